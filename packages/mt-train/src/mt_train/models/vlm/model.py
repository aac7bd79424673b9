"""The LLaVA-style vision-language model: ViT encoder → projector → Llama decoder.

Shape suffixes: B batch, T sequence, N images in the micro-batch, P the encoder's feature
rows per image, L image tokens per image in the decoder (``P``, or ``(s/r)²`` after a
reduction), E encoder width, K the projector's input width (``E``, or ``r²·E`` after a pixel
shuffle), D decoder width, V vocabulary (``V_l`` the local slice under TP).

Math::

    f_NPE = vision(images_NCHW)                                  (:mod:`.vision`)
    t_NLK = reduce(f_NPE)                                        optional, below
    g_NLD = linear_2(gelu(linear_1(t_NLK)))                      projector (LLaVA-1.5)
    x_BTD = embed(tokens_BT);  x[tokens == image_token_id] = g   (row-major order)
    logits = output(norm(blocks(x)))                             the Llama decoder

Token reduction (``model.projector_reduction``, :func:`reduce_patch_grid`). The features are
the ``s×s`` patch grid in row-major order (``f[n, i·s + j]`` the patch at row ``i``, column
``j``; ``s = image_size / patch_size``, a multiple of ``r``); output token ``I·(s/r) + J``
covers the patches ``(I·r + a, J·r + b)`` for ``a, b < r``::

    pixel_shuffle:  t[n, I·(s/r) + J, (a·r + b)·E + e] = f[n, (I·r + a)·s + J·r + b, e]
    avg_pool:       t[n, I·(s/r) + J, e] = mean over a, b < r of f[n, (I·r + a)·s + J·r + b, e]

so the neighbourhood's patches enter the shuffled token in row-major order, each its ``E``
features: the order of Idefics3's and InternVL's ``pixel_shuffle`` (transformers' modules;
InternVL also normalises the shuffled features before its projector, ours is LLaVA's two
linears). ``r = 1`` changes nothing. The class token is no cell of the grid, so the config
refuses a reduction with ``feature_select=all``. The reduction is parameter-free and runs in
:class:`Projector`, on every image's whole features: they are replicated over tp (the
encoder's row-parallel outputs are all-reduced), so under TP, SP and CP it runs on every
rank as on one process, and ``linear_1`` stays column-parallel with its input dim ``K``
whole (the FP8 rule, both dims divisible by 16 or the recipe's block, holds for ``r²·E``
whenever it holds for ``E``; a layer that misses it stays high precision, with mt-parallel's
warning). A micro-batch's ``R = N·L`` feature rows are the reduced tokens.

Images are placed at their placeholders: the input ids hold ``L`` copies of
``image_token_id`` per image (``mt-prepare-data``'s image-text format, or the Hugging Face
LLaVA processor), and the ``k``-th image of the micro-batch (samples in order, a sample's
images in text order) fills the ``k``-th run of ``L`` placeholders, so a sample may have any
number of images. The counts must agree (the error says both), except that a batch padded to
a fixed image count (``trainer.cuda_graph``, :mod:`mt_train.data.image_text`) may carry
trailing images no placeholder takes (:meth:`ImagePlacement.set_image_padding`). Placeholder
rows of the embedding are overwritten, never read.

Loss: next-token cross-entropy only where the target is not ``IGNORE_INDEX`` (the data
masks image and prompt tokens and the padding); the mean is over the micro-batch's unmasked
targets (under CP: ``cp·Σ_local / count_cp``, whose mean over the cp ranks is that mean). :meth:`VisionLanguageModel.loss` also reports the micro-batch's masked and trained
target counts (``masked_tokens``, ``loss_tokens``), which the trainer logs.

Packed samples (``data.pack_samples``, :mod:`mt_train.data.image_text`): a row holds several
samples, told apart by the batch's document ids ``doc_BT``. Attention stays inside each sample
(the decoder's document masks) and :meth:`VisionLanguageModel.sequence_inputs` restarts the
RoPE positions at each sample::

    pos[b, t] = t − min{u : doc[b, u'] = doc[b, t] for all u ≤ u' ≤ t}

so every sample sees the positions ``0, 1, ...`` it has alone in a row (the attention scores
only depend on position differences inside a sample, so this changes the scores by rounding
only, and makes a packed sample's RoPE tables those of the same sample unpacked). They are
computed on the whole row and, under CP, cut like the tokens, while ``positions_S`` keeps the
tokens' places in the row (which :class:`ImagePlacement` numbers placeholders by). The images
of a packed row are its samples' in order, so the row-major placement fills each sample's
placeholders with its own images, whatever the number per row.

Sequence and context parallelism (the decoder's; the image tower stays replicated). Image
features go to rows ``q`` of ``g_RD`` (``R = N·L``, the flattened features) by
:meth:`ImagePlacement.image_slots`: ``q`` is the placeholder's row-major ordinal in the
whole micro-batch, -1 for text. Under CP (``parallel.cp > 1``) a rank holds its load-balanced
chunks (at ``positions_S``), so it all-gathers the cp ranks' placeholder masks (``B×T``
integers) to number its own placeholders; every rank runs the encoder and projector on *all*
images of the micro-batch and places the rows that fall in its chunks (the encoder's compute
is repeated on each of the ``cp`` ranks; docs/architecture.md gives its FLOP share). Under SP (``parallel.tp > 1`` with
``sequence_parallel``) the embedding comes out sequence-sharded; each TP rank places the
rows of its shard, and ``g`` passes through ``copy_to_group`` (identity forward, all-reduce
backward) so every rank's encoder sees the features' whole gradient, as under plain TP. The
encoder and projector linears stay plain TP under SP (the plan's ``sequence_parallel_skip``).
Each cp rank's gradient covers the paths through its own chunks' features (other ranks'
losses reach them through the attention's K/V backward), so their sum over cp, which DDP /
FSDP2 / ZeRO-1 average over dp×cp, is the whole sequence's gradient.

Pipeline parallelism (``parallel.pp > 1``, as Megatron-LM's LLaVA): the encoder, the
projector and the placement run on the first chunk with the embedding and its blocks
(:mod:`mt_train.models.vlm.parallelize` declares them in the plan's ``PipelineLayout``, with
:func:`embed_with_images` as the first chunk's input function); only the images of a
micro-batch are an extra input, read there, and every later stage receives the hidden
states ``[B, T, D]`` (``T/tp`` under SP) of the merged sequence, the static shape a text model
passes. The last chunk holds the head and :class:`CaptionLoss`. The two parameter-free modules
(:class:`ImagePlacement`, :class:`CaptionLoss`) hold the groups their hooks receive, so each
chunk's own transforms set them; neither adds a state-dict key.

Freezing (``model.freeze``): ``encoder`` (LLaVA's stage 2) or ``encoder_and_decoder``
(stage 1, only the projector trains) sets ``requires_grad=False``, which the optimizer and
the gradient norm skip.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

import mt_comm
import mt_parallel
from mt_train.models.llama.model import Llama
from mt_train.models.llama.model import flops_per_token as llama_flops
from mt_train.models.vlm.config import VLMConfig
from mt_train.models.vlm.vision import VisionTransformer, vision_flops_per_image

IGNORE_INDEX = -100
"""Targets that carry no loss (image tokens, prompts, padding)."""


def reduce_patch_grid(f_NPE: torch.Tensor, reduction: str, r: int) -> torch.Tensor:
    """The token reduction of the module docstring: features ``(N, s², E)`` of a row-major
    ``s×s`` patch grid become ``(N, (s/r)², r²·E)`` (``pixel_shuffle``) or ``(N, (s/r)², E)``
    (``avg_pool``); ``none`` returns them as they are."""
    if reduction == "none":
        return f_NPE
    if reduction not in ("pixel_shuffle", "avg_pool"):
        raise ValueError(f"reduction={reduction!r}; valid: none, pixel_shuffle, avg_pool")
    N, P, E = f_NPE.shape
    s = math.isqrt(P)
    if s * s != P or s % r:
        raise ValueError(
            f"{reduction} with r={r} needs a square patch grid whose side r divides, got {P} "
            "feature rows per image"
        )
    # Split rows and columns into (cell, offset): f_NIaJbE[n, I, a, J, b] is patch (I·r+a, J·r+b).
    f_NIaJbE = f_NPE.reshape(N, s // r, r, s // r, r, E)
    if reduction == "avg_pool":
        return f_NIaJbE.mean(dim=(2, 4)).reshape(N, (s // r) ** 2, E)
    return f_NIaJbE.permute(0, 1, 3, 2, 4, 5).reshape(N, (s // r) ** 2, r * r * E)


class Projector(nn.Module):
    """LLaVA-1.5's projector: ``linear_2(gelu(linear_1(t)))``, column- then row-parallel, on the
    features ``t`` after the optional token reduction (module docstring)."""

    def __init__(
        self,
        vision_dim: int,
        dim: int,
        bias: bool,
        init_std: float,
        reduction: str = "none",
        factor: int = 1,
    ) -> None:
        super().__init__()
        self.reduction, self.factor = reduction, factor
        in_dim = vision_dim * (factor * factor if reduction == "pixel_shuffle" else 1)
        self.linear_1 = mt_parallel.ColumnParallelLinear(in_dim, dim, bias, init_std=init_std)
        self.linear_2 = mt_parallel.RowParallelLinear(dim, dim, bias, init_std=init_std)

    def forward(self, f_NPE: torch.Tensor) -> torch.Tensor:
        t_NLK = reduce_patch_grid(f_NPE, self.reduction, self.factor)
        return self.linear_2(torch.nn.functional.gelu(self.linear_1(t_NLK)))


def _placeholders_fit(found: int, n_images: int, per_image: int, padded: bool) -> bool:
    """``found`` placeholders take whole images: all ``n_images``, or with trailing padding
    images a leading part of them."""
    if padded:
        return found % per_image == 0 and found <= n_images * per_image
    return found == n_images * per_image


class ImagePlacement(nn.Module):
    """Writes the projected image features over their placeholders (module docstring); holds
    no parameters, only the groups its hooks receive, so it can sit on the first pipeline chunk
    with the encoder."""

    def __init__(self, image_token_id: int, tokens_per_image: int) -> None:
        super().__init__()
        self.image_token_id, self.tokens_per_image = image_token_id, tokens_per_image
        self.tp_group: Any = None
        """The TP group when sequence parallel is on (set by the TP transform)."""
        self.cp_group: Any = None
        """The cp group under context parallelism (set by the CP transform)."""
        self.padded_images = False
        """Batches may end with images no placeholder takes (set by the trainer)."""

    def set_image_padding(self, padded: bool) -> None:
        """Hook of the trainer: its batches carry a fixed image count, padded at the end."""
        self.padded_images = padded

    def set_tensor_parallel(self, tp_group: Any, sequence_parallel: bool) -> None:
        """Hook of the TP transform: under SP each rank merges the features of its shard."""
        self.tp_group = tp_group if sequence_parallel else None

    def set_context_parallel(self, cp_group: Any, ring: bool) -> None:
        """Hook of the CP transform: the placeholders are numbered over the cp group."""
        self.cp_group = cp_group

    def image_slots(
        self, tokens_BT: torch.Tensor, positions_S: torch.Tensor | None, n_images: int
    ) -> torch.Tensor:
        """Each token's row of the flattened image features ``(N·L, D)``, -1 for text tokens.

        Rows follow the placeholders' row-major order in the *whole* sequence; under CP this
        rank's tokens sit at ``positions_S`` (by default the load-balanced chunks), so the cp
        ranks' placeholder masks are gathered (a ``(B, T)`` integer all-gather) to count the
        placeholders before each of its tokens. Checks the count against the images.
        """
        placeholders_BT = tokens_BT == self.image_token_id
        full_BT = placeholders_BT.long()
        cp = 1 if self.cp_group is None else mt_comm.group_size(self.cp_group)
        if cp > 1:
            seq_len = tokens_BT.shape[1] * cp
            if positions_S is None:
                rank = mt_comm.group_rank(self.cp_group)
                positions_S = mt_parallel.load_balanced_positions(seq_len, cp, rank)
            positions_S = positions_S.to(tokens_BT.device)
            gathered_BT = mt_comm.all_gather(full_BT, dim=1, group=self.cp_group)
            gathered_S = mt_comm.all_gather(positions_S.long(), dim=0, group=self.cp_group)
            full_BT = torch.zeros_like(gathered_BT)
            full_BT[:, gathered_S] = gathered_BT
        per_image, padding = self.tokens_per_image, self.padded_images
        # The count is read on the host except while a CUDA graph captures the step (a read
        # would end the capture); the eager steps before the capture check it.
        capturing = tokens_BT.is_cuda and torch.cuda.is_current_stream_capturing()
        found = None if capturing else int(full_BT.sum())
        if found is not None and not _placeholders_fit(found, n_images, per_image, padding):
            images = f"at most {n_images}" if padding else str(n_images)
            raise ValueError(
                f"the batch has {found} image placeholder tokens (id {self.image_token_id}) "
                f"for {images} images of {per_image} tokens each (model.vision and "
                f"model.projector_reduction give {per_image} per image; prepare the data with "
                "that many)"
            )
        rows_BT = full_BT.flatten().cumsum(0).view_as(full_BT) - 1
        if cp > 1:
            rows_BT = rows_BT[:, positions_S]
        return torch.where(placeholders_BT, rows_BT, -1)

    def forward(
        self,
        x_BTD: torch.Tensor,
        tokens_BT: torch.Tensor,
        g_RD: torch.Tensor | None,
        positions_S: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x_BTD`` (this rank's sequence shard under SP) with the feature rows ``g_RD``
        (None: no image) written at their placeholders."""
        n_images = 0 if g_RD is None else g_RD.shape[0] // self.tokens_per_image
        slots_BT = self.image_slots(tokens_BT, positions_S, n_images)
        if g_RD is None:
            return x_BTD
        if self.tp_group is not None:
            # The features are replicated over tp; each rank places only those of its sequence
            # shard, so their gradient is summed over tp (copy: identity, all-reduce backward).
            shard = x_BTD.shape[1]
            start = mt_comm.group_rank(self.tp_group) * shard
            slots_BT = slots_BT[:, start : start + shard]
            g_RD = mt_parallel.copy_to_group(g_RD, self.tp_group)
        # A gather at every token and a select, not boolean indexing: no shape depends on the
        # data, so nothing synchronises with the host (a captured step needs that).
        image_BT1 = (slots_BT >= 0).unsqueeze(-1)
        g_BTD = g_RD[slots_BT.clamp(min=0)].to(x_BTD.dtype)
        return torch.where(image_BT1, g_BTD, x_BTD)


class CaptionLoss(mt_parallel.SequenceCrossEntropy):
    """The masked-mean cross-entropy of :meth:`VisionLanguageModel.loss`, with the counts it
    logs (parameter-free, on the last pipeline chunk with the head)."""

    def __init__(self) -> None:
        super().__init__(IGNORE_INDEX)

    def forward(  # type: ignore[override]
        self, logits_BTV_l: torch.Tensor, targets_BT: torch.Tensor, tp_group: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cp = 1 if self.cp_group is None else mt_comm.group_size(self.cp_group)
        result = super().forward(logits_BTV_l, targets_BT, tp_group)
        trained = result.count.float()
        masked = targets_BT.numel() * cp - trained
        return result.loss, {"masked_tokens": masked, "loss_tokens": trained}


def embed_with_images(
    tree: nn.Module,
    tokens_BT: torch.Tensor,
    positions_S: torch.Tensor | None = None,
    images: torch.Tensor | None = None,
) -> torch.Tensor:
    """Token embeddings with the projected image features at the placeholders, computed by
    the modules of ``tree`` at the model's names (``language.embed``, ``vision``,
    ``projector``, ``image_placement``): the whole model, or its first pipeline chunk."""
    x_BTD = tree.language.embed(tokens_BT)
    g_RD = None
    if images is not None and images.shape[0] > 0:
        g_RD = tree.projector(tree.vision(images)).flatten(0, 1)
    return tree.image_placement(x_BTD, tokens_BT, g_RD, positions_S)


class VisionLanguageModel(nn.Module):
    """``forward(tokens_BT, positions_S, document_ids_BT, images=None)`` (module docstring)."""

    def __init__(self, cfg: VLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.vision = VisionTransformer(cfg.vision, cfg.init_std)
        self.projector = Projector(
            cfg.vision.dim,
            cfg.dim,
            cfg.projector_bias,
            cfg.init_std,
            cfg.projector_reduction,
            cfg.projector_reduction_factor,
        )
        self.language = Llama(cfg)
        self.image_placement = ImagePlacement(cfg.image_token_id, cfg.image_tokens)
        self.caption_loss = CaptionLoss()
        if cfg.freeze != "none":
            self.vision.requires_grad_(False)
        if cfg.freeze == "encoder_and_decoder":
            self.language.requires_grad_(False)

    def embed(
        self,
        tokens_BT: torch.Tensor,
        images_NCHW: torch.Tensor | None,
        positions_S: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token embeddings with the projected image features at the placeholders (this
        rank's sequence shard under SP: its slice of :meth:`ImagePlacement.image_slots`)."""
        return embed_with_images(self, tokens_BT, positions_S, images_NCHW)

    def sequence_inputs(
        self,
        tokens_BT: torch.Tensor,
        targets_BT: torch.Tensor,
        document_ids_BT: torch.Tensor | None,
    ) -> dict[str, torch.Tensor]:
        """The trainer's hook for inputs computed on the whole row (cut like the tokens under
        CP): with document ids (packed samples), ``sample_positions``, the RoPE positions
        restarting at each sample (module docstring)."""
        if document_ids_BT is None:
            return {}
        return {"sample_positions": positions_within_documents(document_ids_BT)}

    def forward(
        self,
        tokens_BT: torch.Tensor,
        positions_S: torch.Tensor | None = None,
        document_ids_BT: torch.Tensor | None = None,
        images: torch.Tensor | None = None,
        sample_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``(B, T, V_l)``; ``images`` ``(N, C, H, W)`` fill the placeholders in order;
        ``sample_positions`` ``(B, T)`` (packed samples) are the decoder's RoPE positions
        instead of ``positions_S``."""
        x_BTD = self.embed(tokens_BT, images, positions_S)
        rope_positions = positions_S if sample_positions is None else sample_positions
        for layer in self.language.layers:
            x_BTD = layer(x_BTD, rope_positions, document_ids_BT)
        return self.language.output(self.language.norm(x_BTD))

    def loss(
        self, logits_BTV_l: torch.Tensor, targets_BT: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Mean cross-entropy over unmasked targets, and the masked/trained counts.

        Under CP the counts are the cp group's and the loss is ``cp·Σ_local / count``
        (``mt_parallel.sequence_mean_cross_entropy``): the cp ranks' chunks hold different
        numbers of unmasked targets, so a per-rank mean averaged over cp would weight them
        unequally; this one averages to the whole sequence's mean.
        """
        return self.caption_loss(logits_BTV_l, targets_BT, self.language.output.tp_group)


def positions_within_documents(document_ids_BT: torch.Tensor) -> torch.Tensor:
    """Each token's offset from the start of its run of equal document ids (module
    docstring's ``pos``)."""
    T = document_ids_BT.shape[1]
    t_BT = torch.arange(T, device=document_ids_BT.device).expand_as(document_ids_BT)
    starts_BT = torch.ones_like(document_ids_BT, dtype=torch.bool)
    starts_BT[:, 1:] = document_ids_BT[:, 1:] != document_ids_BT[:, :-1]
    return t_BT - torch.where(starts_BT, t_BT, 0).cummax(dim=1).values


def embedding_parameters(model: nn.Module) -> int:
    """The decoder's input embedding (a lookup, not a GEMM: excluded from ``6·N``)."""
    return model.language.embed.weight.numel() if isinstance(model, VisionLanguageModel) else 0


def image_flops_per_token(cfg: VLMConfig) -> float:
    """Training FLOPs of the image path per image token of the decoder: the encoder's per
    image spread over the image's ``L`` tokens, plus the projector's ``6·(K·D + D·D)`` (``K``
    the first linear's input width, ``r²·E`` after a pixel shuffle; the reduction itself is
    no GEMM and not counted)."""
    projector = 6.0 * (cfg.projector_in_dim * cfg.dim + cfg.dim * cfg.dim)
    return vision_flops_per_image(cfg.vision) / cfg.image_tokens + projector


def flops_per_token(cfg: VLMConfig, seq_len: int) -> float:
    """The decoder's FLOPs per token (:func:`mt_train.models.llama.flops_per_token`) plus the
    image path's per image token (:func:`image_flops_per_token`)."""
    return llama_flops(cfg, seq_len) + image_flops_per_token(cfg)
