#!/usr/bin/env bash
# The two-GPU measurements (nvidia-h200-x2): a worker per GPU against one GPU, and tensor
# parallelism. Not yet run. NVLink multicast stays off, as the device rules require.
#   1. correctness first: tests/gpu/test_tensor_parallel_gpu.py (TP=2 over NCCL, CUDA graphs
#      capturing the collectives, fp32, against the unsplit engine's stock tokens);
#   2. e2e `paper` and `labeling` on one GPU and with `--gpus 0,1` (the issue asks >= 1.9x);
#   3. dummy:llama-3-70b+bpe at TP=2 on e2e `paper`, every mode against stock (70B does not fit
#      one H200 with room for KV, so there is no TP=1 row);
#   4. a 7B decode step (dummy:qwen2.5-7b) at TP=2 against TP=1 (benchmarks/tp_decode.py).
# Usage on the GPU machine, from the repo root, with .whl carried (device_bench.sh's wheels) and
# $PPQA_HOME/models/smollm2/tokenizer-*/ for the +bpe models:
#   bash benchmarks/multi_gpu.sh            # STEPS="1 2 3 4" by default; e.g. STEPS="3" alone
# Each step writes JSON and a log under $OUT; one step fits a 10-minute call (PASSES=1).
set -u
OUT=${OUT:-/tmp/ppqa-device-out}
STEPS=${STEPS:-1 2 3 4}
PASSES=${PASSES:-1}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site:${PYTHONPATH:-} || exit 1
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
step() { case " $STEPS " in *" $1 "*) return 0;; *) return 1;; esac; }

if step 1; then
  echo "== 1: tensor parallelism over NCCL, against the unsplit tokens"
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_tensor_parallel_gpu.py \
    > "$OUT/tp_gpu_test.log" 2>&1
  tail -3 "$OUT/tp_gpu_test.log"
fi
if step 2; then
  for gpus in one two; do
    args=()
    [ $gpus = two ] && args=(--run-args "--gpus 0,1")
    echo "== 2: e2e paper,labeling on $gpus GPU(s)"
    python3 -m ppqa bench --e2e paper,labeling --modes stock,auto --passes "$PASSES" \
      "${args[@]}" --work-dir "$OUT/e2e_$gpus" --out "$OUT/e2e_gpus_$gpus.json" \
      2>>"$OUT/e2e_gpus.log" | tail -12
  done
fi
if step 3; then
  echo "== 3: dummy:llama-3-70b+bpe at tensor_parallel 2 on e2e paper"
  python3 -m ppqa bench --e2e paper --model dummy:llama-3-70b+bpe \
    --modes stock,auto,cascade,parallel --passes "$PASSES" \
    --run-args "--gpus 0,1 --tensor-parallel 2" --work-dir "$OUT/e2e_70b" \
    --out "$OUT/e2e_70b_tp2.json" 2>>"$OUT/e2e_70b.log" | tail -12
fi
if step 4; then
  echo "== 4: a 7B decode step, tensor_parallel 2 against 1"
  python3 benchmarks/tp_decode.py --model dummy:qwen2.5-7b --tp 1,2 --modes stock,cascade \
    --questions 64 --doc-tokens 8192 --tokens 128 --out "$OUT/tp_decode_7b.json" \
    2>>"$OUT/tp_decode.log"
fi
