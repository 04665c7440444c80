#!/bin/bash
# Exact guidance's forward with QKV + RoPE and gate/up + GeGLU on their fused small-M kernels (two
# kernels a block fewer; backward unchanged: the elementwise gradient kernels and cuBLAS), behind
# `triton_gemm.set_grad_gemms`: its tests on the GPU, then engines alternated at batch 1. Carry .whl.
export TRITON_CACHE_DIR=/tmp/tc PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
echo "=== tests"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_triton_gemm.py tests/test_triton_grad.py \
    -k "grad or fused_kernel or gemms or vjp" 2>&1 | grep -vE "leaked|nanobind|refleaks" | tail -4
echo "=== A/B, batch 1, exact guidance"
timeout 300 python3 benchmarks/engine_ab_gpu.py --rtc guided --reps 50 --json $OUT/ab_fused_forward.json \
    --variants "cublas;fused forward:grad-gemms;cublas again" 2>&1 | tail -6
