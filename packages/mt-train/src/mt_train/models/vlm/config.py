"""The vision-language family's config: :class:`VLMConfig` (a Llama decoder's fields plus a
:class:`VisionConfig` and the projector) for ``model=vlm_tiny`` and ``model=llava_1_5_7b``.

The decoder is the Llama family's, so :class:`VLMConfig` extends
:class:`~mt_train.models.llama.LlamaConfig` (``model.dim``, ``model.n_layers`` ... are the
language model's) and adds ``model.vision.*``, ``model.image_token_id``, ``model.freeze`` and
``model.fp8_vision``. Fields are validated eagerly with messages that name the values.
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
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def feature_blocks(self) -> int:
        """How many blocks run to produce the features (the rest are frozen, never run)."""
        layer = self.feature_layer
        return layer if layer > 0 else self.n_layers + 1 + layer

    @property
    def tokens_per_image(self) -> int:
        """Image tokens each image becomes in the language model's sequence."""
        keep_cls = self.cls_token and self.feature_select == "all"
        return self.num_patches + int(keep_cls)


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

    @property
    def image_tokens(self) -> int:
        """Image tokens per image in the decoder's sequence (what image-text data expands each
        ``<image>`` to)."""
        return self.vision.tokens_per_image

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
        return (
            f"vision {v.n_layers} layers width {v.dim} on {v.image_size}px/{v.patch_size}, "
            f"{v.tokens_per_image} tokens per image; language {super().summary()}"
        )
