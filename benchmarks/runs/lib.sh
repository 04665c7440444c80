# Sourced by device-call scripts from the twenty-fourth session on (the earlier ones are records of
# what ran, each with its own copy of these lines).

# The device machine has torch, triton and transformers but no registry: the carried wheels.
gpu_env() {
    export TRITON_CACHE_DIR=/tmp/tc PYTHONUNBUFFERED=1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
}

# daemon_toml FILE MODE [MORE_MODEL_LINES]: the full-size seeded PI0.5 on cudagraph bf16, a synthetic
# camera, RTC in MODE, actions on a local endpoint.
daemon_toml() {
    cat > "$1" <<TOML
[cameras.top]
source = "synthetic"
[model]
preset = "full"
backend = "cudagraph"
device = "cuda"
dtype = "bfloat16"
${3:-}
[chunking]
mode = "$2"
[publish]
endpoint = "tcp://127.0.0.1:5599"
TOML
}
