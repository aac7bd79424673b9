"""The built-in MoE family as a plugin, registered through ``mt_register_model_families`` like
Llama (:mod:`mt_train.models.llama.plugin`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mt_core import Registry, hookimpl

if TYPE_CHECKING:
    from mt_train.models.family import ModelFamily


def moe_family() -> ModelFamily:
    """The :class:`~mt_train.models.ModelFamily` of the Mixtral / DeepSeek-MoE-style models."""
    from mt_train.models.family import ModelFamily
    from mt_train.models.llama.model import embedding_parameters
    from mt_train.models.moe.config import MoEModelConfig
    from mt_train.models.moe.hf import MixtralHF
    from mt_train.models.moe.model import MoETransformer, flops_per_token
    from mt_train.models.moe.parallelize import moe_plan
    from mt_train.models.moe.sizes import SIZES

    return ModelFamily(
        name="moe",
        label="MoE",
        config=MoEModelConfig,
        build=MoETransformer,
        plan=moe_plan,
        flops_per_token=flops_per_token,
        embedding_parameters=embedding_parameters,
        sizes=SIZES,
        hf=MixtralHF(),
    )


@hookimpl
def mt_register_model_families(registry: Registry) -> None:
    registry.add("moe", moe_family)
