"""Config schemas of ``mt-train``: one dataclass per config group, validated eagerly.

Hydra composes YAML from ``mt_train/conf`` onto these schemas (registered in
:mod:`mt_train.config.store`), so types are checked while composing; turning the
composed config into objects (:func:`mt_train.config.to_train_config`) runs every
``__post_init__`` below, whose messages name the offending values and what is valid.
Cross-group rules (tensor parallelism dividing the head counts, batch sizes dividing
each other) live in :meth:`TrainConfig.__post_init__`.

The ``rewind`` and ``fault`` groups' schemas live in :mod:`mt_train.config.rewind`, the
``profiling`` group's and the ``comm`` section's in :mod:`mt_train.config.observability`.
The ``parallel`` group's schema is ``mt_parallel.ParallelConfig`` (mt_parallel owns it).
``mt_fp8`` exports recipe dataclasses but no config schema, so :class:`FP8Config` here names
an ``mt_fp8`` recipe and its arguments, and the recipe dataclass validates them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mt_fp8 import FP8_GEMMS, RECIPES, parse_fp8_gemms, recipe_from_name
from mt_parallel import (
    DOCUMENT_MASK_KERNELS,
    EXPERT_FORMATS,
    ParallelConfig,
    validate_cp_sequence,
)
from mt_parallel.pipeline import chunks_per_rank, split_layers
from mt_train.config.observability import CommConfig, ProfilingConfig
from mt_train.config.rewind import FaultConfig, RewindConfig
from mt_train.data.image_text import PACK_ORDERS

SCHEDULES = ("cosine", "wsd", "constant")
BUNDLED_DATA = ("kjv", "digits", "shapes")
SAMPLINGS = ("permutation", "random")
PRECISIONS = ("auto", "bf16", "fp32")
RESUME_MODES = ("none", "auto", "must")


def positive(owner: str, **values: Any) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{owner}.{name} must be a positive integer, got {value!r}")


@dataclass
class ModelConfig:
    """What every model family's config has; each family's config dataclass extends it
    (:class:`mt_train.models.llama.LlamaConfig`) and is the ``model`` group's schema.

    The ``model`` group's options are the named sizes of the registered families
    (:mod:`mt_train.models.registry`); which family builds a config is read off its class.
    """

    name: str = "model"
    """Label used in logs and run directories."""
    vocab_size: int | None = None
    """Embedding rows; ``null`` takes the tokenizer's size rounded up to a multiple of 64."""
    dropout: float = 0.0
    """Dropout probability of the attention probabilities and of both residual branches of
    every block (mt_parallel's ``DecoderBlock``); masks come from ``mt_parallel``'s RNG tracker,
    which checkpoints save, so a resumed run draws the same masks."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if self.vocab_size is not None:
            positive("model", vocab_size=self.vocab_size)

    def check_parallel(self, parallel: ParallelConfig, seq_len: int | None = None) -> None:
        """Raise if the model cannot be split as ``parallel`` says: the vocabulary over tp, the
        sequence over cp (a family adds its own shapes: heads, FFN width)."""
        if self.vocab_size is not None and self.vocab_size % parallel.tp:
            raise ValueError(
                f"tensor parallel size tp={parallel.tp} does not divide vocab_size={self.vocab_size}"
            )
        if seq_len is not None:
            sp_tp = parallel.tp if parallel.sequence_parallel else 1
            validate_cp_sequence(parallel.cp, seq_len, sp_tp)

    def summary(self) -> str:
        """The shapes a log line shows (a family names its own)."""
        return f"vocab {self.vocab_size}"


@dataclass
class FP8Config:
    """Which ``mt_fp8`` recipe the linear layers of the decoder blocks use (``none``: bf16)."""

    recipe: str = "none"
    """``none`` or an mt_fp8 recipe: delayed, tensorwise, rowwise, block, mxfp8."""
    recipe_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the recipe dataclass (e.g. ``amax_history_len`` for delayed)."""
    backend: str = "auto"
    """mt_fp8 GEMM backend: auto, fast, scaled_mm, triton or emulate."""
    min_features: int = 0
    """Linear layers with in or out features below this stay in high precision."""
    cache_weight: bool = True
    """Keep each layer's FP8 weight from its first forward of a step to its last backward
    (quantized once per step); false quantizes in every forward and recomputed forward, which
    saves two bytes per weight element of every layer awaiting its backward
    (``mt_parallel.set_fp8_weight_cache``)."""
    gemms: list[str] = field(default_factory=lambda: list(FP8_GEMMS))
    """Which of the blocks' GEMMs (``forward``, ``dgrad``, ``wgrad``) run in FP8; the others run
    in bf16 from high-precision operands (``mt_fp8.FP8Linear(fp8_gemms=...)``). ``[forward,dgrad]``
    is Megatron's ``--no-fp8-wgrad``: exact weight gradients for the cost of one bf16 GEMM and
    of saving the layer input in bf16."""
    output_head: bool = False
    """Run the output head (the ``D × V`` logits GEMM) in FP8 too. Off by default, as in
    Megatron, Transformer Engine recipes and DeepSeek-V3: the logits and their gradient are
    the most precision-sensitive GEMM of the model. At Llama3-8B shapes the head is a third of
    an 8-layer model's GEMM time, so this is the largest speed lever left; its loss against
    bf16 depends on the recipe (docs/performance.md, "dense Llama slice" and "quality"): check
    yours."""
    output_head_gemms: list[str] = field(default_factory=lambda: list(FP8_GEMMS))
    """With ``output_head``: which of the head's GEMMs (``forward``, ``dgrad``, ``wgrad``) run in
    FP8; the others run in bf16 from high-precision operands (``mt_fp8.FP8Linear(fp8_gemms=...)``),
    e.g. ``[forward,dgrad]`` keeps the head's weight gradient exact."""

    expert_formats: str = "auto"
    """FP8 formats of the MoE experts' grouped GEMMs (``mt_parallel.expert_recipe``): ``auto``
    runs every role in E4M3 under the rowwise, block and MXFP8 recipes (PyTorch's grouped FP8
    GEMM takes E4M3 only; an E5M2 gradient makes the backward one GEMM per expert) and keeps
    tensorwise and delayed scaling's own formats; ``e4m3`` always; ``recipe`` never. Measured
    effect in docs/performance.md, "FP8 expert gradients in E4M3"."""

    def __post_init__(self) -> None:
        if self.expert_formats not in EXPERT_FORMATS:
            raise ValueError(
                f"fp8.expert_formats={self.expert_formats!r} is unknown; valid: "
                f"{', '.join(EXPERT_FORMATS)}"
            )
        if self.recipe != "none":
            if self.recipe not in RECIPES:
                raise ValueError(
                    f"fp8.recipe={self.recipe!r} is unknown; valid: none, {', '.join(RECIPES)}"
                )
            recipe_from_name(self.recipe, **dict(self.recipe_args))
        needs = {
            "gemms": (
                self.enabled,
                f"needs an FP8 recipe; choose fp8=<recipe> ({', '.join(RECIPES)})",
            ),
            "output_head_gemms": (
                self.output_head,
                "applies to an FP8 output head only; set fp8.output_head=true too",
            ),
        }
        for name, (applies, requirement) in needs.items():
            value = getattr(self, name)
            try:
                gemms = parse_fp8_gemms(value)
            except ValueError as error:
                raise ValueError(f"fp8.{name}: {error}") from None
            if gemms != set(FP8_GEMMS) and not applies:
                raise ValueError(f"fp8.{name}={list(value)} {requirement}, or leave the default")

    @property
    def enabled(self) -> bool:
        return self.recipe != "none"


OPTIMIZER_IMPLS = ("auto", "triton", "fused", "foreach")


@dataclass
class OptimizerConfig:
    """AdamW with decoupled weight decay; norms, biases and embeddings' gains are not decayed."""

    name: str = "adamw"
    """Only ``adamw``."""
    lr: float = 3e-3
    """Peak learning rate (after warmup)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """Adam (beta1, beta2)."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay of 2-D weights (not norms or biases)."""
    embedding_weight_decay: bool = True
    """Whether the input embedding is decayed with the other matrices; false leaves it undecayed
    like the norms (the output head, a linear layer, is decayed either way)."""
    grad_clip: float = 1.0
    """Global gradient-norm clip; 0 turns clipping off."""
    impl: str = "auto"
    """AdamW kernel: ``triton`` (:class:`mt_fp8.FusedAdamW`, one Triton pass per parameter),
    ``fused`` (PyTorch's fused CUDA kernel), ``foreach`` (PyTorch's default); ``auto``: triton on
    CUDA with Triton installed, fused on other accelerators and under ZeRO-1, foreach on the CPU
    and under FSDP2 (whose DTensor parameters neither fused kernel takes)."""

    def __post_init__(self) -> None:
        if self.name != "adamw":
            raise ValueError(f"optimizer.name={self.name!r} is unknown; valid: adamw")
        if not self.lr > 0:
            raise ValueError(f"optimizer.lr must be > 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optimizer.betas must be two numbers in [0, 1), got {self.betas}")
        if self.impl not in OPTIMIZER_IMPLS:
            raise ValueError(
                f"optimizer.impl={self.impl!r} is unknown; valid: {', '.join(OPTIMIZER_IMPLS)}"
            )
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError(
                f"optimizer.weight_decay={self.weight_decay} and optimizer.grad_clip="
                f"{self.grad_clip} must be >= 0"
            )


@dataclass
class SchedulerConfig:
    """Learning-rate schedule: linear warmup, then cosine, warmup-stable-decay or constant."""

    name: str = "cosine"
    """cosine, wsd or constant."""
    warmup_steps: int = 20
    """Linear warmup from 0 to the peak LR."""
    min_lr_ratio: float = 0.1
    """Final LR as a fraction of the peak."""
    decay_fraction: float = 0.2
    """WSD only: fraction of the run spent decaying linearly at the end."""

    def __post_init__(self) -> None:
        if self.name not in SCHEDULES:
            raise ValueError(
                f"scheduler.name={self.name!r} is unknown; valid: {', '.join(SCHEDULES)}"
            )
        if self.warmup_steps < 0:
            raise ValueError(f"scheduler.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"scheduler.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0 < self.decay_fraction <= 1:
            raise ValueError(
                f"scheduler.decay_fraction must be in (0, 1], got {self.decay_fraction}"
            )


@dataclass
class DataConfig:
    """Where the tokens come from: a folder written by ``mt-prepare-data``."""

    path: str | None = None
    """Prepared data folder; null prepares the bundled set named by ``bundled``."""
    bundled: str = "kjv"
    """The bundled set prepared when ``path`` is null: ``kjv`` (the King James corpus, byte
    tokens), ``digits`` (scikit-learn's handwritten digits as image captions, for a
    vision-language model; needs ``mt-train[vision]``) or ``shapes`` (generated scenes of two
    coloured shapes captioned with their relation, :mod:`mt_train.data.shapes`)."""
    val_every: int = 50
    """When preparing a bundled set: every n-th document (image) goes to the validation split."""
    document_masking: bool = False
    """Attention stays inside each packed document (mask ``causal ∧ same document``, Megatron's
    ``reset_attention_mask``), applied by ``document_masking_kernel``. Off by default, as in
    torchtitan and Megatron: with windows much shorter than the documents few tokens cross a
    boundary."""
    document_masking_kernel: str = "auto"
    """How the document masks are applied (:mod:`mt_parallel.document_attention`): ``flex``,
    PyTorch's FlexAttention with a block mask built from the document ids once per micro-batch
    (the fused path on GPUs, also under CP with ``parallel.cp_attention=all_gather``; refused
    on the CPU, with ring attention and with ``model.dropout > 0``); ``explicit``, a boolean
    mask handed to SDPA (every device, ring attention and dropout; the reference); ``auto``,
    ``flex`` on CUDA where it applies and ``explicit`` elsewhere."""
    pack_samples: bool = False
    """Image-text data: pack several samples (grouped as ``pack_order`` says) into each
    ``trainer.seq_len`` sequence instead of one sample per sequence padded to it, as
    Megatron-Core's and LLaVA's packed sequences (:mod:`mt_train.data.image_text`). Each
    sample's images fill its own ``<image>`` placeholders, attention stays inside each sample
    (document masks, applied whether or not ``document_masking`` is set, by
    ``document_masking_kernel``), the decoder's RoPE positions restart at each sample and the
    loss stays on the captions, a masked mean over the global batch's trained targets. Under
    ``parallel.pp > 1`` every stage's blocks receive the per-sample positions. With
    ``trainer.cuda_graph`` every batch is padded to the most images a row of the split holds
    times the rows (zero images no placeholder takes: the encoder's compute grows, the loss
    and gradients do not change)."""
    pack_order: str = "consecutive"
    """With ``pack_samples``, how samples are grouped into packs
    (:mod:`mt_train.data.image_text`): ``consecutive``, in file order, greedily (each pack a
    run of neighbouring samples); ``shuffled``, the same greedy cut over the split's samples
    permuted with ``trainer.seed``, so packs mix samples from across the file;
    ``best_fit``, Best-Fit-Decreasing bin packing (longest sample first, each into the fullest
    pack that still fits it), usually the least padding. Packs depend only on the data and
    these settings, so a resumed run draws the same ones; the banner prints the padding
    share. Anything but ``consecutive`` needs ``pack_samples=true``."""
    blend: Any = None
    """Train on a weighted blend of prepared folders instead of ``path``: a list of
    ``{path, weight}`` or Megatron's flat string ``"w1 path1 w2 path2"``; weights are normalised
    (:mod:`mt_train.data.blend`). All folders must share one tokenizer. Metrics gain
    ``tokens/<folder name>`` (tokens consumed from each source) and ``val_loss/<folder name>``
    (``val_loss`` is then the weighted mean of the sources' losses)."""
    sampling: str = "permutation"
    """How training windows are drawn (:mod:`mt_train.data.dataset`): ``permutation``, the
    split cut into non-overlapping windows visited in a new random order every epoch (every
    token once per epoch, the same cut every epoch); ``random``, every draw a window starting at
    an independent, uniformly random token (nanoGPT's sampler; windows overlap and differ
    between epochs). Both are deterministic in the seed and the draw number, so resume and
    every parallel layout see the same samples."""

    def __post_init__(self) -> None:
        if self.bundled not in BUNDLED_DATA:
            raise ValueError(
                f"data.bundled={self.bundled!r} is unknown; valid: {', '.join(BUNDLED_DATA)}"
            )
        if self.document_masking_kernel not in DOCUMENT_MASK_KERNELS:
            raise ValueError(
                f"data.document_masking_kernel={self.document_masking_kernel!r} is unknown; "
                f"valid: {', '.join(DOCUMENT_MASK_KERNELS)}"
            )
        if self.pack_order not in PACK_ORDERS:
            raise ValueError(
                f"data.pack_order={self.pack_order!r} is unknown; valid: {', '.join(PACK_ORDERS)}"
            )
        if self.pack_order != "consecutive" and not self.pack_samples:
            raise ValueError(
                f"data.pack_order={self.pack_order} orders packed image-text samples, but "
                "data.pack_samples=false; set data.pack_samples=true (or drop data.pack_order)"
            )
        if self.sampling not in SAMPLINGS:
            raise ValueError(
                f"data.sampling={self.sampling!r} is unknown; valid: {', '.join(SAMPLINGS)}"
            )
        if self.path is not None and not os.path.isdir(os.path.expanduser(self.path)):
            raise ValueError(
                f"data.path={self.path!r} is not a folder; write one with `mt-prepare-data` "
                "or set data.path=null for the bundled corpus"
            )
        positive("data", val_every=self.val_every)
        if self.blend is not None:
            if self.path is not None:
                raise ValueError(
                    f"data.path={self.path!r} and data.blend are both set; use one (a blend "
                    "lists every folder)"
                )
            for folder, _ in self.blend_sources:
                if not os.path.isdir(os.path.expanduser(folder)):
                    raise ValueError(
                        f"data.blend source {folder!r} is not a folder; write one with "
                        "`mt-prepare-data`"
                    )

    @property
    def blend_sources(self) -> list[tuple[str, float]]:
        """``data.blend`` as ``[(folder, normalised weight), ...]`` (empty without a blend)."""
        from mt_train.data.blend import parse_blend

        if self.blend is None:
            return []
        if isinstance(self.blend, str):
            return parse_blend(self.blend)
        return parse_blend([dict(e) if isinstance(e, Mapping) else e for e in self.blend])

    @property
    def independent_draws(self) -> bool:
        """``sampling=random``: independent draws over windows at every token."""
        return self.sampling == "random"

    @property
    def train_stride(self) -> int | None:
        """Token stride between training windows: 1 for ``sampling=random``, else the
        sequence length (non-overlapping windows)."""
        return 1 if self.independent_draws else None


@dataclass
class CheckpointConfig:
    """safetensors shards per rank + a JSON manifest, written atomically (and asynchronously)."""

    enabled: bool = True
    """Save checkpoints at all."""
    dir: str | None = None
    """Checkpoint folder; null: ``<output_dir>/checkpoints``."""
    keep_last: int = 2
    """How many complete checkpoints to keep."""
    async_save: bool = True
    """Write in a background thread; the next save (or the end of training) waits for it."""
    resume: str = "none"
    """none; auto (the newest checkpoint in ``dir`` that verifies; damaged newer ones are
    set aside with a logged reason; none left: start fresh, saying so); must (as auto, but
    refuse to start fresh); or a path: a ``step-*`` checkpoint folder, or a folder of them
    (the newest that verifies)."""
    init_from: str | None = None
    """Start from these weights only (an ``mt-convert import`` root or any checkpoint folder);
    ignored when resuming."""

    def __post_init__(self) -> None:
        positive("checkpoint", keep_last=self.keep_last)
        if self.resume not in RESUME_MODES and not os.path.isdir(os.path.expanduser(self.resume)):
            raise ValueError(
                f"checkpoint.resume={self.resume!r} must be none, auto, must or an existing "
                "checkpoint folder (or a folder of them)"
            )
        if self.init_from is not None and not os.path.isdir(os.path.expanduser(self.init_from)):
            raise ValueError(f"checkpoint.init_from={self.init_from!r} is not a folder")


WANDB_MODES = ("offline", "online", "disabled")


@dataclass
class LoggingConfig:
    """Where metrics go."""

    progress_bar: bool = True
    """A tqdm bar on rank 0 (plain log lines when false)."""
    jsonl: bool = True
    """Append every logged step to ``<output_dir>/metrics.jsonl``."""
    tensorboard: bool = False
    """Also write TensorBoard events (needs the ``tensorboard`` extra)."""
    wandb: bool = False
    """Also log to Weights & Biases (needs the ``wandb`` extra); files in ``<run>/wandb``."""
    wandb_project: str = "mt-train"
    """The W&B project."""
    wandb_mode: str = "offline"
    """offline (files only, ``wandb sync`` uploads them later), online or disabled."""
    mlflow: bool = False
    """Also log to MLflow (needs the ``mlflow`` extra)."""
    mlflow_experiment: str = "mt-train"
    """The MLflow experiment."""
    mlflow_tracking_uri: str | None = None
    """Where MLflow stores runs; null: an SQLite store ``<run>/mlflow.db`` (artifacts in
    ``<run>/mlartifacts``)."""
    loggers: list[str] = field(default_factory=list)
    """Further metric loggers by registered name (third-party ones come through the
    ``mt_register_loggers`` hook; :mod:`mt_train.loggers`)."""
    step_breakdown: bool = True
    """Add where the time of the logged steps went (``time/*``), reserved memory and the slowest
    rank's step time to every logged record (:mod:`mt_train.step_timer`)."""

    def __post_init__(self) -> None:
        if self.wandb_mode not in WANDB_MODES:
            raise ValueError(
                f"logging.wandb_mode={self.wandb_mode!r} is unknown; valid: {', '.join(WANDB_MODES)}"
            )
        if not self.wandb_project or not self.mlflow_experiment:
            raise ValueError(
                f"logging.wandb_project={self.wandb_project!r} and logging.mlflow_experiment="
                f"{self.mlflow_experiment!r} must not be empty"
            )
        if len(set(self.loggers)) != len(self.loggers):
            raise ValueError(f"logging.loggers={list(self.loggers)} names a logger twice")


@dataclass
class TrainerConfig:
    """The loop: steps, batch sizes, intervals, seed, device."""

    max_steps: int = 500
    """Optimizer steps to train for."""
    global_batch_size: int = 16
    """Sequences per optimizer step over all data-parallel ranks."""
    micro_batch_size: int = 8
    """Sequences per forward/backward on one rank; the rest is gradient accumulation."""
    seq_len: int = 256
    """Tokens per sequence."""
    log_interval: int = 10
    """Log metrics every n steps."""
    eval_interval: int = 250
    """Evaluate on the validation split every n steps (and at the end)."""
    eval_batches: int = 8
    """Micro-batches per evaluation."""
    checkpoint_interval: int = 250
    """Save a checkpoint every n steps (and at the end)."""
    seed: int = 1234
    """Seeds the init, the data order and the dropout streams (``mt_parallel.manual_seed``
    with this rank's TP and CP coordinates: the same on every DP rank)."""
    device: str = "auto"
    """auto (the accelerator if present, else cpu) or a registered mt device name."""
    precision: str = "auto"
    """auto (bf16 autocast on accelerators, fp32 on CPU), bf16 or fp32."""
    compile: bool = False
    """torch.compile each decoder block (the same as ``parallel.compile``; either turns it on)."""
    cuda_graph: bool = False
    """Replay each step's forward and backward as one CUDA graph, captured at the second step
    (no collectives inside the backward, no dropout: :mod:`mt_train.cuda_graph`)."""
    output_dir: str | None = None
    """Run folder; null: Hydra's run directory."""
    sample_tokens: int = 160
    """Length of the greedy sample printed at the end (0: none)."""
    sample_prompt: str = "And God said"
    """Prompt of that sample."""
    step_timeout_s: float | None = None
    """A step (with its evaluation and checkpoint) taking longer than this dumps every thread's
    Python stack of this rank to ``<run>/hang/rank<r>.txt`` and ends the process with exit
    status 4 (:mod:`mt_train.watchdog`); null: no watchdog. Leave room for the first step's
    compilation or CUDA-graph capture."""

    def __post_init__(self) -> None:
        positive(
            "trainer",
            max_steps=self.max_steps,
            global_batch_size=self.global_batch_size,
            micro_batch_size=self.micro_batch_size,
            seq_len=self.seq_len,
            log_interval=self.log_interval,
            eval_interval=self.eval_interval,
            eval_batches=self.eval_batches,
            checkpoint_interval=self.checkpoint_interval,
        )
        if self.step_timeout_s is not None and not self.step_timeout_s > 0:
            raise ValueError(
                f"trainer.step_timeout_s must be > 0 seconds or null, got {self.step_timeout_s}"
            )
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"trainer.precision={self.precision!r} is unknown; valid: {', '.join(PRECISIONS)}"
            )


@dataclass
class TrainConfig:
    """The whole run; composed from ``train.yaml``'s defaults list."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    fp8: FP8Config = field(default_factory=FP8Config)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    rewind: RewindConfig = field(default_factory=RewindConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def __post_init__(self) -> None:
        model, par, tr = self.model, self.parallel, self.trainer
        model.check_parallel(par, tr.seq_len)
        if par.cp > 1 and par.cp_attention == "ring" and model.dropout > 0:
            raise ValueError(
                f"parallel.cp_attention=ring with model.dropout={model.dropout}: ring attention "
                "has no attention dropout; use parallel.cp_attention=all_gather or model.dropout=0"
            )
        masks = self.data.document_masking or self.data.pack_samples
        flex = masks and self.data.document_masking_kernel == "flex"
        if flex and par.cp > 1 and par.cp_attention == "ring":
            raise ValueError(
                f"data.document_masking_kernel=flex does not run inside ring attention "
                f"(parallel.cp={par.cp}, parallel.cp_attention=ring): use "
                "parallel.cp_attention=all_gather, or data.document_masking_kernel=auto or explicit"
            )
        if flex and model.dropout > 0:
            raise ValueError(
                f"data.document_masking_kernel=flex has no attention dropout (model.dropout="
                f"{model.dropout}): use data.document_masking_kernel=auto or explicit"
            )
        if tr.global_batch_size % tr.micro_batch_size:
            raise ValueError(
                f"trainer.global_batch_size={tr.global_batch_size} is not a multiple of "
                f"trainer.micro_batch_size={tr.micro_batch_size}"
            )
        if self.scheduler.warmup_steps > tr.max_steps:
            raise ValueError(
                f"scheduler.warmup_steps={self.scheduler.warmup_steps} exceeds "
                f"trainer.max_steps={tr.max_steps}"
            )
        if par.pp > 1 and hasattr(model, "n_layers"):  # the layers split as asked
            chunks = chunks_per_rank(par.pp_schedule, par.pp_chunks)
            split_layers(model.n_layers, par.pp * chunks, par.pp_layers or None)
        if self.fp8.enabled and self.fp8.min_features % 16:
            raise ValueError(f"fp8.min_features={self.fp8.min_features} must be a multiple of 16")

    def check_world(self, world_size: int) -> int:
        """The dp degree for ``world_size``; raises unless the global batch splits evenly."""
        dp = self.parallel.validate_world(world_size)
        per_step = self.trainer.micro_batch_size * dp
        if self.trainer.global_batch_size % per_step:
            raise ValueError(
                f"trainer.global_batch_size={self.trainer.global_batch_size} is not a multiple of "
                f"micro_batch_size·dp = {self.trainer.micro_batch_size}·{dp} = {per_step}"
            )
        self.parallel.pipeline_microbatches(self.trainer.global_batch_size // per_step)
        if self.fault.rank is not None and self.fault.rank >= world_size:
            raise ValueError(
                f"fault.rank={self.fault.rank} is not a rank of this run (world size {world_size})"
            )
        return dp
