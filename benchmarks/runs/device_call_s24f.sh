#!/bin/bash
# The daemon on the GPU after this session's changes: full-size PI0.5, cudagraph bf16, exact guidance
# (the fused VJP forward on by default), 8 s; ticks, missed slots, delay. Carry .whl.
export TRITON_CACHE_DIR=/tmp/tc PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
cat > /tmp/gpu.toml <<TOML
[cameras.top]
source = "synthetic"
[model]
preset = "full"
backend = "cudagraph"
device = "cuda"
dtype = "bfloat16"
[chunking]
mode = "guided"
[publish]
endpoint = "tcp://127.0.0.1:5599"
TOML
python3 -m phyai_edge run --check-config /tmp/gpu.toml
timeout 170 python3 -m phyai_edge run --config /tmp/gpu.toml --duration 8 --summary $OUT/summary.json > $OUT/daemon.txt 2>&1; echo "rc $?"
grep -E "captured|warm-up|stopped|rror|did not run|after its deadline|delay" $OUT/daemon.txt | cut -c1-200 | tail -10
