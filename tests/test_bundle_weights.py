"""Cudagraph bundles store their weights in the engine's precision (bf16 / fp16 matmul weights,
float32 norms, time MLP and action projections: `PI05Model.precision_dtypes`), and loading them
gives bit-identical engine weights to casting the float32 checkpoint. All on CPU: the cudagraph
engine runs its code eagerly there, and the bundle's CUDA check is let through where a test
needs the real load path (as tests/test_fp8.py does)."""

from __future__ import annotations

import copy
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from phyai_edge.adapters.checkpoint import CheckpointError
from phyai_edge.adapters.pi05 import builtin_adapter, load_pi05, save_native
from phyai_edge.calibration import synthetic_observations
from phyai_edge.engines import bundle as bundle_mod
from phyai_edge.engines.bundle import BundleError, load_bundle_engine, read_manifest
from phyai_edge.engines.cudagraph import CudaGraphEngine
from phyai_edge.engines.eager import EagerEngine
from phyai_edge.engines.exporter import ExportRequest, export_bundle

REDUCED = [torch.bfloat16, torch.float16]


def _stored(path: Path) -> dict[str, torch.dtype]:
    return {k: t.dtype for k, t in _tensors(path).items()}


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def _snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k].cpu(), b[k].cpu()), k  # an engine's module may sit on a GPU


def _export(out: Path, precision: str, adapter=None):
    # On the CPU wherever the tests run: on a GPU machine the export would validate there, and
    # these tests are about a bundle exported, and loaded, without one.
    return export_bundle(ExportRequest(out=out, backend="cudagraph", precision=precision, holdout=1, progress=False,
                                       device="cpu"),
                         adapter=adapter or builtin_adapter("tiny", seed=0), echo=lambda _: None)


@pytest.fixture
def cpu_bundles(monkeypatch):
    """Cudagraph bundles refuse a non-CUDA device before building anything; let them load here."""
    monkeypatch.setattr(bundle_mod, "check_platform", lambda *a, **k: None)


# -- the rule -----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [*REDUCED, torch.float32])
def test_precision_dtypes_is_what_set_precision_does(dtype):
    model = builtin_adapter("tiny", seed=0).module
    rule = model.precision_dtypes(dtype)
    cast = copy.deepcopy(model).set_precision(dtype)
    assert {k: v.dtype for k, v in cast.state_dict().items()} == rule
    if dtype != torch.float32:
        assert rule["prefix_layers.0.mlp.gate_proj.weight"] == dtype and rule["embed_tokens.weight"] == dtype
        for kept in ("expert_norm.dense.weight", "time_mlp_in.weight", "action_in_proj.weight",
                     "action_out_proj.bias", "prefix_layers.0.input_layernorm.weight",
                     "expert_layers.0.input_layernorm.dense.weight"):
            assert rule[kept] == torch.float32, kept


def test_set_precision_keeps_weights_already_in_their_dtype():
    model = builtin_adapter("tiny", seed=0).module.set_precision(torch.bfloat16)
    before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    model.set_precision(torch.bfloat16)
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == before  # no copy, no float32 detour
    w = model.prefix_layers[0].mlp.gate_proj.weight
    model.set_precision(torch.float16)  # bf16 -> fp16 through float32, as the cast always went
    assert w.dtype == torch.float16 and model.prefix_layers[0].mlp.gate_proj.weight is w


# -- save_native(dtype=...) and loading it back -------------------------------------------
@pytest.mark.parametrize("dtype", REDUCED)
def test_reduced_native_round_trip_is_bit_identical(tmp_path, dtype):
    src = builtin_adapter("tiny", seed=0)
    original = _snapshot(src.module)
    plain = save_native(src, tmp_path / "fp32")
    folder = save_native(src, tmp_path / "reduced", dtype=dtype)
    _same(_snapshot(src.module), original)  # the caller's float32 model is untouched

    rule = src.module.precision_dtypes(dtype)
    assert _stored(folder / "model.safetensors") == rule
    assert json.loads((folder / "phyai_edge.json").read_text())["weight_dtype"] == str(dtype).removeprefix("torch.")
    assert "weight_dtype" not in json.loads((plain / "phyai_edge.json").read_text())
    fp32_bytes, reduced_bytes = ((f / "model.safetensors").stat().st_size for f in (plain, folder))
    print(f"tiny {dtype}: weights {reduced_bytes:,} B vs float32 {fp32_bytes:,} B")
    assert reduced_bytes < 0.6 * fp32_bytes

    want = _snapshot(copy.deepcopy(src.module).set_precision(dtype))  # what an engine casts the fp32 weights to
    kept = load_pi05(folder, dtype=None)  # a bundle's load: as stored
    assert {k: v.dtype for k, v in kept.module.state_dict().items()} == rule
    _same(_snapshot(kept.module.set_precision(dtype)), want)
    widened = load_pi05(folder)  # the default still hands out float32 (lossless: bf16/fp16 -> fp32)
    assert all(v.dtype == torch.float32 for v in widened.module.state_dict().values())
    _same(_snapshot(widened.module.set_precision(dtype)), want)


def test_float32_native_checkpoints_are_unchanged(tmp_path):
    src = builtin_adapter("tiny", seed=0)
    a = save_native(src, tmp_path / "a")
    b = save_native(src, tmp_path / "b", dtype=torch.float32)
    for name in ("model.safetensors", "phyai_edge.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert set(_stored(a / "model.safetensors").values()) == {torch.float32}
    _same(_tensors(a / "model.safetensors"), _snapshot(src.module))


def test_reduced_native_folder_is_strict_about_its_dtypes(tmp_path):
    src = builtin_adapter("tiny", seed=0)
    folder = save_native(src, tmp_path / "bf16", dtype=torch.bfloat16)
    state = _tensors(folder / "model.safetensors")
    # A matmul weight in another reduced dtype, and a float32-by-rule tensor narrowed
    state["prefix_layers.0.mlp.up_proj.weight"] = state["prefix_layers.0.mlp.up_proj.weight"].half()
    state["time_mlp_in.weight"] = state["time_mlp_in.weight"].bfloat16()
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"wrongly typed tensors \(2\)") as err:
        load_pi05(folder, dtype=None)
    assert "up_proj.weight: F16" in str(err.value) and "time_mlp_in.weight: BF16" in str(err.value)
    state = _tensors(save_native(src, tmp_path / "again", dtype=torch.bfloat16) / "model.safetensors")
    state["time_mlp_in.bias"] = torch.zeros(state["time_mlp_in.bias"].shape, dtype=torch.int32)
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="expected a floating-point tensor"):
        load_pi05(folder, dtype=None)


# -- bundles ------------------------------------------------------------------------------
@pytest.mark.parametrize("precision,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_cudagraph_bundle_stores_the_engine_s_precision(tmp_path, cpu_bundles, caplog, precision, dtype):
    src = builtin_adapter("tiny", seed=0)
    original = _snapshot(src.module)
    m = _export(tmp_path / "cg", precision, adapter=src)
    _same(_snapshot(src.module), original)  # the exporter's float32 model (its validation reference)
    assert m["checkpoint"]["weight_dtype"] == str(dtype).removeprefix("torch.")
    weights = tmp_path / "cg" / "checkpoint" / "model.safetensors"
    assert _stored(weights) == src.module.precision_dtypes(dtype)

    timings: dict[str, float] = {}
    with caplog.at_level(logging.INFO, logger="phyai_edge.engines.bundle"):
        _, engine, _ = load_bundle_engine(tmp_path / "cg", device="cpu", timings=timings)
    # Bit-identical to the engine built from the float32 model (cast, then fused)
    ref = CudaGraphEngine(copy.deepcopy(src), device="cpu", dtype=dtype)
    _same(_snapshot(engine.module), _snapshot(ref.module))
    assert engine.fused == ref.fused > 0
    inputs = src.preprocess(synthetic_observations(src, 1))
    noise = torch.randn(1, src.chunk_size, src.model_action_dim, generator=torch.Generator().manual_seed(0))
    assert torch.equal(engine.run(inputs, noise=noise), ref.run(inputs, noise=noise))

    assert set(timings) == {"verify_s", "hash_s", "read_s", "to_device_s", "adapter_s", "engine_s", "total_s"}
    assert all(v >= 0 for v in timings.values()) and timings["total_s"] >= timings["engine_s"]
    lines = [r.getMessage() for r in caplog.records if r.name == "phyai_edge.engines.bundle"]
    # the load's timing line, after the warning that a cudagraph bundle exported on a CPU is unvalidated
    assert len(lines) == 2 and "not validated at export" in lines[0]
    lines = lines[1:]
    for part in ("verify/hash", "read weights", "to device", "engine build", f"{m['checkpoint']['weight_dtype']} weights"):
        assert part in lines[0]


def test_fp32_cudagraph_bundle_keeps_float32_weights(tmp_path, cpu_bundles):
    src = builtin_adapter("tiny", seed=0)
    m = _export(tmp_path / "cg32", "fp32", adapter=src)
    assert m["checkpoint"]["weight_dtype"] == "float32"
    folder = tmp_path / "cg32" / "checkpoint"
    plain = save_native(src, tmp_path / "plain")
    assert (folder / "model.safetensors").read_bytes() == (plain / "model.safetensors").read_bytes()
    assert "weight_dtype" not in json.loads((folder / "phyai_edge.json").read_text())
    _, engine, _ = load_bundle_engine(tmp_path / "cg32", device="cpu")
    _same(_snapshot(engine.module), _snapshot(CudaGraphEngine(copy.deepcopy(src), device="cpu", dtype="float32").module))


def test_fp8_cudagraph_bundle_stores_bf16(tmp_path):
    m = export_bundle(ExportRequest(out=tmp_path / "fp8", backend="cudagraph", precision="fp8",
                                    calibration="synthetic", calibration_samples=2, holdout=1, progress=False),
                      adapter=builtin_adapter("tiny", seed=0), echo=lambda _: None)
    assert m["dtype"] == "bfloat16" and m["checkpoint"]["weight_dtype"] == "bfloat16"


def test_reduced_bundle_refusals_still_hold(tmp_path, cpu_bundles):
    _export(tmp_path / "cg", "bf16")
    damaged = tmp_path / "damaged"
    shutil.copytree(tmp_path / "cg", damaged)
    weights = damaged / "checkpoint" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x40
    weights.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="fail their hash"):
        load_bundle_engine(damaged, device="cpu")
    edited = tmp_path / "edited"
    shutil.copytree(tmp_path / "cg", edited)
    manifest = read_manifest(edited)
    manifest["checkpoint"]["weight_dtype"] = "float32"
    (edited / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="edited after export"):
        load_bundle_engine(edited, device="cpu")


def test_bundle_weights_go_straight_to_the_device(tmp_path):
    """The loader puts included weights on the device it is given (the engine's), as stored; the
    meta device stands in for a GPU here."""
    m = _export(tmp_path / "cg", "bf16")
    timings: dict[str, float] = {}
    ad = bundle_mod.bundle_adapter(tmp_path / "cg", m, device="meta", timings=timings)
    state = ad.module.state_dict()
    assert {t.device.type for t in state.values()} == {"meta"}
    assert {k: t.dtype for k, t in state.items()} == ad.module.precision_dtypes(torch.bfloat16)
    assert set(timings) == {"read_s", "to_device_s"}


def test_eager_engine_on_the_bundle_weights_matches_a_cast_checkpoint(tmp_path):
    """The bundle's adapter (weights as stored) under the eager engine at the bundle's precision
    gives the float32 model's actions at that precision, bit for bit."""
    src = builtin_adapter("tiny", seed=0)
    m = _export(tmp_path / "cg", "bf16", adapter=src)
    ad = bundle_mod.bundle_adapter(tmp_path / "cg", m)
    inputs = src.preprocess(synthetic_observations(src, 1))
    noise = torch.randn(1, src.chunk_size, src.model_action_dim, generator=torch.Generator().manual_seed(1))
    a = EagerEngine(ad, dtype="bfloat16").run(inputs, noise=noise)
    b = EagerEngine(copy.deepcopy(src), dtype="bfloat16").run(inputs, noise=noise)
    assert torch.equal(a, b)


def test_skeleton_is_the_meta_model_without_its_initialisers():
    from phyai_edge.adapters.pi05.config import tiny
    from phyai_edge.adapters.pi05.model import PI05Model

    fast = PI05Model.skeleton(tiny())
    with torch.device("meta"):
        ref = PI05Model(tiny())
    shape = {k: (type(v), v.shape, v.dtype, v.device) for k, v in fast.state_dict(keep_vars=True).items()}
    assert shape == {k: (type(v), v.shape, v.dtype, v.device) for k, v in ref.state_dict(keep_vars=True).items()}
    x = torch.zeros(64)  # off the meta device the initialisers still run, also after
    torch.nn.init.normal_(x)
    assert x.abs().sum() > 0
