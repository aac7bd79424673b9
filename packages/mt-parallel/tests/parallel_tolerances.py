"""Error bounds shared by the mt-parallel tests, with their justification, and ``assert_close``.

``FP32_VS_FP64``: the parallel computation runs in fp32, the reference in fp64 on one process.
fp32's unit roundoff is u = 2⁻²⁴ ≈ 6e-8. Every compared value is a short chain (≤ 2 blocks) of
dot products of length ≤ 64, softmaxes and norms; the usual bound grows like √n·u per dot
product, a few times over, so a correct implementation lands around 1e-7..1e-6 relative to the
tensor's largest entry (observed: ≤ 5e-7). 1e-5 keeps a 10× margin for a different reduction
order and is still 4 orders of magnitude below what a wrong shard, a missing or doubled
reduction or a wrong causal offset produces (errors of 1e-2..1).

``FP64_VS_FP64``: both sides in fp64 (the optimizer tests, where AdamW's g/√v would amplify fp32
rounding of near-zero gradients); u = 1.1e-16, so 1e-10 is a wide margin.
"""

FP32_VS_FP64 = 1e-5
FP64_VS_FP64 = 1e-10


def assert_close(result: dict, tol: float = FP32_VS_FP64) -> None:
    """Every float (and every float of a nested dict) in a check's result is below ``tol``."""
    for key, value in result.items():
        if isinstance(value, dict):
            assert value, key
            for name, error in value.items():
                assert error < tol, (key, name, error)
        elif isinstance(value, float):
            assert value < tol, (key, value)
