#!/bin/bash
# Twenty-eighth session, call 1 (kind nvidia-h200, needs_h200): the headline with exact
# guidance at HEAD on an H200 (the last H200 headline was the twenty-second session's), then the
# shared server at 64 robots (an H100 fails them for throughput). Carry .whl.
export TRITON_CACHE_DIR=/tmp/tc PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
GPU=$(nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader); echo "$GPU"
echo "=== headline"
timeout 260 python3 benchmarks/pi05_gpu.py --triton-only --no-fp8 --no-compile --no-compile-baseline \
    --batches 1,8,32 --variants "triton+gemm" --rtc-modes guided --rtc-batches 1,8,32 --out $OUT/pi05 --budget-s 220 \
    > $OUT/headline.log 2>&1; tail -14 $OUT/headline.log
if [[ "$GPU" == *H200* ]]; then
  echo "=== serving, 64 robots"
  timeout 200 python3 benchmarks/serve_gpu.py robots --robots 64 --seconds 15 --warmup-s 2 --out $OUT/serve \
      > $OUT/serve64.log 2>&1
  grep -vE "^\s*$" $OUT/serve64.log | grep -E "warm|robots|measured|PASS|FAIL" | tail -8
fi
