#!/usr/bin/env bash
# FlashInfer's paged decode beside our stock decode on the GPU machine (issue 6), from the 0.2.5
# source release carried in .fi/ (the machine reaches no network; the wheel is over the carry
# limit). The release is laid out as an installed package would be (flashinfer/data/{include,
# csrc,cutlass}) and its kernels compile with the machine's nvcc at first use (JIT), for sm_90
# only. Usage there, from the repo root, with .fi carried:
#   timeout 300 bash benchmarks/flashinfer_device.sh [--cells 16384x256]
# Here, to fetch the release:
#   python3 -m pip download --no-deps --no-binary :all: flashinfer-python==0.2.5 -d .fi
set -u
OUT=${OUT:-/tmp/ppqa-device-out}
mkdir -p "$OUT" /tmp/fi
tar xzf .fi/flashinfer_python-0.2.5.tar.gz -C /tmp/fi || exit 1
src=/tmp/fi/flashinfer_python-0.2.5
mkdir -p "$src/flashinfer/data"
ln -sfn "$src/include" "$src/flashinfer/data/include"
ln -sfn "$src/csrc" "$src/flashinfer/data/csrc"
ln -sfn "$src/3rdparty/cutlass" "$src/flashinfer/data/cutlass"
# nvcc 13 gives __global__ template stubs internal linkage, and 0.2.5's decode module then fails
# to link (run 7, call 4: "relocation ... against undefined hidden symbol BatchDecodeWith
# PagedKVCacheKernel"); later FlashInfer releases pass this flag (their PR #1523).
sed -i 's/"-std=c++17",/"-std=c++17", "-static-global-template-stub=false",/' \
  "$src/flashinfer/jit/core.py"
export PYTHONPATH=$PWD:$src:${PYTHONPATH:-} TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 \
  FLASHINFER_WORKSPACE_BASE=/tmp PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
command -v nvcc ninja || echo "nvcc or ninja missing"
python3 benchmarks/flashinfer_stock.py --out "$OUT/flashinfer_stock.json" "$@" 2>&1 | tail -30
