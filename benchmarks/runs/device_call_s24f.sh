#!/bin/bash
# The daemon on the GPU after this session's changes: full-size PI0.5, cudagraph bf16, exact guidance
# (the fused VJP forward on by default), 8 s; ticks, missed slots, delay. Carry .whl.
source benchmarks/runs/lib.sh
gpu_env
nvidia-smi --query-gpu=name --format=csv,noheader
daemon_toml /tmp/gpu.toml guided
python3 -m phyai_edge run --check-config /tmp/gpu.toml
timeout 170 python3 -m phyai_edge run --config /tmp/gpu.toml --duration 8 --summary $OUT/summary.json > $OUT/daemon.txt 2>&1; echo "rc $?"
grep -E "captured|warm-up|stopped|rror|did not run|after its deadline|delay" $OUT/daemon.txt | cut -c1-200 | tail -10
