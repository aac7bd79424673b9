"""Document-masked causal attention through PyTorch's FlexAttention, and the choice of kernel.

Shape suffixes: B batch, H query heads, K key/value heads (GQA: H a multiple of K), S tokens,
d head dim.

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
  there). FlexAttention has no dropout and takes the whole sequence, so it is refused with
  attention dropout and under context parallelism (:func:`check_flex`).

``auto`` picks ``flex`` on CUDA where it applies (no attention dropout, cp = 1) and ``explicit``
everywhere else (:func:`resolve_document_mask_kernel`).

Block mask cache: one slot keyed by the document-id tensor (the object and its version
counter). Every layer of a forward, and a recomputation, receives the same tensor, so the mask
is built once per micro-batch and shared by all layers. The flex call runs outside any
enclosing ``torch.compile`` graph (``torch.compiler.disable``: a compiled block breaks its graph
around the attention core) and with autocast off (its inputs already carry the compute dtype),
so the separately compiled kernel sees the same call in eager and compiled models.
"""

from __future__ import annotations

from typing import Any

import torch

DOCUMENT_MASK_KERNELS = ("auto", "flex", "explicit")
"""``data.document_masking_kernel`` values (module docstring)."""


def check_flex(cp: int, attention_dropout: float, device_type: str | None = None) -> None:
    """Raise unless FlexAttention can run document masking here (module docstring)."""
    if cp > 1:
        raise ValueError(
            f"document_masking_kernel=flex does not run under context parallelism (cp={cp}): "
            "use document_masking_kernel=explicit or auto"
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
    kernel: str, device_type: str, cp: int = 1, attention_dropout: float = 0.0
) -> str:
    """``flex`` or ``explicit`` for ``kernel`` on ``device_type`` (module docstring)."""
    if kernel not in DOCUMENT_MASK_KERNELS:
        raise ValueError(
            f"document_masking_kernel={kernel!r} is unknown; valid: {', '.join(DOCUMENT_MASK_KERNELS)}"
        )
    if kernel == "auto":
        fits = device_type == "cuda" and cp == 1 and attention_dropout == 0
        return "flex" if fits else "explicit"
    if kernel == "flex":
        check_flex(cp, attention_dropout, device_type)
    return kernel


class _BlockMaskCache:
    """The block mask of the last document-id tensor seen (module docstring)."""

    def __init__(self) -> None:
        self.key: tuple[torch.Tensor, int] | None = None
        self.mask: Any = None
        self.builds = 0
        """Block masks built so far (the tests count them)."""

    def get(self, document_ids_BS: torch.Tensor) -> Any:
        key = self.key
        if key is None or key[0] is not document_ids_BS or key[1] != document_ids_BS._version:
            self.mask = document_block_mask(document_ids_BS)
            self.key = (document_ids_BS, document_ids_BS._version)
            self.builds += 1
        return self.mask


BLOCK_MASKS = _BlockMaskCache()


def document_block_mask(document_ids_BS: torch.Tensor, compiled: bool | None = None) -> Any:
    """FlexAttention ``BlockMask`` of ``causal ∧ same document`` for ``(B, S)`` document ids.

    ``compiled`` (default: on CUDA) builds it through ``torch.compile(create_block_mask)``,
    torch's advice for long sequences: the eager builder materialises the whole
    ``(B, 1, S, S)`` element mask and its intermediates before reducing it to tiles. Both give
    the same block mask.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    B, S = document_ids_BS.shape

    def causal_same_document(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        return (kv_idx <= q_idx) & (document_ids_BS[b, q_idx] == document_ids_BS[b, kv_idx])

    if compiled is None:
        compiled = document_ids_BS.device.type == "cuda"
    build = _compiled("create_block_mask", create_block_mask) if compiled else create_block_mask
    return build(causal_same_document, B, None, S, S, device=document_ids_BS.device)


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
    q_BHSd: torch.Tensor, k_BKSd: torch.Tensor, v_BKSd: torch.Tensor, document_ids_BS: torch.Tensor
) -> torch.Tensor:
    """Causal GQA attention inside each document, by FlexAttention (module docstring)."""
    if document_ids_BS.shape != (q_BHSd.shape[0], q_BHSd.shape[2]):
        raise ValueError(
            f"document ids of shape {tuple(document_ids_BS.shape)} do not match the "
            f"(batch, tokens) = {(q_BHSd.shape[0], q_BHSd.shape[2])} of the queries"
        )
    block_mask = BLOCK_MASKS.get(document_ids_BS)
    device_type = q_BHSd.device.type
    with torch.autocast(device_type, enabled=False):
        return _flex_function(device_type)(
            q_BHSd,
            k_BKSd.to(q_BHSd.dtype),
            v_BKSd.to(q_BHSd.dtype),
            block_mask=block_mask,
            enable_gqa=q_BHSd.shape[1] != k_BKSd.shape[1],
        )


def apply_document_mask_kernel(model: torch.nn.Module, kernel: str) -> torch.nn.Module:
    """Give every module with a ``set_document_mask_kernel`` hook (the attention cores) the
    resolved ``kernel`` (``explicit`` or ``flex``); after context parallelism, whose cp group
    ``flex`` refuses."""
    for module in model.modules():
        if hasattr(module, "set_document_mask_kernel"):
            module.set_document_mask_kernel(kernel)
    return model
