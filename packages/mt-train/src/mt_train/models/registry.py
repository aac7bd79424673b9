"""The registered model families: built-in and third-party, through one hook.

:func:`model_families` asks every plugin's ``mt_register_model_families(registry)`` hook
(:mod:`mt_core.hookspecs`) once, after registering mt-train's built-in family plugins
(:data:`BUILTIN_FAMILY_PLUGINS`, ordinary plugin modules such as
:mod:`mt_train.models.llama.plugin`), and caches the specs until the plugin set changes. A
third-party family is a package with an ``mt`` entry point whose module implements the same hook.
"""

from __future__ import annotations

import functools

from mt_core import Plugins, register_builtin_plugin
from mt_core.plugins import on_plugins_changed
from mt_train.config.schema import ModelConfig
from mt_train.models.family import ModelFamily

BUILTIN_FAMILY_PLUGINS = {
    "mt_train.llama": "mt_train.models.llama.plugin",
    "mt_train.moe": "mt_train.models.moe.plugin",
    "mt_train.deepseek_v3": "mt_train.models.deepseek_v3.plugin",
    "mt_train.vlm": "mt_train.models.vlm.plugin",
}
"""Plugin name -> module of mt-train's built-in model families."""

DEFAULT_FAMILY = "llama"
"""The family of checkpoints written before manifests named one."""


@functools.cache
def model_families() -> dict[str, ModelFamily]:
    """Every registered family by name (module docstring)."""
    for name, module in BUILTIN_FAMILY_PLUGINS.items():
        register_builtin_plugin(name, module)
    registry = Plugins().register_model_families()
    families = {}
    for entry in registry:
        family = entry.factory()
        if not isinstance(family, ModelFamily) or family.name != entry.name:
            raise TypeError(
                f"model family {entry.name!r}: its factory must return a ModelFamily named "
                f"{entry.name!r}, got {family!r}"
            )
        families[entry.name] = family
    return families


on_plugins_changed(model_families.cache_clear)


def get_family(name: str) -> ModelFamily:
    """The family called ``name``; an unknown name lists the registered ones."""
    families = model_families()
    if name not in families:
        raise KeyError(
            f"unknown model family {name!r}; registered: {', '.join(sorted(families)) or '(none)'}"
        )
    return families[name]


def family_of(cfg: ModelConfig) -> ModelFamily:
    """The family whose config class ``cfg`` is an instance of (the most derived match)."""
    matches = [f for f in model_families().values() if isinstance(cfg, f.config)]
    if not matches:
        raise TypeError(
            f"no registered model family has the config class {type(cfg).__name__}; "
            f"registered: {', '.join(sorted(model_families()))}"
        )
    return max(matches, key=lambda f: len(f.config.__mro__))


def model_sizes() -> dict[str, ModelConfig]:
    """Every family's named sizes (``model=<name>``); two families may not share a name."""
    sizes: dict[str, ModelConfig] = {}
    owner: dict[str, str] = {}
    for family in model_families().values():
        for size, cfg in family.sizes.items():
            if size in sizes:
                raise ValueError(
                    f"model size {size!r} is defined by the families {owner[size]!r} and "
                    f"{family.name!r}; size names must be unique"
                )
            sizes[size], owner[size] = cfg, family.name
    return sizes
