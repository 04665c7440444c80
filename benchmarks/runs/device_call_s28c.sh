#!/bin/bash
# Twenty-eighth session, call 3: would weight-only int8 / fp8 make the batch-1 action expert's GEMMs
# faster (benchmarks/weight_only_gpu.py)? Nothing to carry.
export TRITON_CACHE_DIR=/tmp/tc PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 500 python3 benchmarks/weight_only_gpu.py --json $OUT/weight_only.json > $OUT/weight_only.log 2>&1
echo "rc=$?"; tail -12 $OUT/weight_only.log
