"""The GPU benchmarks' plumbing, run on this CPU: each script's `--tiny` mode under Triton's interpreter
(the kernel scripts), so that a change to a kernel's arguments or a tiling's fields breaks a test here
instead of the next GPU session's first call, whose device time is scarce. The numbers such a run
prints mean nothing on a CPU; what is checked is that the script runs to its end and prints the
table it exists for, with no variant that raised (the scripts record such a variant's error in
their table and go on, as a GPU refusing a tiling needs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_triton_ops import kernels

ROOT = Path(__file__).resolve().parents[1]

CASES = {
    # script, arguments, what its output must contain
    "attention_grad_gpu": (["--batches", "1", "--cold"], ["input sets, cycled", "fwd+bwd, kernel vs sdpa"]),
    "expert_layer_gpu": ([], ["| per-op kernels (before) |", "| phases one by one |"]),
    "gemm_gpu": ([], ["Suggested `triton_gemm.CONFIGS` entries"]),
    "siglip_padding_gpu": ([], ["fc1 us", "sdpa us"]),
    # its kernel checks every config against the dequantised weights and raises on a mismatch
    "weight_only_gpu": ([], ["| qkv |", "int8 / bf16", "One expert layer's four projections"]),
    "policy_overhead_gpu": (["--reps", "2", "--layouts", "1+2 masked", "--rtc", "none,guided-approx"],
                            ["| 1+2 masked, none |", "| 1+2 masked, guided-approx |", "infer - run"]),
}


def _run(script: str, args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@kernels
@pytest.mark.parametrize("script", list(CASES))
def test_benchmark_runs_tiny_on_the_cpu(script) -> None:
    args, markers = CASES[script]
    done = _run(script, ["--device", "cpu", "--tiny", *args])
    assert done.returncode == 0, done.stderr[-3000:]
    for marker in markers:
        assert marker in done.stdout, (marker, done.stdout[-2000:])
    # the scripts record a variant that raised and go on (a tiling a GPU refuses): none may here
    assert "Error:" not in done.stdout, done.stdout[-3000:]


def test_gpu_only_benchmark_imports_on_the_cpu() -> None:
    """`l2_prefetch_gpu.py` has no CPU mode (its kernel is inline PTX): its imports and arguments, at least."""
    done = _run("l2_prefetch_gpu", ["--help"], timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--programs" in done.stdout


def test_ncu_stages_summarizes_a_recorded_run() -> None:
    """`ncu_stages.py --parse` on the first batch-1 step it recorded on the H200 (RESULTS.md, fourteenth
    session): the table names the step's kernels and sums what ncu measured."""
    done = _run("ncu_stages", ["--parse", str(ROOT / "benchmarks/runs/ncu_b1_s14/denoise_step.csv")], timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "denoise_step: 161 kernels, 1027.4 us alone under ncu" in done.stdout
    assert "| `_split_attn_kernel` | 18 | 262.8 (14.60) |" in done.stdout


def test_ncu_kernel_names_lose_their_templates() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from ncu_stages import short_name

    assert short_name("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>(int, T2)") \
        == "at::native::vectorized_elementwise_kernel"
    assert short_name("_split_attn_kernel") == "_split_attn_kernel"


def test_norm_fold_benchmark_imports_on_the_cpu() -> None:
    """`norm_fold_gpu.py --tiny` takes minutes under the interpreter (the vision and prefix stages):
    its arguments and imports here; its engines' code is `tests/test_norm_fold.py`'s."""
    done = _run("norm_fold_gpu", ["--help"], timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--builtin" in done.stdout


def test_engine_ab_variants_set_their_knobs_and_put_them_back() -> None:
    """`engine_ab_gpu.py --variants`: each knob parsed into the setting it names, active only inside
    the variant's context; a knob it does not know is refused by name. (Its `--tiny` run takes
    minutes under the interpreter; the engines' code is tested elsewhere.)"""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from engine_ab_gpu import parse_variants

    from phyai_edge.layers import fused_stacks, triton_fold, triton_gemm

    a, b = parse_variants("base; tuned: geglu/m64=64,32,128,4,3,2 + residual=64,16,128,4,4,4 + unfolded")
    assert (a.name, a.fold, a.configs) == ("base", True, {})
    assert b.configs["geglu/m64"] == triton_gemm.GemmConfig(64, 32, 128, 4, 3, 2)
    before = triton_gemm.CONFIGS["geglu/m64"]
    with b.active():
        assert triton_gemm.CONFIGS["geglu/m64"].split_k == 2
        assert (triton_fold.RESIDUAL_CONFIG.block_n, triton_fold.RESIDUAL_CONFIG.split_k) == (16, 4)
        assert fused_stacks.set_fold_norms(False) is False  # the variant had turned it off
    assert triton_gemm.CONFIGS["geglu/m64"] == before and triton_fold.RESIDUAL_CONFIG is None
    assert fused_stacks.set_fold_norms(True) is True
    (c,) = parse_variants("c:few=16,64,4,3,128,1,1")
    assert c.configs["few"].tma and c.configs["few"].stages == 3
    from phyai_edge.layers import triton_attention

    few = triton_attention.FEW_BLOCKS
    with c.active():
        assert triton_attention.FEW_BLOCKS.tma
    assert triton_attention.FEW_BLOCKS is few
    (m,) = parse_variants("m:mid=64,64,4,2,2000,0,0,1")  # the 64-row class, pointer loads, keys as rows
    mid = triton_attention.MID_BLOCKS
    want = triton_attention.SplitConfig(64, 64, 4, 2, 2000, False, tma=False, keys_as_rows=True)
    with m.active():
        active = triton_attention.MID_BLOCKS
        assert active == want
        assert triton_attention.FEW_BLOCKS is few
    assert triton_attention.MID_BLOCKS is mid
    (e,) = parse_variants("e:no-early+early-max=3+no-dense+early-guided")
    from phyai_edge.engines import cudagraph

    most = cudagraph.EARLY_STEP_MAX_BATCH
    assert e.engine == {"early_step": False, "dense_prefix": False, "dense_expert": False} and e.early_max == 3
    guided = cudagraph.EARLY_STEP_GUIDED
    with e.active():
        assert cudagraph.EARLY_STEP_MAX_BATCH == 3 and cudagraph.EARLY_STEP_GUIDED
    assert cudagraph.EARLY_STEP_MAX_BATCH == most != 3
    assert cudagraph.EARLY_STEP_GUIDED is guided
    (g,) = parse_variants("g:unfused-vjp")
    with g.active():
        assert triton_gemm.set_fused_vjp_forward(False) is False  # the variant had turned it off
    assert triton_gemm.set_fused_vjp_forward(True) is True
    for bad in ("x:geglu/m65=64,32,128,4,3", "x:geglu/m64=64,32", "x;x", "x:few=16,64", "x:mid=64,64,4,2,2000,0,0,1,1"):
        with pytest.raises(SystemExit):
            parse_variants(bad)
    done = _run("engine_ab_gpu", ["--help"], timeout=120)
    assert done.returncode == 0 and "--variants" in done.stdout, done.stderr[-3000:]


def test_attention_timeline_summary_on_a_made_up_trace() -> None:
    """`attention_timeline_gpu.py` runs on a GPU only; its summary of a trace, here two calls of two
    programs whose phases are known, gives those phases back (and the script refuses a CPU by name)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from attention_timeline_gpu import summarize

    # g_start, c_start, c_q, c_keys, c_ticket, c_merged, c_end, g_end, sm, then the first four key blocks' ends
    call = [[1000, 0, 100, 1100, 1300, 0, 1350, 1700, 3, 400, 700, 1100, 0],
            [1500, 50, 150, 1150, 1350, 1950, 2000, 2600, 7, 650, 1150, 0, 0]]
    s = summarize([call, call])
    p = s["phases_cycles"]
    assert p["block 1"]["median"] == 400 and p["block 1"]["n"] == 4  # 300 and 500 cycles, two calls
    assert p["block 3"]["median"] == 400 and p["block 3"]["n"] == 2  # the second program has no third block
    assert "block 4" not in p
    assert p["queries"]["median"] == 100 and p["keys"]["median"] == 1000 and p["ticket"]["median"] == 200
    assert p["merge"]["n"] == 2 and p["merge"]["median"] == 600  # only the program that merged
    assert s["programs"] == 2 and s["sms"] == 2 and s["span_ns_median"] == 1600
    assert s["start_ns"]["max"] == 500 and s["timer_grain_ns"] == 500
    done = _run("attention_timeline_gpu", ["--help"], timeout=120)
    assert done.returncode == 0 and "--replays" in done.stdout, done.stderr[-3000:]


def test_input_sets_benchmark_runs_tiny_on_the_cpu() -> None:
    done = _run("input_sets_gpu", ["--tiny", "--device", "cpu", "--batch", "2", "--seconds", "0.5"], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| bench CLI inputs |" in done.stdout and "| pi05_gpu.py inputs |" in done.stdout
