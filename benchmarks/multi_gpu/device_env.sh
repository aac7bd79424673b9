# Source this from the repository root before running the benchmarks/multi_gpu scripts from a
# source checkout on a GPU machine where the packages are not installed:
#
#   . benchmarks/multi_gpu/device_env.sh && torchrun --nproc-per-node 8 benchmarks/multi_gpu/parity.py
#
# * NVLink multicast off in NCCL, PyTorch and NVSHMEM (the scripts refuse other values, so their
#   figures never depend on it).
# * The mt packages from this checkout on PYTHONPATH (pure Python: nothing to build).
# * mt-train's config dependencies (hydra-core, omegaconf, antlr4), if the machine lacks them,
#   from wheels placed in .whl/train, installed once into /tmp/mt-site.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
_mt_site=/tmp/mt-site
if [ -d .whl/train ] && ! [ -d "$_mt_site/hydra" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$_mt_site" .whl/train/hydra_core-*.whl .whl/train/omegaconf-*.whl \
        .whl/train/antlr4_python3_runtime-*.whl || echo "device_env.sh: wheel install failed" >&2
fi
_mt_src=""
for _p in mt-core mt-comm mt-fp8 mt-parallel mt-train; do _mt_src="$_mt_src:$PWD/packages/$_p/src"; done
export PYTHONPATH="${_mt_src#:}:$_mt_site${PYTHONPATH:+:$PYTHONPATH}"
unset _p _mt_src _mt_site
python3 -c 'import torch, mt_parallel; print("device_env:", torch.__version__, "cuda", torch.version.cuda, "GPUs", torch.cuda.device_count())'
