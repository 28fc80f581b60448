#!/usr/bin/env bash
# The CUDA image's /usr/local/cuda, for FlashInfer's kernel builds, from NVIDIA's PyPI wheels: nvcc, the
# headers and the runtime of the CUDA release torch's own CUDA libraries come from (the `cuda-toolkit` torch
# depends on, at its version), and a link-time stub of the driver, lib64/stubs/libcuda.so, whose soname is the
# driver's: a built kernel loads the node's libcuda.so.1. Then nvcc builds and links a kernel with it, so a
# broken toolkit fails the image's build, not a server's first request.
set -euo pipefail
PY=/opt/tandem/.venv/bin/python
CUDA=/usr/local/cuda
VERSION=$($PY -c "import importlib.metadata as m; print(m.version('cuda-toolkit'))")
TORCH_MAJOR=$($PY -c "import torch; print(torch.version.cuda.split('.')[0])")
$PY -m pip install -q "cuda-toolkit[nvcc,cudart,cccl,crt]==$VERSION"
TOP=$($PY -c "import nvidia, os; print(os.path.join(nvidia.__path__[0], 'cu$TORCH_MAJOR'))")
[ -x "$TOP/bin/nvcc" ] || { echo "[cuda] no nvcc in $TOP (cuda-toolkit $VERSION, torch's CUDA $TORCH_MAJOR)" >&2; exit 1; }

mkdir -p "$CUDA/lib64/stubs"
for d in bin include nvvm; do ln -sfn "$TOP/$d" "$CUDA/$d"; done
ln -sf "$TOP"/lib/* "$CUDA/lib64/"
ln -sf "libcudart.so.$TORCH_MAJOR" "$CUDA/lib64/libcudart.so"
# the stub: every function cuda.h declares, under each name its API versions resolve to (cuMemAlloc_v2, the
# per-thread-stream _ptsz, the old names), in a library with the driver's soname
for flags in "" -D__CUDA_API_VERSION_INTERNAL -DCUDA_API_PER_THREAD_DEFAULT_STREAM; do
  gcc -E -P $flags -x c "$CUDA/include/cuda.h"
done | grep -oE '\bcu[A-Z][A-Za-z0-9_]*[[:space:]]*\(' | tr -d ' (' | sort -u | sed 's/.*/void &(void) {}/' \
  | gcc -shared -x c - -Wl,-soname,libcuda.so.1 -o "$CUDA/lib64/stubs/libcuda.so"

tmp=$(mktemp -d)
printf '%s\n' '#include <cuda.h>' '#include <cuda_fp16.h>' \
  '__global__ void twice(half* x) { x[threadIdx.x] = __hadd(x[threadIdx.x], x[threadIdx.x]); }' \
  'extern "C" int launch(half* x) { int v; cuDriverGetVersion(&v); twice<<<1, 32>>>(x); return v; }' >"$tmp/k.cu"
"$CUDA/bin/nvcc" -shared -Xcompiler -fPIC -gencode=arch=compute_90,code=sm_90 "$tmp/k.cu" -o "$tmp/k.so" \
  -L"$CUDA/lib64" -L"$CUDA/lib64/stubs" -lcudart -lcuda
readelf -d "$tmp/k.so" | grep 'Shared library: \[libcuda.so.1\]' >/dev/null \
  || { echo "[cuda] a kernel calling the driver does not load libcuda.so.1" >&2; exit 1; }
rm -rf "$tmp"
echo "[cuda] $CUDA: nvcc $("$CUDA/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p') (cuda-toolkit $VERSION), a kernel built and linked"
