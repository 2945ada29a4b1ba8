#!/usr/bin/env bash
# Source on the GPU machine, from the repo root, with .fi carried: unpacks FlashInfer's 0.2.5
# source release from .fi/ into /tmp/fi, lays it out as an installed package would be
# (flashinfer/data/{include,csrc,cutlass}) and exports what its JIT build needs; its kernels
# compile with the machine's nvcc at first use (about a minute a module), for sm_90 only.
# The machine reaches no network and the wheel is over the carry limit. Here, to fetch it:
#   python3 -m pip download --no-deps --no-binary :all: flashinfer-python==0.2.5 -d .fi
mkdir -p /tmp/fi
tar xzf .fi/flashinfer_python-0.2.5.tar.gz -C /tmp/fi || return 1
FI_SRC=/tmp/fi/flashinfer_python-0.2.5
mkdir -p "$FI_SRC/flashinfer/data"
ln -sfn "$FI_SRC/include" "$FI_SRC/flashinfer/data/include"
ln -sfn "$FI_SRC/csrc" "$FI_SRC/flashinfer/data/csrc"
ln -sfn "$FI_SRC/3rdparty/cutlass" "$FI_SRC/flashinfer/data/cutlass"
# nvcc 13 gives __global__ template stubs internal linkage, and 0.2.5's decode module then fails
# to link ("relocation ... against undefined hidden symbol BatchDecodeWithPagedKVCacheKernel");
# later FlashInfer releases pass this flag (their PR #1523).
grep -q static-global-template-stub "$FI_SRC/flashinfer/jit/core.py" || \
  sed -i 's/"-std=c++17",/"-std=c++17", "-static-global-template-stub=false",/' \
    "$FI_SRC/flashinfer/jit/core.py"
export PYTHONPATH=$PWD:$FI_SRC:${PYTHONPATH:-} TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 \
  FLASHINFER_WORKSPACE_BASE=/tmp PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
command -v nvcc >/dev/null && command -v ninja >/dev/null || echo "nvcc or ninja missing"
