#!/bin/bash
# The first flow step beside the prefix (`CudaGraphEngine(early_step=True)`): its tests with real
# capture on two streams, the engine tests its hooks touch, and the engines alternated at batch 1
# without RTC and with the daemon's guided-approx.
export TRITON_CACHE_DIR=/tmp/tc PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
echo "=== tests"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_early_step.py tests/test_cudagraph.py tests/test_unmasked_expert.py \
    2>&1 | grep -vE "leaked|nanobind|refleaks|skipped remainder" | tail -6
echo "=== A/B, no RTC"
timeout 200 python3 benchmarks/engine_ab_gpu.py --variants "default;early:early" --reps 150 --json $OUT/ab_none.json 2>&1 | tail -4
echo "=== A/B, guided-approx"
timeout 150 python3 benchmarks/engine_ab_gpu.py --rtc guided-approx --variants "default;early:early" --reps 100 --json $OUT/ab_approx.json 2>&1 | tail -4
