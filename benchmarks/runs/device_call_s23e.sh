#!/bin/bash
# The shared server at 48 robots after the serving fix (room kept: no exact-length graph sets;
# serve_gpu warms as `phyai-edge serve` does). Expect captures while serving 0. Carry .whl.
export TRITON_CACHE_DIR=/tmp/tc PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader -lms 1000 > $OUT/mem.csv &
timeout 280 python3 benchmarks/serve_gpu.py robots --robots 48 --seconds 10 --warmup-s 2 --out $OUT/serve 2>&1 | grep -vE "^\s*$" | tail -22
kill %1
sort -t, -k2 -n $OUT/mem.csv | tail -1
