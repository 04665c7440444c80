#!/bin/bash
# Twenty-eighth session, call 2 (H200): the shared server of issue #7 at HEAD with the fp8 prefix
# (the configuration that passed 64 and 72 robots in the third session, 2026-12-03 call 3), with the
# static scales of that session carried in the repository. Carry .whl.
export TRITON_CACHE_DIR=/tmp/tc PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 400 python3 benchmarks/serve_gpu.py robots --robots 64,72 --seconds 15 --warmup-s 2 --fp8 prefix \
    --fp8-scales benchmarks/runs/pi05_fp8_scales_seed0_2026-12-03.json --out $OUT/serve > $OUT/serve_fp8.log 2>&1
grep -vE "^\s*$" $OUT/serve_fp8.log | grep -E "warm|robots|measured|PASS|FAIL|Error|error" | tail -10
