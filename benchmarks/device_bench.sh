#!/usr/bin/env bash
# One device call of `ppqa bench` on the H200: install the store's wheels (the CLI imports
# SQLAlchemy), check CUDA-graph replay against eager steps, then run the cells named in
# $BENCH_PLAN (one `ppqa bench` argument line per model), writing JSON + logs under $OUT.
# Usage on the GPU machine, from the repo root, with .whl carried:
#   BENCH_PLAN=benchmarks/plans/grid.txt bash benchmarks/device_bench.sh
set -u
OUT=${OUT:-/tmp/ppqa-device-out}
mkdir -p "$OUT"
# A PYTHONPATH set before (benchmarks/flashinfer_setup.sh's, for --modes stock-flashinfer)
# stays after ours.
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site:${PYTHONPATH:-} || exit 1
graphs=--cuda-graphs
if [ "${SKIP_GRAPH_TEST:-0}" != 1 ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_engine_graphs.py \
    > "$OUT/graphs_test.log" 2>&1
  status=$?
  tail -3 "$OUT/graphs_test.log"
  [ $status = 0 ] || { echo "graph test failed: benchmarking eager steps"; graphs=--no-cuda-graphs; }
fi
while read -r name args; do
  [ -z "$name" ] || [ "${name#\#}" != "$name" ] && continue
  echo "== $name: $args $graphs"
  # shellcheck disable=SC2086
  python3 -m ppqa bench $args $graphs --out "$OUT/$name.json" 2>>"$OUT/bench.log" | tail -20
done < "${BENCH_PLAN:?set BENCH_PLAN to a plan file}"
tail -5 "$OUT/bench.log"
