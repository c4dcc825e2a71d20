#!/usr/bin/env bash
# One run on the GPU machine: install the offline wheels, run the GPU tests, then the benchmarks.
# Usage (device tool, with .whl carried): bash scripts/gpu_check.sh [tests] [decode] [kernels] [loading]
# Logs and JSON go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
stages=${*:-tests decode}
for stage in $stages; do
  start=$(date +%s)
  case $stage in
    tests)   timeout 420 python3 -m pytest tests/gpu tests/kernels -q -rA -p no:cacheprovider > "$OUT/tests.log" 2>&1 ;;
    decode)  timeout 300 python3 -m bench.decode_step --out "$OUT/decode.json" > "$OUT/decode.log" 2>&1 ;;
    kernels) timeout 120 python3 -m bench.kernels_lora --out "$OUT/kernels_lora.json" > "$OUT/kernels.log" 2>&1 ;;
    loading) timeout 300 python3 -m bench.lora_loading --out "$OUT/lora_loading.json" > "$OUT/loading.log" 2>&1 ;;
  esac
  echo "$stage: rc=$? in $(( $(date +%s) - start )) s" | tee -a "$OUT/stages.txt"
done
tail -5 "$OUT"/tests.log 2>/dev/null
