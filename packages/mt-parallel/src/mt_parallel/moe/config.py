"""``MoEConfig``: the routing, balancing, capacity and expert shapes of one MoE layer.

Validated on construction; messages name the offending values and what would be valid. A model
family embeds it in its own config (``model.moe.*`` in mt-train) and hands it to
:class:`~mt_parallel.moe.MoE`; the expert-parallel degree is checked against it by
:meth:`MoEConfig.check_expert_parallel`.
"""

from __future__ import annotations

from dataclasses import dataclass

SCORE_FUNCTIONS = ("softmax", "sigmoid")
BALANCING_MODES = ("aux_loss", "seq_aux_loss", "aux_free", "none")
DISPATCHERS = ("all_to_all", "all_gather")


@dataclass
class MoEConfig:
    """One MoE layer's routing and experts (module docstring)."""

    num_experts: int = 8
    """Routed experts (all of them, before expert parallelism splits them)."""
    top_k: int = 2
    """Experts each token is sent to."""
    expert_ffn_dim: int = 256
    """Hidden size of each routed expert's SwiGLU MLP."""
    score_function: str = "softmax"
    """``softmax`` (Mixtral, DeepSeek-V2) or ``sigmoid`` (DeepSeek-V3) router scores."""
    normalize_weights: bool = True
    """Divide the chosen experts' scores by their sum (Mixtral's renormalised softmax; V3)."""
    routed_scaling_factor: float = 1.0
    """Multiplies the routed experts' weights after normalisation (DeepSeek-V3: 2.5)."""
    n_group: int = 1
    """Expert groups for group-limited routing (DeepSeek): ``num_experts`` split into equal groups."""
    topk_group: int = 1
    """Groups each token may pick experts from (``n_group`` means no limit)."""
    balancing: str = "aux_loss"
    """``aux_loss`` (Switch/GShard, over the micro-batch), ``seq_aux_loss`` (DeepSeek-V3, per
    sequence), ``aux_free`` (a selection bias moved after each step) or ``none``."""
    aux_loss_coeff: float = 0.01
    """Weight of the auxiliary balancing loss (``aux_loss``, ``seq_aux_loss``)."""
    z_loss_coeff: float = 0.0
    """Weight of the router z-loss ``mean(logsumexp(logits)²)`` (0 turns it off)."""
    bias_update_rate: float = 1e-3
    """γ of ``aux_free``: each step ``b_e += γ·sign(mean load − load_e)``."""
    capacity_factor: float | None = None
    """Tokens each expert may take, as a multiple of the balanced share ``T·k/E`` of a rank's
    ``T`` tokens (under sequence parallel the TP rank's share of the sequence); assignments past
    it are dropped (in token order). None: dropless."""
    pad_to_capacity: bool = False
    """With a capacity factor: every expert computes exactly its capacity (static shapes)."""
    n_shared_experts: int = 0
    """Always-on shared experts (DeepSeek), one SwiGLU MLP of ``n_shared·shared_ffn_dim``."""
    shared_ffn_dim: int | None = None
    """Hidden size of one shared expert; None uses ``expert_ffn_dim``."""
    dispatcher: str = "all_to_all"
    """How tokens reach their experts over the ep group: ``all_to_all`` (uneven splits) or
    ``all_gather`` (every rank sees every token; for small groups)."""
    shared_expert_overlap: bool = True
    """Run the shared experts while the all-to-all dispatcher's expert counts travel to the
    host (ep > 1), not after the routed experts (Megatron-Core's ``moe_shared_expert_overlap``).
    Changes no value, only when the host waits."""

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "expert_ffn_dim", "n_group", "topk_group"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"moe.{name}={value!r} must be a positive integer")
        if self.n_shared_experts < 0:
            raise ValueError(f"moe.n_shared_experts={self.n_shared_experts} must be >= 0")
        if self.top_k > self.num_experts:
            raise ValueError(f"moe.top_k={self.top_k} exceeds moe.num_experts={self.num_experts}")
        if self.score_function not in SCORE_FUNCTIONS:
            raise ValueError(
                f"moe.score_function={self.score_function!r}; valid: {', '.join(SCORE_FUNCTIONS)}"
            )
        if self.balancing not in BALANCING_MODES:
            raise ValueError(
                f"moe.balancing={self.balancing!r}; valid: {', '.join(BALANCING_MODES)}"
            )
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(f"moe.dispatcher={self.dispatcher!r}; valid: {', '.join(DISPATCHERS)}")
        if self.num_experts % self.n_group:
            raise ValueError(
                f"moe.n_group={self.n_group} does not divide moe.num_experts={self.num_experts}"
            )
        if self.topk_group > self.n_group:
            raise ValueError(f"moe.topk_group={self.topk_group} exceeds moe.n_group={self.n_group}")
        if self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError(
                f"moe.top_k={self.top_k} exceeds the {self.topk_group} groups × "
                f"{self.num_experts // self.n_group} experts a token may choose from"
            )
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(
                f"moe.capacity_factor={self.capacity_factor} must be > 0 (or null for dropless)"
            )
        if self.pad_to_capacity and self.capacity_factor is None:
            raise ValueError("moe.pad_to_capacity=true needs a moe.capacity_factor")
        for name in ("aux_loss_coeff", "z_loss_coeff", "bias_update_rate"):
            if getattr(self, name) < 0:
                raise ValueError(f"moe.{name}={getattr(self, name)} must be >= 0")
        if not self.routed_scaling_factor > 0:
            raise ValueError(f"moe.routed_scaling_factor={self.routed_scaling_factor} must be > 0")
        if self.shared_ffn_dim is not None and self.shared_ffn_dim < 1:
            raise ValueError(f"moe.shared_ffn_dim={self.shared_ffn_dim} must be positive")

    @property
    def shared_hidden_dim(self) -> int:
        """Hidden size of the one MLP that holds all shared experts (0 without them)."""
        return self.n_shared_experts * (self.shared_ffn_dim or self.expert_ffn_dim)

    def check_expert_parallel(self, ep: int) -> None:
        """``ep`` ranks must split the routed experts evenly."""
        if self.num_experts % ep:
            raise ValueError(f"parallel.ep={ep} does not divide moe.num_experts={self.num_experts}")
