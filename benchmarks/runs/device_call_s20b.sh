#!/bin/bash
# The twentieth session's second pending call: the headline at HEAD (this session changed
# Policy.infer's host path: states kept for relative actions, prompt room) and the GPU tests of
# the code it added. Carry .whl (pyzmq) as in device_call_s20.sh.
export TRITON_CACHE_DIR=/tmp/tc PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
echo "=== GPU tests of this session's code"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_control_task.py tests/test_relative_actions.py \
    tests/test_control_geometry.py -k "cuda or room or inpaint or relative" 2>&1 | grep -vE "leaked|nanobind|refleaks" | tail -5
echo "=== headline"
timeout 330 python3 benchmarks/pi05_gpu.py --triton-only --no-fp8 --no-compile --no-compile-baseline --batches 1,8,32 \
    --variants "triton+gemm" --rtc-modes guided --rtc-batches 1,8,32 --out $OUT/pi05 --budget-s 300 2>&1 | tail -30
