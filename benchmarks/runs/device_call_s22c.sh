#!/bin/bash
# The first flow step beside the prefix from batch 8: a full batch now runs it beside the unmasked
# prefix on the unmasked expert ("dense, early"), a padded one beside the masked prefix. GPU tests
# first (real capture on two streams, the dense variant included), then engines alternated at
# batch 8 / 16 / 32 full and batch 8 padded (prompts of 48 and 40 tokens). Carry .whl (pyzmq).
export TRITON_CACHE_DIR=/tmp/tc PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
echo "=== tests"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_early_step.py tests/test_unmasked_expert.py \
    tests/test_cudagraph.py 2>&1 | grep -vE "leaked|nanobind|refleaks|skipped remainder" | tail -4
for b in 8 16 32; do
  reps=$((b == 32 ? 20 : 40))
  echo "=== full batch $b"
  timeout 200 python3 benchmarks/engine_ab_gpu.py --batch $b --reps $reps \
      --variants "plain:no-early;early:early-max=$b" --json $OUT/ab_early_full_b$b.json 2>&1 | tail -3
done
echo "=== padded batch 8"
timeout 150 python3 benchmarks/engine_ab_gpu.py --batch 8 --valid-tokens 48,40 --reps 40 \
    --variants "plain:no-early;early:early-max=8" --json $OUT/ab_early_padded_b8.json 2>&1 | tail -3
