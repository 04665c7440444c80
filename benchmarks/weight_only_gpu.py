"""Would weight-only int8 / fp8 make the batch-1 action expert faster? One question, one device call.

At batch 1 a denoise step reads all 311M action-expert weights (622 MB in bf16) for 50 activation
rows: the GEMMs are memory-bound, and the step runs at ~0.75 ms on an H200 where the weight read
alone is ~0.15 ms (RESULTS.md). Storing the weights in 8 bits (one scale per output channel, the
activations left in bf16, the weight tile upcast in registers) halves the bytes read. Whether that
halves the time depends on what bounds these kernels: RESULTS.md's Nsight profile says the small-M
GEMMs issue ~1000 instructions a warp and are not waiting on DRAM, so the upcast's extra
instructions may eat the saving. This script measures it before any engine work is done.

For the expert's four projections (fused QKV 2560 x 1024, o_proj 1024 x 2048, fused gate/up
8192 x 1024, down 1024 x 4096) at M = 50 rows:
1. one small-M Triton kernel written for this question (the K loop and tiling of
   `layers.triton_gemm`'s plain linear, split K with float32 partials and a fixed-order sum),
   compiled for a bf16, an int8 or an fp8 (E4M3) weight; the 8-bit weights carry per-output-channel
   scales applied once in the epilogue; a small sweep of tiles and splits per weight kind;
2. beside it, cuBLAS (`F.linear`) and the project's own bf16 kernel (`triton_gemm.linear`) as the
   engine runs them today;
3. correctness: each kernel against float32 math on the same (dequantised) weights, and the
   quantisation's own error against the bf16 weights (random weights: a real checkpoint's error
   is not measured here).

Timing as `gemm_gpu.py`: copies of each weight, together more than twice the L2, called in turn
inside one CUDA graph, replayed 20 times; median microseconds per call.

    PYTHONPATH=$PWD python3 benchmarks/weight_only_gpu.py --json $OUT/weight_only.json      # GPU
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/weight_only_gpu.py --device cpu --tiny   # plumbing

On a CPU the numbers mean nothing (the interpreter); fp8 runs only where the GPU has E4M3
conversions (compute capability 8.9 and up).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from graph_timing import l2_bytes, time_calls  # benchmarks/ is on sys.path when this runs as a script

T0 = time.perf_counter()
KINDS = ("bf16", "int8", "fp8")
INT8_MAX, FP8_MAX = 127.0, 448.0


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def shapes(tiny: bool) -> list[tuple[str, int, int]]:
    """(name, N, K) of the expert's projections (weights are N x K)."""
    if tiny:
        return [("qkv", 96, 64), ("down", 64, 128)]
    return [("qkv", 2560, 1024), ("o_proj", 1024, 2048), ("gate_up", 8192, 1024), ("down", 1024, 4096)]


def quantise(w: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A bf16 (N, K) weight as `kind`: (stored weight, float32 per-row scale or None)."""
    if kind == "bf16":
        return w, None
    amax = w.float().abs().amax(dim=1).clamp_min(1e-12)
    if kind == "int8":
        scale = amax / INT8_MAX
        q = torch.round(w.float() / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    else:
        scale = amax / FP8_MAX
        q = (w.float() / scale[:, None]).to(torch.float8_e4m3fn)
    return q.contiguous(), scale.contiguous()


def dequantised(q: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return q.float() if scale is None else q.float() * scale[:, None]


try:
    import triton
    import triton.language as tl
except ImportError:  # the plumbing test skips without it
    triton = None

if triton is not None:

    @triton.jit
    def _wo_linear_kernel(a_ptr, w_ptr, scale_ptr, out_ptr, M, N, K, k_per_split,
                          s_am, s_wn, s_os, s_om,
                          SCALED: tl.constexpr, PARTIAL: tl.constexpr, UPCAST: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """out[:, tile] (or this split's float32 partial) = a @ (w * scale)^T for one column tile.
        The weight tile is loaded in its stored type and upcast to the activation type in
        registers; the per-column scale multiplies the float32 sums once, after the K loop."""
        pid_n = tl.program_id(0)
        split = tl.program_id(1)
        rm = tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = rm < M, rn < N
        rk = tl.arange(0, BLOCK_K)
        k0 = split * k_per_split
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in range(k0, k0 + k_per_split, BLOCK_K):  # K is a multiple of BLOCK_K x splits (checked)
            kk = k + rk
            a = tl.load(a_ptr + rm[:, None] * s_am + kk[None, :], mask=m_ok[:, None], other=0.0)
            w = tl.load(w_ptr + rn[None, :] * s_wn + kk[:, None], mask=n_ok[None, :], other=0.0,
                        eviction_policy="evict_first")
            w = w.to(a.dtype)
            if UPCAST:  # the interpreter's bf16 dot is wrong (layers.triton_gemm says so)
                acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
        if SCALED:
            acc = acc * tl.load(scale_ptr + rn, mask=n_ok, other=0.0)[None, :]
        dst = out_ptr + split * s_os + rm[:, None] * s_om + rn[None, :]
        if PARTIAL:
            tl.store(dst, acc, mask=m_ok[:, None] & n_ok[None, :])
        else:
            tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _sum_splits_kernel(part_ptr, out_ptr, M, N, s_ps, s_pm, s_om, SPLITS: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        rm = tl.arange(0, BLOCK_M)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = (rm[:, None] < M) & (rn[None, :] < N)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for s in tl.static_range(SPLITS):  # a fixed order: the same sum on every run
            acc += tl.load(part_ptr + s * s_ps + rm[:, None] * s_pm + rn[None, :], mask=ok, other=0.0)
        tl.store(out_ptr + rm[:, None] * s_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)


def wo_linear(a: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, cfg: dict[str, int],
              out: torch.Tensor, part: torch.Tensor | None) -> torch.Tensor:
    """a (M, K) bf16 @ (w * scale)^T -> out (M, N); `part` (splits, M, N) float32 when split."""
    m, k = a.shape
    n = w.shape[0]
    bn, bk, splits = cfg["block_n"], cfg["block_k"], cfg["splits"]
    bm = max(16, triton.next_power_of_2(m))
    assert k % (bk * splits) == 0, (k, bk, splits)
    per = k // splits
    grid = (triton.cdiv(n, bn), splits)
    upcast = os.environ.get("TRITON_INTERPRET") == "1"
    dst = part if splits > 1 else out
    _wo_linear_kernel[grid](a, w, scale if scale is not None else a, dst, m, n, k, per,
                            a.stride(0), w.stride(0), dst.stride(0) if splits > 1 else 0, dst.stride(-2),
                            SCALED=scale is not None, PARTIAL=splits > 1, UPCAST=upcast,
                            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=cfg["warps"], num_stages=cfg["stages"])
    if splits > 1:
        assert part is not None
        _sum_splits_kernel[(triton.cdiv(n, 64),)](part, out, m, n, part.stride(0), part.stride(1), out.stride(0),
                                                 SPLITS=splits, BLOCK_M=bm, BLOCK_N=64)
    return out


def configs(tiny: bool, k: int) -> list[dict[str, int]]:
    if tiny:
        grid = itertools.product((32,), (32, 64), (1, 2), (4,), (2,))
    else:
        grid = itertools.product((32, 64), (128, 256), (1, 2, 4), (4,), (3, 4))
    out = []
    for bn, bk, splits, warps, stages in grid:
        if k % (bk * splits) == 0:
            out.append({"block_n": bn, "block_k": bk, "splits": splits, "warps": warps, "stages": stages})
    return out


def fp8_ok(device: str) -> bool:
    if not device.startswith("cuda"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def run(args: argparse.Namespace) -> dict[str, Any]:
    dev = args.device
    gen = torch.Generator(device="cpu").manual_seed(0)
    m = args.rows
    kinds = [k for k in KINDS if k != "fp8" or fp8_ok(dev)]
    rows: list[dict[str, Any]] = []
    for name, n, k in shapes(args.tiny):
        w = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16).to(dev)
        a = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(dev)
        exact = a.float() @ w.float().t()
        # Enough copies that they do not fit the L2 twice over: every call reads its weight from memory.
        copies = max(2, -(-2 * l2_bytes(dev) // (n * k * 2))) if dev.startswith("cuda") else 2
        row: dict[str, Any] = {"shape": name, "n": n, "k": k, "m": m, "copies": copies}
        ws = [w] + [w.clone() for _ in range(copies - 1)]
        out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
        row["cublas_us"] = time_calls([lambda x=x, a=a, out=out: torch.matmul(a, x.t(), out=out) for x in ws], dev)
        try:
            from phyai_edge.layers import triton_gemm

            row["project_us"] = time_calls([lambda x=x, a=a: triton_gemm.linear(a, x, backend="triton") for x in ws],
                                           dev)
        except Exception as exc:  # its table may not take the tiny shapes
            row["project_us"] = None
            row["project_note"] = f"{type(exc).__name__}: {exc}"
        for kind in kinds:
            q, scale = quantise(w, kind)
            deq = dequantised(q, scale)
            # What storing the weight in `kind` costs, before any kernel: the chunk's actions see this.
            row[f"{kind}_quant_rel"] = float((a.float() @ deq.t() - exact).norm() / exact.norm())
            qs = [(q, scale)] + [(q.clone(), None if scale is None else scale.clone()) for _ in range(copies - 1)]
            best: tuple[float, dict[str, int]] | None = None
            for cfg in configs(args.tiny, k):
                part = torch.empty(cfg["splits"], m, n, dtype=torch.float32, device=dev) if cfg["splits"] > 1 else None
                try:
                    got = wo_linear(a, q, scale, cfg, out, part).float()
                except triton.runtime.errors.OutOfResources:  # a tile the GPU's shared memory cannot hold
                    continue
                err = float((got - a.float() @ deq.t()).abs().max())
                ref_scale = float((a.float() @ deq.t()).abs().max())
                if err > 2e-2 * ref_scale:
                    raise AssertionError(f"{name} {kind} {cfg}: max abs error {err:.3g} at scale {ref_scale:.3g}")
                us = time_calls([lambda x=x, s=s, a=a, cfg=cfg, out=out, part=part: wo_linear(a, x, s, cfg, out, part)
                                 for x, s in qs], dev)
                if best is None or us < best[0]:
                    best = (us, cfg)
            assert best is not None
            row[f"{kind}_us"], row[f"{kind}_cfg"] = best
            row[f"{kind}_tbs"] = q.numel() * q.element_size() / (best[0] * 1e-6) / 1e12
            say(f"{name} {kind}: {best[0]:.2f} us {best[1]} (quantisation rel error {row[f'{kind}_quant_rel']:.2e})")
        rows.append(row)
    return {"device": torch.cuda.get_device_name(dev) if dev.startswith("cuda") else "cpu",
            "torch": torch.__version__, "triton": getattr(triton, "__version__", None), "rows": rows,
            "kinds": kinds}


def table(res: dict[str, Any]) -> str:
    kinds = res["kinds"]
    head = ["shape", "cuBLAS us", "project bf16 us"] + [f"{k} us (TB/s)" for k in kinds] + \
        [f"{k} / bf16" for k in kinds if k != "bf16"] + [f"{k} quant rel err" for k in kinds if k != "bf16"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    total = dict.fromkeys(["cublas", "project", *kinds], 0.0)
    for r in res["rows"]:
        cells = [r["shape"], f"{r['cublas_us']:.2f}", "-" if r["project_us"] is None else f"{r['project_us']:.2f}"]
        cells += [f"{r[f'{k}_us']:.2f} ({r[f'{k}_tbs']:.2f})" for k in kinds]
        cells += [f"{r[f'{k}_us'] / r['bf16_us']:.2f}" for k in kinds if k != "bf16"]
        cells += [f"{r[f'{k}_quant_rel']:.1e}" for k in kinds if k != "bf16"]
        lines.append("| " + " | ".join(cells) + " |")
        total["cublas"] += r["cublas_us"]
        total["project"] += r["project_us"] or 0.0
        for k in kinds:
            total[k] += r[f"{k}_us"]
    per_layer = ", ".join(f"{k} {v:.1f}" for k, v in total.items())
    lines.append(f"\nOne expert layer's four projections, us: {per_layer}; x 18 layers x 10 steps = "
                 + ", ".join(f"{k} {v * 180 / 1e3:.2f} ms" for k, v in total.items()) + " a chunk.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", type=int, default=50, help="activation rows (50: the expert at batch 1)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes and two configs: a plumbing check")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    if triton is None:
        print("triton is not installed", file=sys.stderr)
        return 2
    res = run(args)
    print(table(res))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
