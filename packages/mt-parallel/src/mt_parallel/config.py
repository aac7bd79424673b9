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
    """Pipeline-parallel degree (schedules come with the pipeline issue; 1 until then)."""
    ep: int = 1
    """Expert-parallel degree for MoE layers, carved out of dp×cp (1 for dense models): each
    ep rank keeps ``1/ep`` of every MoE layer's routed experts (``ep`` must divide dp·cp and
    the expert count; needs ``data_parallel=ddp``)."""
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
        if self.ep > 1 and self.data_parallel != "ddp":
            raise ValueError(
                f"parallel.ep={self.ep} needs parallel.data_parallel=ddp (got "
                f"{self.data_parallel!r}): FSDP2 and ZeRO-1 do not shard expert-parallel "
                "parameters yet"
            )
        if self.ep > 1 and self.compile:
            raise ValueError(
                f"parallel.ep={self.ep} with parallel.compile=true is not supported yet "
                "(the uneven all-to-all's split sizes are host values)"
            )
        if self.pp != 1:
            raise ValueError(
                f"parallel.pp={self.pp}: pipeline parallelism is not implemented yet (pp=1)"
            )

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
