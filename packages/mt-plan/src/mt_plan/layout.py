"""A parallel layout and the trainer's rules for it, mirrored in pure Python.

:func:`layout_problem` answers the question mt-train answers when it composes a config and
checks the world size (``ParallelConfig.__post_init__``, the family's ``check_parallel``,
``TrainConfig.__post_init__`` / ``check_world``, ``ParallelDims``): None when the trainer would
run the layout, else the first rule it breaks. It is a mirror, not a call, because those checks
live in modules that import torch and the search must not; ``test_plan_rules.py`` holds the two
to the same verdict on every layout of a grid. Rules (``w`` world, ``m`` micro-batches):

* ``dp = w / (tp·cp·pp)`` integral; ``global_batch % (micro_batch·dp) == 0``, ``m =
  global_batch / (micro_batch·dp)``;
* tp divides heads, KV heads, vocabulary, FFN widths (the family's list); sp needs tp > 1
  (every family allows it); ``seq % 2cp == 0`` for cp > 1; ``(seq / cp) % tp == 0`` with sp;
  ``cp_attention`` one of :data:`CP_ATTENTION` (any cp; the runtime uses it at cp > 1 only),
  ``ring`` at cp > 1 refused with ``model.dropout > 0`` (the ring has no attention dropout);
* ``recompute_every`` a positive integer (used by full recompute only, as in the trainer);
* ep divides the experts (dense models ignore it) and dp·cp, needs ``data_parallel=ddp``; MTP
  refuses pp;
* pp: the schedule's chunks per rank (interleaved ≥ 2, zbv/dualpipev exactly 2, others 1),
  ``m ≥ pp`` (gpipe: any; dualpipev ``2·pp``), interleaved schedules at v > 1 run
  micro-batches in rounds (``m`` a multiple of ``m // pp`` rounds), no FSDP;
* the blocks of each pipeline chunk (:func:`split_layers`, mt-parallel's function of the same
  name mirrored): ``pp_layers`` (``parallel.pp_layers``) needs pp > 1 and ``pp·v`` entries,
  non-negative integers summing to the model's layers (chunks may be empty); without it
  ``layers ≥ pp·v`` and the automatic split.

:func:`split_layers` is the trainer's ``mt_parallel.pipeline.split.split_layers`` rewritten
without torch (that module imports it); ``test_plan_rules.py`` holds the two to the same counts
and the same error messages on every case of a grid.
"""

from __future__ import annotations

from dataclasses import dataclass

from mt_plan.shape import ModelShape

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev")
SPLIT_BACKWARD = ("zero_bubble", "zbv", "dualpipev")
V_SCHEDULES = ("zbv", "dualpipev")
DP_MODES = ("ddp", "fsdp", "zero1")
RECOMPUTE = ("none", "selective", "selective_mlp", "full", "full_keep")
"""``selective``: the attention core; ``selective_mlp``: attention core and SwiGLU;
``full_keep``: full with ``recompute_keep=[attention]``."""
FULL_RECOMPUTE = ("full", "full_keep")
"""The policies that checkpoint whole blocks, every ``recompute_every``-th one."""
FP8_RECIPES = ("none", "tensorwise", "rowwise", "blockwise", "delayed", "mxfp8")
CP_ATTENTION = ("all_gather", "ring")
"""``parallel.cp_attention``: K/V all-gathered per layer, or passed around the cp ring."""


@dataclass(frozen=True)
class Layout:
    """One candidate: every knob the search turns."""

    tp: int = 1
    cp: int = 1
    cp_attention: str = "all_gather"
    """How attention crosses the cp group (``parallel.cp_attention``, :data:`CP_ATTENTION`)."""
    pp: int = 1
    dp: int = 1
    ep: int = 1
    sp: bool = False
    vpp: int = 1
    """Chunks per pipeline rank (``parallel.pp_chunks``)."""
    schedule: str = "1f1b"
    dp_mode: str = "ddp"
    micro_batch: int = 1
    recompute: str = "none"
    recompute_every: int = 1
    """With a :data:`FULL_RECOMPUTE` policy: ``parallel.recompute_every`` (the runtime ignores
    it under the others, and so does the cost model)."""
    fp8: str = "none"
    pp_layers: tuple[int, ...] = ()
    """Blocks of each pipeline chunk in stage order (``parallel.pp_layers``, ``pp·v``
    entries); empty: the trainer's automatic split (:func:`split_layers`)."""

    def __post_init__(self) -> None:
        # a list from a config becomes a tuple: layouts are hashed (the cost model's caches)
        object.__setattr__(self, "pp_layers", tuple(self.pp_layers))

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def chunks_per_rank(self) -> int:
        if self.pp == 1:
            return 1
        return 2 if self.schedule in V_SCHEDULES else self.vpp

    def microbatches(self, global_batch: int) -> int:
        return global_batch // (self.micro_batch * self.dp)

    def overrides(self, global_batch: int) -> list[str]:
        """The mt-train overrides that run this layout."""
        out = [
            f"parallel.tp={self.tp}", f"parallel.cp={self.cp}", f"parallel.pp={self.pp}",
            f"parallel.data_parallel={self.dp_mode}",
            f"trainer.micro_batch_size={self.micro_batch}",
            f"trainer.global_batch_size={global_batch}",
        ]  # fmt: skip
        if self.sp:
            out.append("parallel.sequence_parallel=true")
        if self.cp_attention != "all_gather":
            out.append(f"parallel.cp_attention={self.cp_attention}")
        if self.ep > 1:
            out.append(f"parallel.ep={self.ep}")
        if self.pp > 1:
            out.append(f"parallel.pp_schedule={self.schedule}")
            if self.schedule in ("interleaved_1f1b", "zero_bubble") and self.vpp > 1:
                out.append(f"parallel.pp_chunks={self.vpp}")
            if self.pp_layers:
                out.append(f"parallel.pp_layers=[{','.join(map(str, self.pp_layers))}]")
        if self.recompute == "selective":
            out.append("parallel.recompute=selective")
        elif self.recompute == "selective_mlp":
            out += ["parallel.recompute=selective", "parallel.recompute_targets=[attention,mlp]"]
        elif self.recompute == "full":
            out.append("parallel.recompute=full")
        elif self.recompute == "full_keep":
            out += ["parallel.recompute=full", "parallel.recompute_keep=[attention]"]
        if self.recompute in FULL_RECOMPUTE and self.recompute_every != 1:
            out.append(f"parallel.recompute_every={self.recompute_every}")
        if self.fp8 != "none":
            out.append(f"fp8={self.fp8}")
        return out

    def label(self) -> str:
        ring = "/ring" if self.cp > 1 and self.cp_attention == "ring" else ""
        parts = [f"tp{self.tp}{'+sp' if self.sp else ''}", f"cp{self.cp}{ring}", f"dp{self.dp}"]
        if self.pp > 1:
            parts.append(f"pp{self.pp}/{self.schedule}" + (f"/v{self.vpp}" if self.vpp > 1 else ""))
            if self.pp_layers:
                parts[-1] += f"/layers{','.join(map(str, self.pp_layers))}"
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        recompute = self.recompute
        if recompute in FULL_RECOMPUTE and self.recompute_every != 1:
            recompute += f"/every{self.recompute_every}"
        return " ".join([*parts, self.dp_mode, f"mb{self.micro_batch}", recompute, self.fp8])


def split_layers(
    num_layers: int, num_chunks: int, layers: tuple[int, ...] | list[int] = ()
) -> list[int]:
    """Blocks per pipeline chunk, as ``mt_parallel.pipeline.split.split_layers`` splits them
    (its ranges' lengths, its ``ValueError`` messages): the user's ``layers`` when given (one
    non-negative integer per chunk, summing to ``num_layers``), else ``⌊L/C⌋`` each with the
    remainder given to the middle chunks first, then chunk 0, then the last (they also hold the
    embedding and the head)."""
    if num_chunks < 1:
        raise ValueError(f"a pipeline needs at least one chunk, got {num_chunks}")
    if layers:
        counts = list(layers)
        if len(counts) != num_chunks:
            raise ValueError(
                f"parallel.pp_layers={counts} has {len(counts)} entries; the pipeline has "
                f"{num_chunks} chunks (pp·pp_chunks)"
            )
        if any(not isinstance(c, int) or c < 0 for c in counts):
            raise ValueError(f"parallel.pp_layers={counts} must be non-negative integers")
        if sum(counts) != num_layers:
            raise ValueError(
                f"parallel.pp_layers={counts} sums to {sum(counts)}, the model has "
                f"{num_layers} layers"
            )
        return counts
    if num_layers < num_chunks:
        raise ValueError(
            f"{num_layers} layers cannot be split into {num_chunks} pipeline chunks "
            "(pp·pp_chunks) of at least one layer each; lower pp or pp_chunks, or give "
            "parallel.pp_layers (chunks may be empty there)"
        )
    base, extra = divmod(num_layers, num_chunks)
    counts = [base] * num_chunks
    middle_first = [*range(1, num_chunks - 1), 0, num_chunks - 1]
    for chunk in middle_first[:extra] if num_chunks > 2 else range(extra):
        counts[chunk] += 1
    return counts


def minimum_microbatches(schedule: str, pp: int, v: int) -> int:
    """As ``mt_parallel.pipeline.schedules.minimum_microbatches``."""
    if schedule == "gpipe" or pp == 1:
        return 1
    return pp * v if schedule == "dualpipev" else pp


def layout_problem(
    layout: Layout, model: ModelShape, world: int, global_batch: int, seq_len: int
) -> str | None:
    """The first trainer rule ``layout`` breaks (module docstring), or None."""
    L = layout
    if L.tp * L.cp * L.pp * L.dp != world:
        return f"dp·cp·tp·pp = {L.dp}·{L.cp}·{L.tp}·{L.pp} does not equal the world size {world}"
    if global_batch % L.micro_batch or global_batch % (L.micro_batch * L.dp):
        return f"global batch {global_batch} is not a multiple of micro_batch·dp = {L.micro_batch}·{L.dp}"
    for name, value in model.tp_divides:
        if value % L.tp:
            return f"tp={L.tp} does not divide {name}={value}"
    if model.attention == "gqa" and model.n_heads % model.n_kv_heads:
        return f"num_heads={model.n_heads} is not a multiple of num_kv_heads={model.n_kv_heads}"
    if L.sp and L.tp == 1:
        return "sequence parallel needs tp > 1"
    if L.cp > 1 and (not model.supports_cp or seq_len % (2 * L.cp)):
        return f"cp={L.cp} needs the family's support and seq_len % 2·cp == 0 (seq {seq_len})"
    if L.cp_attention not in CP_ATTENTION:  # ParallelConfig's wording
        return f"parallel.cp_attention={L.cp_attention!r}; valid: {', '.join(CP_ATTENTION)}"
    if L.cp > 1 and L.cp_attention == "ring" and model.dropout > 0:
        return (
            f"parallel.cp_attention=ring with model.dropout={model.dropout}: ring attention "
            "has no attention dropout"
        )
    if L.sp and (seq_len // L.cp) % L.tp:
        return f"sequence parallel needs (seq/cp) % tp == 0, got {seq_len}/{L.cp} over {L.tp}"
    if L.ep > 1:
        if model.moe and model.num_experts % L.ep:  # dense models ignore ep
            return f"ep={L.ep} does not divide the experts ({model.num_experts})"
        if (L.dp * L.cp) % L.ep:
            return f"ep={L.ep} does not divide dp·cp = {L.dp * L.cp}"
    if L.dp_mode not in DP_MODES:
        return f"data_parallel={L.dp_mode!r}; valid: {', '.join(DP_MODES)}"
    if L.recompute not in RECOMPUTE or L.fp8 not in FP8_RECIPES:
        return f"recompute={L.recompute!r} / fp8={L.fp8!r} unknown"
    every = L.recompute_every
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        return f"recompute_every={every!r} must be a positive integer"
    if L.pp == 1:
        if L.vpp != 1 or L.pp_layers:
            return (
                f"parallel.pp_chunks={L.vpp} / pp_layers={list(L.pp_layers)} need pipeline "
                "parallelism (pp > 1)"
            )
        return None
    if not model.supports_pp:
        return f"the {model.family} family (model {model.name}) does not run pp > 1"
    if L.schedule not in SCHEDULES:
        return f"pp_schedule={L.schedule!r}; valid: {', '.join(SCHEDULES)}"
    if L.schedule == "interleaved_1f1b" and L.vpp < 2:
        return "interleaved_1f1b needs pp_chunks >= 2"
    if L.schedule in ("gpipe", "1f1b", *V_SCHEDULES) and L.vpp != 1:
        return f"{L.schedule} takes pp_chunks=1 (the search's vpp)"
    v = L.chunks_per_rank()
    if L.pp_layers and len(L.pp_layers) != L.pp * v:  # ParallelConfig's wording
        return (
            f"parallel.pp_layers={list(L.pp_layers)} needs pp·chunks = {L.pp}·{v} "
            f"= {L.pp * v} entries ({L.schedule})"
        )
    try:
        split_layers(model.n_layers, L.pp * v, L.pp_layers)
    except ValueError as error:
        return str(error)
    m = L.microbatches(global_batch)
    need = minimum_microbatches(L.schedule, L.pp, v)
    if m < need:
        return f"{L.schedule} at pp={L.pp} needs >= {need} micro-batches, got {m}"
    if L.schedule in ("interleaved_1f1b", "zero_bubble") and v > 1:
        rounds = max(1, m // L.pp)
        if m % rounds:
            return f"{m} micro-batches do not split into {rounds} rounds"
    return None
