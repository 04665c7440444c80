#!/bin/bash
# Should the first flow step run beside the prefix at batch 8 and 16 too? EARLY_STEP_MAX_BATCH is 4
# (batch 2 and 4 measured: -2.1% / -2.3% on an H100). From batch 8 a full batch takes the unmasked
# graphs (which keep the whole loop); a padded one the masked graphs, where the early step can run.
#   1. padded batches (prompts of 48 and 40 tokens), masked graphs: plain vs early, batch 8 and 16
#   2. a full batch 8: the unmasked graphs (today's default) vs the masked ones with the early step
# Then the batch-1 headline at HEAD. Carry .whl (pyzmq).
export TRITON_CACHE_DIR=/tmp/tc PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
for b in 8 16; do
  echo "=== padded batch $b"
  timeout 150 python3 benchmarks/engine_ab_gpu.py --batch $b --valid-tokens 48,40 --reps 40 \
      --variants "plain:no-early;early:early-max=$b" --json $OUT/ab_early_padded_b$b.json 2>&1 | tail -3
done
echo "=== full batch 8: unmasked graphs vs masked + early"
timeout 150 python3 benchmarks/engine_ab_gpu.py --batch 8 --reps 40 \
    --variants "unmasked:no-early;masked early:no-dense+early-max=8;masked:no-dense+no-early" \
    --json $OUT/ab_dense_vs_early_b8.json 2>&1 | tail -4
echo "=== headline at batch 1 (default engine)"
timeout 200 python3 benchmarks/pi05_gpu.py --triton-only --no-fp8 --no-compile --no-compile-baseline --batches 1 \
    --variants "triton+gemm" --rtc-modes guided --rtc-batches 1 --out $OUT/pi05 --budget-s 180 2>&1 | tail -8
