#!/bin/bash
# Twenty-seventh session, call 5 (any GPU): the daemon at full size on cudagraph bf16 (exact
# guidance), 8 s, after this session's daemon changes (every hold reason in the flags, stalls
# logged as late ticks, STARVED holds logged, the metrics endpoint checked before loading):
# its log's warnings and its summary. Carry .whl.
source benchmarks/runs/lib.sh
gpu_env
daemon_toml /tmp/d.toml guided "
[metrics]
port = 9108"
timeout 300 python3 -m phyai_edge run --config /tmp/d.toml --duration 8 --summary $OUT/summary.json > $OUT/daemon.log 2>&1
echo "rc=$?"
grep -E "WARNING|ERROR|stopped:|running" $OUT/daemon.log | tail -12
python3 - <<'PY'
import json, os
s = json.load(open(os.environ["OUT"] + "/summary.json"))
print({k: s.get(k) for k in ("ticks", "missed_slots", "inferences", "failures", "holds", "late_ticks")})
PY
