"""``convert_to_fp8``: swap a model's ``nn.Linear`` layers for :class:`~mt_fp8.FP8Linear`.

A transform, not an edit of model code (torchtitan's order: tensor parallel → FP8 → recompute →
compile → data parallel). The new layers share the old ones' ``Parameter`` objects, so an
optimizer built before the swap keeps working and the state-dict keys ``weight``/``bias`` are
unchanged. A layer is skipped, with the reason logged on the ``mt_fp8`` logger, when
``module_filter`` rejects it or its dimensions cannot run in FP8 (FP8 GEMMs need both dims
divisible by 16, and by the recipe's block size).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch import nn

from mt_fp8.linear import FP8Linear
from mt_fp8.linear_plan import check_dims
from mt_fp8.recipes import Recipe

logger = logging.getLogger("mt_fp8")


def convert_to_fp8(
    model: nn.Module,
    recipe: Recipe,
    module_filter: Callable[[str, nn.Linear], bool] | None = None,
    backend: str = "auto",
    track_health: bool = True,
) -> list[str]:
    """Replace eligible ``nn.Linear`` modules of ``model`` in place; returns the converted names.

    ``module_filter(name, linear)`` returns False to keep a layer in high precision (e.g. the
    output projection, or layers too small for FP8 to pay).
    """
    if type(model) is nn.Linear:
        raise ValueError(
            "convert_to_fp8 swaps submodules in place; wrap a bare nn.Linear in a parent module"
        )
    converted = []
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear:
            continue
        if module_filter is not None and not module_filter(name, module):
            logger.info("convert_to_fp8: keeping %s in high precision (module_filter)", name)
            continue
        reason = check_dims(recipe, module.in_features, module.out_features)
        if reason is not None:
            logger.info("convert_to_fp8: keeping %s in high precision: %s", name, reason)
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        layer = FP8Linear.from_linear(
            module, recipe=recipe, backend=backend, track_health=track_health
        )
        layer.train(module.training)
        setattr(parent, child, layer)
        converted.append(name)
    return converted
