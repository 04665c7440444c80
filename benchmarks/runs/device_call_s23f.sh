#!/bin/bash
# For the next session, on an H200 (this session got H100s only): the shared server at 48 and 64
# robots in bf16 after the serving fix (the batch-32 engine is now ~143 samples/s, above the 128
# chunks/s 64 robots ask for), then the headline with exact guidance (EARLY_STEP_GUIDED on). Carry .whl.
export TRITON_CACHE_DIR=/tmp/tc PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader
echo "=== serving"
timeout 330 python3 benchmarks/serve_gpu.py robots --robots 48,64 --seconds 15 --warmup-s 2 --out $OUT/serve 2>&1 \
    | grep -vE "^\s*$" | grep -E "warm|robots|measured|PASS|FAIL" | tail -8
echo "=== headline"
timeout 240 python3 benchmarks/pi05_gpu.py --triton-only --no-fp8 --no-compile --no-compile-baseline \
    --batches 1,8,32 --variants "triton+gemm" --rtc-modes guided --rtc-batches 1,8,32 --out $OUT/pi05 --budget-s 200 2>&1 | tail -14
