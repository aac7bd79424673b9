"""The built-in Llama family as a plugin: registered through ``mt_register_model_families``,
the same hook a third-party family implements (:mod:`mt_core.hookspecs`).

The factory imports the family's modules only when mt-train first asks for the families.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mt_core import Registry, hookimpl

if TYPE_CHECKING:
    from mt_train.models.family import ModelFamily


def llama_family() -> ModelFamily:
    """The :class:`~mt_train.models.ModelFamily` of the Llama 3 models."""
    from mt_train.models.family import ModelFamily
    from mt_train.models.llama.config import LlamaConfig
    from mt_train.models.llama.hf import LlamaHF
    from mt_train.models.llama.model import Llama, embedding_parameters, flops_per_token
    from mt_train.models.llama.parallelize import llama_plan
    from mt_train.models.llama.sizes import SIZES

    return ModelFamily(
        name="llama",
        label="Llama",
        config=LlamaConfig,
        build=Llama,
        plan=llama_plan,
        flops_per_token=flops_per_token,
        embedding_parameters=embedding_parameters,
        sizes=SIZES,
        hf=LlamaHF(),
    )


@hookimpl
def mt_register_model_families(registry: Registry) -> None:
    registry.add("llama", llama_family)
