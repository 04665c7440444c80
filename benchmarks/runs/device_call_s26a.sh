#!/bin/bash
# Twenty-sixth session: the daemon on the GPU with keyed noise (full-size PI0.5, cudagraph bf16,
# exact guidance, 8 s, --record), then `phyai-edge eval` of that recording on the same engine at
# batch 1 (recorded error: how close a replay comes to what the robot got) and against eager fp32;
# then what host-given noise costs `Policy.infer` now that it goes through pinned staging. Carry .whl.
source benchmarks/runs/lib.sh
gpu_env
nvidia-smi --query-gpu=name --format=csv,noheader
daemon_toml /tmp/gpu.toml guided
echo "=== daemon"
timeout 200 python3 -m phyai_edge run --config /tmp/gpu.toml --duration 8 --record /tmp/rec --summary $OUT/summary.json \
    > $OUT/daemon.txt 2>&1; echo "rc $?"
grep -E "captured|warm-up|stopped|rror|did not run|after its deadline|delay|record" $OUT/daemon.txt | cut -c1-200 | tail -12
echo "recorded: $(ls /tmp/rec | grep -c npz) chunks"
echo "=== eval: the recording's model (named in its meta.json) on the daemon's engine at batch 1, eager fp32 as the reference"
timeout 240 python3 -m phyai_edge eval /tmp/rec --backend cudagraph --device cuda --dtype bfloat16 \
    --batch 1 --reference-backend eager --reference-dtype float32 --json > $OUT/eval.json 2> $OUT/eval.err; echo "rc $?"
python3 -c "import json; o=json.load(open('$OUT/eval.json'))['overall']; print({k: o[k] for k in sorted(o)})" \
    || tail -5 $OUT/eval.err
grep "recording's daemon ran" $OUT/eval.err | cut -c1-240
echo "=== policy.infer with engine-drawn vs host-given noise"
timeout 150 python3 benchmarks/policy_overhead_gpu.py --layouts "1+2 masked" --host-noise --no-absent --reps 40 \
    --json $OUT/policy_overhead.json 2>&1 | tail -6
