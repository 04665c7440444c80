"""FP8 (E4M3) linears (`layers/fp8.py`), their swap into PI0.5, the cudagraph engine's `fp8=`
option, fp8 cudagraph bundles, and `bench --fp8`.

On a CPU the fp8 layers run their plain-torch reference path (the same E4M3 rounding, dequantised
weight times the activation); torch's CPU `_scaled_mm` is used to check that the CUDA path's call
(scale convention, transposed column-major weight, bias) computes the same thing. The GPU tests at
the end run `_scaled_mm` on CUDA and skip without a GPU of compute capability >= 8.9.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from phyai_edge.adapters.base import ModelInputs
from phyai_edge.adapters.pi05 import builtin_adapter
from phyai_edge.engines.cudagraph import CudaGraphEngine
from phyai_edge.engines.eager import EagerEngine
from phyai_edge.layers.fp8 import (
    FP8_DTYPE,
    Fp8Linear,
    convert_fp8,
    fp8_linears,
    remove_fp8,
    scaled_mm_supported,
    select_backend,
)
from phyai_edge.layers.fused import fuse_projections

GPU_FP8 = torch.cuda.is_available() and scaled_mm_supported("cuda")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def _linear(k: int = 64, n: int = 48, bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias)


# -- the layer ------------------------------------------------------------------------------
def test_reference_path_close_to_float() -> None:
    lin = _linear()
    x = torch.randn(5, 7, 64, generator=torch.Generator().manual_seed(1))
    ref = lin(x)
    for act in ("dynamic", "none"):
        out = Fp8Linear(lin, activations=act)(x)
        rel = _rel(out, ref)
        print(f"fp8 linear ({act} activations) vs float32: rel {rel:.3g}")
        assert out.shape == ref.shape and rel < 0.05
    # weight-only rounds only the weight: closer than weight + activation
    assert _rel(Fp8Linear(lin, activations="none")(x), ref) < _rel(Fp8Linear(lin)(x), ref)


def test_weight_is_e4m3_with_amax_scale_and_saturates() -> None:
    lin = _linear(bias=False)
    f = Fp8Linear(lin)
    assert f.weight_fp8.dtype == FP8_DTYPE and f.weight_fp8.is_contiguous()
    assert float(f.weight_fp8.float().abs().max()) == 448.0  # amax lands on the top of E4M3
    assert f.weight_scale.dtype == torch.float32 and f.weight_scale.dim() == 0
    # a calibrated scale smaller than the weight's amax saturates instead of overflowing to NaN
    small = Fp8Linear(lin, weight_scale=float(lin.weight.detach().abs().max()) / 448 / 4)
    assert torch.isfinite(small.weight_fp8.float()).all()
    # static activation scales: inputs beyond the calibrated range saturate at +-448 * scale
    st = Fp8Linear(lin, input_scale=0.001, activations="static")
    x = torch.full((1, 64), 10.0)
    sat = x.clamp(max=448 * 0.001)
    assert torch.allclose(st(x), Fp8Linear(lin, activations="dynamic")(sat), rtol=1e-6, atol=1e-6)


def _cpu_scaled_mm() -> bool:
    """torch has a CPU `_scaled_mm` kernel (2.6 and later; JetPack 6's 2.5 has none)."""
    a = torch.zeros(16, 16).to(torch.float8_e4m3fn)
    one = torch.tensor(1.0)
    try:
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    except (NotImplementedError, RuntimeError):
        return False
    return True


@pytest.mark.skipif(not _cpu_scaled_mm(), reason="this torch has no CPU _scaled_mm to run the CUDA path's call on")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("act", ["dynamic", "static"])
def test_scaled_mm_call_matches_reference(dtype: torch.dtype, act: str) -> None:
    """The CUDA path's exact `_scaled_mm` call (on torch's CPU kernel) against the reference path:
    same quantisation, so they differ only by accumulation order and output rounding."""
    lin = _linear(k=64, n=32).to(dtype)
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    kw = {"input_scale": float(x.float().abs().max()) / 448 * 1.1} if act == "static" else {}
    fast = Fp8Linear(lin, activations=act, backend="scaled_mm", **kw)
    ref = Fp8Linear(lin, activations=act, backend="reference", **kw)
    assert fast.backend == "scaled_mm" and ref.backend == "reference"
    a, b = fast(x), ref(x)
    assert a.dtype == b.dtype == dtype and a.shape == (3, 5, 32)
    rel = _rel(a, b)
    print(f"_scaled_mm vs reference ({dtype}, {act}): rel {rel:.3g}")
    assert rel < (1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_operand_layouts_for_cuda() -> None:
    """torch 2.13 `_scaled_mm` on CUDA: self row-major, mat2 column-major, K and N % 16 == 0."""
    f = Fp8Linear(_linear(k=64, n=48))
    mat2 = f.weight_fp8.t()
    assert mat2.shape == (64, 48) and mat2.stride(0) == 1 and mat2.stride(1) > 1  # column-major view, no copy
    assert mat2.data_ptr() == f.weight_fp8.data_ptr()


def test_backend_selection() -> None:
    assert select_backend("cpu") == "reference"
    assert not scaled_mm_supported("cpu")
    assert select_backend("cuda:0", capability=(9, 0)) == "scaled_mm"  # Hopper
    assert select_backend("cuda:0", capability=(8, 9)) == "scaled_mm"  # Ada
    assert select_backend("cuda:0", capability=(10, 0)) == "scaled_mm"  # Blackwell
    assert select_backend("cuda:0", capability=(8, 7)) == "reference"  # Orin: no fp8 tensor cores
    assert select_backend("cuda:0", capability=(8, 0)) == "reference"  # A100
    assert select_backend("cuda:0", capability=(9, 0), activations="none") == "reference"  # weight-only
    assert select_backend("cuda:0", requested="reference", capability=(9, 0)) == "reference"
    with pytest.raises(RuntimeError, match=r"compute capability >= 8\.9"):
        select_backend("cuda:0", requested="scaled_mm", capability=(8, 0))
    with pytest.raises(ValueError, match="weight-only"):
        select_backend("cpu", requested="scaled_mm", activations="none")
    with pytest.raises(ValueError, match="fp8 backend"):
        select_backend("cpu", requested="cublas")
    assert Fp8Linear(_linear()).backend == "reference"  # a CPU layer never picks the CUDA path


def test_backend_follows_device(monkeypatch) -> None:
    """Moving a converted layer re-selects its path: CUDA with capability >= 8.9 only."""
    import phyai_edge.layers.fp8 as fp8

    f = Fp8Linear(_linear())
    monkeypatch.setattr(fp8, "scaled_mm_supported", lambda device, capability=None: torch.device(device).type == "cuda")
    f.to("cpu")
    assert f.backend == "reference"
    monkeypatch.setattr(fp8, "scaled_mm_supported", lambda device, capability=None: True)
    f.to("cpu")  # (pretend the device is a capable GPU)
    assert f.backend == "scaled_mm"


def test_bad_shapes_and_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match=r"\(30 -> 32\).*multiples of 16"):
        Fp8Linear(nn.Linear(30, 32))
    with pytest.raises(ValueError, match=r"\(32 -> 40\).*multiples of 16"):
        Fp8Linear(nn.Linear(32, 40))
    with pytest.raises(ValueError, match="needs input_scale"):
        Fp8Linear(_linear(), activations="static")
    with pytest.raises(ValueError, match="activations"):
        Fp8Linear(_linear(), activations="per-token")
    with pytest.raises(TypeError, match=r"nn\.Linear"):
        Fp8Linear(nn.Conv2d(16, 16, 1))  # type: ignore[arg-type]
    f = Fp8Linear(_linear(k=64), backend="scaled_mm")
    with pytest.raises(ValueError, match="expects 64 input features"):
        f(torch.randn(2, 48))

    class Tiny(nn.Module):  # a scope whose MLP has a width _scaled_mm cannot take
        def __init__(self) -> None:
            super().__init__()
            from phyai_edge.layers.mlp import GatedMLP

            self.expert_layers = nn.ModuleList([nn.Module()])
            self.expert_layers[0].mlp = GatedMLP(32, 40)

    with pytest.raises(ValueError, match=r"expert_layers\.0\.mlp\.gate_proj.*multiples of 16"):
        convert_fp8(Tiny(), "expert")
    with pytest.raises(ValueError, match="fp8 scope"):
        convert_fp8(Tiny(), "vision-only")


# -- the swap into PI0.5 --------------------------------------------------------------------
@pytest.fixture(scope="module")
def base():
    return builtin_adapter("tiny", seed=3)


def _inputs(adapter, batch: int = 2, views: int = 3, seed: int = 0) -> ModelInputs:
    cfg = adapter.cfg
    g = torch.Generator().manual_seed(seed)
    s, length = cfg.vision.image_size, cfg.max_token_len
    valid = torch.tensor([20, 9][:batch] + [5] * max(0, batch - 2))
    token_mask = torch.arange(length)[None, :] < valid[:, None]
    tokens = torch.randint(1, cfg.vocab_size, (batch, length), generator=g) * token_mask
    return ModelInputs({"images": torch.rand(batch, views, 3, s, s, generator=g) * 2 - 1,
                        "image_mask": torch.ones(batch, views, dtype=torch.bool),
                        "tokens": tokens, "token_mask": token_mask}, batch)


def _noise(adapter, batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, adapter.chunk_size, adapter.model_action_dim, generator=torch.Generator().manual_seed(1))


def test_convert_keeps_state_dict_and_composes_with_fusion(base) -> None:
    module = copy.deepcopy(base.module).set_precision(torch.bfloat16)
    assert fuse_projections(module) > 0  # fusion keeps the names, the parts become views
    before = {k: (v.dtype, v.shape, v.data_ptr()) for k, v in module.state_dict().items()}
    n = convert_fp8(module, "expert")
    depth = module.cfg.expert.depth
    assert n == 4 * depth  # fused qkv, o, fused gate/up, down per expert layer
    layer = module.expert_layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Fp8Linear) and isinstance(layer.mlp.gate_up, Fp8Linear)
    assert isinstance(layer.self_attn.o_proj, Fp8Linear) and isinstance(layer.mlp.down_proj, Fp8Linear)
    assert not isinstance(layer.self_attn.q_proj, Fp8Linear)  # parts stay bf16 views of the fused weight
    assert not any(isinstance(m, Fp8Linear) for m in module.prefix_layers.modules())
    assert not isinstance(layer.input_layernorm.dense, Fp8Linear)  # norm modulation stays float32
    after = {k: (v.dtype, v.shape, v.data_ptr()) for k, v in module.state_dict().items()}
    assert after == before  # same names, dtypes, shapes and storage: still a checkpoint
    assert len(fp8_linears(module)) == n
    assert convert_fp8(module, "expert") == 0  # idempotent
    # set_precision drops fp8 (and fusion) and restores plain linears on the same Parameters
    w = layer.self_attn.o_proj.weight
    module.set_precision(torch.float32)
    assert not fp8_linears(module) and type(layer.self_attn.o_proj) is nn.Linear
    assert layer.self_attn.qkv_proj is None and layer.self_attn.o_proj.weight.dtype == torch.float32
    assert set(module.state_dict()) == set(before)
    del w


def test_unfused_conversion_and_remove(base) -> None:
    module = copy.deepcopy(base.module).set_precision(torch.bfloat16)
    assert convert_fp8(module, "expert") == 7 * module.cfg.expert.depth  # q, k, v, o, gate, up, down
    all_module = copy.deepcopy(base.module).set_precision(torch.bfloat16)
    fuse_projections(all_module)
    cfg = all_module.cfg
    assert convert_fp8(all_module, "all") == 4 * (cfg.vision.depth + cfg.prefix.depth + cfg.expert.depth) + 1
    assert isinstance(all_module.projector, Fp8Linear)
    assert remove_fp8(module) == 7 * module.cfg.expert.depth and not fp8_linears(module)


def test_cast_after_conversion_is_refused_clearly(base) -> None:
    module = copy.deepcopy(base.module).set_precision(torch.bfloat16)
    convert_fp8(module, "expert")
    lin = module.expert_layers[0].self_attn.o_proj
    lin.float()  # bypassing set_precision: the fp8 copy is cast too
    with pytest.raises(RuntimeError, match="remove_fp8"):
        lin(torch.randn(1, lin.in_features))


def test_calibrated_scales_for_fused_linears(base) -> None:
    from phyai_edge.calibration.fp8 import collect_amax, scales_from_amax

    module = copy.deepcopy(base.module).float()
    ad = copy.copy(base)
    ad.module = module
    x, noise = _inputs(base), _noise(base)
    amax = collect_amax(module, lambda: EagerEngine(ad, dtype="float32").run(x, noise=noise))
    scales = scales_from_amax(amax)
    module.set_precision(torch.bfloat16)
    fuse_projections(module)
    convert_fp8(module, "expert", scales)
    qkv = module.expert_layers[1].self_attn.qkv_proj
    parts = [f"expert_layers.1.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
    assert qkv.activations == "static"
    assert float(qkv.weight_scale) == pytest.approx(max(scales[p]["weight_scale"] for p in parts))
    assert float(qkv.input_scale) == pytest.approx(max(scales[p]["input_scale"] for p in parts))


# -- accuracy: the engine option on the tiny preset (reference path on CPU) -----------------
@pytest.fixture(scope="module")
def references(base):
    x, noise = _inputs(base), _noise(base)
    fp32 = EagerEngine(copy.deepcopy(base), dtype="float32").run(x, noise=noise)
    bf16 = EagerEngine(copy.deepcopy(base), dtype="bfloat16").run(x, noise=noise)
    return x, noise, fp32, bf16


@pytest.mark.parametrize("scope,bound", [("expert", 2e-2), ("all", 3e-2)])
def test_fp8_engine_accuracy(base, references, scope: str, bound: float) -> None:
    x, noise, fp32, bf16 = references
    eng = CudaGraphEngine(copy.deepcopy(base), device="cpu", dtype="bfloat16", fp8=scope)
    assert eng.fp8 == scope and eng.fp8_linears > 0
    assert {m.backend for m in fp8_linears(eng.module)} == {"reference"}
    out = eng.run(x, noise=noise)
    assert torch.isfinite(out).all()
    vs32, vs16, bf16_err = _rel(out, fp32), _rel(out, bf16), _rel(bf16, fp32)
    print(f"fp8 {scope} (tiny, cpu reference path): rel L2 vs eager fp32 {vs32:.3g}, vs eager bf16 {vs16:.3g} "
          f"(bf16 vs fp32 {bf16_err:.3g})")
    assert vs32 < bound and vs16 < bound
    assert vs32 > bf16_err  # fp8 really is on: coarser than bf16 alone


def _guidance(adapter, batch: int, mode: str):
    from phyai_edge.engines.rtc import RTCGuidance, prefix_weights

    h, d = adapter.chunk_size, adapter.model_action_dim
    target = torch.randn(batch, h, d, generator=torch.Generator().manual_seed(7)) * 0.5
    dim_mask = torch.zeros(d)
    dim_mask[: adapter.action_dim] = 1.0
    return RTCGuidance(mode, target, prefix_weights(h, 4, 20), dim_mask, 4, 5.0)


@pytest.mark.parametrize("mode", ["inpaint", "guided-approx", "guided"])
def test_fp8_engine_rtc_modes(base, references, mode: str) -> None:
    """RTC through fp8 linears; exact guidance takes its VJP through them (straight-through)."""
    x, noise, _, _ = references
    g = _guidance(base, 2, mode)
    ref = EagerEngine(copy.deepcopy(base), dtype="float32").run(x, noise=noise, rtc=g)
    eng = CudaGraphEngine(copy.deepcopy(base), device="cpu", dtype="bfloat16", fp8="expert")
    rel = _rel(eng.run(x, noise=noise, rtc=g), ref)
    print(f"fp8 expert, RTC {mode}: rel L2 vs eager fp32 {rel:.3g}")
    assert rel < 3e-2


def test_fp8_gradient_is_straight_through() -> None:
    lin = _linear(bias=True)
    f = Fp8Linear(lin)
    x = torch.randn(4, 64, requires_grad=True)
    grad_out = torch.randn(4, 48)
    (gx,) = torch.autograd.grad(f(x), x, grad_out)
    assert torch.allclose(gx, grad_out @ f.dequantized_weight(torch.float32), atol=1e-6)


def test_fp8_engine_calibrated_and_options(base, references) -> None:
    from phyai_edge.calibration.fp8 import collect_amax, scales_from_amax

    x, noise, fp32, _ = references
    ad = copy.deepcopy(base)
    amax = collect_amax(ad.module, lambda: EagerEngine(ad, dtype="float32").run(x, noise=noise))
    scales = scales_from_amax(amax)
    eng = CudaGraphEngine(copy.deepcopy(base), device="cpu", dtype="bfloat16", fp8="expert", fp8_scales=scales)
    assert {m.activations for m in fp8_linears(eng.module)} == {"static"}
    rel = _rel(eng.run(x, noise=noise), fp32)
    print(f"fp8 expert, calibrated static scales: rel L2 vs eager fp32 {rel:.3g}")
    assert rel < 2e-2
    unfused = CudaGraphEngine(copy.deepcopy(base), device="cpu", dtype="bfloat16", fp8="expert", fuse=False)
    assert unfused.fp8_linears == 7 * base.cfg.expert.depth
    assert _rel(unfused.run(x, noise=noise), fp32) < 2e-2
    untouched = copy.deepcopy(base)
    with pytest.raises(ValueError, match="fp8="):
        CudaGraphEngine(untouched, device="cpu", dtype="bfloat16", fp8="vision")
    assert next(untouched.module.parameters()).dtype == torch.float32  # refused before any cast
    plain = CudaGraphEngine(copy.deepcopy(base), device="cpu", dtype="bfloat16")
    assert plain.fp8 is None and plain.fp8_linears == 0 and not fp8_linears(plain.module)


# -- bundles: `export --backend cudagraph --precision fp8` and its load path ----------------
def test_fp8_cudagraph_bundle_uses_its_scales(tmp_path, monkeypatch) -> None:
    from phyai_edge.calibration.fp8 import load_scales
    from phyai_edge.engines import bundle as bundle_mod
    from phyai_edge.engines.bundle import cudagraph_fp8_options, load_bundle_engine, read_manifest
    from phyai_edge.engines.exporter import ExportRequest, export_bundle

    out = tmp_path / "tiny-cg-fp8"
    lines: list[str] = []
    export_bundle(ExportRequest(out=out, backend="cudagraph", precision="fp8", calibration="synthetic",
                                calibration_samples=3, holdout=2, progress=False, fp8_scope="expert"),
                  adapter=builtin_adapter("tiny", seed=0), echo=lines.append)
    m = read_manifest(out)
    assert m["fp8"]["scope"] == "expert" and m["fp8"]["activations"] == "static"
    # Only the stage that runs the expert's linears is fp8; vision and prefix run in bf16.
    assert m["precision"] == {"embed_images": "bf16", "encode_prefix": "bf16", "denoise_step": "fp8"}
    assert m["fp8"]["scales"] in m["files"]
    report = m["calibration"]["fp8_engine_vs_fp32"]
    print(f"fp8 cudagraph bundle (expert, calibrated, cpu reference path) vs fp32: rel-RMSE "
          f"{report['relative_rmse']:.3g}, max {report['max_abs_error']:.3g}")
    assert 0 < report["relative_rmse"] < 0.05
    assert any("fp8 engine (expert" in line for line in lines)
    opts = cudagraph_fp8_options(out, m)
    assert opts["fp8"] == "expert" and opts["fp8_activations"] == "static"
    stored = load_scales(out / m["fp8"]["scales"])
    assert opts["fp8_scales"] == stored

    # The real load path (bundle.load_bundle_engine), let through on a CPU: cudagraph bundles
    # otherwise refuse a non-CUDA device before building anything.
    monkeypatch.setattr(bundle_mod, "check_platform", lambda *a, **k: None)
    adapter, engine, _ = load_bundle_engine(out, device="cpu")
    assert engine.fp8 == "expert" and engine.fp8_linears == 4 * adapter.cfg.expert.depth
    down = engine.module.expert_layers[0].mlp.down_proj
    assert isinstance(down, Fp8Linear) and down.activations == "static"
    assert float(down.input_scale) == pytest.approx(stored["expert_layers.0.mlp.down_proj"]["input_scale"])
    assert float(down.weight_scale) == pytest.approx(stored["expert_layers.0.mlp.down_proj"]["weight_scale"])

    # A bundle without its scales file is refused with the reason
    m2 = dict(m, fp8={**m["fp8"], "scales": "calibration/missing.safetensors"})
    with pytest.raises(bundle_mod.BundleError, match="no fp8 scales"):
        cudagraph_fp8_options(out, m2)
    assert cudagraph_fp8_options(out, {**m, "precision": {"denoise_step": "bf16"}}) == {}


def test_linear_calls_are_attributed_to_their_stage() -> None:
    """What the exporter's per-stage precision rests on: every linear call seen while calibrating
    is told to the stage that made it, so a scope's roots map onto the stages that run them."""
    from phyai_edge.calibration.dataset import synthetic_observations
    from phyai_edge.calibration.fp8 import collect_amax
    from phyai_edge.engines.stage_inputs import collect_stage_inputs

    adapter = builtin_adapter("tiny", seed=0)
    obs = synthetic_observations(adapter, 1, seed=1)
    current = [""]
    seen: dict[str, set[str]] = {}
    collect_amax(adapter.module,
                 lambda: collect_stage_inputs(adapter, obs, on_stage=lambda n: current.__setitem__(0, n)),
                 on_call=lambda lin: seen.setdefault(current[0], set()).add(lin))
    assert set(seen) == set(adapter.stage_names())

    def roots(stage: str) -> set[str]:
        return {name.split(".")[0] for name in seen[stage]}

    assert "vision" in roots("embed_images") and not roots("embed_images") & {"prefix_layers", "expert_layers"}
    assert "prefix_layers" in roots("encode_prefix") and "expert_layers" not in roots("encode_prefix")
    assert "expert_layers" in roots("denoise_step") and "prefix_layers" not in roots("denoise_step")


def test_export_fp8_scope_is_checked() -> None:
    from phyai_edge.engines.exporter import ExportRequest

    with pytest.raises(ValueError, match="fp8 scope"):
        ExportRequest(out=None, backend="cudagraph", precision="fp8", fp8_scope="vision").normalised()


# -- bench --------------------------------------------------------------------------------
def test_bench_fp8_option(capsys) -> None:
    from phyai_edge.cli import main as cli

    assert cli(["bench", "--backend", "cudagraph", "--dtype", "bfloat16", "--fp8", "expert", "--iters", "1",
                "--warmup", "0", "--steps", "2", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["fp8"] == "expert" and res["fp8_linears"] > 0
    with pytest.raises(SystemExit) as exc:  # a usage error: exit 2, one line naming the flag
        cli(["bench", "--fp8", "expert", "--iters", "1"])
    assert exc.value.code == 2 and "phyai-edge bench: --fp8 / --fp8-scales need --backend cudagraph" in (
        capsys.readouterr().err)


# -- on a GPU with fp8 tensor cores -------------------------------------------------------
@pytest.mark.skipif(not GPU_FP8, reason="needs a CUDA GPU of compute capability >= 8.9 (Ada / Hopper)")
def test_scaled_mm_on_gpu_matches_reference() -> None:
    lin = _linear(k=1024, n=4096).to("cuda", torch.bfloat16)
    x = torch.randn(50, 1024, device="cuda", dtype=torch.bfloat16)
    fast = Fp8Linear(lin)
    assert fast.backend == "scaled_mm"
    ref = Fp8Linear(lin, backend="reference")
    assert _rel(fast(x), ref(x)) < 1e-2
    assert _rel(fast(x), lin(x)) < 0.06


@pytest.mark.skipif(not GPU_FP8, reason="needs a CUDA GPU of compute capability >= 8.9 (Ada / Hopper)")
@pytest.mark.parametrize("scope", ["expert", "all"])
def test_fp8_graphs_on_gpu(base, scope: str) -> None:
    x, noise = _inputs(base), _noise(base)
    x = ModelInputs({k: v.cuda() for k, v in x.tensors.items()}, x.batch_size)
    ref = EagerEngine(copy.deepcopy(base), device="cuda", dtype="float32").run(x, noise=noise.cuda())
    eng = CudaGraphEngine(copy.deepcopy(base), device="cuda", dtype="bfloat16", fp8=scope)
    assert {m.backend for m in fp8_linears(eng.module)} == {"scaled_mm"}
    out = eng.run(x, noise=noise.cuda())
    gs = next(iter(eng._sets.values()))
    assert not gs.eager  # captured, not the eager fallback
    assert _rel(out, ref) < 3e-2
    g = _guidance(base, 2, "guided")
    g_ref = EagerEngine(copy.deepcopy(base), device="cuda", dtype="float32").run(x, noise=noise.cuda(), rtc=g)
    assert _rel(eng.run(x, noise=noise.cuda(), rtc=g), g_ref) < 3e-2


# -- the one-pass activation quantiser ------------------------------------------------------------------
def test_quantize_kernel_saturates_like_the_reference() -> None:
    """`quantize_kernel`'s value before the E4M3 cast (float32 out: Triton's CPU interpreter casts
    to fp8 wrongly, so the cast itself is checked on the GPU below) is the reference's x / scale
    clamped to +-448, bit for bit, including values far past the range; odd sizes cross block
    edges. On a CPU `quantize_fast` is the reference."""
    from phyai_edge.layers import fp8 as fp8_mod
    from phyai_edge.layers.triton_dispatch import triton_status

    x = torch.randn(3, 4099, dtype=torch.bfloat16) * 300
    scale = torch.tensor(0.37)
    assert torch.equal(fp8_mod.quantize_fast(x, scale).view(torch.uint8),
                       fp8_mod.quantize(x, scale).view(torch.uint8))
    ok, why = triton_status("cpu")
    if not ok:
        pytest.skip(f"Triton kernels cannot run here: {why}")
    out = fp8_mod.quantize_kernel(x, scale, torch.float32)
    want = (x.float() / scale).clamp(-448.0, 448.0)
    assert out.shape == x.shape and torch.equal(out, want)
    assert float(out.abs().max()) == 448.0  # some inputs saturated


@pytest.mark.skipif(not GPU_FP8, reason="needs a CUDA GPU with fp8 (compute capability >= 8.9)")
def test_quantize_kernel_matches_torch_on_gpu() -> None:
    from phyai_edge.layers import fp8 as fp8_mod

    x = torch.randn(257, 1000, device="cuda", dtype=torch.bfloat16) * 300
    scale = torch.tensor(0.37, device="cuda")
    assert torch.equal(fp8_mod.quantize_kernel(x, scale).view(torch.uint8),
                       fp8_mod.quantize(x, scale).view(torch.uint8))
