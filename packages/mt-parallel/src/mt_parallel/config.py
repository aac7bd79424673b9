"""``ParallelConfig``: the parallel layout of a training run, validated on construction.

The trainer registers this dataclass in Hydra's ConfigStore as the ``parallel`` group; every field
is documented right under it. Validation is eager (``__post_init__``) and messages name the
offending values. Checks that need the model or the world size live in :meth:`validate_model` and
:meth:`validate_world`, called by :func:`mt_parallel.parallelize` before any process group is used.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DATA_PARALLEL_MODES = ("ddp", "fsdp", "zero1", "none")
CP_ATTENTION_MODES = ("all_gather", "ring")
RECOMPUTE_POLICIES = ("none", "selective", "full")
SELECTIVE_TARGETS = ("attention", "mlp")
RECOMPUTE_KEEP_TARGETS = ("attention",)


@dataclass
class ParallelConfig:
    """How a model is split over the world (see the module docstring)."""

    tp: int = 1
    """Tensor-parallel degree: attention heads, KV heads, FFN width and vocabulary are split."""
    cp: int = 1
    """Context-parallel degree: the sequence is split into ``2·cp`` chunks, two per rank."""
    cp_attention: str = "all_gather"
    """How attention crosses the cp group: ``all_gather`` (K/V gathered once per layer, as in
    Llama 3 training; supports attention dropout) or ``ring`` (K/V passed around the group with
    p2p while blocks compute; one K/V block in flight instead of the whole sequence)."""
    dp: int | None = None
    """Data-parallel degree; None infers ``world / (tp·cp·pp)``."""
    pp: int = 1
    """Pipeline-parallel degree: the model's layers are cut into ``pp·pp_chunks`` chunks run by
    ``pp_schedule`` (:mod:`mt_parallel.pipeline`)."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule: ``gpipe``, ``1f1b``, ``interleaved_1f1b`` (``pp_chunks ≥ 2``),
    ``zero_bubble`` (ZB-H1 at ``pp_chunks=1``, interleaved zero bubble above), ``zbv`` or
    ``dualpipev`` (two chunks per rank in a V)."""
    pp_microbatches: int | None = None
    """Pipeline micro-batches per optimizer step; None: the trainer's accumulation count
    (``global_batch_size / (micro_batch_size·dp)``), which a set value must equal. Every
    schedule but gpipe needs at least ``pp`` (dualpipev ``2·pp``)."""
    pp_chunks: int = 1
    """Model chunks per pipeline rank (virtual stages): ≥ 2 for ``interleaved_1f1b``; ``zbv``
    and ``dualpipev`` always hold 2."""
    pp_overlap: bool = True
    """``dualpipev``: run each overlapped forward/backward pair interleaved at the MoE
    all-to-alls, each half's exchanges in flight while the other computes
    (:mod:`mt_parallel.pipeline.overlap`; only where the chunks hold MoE layers split over
    ``ep > 1``); false runs the halves back to back, as torch's runtime does."""
    pp_layers: list[int] = field(default_factory=list)
    """Decoder layers of each chunk, first to last (``pp·chunks`` entries summing to the layer
    count); empty: even, with the remainder on the middle chunks (the first holds the
    embedding, the last the norm and head)."""
    ep: int = 1
    """Expert-parallel degree for MoE layers, carved out of dp×cp (1 for dense models): each
    ep rank keeps ``1/ep`` of every MoE layer's routed experts (``ep`` must divide dp·cp and
    the expert count). Expert weights are reduced (and under ``fsdp`` / ``zero1`` sharded)
    over the expert-data-parallel group, the ``dp·cp/ep`` ranks that hold the same experts;
    every other parameter over dp×cp (:mod:`mt_parallel.data_parallel`)."""
    sequence_parallel: bool = False
    """Shard activations along the sequence between TP regions (needs ``tp > 1``)."""
    data_parallel: str = "ddp"
    """How gradients are synchronised over dp×cp: ``ddp`` (torch DDP, all-reduce), ``fsdp``
    (torch FSDP2 ``fully_shard``), ``zero1`` (no wrapper; :class:`DistributedOptimizer`
    reduce-scatters gradients and shards optimizer state and fp32 master weights) or ``none``."""
    recompute: str = "none"
    """Activation recomputation: ``none``, ``selective`` (parts named in ``recompute_targets``)
    or ``full`` (whole decoder blocks, every ``recompute_every``-th one)."""
    recompute_every: int = 1
    """With ``recompute="full"``: recompute blocks 0, N, 2N, ... (1 = every block)."""
    recompute_targets: list[str] = field(default_factory=lambda: ["attention"])
    """With ``recompute="selective"``: ``attention`` (the softmax core) and/or ``mlp`` (the
    SwiGLU activation)."""
    recompute_keep: list[str] = field(default_factory=list)
    """With ``recompute="full"``: outputs the recomputation reuses instead of computing again.
    ``attention``: the attention core's output and softmax statistics (2·B·S·D bytes in bf16
    per recomputed block), so the backward recomputes everything but the attention forward."""
    compile: bool = False
    """``torch.compile`` each decoder block (after recompute, before data parallel)."""

    def __post_init__(self) -> None:
        for name in ("tp", "cp", "pp", "ep", "recompute_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"parallel.{name}={value!r} must be a positive integer")
        if self.dp is not None and (
            not isinstance(self.dp, int) or isinstance(self.dp, bool) or self.dp < 1
        ):
            raise ValueError(f"parallel.dp={self.dp!r} must be a positive integer or None")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError(
                "parallel.sequence_parallel=True needs tensor parallelism (tp > 1), got tp=1: "
                "sequence parallel shards the activations that TP would otherwise replicate"
            )
        if self.cp_attention not in CP_ATTENTION_MODES:
            raise ValueError(
                f"parallel.cp_attention={self.cp_attention!r}; valid: "
                f"{', '.join(CP_ATTENTION_MODES)}"
            )
        if self.data_parallel not in DATA_PARALLEL_MODES:
            raise ValueError(
                f"parallel.data_parallel={self.data_parallel!r}; valid: "
                f"{', '.join(DATA_PARALLEL_MODES)}"
            )
        if self.recompute not in RECOMPUTE_POLICIES:
            raise ValueError(
                f"parallel.recompute={self.recompute!r}; valid: {', '.join(RECOMPUTE_POLICIES)}"
            )
        unknown = [t for t in self.recompute_targets if t not in SELECTIVE_TARGETS]
        if unknown or (self.recompute == "selective" and not self.recompute_targets):
            raise ValueError(
                f"parallel.recompute_targets={list(self.recompute_targets)!r}: selective "
                f"recompute needs one or more of {', '.join(SELECTIVE_TARGETS)}"
            )
        unknown_keep = [t for t in self.recompute_keep if t not in RECOMPUTE_KEEP_TARGETS]
        if unknown_keep:
            raise ValueError(
                f"parallel.recompute_keep={list(self.recompute_keep)!r}; valid entries: "
                f"{', '.join(RECOMPUTE_KEEP_TARGETS)}"
            )
        if self.recompute_keep and self.recompute != "full":
            raise ValueError(
                f"parallel.recompute_keep={list(self.recompute_keep)!r} needs "
                f"parallel.recompute=full (got {self.recompute!r})"
            )
        if self.ep > 1 and self.compile:
            raise ValueError(
                f"parallel.ep={self.ep} with parallel.compile=true is not supported yet "
                "(the uneven all-to-all's split sizes are host values)"
            )
        self._validate_pipeline()

    def _validate_pipeline(self) -> None:
        from mt_parallel.pipeline.schedules import (
            SCHEDULES,
            SPLIT_BACKWARD_REFUSES_COMPILE,
            check_microbatches,
            chunks_per_rank,
        )

        if self.pp_schedule not in SCHEDULES:
            raise ValueError(
                f"parallel.pp_schedule={self.pp_schedule!r}; valid: {', '.join(SCHEDULES)}"
            )
        if not isinstance(self.pp_chunks, int) or isinstance(self.pp_chunks, bool):
            raise ValueError(f"parallel.pp_chunks={self.pp_chunks!r} must be a positive integer")
        if self.pp == 1:
            if self.pp_chunks != 1 or self.pp_layers:
                raise ValueError(
                    f"parallel.pp_chunks={self.pp_chunks} / pp_layers={list(self.pp_layers)} "
                    "need pipeline parallelism (pp > 1)"
                )
            return
        try:
            chunks = chunks_per_rank(self.pp_schedule, self.pp_chunks)
        except ValueError as error:
            raise ValueError(f"parallel.{error}") from None
        if self.pp_layers and len(self.pp_layers) != self.pp * chunks:
            raise ValueError(
                f"parallel.pp_layers={list(self.pp_layers)} needs pp·chunks = {self.pp}·{chunks} "
                f"= {self.pp * chunks} entries ({self.pp_schedule})"
            )
        if self.pp_microbatches is not None:
            check_microbatches(self.pp_schedule, self.pp, self.pp_microbatches, chunks)
        if self.compile and self.pp_schedule in SPLIT_BACKWARD_REFUSES_COMPILE:
            raise ValueError(
                f"parallel.compile=true with pp_schedule={self.pp_schedule}: torch's runtime "
                "refuses compiled stages in split-backward schedules (use 1f1b, gpipe or "
                "interleaved_1f1b, or compile=false)"
            )

    def pipeline_microbatches(self, accumulation: int) -> int:
        """The pipeline's micro-batches per step when a step accumulates ``accumulation``
        micro-batches per rank; raises unless ``pp_microbatches`` (if set) equals it and the
        schedule runs that many."""
        if self.pp_microbatches is not None and self.pp_microbatches != accumulation:
            raise ValueError(
                f"parallel.pp_microbatches={self.pp_microbatches} but a step has {accumulation} "
                "micro-batches per rank (global_batch_size / (micro_batch_size·dp)); set them equal "
                "or leave pp_microbatches unset"
            )
        from mt_parallel.pipeline.schedules import check_microbatches, chunks_per_rank

        if self.pp > 1:
            chunks = chunks_per_rank(self.pp_schedule, self.pp_chunks)
            check_microbatches(self.pp_schedule, self.pp, accumulation, chunks)
        return accumulation

    def validate_world(self, world_size: int) -> int:
        """The data-parallel degree for ``world_size`` processes; raises if it does not fit."""
        model_parallel = self.tp * self.cp * self.pp
        if self.dp is None:
            if world_size % model_parallel:
                raise ValueError(
                    f"world size {world_size} is not divisible by tp·cp·pp = "
                    f"{self.tp}·{self.cp}·{self.pp} = {model_parallel}"
                )
            return world_size // model_parallel
        if self.dp * model_parallel != world_size:
            raise ValueError(
                f"dp·cp·tp·pp = {self.dp}·{self.cp}·{self.tp}·{self.pp} = "
                f"{self.dp * model_parallel} must equal the world size {world_size}"
            )
        return self.dp

    def validate_model(
        self,
        num_heads: int,
        num_kv_heads: int,
        vocab_size: int,
        seq_len: int | None = None,
        ffn_dim: int | None = None,
    ) -> None:
        """Raise if the model's shapes cannot be split this way (messages name the values)."""
        validate_tp_shapes(self.tp, num_heads, num_kv_heads, vocab_size, ffn_dim)
        if seq_len is not None:
            validate_cp_sequence(self.cp, seq_len, self.tp if self.sequence_parallel else 1)


def validate_tp_shapes(
    tp: int,
    num_heads: int,
    num_kv_heads: int,
    vocab_size: int,
    ffn_dim: int | None = None,
) -> None:
    """Heads, KV heads, vocabulary and FFN width must all be divisible by ``tp``."""
    for name, value in (
        ("num_heads", num_heads),
        ("num_kv_heads", num_kv_heads),
        ("vocab_size", vocab_size),
        ("ffn_dim", ffn_dim),
    ):
        if value is not None and value % tp:
            raise ValueError(f"tensor parallel size tp={tp} does not divide {name}={value}")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads} (GQA)"
        )


def validate_cp_sequence(cp: int, seq_len: int, sp_tp: int = 1) -> None:
    """The sequence splits into ``2·cp`` equal chunks, and each rank's part over ``sp_tp``."""
    if seq_len % (2 * cp) and cp > 1:
        raise ValueError(
            f"context parallel size cp={cp} needs the sequence length {seq_len} to be divisible "
            f"by 2·cp = {2 * cp} (two load-balanced chunks per rank)"
        )
    local = seq_len // cp
    if local % sp_tp:
        raise ValueError(
            f"sequence parallel over tp={sp_tp} needs the per-rank sequence length {local} "
            f"(= {seq_len} / cp={cp}) to be divisible by {sp_tp}"
        )
