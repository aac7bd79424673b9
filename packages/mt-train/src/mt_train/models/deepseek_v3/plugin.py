"""The built-in DeepSeek-V3 family as a plugin, registered through
``mt_register_model_families`` like Llama and MoE."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mt_core import Registry, hookimpl

if TYPE_CHECKING:
    from mt_train.models.family import ModelFamily


def deepseek_v3_family() -> ModelFamily:
    """The :class:`~mt_train.models.ModelFamily` of the DeepSeek-V2/V3 models."""
    from mt_train.models.deepseek_v3.config import DeepSeekV3Config
    from mt_train.models.deepseek_v3.hf import DeepseekV3HF
    from mt_train.models.deepseek_v3.model import DeepSeekV3, deepseek_plan, flops_per_token
    from mt_train.models.deepseek_v3.sizes import SIZES
    from mt_train.models.family import ModelFamily
    from mt_train.models.llama.model import embedding_parameters

    return ModelFamily(
        name="deepseek_v3",
        label="DeepSeek-V3",
        config=DeepSeekV3Config,
        build=DeepSeekV3,
        plan=deepseek_plan,
        flops_per_token=flops_per_token,
        embedding_parameters=embedding_parameters,
        sizes=SIZES,
        hf=DeepseekV3HF(),
    )


@hookimpl
def mt_register_model_families(registry: Registry) -> None:
    registry.add("deepseek_v3", deepseek_v3_family)
