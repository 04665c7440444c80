#!/bin/bash
# EARLY_STEP_GUIDED on by default: the early-step tests on real graphs, then the headline with
# exact RTC guidance at batch 1 / 8 / 32 (not re-run since the twenty-first session); before them the
# daemon in exact guidance with three warm-up rounds (why the second is slow). Carry .whl.
export TRITON_CACHE_DIR=/tmp/tc PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
cat > /tmp/gpu.toml <<TOML
[cameras.top]
source = "synthetic"
[model]
preset = "full"
backend = "cudagraph"
device = "cuda"
dtype = "bfloat16"
warmup = 3
[chunking]
mode = "guided"
[publish]
endpoint = "tcp://127.0.0.1:5599"
TOML
echo "=== daemon, exact guidance, three warm-up rounds (is round 2 slow, round 3 not?)"
timeout 150 python3 -m phyai_edge run --config /tmp/gpu.toml --duration 10 > $OUT/daemon.txt 2>&1; echo "rc $?"
grep -E "captured|warm-up|stopped|rror|did not run|after its deadline|delay" $OUT/daemon.txt | cut -c1-220 | tail -12
echo "=== tests"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_early_step.py 2>&1 | grep -vE "leaked|nanobind|refleaks|skipped remainder" | tail -3
echo "=== headline"
timeout 400 python3 benchmarks/pi05_gpu.py --triton-only --no-fp8 --no-compile --no-compile-baseline \
    --batches 1,8,32 --variants "triton+gemm" --rtc-modes guided --rtc-batches 1,8,32 --out $OUT/pi05 --budget-s 330 2>&1 | tail -25
