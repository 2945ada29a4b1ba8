#!/usr/bin/env bash
# FlashInfer's paged decode beside our stock decode on the GPU machine, per layer
# (benchmarks/flashinfer_stock.py), from the source release that flashinfer_setup.sh unpacks.
# Usage there, from the repo root, with .fi carried:
#   timeout 300 bash benchmarks/flashinfer_device.sh [--cells 16384x256] [--doc-product]
set -u
OUT=${OUT:-/tmp/ppqa-device-out}
mkdir -p "$OUT"
# shellcheck source=benchmarks/flashinfer_setup.sh
source benchmarks/flashinfer_setup.sh || exit 1
python3 benchmarks/flashinfer_stock.py --out "$OUT/flashinfer_stock.json" "$@" 2>&1 | tail -30
