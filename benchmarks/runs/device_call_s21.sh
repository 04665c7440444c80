#!/bin/bash
# The twenty-first session's call: (1) could the first flow step run behind the prefix, and where
# engine.run's time outside its stages goes (stream_overlap_gpu.py); (2) the full-size daemon with
# instructions switched every 3 s and every tick over 1 ms late described in the log (what was the
# 3.45 ms tick of call 1?). Carry .whl (pyzmq).
export TRITON_CACHE_DIR=/tmp/tc PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
echo "=== overlap"
timeout 300 python3 benchmarks/stream_overlap_gpu.py --json $OUT/overlap.json 2>&1 | grep -v "^\[W" | tail -14
cat > /tmp/gpu.toml <<TOML
[cameras.top]
source = "synthetic"
[model]
preset = "full"
backend = "cudagraph"
device = "cuda"
dtype = "bfloat16"
warmup = 1
[publish]
endpoint = "tcp://127.0.0.1:5599"
[task]
endpoint = "tcp://127.0.0.1:5597"
prompts = ["put the cube in the bowl", "pick up the bowl"]
[clock]
late_warning_ms = 1.0
TOML
echo "=== daemon"
(timeout 200 python3 -m phyai_edge run --config /tmp/gpu.toml --duration 30 --summary $OUT/summary.json > $OUT/daemon.txt 2>&1; echo "rc $?" > $OUT/daemon_rc.txt) &
for i in $(seq 1 150); do sleep 1; if grep -q "running" $OUT/daemon.txt 2>/dev/null; then break; fi; done
sleep 3
for i in 1 2 3 4 5 6 7; do
  p="put the cube in the bowl"; [ $((i % 2)) = 0 ] && p="pick up the bowl"
  python3 -m phyai_edge task --endpoint tcp://127.0.0.1:5597 "$p" >> $OUT/task.txt 2>&1
  sleep 3
done
wait
cat $OUT/daemon_rc.txt
grep -E "after its deadline|tick\(s\) published|stopped|task: now|rror" $OUT/daemon.txt | cut -c1-260 | tail -24
python3 -c "import json;d=json.load(open('$OUT/summary.json'));print('late_ticks',d['late_ticks'],'lateness',d['lateness_ms'],'wake',d['wake_lateness_ms'])"
