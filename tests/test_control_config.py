"""Daemon configuration: the embedded default, and an error that names the key for each mistake."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from phyai_edge.control.config import (
    DEFAULT_CONFIG_TOML,
    ConfigError,
    check_against_policy,
    load_config,
    parse_config,
    tomllib,
)


def test_embedded_default_is_valid_and_self_describing():
    cfg = load_config(None)
    assert cfg.model.preset == "tiny" and cfg.cameras["top"].source == "synthetic"
    assert cfg.state.source == "synthetic" and cfg.publish.endpoint.startswith("tcp://127.0.0.1:")
    # The printed default is exactly what `load_config(None)` uses.
    assert parse_config(tomllib.loads(DEFAULT_CONFIG_TOML)) == cfg.__class__(**{**cfg.__dict__, "source": "<dict>"})


def test_every_key_left_out_takes_the_printed_default():
    """The printed default says "Every key is optional; these are the defaults": a file with only its
    camera tables must run as the whole printed file does (it once differed in the worker's torch
    threads, 0 against 1, which made a tiny model's warm-up 30x slower, the whole-chunk topic and the
    robot's name)."""
    full = tomllib.loads(DEFAULT_CONFIG_TOML)
    printed = parse_config(full, "<default>")
    minimal = parse_config({"cameras": full["cameras"]}, "<default>")
    assert minimal == printed


ONE_CAMERA = {"cameras": {"top": {}}}  # a file needs one: camera tables replace the default's

BAD = [
    ({"cameras": {"top": {"fps": "abc"}}}, 'cameras.top.fps: expected a positive number, got "abc"'),
    ({"cameras": {"top": {"fps": -1}}}, "cameras.top.fps: expected a positive number, got -1"),
    ({"cameras": {"top": {"fsp": 30}}}, "cameras.top.fsp: unknown key"),
    ({"cameras": {"top": {"source": "webcam"}}}, 'cameras.top.source: expected one of synthetic, v4l2'),
    ({"cameras": {"top": {"source": "rtsp", "url": "http://x"}}}, "cameras.top.url: expected an rtsp:// URL"),
    ({"cameras": {"top": {"source": "gstreamer"}}}, "cameras.top.pipeline: required"),
    ({"cameras": {"top": {"source": "zmq"}}}, "cameras.top.endpoint: required"),
    ({"cameras": {"top": {"source": "zmq", "endpoint": "localhost"}}}, "cameras.top.endpoint: expected a ZeroMQ endpoint"),
    ({"cameras": {"top": {"source": "v4l2", "device": -2}}}, "cameras.top.device: expected a device index"),
    ({"cameras": {"top": {"width": 0}}}, "cameras.top.width: expected an integer >= 1, got 0"),
    ({"cameras": {"a": {"view": "top"}, "b": {"view": "top"}}}, "cameras.b.view: view 'top' is fed by more than one camera"),
    ({"robot": {"control_hz": 0}}, "robot.control_hz: expected a positive number, got 0"),
    ({"robot": {"control_hz": True}}, "robot.control_hz: expected a positive number, got true"),
    ({"robot": {"control_hz": 1e12}}, "robot.control_hz: 1e+12 Hz is above the 1000 Hz"),
    ({"robot": {"action_names": ["a", "b"], "action_dim": 3}}, "robot.action_names: has 2 names but robot.action_dim is 3"),
    ({"robot": {"limits": {"action_min": [0, 0], "action_max": 1, "foo": 1}}}, "robot.limits.foo: unknown key"),
    ({"robot": {"limits": {"action_min": 1, "action_max": 0}}}, "robot.limits.action_min: must be below action_max"),
    ({"robot": {"limits": {"max_rate": [1, "x"]}}}, 'robot.limits.max_rate[1]: expected a positive number, got "x"'),
    ({"state": {"source": "zmq", "endpoint": "5556"}}, "state.endpoint: expected a ZeroMQ endpoint"),
    ({"model": {"dtype": "float64"}}, "model.dtype: expected one of float32, fp32, bfloat16, bf16, float16, fp16"),
    ({"model": {"worker": "fiber"}}, "model.worker: expected one of process, thread"),
    ({"model": {"factory": "nocolon"}}, 'model.factory: expected "module:function"'),
    ({"model": {"restart_backoff_s": 0}}, "model.restart_backoff_s: expected a positive number, got 0"),
    ({"model": {"restart_backoff_s": 5, "restart_backoff_max_s": 1}},
     "model.restart_backoff_max_s: expected a number >= model.restart_backoff_s (5), got 1"),
    ({"model": {"bundle": "/nonexistent/engines/x"}}, "model.bundle: '/nonexistent/engines/x' is not a folder"),
    ({"model": {"tokenizer": "/nonexistent/tok.json"}}, "model.tokenizer: only used with model.checkpoint"),
    ({"model": {"checkpoint": "/ckpt", "tokenizer": "/nonexistent/tok.json"}},
     "model.tokenizer: '/nonexistent/tok.json' is neither a tokenizer file nor a folder"),
    ({"model": {"inference_timeout_s": -1}}, "model.inference_timeout_s: expected a positive number, got -1"),
    ({"model": {"noise_seed": -1}}, "model.noise_seed: expected an integer >= 0, got -1"),
    ({"model": {"noise_seed": 2**31}}, "model.noise_seed: expected an integer <= 2147483647"),
    ({"chunking": {"mode": "magic"}}, "chunking.mode: expected one of none, crossfade, inpaint"),
    ({"chunking": {"horizon": 20, "execution_horizon": 20}}, "chunking.execution_horizon: must be below chunking.horizon"),
    ({"chunking": {"execution_horizon": 0}}, "chunking.execution_horizon: expected an integer >= 1, got 0"),
    ({"chunking": {"max_guidance_weight": "big"}}, 'chunking.max_guidance_weight: expected a positive number, got "big"'),
    ({"publish": {"endpoint": ""}}, "publish.endpoint: required"),
    ({"publish": {"endpoint": "tcp://127.0.0.1:99999"}}, "publish.endpoint: port 99999 is outside 1..65535"),
    ({"publish": {"topic": "act", "chunk_topic": "action"}}, "publish.chunk_topic:"),
    ({"safety": {"hold": "freeze"}}, "safety.hold: expected one of last, state, zero"),
    ({"safety": {"state_max_age_ms": 0}}, "safety.state_max_age_ms: expected a positive number, got 0"),
    ({"metrics": {"port": 70000}}, "metrics.port: expected an integer <= 65535, got 70000"),
    ({"clock": {"cpus": [0, -1]}}, "clock.cpus: expected a list of CPU indices"),
    ({"clock": {"priority": 120}}, "clock.priority: expected an integer <= 99, got 120"),
    ({"clock": {"late_warning_ms": -1}}, "clock.late_warning_ms: expected a number >= 0, got -1"),
    ({"robot": []}, "robot: expected a table"),
    ({"robot": {}}, "cameras: no camera is configured"),
    ({"cameras": {}}, "cameras: no camera is configured"),
    ({"model": {"backend": "tensorrt-llm"}}, "model.backend: expected one of eager, cudagraph, onnxruntime, tensorrt, onnx"),
    ({"model": {"device": "gpu"}}, "model.device: expected cpu, cuda or cuda:N, got \"gpu\""),
    ({"model": {"adapter_options": "padded"}}, "model.adapter_options: expected a table of plain values"),
    ({"model": {"bundle": "/tmp", "adapter_options": {"prompt_state": "padded"}}},
     "model.adapter_options: only used with model.checkpoint or model.preset"),
    ({"model": {"backend": "cudagraph", "engine_options": {"early_steps": False}}},
     "model.engine_options.early_steps: unknown switch; the cudagraph engine's are triton_ops"),
    ({"model": {"backend": "cudagraph", "engine_options": {"early_step": "no"}}},
     'model.engine_options.early_step: expected true or false, got "no"'),
    ({"model": {"backend": "cudagraph", "engine_options": "early_step"}}, "model.engine_options: expected a table"),
    ({"model": {"engine_options": {"early_step": False}}},
     'model.engine_options: only for model.backend = "cudagraph"'),
    ({"rbot": {}}, "rbot: unknown key"),
    ({"cameras": {"top": {"fps": 30, "max_age_ms": 20}}},
     "cameras.top.max_age_ms: 20 ms is shorter than cameras.top's frame period (30 fps: 33.3 ms)"),
    ({"cameras": {"top": {"fps": 4}}}, "safety.camera_max_age_ms: 200 ms is shorter than cameras.top's frame period"),
    # accepted before, and refused only by `run` (the endpoints) or never (the rest)
    ({"publish": {"endpoint": "http://127.0.0.1:25555"}}, "publish.endpoint: expected a ZeroMQ endpoint"),
    ({"publish": {"endpoint": "tcp://127.0.0.1"}}, "publish.endpoint: a tcp endpoint needs a port"),
    ({"publish": {"endpoint": "tcp://127.0.0.1:\u00b2"}}, "publish.endpoint: a tcp endpoint needs a port"),  # int() refuses it
    ({"state": {"source": "zmq", "endpoint": ""}}, "state.endpoint: required"),
    ({"state": {"source": "zmq", "endpoint": "tcp://localhost:5555"}, "publish": {"endpoint": "tcp://127.0.0.1:5555"}},
     "state.endpoint: 'tcp://localhost:5555' is publish.endpoint, the daemon's own action stream"),
    ({"metrics": {"port": 25555}, "publish": {"endpoint": "tcp://*:25555"}},
     "metrics.port: 'tcp://127.0.0.1:25555' is the address publish.endpoint binds"),
    ({"task": {"endpoint": "tcp://localhost:5555"}, "publish": {"endpoint": "tcp://127.0.0.1:5555"}},
     "task.endpoint: 'tcp://localhost:5555' is publish.endpoint's socket too"),
    ({"robot": {"action_names": ["a", "b", "a"]}}, "robot.action_names: 'a' named more than once"),
    ({"chunking": {"horizon": 10, "execution_horizon": 5, "delay_initial": 500}},
     "chunking.delay_initial: 500 slots is not below chunking.horizon (10)"),
    ({"chunking": {"horizon": 10, "execution_horizon": 5, "crossfade_steps": 500}},
     "chunking.crossfade_steps: 500 is longer than chunking.horizon (10)"),
    ({"clock": {"cpus": [0, 0]}}, "clock.cpus: a CPU is listed more than once"),
    ({"cameras": {"top": {"device": 2}}}, 'cameras.top.device: only used with source = "v4l2"; this camera\'s source is '
                                          '"synthetic"'),
    ({"cameras": {"": {}}}, 'cameras."": a camera needs a name'),
    ({"cameras": {"top": {"source": "file", "path": "/nonexistent.mp4"}}}, "cameras.top.path: no file '/nonexistent.mp4'"),
]


@pytest.mark.parametrize("data,message", BAD, ids=[m.split(":")[0] for _, m in BAD])
def test_each_error_names_its_key(data, message):
    with pytest.raises(ConfigError) as exc:
        parse_config(data)
    assert str(exc.value).startswith(message), str(exc.value)


def test_a_config_that_is_not_utf8_is_one_line_naming_the_file(tmp_path):
    """A Latin-1 comment crashed `--check-config`, `--preflight` and `run` with a traceback."""
    from phyai_edge.control.config import load_config

    f = tmp_path / "robot.toml"
    f.write_bytes(b"# caf\xe9\n[cameras.top]\n")
    with pytest.raises(ConfigError, match=r"robot\.toml: not UTF-8 text, which TOML requires \(byte 5"):
        load_config(f)


def test_a_controller_on_another_host_may_use_the_port_the_daemon_publishes_on():
    """Only a connection through loopback reaches the daemon's own wildcard-bound publisher."""
    cfg = parse_config({"publish": {"endpoint": "tcp://*:5555"}, "state": {"source": "zmq",
                        "endpoint": "tcp://192.168.1.5:5555"}, **ONE_CAMERA})
    assert cfg.state.endpoint == "tcp://192.168.1.5:5555"
    with pytest.raises(ConfigError, match=r"^state\.endpoint: .* is publish\.endpoint"):
        parse_config({"publish": {"endpoint": "tcp://*:5555"}, "state": {"source": "zmq",
                      "endpoint": "tcp://localhost:5555"}, **ONE_CAMERA})


def test_model_dtype_takes_the_short_names_the_commands_take():
    """`bench --dtype fp16` worked, `model.dtype = "fp16"` was refused; both now mean float16."""
    assert parse_config({"model": {"dtype": "fp16"}, **ONE_CAMERA}).model.dtype == "float16"
    assert parse_config({"model": {"dtype": "bf16"}, **ONE_CAMERA}).model.dtype == "bfloat16"


def test_backend_short_names_mean_the_same_engine_everywhere(monkeypatch):
    """`export --backend onnx` wrote an onnxruntime bundle, while `bench --backend onnx` and
    `model.backend = "onnx"` were refused as unknown."""
    from phyai_edge.control import config as config_mod
    from phyai_edge.engines import backend_name

    # As on a machine that has TensorRT: without it the key is refused (the next test).
    monkeypatch.setattr(config_mod, "_importable", lambda module: True)
    assert parse_config({"model": {"backend": "onnx"}, **ONE_CAMERA}).model.backend == "onnxruntime"
    assert parse_config({"model": {"backend": "trt"}, **ONE_CAMERA}).model.backend == "tensorrt"
    assert backend_name("ort") == "onnxruntime" and backend_name("cudagraph") == "cudagraph"


def test_a_backend_whose_library_is_missing_is_refused_by_its_key(monkeypatch):
    """Not a worker that fails at load (exit 1, restarted by systemd, loading the model each time)."""
    from phyai_edge.control import config as config_mod

    monkeypatch.setattr(config_mod, "_importable", lambda module: module != "tensorrt")
    with pytest.raises(ConfigError, match=r"^model.backend: tensorrt needs tensorrt, not installed here "
                                          r"\(JetPack's python3-libnvinfer, or pip install 'phyai-edge\[tensorrt\]'\)"):
        parse_config({"model": {"backend": "trt"}, **ONE_CAMERA})
    assert parse_config({"model": {"backend": "onnx"}, **ONE_CAMERA}).model.backend == "onnxruntime"
    # A factory builds its own policy: the backend key is not what it runs.
    parse_config({"model": {"backend": "trt", "factory": "json:loads"}, **ONE_CAMERA})


def test_checks_against_the_policy_name_the_key():
    cfg = parse_config({"robot": {"action_dim": 6}, **ONE_CAMERA})
    with pytest.raises(ConfigError, match=r"^robot.action_dim: the policy outputs 14 actions"):
        check_against_policy(cfg, 50, 14, 14, ["top"])
    cfg = parse_config({"cameras": {"front": {}}})
    with pytest.raises(ConfigError, match=r"^cameras.front.view: the policy has no camera 'front'"):
        check_against_policy(cfg, 50, 14, 14, ["top", "left_wrist"])
    cfg = parse_config({"chunking": {"horizon": 60}, **ONE_CAMERA})
    with pytest.raises(ConfigError, match=r"^chunking.horizon: 60 is longer"):
        check_against_policy(cfg, 50, 14, 14, ["top"])
    cfg = parse_config({"robot": {"limits": {"max_rate": [1.0, 2.0]}}, **ONE_CAMERA})
    with pytest.raises(ConfigError, match=r"^robot.limits.max_rate: has 2 values"):
        check_against_policy(cfg, 50, 14, 14, ["top"])
    cfg = parse_config({"safety": {"hold": "state"}, **ONE_CAMERA})
    with pytest.raises(ConfigError, match=r"^safety.hold: 'state' .* state has 7 values and its actions 14"):
        check_against_policy(cfg, 50, 14, 7, ["top"])
    cfg = parse_config({"safety": {"hold": "state"}, **ONE_CAMERA})
    check_against_policy(cfg, 50, 14, 14, ["top"])  # one space: holding at the state is meaningful
    cfg = parse_config(ONE_CAMERA)
    check_against_policy(cfg, 50, 14, 14, ["top"])
    assert (cfg.robot.action_dim, cfg.chunking.horizon) == (14, 50)


def test_cli_print_and_check_config(tmp_path):
    run = [sys.executable, "-m", "phyai_edge", "run"]
    out = subprocess.run([*run, "--print-default-config"], capture_output=True, text=True, check=True).stdout
    assert out == DEFAULT_CONFIG_TOML
    good = tmp_path / "good.toml"
    good.write_text(out)
    res = subprocess.run([*run, "--check-config", str(good)], capture_output=True, text=True)
    assert res.returncode == 0 and "valid" in res.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text(out.replace("fps = 30.0", 'fps = "abc"'))
    res = subprocess.run([*run, "--check-config", str(bad)], capture_output=True, text=True)
    assert res.returncode == 2
    assert 'cameras.top.fps: expected a positive number, got "abc"' in res.stderr
    broken = tmp_path / "broken.toml"
    broken.write_text("[robot\n")
    res = subprocess.run([*run, "--check-config", str(broken)], capture_output=True, text=True)
    assert res.returncode == 2 and "not valid TOML" in res.stderr


@pytest.mark.parametrize(("sections", "message"), [
    ('[cameras.a]\nview = "wrist"\n', "cameras.a.view: the policy has no camera 'wrist' (it expects top, left_wrist"),
    ('[cameras.top]\n[chunking]\nhorizon = 500\n', "chunking.horizon: 500 is longer than the policy's chunk (50)"),
    ('[cameras.top]\n[chunking]\ndelay = 60\n', "chunking.delay: 60 slots is not below the policy's chunk (50)"),
    ('[cameras.top]\n[model]\npreset = "huge"\n', "model.preset: unknown PI0.5 preset 'huge'"),
    ('[cameras.top]\n[model]\ncheckpoint = "{tmp}/none"\n', "model.checkpoint: '{tmp}/none' is not a folder"),
    ('[cameras.top]\n[model.adapter_options]\nprompt_stat = "x"\n',
     "model.adapter_options: adapter 'pi05' has no option 'prompt_stat'"),
    ('[cameras.top]\n[model.adapter_options]\nprompt_state = "sideways"\n', "model.adapter_options: "),
    # passed the check, failed the start
    ('[cameras.top]\n[task]\nendpoint = "tcp://127.0.0.1:5591"\nprompt_tokens = 100000000\n',
     "task.prompt_tokens: 100000000 is more than the policy takes (128)"),
    ('[cameras.top]\n[model]\nprompt = "' + "pick up the red cube " * 40 + '"\n',
     "model.prompt: takes up to"),
    ('[cameras.top]\n[task]\nendpoint = "tcp://127.0.0.1:5591"\nprompts = ["' + "stack the cups " * 60 + '"]\n',
     "task.prompts[0]: takes up to"),
])
def test_check_config_reads_the_policy_s_shape_without_its_weights(tmp_path, capsys, sections, message):
    """What only the policy can say (its cameras, its chunk, its adapter's names) is checked by
    `--check-config` too, from the adapter built without weights, instead of after a model load and
    warm-up at start-up (minutes for a full-size model on an Orin)."""
    from phyai_edge.cli import main as cli

    cfg = tmp_path / "robot.toml"
    cfg.write_text(sections.format(tmp=tmp_path))
    assert cli(["run", "--check-config", str(cfg)]) == 2
    assert message.format(tmp=tmp_path) in capsys.readouterr().err


def test_check_config_names_a_factory_policy_not_the_unused_preset(tmp_path, capsys):
    """A config whose policy comes from `model.factory` (the multi-robot server's RemotePolicy) was
    reported as "model: pi05 tiny", the preset it never loads."""
    from phyai_edge.cli import main as cli

    cfg = tmp_path / "remote.toml"
    cfg.write_text('[cameras.top]\n[model]\nfactory = "phyai_edge.serve.client:remote_policy"\n'
                   'factory_args = { endpoint = "tcp://127.0.0.1:5570" }\n')
    assert cli(["run", "--check-config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "model: factory phyai_edge.serve.client:remote_policy," in out and "tiny" not in out


def test_shipped_daemon_configs_are_valid():
    from pathlib import Path

    files = sorted((Path(__file__).resolve().parents[1] / "adapters").glob("*.toml"))
    assert files
    for f in files:
        load_config(f)


def test_model_adapter_options_reach_load_policy():
    from phyai_edge.control.daemon import policy_spec_from_config

    cfg = parse_config({"model": {"adapter_options": {"prompt_state": "padded"}}, **ONE_CAMERA})
    assert policy_spec_from_config(cfg).kwargs["adapter_options"] == {"prompt_state": "padded"}
    assert policy_spec_from_config(parse_config(ONE_CAMERA)).kwargs["adapter_options"] is None


def test_model_engine_options_reach_load_policy_and_name_real_switches():
    import inspect

    from phyai_edge.control.config import CUDAGRAPH_SWITCHES
    from phyai_edge.control.daemon import policy_spec_from_config
    from phyai_edge.engines.cudagraph import CudaGraphEngine

    cfg = parse_config({"model": {"backend": "cudagraph", "engine_options": {"early_step": False}}, **ONE_CAMERA})
    assert policy_spec_from_config(cfg).kwargs["engine_options"] == {"early_step": False}
    assert policy_spec_from_config(parse_config(ONE_CAMERA)).kwargs["engine_options"] is None
    params = inspect.signature(CudaGraphEngine.__init__).parameters
    for name in CUDAGRAPH_SWITCHES:  # each a keyword of the engine, on by default or chosen by device
        assert name in params and params[name].default in (True, None), name


def test_model_tokenizer_reaches_load_policy(tmp_path):
    """A checkpoint folder without the PaliGemma tokenizer files: the config names them."""
    from phyai_edge.adapters.pi05.builtin import tiny_tokenizer_path
    from phyai_edge.control.config import parse_config
    from phyai_edge.control.daemon import policy_spec_from_config

    tok = str(tiny_tokenizer_path())
    cfg = parse_config({"model": {"checkpoint": str(tmp_path), "tokenizer": tok}, **ONE_CAMERA}, "<test>")
    spec = policy_spec_from_config(cfg)
    assert spec.factory == "phyai_edge.engines.policy:load_policy"
    assert spec.kwargs["tokenizer"] == tok and spec.kwargs["checkpoint"] == str(tmp_path)


def test_a_bundle_manifest_edited_after_export_is_refused_with_the_config(tmp_path):
    """Passed `--check-config`, then failed the start-up without naming model.bundle."""
    import json

    from phyai_edge.engines.bundle import seal

    folder = tmp_path / "b"
    folder.mkdir()
    manifest = seal({"format": "phyai-edge/bundle/1", "backend": "onnxruntime", "checkpoint": {}, "files": {"x": {}}})
    manifest["backend"] = "cudagraph"
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"^model\.bundle: .*manifest\.json was edited after export"):
        parse_config({"cameras": {"top": {}}, "model": {"bundle": str(folder)}})


@pytest.mark.parametrize(("fields", "says"), [
    ({"validation": {"status": "failed", "max_abs_error": 3.0}}, "failed its validation at export"),
    ({"batch_sizes": [2, 4]}, "was exported for batch sizes [2, 4], and the daemon runs batch 1"),
])
def test_a_bundle_the_daemon_would_refuse_at_start_up_is_refused_with_the_config(tmp_path, fields, says):
    """A bundle whose export failed validation, or an ONNX bundle without batch 1, was `valid` for
    --check-config and --preflight, and refused only by the start-up (after loading)."""
    import json

    from phyai_edge.engines.bundle import seal

    folder = tmp_path / "b"
    folder.mkdir()
    manifest = seal({"format": "phyai-edge/bundle/1", "backend": "onnxruntime", "checkpoint": {}, "files": {"x": {}},
                     "batch_sizes": [1], **fields})
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=rf"^model\.bundle: .*{re.escape(says)}"):
        parse_config({"cameras": {"top": {}}, "model": {"bundle": str(folder)}})


def test_what_a_bundle_or_factory_needs_is_checked_with_the_config(tmp_path, monkeypatch):
    """A cudagraph bundle on the CPU, an onnxruntime bundle without onnxruntime, and a factory whose
    package is not installed passed `--check-config` and `--preflight`, then failed the start-up
    with exit 1 (restarted by systemd, each time after loading): now the config names the key."""
    import json

    from phyai_edge.control import config
    from phyai_edge.engines.bundle import seal

    def bundle(backend: str):
        folder = tmp_path / backend
        folder.mkdir()
        manifest = seal({"format": "phyai-edge/bundle/1", "backend": backend, "checkpoint": {}, "files": {"x": {}}})
        (folder / "manifest.json").write_text(json.dumps(manifest))
        return str(folder)

    with pytest.raises(ConfigError, match=r'^model\.device: a cudagraph bundle runs on a CUDA device; set model\.device = "cuda"'):
        parse_config({"cameras": {"top": {}}, "model": {"bundle": bundle("cudagraph"), "device": "cpu"}})
    onnx = bundle("onnxruntime")
    parse_config({"cameras": {"top": {}}, "model": {"bundle": onnx}})  # installed here (the test extra)
    monkeypatch.setattr(config, "_importable", lambda module: module != "onnxruntime")
    with pytest.raises(ConfigError, match=r"^model\.bundle: .* is an onnxruntime bundle, and onnxruntime is not "
                                          r"installed here \(pip install 'phyai-edge\[onnx\]'\)"):
        parse_config({"cameras": {"top": {}}, "model": {"bundle": onnx}})
    monkeypatch.undo()
    with pytest.raises(ConfigError, match=r"^model\.factory: no module 'nosuch' can be imported here"):
        parse_config({"cameras": {"top": {}}, "model": {"factory": "nosuch.policies:make"}})
    parse_config({"cameras": {"top": {}}, "model": {"factory": "phyai_edge.control.fakes:make_fake_policy"}})
