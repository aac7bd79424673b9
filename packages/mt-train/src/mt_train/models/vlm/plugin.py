"""The built-in vision-language family as a plugin (``mt_register_model_families``), the same
hook a third-party family implements; its modules are imported only when first asked for."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mt_core import Registry, hookimpl

if TYPE_CHECKING:
    from mt_train.models.family import ModelFamily


def vlm_family() -> ModelFamily:
    """The :class:`~mt_train.models.ModelFamily` of the LLaVA-style vision-language models."""
    from mt_train.models.family import ModelFamily
    from mt_train.models.vlm.config import VLMConfig
    from mt_train.models.vlm.hf import LlavaHF
    from mt_train.models.vlm.model import (
        VisionLanguageModel,
        embedding_parameters,
        flops_per_token,
    )
    from mt_train.models.vlm.parallelize import vlm_plan
    from mt_train.models.vlm.sizes import SIZES

    return ModelFamily(
        name="vlm",
        label="LLaVA-style VLM",
        config=VLMConfig,
        build=VisionLanguageModel,
        plan=vlm_plan,
        flops_per_token=flops_per_token,
        embedding_parameters=embedding_parameters,
        sizes=SIZES,
        hf=LlavaHF(),
    )


@hookimpl
def mt_register_model_families(registry: Registry) -> None:
    registry.add("vlm", vlm_family)
