#!/bin/bash
export TRITON_CACHE_DIR=/tmp/tc PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
(for i in $(seq 1 400); do nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader >> $OUT/clocks.txt; sleep 0.25; done) &
echo "=== policy_overhead"
timeout 330 python3 benchmarks/policy_overhead_gpu.py --layouts "1+2 masked,3 x 224" --rtc none,guided-approx --gap-s 0.48 --reps 30 --json $OUT/policy_overhead_absent.json > $OUT/policy_overhead_absent.txt 2>&1; echo "rc $?"
grep -E "^\||first three|chunks with|rror" $OUT/policy_overhead_absent.txt | head -40
kill %1 2>/dev/null
sort $OUT/clocks.txt | awk -F, '{print int($1/100)*100" MHz"}' | sort | uniq -c | sort -rn | head -8
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
prompts = ["put the cube in the bowl"]
[metrics]
port = 9109
TOML
echo "=== daemon"
(timeout 200 python3 -m phyai_edge run --config /tmp/gpu.toml --duration 20 > $OUT/daemon.txt 2>&1; echo "rc $?" > $OUT/daemon_rc.txt) &
for i in $(seq 1 150); do sleep 1; if grep -q "running" $OUT/daemon.txt 2>/dev/null; then break; fi; done
sleep 4
# instructions at run time: a declared one, an undeclared one within the room, one far too long
python3 -m phyai_edge task --endpoint tcp://127.0.0.1:5597 "put the cube in the bowl" > $OUT/task.txt 2>&1; echo "rc $?" >> $OUT/task.txt
sleep 2
python3 -m phyai_edge task --endpoint tcp://127.0.0.1:5597 "pick up the bowl" >> $OUT/task.txt 2>&1; echo "rc $?" >> $OUT/task.txt
python3 -m phyai_edge task --endpoint tcp://127.0.0.1:5597 "$(python3 -c 'print(" ".join(["then put the red cube next to the blue bowl"] * 6))')" >> $OUT/task.txt 2>&1; echo "rc $?" >> $OUT/task.txt
sleep 8
python3 -c "import urllib.request;print(urllib.request.urlopen('http://127.0.0.1:9109/metrics',timeout=5).read().decode())" > $OUT/metrics.txt
wait
cat $OUT/daemon_rc.txt
grep -E "phyai_model_info|phyai_inference(_stage)?_seconds_(sum|count)" $OUT/metrics.txt
grep -E "captured|warm-up|running|stopped|rror|HOLD|warn|never present|task|did not run" $OUT/daemon.txt | tail -16
cat $OUT/task.txt
