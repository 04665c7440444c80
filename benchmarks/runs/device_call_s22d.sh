#!/bin/bash
# Exact RTC guidance with its first step (forward and gradient) beside the prefix: GPU tests (real
# capture, autograd on the side stream), engines alternated at batch 1 and 8 in exact guidance, then
# the headline with exact guidance at batch 1 / 8 / 32. Carry .whl (pyzmq).
export TRITON_CACHE_DIR=/tmp/tc PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
echo "=== tests"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_early_step.py tests/test_unmasked_expert.py \
    tests/test_cudagraph.py tests/test_rtc_per_sample.py 2>&1 | grep -vE "leaked|nanobind|refleaks|skipped remainder" | tail -4
echo "=== exact guidance, batch 1"
timeout 150 python3 benchmarks/engine_ab_gpu.py --rtc guided --reps 60 --variants "plain:no-early;early:early" \
    --json $OUT/ab_guided_early_b1.json 2>&1 | tail -3
echo "=== exact guidance, batch 8 (full: the unmasked prefix, the masked expert)"
timeout 150 python3 benchmarks/engine_ab_gpu.py --rtc guided --batch 8 --reps 30 --variants "plain:no-early;early:early-max=8" \
    --json $OUT/ab_guided_early_b8.json 2>&1 | tail -3
echo "=== headline with exact guidance"
timeout 280 python3 benchmarks/pi05_gpu.py --triton-only --no-fp8 --no-compile --no-compile-baseline --batches 1,8,32 \
    --variants "triton+gemm" --rtc-modes guided --rtc-batches 1,8,32 --out $OUT/pi05 --budget-s 260 2>&1 | tail -9
