"""The cost model: step time, memory per rank and communication of one layout (pure Python).

Notation: ``b`` micro-batch, ``s`` sequence, ``T = b·s/cp`` tokens a rank's linears see per
micro-batch (sequence parallel all-gathers them back to ``T``), ``T_n = T/tp`` with sequence
parallel else ``T`` (the norm/residual region), ``A`` bytes per activation element (2 under bf16
autocast, 4 in fp32), ``m`` micro-batches per step per rank, ``W = dp·cp`` the gradient group.

Compute, per decoder layer and micro-batch, in three parts (the pipeline simulator's ``F``, ``I``,
``W``): every linear as a GEMM (forward ``M×N×K``, input gradient ``M×K×N``, weight gradient
``N×K×M``, each priced from the table's entries of that pass, timed with the operand layouts
training gives it: :mod:`mt_plan.calibration`, "GEMM passes"; FP8 recipes run the block linears'
GEMMs in ``fp8_<recipe>`` and add the quantization of inputs and output gradients as memory-bound
ops, below; the output head and the fp32 router stay high precision; every bf16 linear under
autocast also pays its fp32 weight's cast to bf16 each forward and its bf16 weight gradient's cast
back to fp32, ``(4+A)·N·K`` bytes each as copies: ``weight_cast``), the attention core (causal:
``b·(H/tp)·(s²/2cp)·2·(d_qk + d_v)`` forward FLOPs, a FlashAttention backward of 2.5× that), and
memory-bound ops by the bytes they must move (RMSNorm, residual adds, RoPE, SwiGLU, MoE
permutation, cross-entropy) at the bandwidth their calibration achieved
(:data:`~mt_plan.calibration.HARNESS_TRAFFIC`). SwiGLU's kernels read gate and up and write the
product (``3A`` per element) forward and read those three and write two gradients (``5A``)
backward; cross-entropy reads the logits forward (``A``) and reads them and writes their gradient
(``2A``) backward. Times come from :class:`~mt_plan.calibration.CalibrationTable`. Recompute adds
to ``I``: ``full`` the whole block forward again (``full_keep`` without the attention core),
``selective`` the attention core, ``selective_mlp`` the core and SwiGLU (under FP8 only the core:
the FP8 down projection quantizes SwiGLU's product from gate and up, so there is no SwiGLU module
to recompute).

Full recompute every ``N`` blocks (``recompute_every``, :meth:`CostModel.recomputed_layers`), as
mt-parallel's ``apply_recompute`` picks them: it numbers from 0 the blocks of the module it is
given, which is the whole model at pp = 1 and each pipeline chunk under pp (mt-parallel
parallelizes every chunk on its own), and checkpoints block ``j`` when ``j % N == 0``. At pp = 1
the VLM's vision blocks come first in that numbering (``ModelShape.blocks_before``); in a chunk
the decoder's blocks come first (the chunk registers the decoder's container with its
embedding, before the vision tower). The blocks it skips are priced as ``recompute="none"``:
all their activations saved, their bf16 weight copies kept, no second forward, no repeated
collectives.

Pipeline stages. The decoder layers of each chunk are ``Layout.pp_layers`` or the trainer's
automatic split (:func:`~mt_plan.layout.split_layers`: the remainder to the middle chunks
first); chunk 0 also runs the embedding (and the VLM's vision encoder), the last chunk the
head and the loss. Each chunk's ``F``, ``I``, ``W`` sum its own layers, ends and
stage-boundary p2p, and mt-parallel's simulator times the schedule with each chunk's own
(:mod:`mt_plan.pipeline`; the bubble then includes the idling that uneven chunks cause). After the
schedule every pipeline rank reduces its own gradients and steps its own optimizer, so the step
ends with the rank slowest at both (:meth:`CostModel._optimizer`); memory is the fullest rank's,
each rank counting the parameters and saved activations of its own chunks. Compute classes and
collective bytes in the breakdown are pipeline rank 0's.

FP8 quantization, as mt-fp8 runs it (:mod:`mt_fp8.linear_plan`). Each quantized activation or
output gradient becomes an FP8 GEMM operand and its transpose (2 bytes written per element)
after :data:`QUANTIZE_READS` reads of the high-precision tensor (tensorwise: an amax launch, then
the cast; delayed: one, the amax is recorded in the cast; blockwise and MXFP8: a row-group and a
column-group kernel; rowwise: the row kernel, the column amax and the column cast). The
calibration's ``quantize`` rate is the current tensorwise quantizer's, rated per ``A + 2`` bytes
while it moves ``2A + 2``, so a quantization moving ``B`` bytes is priced as ``B·(A+2)/(2A+2)``
of them at that rate. Layers reading one tensor share its quantization (``quantize_shared_input``:
q/k/v, gate/up, MLA's kv_a and q_a or q under current scaling); the down projection's input
``silu(gate)·up`` is quantized straight from gate and up under tensorwise and delayed scaling
(SwiGLU's forward does not run; the quantizer reads ``2A`` bytes per element), and computed, then
quantized, under the other recipes. The FP8 weight and its transpose are quantized once per step
from the fp32 weight (the weight cache), :data:`WEIGHT_READS` reads (rowwise adds an FP8 byte
transpose, its fp32 column cast stores untransposed), charged with the optimizer. The routed
experts' weights are priced as the dense ones, because on CUDA they move the same bytes:
under tensorwise scaling mt-fp8's grouped path reads the fp32 stack once for the per-expert
∞-norm (4 bytes per weight) and once more in the one Triton launch that writes ``W`` and
``Wᵀ`` (4 read, 1 + 1 written): 10 bytes, the dense weight's two reads plus two FP8 writes;
under delayed scaling the experts run the per-expert loop, whose weights take the dense fused
quantizer (4 read, 1 + 1 written). (The grouped path's eager requantization, a cast with health
counts and an FP8 transpose copy, runs only where Triton does not, which a CUDA calibration
does not price; docs/plan.md, "Measured again", counted its bytes.) Rowwise
GEMMs write bf16 only, so each weight gradient is converted to fp32 (6 bytes per weight), charged
as a copy unless the table has ``fp8_rowwise`` ``gemm_wgrad`` entries, which time the
conversion inside the GEMM call.

Routed experts: the gate, up and down projections of ``rows = T_n·k`` rows over the rank's
``E/ep`` experts (mt-parallel's ``GroupedLinear`` and, under FP8, mt-fp8's ``FP8GroupedLinear``).
In bf16 on CUDA mt-parallel's ``GroupedExperts`` pads the MLP's rows once for its three
projections: the input's rows copied into a zeroed buffer of aligned groups and the output's
rows gathered back at the end, ``A·(3·rows·D + 2·rows·D)`` bytes forward, the gather's scatter
into zeros and the copy's gather ``A·(2·rows·D + 3·rows·D)`` backward, charged as copies
(``expert_padding``), over ``ep > 1`` ranks only: with every expert local the permutation writes
the rows into the padded groups itself and the combine reads them there (mt-parallel's
``dispatch_and_combine``), so the padding costs nothing beyond the permute, whose zero rows
between groups are not charged; FP8 does not pad. Where the table has ``grouped_linear`` entries for the
precision (bf16, the recipe, else ``fp8_tensorwise``) each projection's forward and backward
are priced from them (nearest shape, never faster than the roofline), the backward split evenly
between ``I`` and ``W``: they time one ``GroupedLinear`` (``FP8GroupedLinear``) called alone, so
quantization, weight casts and per-expert GEMMs are inside, and in bf16 also the padding a lone
projection runs around itself (its input of width ``K`` padded, its output of width ``N``
unpadded: ``A·(3·rows·K + 2·rows·N)`` bytes forward, ``A·(2·rows·K + 3·rows·N)`` backward). The
MLP does not run that per-projection padding, so it is subtracted from each pass at the copy
rate, never below the pass's GEMM roofline (the entry still pays for the GEMM), and the MLP's one
padding is charged as above. ``experts`` then holds the projections' time without padding and
``expert_padding`` the padding, in both paths: the same names for the same work, each a time the
runtime spends (a negative "saved" class beside the entries' time would not say what runs).
Without entries (the shipped H200 table predates them; the H100 table has them): bf16 prices
its three GEMMs at ``grouped_gemm`` rates and adds as copies the fp32 weight's cast to the
autocast dtype in each projection's forward and the gradient's cast back (``(4+A)·E·N·K``
bytes each, as the dense linears' ``weight_cast``), plus the MLP's padding; FP8 prices its
GEMMs as a dense linear's (``grouped_gemm`` at ``fp8_<recipe>``, which no table measures, so
the bf16 rate scaled to the FP8 peak) plus the quantization of input and output gradient,
which misses the grouped FP8 path's per-group work; ``--explain`` says which applies. The
router's fp32 GEMM is priced as a bf16 one, and routing, top-k and the balancing losses are not
charged (``T·E``-sized).

Communication, by group and collective (payloads in :mod:`mt_plan.comm`'s sense), and what our
runtime overlaps (read from the code, see docs/architecture.md "Planner"):

* tp: per dense layer and micro-batch, forward two all-reduces of ``T·D`` (attention and MLP
  outputs, row-parallel) and backward two of the block inputs' gradients (column-parallel
  entries); with sequence parallel each is an all-gather plus a reduce-scatter of ``T·D``. MoE
  layers exchange only their shared experts' (routed experts are not TP-split); with sequence
  parallel the router and routed experts run on the rank's ``T/tp`` tokens and their fp32
  weight gradients are all-reduced over tp: the router's in every micro-batch's backward, the
  experts' there too at ep = 1 (the data-parallel engine reduces them as dense parameters) and
  at ep > 1 once per step, exposed, with their expert-data reduction, on the gradients
  accumulated over the micro-batches: the local experts' whole gradients under ddp (the
  expert-data and TP sums in one pass), this rank's ``1/edp`` shard of them after the
  expert-data reduce-scatter under zero1 and fsdp (``edp = dp·cp/ep``; the TP ranks of one edp
  rank shard the same experts alike); the router's E-sized
  statistics sums are latency-bound scalars, not counted. MLA with
  sequence parallel gathers its latents (``T·(Q+C+R)``, plus ``T·D`` without q-lora) instead
  of ``T·D`` and sums its replicated compressions' and latent norms' gradients. Embedding
  (vocab-parallel, fp32 output) one all-reduce of ``T·D`` forward, the head one of ``T·D``
  backward, cross-entropy three fp32 values per token. Not overlapped (synchronous autograd
  functions); the forward ones repeat under full recompute.
* cp (``all_gather``): K and V all-gathered per layer forward, their gradients reduce-scattered
  backward; not overlapped. MLA gathers its compressed latent ``[c ; k_rot]`` instead
  (``b·s·(C+R)``, the same on every tp rank) and expands it on every cp rank: its ``kv_b``
  GEMMs are priced on ``b·s`` tokens, and the whole sequence's k and v are saved (GQA's too:
  the core keeps the gathered k and v).
* cp (``ring``): p2p sends to the next cp rank overlapped with the block attention, below.
* ep: all-to-all of ``T·k·D`` at dispatch and combine, forward and backward; not overlapped.
* pp: one p2p of the fp32 hidden state ``4·T·D`` (``/tp`` with sp) per micro-batch and stage
  boundary each way, charged to the chunk's ``F`` and ``I``.
* dp (over dp×cp): ddp one all-reduce of the fp32 gradients per step (expert parameters over
  the expert-data group), overlapped with the last micro-batch's backward (DDP's buckets; the
  last bucket stays exposed): at pp = 1 the step's last backward, under a pipeline without a
  split backward the last backward of the rank's chunk that finishes last (mt-train's
  per-chunk buckets, started as autograd completes them; counted as the only overlap, though
  a rank's other chunks finish earlier), exposed after the schedule under the split-backward
  schedules (their ``W`` sets the gradients outside autograd's accumulation, so the buckets
  start at the chunk's ``REDUCE_GRAD``); zero1 a reduce-scatter of the gradients and an all-gather of the updated
  fp32 parameters, exposed; fsdp an all-gather of each block's parameters in forward and in
  backward of every micro-batch and a reduce-scatter at the last, prefetched: exposed only where
  it exceeds the compute it hides behind; fsdp under pp one all-gather of each chunk's
  parameters per step (kept through the schedule) and one reduce-scatter after its last
  backward, exposed as ddp's all-reduce is. Under zero1 and fsdp expert parameters take the
  same collectives over the expert-data group instead of dp×cp.

Ring attention (``cp_attention=ring``, mt-parallel's :mod:`mt_parallel.ring_attention`), per
layer and micro-batch on a rank of ``c = cp`` with ``t = s/c`` local tokens (the load-balanced
chunks ``r`` and ``2c−1−r``, so every rank does the same work). The message is the rank's K|V
(GQA, ``b·t·2·H_kv·hd`` values) or its latent ``[c ; k_rot]`` (MLA, ``b·t·(C+R)``), in the
activation dtype; its gradient travels in fp32. Forward: steps ``0..c−1``; step ``j < c−1``
sends the held block on while computing, so it takes ``max(p2p, block_j)``, the last step only
its block. Backward: the ring again (``c−1`` block sends) plus ``c`` gradient sends, step ``j``
overlapping its block backward with the block send and the previous step's gradient send
(``max(p2p_kv + p2p_grad, block_j)``), the last gradient hop exposed. Only the seconds beyond
the blocks count in ``F`` and ``I`` and as the cp group's exposed time; its payload counts
every send. The blocks run as the runtime runs them on a GPU in bf16 without document masks
(since 24788cd): one call of PyTorch's flash attention each, step 0 scoring ``t×t/2`` pairs
under the causal mask, every later step ``t×t/2`` unmasked (all queries × the early chunk, or
the late queries × all keys), so the steps together score the all-gather core's pairs; each
block is priced at the calibrated attention core's rate for the local shape (``attention_fwd``
and ``attention_bwd``, its share of the pairs; a value head dim below the key's is padded to
it, as the runtime pads MLA's), plus :data:`RING_MERGE_PASSES` fp32 output-sized passes per
step (the merge forward, the ``dQ`` sum backward) and, on step 0, the copy that expands GQA's
K/V to the query heads, at the copy rate. MLA expands every block it holds with ``kv_b``
(``b·s`` tokens over the ring, as all-gather) and again in the backward (one more forward of
``kv_b``, charged to ``I``); the expansion's share of each step counts as compute the sends
hide behind. Recompute that reruns the core (``selective``, ``full``) runs the ring forward
again, sends and expansions and all. Saved: the rank's own message (no expanded or gathered
K/V) and the fp32 output beside the core's. Not charged: the ``dK, dV`` buffers (``t``-sized)
and the smaller block efficiency of short local sequences beyond what the table's shapes say.
The runtime's plain-formula blocks (document masks, fp32 on the GPU) are not priced. At cp = 1
the runtime runs no ring, and the price is that of no context parallelism.

Host time (the floor of a host-bound step). The host enqueues every kernel before the device
runs it, so a step is never shorter than the host's work, and where the host waits for the
device (a device-to-host read) the device cannot run ahead of it either. Per decoder layer,
micro-batch and pass the host spends ``launches × t_launch + reads × t_read``
(:meth:`~mt_plan.calibration.CalibrationTable.host_seconds`): ``launches`` from
:data:`KERNEL_LAUNCHES` (counted on the runtime, below) plus one per collective of the layer,
``reads`` from :data:`EXPERT_MLP_HOST_READS` and :data:`DISPATCH_HOST_READS`; full recompute
repeats the forward's launches and reads in the backward. A read waits for everything queued
before it, so the reads cut the step into segments, and each segment costs ``max(device,
host)``; a step without reads costs ``max(Σ device, Σ host)`` (the host runs ahead of the
device). The model places a layer's reads at the start of its forward (they follow its
attention, router and permutation; over a run of equal layers the segments between reads are
one layer's forward either way) or, recomputed, of its backward; the step begins and ends
synchronized. Under pp each chunk's ``F``, ``I`` and ``W`` are floored on their own before the
pipeline simulator times them (the backward's host time split between ``I`` and ``W`` as their
device time is): the simulator has no host queue, so the host is not let run ahead across
schedule ops. Not counted: the optimizer's and the data-parallel reduction's launches (few,
fused), the all-to-all dispatcher's own copies at ep > 1 (counted: its collectives and its
read), selective recompute's core launches.

Launch counts (:data:`KERNEL_LAUNCHES`) are data measured from mt's runtime by ``packages/mt-
plan/tests/plan_launch_counts.py``, and a test keeps them equal to it: tiny models of each
family (Llama, Mixtral, DeepSeek-V2-Lite with and without MoE) on the CPU, one forward and
backward under bf16 autocast, every aten op that launches a kernel on CUDA counted (views,
allocations and metadata not), every Triton kernel as one (mt-fp8's fused ops run their Triton
kernels in Triton's interpreter) and every FP8 GEMM call as one, with the grouped FP8 path
forced as on Hopper and every expert routed the same number of tokens; a layer's count is the
difference of the model with two layers and with one, the per-expert count the difference of two
expert counts (the per-expert loops of E5M2 gradients and of delayed scaling grow with the local
experts). Models whose layers were not counted take their family's (DeepSeek-V3's q-lora layers
take V2-Lite's), and recipes without counts the one :data:`LAUNCH_RECIPE_STANDIN` names. The
embedding's, final norm's, head's and loss's kernels (:data:`END_LAUNCHES`) are counted with the
last chunk's head; the VLM's vision tower and the MTP modules are not counted.

Memory per rank (bytes): fp32 weights (trainer parameters are fp32 under autocast), gradients,
AdamW moments by mode (ddp: all, plus DDP's bucket copies when ``W > 1``; zero1: moments and a
master shard ``/W``; fsdp: everything ``/W`` plus two gathered blocks, under pp plus the
chunks' gathered weights and unreduced gradients, held through the schedule; expert parameters
``/(W/ep)`` in both), then what the forward builds and the backward frees: FP8 weight caches
(the FP8 weight and its transpose, 2 bytes per FP8 parameter, kept from the first forward until
the layer's backward in the step's last micro-batch frees them; none under FSDP), autocast's
bf16 copies of the high-precision linears' weights (the head, and every block linear without
FP8), which the backward keeps, activations (each layer's saved tensors by recompute policy,
times the micro-batches held: 1 without pp, with pp the simulator's most chunks a rank holds
from their forward to their weight gradient, :mod:`mt_plan.pipeline`), and on the last
stage the logits and their gradient. Holding to the weight gradient is what torch's split
backward does (torch >= 2.13, which the planner assumes): a zero-bubble schedule's ``I``
keeps every tensor the weight gradients need, in a transformer block nearly all it saved,
until ``W`` (:mod:`mt_parallel.pipeline.memory`), so ZB-H1 holds ``p`` stage activations on
every rank where 1F1B holds ``p − r``; without a separate ``W`` (GPipe, 1F1B, interleaved) the
count ends at the full backward. A chunk with a weight-gradient sink (FP8 layers, and every
chunk of a split-backward schedule on torch < 2.13) frees its autograd graph at ``I`` and
keeps only what the queued closures hold, the linears' inputs and output gradients, until
``W``; the model has no per-layer split of those from the rest, so it charges such chunks
their whole saved bytes to ``W`` too: an upper bound for them wherever the closures hold
fewer bytes than the chunk saved (a Llama block's do: its norms' fp32 inputs, attention's
q, k, v and SwiGLU's gate and up are saved but held by no closure). A split-backward schedule
over blocks recomputed whole runs such chunks through a sink too (mt-parallel's runtime:
torch's split would recompute a block once per weight group in ``W``): ``F`` keeps the block
inputs, ``I`` recomputes and the closures keep the recomputed linears' inputs and output
gradients until ``W``, more than the inputs (measured on gloo, ``test_pipeline_world2.py``); a
recomputed block is charged its bytes without recompute from ``F`` to ``W``, the same upper
bound (a chunk holds no more between ``F`` and ``I`` than after ``I``). Under full recompute the
checkpointed blocks keep no bf16 weight copy (autocast's cache holds them until the forward's
autocast region ends), and the largest of three moments counts: the forward's end (every
bf16 copy, the logits), the loss's backward (the head's copy, the logits and their gradient)
and a block's recomputation (its activations, built after the head's backward freed the
logits; the largest checkpointed block's). Blocks that ``recompute_every`` skips keep their
bf16 copies in the last two moments too (in the recomputation an upper bound: the skipped
blocks after the first recomputed one in backward order have freed theirs).
With ``m > 1`` (or pp) gradients live while the next micro-batch's forward tensors are built;
with ``m = 1`` they grow as those are freed, so the peak holds the larger of the two, plus, under
FP8, what the layer backpropagated last holds beside every gradient: its largest projection's FP8
weight and transpose (freed once that layer's backward has run) and, under rowwise scaling, the
bf16 result of its weight gradient before the conversion to fp32.
The allocator's overhead (fragmentation, reserved above allocated) is a fraction on top.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache

from mt_plan.calibration import FP8_REFERENCE, GEMM_PASSES, CalibrationTable, gemm_pass_shapes
from mt_plan.cluster import Cluster
from mt_plan.comm import collective_time, tier_of
from mt_plan.layout import FULL_RECOMPUTE, SPLIT_BACKWARD, V_SCHEDULES, Layout, split_layers
from mt_plan.pipeline import pipeline_timing
from mt_plan.shape import ModelShape

EXPERT_OPS = ("grouped_linear_fwd", "grouped_linear_bwd")
QUANTIZE_READS = {"tensorwise": 2, "delayed": 1, "rowwise": 3, "blockwise": 2, "mxfp8": 2}
"""Reads of a high-precision activation or gradient by mt-fp8's quantizer for its FP8 operand
and transpose, per recipe (module docstring, "FP8 quantization")."""
WEIGHT_READS = {"tensorwise": 2, "delayed": 1, "rowwise": 3, "blockwise": 1, "mxfp8": 2}
"""The same for the fp32 weight (blockwise: 128×128 blocks, transposed in the same pass), dense
and routed experts alike (module docstring, "FP8 quantization")."""
SWIGLU_FWD, SWIGLU_BWD = 3, 5
"""Activation-sized tensors SwiGLU's kernels move per element of ``gate``: forward reads gate and
up and writes the product; backward reads the product's gradient, gate and up and writes their
two gradients (the calibration's ``16A`` per element also counted its harness, module docstring
of :mod:`mt_plan.calibration`)."""
RING_MERGE_PASSES = 3
"""fp32 output-sized tensors a ring step moves beside its flash block: the forward merge reads
the running output and writes it back and reads the block's output (counted fp32), the
backward adds the block's ``dQ`` into its fp32 sum the same way (module docstring, "Ring
attention")."""


@dataclass(frozen=True)
class LaunchCounts:
    """Kernels one decoder layer launches per micro-batch (module docstring, "Launch counts")."""

    forward: float
    backward: float
    expert_forward: float = 0.0
    """More per local routed expert (the per-expert loops)."""
    expert_backward: float = 0.0


KERNEL_LAUNCHES: dict[str, LaunchCounts] = {
    "llama/none": LaunchCounts(35, 38),
    "llama/tensorwise": LaunchCounts(50, 45),
    "llama/rowwise": LaunchCounts(103, 73),
    "llama/delayed": LaunchCounts(72, 59),
    "moe/none": LaunchCounts(90, 59),
    "moe/tensorwise": LaunchCounts(283, 201, 5.875, 15),
    "moe/rowwise": LaunchCounts(335, 226),
    "moe/delayed": LaunchCounts(103, 68, 32.875, 18),
    "mla/none": LaunchCounts(65, 60),
    "mla/tensorwise": LaunchCounts(83, 67),
    "mla/rowwise": LaunchCounts(140, 95),
    "mla/delayed": LaunchCounts(112, 81),
    "mla_moe/none": LaunchCounts(128, 86),
    "mla_moe/tensorwise": LaunchCounts(294, 195, 8.125, 17.25),
    "mla_moe/rowwise": LaunchCounts(410, 268),
    "mla_moe/delayed": LaunchCounts(167, 104, 32.875, 18),
}
"""Kernel launches of one layer by ``<layer kind>/<recipe>``: ``llama`` (GQA attention, dense
MLP), ``moe`` (GQA, routed experts), ``mla`` (MLA, dense MLP), ``mla_moe`` (MLA, routed and
shared experts), as ``plan_launch_counts.py`` counted them at 3ee99fa (module docstring)."""
END_LAUNCHES: dict[str, tuple[int, int]] = {
    "llama/none": (11, 11),
    "llama/tensorwise": (13, 11),
    "llama/rowwise": (11, 11),
    "llama/delayed": (13, 11),
    "moe/none": (16, 11),
    "moe/tensorwise": (18, 11),
    "moe/rowwise": (16, 11),
    "moe/delayed": (18, 11),
    "mla_moe/none": (16, 11),
    "mla_moe/tensorwise": (18, 11),
    "mla_moe/rowwise": (16, 11),
    "mla_moe/delayed": (18, 11),
}
"""Kernel launches of the embedding, the final norm, the head and the loss (forward, backward)
by ``<family>/<recipe>`` (``mla`` layers' models are ``mla_moe``'s)."""
LAUNCH_RECIPE_STANDIN = {"blockwise": "tensorwise", "mxfp8": "tensorwise"}
"""Recipes without counts of their own and the recipe whose counts stand in for them."""
EXPERT_PATH = {
    "none": "grouped", "tensorwise": "grouped", "rowwise": "grouped", "delayed": "per_expert",
    "blockwise": "grouped_block", "mxfp8": "grouped_block",
}  # fmt: skip
"""The path the routed experts take under each recipe on Hopper (:func:`expert_path`):
``torch._grouped_mm`` (bf16), ``torch._scaled_grouped_mm`` (tensorwise, rowwise; E5M2 gradients
keep dgrad and wgrad per expert), mt-fp8's per-expert loop (delayed), mt-fp8's grouped block
GEMMs (blockwise, MXFP8, from :data:`BLOCK_GROUPED_MIN_EXPERTS` local experts)."""
BLOCK_GROUPED_MIN_EXPERTS = 16
"""mt-fp8's ``grouped.BLOCK_GROUPED_MIN_EXPERTS``: block and MXFP8 layers with fewer local
experts keep the per-expert loop under backend ``auto`` (a test keeps the two equal)."""
EXPERT_MLP_HOST_READS = {
    ("none", "grouped"): 0,
    ("tensorwise", "grouped"): 1,
    ("rowwise", "grouped"): 0,
    ("delayed", "per_expert"): 1,
    ("blockwise", "grouped_block"): 0,
    ("mxfp8", "grouped_block"): 0,
    ("blockwise", "per_expert"): 1,
    ("mxfp8", "per_expert"): 1,
}
"""Device-to-host reads per routed-expert MLP forward by (recipe, path): mt-parallel's
``GroupedExperts.forward`` reads the group sizes once (``sizes_L.tolist()``) for FP8
projections that need host ints (tensorwise's per-group E5M2 GEMMs, the per-expert loops);
bf16's grouped GEMM, rowwise's all-grouped path (2019e7d) and the grouped block GEMMs (a83be73)
take them on the device (``FP8GroupedLinear.reads_sizes_on_device``)."""
DISPATCH_HOST_READS = {"all_to_all": 1}
"""Reads per MoE layer forward of the dispatcher at ep > 1: the all-to-all's split sizes
(mt-parallel's ``dispatch._counts_to_host``)."""
SWIGLU_INTO_FP8 = ("tensorwise", "delayed")
"""Recipes whose down projection quantizes ``silu(gate)·up`` from gate and up (tensorwise INPUT
scales: ``LinearPlan.quantize_swiglu_input``'s fused path)."""


def expert_path(recipe: str, local_experts: int) -> str:
    """The routed experts' path under ``recipe`` with ``local_experts`` per rank
    (:data:`EXPERT_PATH`; block recipes below :data:`BLOCK_GROUPED_MIN_EXPERTS` loop)."""
    path = EXPERT_PATH[recipe]
    if path == "grouped_block" and local_experts < BLOCK_GROUPED_MIN_EXPERTS:
        return "per_expert"
    return path


@dataclass(frozen=True)
class Workload:
    """What is trained: sequence, global batch (sequences), precision and memory policy."""

    seq_len: int
    global_batch: int
    act_bytes: int = 2
    """Bytes per activation element: 2 (bf16 autocast, GPUs), 4 (fp32, the CPU default)."""
    allocator_overhead: float = 0.05
    """Reserved memory above the allocated peak, as a fraction of it."""
    headroom: float = 0.05
    """Fraction of the GPU's memory left unused by a layout that "fits"."""
    ddp_bucket_bytes: float = 25 * 2**20
    """torch DDP's default bucket size (its last bucket is not overlapped)."""


@dataclass
class GroupComm:
    group: str
    size: int
    tier: str
    payload_bytes: float = 0.0
    """Bytes handed to collectives per step by one rank (module docstring)."""
    seconds: float = 0.0
    exposed: float = 0.0


@dataclass
class Estimate:
    layout: Layout
    step_time: float
    tokens_per_s_per_gpu: float
    mfu: float
    peak_memory: float
    """Allocated peak plus allocator overhead, bytes."""
    fits: bool
    memory: dict[str, float]
    compute: dict[str, float]
    """Seconds per step per rank by op class (forward + backward + recompute)."""
    comm: dict[str, GroupComm]
    bubble_fraction: float
    optimizer_time: float
    roofline_share: float
    """Share of compute time priced by the roofline (no calibration entry)."""
    microbatches: int = 1
    notes: list[str] = field(default_factory=list)
    host_time: float = 0.0
    """Seconds the host spends enqueuing kernels and waiting on device-to-host reads per step
    (pipeline rank 0; module docstring, "Host time")."""
    host_floor: float = 0.0
    """Seconds the host-time floor adds to the step (0: the device bounds it)."""
    host_reads: int = 0
    kernel_launches: float = 0.0
    host_costs: tuple[float, float, str] = (0.0, 0.0, "")
    """(seconds per launch, per read, their source: ``measured`` or ``default``)."""

    @property
    def exposed_comm(self) -> float:
        return sum(g.exposed for g in self.comm.values())


@dataclass
class _Phase:
    fwd: float = 0.0
    igrad: float = 0.0
    wgrad: float = 0.0
    classes: dict[str, float] = field(default_factory=dict)
    roofline: float = 0.0

    def add(self, cls: str, fwd: float, igrad: float, wgrad: float, roofline: bool) -> None:
        self.fwd += fwd
        self.igrad += igrad
        self.wgrad += wgrad
        total = fwd + igrad + wgrad
        self.classes[cls] = self.classes.get(cls, 0.0) + total
        if roofline:
            self.roofline += total


@dataclass(frozen=True)
class _Piece:
    """One decoder layer (or a chunk's ends) of one micro-batch: device seconds by pass and
    host seconds, reads and launches forward and backward (module docstring, "Host time")."""

    forward: float
    igrad: float
    wgrad: float
    host_f: float
    host_b: float
    reads_f: int
    reads_b: int
    launches_f: float
    launches_b: float


def _timeline(pieces: list[_Piece]) -> list[tuple[float, float, int]]:
    """(device, host, reads) of one micro-batch's forward then backward in execution order: the
    layers forward, the ends (the last piece) forward and backward, the layers backward."""
    *layers, ends = pieces
    return [
        *((p.forward, p.host_f, p.reads_f) for p in layers),
        (ends.forward, ends.host_f, 0),
        (ends.igrad + ends.wgrad, ends.host_b, 0),
        *((p.igrad + p.wgrad, p.host_b, p.reads_b) for p in reversed(layers)),
    ]


def _segments(
    timeline: list[tuple[float, float, int]], t_read: float
) -> tuple[tuple[float, float], list[tuple[float, float]], tuple[float, float]] | None:
    """(before the first read, the segments between reads, after the last) as (device, host)
    seconds, a read's wait counted as host time of the segment it opens; None without reads."""
    device = host = 0.0
    first, inner = None, []
    for seconds, host_seconds, reads in timeline:
        if reads:
            if first is None:
                first = (device, host)
            else:
                inner.append((device, host))
            device, host = 0.0, reads * t_read
        device += seconds
        host += host_seconds
    return None if first is None else (first, inner, (device, host))


def _floored_step(pieces: list[_Piece], m: int, after: float, t_read: float) -> float:
    """Seconds of ``m`` micro-batches of ``pieces`` back to back and then ``after`` device
    seconds (the reduction and the optimizer), each segment between reads at ``max(device,
    host)``; without reads ``max(Σ device, Σ host)`` (module docstring, "Host time")."""
    timeline = _timeline(pieces)
    cut = _segments(timeline, t_read)
    if cut is None:
        device = sum(t[0] for t in timeline)
        host = sum(t[1] for t in timeline)
        return max(m * device + after, m * host)
    (first_d, first_h), inner, (last_d, last_h) = cut
    return (
        max(first_d, first_h)
        + m * sum(max(d, h) for d, h in inner)
        + (m - 1) * max(last_d + first_d, last_h + first_h)  # one micro-batch into the next
        + max(last_d + after, last_h)
    )


def _excess(floored: float, device: float) -> float:
    """What the floor adds to ``device`` seconds: 0 unless it binds beyond rounding."""
    return floored - device if floored > device * (1 + 1e-12) else 0.0


def _floor_excess(pieces: list[_Piece], m: int, after: float, t_read: float) -> float:
    """Seconds :func:`_floored_step` adds to the device's time of the same work."""
    device = m * sum(t[0] for t in _timeline(pieces)) + after
    return _excess(_floored_step(pieces, m, after, t_read), device)


def _floored_passes(pieces: list[_Piece], t_read: float) -> tuple[float, float, float]:
    """Seconds the floor adds to a pipeline chunk's ``F``, ``I``, ``W``, each floored alone
    (module docstring, "Host time"): the backward's host time split between ``I`` and ``W`` as
    their device time."""
    *layers, ends = pieces
    forward = [(p.forward, p.host_f, p.reads_f) for p in layers] + [(ends.forward, ends.host_f, 0)]

    def share(p: _Piece, part: float) -> float:
        total = p.igrad + p.wgrad
        return p.host_b * (part / total if total else 0.5)

    order = [ends, *reversed(layers)]
    igrad = [(p.igrad, share(p, p.igrad), p.reads_b) for p in order]
    wgrad = [(p.wgrad, share(p, p.wgrad), 0) for p in order]
    f, i, w = (
        _excess(_floored_step_of(t, t_read), sum(d for d, _, _ in t))
        for t in (forward, igrad, wgrad)
    )
    return f, i, w


def _floored_step_of(timeline: list[tuple[float, float, int]], t_read: float) -> float:
    """One run of ``timeline`` from and to a synchronized host, floored by segment."""
    cut = _segments(timeline, t_read)
    if cut is None:
        return max(sum(t[0] for t in timeline), sum(t[1] for t in timeline))
    first, inner, last = cut
    return sum(max(d, h) for d, h in (first, *inner, last))


@dataclass(frozen=True)
class _RingCost:
    """Ring attention of one layer and micro-batch (module docstring, "Ring attention")."""

    compute: tuple[float, float]
    """Seconds of the block attention, forward and backward (the blocks' expansions are
    ``attention_proj``'s)."""
    exposed: tuple[float, float]
    """Seconds of p2p not hidden behind the blocks, forward and backward."""
    sends: tuple[tuple[float, int], ...]
    """(bytes, count) of the messages one rank sends, both passes."""

    def with_forward_repeated(self, forward_sends: int) -> _RingCost:
        """The same with the forward run again in the backward (recompute)."""
        f, b = self.exposed
        return replace(self, exposed=(f, b + f), sends=(*self.sends, *self.sends[:forward_sends]))


@dataclass
class _LayerCost:
    phase: _Phase
    comm_fwd: tuple[tuple[str, str, float], ...]
    """(group, collective, payload bytes) of the forward, in the order they run."""
    comm_bwd: tuple[tuple[str, str, float], ...]
    """The same for the backward (with a recomputed forward's collectives)."""
    saved: float
    """Activation bytes kept for backward by one micro-batch."""
    full_acts: float
    """What the layer saves without recompute (the transient of a recomputed block)."""
    ring: _RingCost | None = None
    launches: tuple[float, float] = (0.0, 0.0)
    """Kernels launched, forward and backward (with a recomputed forward's; module docstring,
    "Host time")."""
    reads: tuple[int, int] = (0, 0)
    """Device-to-host reads, forward and backward."""


class CostModel:
    """Prices layouts of one model on one cluster with one calibration table."""

    def __init__(
        self, model: ModelShape, cluster: Cluster, table: CalibrationTable, workload: Workload
    ) -> None:
        self.model, self.cluster, self.table, self.work = model, cluster, table, workload
        self._layer = lru_cache(maxsize=4096)(self._layer_cost)
        self._collective = lru_cache(maxsize=65536)(self._collective_time)

    # -- compute primitives -------------------------------------------------------------------

    def _gemm(
        self, dtype: str, M: int, N: int, K: int, groups: int = 0, gemm_pass: str = "fwd"
    ) -> tuple[float, bool]:
        """One GEMM of a linear, ``M×N`` out over ``K``, priced from the table's entries of
        its pass (:mod:`mt_plan.calibration`, "GEMM passes"); ``groups``: a grouped GEMM, whose
        weight-sized operand (the output in wgrad) is per group."""
        gpu = self.cluster.gpu
        fp8 = dtype.startswith("fp8")
        peak = gpu.peak_fp8_flops if fp8 else gpu.peak_bf16_flops
        in_bytes = 1 if fp8 else 2
        flops = 2.0 * M * N * K
        per_group = max(groups, 1)
        if gemm_pass == "wgrad":  # FP8 writes the weight gradient in fp32
            moved = (M * K + K * N) * in_bytes + M * N * per_group * (4 if fp8 else 2)
        else:
            moved = (M * K + K * N * per_group) * in_bytes + M * N * 2
        op = f"grouped_gemm_{gemm_pass}" if groups else f"gemm_{gemm_pass}"
        shape = (M, N, K, groups) if groups else (M, N, K)
        seconds, source = self.table.compute_time(
            op, dtype, shape, flops, moved, peak, gpu.memory_bandwidth, gpu.peak_bf16_flops
        )
        return seconds, source == "roofline"

    def _membound(self, op: str, bytes_moved: float, shape: tuple[int, ...]) -> tuple[float, bool]:
        seconds, source = self.table.membound_time(
            op, "bf16", shape, bytes_moved, self.cluster.gpu.memory_bandwidth
        )
        return seconds, source == "roofline"

    def _gemm_dtype(self, fp8: str) -> str:
        if fp8 == "none" or (fp8 == "mxfp8" and not self.cluster.gpu.mx_fp8):
            return "bf16"
        return f"fp8_{fp8}"

    def _quantize(
        self, fp8: str, elements: float, shape: tuple[int, ...], source: int, weight: bool = False
    ) -> tuple[float, bool]:
        """mt-fp8's quantization of ``elements`` values of ``source`` bytes each into an FP8
        operand and its transpose under recipe ``fp8`` (module docstring, "FP8 quantization")."""
        reads = (WEIGHT_READS if weight else QUANTIZE_READS).get(fp8, 2)
        per_element = reads * source + 2 + (2 if weight and fp8 == "rowwise" else 0)
        moved = per_element * elements
        if self.table.has("quantize", "bf16"):
            A = self.work.act_bytes
            moved *= (A + 2) / (2 * A + 2)  # the entry's bytes: A + 2 of the 2A + 2 it moves
        return self._membound("quantize", moved, shape)

    def _linear(
        self,
        ph: _Phase,
        cls: str,
        M: int,
        N: int,
        K: int,
        fp8: str,
        groups: int = 0,
        quantize_input: bool = True,
        autocast: bool = True,
    ) -> None:
        """A linear's three GEMMs (+ FP8 quantization of its input and output gradient;
        ``quantize_input=False``: the previous layer read the same input and its FP8 operands
        are reused, module docstring), and, for a high-precision linear under autocast
        (``autocast=False``: the fp32 router), its weight's casts."""
        dtype = self._gemm_dtype(fp8)
        shapes = gemm_pass_shapes(M, N, K)
        (f, r1), (i, r2), (w, r3) = (self._gemm(dtype, *shapes[p], groups, p) for p in GEMM_PASSES)
        ph.add(cls, f, i, w, r1 or r2 or r3)
        A = self.work.act_bytes
        if fp8 == "none" and not groups and autocast and A < 4:
            # autocast reads the fp32 weight and writes its bf16 copy in every forward (again in
            # a recomputed one, which repeats the phase's forward), and the GEMM's bf16 weight
            # gradient is cast back to fp32 for the fp32 .grad: (4 + A)·N·K bytes each way
            cast, rc = self._membound("copy", (4 + A) * N * K, (N, K))
            ph.add("weight_cast", cast, 0.0, cast, rc)
        if fp8 != "none":
            A = self.work.act_bytes
            qf, rf = self._quantize(fp8, M * K, (M, K), A) if quantize_input else (0.0, False)
            qb, rb = self._quantize(fp8, M * N, (M, N), A)
            ph.add("fp8_quantize", qf, qb, 0.0, rf or rb)
            if fp8 == "rowwise" and not groups and not self.table.has("gemm_wgrad", dtype):
                # the bf16 weight gradient converted to fp32 (its own wgrad entries include it)
                cv, rc = self._membound("copy", (2 + 4) * N * K, (N, K))
                ph.add("fp8_wgrad_convert", 0.0, 0.0, cv, rc)

    def expert_entries(self, fp8: str) -> str | None:
        """The dtype whose ``grouped_linear`` entries price the routed experts' linears under
        ``fp8``: bf16's own; an FP8 recipe's own, else ``fp8_tensorwise``'s; None where the
        table has none (module docstring, "Routed experts")."""
        dtype = self._gemm_dtype(fp8)
        if fp8 != "none" and dtype == "bf16":
            return None  # MXFP8 without MX tensor cores: priced as bf16 GEMMs, as before
        for source in (dtype, FP8_REFERENCE) if dtype.startswith("fp8_") else (dtype,):
            if all(self.table.has(op, source) for op in EXPERT_OPS):
                return source
        return None

    def _group_padding(self, M: int, K: int, N: int) -> tuple[float, float, bool]:
        """(forward, backward, roofline) of CUDA's group padding around grouped GEMMs that read
        ``M`` rows of width ``K`` and write ``M`` rows of width ``N``: the rows scattered into
        a zeroed padded copy and the output's rows gathered back (forward), the gather's
        scatter into zeros and the copy's gather (backward), as copies (module docstring,
        "Routed experts")."""
        A = self.work.act_bytes
        f, r1 = self._membound("copy", A * (3 * M * K + 2 * M * N), (M, K + N))
        b, r2 = self._membound("copy", A * (2 * M * K + 3 * M * N), (M, K + N))
        return f, b, r1 or r2

    def _expert_mlp(
        self, ph: _Phase, rows: int, D: int, F: int, fp8: str, groups: int, ep: int
    ) -> None:
        """The routed experts' gate, up and down projections over ``groups`` local experts and,
        in bf16 over ``ep > 1`` ranks, the one group padding of the MLP's ``D``-wide input and
        output (module docstring, "Routed experts")."""
        for N, K in ((F, D), (F, D), (D, F)):
            self._expert_linear(ph, rows, N, K, fp8, groups)
        if fp8 == "none" and ep > 1:  # FP8GroupedLinear does not pad; ep = 1: the permute does
            pad_f, pad_b, roofline = self._group_padding(rows, D, D)
            ph.add("expert_padding", pad_f, pad_b, 0.0, roofline)

    def _expert_linear(self, ph: _Phase, M: int, N: int, K: int, fp8: str, groups: int) -> None:
        """One projection of the routed experts over ``groups`` local experts, without the
        bf16 group padding, which :meth:`_expert_mlp` charges once per MLP (module docstring,
        "Routed experts")."""
        gpu, A = self.cluster.gpu, self.work.act_bytes
        dtype = self._gemm_dtype(fp8)
        params = groups * N * K
        if self.expert_entries(fp8) is not None:
            flops = 2.0 * M * N * K
            fp8_bytes = dtype.startswith("fp8_")
            in_bytes = 1 if fp8_bytes else A
            moved = (M * K + params + M * N) * in_bytes + M * N * A
            peak = gpu.peak_fp8_flops if fp8_bytes else gpu.peak_bf16_flops
            peaks = (peak, gpu.memory_bandwidth, gpu.peak_bf16_flops)
            shape = (M, N, K, groups)
            f, src_f = self.table.compute_time(
                "grouped_linear_fwd", dtype, shape, flops, moved, *peaks
            )
            b, src_b = self.table.compute_time(
                "grouped_linear_bwd", dtype, shape, 2 * flops, 2 * moved, *peaks
            )
            roofline = "roofline" in (src_f, src_b)
            if fp8 == "none":
                # the entries time a lone GroupedLinear, which pads itself; the MLP pads once
                # instead, and a pass never gets cheaper than its GEMM's roofline
                pad_f, pad_b, _ = self._group_padding(M, K, N)
                roof = max(flops / peak, moved / gpu.memory_bandwidth)
                roofline = roofline or f - pad_f < roof or b - pad_b < 2 * roof
                f, b = max(f - pad_f, roof), max(b - pad_b, 2 * roof)
            ph.add("experts", f, b / 2, b / 2, roofline)
            return
        self._linear(ph, "experts", M, N, K, fp8, groups)
        if fp8 == "none" and A < 4:
            # bf16: the fp32 weight is cast for the GEMM and its gradient cast back, every call
            cast, rc = self._membound("copy", (4 + A) * params, (groups * N, K))
            ph.add("expert_weight_cast", cast, cast, 0.0, rc)

    # -- one decoder layer --------------------------------------------------------------------

    def _layer_cost(self, dense: bool, L: Layout) -> _LayerCost:
        md, w = self.model, self.work
        A, b, tp = w.act_bytes, L.micro_batch, L.tp
        s_loc = w.seq_len // L.cp
        T = b * s_loc
        Tn = T // tp if L.sp else T
        D = md.dim
        H = md.n_heads // tp
        fp8 = L.fp8
        ring = L.cp > 1 and L.cp_attention == "ring"
        gathered = L.cp > 1 and not ring
        expansion = 0.0  # MLA under the ring: kv_b's forward, which each step's block repeats
        ph = _Phase()
        comm_f: list[tuple[str, str, float]] = []
        comm_b: list[tuple[str, str, float]] = []
        saved = 0.0
        # attention projections
        if md.attention == "gqa":
            hd, Hkv = md.head_dim, md.n_kv_heads // tp
            self._linear(ph, "attention_proj", T, H * hd, D, fp8)
            self._linear(ph, "attention_proj", T, Hkv * hd, D, fp8, quantize_input=False)
            self._linear(ph, "attention_proj", T, Hkv * hd, D, fp8, quantize_input=False)
            self._linear(ph, "attention_proj", T, D, H * hd, fp8)
            rope_bytes = 2 * A * T * (H + Hkv) * hd
            kv_heads, qk, vd = Hkv, hd, hd
            saved += (1 if fp8 != "none" else A) * T * D  # the q/k/v input (shared; FP8: 1 byte)
            # q, k, v after RoPE, kept by the core: all-gather CP's core keeps the whole
            # sequence's k and v, the ring its own K|V message
            saved += A * T * H * hd + A * (b * w.seq_len if gathered else T) * 2 * Hkv * hd
            cp_kv = (A * b * w.seq_len * Hkv * hd, A * b * w.seq_len * Hkv * hd)
            ring_values = 2 * Hkv * hd
            tp_in_grad = T * D
            sp_gather, sp_replicated = T * D, []
        else:
            qk, vd = md.qk_dim, md.v_head_dim
            qr, kvr, rope = md.q_lora_rank, md.kv_lora_rank, md.qk_rope_head_dim
            if qr:
                self._linear(ph, "attention_proj", T, qr, D, fp8)
                self._linear(ph, "attention_proj", T, H * qk, qr, fp8)
            else:
                self._linear(ph, "attention_proj", T, H * qk, D, fp8)
            # CP (all-gather): the latent [c ; k_rot] of the whole sequence is gathered and
            # kv_b expands it on every cp rank, so kv_b runs on Tk = b·s tokens, and the core
            # keeps the whole sequence's k and v (kv_b's saved input is the gathered c). The
            # ring expands every block it holds (Tk = b·s over the ring, module docstring) and
            # keeps none: its saved latent is its own message.
            Tk = b * w.seq_len if L.cp > 1 else T
            # kv_a reads q_a's (or q's) input: shared under current scaling; delayed scaling
            # ties no MLA input scales, so each quantizes its own
            shared = fp8 != "delayed"
            self._linear(ph, "attention_proj", T, kvr + rope, D, fp8, quantize_input=not shared)
            before = ph.fwd
            self._linear(ph, "attention_proj", Tk, H * (md.qk_nope_head_dim + vd), kvr, fp8)
            if ring:  # the backward expands every block again before its gradients
                expansion = ph.fwd - before
                ph.add("attention_proj", 0.0, expansion, 0.0, False)
            self._linear(ph, "attention_proj", T, D, H * vd, fp8)
            rope_bytes = 2 * A * T * (H + 1) * rope
            kv_heads = H
            saved += A * T * (D + qr + rope) + A * (T if ring else Tk) * kvr + A * T * H * qk
            saved += 0.0 if ring else A * Tk * H * (qk + vd)
            cp_kv = (A * b * w.seq_len * (kvr + rope),)
            ring_values = kvr + rope
            tp_in_grad = T * ((qr or D) + kvr + rope)
            # SP: the latents are gathered, not n (plus n itself for q_proj without q-lora);
            # the replicated q_a/kv_a weights and latent norm gains get fp32 gradient sums.
            sp_gather = T * (qr + kvr + rope) + (0 if qr else T * D)
            sp_replicated = [4 * D * (kvr + rope), 4 * kvr] + ([4 * D * qr, 4 * qr] if qr else [])
        # attention core (causal)
        core_fwd_flops = b * H * (w.seq_len * w.seq_len / (2 * L.cp)) * 2 * (qk + vd)
        core_bytes = A * T * (H * (qk + vd) * 2 + kv_heads * (qk + vd))
        peak = self.cluster.gpu.peak_bf16_flops
        bw = self.cluster.gpu.memory_bandwidth
        shape = (b * H, s_loc, qk)
        ring_cost = None
        if ring:
            ring_cost = self._ring(L, b * H, s_loc, qk, vd, b * s_loc * ring_values, expansion)
            cf, cb = ring_cost.compute
            ph.add("attention_core", cf, cb, 0.0, True)
            saved += 4 * T * H * vd  # the ring keeps its fp32 output for the backward
        else:
            cf, src_f = self.table.compute_time(
                "attention_fwd", "bf16", shape, core_fwd_flops, core_bytes, peak, bw
            )
            cb, src_b = self.table.compute_time(
                "attention_bwd", "bf16", shape, 2.5 * core_fwd_flops, 2 * core_bytes, peak, bw
            )
            ph.add("attention_core", cf, cb, 0.0, "roofline" in (src_f, src_b))
        saved += A * T * H * vd + 4 * b * H * s_loc  # the core's output and log-sum-exp
        rf, r1 = self._membound("rope", rope_bytes, (T, (H + kv_heads) * qk))
        ph.add("rope", rf, rf, 0.0, r1)
        # feed-forward
        if dense or not md.moe:
            F = md.ffn_dim // tp
            self._mlp(ph, T, D, F, fp8)
            saved += self._mlp_saved(T, D, F, fp8, L.recompute)
            mlp_tp = True
        else:
            # Under SP the router and routed experts run on this rank's Tn tokens.
            k, E_loc = md.top_k, md.num_experts // L.ep
            rows = Tn * k
            self._linear(ph, "router", Tn, md.num_experts, D, "none", autocast=False)
            Fe = md.expert_ffn_dim
            self._expert_mlp(ph, rows, D, Fe, fp8, E_loc, L.ep)
            sw, r2 = self._membound("swiglu", SWIGLU_FWD * A * rows * Fe, (rows, Fe))
            ph.add("swiglu", sw, sw * SWIGLU_BWD / SWIGLU_FWD, 0.0, r2)
            pm, r3 = self._membound("permute", 4 * A * rows * D, (rows, D))
            ph.add("moe_permute", pm, pm, 0.0, r3)
            saved += 4 * Tn * D + A * rows * D * 2 + self._mlp_saved(rows, D, Fe, fp8, L.recompute)
            mlp_tp = md.shared_ffn_dim > 0
            if mlp_tp:
                Fs = md.shared_ffn_dim // tp
                self._mlp(ph, T, D, Fs, fp8)
                saved += self._mlp_saved(T, D, Fs, fp8, L.recompute)
        # norms and residual adds (fp32 residual stream)
        nf, n1 = self._membound("rmsnorm", 2 * (4 + A) * Tn * D, (Tn, D))
        nb, _ = self._membound("rmsnorm", 2 * (8 + A) * Tn * D, (Tn, D))
        ph.add("norm_residual", nf, nb, 0.0, n1)
        ra, r4 = self._membound("copy", 2 * 12 * Tn * D, (Tn, D))
        ph.add("norm_residual", ra, ra, 0.0, r4)
        saved += 2 * 4 * Tn * D  # the norms' fp32 inputs
        # the block's collectives in execution order (the backward's mirror the forward's)
        TD = A * T * D
        moe_ep = md.moe and not dense and L.ep > 1
        if tp > 1 and L.sp:
            comm_f.append(("tp", "all_gather", A * sp_gather))
            comm_b.append(("tp", "reduce_scatter", A * sp_gather))
            comm_b += [("tp", "all_reduce", payload) for payload in sp_replicated]
        for payload in cp_kv if gathered else ():
            comm_f.append(("cp", "all_gather", payload))
            comm_b.append(("cp", "reduce_scatter", payload))
        if tp > 1:
            if L.sp:
                comm_f.append(("tp", "reduce_scatter", TD))
                comm_b.append(("tp", "all_gather", TD))
                if mlp_tp:  # the MLP's (or shared experts') input
                    comm_f.append(("tp", "all_gather", TD))
                    comm_b.append(("tp", "reduce_scatter", TD))
                if md.moe and not dense:  # replicated router and experts: fp32 gradient sums
                    comm_b.append(("tp", "all_reduce", 4 * md.num_experts * D))
                    if self._expert_tp_sum_in_backward(L):  # else once per step (_data_parallel)
                        expert_bytes = 4 * (md.num_experts // L.ep) * D * md.expert_ffn_dim
                        comm_b += [("tp", "all_reduce", expert_bytes)] * 3
            else:
                comm_f.append(("tp", "all_reduce", TD))
                comm_b.append(("tp", "all_reduce", A * tp_in_grad))
                if mlp_tp:
                    comm_b.append(("tp", "all_reduce", TD))
        if moe_ep:
            rows_bytes = A * Tn * md.top_k * D
            comm_f += [("ep", "all_to_all", rows_bytes)] * 2
            comm_b += [("ep", "all_to_all", rows_bytes)] * 2
        if tp > 1 and mlp_tp:
            comm_f.append(("tp", "reduce_scatter" if L.sp else "all_reduce", TD))
            if L.sp:
                comm_b.append(("tp", "all_gather", TD))
        full = saved
        # recompute: extra backward compute and what stays saved
        core_f = ph.classes.get("attention_core", 0.0) * cf / (cf + cb) if cf + cb else 0.0
        if L.recompute in ("full", "full_keep"):
            extra = ph.fwd - (core_f if L.recompute == "full_keep" else 0.0)
            ph.igrad += extra
            ph.classes["recompute"] = extra
            saved = 4 * Tn * D
            if L.recompute == "full_keep":
                saved += A * T * H * vd + 4 * b * H * s_loc
            # torch's checkpoint stops recomputing once every saved tensor is rebuilt: the
            # block's last collective (its output) is not run again
            comm_b += comm_f[:-1]
        elif L.recompute in ("selective", "selective_mlp"):
            extra = core_f + expansion  # the MLA ring expands its blocks inside the core
            saved -= 4 * b * H * s_loc
            if L.recompute == "selective_mlp" and fp8 == "none":  # FP8: no SwiGLU module
                swiglu = ph.classes.get("swiglu", 0.0) * SWIGLU_FWD / (SWIGLU_FWD + SWIGLU_BWD)
                extra += swiglu
            ph.igrad += extra
            ph.classes["recompute"] = extra
        if ring_cost is not None and L.recompute in ("full", "selective", "selective_mlp"):
            ring_cost = ring_cost.with_forward_repeated(1)  # the core runs again, ring and all
        launches_f, launches_b, reads_f = self._layer_launches(dense, L)
        launches = (launches_f + len(comm_f), launches_b + len(comm_b))
        reads = (reads_f, 0)
        if L.recompute in ("full", "full_keep"):  # the forward's kernels and reads again
            launches = (launches[0], launches[1] + launches_f)
            reads = (reads_f, reads_f)
        return _LayerCost(ph, tuple(comm_f), tuple(comm_b), saved, full, ring_cost, launches, reads)

    def _launch_key(self, dense: bool, L: Layout) -> str:
        """The :data:`KERNEL_LAUNCHES` key of a decoder layer (module docstring, "Launch
        counts")."""
        md = self.model
        mla, routed = md.attention == "mla", md.moe and not dense
        kind = ("mla_moe" if mla else "moe") if routed else ("mla" if mla else "llama")
        return f"{kind}/{LAUNCH_RECIPE_STANDIN.get(L.fp8, L.fp8)}"

    def _layer_launches(self, dense: bool, L: Layout) -> tuple[float, float, int]:
        """(forward kernels, backward kernels, forward host reads) of one decoder layer per
        micro-batch, its collectives not included (module docstring, "Host time")."""
        md = self.model
        counts = KERNEL_LAUNCHES[self._launch_key(dense, L)]
        if dense or not md.moe:
            return counts.forward, counts.backward, 0
        local = md.num_experts // L.ep
        reads = EXPERT_MLP_HOST_READS[(L.fp8, expert_path(L.fp8, local))]
        if L.ep > 1:
            reads += DISPATCH_HOST_READS["all_to_all"]
        return (
            counts.forward + counts.expert_forward * local,
            counts.backward + counts.expert_backward * local,
            reads,
        )

    def _end_launches(self, L: Layout) -> tuple[int, int]:
        """Kernels of the embedding, final norm, head and loss (forward, backward):
        :data:`END_LAUNCHES` of the model's layer family (module docstring, "Launch counts")."""
        key = self._launch_key(not self.model.moe, L).replace("mla/", "mla_moe/")
        return END_LAUNCHES[key]

    def _ring(
        self, L: Layout, heads: int, t: int, qk: int, vd: int, elements: int, expansion: float
    ) -> _RingCost:
        """Ring attention over ``L.cp`` ranks of ``heads`` (batch × heads) query rows of ``t``
        local tokens, whose message holds ``elements`` values, and MLA's ``expansion`` (kv_b's
        forward over the ring; module docstring, "Ring attention")."""
        gpu, c, A = self.cluster.gpu, L.cp, self.work.act_bytes
        v = max(vd, qk)  # flash takes one head dim: a narrower value is padded to it
        pairs = t * t / 2  # every step's (step 0: causal over t×t; later: t × t/2 unmasked)
        flops = 2.0 * heads * pairs * (qk + v)
        core_bytes = A * heads * t * (2 * qk + 2 * v)
        shape = (heads, t, qk)
        block_f = self.table.compute_time(
            "attention_fwd", "bf16", shape, flops, core_bytes, gpu.peak_bf16_flops,
            gpu.memory_bandwidth,
        )[0]  # fmt: skip
        block_b = self.table.compute_time(
            "attention_bwd", "bf16", shape, 2.5 * flops, 2 * core_bytes, gpu.peak_bf16_flops,
            gpu.memory_bandwidth,
        )[0]  # fmt: skip
        merge_f = self._membound("copy", RING_MERGE_PASSES * 4 * heads * t * vd, (heads, t))[0]
        merge_b = self._membound("copy", RING_MERGE_PASSES * 4 * heads * t * qk, (heads, t))[0]
        expand = self._membound("copy", 2 * A * heads * t * (qk + v), (heads, t))[0]
        fwd = [block_f + merge_f + expand] + [block_f + merge_f] * (c - 1)
        bwd = [block_b + merge_b + expand] + [block_b + merge_b] * (c - 1)
        message, gradient = A * elements, 4 * elements
        kv, grad = self._time("cp", "p2p", message, L), self._time("cp", "p2p", gradient, L)
        step_f, step_b = expansion / c, 3 * expansion / c
        exposed_f = sum(max(0.0, kv - fwd[s] - step_f) for s in range(c - 1))
        exposed_b = grad + sum(
            max(0.0, kv * (s < c - 1) + grad * (s > 0) - bwd[s] - step_b) for s in range(c)
        )
        return _RingCost(
            (sum(fwd), sum(bwd)), (exposed_f, exposed_b),
            ((message, c - 1), (message, c - 1), (gradient, c)),
        )  # fmt: skip

    def _mlp(self, ph: _Phase, T: int, D: int, F: int, fp8: str) -> None:
        """A SwiGLU MLP: gate and up share their input's quantization; under
        :data:`SWIGLU_INTO_FP8` recipes SwiGLU's forward is the down projection's quantizer."""
        A = self.work.act_bytes
        fused = fp8 in SWIGLU_INTO_FP8
        self._linear(ph, "mlp", T, F, D, fp8)
        self._linear(ph, "mlp", T, F, D, fp8, quantize_input=False)
        self._linear(ph, "mlp", T, D, F, fp8, quantize_input=not fused)
        sw, r = self._membound("swiglu", SWIGLU_FWD * A * T * F, (T, F))
        ph.add("swiglu", 0.0 if fused else sw, sw * SWIGLU_BWD / SWIGLU_FWD, 0.0, r)
        if fused:
            q, rq = self._quantize(fp8, T * F, (T, F), 2 * A)
            ph.add("fp8_quantize", q, 0.0, 0.0, rq)

    def _mlp_saved(self, T: int, D: int, F: int, fp8: str, recompute: str) -> float:
        A = self.work.act_bytes
        saved = (1 if fp8 != "none" else A) * T * D + 2 * A * T * F
        if recompute != "selective_mlp" or fp8 != "none":  # FP8: down's FP8 input is saved
            saved += (1 if fp8 != "none" else A) * T * F
        return saved

    # -- the layout's pieces --------------------------------------------------------------------

    @staticmethod
    @lru_cache(maxsize=4096)
    def _groups(tp: int, cp: int, dp: int, ep: int, pp: int) -> dict[str, tuple[int, int]]:
        """(size, stride) of each group in mt-comm's rank layout (tp, cp, dp, pp; ep fastest
        inside dp×cp; pp's p2p pairs are one pipeline stride apart)."""
        return {
            "tp": (tp, 1),
            "cp": (cp, tp),
            "dp": (dp * cp, tp),
            "ep": (ep, tp),
            "edp": (dp * cp // ep, tp * ep),
            "pp": (2 if pp > 1 else 1, tp * cp * dp),
        }

    def _time(self, name: str, collective: str, payload: float, L: Layout) -> float:
        size, stride = self._groups(L.tp, L.cp, L.dp, L.ep, L.pp)[name]
        return self._collective(collective, payload, size, stride)

    def _collective_time(self, collective: str, payload: float, size: int, stride: int) -> float:
        return collective_time(collective, payload, size, tier_of(self.cluster, stride, size))

    def chunk_layers(self, L: Layout) -> list[list[int]]:
        """The decoder layers of each pipeline chunk: ``L.pp_layers``, else the trainer's
        automatic split (:func:`~mt_plan.layout.split_layers`)."""
        counts = split_layers(self.model.n_layers, L.pp * L.chunks_per_rank(), L.pp_layers)
        out, start = [], 0
        for c in counts:
            out.append(list(range(start, start + c)))
            start += c
        return out

    def recomputed_layers(self, L: Layout) -> frozenset[int]:
        """The decoder layers whose blocks full recompute checkpoints (module docstring, "Full
        recompute every ``N`` blocks"): all of them under ``recompute_every = 1``, none without
        a :data:`~mt_plan.layout.FULL_RECOMPUTE` policy."""
        if L.recompute not in FULL_RECOMPUTE:
            return frozenset()
        offset = self.model.blocks_before if L.pp == 1 else 0
        return frozenset(
            layer
            for layers in self.chunk_layers(L)
            for j, layer in enumerate(layers)
            if (offset + j) % L.recompute_every == 0
        )

    def rank_chunks(self, L: Layout) -> list[list[int]]:
        """The chunks each pipeline rank holds (loop placement, or a V for zbv/dualpipev)."""
        v = L.chunks_per_rank()
        if L.pp > 1 and L.schedule in V_SCHEDULES:
            return [[r, 2 * L.pp - 1 - r] for r in range(L.pp)]
        return [[r + k * L.pp for k in range(v)] for r in range(L.pp)]

    def _ends(self, L: Layout) -> tuple[_Phase, _Phase, dict[str, list], dict[str, list]]:
        """(embedding phase, head phase, {"embedding"/"head": collectives} forward, backward)."""
        md, w = self.model, self.work
        A, T = w.act_bytes, L.micro_batch * w.seq_len // L.cp
        Tn = T // L.tp if L.sp else T
        V, D = md.vocab_size // L.tp, md.dim
        emb, head = _Phase(), _Phase()
        ef, r1 = self._membound("copy", 8 * T * D, (T, D))
        eb, r2 = self._membound("copy", 8 * T * D + 4 * V * D, (V, D))
        emb.add("embedding", ef, eb, 0.0, r1 or r2)
        nf, r3 = self._membound("rmsnorm", (4 + A) * Tn * D, (Tn, D))
        head.add("norm_residual", nf, 2 * nf, 0.0, r3)
        self._linear(head, "head", T, V, D, "none")
        # one read of the logits forward (online max and sum), one read and one write backward
        cf, r4 = self._membound("cross_entropy", A * T * V, (T, V))
        head.add("cross_entropy", cf, 2 * cf, 0.0, r4)
        if md.extra_flops_per_token:
            seconds, r5 = self._gemm("bf16", T, D, D)
            # Every cp rank encodes all of the micro-batch's images (the VLM's encoder is
            # replicated over cp), so its work is the whole micro-batch's, not T's.
            extra = md.extra_flops_per_token * T * L.cp / (2.0 * T * D * D) * seconds
            emb.add("vision_encoder", extra / 3, extra / 3, extra / 3, r5)
        fwd: dict[str, list] = {"embedding": [], "head": []}
        bwd: dict[str, list] = {"embedding": [], "head": []}
        if L.tp > 1:
            # vocab-parallel embedding (fp32 output), the head's input, cross-entropy's three
            # fp32 values per token; the final norm's gain with sequence parallel
            if L.sp:
                fwd["embedding"].append(("tp", "reduce_scatter", 4 * T * D))
                bwd["embedding"].append(("tp", "all_gather", 4 * T * D))
                fwd["head"].append(("tp", "all_gather", A * T * D))
                bwd["head"] += [("tp", "reduce_scatter", A * T * D), ("tp", "all_reduce", 4 * D)]
            else:
                fwd["embedding"].append(("tp", "all_reduce", 4 * T * D))
                bwd["head"].append(("tp", "all_reduce", A * T * D))
            fwd["head"] += [("tp", "all_reduce", 4 * T)] * 3
        return emb, head, fwd, bwd

    def estimate(self, L: Layout) -> Estimate:
        """Step time, memory and communication of ``L`` (module docstring)."""
        md, w, cl = self.model, self.work, self.cluster
        m = L.microbatches(w.global_batch)
        chunks = self.chunk_layers(L)
        placement = self.rank_chunks(L)
        emb, head, end_fwd, end_bwd = self._ends(L)
        comm: dict[str, GroupComm] = {}

        def account(group: str, collective: str, payload: float, times: float) -> float:
            size, stride = self._groups(L.tp, L.cp, L.dp, L.ep, L.pp)[group]
            seconds = self._time(group, collective, payload, L) * times
            g = comm.setdefault(
                group,
                GroupComm(
                    group, size, "intra" if tier_of(cl, stride, size) is cl.intra_node else "inter"
                ),
            )
            g.payload_bytes += payload * times
            g.seconds += seconds
            return seconds

        # per chunk: F, I, W seconds (compute + exposed in-layer comm), classes, saved bytes
        chunk_f, chunk_i, chunk_w, chunk_saved, chunk_full = [], [], [], [], []
        chunk_pieces: list[list[_Piece]] = []  # each layer's, then the chunk's ends (host time)
        t_launch, host_source = self.table.host_seconds("kernel_launch")
        t_read = self.table.host_seconds("host_read")[0]
        end_launches = self._end_launches(L)
        floor_binds = False  # under pp: in some chunk's F, I or W
        classes: dict[str, float] = {}
        roofline = 0.0
        rank0 = set(placement[0])
        rank_of = {c: r for r, held in enumerate(placement) for c in held}
        recomputed = self.recomputed_layers(L)
        overlapped: dict[str, float] = {}  # seconds of a group's comm that compute hides (the ring)
        # a layer's own policy: recompute_every leaves some blocks out of full recompute (a
        # layer's cost does not depend on the split, so the cache ignores pp_layers)
        every_block = replace(L, recompute_every=1, pp_layers=())
        not_recomputed = replace(L, recompute="none", recompute_every=1, pp_layers=())
        # split backward over blocks recomputed whole: the chunk's sink keeps each linear's
        # recomputed input and dy from I to W (module docstring, "Memory per rank")
        sink_recompute = L.pp > 1 and L.schedule in SPLIT_BACKWARD and L.recompute in FULL_RECOMPUTE
        for c, layers in enumerate(chunks):
            f = i = wg = saved = biggest = 0.0
            count_comm = c in rank0
            pieces: list[_Piece] = []
            for layer in layers:
                dense = not md.moe or layer < md.first_k_dense
                skipped = L.recompute in FULL_RECOMPUTE and layer not in recomputed
                lc = self._layer(dense, not_recomputed if skipped else every_block)
                before = (f, i, wg)
                f += lc.phase.fwd
                i += lc.phase.igrad
                wg += lc.phase.wgrad
                saved += lc.full_acts if sink_recompute and not skipped else lc.saved
                if not skipped:  # a recomputed block's transient (full recompute only)
                    biggest = max(biggest, lc.full_acts)
                for group, kind, payload in lc.comm_fwd:
                    f += self._time(group, kind, payload, L)
                    if count_comm:
                        account(group, kind, payload, m)
                for group, kind, payload in lc.comm_bwd:
                    i += self._time(group, kind, payload, L)
                    if count_comm:
                        account(group, kind, payload, m)
                if lc.ring is not None:  # the ring's p2p, as far as its blocks do not hide it
                    f += lc.ring.exposed[0]
                    i += lc.ring.exposed[1]
                    if count_comm:
                        sent = sum(account("cp", "p2p", p, n * m) for p, n in lc.ring.sends)
                        overlapped["cp"] = (
                            overlapped.get("cp", 0.0) + sent - m * sum(lc.ring.exposed)
                        )
                if L.sp:  # the two replicated norm gains: fp32 gradients, per micro-batch
                    i += 2 * self._time("tp", "all_reduce", 4 * md.dim, L)
                    if count_comm:
                        account("tp", "all_reduce", 4 * md.dim, 2 * m)
                if count_comm:
                    for cls, t in lc.phase.classes.items():
                        classes[cls] = classes.get(cls, 0.0) + t * m
                    roofline += lc.phase.roofline * m
                pieces.append(
                    _Piece(
                        f - before[0], i - before[1], wg - before[2],
                        lc.launches[0] * t_launch, lc.launches[1] * t_launch,
                        *lc.reads, *lc.launches,
                    )
                )  # fmt: skip
            before = (f, i, wg)
            ends = ([emb] if c == 0 else []) + ([head] if c == len(chunks) - 1 else [])
            for ph in ends:
                f, i, wg = f + ph.fwd, i + ph.igrad, wg + ph.wgrad
                if count_comm or L.pp == 1:
                    for cls, t in ph.classes.items():
                        classes[cls] = classes.get(cls, 0.0) + t * m
                    roofline += ph.roofline * m
            ends_here = (["embedding"] if c == 0 else []) + (
                ["head"] if c == len(chunks) - 1 else []
            )
            for end in ends_here:
                for group, kind, payload in end_fwd[end]:
                    f += self._time(group, kind, payload, L)
                    if count_comm:
                        account(group, kind, payload, m)
                for group, kind, payload in end_bwd[end]:
                    i += self._time(group, kind, payload, L)
                    if count_comm:
                        account(group, kind, payload, m)
            if L.pp > 1:  # stage boundaries between ranks (a V keeps its turn on one rank)
                hidden = 4 * L.micro_batch * w.seq_len // L.cp * md.dim // (L.tp if L.sp else 1)
                p2p = self._time("pp", "p2p", hidden, L)
                if c < len(chunks) - 1 and rank_of[c + 1] != rank_of[c]:
                    f += p2p
                    if count_comm:
                        account("pp", "p2p", hidden, m)
                if c > 0 and rank_of[c - 1] != rank_of[c]:
                    i += p2p
                    if count_comm:
                        account("pp", "p2p", hidden, m)
            # the embedding's and head's kernels (and the stage p2p), counted at the head
            end_f, end_b = end_launches if c == len(chunks) - 1 else (0, 0)
            pieces.append(
                _Piece(
                    f - before[0], i - before[1], wg - before[2],
                    end_f * t_launch, end_b * t_launch, 0, 0, end_f, end_b,
                )
            )  # fmt: skip
            chunk_pieces.append(pieces)
            if L.pp > 1:  # each schedule op floored alone (module docstring, "Host time")
                excess = _floored_passes(pieces, t_read)
                floor_binds = floor_binds or any(excess)
                f, i, wg = f + excess[0], i + excess[1], wg + excess[2]
            chunk_f.append(f)
            chunk_i.append(i)
            chunk_w.append(wg)
            chunk_saved.append(saved)
            chunk_full.append(biggest)

        # pipeline or accumulation loop
        if L.pp > 1:
            v = L.chunks_per_rank()
            pipe_time, bubble, held = pipeline_timing(
                L.schedule, L.pp, v, m, chunk_f, chunk_i, chunk_w
            )
            last_backward = 0.0
            device_pipe = pipe_time
            if floor_binds:
                device = [[sum(getattr(p, k) for p in ps) for ps in chunk_pieces]
                          for k in ("forward", "igrad", "wgrad")]  # fmt: skip
                device_pipe = pipeline_timing(L.schedule, L.pp, v, m, *device)[0]
        else:
            pipe_time = m * (chunk_f[0] + chunk_i[0] + chunk_w[0])
            bubble, held = 0.0, (1.0,)
            last_backward = chunk_i[0] + chunk_w[0]

        # parameters per pipeline rank; after the schedule each rank reduces its gradients and
        # steps its optimizer on its own, so the rank slowest at both ends the step (uneven
        # splits); the collectives' bytes are rank 0's, as everywhere in ``comm``
        params = [self.rank_params(L, placement[r], chunks) for r in range(L.pp)]

        def timed_only(group: str, collective: str, payload: float, times: float) -> float:
            return self._time(group, collective, payload, L) * times

        after = []  # (data-parallel exposed, optimizer) seconds per pipeline rank
        for r in range(L.pp):
            if L.pp > 1 and L.schedule not in SPLIT_BACKWARD:  # buckets in the last B (docstring)
                first = min(placement[r])  # the rank's chunk whose last backward ends last
                last_backward = chunk_i[first] + chunk_w[first]
            dp_r = self._data_parallel(
                L, params[r], m, last_backward, pipe_time,
                *((account, comm) if r == 0 else (timed_only, {})),
            )  # fmt: skip
            after.append((dp_r, self._optimizer(L, params[r])))
        dp_exposed, optimizer = max(after, key=sum)
        for g in ("dp", "edp"):
            if g in comm:
                comm[g].exposed = dp_exposed if g == "dp" else 0.0
        classes["optimizer"] = optimizer

        if L.pp > 1:
            host_floor = pipe_time - device_pipe
        else:
            host_floor = _floor_excess(chunk_pieces[0], m, dp_exposed + optimizer, t_read)
            pipe_time += host_floor
        step = pipe_time + dp_exposed + optimizer
        rank0_pieces = [p for c in placement[0] for p in chunk_pieces[c]]
        host_time = m * sum(p.host_f + p.host_b + (p.reads_f + p.reads_b) * t_read
                            for p in rank0_pieces)  # fmt: skip
        host_reads = m * sum(p.reads_f + p.reads_b for p in rank0_pieces)
        launches = m * sum(p.launches_f + p.launches_b for p in rank0_pieces)
        tokens = w.global_batch * w.seq_len
        per_gpu = tokens / step / L.world
        mfu = per_gpu * md.flops_per_token(w.seq_len) / cl.gpu.peak_bf16_flops

        # memory: the rank with the largest peak
        worst: dict[str, float] = {}
        worst_total = -1.0
        for r in range(L.pp):
            local_r, experts_r, linear_r = params[r]
            layers_r = [chunk_saved[c] for c in placement[r]]
            acts = held[r] * sum(layers_r)
            last = len(chunks) - 1 in placement[r]
            kept_r = 0.0  # block linears whose bf16 copies outlive the forward (recompute_every)
            if L.recompute in FULL_RECOMPUTE:
                kept_r = sum(
                    self._block_linear_params(L, layer)
                    for c in placement[r]
                    for layer in chunks[c]
                    if layer not in recomputed
                )
            mem = self._memory(
                L, local_r, experts_r, linear_r, acts, max(chunk_full), last, m, kept_r
            )
            total = sum(mem.values())
            if total > worst_total:
                worst, worst_total = mem, total
        peak_mem = worst_total * (1.0 + w.allocator_overhead)
        fits = peak_mem <= cl.gpu.memory_bytes * (1.0 - w.headroom)
        compute_total = sum(t for k, t in classes.items() if k != "optimizer")
        for g in comm.values():
            if g.group not in ("dp", "edp"):  # in-layer collectives: only the ring overlaps
                g.exposed = g.seconds - overlapped.get(g.group, 0.0)
        return Estimate(
            layout=L, step_time=step, tokens_per_s_per_gpu=per_gpu, mfu=mfu,
            peak_memory=peak_mem, fits=fits, memory=worst, compute=classes, comm=comm,
            bubble_fraction=bubble, optimizer_time=optimizer,
            roofline_share=roofline / compute_total if compute_total else 0.0, microbatches=m,
            notes=self._gemm_notes(L) + self._expert_notes(L), host_time=host_time,
            host_floor=max(host_floor, 0.0), host_reads=host_reads, kernel_launches=launches,
            host_costs=(t_launch, t_read, host_source),
        )  # fmt: skip

    def _optimizer(self, L: Layout, params: tuple[float, float, float]) -> float:
        """Seconds of one rank's optimizer step: AdamW over the parameters it updates, the
        clip's norm, and under FP8 the weights' requantization (module docstring)."""
        local, experts, linear_params = params
        updated = local + experts
        if L.dp_mode in ("zero1", "fsdp"):
            updated = self._sharded(L, local, experts)
        adam, _ = self._membound("adamw", 28 * updated, (int(updated),))
        norm, _ = self._membound("copy", 4 * updated, (int(updated),))
        requant = 0.0
        if L.fp8 != "none":  # once per step, from the fp32 weights
            requant, _ = self._quantize(L.fp8, linear_params, (int(linear_params),), 4, weight=True)
        return adam + norm + requant

    def _gemm_notes(self, L: Layout) -> list[str]:
        """Which GEMM dtypes are priced from a table's layout-free entries, for ``--explain``."""
        dtypes = sorted({"bf16", self._gemm_dtype(L.fp8)})
        old = [
            d for d in dtypes
            if any(self.table.layout_free(f"gemm_{p}", d) for p in GEMM_PASSES)
        ]  # fmt: skip
        if not old:
            return []
        return [
            f"GEMMs ({', '.join(old)}): this table predates per-pass gemm entries, so forward, "
            "dgrad and wgrad take its layout-free gemm rates (not timed with the operand "
            "layouts training uses; mt-plan calibrate times each pass)"
        ]

    def _expert_notes(self, L: Layout) -> list[str]:
        """Where the routed experts' linears are priced from, for ``--explain``."""
        if not self.model.moe:
            return []
        dtype = self._gemm_dtype(L.fp8)
        source = self.expert_entries(L.fp8)
        if source is not None:
            how = "measured" if source == dtype else f"derived from {source}"
            timed = (
                "a lone projection's forward and backward, less the group padding it runs "
                "around itself: the expert MLP pads once, expert_padding"
                if dtype == "bf16"
                else "the expert module's forward and backward as mt runs it"
            )
            return [
                f"expert linears ({dtype}): priced from the table's grouped_linear entries "
                f"({how}; {timed})"
            ]
        if dtype == "bf16":
            if L.fp8 != "none":
                return []
            return [
                "expert linears (bf16): this table has no grouped_linear entries, so they are "
                "priced at grouped_gemm rates plus their weight casts and the MLP's one group "
                "padding as copies"
            ]
        return [
            f"expert linears ({dtype}): this table has no FP8 grouped_linear entries, so they "
            "are priced at grouped_gemm rates scaled to the FP8 peak plus separate quantization, "
            "faster than mt's grouped FP8 path runs; mt-plan calibrate measures them"
        ]

    def rank_params(
        self, L: Layout, rank_chunks: list[int], chunks: list[list[int]]
    ) -> tuple[float, float, float]:
        """(dense-parallel parameters, expert parameters, block-linear parameters) on one rank;
        the block linears are the ones FP8 recipes convert (not the head, not the router)."""
        md, tp = self.model, L.tp
        split, rep = md.attention_params()
        dense = experts = linear = 0.0
        for c in rank_chunks:
            for layer in chunks[c]:
                m_split, m_rep, m_exp = md.mlp_params(layer)
                dense += split / tp + rep + 2 * md.dim + m_split / tp + m_rep
                experts += m_exp / L.ep
                linear += self._block_linear_params(L, layer)
            if c == 0:
                dense += md.embedding_params() / tp + md.extra_params
            if c == len(chunks) - 1:
                dense += md.embedding_params() / tp + md.dim
                dense += md.mtp_params()
                if md.mtp_depth and 0 not in rank_chunks:  # the MTP modules' embedding copy
                    dense += md.embedding_params() / tp
        return dense, experts, linear

    def _block_linear_params(self, L: Layout, layer: int) -> float:
        """Parameters of decoder layer ``layer``'s block linears on one rank (attention, MLP and
        this rank's experts: the ones FP8 recipes convert; not the fp32 router)."""
        split, rep = self.model.attention_params()
        m_split, _, m_exp = self.model.mlp_params(layer)
        return split / L.tp + rep + m_split / L.tp + m_exp / L.ep

    @staticmethod
    def _sharded(L: Layout, local: float, experts: float) -> float:
        """Parameters per rank once zero1/fsdp shard them: dense ones over dp×cp, expert ones
        over their expert-data-parallel group (dp·cp/ep ranks)."""
        W = L.dp * L.cp
        return local / W + experts / max(W // L.ep, 1)

    @staticmethod
    def _expert_tp_sum_in_backward(L: Layout) -> bool:
        """Whether the routed experts' TP gradient sum (sequence parallel) runs in every
        micro-batch's backward (ep = 1) rather than once per step with their expert-data
        reduction (ep > 1, every data-parallel mode; :meth:`_data_parallel`)."""
        return L.ep == 1

    def _data_parallel(self, L, params, m, last_backward, compute, account, comm) -> float:
        """Exposed seconds of the gradient (and parameter) collectives of one step."""
        local, experts, _ = params
        W = L.dp * L.cp
        if W == 1:
            return 0.0
        grads = 4 * local
        if self.model.moe:  # the step's expert counts (int64), summed for the router biases
            counts = 8 * self.model.num_experts * self.model.moe_layers
            account("dp", "all_reduce", counts / L.pp, 1)
        if L.dp_mode == "ddp":
            t = account("dp", "all_reduce", grads, 1)
            if experts and W // L.ep > 1:
                t += account("edp", "all_reduce", 4 * experts, 1)
            if last_backward > 0:  # buckets behind the last backward (module docstring)
                bucket = self._time("dp", "all_reduce", min(self.work.ddp_bucket_bytes, grads), L)
                exposed = max(t - last_backward, bucket)
            else:
                exposed = t
        elif L.dp_mode == "zero1":
            exposed = account("dp", "reduce_scatter", grads, 1)
            exposed += account("dp", "all_gather", grads, 1)
            if experts and W // L.ep > 1:
                exposed += account("edp", "reduce_scatter", 4 * experts, 1)
                exposed += account("edp", "all_gather", 4 * experts, 1)
        else:
            gathers_per_step = 2 * m if L.pp == 1 else 1  # pp: gathered once, kept (docstring)
            gathers = account("dp", "all_gather", grads, gathers_per_step)
            scatter = account("dp", "reduce_scatter", grads, 1)
            if experts and W // L.ep > 1:
                gathers += account("edp", "all_gather", 4 * experts, gathers_per_step)
                scatter += account("edp", "reduce_scatter", 4 * experts, 1)
            if L.pp == 1:
                first_block = gathers / (2 * m * max(self.model.n_layers, 1))
                exposed = max(first_block, gathers + scatter - compute)
            else:
                exposed = gathers + scatter
        if experts and L.sp and not self._expert_tp_sum_in_backward(L):  # after the backward
            # zero1 and fsdp sum the shard their expert-data reduce-scatter left on this rank
            shards = 1 if L.dp_mode == "ddp" else W // L.ep
            exposed += account("tp", "all_reduce", 4 * experts / shards, 1)
        for g in ("dp", "edp"):
            if g in comm:
                comm[g].exposed = exposed if g == "dp" else 0.0
        return exposed

    def _memory(
        self,
        L: Layout,
        local: float,
        experts: float,
        linear: float,
        acts: float,
        block: float,
        last_stage: bool,
        m: int,
        kept_linear: float = 0.0,
    ) -> dict[str, float]:
        """Bytes by category on one rank (module docstring); ``kept_linear``: parameters of the
        block linears that full recompute skips (``recompute_every > 1``)."""  # fmt: skip
        md, w = self.model, self.work
        W = L.dp * L.cp
        params = local + experts
        mem: dict[str, float] = {}
        if L.dp_mode == "fsdp" and W > 1:
            layer_params = max(
                md.attention_params()[0] / L.tp + md.attention_params()[1]
                + sum(md.mlp_params(md.n_layers - 1)), 1.0,
            )  # fmt: skip
            sharded = self._sharded(L, local, experts)
            if L.pp == 1:
                mem["weights"] = 4 * sharded + 2 * 4 * layer_params
                mem["gradients"] = 4 * sharded
            else:  # the chunks' gathered weights and their unreduced gradients (docstring)
                mem["weights"] = 4 * sharded + 4 * params
                mem["gradients"] = 4 * sharded + 4 * params
            mem["optimizer"] = 8 * sharded
        elif L.dp_mode == "zero1" and W > 1:
            sharded = self._sharded(L, local, experts)
            mem["weights"] = 4 * params + 4 * sharded
            mem["gradients"] = 4 * params
            mem["optimizer"] = 8 * sharded
        else:
            mem["weights"] = 4 * params
            mem["gradients"] = 4 * params
            mem["optimizer"] = 8 * params
            if W > 1:
                mem["ddp_buckets"] = 4 * local
        T = L.micro_batch * w.seq_len // L.cp
        head = md.embedding_params() / L.tp if last_stage else 0.0
        # autocast's low-precision copies of the high-precision linears' fp32 weights, kept for
        # the backward (FP8 layers quantize from fp32 and keep their FP8 cache instead)
        copy_bytes = w.act_bytes if w.act_bytes < 4 else 0.0
        blocks_copy = (linear if L.fp8 == "none" else 0.0) * copy_bytes
        kept_copy = (kept_linear if L.fp8 == "none" else 0.0) * copy_bytes
        logits = 2 * w.act_bytes * T * md.vocab_size / L.tp if last_stage else 0.0
        forward_phase = {"activations": acts}
        if L.fp8 != "none" and not (L.dp_mode == "fsdp" and W > 1):
            forward_phase["fp8_weight_cache"] = 2 * linear  # freed by the last backward
        moment = {"autocast_weight_copies": head * copy_bytes + blocks_copy, "logits": logits}
        if L.recompute in ("full", "full_keep"):  # the largest moment (module docstring)
            moments = (
                {"autocast_weight_copies": head * copy_bytes + blocks_copy, "logits": logits / 2},
                {"autocast_weight_copies": head * copy_bytes + kept_copy, "logits": logits},
                {"recompute_transient": block, "autocast_weight_copies": kept_copy},
            )
            moment = max(moments, key=lambda parts: sum(parts.values()))
        forward_phase.update(
            {"autocast_weight_copies": 0.0, "logits": 0.0, "recompute_transient": 0.0, **moment}
        )
        mem.update(forward_phase)
        if m == 1 and L.pp == 1:
            # one micro-batch: the gradients grow while the forward's tensors are freed, so
            # only what they exceed them by adds to the peak; the FP8 weights of the first
            # layer's largest projection outlive its weight gradient (module docstring)
            forward = sum(forward_phase.values())
            last = self._last_fp8_projection(L) if "fp8_weight_cache" in forward_phase else 0.0
            grads = mem["gradients"]
            mem["gradients"] = max(grads - forward, 0.0)
            if last:
                mem["fp8_last_backward"] = max(grads + last - forward, 0.0) - mem["gradients"]
        return mem

    def _last_fp8_projection(self, L: Layout) -> float:
        """Bytes the first decoder layer's largest FP8 projection holds beside every gradient
        while its backward runs: its cached FP8 weight and transpose (2 per weight), and under
        rowwise scaling its weight gradient's bf16 result before the fp32 conversion (2 more)."""
        md = self.model
        if md.moe and md.first_k_dense == 0:
            params = md.num_experts // L.ep * md.expert_ffn_dim * md.dim  # the stacked experts
        else:
            params = md.ffn_dim // L.tp * md.dim
        return (4 if L.fp8 == "rowwise" else 2) * params
