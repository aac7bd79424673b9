"""Document-masked causal attention through PyTorch's FlexAttention, and the choice of kernel.

Shape suffixes: B batch, H query heads, K key/value heads (GQA: H a multiple of K), S tokens
of the sequence, t tokens this rank holds (``S/cp``; ``S`` at cp = 1), d head dim.

Math (packed sequences, every kernel)::

    o_BHSd = softmax(q·kᵀ/√d + M) · v,   M[b, i, j] = 0 if j ≤ i and doc[b, i] = doc[b, j], else −∞

with query head ``h`` reading key/value head ``h // (H/K)``. A query always sees itself, so no
row of ``M`` is empty. Two kernels compute it (:data:`DOCUMENT_MASK_KERNELS`):

- ``explicit``: a boolean ``(B, 1, S, S)`` mask handed to ``scaled_dot_product_attention``
  (:func:`mt_parallel.context_parallel.context_parallel_attention`). It runs on every device and
  under context parallelism and is the reference, but it materialises the mask, and SDPA with an
  arbitrary mask cannot use the flash kernel on GPUs.
- ``flex``: ``torch.nn.attention.flex_attention`` with a ``BlockMask`` that
  ``create_block_mask`` builds from the document ids (``mask_mod = causal ∧ same document``).
  The block mask records, per 128×128 tile, whether the tile is empty (skipped), full (run
  without evaluating the mask) or partial (``mask_mod`` evaluated per element), so the work is
  that of the documents' own causal triangles. On CUDA the block mask is built by
  ``torch.compile``'d ``create_block_mask`` and the call is ``torch.compile``'d
  ``flex_attention`` (PyTorch's fused Triton kernel, forward and backward); elsewhere it is
  torch's unfused eager implementation (forward only on the CPU: torch refuses its backward
  there). FlexAttention has no dropout, so it is refused with attention dropout, and it does
  not run inside ring attention (:func:`check_flex`).

Context parallelism (all-gather K/V, :mod:`mt_parallel.context_parallel`'s layout). Rank ``r``
holds the query chunks ``g ∈ {r, 2·cp−1−r}`` of ``L = t/2`` tokens each; K/V (unless the caller
hands them over gathered, as multi-head latent attention does) and the document ids are
all-gathered and put in global order, and chunk ``g`` attends to the keys
``[0, (g+1)·L)`` with ``mask_mod = (kv ≤ q + g·L) ∧ doc_q[q] = doc[kv]``: one block mask per
chunk, both built once per micro-batch (the ids are gathered then, not in every layer).

``auto`` picks ``flex`` on CUDA where it applies (no attention dropout, no ring attention) and
``explicit`` everywhere else (:func:`resolve_document_mask_kernel`).

Block mask cache: one slot keyed by the document-id tensor (the object and its version
counter). Every layer of a forward, and a recomputation, receives the same tensor, so the mask
is built once per micro-batch and shared by all layers. Under CP every rank of the group
receives its new ids at the same layer, so all of them miss the cache together and the
all-gather of the ids is matched. The flex call runs outside any
enclosing ``torch.compile`` graph (``torch.compiler.disable``: a compiled block breaks its graph
around the attention core) and with autocast off (its inputs already carry the compute dtype),
so the separately compiled kernel sees the same call in eager and compiled models.
"""

from __future__ import annotations

from typing import Any

import torch

import mt_comm
from mt_parallel.context_parallel import _global_order, check_document_ids, whole_sequence_kv
from mt_parallel.mappings import group_rank, group_size

DOCUMENT_MASK_KERNELS = ("auto", "flex", "explicit")
"""``data.document_masking_kernel`` values (module docstring)."""


def check_flex(
    cp: int, attention_dropout: float, device_type: str | None = None, ring: bool = False
) -> None:
    """Raise unless FlexAttention can run document masking here (module docstring)."""
    if cp > 1 and ring:
        raise ValueError(
            f"document_masking_kernel=flex does not run inside ring attention (cp={cp}, "
            "cp_attention=ring): use cp_attention=all_gather, or document_masking_kernel="
            "explicit or auto"
        )
    if attention_dropout > 0:
        raise ValueError(
            f"document_masking_kernel=flex has no attention dropout (dropout={attention_dropout}):"
            " use document_masking_kernel=explicit or auto, or dropout=0"
        )
    if device_type == "cpu":
        raise ValueError(
            "document_masking_kernel=flex needs a GPU (torch's FlexAttention has no backward on "
            "the CPU): use document_masking_kernel=explicit or auto"
        )


def resolve_document_mask_kernel(
    kernel: str,
    device_type: str,
    cp: int = 1,
    attention_dropout: float = 0.0,
    ring: bool = False,
) -> str:
    """``flex`` or ``explicit`` for ``kernel`` on ``device_type`` (module docstring)."""
    if kernel not in DOCUMENT_MASK_KERNELS:
        raise ValueError(
            f"document_masking_kernel={kernel!r} is unknown; valid: {', '.join(DOCUMENT_MASK_KERNELS)}"
        )
    if kernel == "auto":
        fits = device_type == "cuda" and attention_dropout == 0 and not (cp > 1 and ring)
        return "flex" if fits else "explicit"
    if kernel == "flex":
        check_flex(cp, attention_dropout, device_type, ring)
    return kernel


class _BlockMaskCache:
    """The block masks of the last document-id tensor seen (module docstring)."""

    def __init__(self) -> None:
        self.key: tuple[torch.Tensor, int] | None = None
        self.masks: Any = None
        self.builds = 0
        """Times block masks were built (the tests count them)."""

    def get(self, document_ids_Bt: torch.Tensor, cp_group: Any = None) -> list[Any]:
        """One block mask (cp = 1) or one per query chunk (cp > 1) for ``document_ids_Bt``."""
        key = self.key
        if key is None or key[0] is not document_ids_Bt or key[1] != document_ids_Bt._version:
            self.masks = _build_masks(document_ids_Bt, cp_group)
            self.key = (document_ids_Bt, document_ids_Bt._version)
            self.builds += 1
        return self.masks


BLOCK_MASKS = _BlockMaskCache()


def _build_masks(document_ids_Bt: torch.Tensor, cp_group: Any) -> list[Any]:
    cp, rank = group_size(cp_group), group_rank(cp_group)
    if cp == 1:
        return [document_block_mask(document_ids_Bt)]
    chunk = document_ids_Bt.shape[1] // 2
    order = _global_order(chunk, cp).to(document_ids_Bt.device)
    gathered = mt_comm.all_gather(document_ids_Bt.contiguous(), dim=1, group=cp_group)
    doc_BS = gathered.index_select(1, order)
    return [
        document_block_mask(
            document_ids_Bt[:, half * chunk : (half + 1) * chunk],
            doc_BS[:, : (g + 1) * chunk],
            query_offset=g * chunk,
        )
        for half, g in enumerate((rank, 2 * cp - 1 - rank))
    ]


def document_block_mask(
    doc_q_Bq: torch.Tensor,
    doc_k_Bk: torch.Tensor | None = None,
    query_offset: int = 0,
    compiled: bool | None = None,
) -> Any:
    """FlexAttention ``BlockMask`` of ``causal ∧ same document``: query ``i`` (global position
    ``i + query_offset``, document ``doc_q_Bq[:, i]``) sees key ``j`` (document
    ``doc_k_Bk[:, j]``; default: the queries' own ids) if ``j ≤ i + query_offset`` and the
    documents match.

    ``compiled`` (default: on CUDA) builds it through ``torch.compile(create_block_mask)``,
    torch's advice for long sequences: the eager builder materialises the whole
    ``(B, 1, q, k)`` element mask and its intermediates before reducing it to tiles. Both give
    the same block mask.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    doc_k_Bk = doc_q_Bq if doc_k_Bk is None else doc_k_Bk
    B, q_len = doc_q_Bq.shape

    def causal_same_document(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        causal = kv_idx <= q_idx + query_offset
        return causal & (doc_q_Bq[b, q_idx] == doc_k_Bk[b, kv_idx])

    if compiled is None:
        compiled = doc_q_Bq.device.type == "cuda"
    build = _compiled("create_block_mask", create_block_mask) if compiled else create_block_mask
    return build(causal_same_document, B, None, q_len, doc_k_Bk.shape[1], device=doc_q_Bq.device)


_COMPILED: dict[str, Any] = {}


def _compiled(name: str, function: Any) -> Any:
    """``torch.compile(function)``, built once (new masks reuse the graph: the ids are an
    input of it, not a constant)."""
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(function, dynamic=False)
    return _COMPILED[name]


def _flex_function(device_type: str) -> Any:
    """``torch.compile(flex_attention)`` on CUDA (the fused kernel), eager elsewhere."""
    from torch.nn.attention.flex_attention import flex_attention

    return _compiled("flex_attention", flex_attention) if device_type == "cuda" else flex_attention


@torch.compiler.disable  # outside enclosing graphs (module docstring)
def flex_document_attention(
    q_BHtd: torch.Tensor,
    k_BKtd: torch.Tensor,
    v_BKtd: torch.Tensor,
    document_ids_Bt: torch.Tensor,
    cp_group: Any = None,
    kv_gathered: bool = False,
) -> torch.Tensor:
    """Causal GQA attention inside each document, by FlexAttention; with a cp group of more
    than one rank, of this rank's load-balanced queries over the all-gathered keys (module
    docstring), or over ``k``/``v`` that already hold the whole sequence in global order
    (``kv_gathered``, :func:`~mt_parallel.context_parallel.gather_sequence`)."""
    check_document_ids(q_BHtd, document_ids_Bt)
    masks = BLOCK_MASKS.get(document_ids_Bt, cp_group)
    device_type = q_BHtd.device.type
    flex = _flex_function(device_type)
    gqa = q_BHtd.shape[1] != k_BKtd.shape[1]
    cp, rank = group_size(cp_group), group_rank(cp_group)
    with torch.autocast(device_type, enabled=False):
        k_BKtd, v_BKtd = k_BKtd.to(q_BHtd.dtype), v_BKtd.to(q_BHtd.dtype)
        if cp == 1:
            return flex(q_BHtd, k_BKtd, v_BKtd, block_mask=masks[0], enable_gqa=gqa)
        chunk = q_BHtd.shape[2] // 2
        k_BKSd, v_BKSd = whole_sequence_kv(q_BHtd, k_BKtd, v_BKtd, cp_group, kv_gathered)
        outputs = [
            flex(
                q_BHtd[:, :, half * chunk : (half + 1) * chunk],
                k_BKSd[:, :, : (g + 1) * chunk],
                v_BKSd[:, :, : (g + 1) * chunk],
                block_mask=masks[half],
                enable_gqa=gqa,
            )
            for half, g in enumerate((rank, 2 * cp - 1 - rank))
        ]
        return torch.cat(outputs, dim=2)


def apply_document_mask_kernel(model: torch.nn.Module, kernel: str) -> torch.nn.Module:
    """Give every module with a ``set_document_mask_kernel`` hook (the attention cores) the
    resolved ``kernel`` (``explicit`` or ``flex``); after context parallelism, whose cp group
    ``flex`` refuses."""
    for module in model.modules():
        if hasattr(module, "set_document_mask_kernel"):
            module.set_document_mask_kernel(kernel)
    return model
