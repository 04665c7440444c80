#!/bin/bash
# Runs at ca030da (the knobs it names were reverted in the next commit).
# Exact guidance's projections on the small-M kernels (`triton_gemm.set_grad_gemms`): their tests on
# the GPU, then engines alternated at batch 1 with exact guidance (cuBLAS, the default; the kernels
# with GRAD_CONFIGS' guesses; the kernels with the forward's tilings). Carry .whl.
export TRITON_CACHE_DIR=/tmp/tc PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
echo "=== tests"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_triton_gemm.py -k "grad or gradient or gemms" 2>&1 \
    | grep -vE "leaked|nanobind|refleaks" | tail -4
echo "=== A/B, batch 1, exact guidance"
timeout 330 python3 benchmarks/engine_ab_gpu.py --rtc guided --reps 40 --json $OUT/ab_grad_gemms.json --variants \
    "cublas;kernels:grad-gemms;kernels, forward tiles:grad-gemms+grad:linear/m64/narrow=64,32,128,4,4,4+grad:linear/m64/wide=64,64,128,4,4,1" \
    2>&1 | tail -8
