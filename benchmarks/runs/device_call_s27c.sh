#!/bin/bash
# Twenty-seventh session (any GPU): device_call_s27b.sh (the changed load path and GPU tests), then
# on an H200 only the shared server at 64 robots (an H100 fails them for throughput). Carry .whl.
bash benchmarks/runs/device_call_s27b.sh
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader)
if [[ "$GPU" == *H200* ]]; then
  source benchmarks/runs/lib.sh
  gpu_env
  echo "=== serving, 64 robots"
  timeout 220 python3 benchmarks/serve_gpu.py robots --robots 64 --seconds 15 --warmup-s 2 --out $OUT/serve \
      > $OUT/serve64.log 2>&1
  grep -vE "^\s*$" $OUT/serve64.log | grep -E "warm|robots|measured|PASS|FAIL" | tail -8
fi
