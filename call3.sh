export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 benchmarks/attention_gpu.py --shapes "expert b1,expert b32,prefix b1,prefix b32" --configs "128,64,8,2,2000,0,0;128,64,8,2,2000,0,1;128,64,8,3,2000,0,1;128,128,8,2,2000,0,1;64,64,4,2,2000,0,0;64,64,4,2,2000,0,1;16,64,8,2,128,1,1" --json $OUT/attn_ws.json 2>&1 | grep "^|"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/lerobot/*.whl || exit 1
PYTHONPATH=/tmp/site:$PWD python3 benchmarks/pi05_gpu.py --no-fp8 --no-triton --no-compile --out $OUT/full --budget-s 320 2>&1 | tail -40
