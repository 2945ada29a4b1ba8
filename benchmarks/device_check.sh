#!/usr/bin/env bash
# One device call: the GPU test suite (tests/kernels at full size + tests/gpu), then the kernel
# benchmark. Logs and benchmarks/results JSON go under $OUT (the device tool brings them back).
# Usage (on the GPU machine, from the repo root): bash benchmarks/device_check.sh [bench args]
# Env: TEST_TIMEOUT / BENCH_TIMEOUT (seconds), SKIP_TESTS=1, PYTEST_WORKERS, PYTEST_ARGS.
set -u
OUT=${OUT:-/tmp/ppqa-device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TRITON_INTERPRET=0
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  # xdist spreads the Triton compiles over the CPU cores; the GPU is shared by the workers.
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -n "${PYTEST_WORKERS:-8}" -p no:cacheprovider --durations=12 \
    tests/kernels tests/gpu ${PYTEST_ARGS:-} > "$OUT/pytest.log" 2>&1
  echo "pytest exit $?"
  grep -E "passed|failed|error|Error|assert" "$OUT/pytest.log" | tail -25
fi
timeout "${BENCH_TIMEOUT:-240}" python3 benchmarks/layer_kernels.py --out "$OUT/kernels_h200.json" "$@" \
  2>&1 | tee "$OUT/bench.log" | tail -60
