"""The vision-language family's config: :class:`VLMConfig` (a Llama decoder's fields plus a
:class:`VisionConfig` and the projector) for ``model=vlm_tiny`` and ``model=llava_1_5_7b``.

The decoder is the Llama family's, so :class:`VLMConfig` extends
:class:`~mt_train.models.llama.LlamaConfig` (``model.dim``, ``model.n_layers`` ... are the
language model's) and adds ``model.vision.*``, ``model.image_token_id``, the projector's
``model.projector_*``, ``model.freeze`` and ``model.fp8_vision``. Fields are validated eagerly
with messages that name the values.

Image tokens: the encoder yields :attr:`VisionConfig.feature_tokens` rows per image (its
``(H/p)·(W/p)`` patch grid, plus the class token with ``feature_select=all``); the projector's
optional reduction (``model.projector_reduction``,
:func:`~mt_train.models.vlm.model.reduce_patch_grid`) cuts an ``s×s`` grid to ``(s/r)²``
tokens, and :attr:`VLMConfig.image_tokens` is what the decoder's sequence holds per image (the
placeholders the data writes, the placement's count, the HF config's ``image_seq_length``, the
FLOPs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mt_parallel import ParallelConfig
from mt_train.config.schema import positive
from mt_train.models.llama.config import LlamaConfig

FREEZE_OPTIONS = ("none", "encoder", "encoder_and_decoder")
"""``model.freeze``: nothing; the vision encoder (LLaVA's stage 2, projector and decoder
train); the encoder and the decoder (LLaVA's stage 1, only the projector trains)."""
ACTIVATIONS = ("quick_gelu", "gelu")
FEATURE_SELECT = ("patch", "all")
PROJECTOR_REDUCTIONS = ("none", "pixel_shuffle", "avg_pool")
"""``model.projector_reduction``: keep every patch token (LLaVA); concatenate each ``r×r``
neighbourhood's features (InternVL, Idefics3); average them."""


@dataclass
class VisionConfig:
    """A ViT image encoder (CLIP's vision tower: LayerNorm, biased linears, GELU MLP)."""

    image_size: int = 8
    """Images are ``channels × image_size × image_size``."""
    patch_size: int = 2
    """Square patches: ``(image_size / patch_size)²`` patch tokens per image."""
    channels: int = 1
    """Input channels (1 for grey digits, 3 for RGB)."""
    dim: int = 64
    """Encoder width."""
    n_layers: int = 2
    """Encoder blocks."""
    n_heads: int = 4
    """Attention heads (bidirectional, no RoPE: learned positions)."""
    ffn_dim: int = 256
    """Hidden size of the encoder MLP."""
    act: str = "gelu"
    """MLP activation: ``quick_gelu`` (CLIP, ``x·sigmoid(1.702x)``) or ``gelu`` (erf)."""
    norm_eps: float = 1e-5
    """LayerNorm epsilon."""
    cls_token: bool = False
    """Prepend a learned class token (CLIP has one)."""
    pre_norm: bool = False
    """A LayerNorm after the embeddings, before the first block (CLIP's ``pre_layrnorm``)."""
    post_norm: bool = False
    """A final LayerNorm (CLIP's ``post_layernorm``): held for checkpoint compatibility, it
    normalises only CLIP's pooled output, which LLaVA never reads, so it stays frozen."""
    feature_layer: int = -1
    """Which hidden state feeds the projector: ``-1`` the last block's output, ``-2`` (LLaVA)
    the one before; index ``0`` is the embeddings. Blocks after it are frozen."""
    feature_select: str = "patch"
    """``patch`` drops the class token from the features (LLaVA's ``default``); ``all``
    keeps it (``full``)."""

    def __post_init__(self) -> None:
        positive(
            "model.vision",
            image_size=self.image_size,
            patch_size=self.patch_size,
            channels=self.channels,
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            ffn_dim=self.ffn_dim,
        )
        if self.image_size % self.patch_size:
            raise ValueError(
                f"model.vision.image_size={self.image_size} is not a multiple of "
                f"model.vision.patch_size={self.patch_size}"
            )
        if self.dim % self.n_heads:
            raise ValueError(
                f"model.vision.dim={self.dim} is not divisible by model.vision.n_heads={self.n_heads}"
            )
        if self.act not in ACTIVATIONS:
            raise ValueError(f"model.vision.act={self.act!r}; valid: {', '.join(ACTIVATIONS)}")
        if self.feature_select not in FEATURE_SELECT:
            raise ValueError(
                f"model.vision.feature_select={self.feature_select!r}; valid: "
                f"{', '.join(FEATURE_SELECT)}"
            )
        if not -self.n_layers <= self.feature_layer <= self.n_layers or self.feature_layer == 0:
            raise ValueError(
                f"model.vision.feature_layer={self.feature_layer} must pick a block's output: "
                f"1..{self.n_layers} or -{self.n_layers}..-1"
            )

    @property
    def grid_side(self) -> int:
        """Patches along each side of the image: ``image_size / patch_size``."""
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid_side**2

    @property
    def feature_blocks(self) -> int:
        """How many blocks run to produce the features (the rest are frozen, never run)."""
        layer = self.feature_layer
        return layer if layer > 0 else self.n_layers + 1 + layer

    @property
    def keeps_cls(self) -> bool:
        """Whether the features include the class token (``feature_select=all``)."""
        return self.cls_token and self.feature_select == "all"

    @property
    def feature_tokens(self) -> int:
        """Feature rows the encoder yields per image (before the projector's reduction)."""
        return self.num_patches + int(self.keeps_cls)


@dataclass
class VLMConfig(LlamaConfig):
    """LLaVA: ViT encoder → 2-layer GELU MLP projector → Llama decoder (module docstring)."""

    name: str = "vlm_tiny"
    vision: VisionConfig = field(default_factory=VisionConfig)
    """The image encoder."""
    image_token_id: int = 257
    """Token id of the image placeholders (one per image token) in the input ids; 257 is the
    first id after the byte tokenizer's (``mt-prepare-data``'s image-text format uses it)."""
    projector_bias: bool = True
    """Biases on both projector linears (LLaVA-1.5 has them)."""
    projector_reduction: str = "none"
    """Fewer image tokens, before the projector's first linear: ``none`` (LLaVA, one token per
    patch); ``pixel_shuffle`` (InternVL, Idefics3: each ``r×r`` neighbourhood of the patch grid
    becomes one token of its ``r²`` patches' features concatenated, so ``linear_1`` takes
    ``r²·model.vision.dim`` inputs); ``avg_pool`` (their mean, width unchanged). Either gives
    ``(grid/r)²`` tokens per image; Hugging Face's Llava has neither, so such a model does not
    export."""
    projector_reduction_factor: int = 2
    """``r``, the neighbourhood's side (with a reduction; the patch grid's side must be a
    multiple of it)."""
    freeze: str = "none"
    """``none``, ``encoder`` (LLaVA stage 2) or ``encoder_and_decoder`` (stage 1: projector only)."""
    fp8_vision: bool = False
    """With an ``fp8`` recipe: run the encoder's and projector's linears in FP8 too (false, the
    default, keeps them in the high-precision autocast dtype: at one image per sample their
    GEMMs are too small for FP8 to pay, docs/performance.md "Vision-language model")."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.freeze not in FREEZE_OPTIONS:
            raise ValueError(f"model.freeze={self.freeze!r}; valid: {', '.join(FREEZE_OPTIONS)}")
        if self.image_token_id < 0:
            raise ValueError(f"model.image_token_id must be >= 0, got {self.image_token_id}")
        if self.vocab_size is not None and self.image_token_id >= self.vocab_size:
            raise ValueError(
                f"model.image_token_id={self.image_token_id} is outside the vocabulary "
                f"(model.vocab_size={self.vocab_size})"
            )
        self._check_reduction()

    def _check_reduction(self) -> None:
        reduction, r, v = self.projector_reduction, self.projector_reduction_factor, self.vision
        if reduction not in PROJECTOR_REDUCTIONS:
            raise ValueError(
                f"model.projector_reduction={reduction!r}; valid: {', '.join(PROJECTOR_REDUCTIONS)}"
            )
        positive("model", projector_reduction_factor=r)
        if reduction == "none":
            return
        if v.keeps_cls:
            # The class token is no patch of the grid: a neighbourhood has no place for it.
            raise ValueError(
                f"model.projector_reduction={reduction} reduces the patch grid, but "
                "model.vision.feature_select=all keeps the class token among the features; "
                "use feature_select=patch (or cls_token=false) with a reduction"
            )
        if v.grid_side % r:
            raise ValueError(
                f"model.projector_reduction_factor={r} does not divide the patch grid's side "
                f"{v.grid_side} (model.vision.image_size={v.image_size} / "
                f"patch_size={v.patch_size})"
            )

    @property
    def image_tokens(self) -> int:
        """Image tokens per image in the decoder's sequence (what image-text data expands each
        ``<image>`` to): the encoder's feature rows, ``(grid/r)²`` after a reduction."""
        if self.projector_reduction == "none":
            return self.vision.feature_tokens
        return (self.vision.grid_side // self.projector_reduction_factor) ** 2

    @property
    def projector_in_dim(self) -> int:
        """Input width of the projector's first linear: ``r²·model.vision.dim`` after a pixel
        shuffle, ``model.vision.dim`` otherwise."""
        r = self.projector_reduction_factor
        return self.vision.dim * (r * r if self.projector_reduction == "pixel_shuffle" else 1)

    def check_parallel(self, parallel: ParallelConfig, seq_len: int | None = None) -> None:
        """The decoder's rules plus the encoder's heads and FFN over tp."""
        super().check_parallel(parallel, seq_len)
        v = self.vision
        for name, value in (("n_heads", v.n_heads), ("ffn_dim", v.ffn_dim)):
            if value % parallel.tp:
                raise ValueError(
                    f"tensor parallel size tp={parallel.tp} does not divide "
                    f"model.vision.{name}={value}"
                )

    def summary(self) -> str:
        v = self.vision
        reduced = ""
        if self.projector_reduction != "none":
            reduced = f"{self.projector_reduction} r={self.projector_reduction_factor} to "
        return (
            f"vision {v.n_layers} layers width {v.dim} on {v.image_size}px/{v.patch_size}, "
            f"{reduced}{self.image_tokens} tokens per image; language {super().summary()}"
        )
