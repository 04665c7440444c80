#!/bin/bash
# Exact RTC guidance with its first step (forward and gradient) beside the prefix: GPU tests (real
# capture, autograd on the side stream), then engines alternated at batch 1 in exact guidance.
# Carry .whl (pyzmq).
export TRITON_CACHE_DIR=/tmp/tc PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
echo "=== tests"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_early_step.py 2>&1 | grep -vE "leaked|nanobind|refleaks|skipped remainder" | tail -4
echo "=== exact guidance, batch 1"
timeout 150 python3 benchmarks/engine_ab_gpu.py --rtc guided --reps 30 --variants "plain:no-early;early:early+early-guided" \
    --json $OUT/ab_guided_early_b1.json 2>&1 | tail -3
