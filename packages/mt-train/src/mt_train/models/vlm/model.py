"""The LLaVA-style vision-language model: ViT encoder → projector → Llama decoder.

Shape suffixes: B batch, T sequence, N images in the micro-batch, L tokens per image, E
encoder width, D decoder width, V vocabulary (``V_l`` the local slice under TP).

Math::

    f_NLE = vision(images_NCHW)                                  (:mod:`.vision`)
    g_NLD = linear_2(gelu(linear_1(f_NLE)))                      projector (LLaVA-1.5)
    x_BTD = embed(tokens_BT);  x[tokens == image_token_id] = g   (row-major order)
    logits = output(norm(blocks(x)))                             the Llama decoder

Images are placed at their placeholders: the input ids hold ``L`` copies of
``image_token_id`` per image (``mt-prepare-data``'s image-text format, or the Hugging Face
LLaVA processor), and the ``k``-th image of the micro-batch (samples in order, a sample's
images in text order) fills the ``k``-th run of ``L`` placeholders, so a sample may have any
number of images. The counts must agree (the error says both). Placeholder rows of the
embedding are overwritten, never read.

Loss: next-token cross-entropy only where the target is not ``IGNORE_INDEX`` (the data
masks image and prompt tokens and the padding); the mean is over this rank's unmasked
targets. :meth:`VisionLanguageModel.loss` also reports the micro-batch's masked and trained
target counts (``masked_tokens``, ``loss_tokens``), which the trainer logs.

Freezing (``model.freeze``): ``encoder`` (LLaVA's stage 2) or ``encoder_and_decoder``
(stage 1, only the projector trains) sets ``requires_grad=False``, which the optimizer and
the gradient norm skip.
"""

from __future__ import annotations

import torch
from torch import nn

import mt_parallel
from mt_train.models.llama.model import Llama
from mt_train.models.llama.model import flops_per_token as llama_flops
from mt_train.models.vlm.config import VLMConfig
from mt_train.models.vlm.vision import VisionTransformer, vision_flops_per_image

IGNORE_INDEX = -100
"""Targets that carry no loss (image tokens, prompts, padding)."""


class Projector(nn.Module):
    """LLaVA-1.5's projector: ``linear_2(gelu(linear_1(f)))``, column- then row-parallel."""

    def __init__(self, vision_dim: int, dim: int, bias: bool, init_std: float) -> None:
        super().__init__()
        self.linear_1 = mt_parallel.ColumnParallelLinear(vision_dim, dim, bias, init_std=init_std)
        self.linear_2 = mt_parallel.RowParallelLinear(dim, dim, bias, init_std=init_std)

    def forward(self, f_NLE: torch.Tensor) -> torch.Tensor:
        return self.linear_2(torch.nn.functional.gelu(self.linear_1(f_NLE)))


class VisionLanguageModel(nn.Module):
    """``forward(tokens_BT, positions_S, document_ids_BT, images=None)`` (module docstring)."""

    def __init__(self, cfg: VLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.vision = VisionTransformer(cfg.vision, cfg.init_std)
        self.projector = Projector(cfg.vision.dim, cfg.dim, cfg.projector_bias, cfg.init_std)
        self.language = Llama(cfg)
        if cfg.freeze != "none":
            self.vision.requires_grad_(False)
        if cfg.freeze == "encoder_and_decoder":
            self.language.requires_grad_(False)

    def embed(self, tokens_BT: torch.Tensor, images_NCHW: torch.Tensor | None) -> torch.Tensor:
        """Token embeddings with the projected image features at the placeholders."""
        x_BTD = self.language.embed(tokens_BT)
        placeholders_BT = tokens_BT == self.cfg.image_token_id
        n_images = 0 if images_NCHW is None else images_NCHW.shape[0]
        per_image = self.cfg.vision.tokens_per_image
        found = int(placeholders_BT.sum())
        if found != n_images * per_image:
            raise ValueError(
                f"the batch has {found} image placeholder tokens (id {self.cfg.image_token_id}) "
                f"for {n_images} images of {per_image} tokens each (model.vision gives "
                f"{per_image} per image; prepare the data with that many)"
            )
        if n_images == 0:
            return x_BTD
        g_NLD = self.projector(self.vision(images_NCHW))
        return x_BTD.masked_scatter(placeholders_BT.unsqueeze(-1), g_NLD.to(x_BTD.dtype))

    def forward(
        self,
        tokens_BT: torch.Tensor,
        positions_S: torch.Tensor | None = None,
        document_ids_BT: torch.Tensor | None = None,
        images: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``(B, T, V_l)``; ``images`` ``(N, C, H, W)`` fill the placeholders in order."""
        x_BTD = self.embed(tokens_BT, images)
        for layer in self.language.layers:
            x_BTD = layer(x_BTD, positions_S, document_ids_BT)
        return self.language.output(self.language.norm(x_BTD))

    def loss(
        self, logits_BTV_l: torch.Tensor, targets_BT: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Mean cross-entropy over unmasked targets, and the masked/trained counts."""
        loss = mt_parallel.vocab_parallel_cross_entropy(
            logits_BTV_l, targets_BT, self.language.output.tp_group, IGNORE_INDEX
        )
        masked = (targets_BT == IGNORE_INDEX).sum().float()
        return loss, {"masked_tokens": masked, "loss_tokens": targets_BT.numel() - masked}


def embedding_parameters(model: nn.Module) -> int:
    """The decoder's input embedding (a lookup, not a GEMM: excluded from ``6·N``)."""
    return model.language.embed.weight.numel() if isinstance(model, VisionLanguageModel) else 0


def flops_per_token(cfg: VLMConfig, seq_len: int) -> float:
    """The decoder's FLOPs per token (:func:`mt_train.models.llama.flops_per_token`) plus the
    encoder's and projector's per image token (each image's FLOPs spread over its tokens)."""
    v = cfg.vision
    projector = 6.0 * (v.dim * cfg.dim + cfg.dim * cfg.dim)
    return llama_flops(cfg, seq_len) + vision_flops_per_image(v) / v.tokens_per_image + projector
