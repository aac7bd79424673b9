"""Registers the schemas in Hydra's ConfigStore and composes configs outside ``@hydra.main``.

``train.yaml``'s defaults list starts with ``train_schema`` (:class:`TrainConfig`), so every
group file merges into a typed node: a misspelt key or a wrong type fails while composing.
The ``model`` group's options are the registered model families' named sizes
(:func:`mt_train.models.model_sizes`), stored here as typed nodes of their family's config
dataclass: ``model=llama3_8b`` selects one, ``model.dim=...`` overrides its keys.
:func:`to_train_config` then builds the dataclasses, which runs their ``__post_init__``
validation (values, and rules across groups).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from mt_train.config.schema import TrainConfig
from mt_train.models.registry import model_sizes

CONFIG_MODULE = "mt_train.conf"
CONFIG_NAME = "train"


_stored_sizes: dict[str, object] | None = None
"""The model sizes :func:`register_configs` stored last (storing converts every dataclass into
an OmegaConf node, about 0.4 s: done again only when the registered sizes change)."""


def register_configs() -> None:
    """Store ``train_schema`` and every registered model size (idempotent)."""
    global _stored_sizes
    store = ConfigStore.instance()
    sizes = model_sizes()
    if sizes == _stored_sizes and "train_schema.yaml" in store.repo and "model" in store.repo:
        return
    store.store(name="train_schema", node=TrainConfig)
    store.repo.pop("model", None)  # exactly the sizes of the families registered now
    for name, cfg in sizes.items():
        store.store(group="model", name=name, node=cfg)
    _stored_sizes = copy.deepcopy(sizes)  # a caller mutating a size must not match it


def compose_config(overrides: Sequence[str] = (), with_hydra: bool = False) -> DictConfig:
    """Compose ``train.yaml`` with ``overrides`` as the CLI would (no run directory made);
    ``with_hydra``: keep Hydra's own section (``hydra.run.dir`` and the like)."""
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        return compose(
            config_name=CONFIG_NAME, overrides=list(overrides), return_hydra_config=with_hydra
        )


def to_train_config(cfg: DictConfig) -> TrainConfig:
    """The validated :class:`TrainConfig` of a composed config (raises ValueError on bad values)."""
    section = (
        OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]) if "hydra" in cfg else cfg
    )
    obj = OmegaConf.to_object(section)
    if not isinstance(obj, TrainConfig):
        raise TypeError(f"expected a TrainConfig, composed {type(obj).__name__}")
    return obj
