"""What a model family gives mt-train: one :class:`ModelFamily` spec, registered through the
``mt_register_model_families`` hook (:mod:`mt_core.hookspecs`).

A family is one folder (``mt_train/models/llama/`` for the built-in one) holding its config
dataclass, its model, its parallelize plan, its named sizes and, if it has one, its Hugging Face
adapter. The trainer, the checkpoints and ``mt-convert`` use only this spec, so a new family
(an MoE, a vision-language model) adds a folder and one registration and touches nothing else.

The model a family builds is a plain (tp=1) ``nn.Module`` with::

    logits_BTV_l = model(tokens_BT, positions_S, document_ids_BT)
    loss = model.loss(logits_BTV_l, targets_BT)          # a 0-d fp32 tensor, or
    loss, extras = model.loss(logits_BTV_l, targets_BT)  # plus named 0-d tensors to log

``loss`` is what the backward runs on (an MoE family folds its auxiliary loss in); each tensor
in ``extras`` (an auxiliary loss, a load-balance statistic) is averaged over the step's
micro-batches and logged under its name, read in the step's one host synchronisation. Its
layers are mt-parallel's (or carry the same hooks), so ``plan`` is all
:func:`mt_parallel.parallelize` needs. Optional model hooks the trainer calls:
``set_train_step(completed_steps) -> changed`` before every step, and
``sequence_inputs(tokens_BT, targets_BT, document_ids_BT) -> {name: (B, T, ...)}``, keyword
inputs of ``forward`` made from the whole micro-batch and, under context parallelism, cut
like the tokens (DeepSeek-V3's shifted MTP tokens and targets, the VLM's per-sample RoPE
positions of packed rows; :mod:`mt_train.step`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mt_parallel import ParallelizePlan
from mt_train.config.schema import ModelConfig

_LAYER_NAME = re.compile(r"^(.*?layers)\.(\d+)\.")
"""``<stem>.layers.<i>.<rest>``: a name inside decoder (or encoder) layer ``i``."""
GroupKey = tuple[str, int, str]
"""Where :func:`layer_groups` puts a name: (layer stem, layer index, part of the layer)."""


def layer_key(name: str) -> GroupKey | None:
    """The group of a name inside a ``…layers.<i>.`` layer (its stem and index), or None."""
    match = _LAYER_NAME.match(name)
    return None if match is None else (match.group(1), int(match.group(2)), "")


def layer_groups(
    names: Iterable[str], key: Callable[[str], GroupKey | None] = layer_key
) -> list[list[str]]:
    """``names`` grouped by ``key``: first every name whose key is None (embeddings, final
    norm, head), then one group per key in (stem, layer index, part) order, each sorted."""
    groups: dict[GroupKey | None, list[str]] = {}
    for name in names:
        groups.setdefault(key(name), []).append(name)
    order = sorted(k for k in groups if k is not None)
    head = [sorted(groups[None])] if None in groups else []
    return head + [sorted(groups[k]) for k in order]


class HFAdapter:
    """Converts a family's checkpoints to and from Hugging Face's layout (``mt-convert``).

    ``architectures`` are the ``config.json`` ``architectures`` entries it reads (``model_types``
    the ``model_type`` values, for configs saved without architectures); the rest are the
    conversions, each of which raises ``ValueError`` with one line naming what it cannot
    represent.
    """

    architectures: tuple[str, ...] = ()
    model_types: tuple[str, ...] = ()
    float32_names: tuple[str, ...] = ()
    """Endings of the Hugging Face tensor names the HF model holds in float32 whatever its
    ``torch_dtype`` (transformers' ``_keep_in_fp32_modules_strict``): export writes these
    float32 beside weights of another dtype instead of upcasting every weight
    (:func:`mt_train.hf_checkpoints.export_dtypes`)."""

    def import_view(
        self, hf: dict[str, Any], names: set[str], mtp_depth: int | None
    ) -> tuple[dict[str, Any], str | None]:
        """``config.json`` as the import reads it, given the checkpoint's tensor ``names`` and
        the multi-token-prediction depth asked for (None: what the checkpoint holds), and a
        line to tell the user (or None). Families without MTP refuse a depth above 0."""
        if mtp_depth:
            raise ValueError(
                f"--mtp-depth={mtp_depth}: architectures={hf.get('architectures')} have no "
                "multi-token-prediction layers (valid: 0 or unset)"
            )
        return hf, None

    def export_view(
        self, cfg: Any, names: Collection[str], mtp_depth: int | None
    ) -> tuple[Any, Collection[str]]:
        """The config export writes with ``mtp_depth`` multi-token-prediction modules (None:
        all the model has) and the names of the model's (tp=1) tensors it reads for it.
        Families without MTP refuse a depth above 0."""
        if mtp_depth:
            raise ValueError(
                f"--mtp-depth={mtp_depth}: model {cfg.name!r} has no multi-token-prediction "
                "modules (valid: 0 or unset)"
            )
        return cfg, names

    def config_from_hf(self, hf: dict[str, Any], name: str) -> ModelConfig:
        """The family's config of a Hugging Face ``config.json``; refuses what it cannot build."""
        raise NotImplementedError

    def config_to_hf(self, cfg: Any, dtype: torch.dtype) -> dict[str, Any]:
        """The ``config.json`` of ``cfg``, whose tensors are written in ``dtype``."""
        raise NotImplementedError

    def import_groups(self, names: Collection[str], hf: dict[str, Any]) -> list[list[str]]:
        """The checkpoint's tensor ``names`` (after :meth:`import_view`) in the groups
        ``mt-convert import`` reads and converts one at a time, so host memory holds one group.
        Contract: :meth:`tensors_from_hf` of each group gives disjoint mt tensors whose union
        is :meth:`tensors_from_hf` of all ``names``; a name in no group is not read (only
        names that conversion ignores may be left out). The default, one group of every name,
        holds the whole model in memory: a family overrides it only where its conversion
        splits (the built-in ones by decoder layer, :func:`layer_groups`)."""
        return [list(names)]

    def tensors_from_hf(
        self, tensors: dict[str, torch.Tensor], hf: dict[str, Any]
    ) -> dict[str, torch.Tensor]:
        """Hugging Face tensors (by HF name) as the family's state dict (by mt name): the
        whole checkpoint, or one of :meth:`import_groups`' groups."""
        raise NotImplementedError

    def export_groups(self, names: Collection[str], cfg: Any) -> list[list[str]]:
        """The model's tensor ``names`` (after :meth:`export_view`) in the groups ``mt-convert
        export`` reads and converts one at a time: :meth:`import_groups`' contract with the
        directions swapped (each group's :meth:`tensors_to_hf` gives disjoint Hugging Face
        tensors whose union is that of all ``names``). The default, one group, holds the
        whole model in memory; the built-in families split by layer (:func:`layer_groups` of
        mt names) and routed experts by projection."""
        return [sorted(names)]

    def tensors_to_hf(self, tensors: dict[str, torch.Tensor], cfg: Any) -> dict[str, torch.Tensor]:
        """The family's (tp=1) tensors of config ``cfg`` (the whole state dict, or one of
        :meth:`export_groups`' groups) as Hugging Face tensors. Export first calls it on meta
        tensors (dtype and shape only) to plan its files: a conversion renames, splits and
        permutes, and checks values only of tensors that are not meta."""
        raise NotImplementedError


@dataclass(frozen=True)
class ModelFamily:
    """One model family (module docstring)."""

    name: str
    """Registry name (``llama``); recorded in checkpoint manifests."""
    label: str
    """What logs call a model of this family (``Llama``)."""
    config: type[ModelConfig]
    """The ``model`` group's schema for this family's sizes."""
    build: Callable[[Any], nn.Module]
    """The plain tp=1 model of a config (vocabulary resolved), on the current default device."""
    plan: Callable[[Any], ParallelizePlan]
    """Its :class:`mt_parallel.ParallelizePlan` (block types, output head, FP8 exclusions)."""
    flops_per_token: Callable[[Any, int], float]
    """Training FLOPs per token of a config at a sequence length (for MFU)."""
    embedding_parameters: Callable[[nn.Module], int]
    """How many of a model's parameters are embedding lookups (excluded from ``6·N``)."""
    sizes: Mapping[str, Any] = field(default_factory=dict)
    """Named configs: the ``model=<name>`` options (``model=debug``, ``model=llama3_8b``)."""
    hf: HFAdapter | None = None
    """Hugging Face import/export, or None when the family has no HF counterpart."""

    def num_params(self, model: nn.Module, exclude_embedding: bool = False) -> int:
        """Parameters of ``model`` (without the embedding lookups if asked)."""
        total = sum(p.numel() for p in model.parameters())
        return total - self.embedding_parameters(model) if exclude_embedding else total
