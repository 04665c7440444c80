#!/bin/bash
# Twenty-seventh session, call 2 (any GPU): the changed load path on the GPU (NaN / Inf weights
# refused, flags gathered on the device) and what the check costs at full size; the GPU tests of
# the paths this session touched. Carry .whl.
source benchmarks/runs/lib.sh
gpu_env
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
echo "=== GPU tests"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_loaders.py tests/test_preprocess_batched.py \
    tests/test_bundle_weights.py tests/test_cudagraph.py 2>&1 | tail -4
echo "=== the finite check's cost at full size"
timeout 240 python3 benchmarks/load_check_gpu.py --reps 3 2>&1 | tail -4
