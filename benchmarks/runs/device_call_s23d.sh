#!/bin/bash
# The shared server at 48 and 64 robots again, with the capture count fixed (it had never counted):
# on an H100 (call 3) every batch size's first use while serving took 0.7-3 s. Graphs built while
# serving, or memory (28 graph sets near the H100's 80 GB)? GPU memory sampled alongside. Carry .whl.
export TRITON_CACHE_DIR=/tmp/tc PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv,noheader -lms 1000 > $OUT/mem.csv &
timeout 480 python3 benchmarks/serve_gpu.py robots --robots 48,64 --seconds 15 --warmup-s 2 --out $OUT/serve 2>&1 | grep -vE "^\s*$" | tail -40
kill %1
sort -t, -k2 -n $OUT/mem.csv | tail -1
