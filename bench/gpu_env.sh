# Source this at the start of a command on the GPU machine: installs the wheels carried in .whl/ (this
# project's packages in .whl/slide, flash-linear-attention in .whl/fla, kept apart so rows can run with and
# without it) and puts the project's on the path. Build them first, where pip reaches an index:
#   pip wheel --no-deps -w .whl/slide packages/slide-core packages/slide-kernels packages/slide-io packages/slide-hf packages/slide-rocm
#   pip download --no-deps -d .whl/fla flash-linear-attention==0.6.0 fla-core==0.6.0 einops
# (einops: fla imports it, and the GPU machine's Python may lack it; where fla does not import, the '+fla'
# rows run the torch path, which bench/gpu_matrix.py now fails)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/slide/*.whl
if ls .whl/fla/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fla .whl/fla/*.whl
fi
export PYTHONPATH=/tmp/site
