"""Where the batch-1 expert attention's ~13.5 us go: a timeline of the split kernel's programs.

The split attention kernel (`layers/triton_attention.py`) run with `TRACE=True` writes, per program,
%globaltimer and %clock64 at its start, %clock64 once its queries have arrived, once its key loop is
done, once it has drawn its merge ticket and once it has merged (the last split of each query block),
and %clock64 / %globaltimer at its end, its SM, and %clock64 as each of its first four blocks of cached
keys is done (with three pipeline stages and three blocks, every block's tiles were requested before
the first was used: the later blocks' times are their arithmetic and waits for data already asked
for). Each of those clock reads sits in a branch on data
the phase produced, so it cannot run ahead of the loads it waits for. Inside one CUDA graph the traced
call follows a GEMM that fills the GPU (as the attention follows the QKV GEMM in a denoise step), and
the graph is replayed `--replays` times. Printed: the call's time traced and untraced (what the
instrumentation costs), per-phase cycles (median / p10 / p90 over programs and replays), and, from the
global timer, when programs start and end relative to the first one (the launch ramp and the tail).

    PYTHONPATH=$PWD python3 benchmarks/attention_timeline_gpu.py --json $OUT/attn_timeline.json   # H200

`--variants "name:bm,bn,warps,stages,min_keys,inline,tma[,keys_as_rows];..."` traces other tilings
of the same call (`SplitConfig`; "default" alone is the shape's `default_config`).

GPU only (the clock reads are inline PTX, which Triton's interpreter does not run); the summary is
tested on the CPU on a made-up trace (`tests/test_benchmarks_plumbing.py`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = {  # name: (batch, query heads, query tokens, cached keys, new keys): PI0.5's expert, 48 prompt tokens
    "expert b1": (1, 8, 50, 816, 50),
    "expert b2": (2, 8, 50, 816, 50),
    "prefix b1": (1, 8, 816, 816, 0),  # the prefix's own attention (one key part), 64-row blocks by default
}
SLOT = {"g_start": 0, "c_start": 1, "c_q": 2, "c_keys": 3, "c_ticket": 4, "c_merged": 5, "c_end": 6, "g_end": 7, "sm": 8,
        "c_block0": 9}  # then c_block1..3: %clock64 as each of the first four cached-key blocks is done (0: none)


def _q(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(p * len(s)))] if s else float("nan")


def summarize(traces: list[list[list[int]]]) -> dict[str, Any]:
    """Per-phase cycle counts and the global-timer spread of a list of traced calls (each a list of
    programs' slot rows, `SLOT`)."""
    phases: dict[str, list[float]] = {k: [] for k in ("queries", "block 1", "block 2", "block 3", "block 4", "keys",
                                                      "ticket", "merge", "after", "whole")}
    start_ns: list[float] = []
    end_ns: list[float] = []
    spans: list[float] = []
    ratios: list[float] = []
    grain = None
    for call in traces:
        g0 = min(r[SLOT["g_start"]] for r in call)
        spans.append(max(r[SLOT["g_end"]] for r in call) - g0)
        for r in call:
            c0, cq, ck, ct, cm, ce = (r[SLOT[k]] for k in ("c_start", "c_q", "c_keys", "c_ticket", "c_merged", "c_end"))
            phases["queries"].append(cq - c0)
            blocks = [cq] + [r[SLOT["c_block0"] + i] for i in range(4)] if len(r) > SLOT["c_block0"] else [cq]
            for i in range(1, len(blocks)):
                if blocks[i] and blocks[i - 1]:
                    phases[f"block {i}"].append(blocks[i] - blocks[i - 1])
            phases["keys"].append(ck - cq)
            phases["ticket"].append(ct - ck)
            if cm:
                phases["merge"].append(cm - ct)
            phases["after"].append(ce - (cm or ct))
            phases["whole"].append(ce - c0)
            start_ns.append(r[SLOT["g_start"]] - g0)
            end_ns.append(r[SLOT["g_end"]] - g0)
            dg = r[SLOT["g_end"]] - r[SLOT["g_start"]]
            if dg > 0:
                ratios.append((ce - c0) / dg)
            for v in (r[SLOT["g_start"]] - g0, dg):
                if v > 0:
                    grain = v if grain is None else min(grain, v)
    out: dict[str, Any] = {"calls": len(traces), "programs": len(traces[0]) if traces else 0,
                           "sms": len({r[SLOT["sm"]] for r in traces[0]}) if traces else 0,
                           "timer_grain_ns": grain, "cycles_per_ns": statistics.median(ratios) if ratios else None}
    out["phases_cycles"] = {k: {"median": statistics.median(v), "p10": _q(v, 0.1), "p90": _q(v, 0.9), "n": len(v)}
                            for k, v in phases.items() if v}
    out["start_ns"] = {"median": statistics.median(start_ns), "p90": _q(start_ns, 0.9), "max": max(start_ns)}
    out["end_ns"] = {"median": statistics.median(end_ns), "p10": _q(end_ns, 0.1), "max": max(end_ns)}
    out["span_ns_median"] = statistics.median(spans)
    return out


def table(name: str, s: dict[str, Any], us: dict[str, float]) -> str:
    cpn = s["cycles_per_ns"] or 1.98
    lines = [f"{name}: {s['programs']} programs on {s['sms']} SMs; untraced {us['untraced']:.2f} us a call, "
             f"traced {us['traced']:.2f} (in a graph of {us['calls']} calls); global timer grain "
             f"{s['timer_grain_ns']} ns, {cpn:.2f} cycles / ns",
             "| phase (per program) | median cycles | p10 | p90 | median us | programs |", "|---|---|---|---|---|---|"]
    labels = {"queries": "start -> queries loaded", "keys": "key loop (its keys)",
              **{f"block {i}": f"  cached-key block {i} of the loop" for i in range(1, 5)}, "ticket": "partial stored, ticket drawn",
              "merge": "merge (the last split)", "after": "to the program's end", "whole": "whole program"}
    for k, v in s["phases_cycles"].items():
        lines.append(f"| {labels[k]} | {v['median']:.0f} | {v['p10']:.0f} | {v['p90']:.0f} | "
                     f"{v['median'] / cpn / 1e3:.2f} | {v['n']} |")
    lines.append(f"program starts after the first: median {s['start_ns']['median'] / 1e3:.2f} us, p90 "
                 f"{s['start_ns']['p90'] / 1e3:.2f}, last {s['start_ns']['max'] / 1e3:.2f}; ends: median "
                 f"{s['end_ns']['median'] / 1e3:.2f} us, last {s['end_ns']['max'] / 1e3:.2f}; first start to last "
                 f"end {s['span_ns_median'] / 1e3:.2f} us (median over calls)")
    return "\n".join(lines)


def split_config(spec: str, what: str) -> Any:
    """'bm,bn,warps,stages,min_keys,inline,tma[,keys_as_rows]' -> `SplitConfig` (this script's
    variants and `engine_ab_gpu.py`'s few= / mid= knobs); `what` names the text in the error."""
    from phyai_edge.layers.triton_attention import SplitConfig

    v = [int(x) for x in spec.split(",")]
    if len(v) not in (7, 8):
        raise SystemExit(f"--variants: {what!r} needs bm,bn,warps,stages,min_keys,inline,tma[,keys_as_rows]")
    return SplitConfig(*v[:5], inline_merge=bool(v[5]), tma=bool(v[6]), keys_as_rows=len(v) == 8 and bool(v[7]))


def parse_variants(text: str) -> list[tuple[str, Any]]:
    """'name' (the default tiling) or 'name:' and a `split_config` spec, ';'-separated."""
    out = []
    for item in filter(None, (t.strip() for t in text.split(";"))):
        name, _, spec = item.partition(":")
        out.append((name.strip(), split_config(spec, item) if spec else None))
    return out


def run_shape(name: str, replays: int, calls: int, config: Any = None) -> tuple[dict[str, Any], dict[str, float]]:
    from graph_timing import time_calls

    from phyai_edge.layers import triton_attention as ta

    b, hq, tq, n1, n2 = SHAPES[name]
    d, dev, dt = 256, torch.device("cuda"), torch.bfloat16
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, hq, tq, d, generator=g).to(dev, dt)
    kp = tuple(torch.randn(b, 1, n, d, generator=g).to(dev, dt) for n in (n1, n2))
    vp = tuple(torch.randn(b, 1, n, d, generator=g).to(dev, dt) for n in (n1, n2))
    mask = torch.ones(b, 1, 1, n1 + n2, dtype=torch.bool, device=dev)
    key_mask = ta.kernel_key_mask(mask, b)
    qf = q.reshape(b, 1, hq * tq, d)
    cfg = config or ta.default_config(hq * tq, b, ta._sm_count(dev))
    splits, _ = ta.plan_splits(hq * tq, n1 + n2, b, ta._sm_count(dev), cfg.block_m, cfg.block_n, cfg.min_keys)
    programs = -(-hq * tq // cfg.block_m) * splits * b
    tickets = ta.Tickets(dev)
    trace = torch.zeros(programs * ta.TRACE_SLOTS, dtype=torch.int64, device=dev)
    scale = d ** -0.5

    def call(traced: bool) -> torch.Tensor:
        return ta._split_attention_triton(qf, kp, vp, key_mask, scale, None, tq, cfg, tickets,
                                          trace=trace if traced else None)

    ref = call(False)
    assert torch.equal(call(True), ref), "the traced kernel must compute the same bits"
    truth = torch.softmax((q.float() @ torch.cat(kp, 2).float().transpose(-1, -2)) * scale, -1) @ torch.cat(vp, 2).float()
    rel = float((ref.transpose(1, 2).float() - truth).norm() / truth.norm())
    assert rel < 2e-2, f"{name} {cfg}: relative error {rel:.2e}"
    us = {"untraced": time_calls([lambda: call(False)] * calls, "cuda"), "traced": time_calls([lambda: call(True)] * calls, "cuda"),
          "calls": calls}
    # One traced call right behind a GEMM that fills the GPU, as in a denoise step.
    a = torch.randn(4096, 4096, device=dev, dtype=dt)
    graph = torch.cuda.CUDAGraph()
    torch.mm(a, a)  # cuBLAS's handle made outside the capture
    call(True)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        torch.mm(a, a)
        call(True)
    traces = []
    for _ in range(replays):
        graph.replay()
        torch.cuda.synchronize()
        traces.append(trace.view(programs, ta.TRACE_SLOTS).tolist())
    summary = summarize(traces)
    summary["config"] = {**cfg.__dict__, "splits": splits}
    return summary, us


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="expert b1", help=f"comma-separated, of {list(SHAPES)}")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--calls", type=int, default=20, help="calls per graph for the traced / untraced timing")
    ap.add_argument("--variants", default="default", help="see above")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    variants = parse_variants(args.variants)
    if not torch.cuda.is_available():
        raise SystemExit("attention_timeline_gpu.py needs a CUDA GPU (its clock reads are inline PTX)")
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "shapes": {}}
    for name in filter(None, (s.strip() for s in args.shapes.split(","))):
        for label, cfg in variants:
            try:
                summary, us = run_shape(name, args.replays, args.calls, cfg)
            except Exception as exc:  # a tiling this GPU refuses: said, and the next one runs
                print(f"{name}, {label}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}", flush=True)
                continue
            res["shapes"][f"{name}, {label}"] = {"summary": summary, "us": us}
            print(table(f"{name}, {label} ({summary['config']})", summary, us), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
