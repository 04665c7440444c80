#!/bin/bash
# Twenty-seventh session, call 4 (any GPU): after call 3 (s27c on an H100): the two bundle tests
# that assumed a CPU export (fixed: they export on the CPU wherever they run), and the finite-check
# cost, whose script drew the full preset on the meta device (fixed). Carry .whl.
source benchmarks/runs/lib.sh
gpu_env
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_bundle_weights.py tests/test_loaders.py -k "precision or non_finite" 2>&1 | tail -2
timeout 400 python3 benchmarks/load_check_gpu.py --reps 3 2>&1 | tail -4
