"""Which of several engine settings runs a chunk fastest (batch 1, or `--batch N`)? Engines alternated, one run.

Each variant is a cudagraph engine on the same seeded full-size PI0.5 (bf16, 3 cameras, 48 prompt
tokens, 10 steps), captured under its own setting of module knobs: the small-M GEMM tilings
(`triton_gemm.CONFIGS` entries, `triton_fold.RESIDUAL_CONFIG`) and the batch-1 norm fold
(`fused_stacks.set_fold_norms`). Their `run` calls are then alternated (A B C A B C ...) so that
clock and host drift fall on all alike. Prints p50 / p90 of the wall-clock chunk and the CUDA-event
stage times of each, each variant's ratio to the first, each chunk's error against eager float32
and its largest difference from the first variant's chunk.

A variant is `name` or `name:knob+knob+...`, variants separated by ';'. Knobs:
  unfolded                  the adaptive norms as kernels of their own (the fold off)
  early / no-early          the first flow step beside the prefix on / off (`CudaGraphEngine(early_step=)`,
                            on by default)
  early-max=N               ... up to batch N (`cudagraph.EARLY_STEP_MAX_BATCH`; from batch 8 a full
                            batch takes the unmasked graphs, a padded one the masked ones)
  early-guided              ... in exact RTC guidance too, the gradient taken beside the prefix
                            (`cudagraph.EARLY_STEP_GUIDED`)
  no-dense                  neither unmasked graph (`dense_prefix=False, dense_expert=False`): a full batch
                            from 8 then runs the masked ones, as a padded batch does
  plain-io                  the action projections as the model runs them (`set_fold_projections(False)`)
  unfused-vjp               exact guidance's QKV + RoPE and gate/up + GeGLU forward on cuBLAS and the
                            elementwise kernels (`triton_gemm.set_fused_vjp_forward(False)`; the default:
                            their fused small-M kernels)
  <class>=bm,bn,bk,warps,stages[,split]
                            that `triton_gemm.CONFIGS` entry (e.g. geglu/m64=64,32,128,4,3,2)
  residual=bm,bn,bk,warps,stages[,split]
                            `triton_fold.RESIDUAL_CONFIG` (o_proj / down with the fold)
  few=bm,bn,warps,stages,min_keys,inline,tma[,keys_as_rows]
                            `triton_attention.FEW_BLOCKS` (the batch-1 expert attention's tiling)
  mid=bm,bn,warps,stages,min_keys,inline,tma[,keys_as_rows]
                            `triton_attention.MID_BLOCKS` (the batch-1 prefix's attention tiling)
  big=bm,bn,warps,stages,min_keys,inline,tma[,keys_as_rows]
                            `triton_attention.BIG_BLOCKS` (the expert's from batch 24, the prefix's from 2)

    python benchmarks/engine_ab_gpu.py --variants "default;split qkv:qkv_rope/m64=64,16,128,4,4,2" --reps 150
    python benchmarks/engine_ab_gpu.py --rtc guided --variants "default;compact attention:few=16,64,8,2,128,1,0"

`--rtc MODE` runs every call with that Real-Time Chunking mode (`pi05_gpu.py`'s guidance: a seeded
target, a 5-step prefix over 25, weight 5), each variant's chunk judged against eager float32's in
the same mode.
    python benchmarks/engine_ab_gpu.py --tiny --device cpu --reps 2 --variants "a;b:unfolded"   # plumbing
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import parity_lerobot as par
from attention_timeline_gpu import split_config
from pi05_gpu import VALID_TOKENS, rtc_guidance, seeded_adapter, sync

# knob -> the `triton_attention` tiling it replaces
ATTENTION_TILINGS = {"few": "FEW_BLOCKS", "mid": "MID_BLOCKS", "big": "BIG_BLOCKS"}


@dataclass
class Variant:
    name: str
    fold: bool = True
    fold_io: bool = True
    configs: dict[str, Any] = field(default_factory=dict)  # CONFIGS key (or "residual") -> GemmConfig
    engine: dict[str, Any] = field(default_factory=dict)  # CudaGraphEngine options
    early_max: int | None = None  # cudagraph.EARLY_STEP_MAX_BATCH while the variant runs
    early_guided: bool | None = None  # cudagraph.EARLY_STEP_GUIDED while the variant runs
    fused_vjp: bool = True  # triton_gemm.set_fused_vjp_forward while the variant runs

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The knobs set, and put back after (they are read when the step is captured on a GPU, or
        at every call where nothing is captured)."""
        from phyai_edge.engines import cudagraph
        from phyai_edge.layers import triton_attention, triton_fold, triton_gemm
        from phyai_edge.layers.fused_stacks import set_fold_norms, set_fold_projections

        early_max_before, guided_before = cudagraph.EARLY_STEP_MAX_BATCH, cudagraph.EARLY_STEP_GUIDED
        if self.early_max is not None:
            cudagraph.EARLY_STEP_MAX_BATCH = self.early_max
        if self.early_guided is not None:
            cudagraph.EARLY_STEP_GUIDED = self.early_guided
        fold_before = set_fold_norms(self.fold)
        io_before = set_fold_projections(self.fold_io)
        saved = dict(triton_gemm.CONFIGS)
        vjp_before = triton_gemm.set_fused_vjp_forward(self.fused_vjp)
        residual_before = triton_fold.RESIDUAL_CONFIG
        tilings_before = {key: getattr(triton_attention, name) for key, name in ATTENTION_TILINGS.items()}
        try:
            for key, cfg in self.configs.items():
                if key in ATTENTION_TILINGS:
                    setattr(triton_attention, ATTENTION_TILINGS[key], cfg)
                elif key == "residual":
                    triton_fold.RESIDUAL_CONFIG = cfg
                else:
                    triton_gemm.CONFIGS[key] = cfg
            yield
        finally:
            cudagraph.EARLY_STEP_MAX_BATCH, cudagraph.EARLY_STEP_GUIDED = early_max_before, guided_before
            set_fold_norms(fold_before)
            set_fold_projections(io_before)
            triton_gemm.CONFIGS.clear()
            triton_gemm.CONFIGS.update(saved)
            triton_gemm.set_fused_vjp_forward(vjp_before)
            triton_fold.RESIDUAL_CONFIG = residual_before
            for key, cfg in tilings_before.items():
                setattr(triton_attention, ATTENTION_TILINGS[key], cfg)


def parse_variants(text: str) -> list[Variant]:
    from phyai_edge.layers.triton_gemm import CONFIGS, GemmConfig

    out = []
    for item in filter(None, (t.strip() for t in text.split(";"))):
        name, _, knobs = item.partition(":")
        v = Variant(name.strip())
        for knob in filter(None, (k.strip() for k in knobs.split("+"))):
            if knob in ("early", "no-early"):
                v.engine["early_step"] = knob == "early"
                continue
            if knob == "early-guided":
                v.early_guided = True
                continue
            if knob == "unfused-vjp":
                v.fused_vjp = False
                continue
            if knob == "no-dense":
                v.engine.update(dense_prefix=False, dense_expert=False)
                continue
            if knob in ("unfolded", "plain-io"):
                if knob == "unfolded":
                    v.fold = False
                else:
                    v.fold_io = False
                continue
            key, eq, spec = knob.partition("=")
            if key == "early-max" and eq:
                v.early_max = int(spec)
                continue
            if key in ATTENTION_TILINGS and eq:
                v.configs[key] = split_config(spec, knob)
                continue
            if not eq or (key != "residual" and key not in CONFIGS):
                raise SystemExit(f"--variants: unknown knob {knob!r} (unfolded, residual=..., or a CONFIGS key "
                                 f"such as geglu/m64=...)")
            fields = [int(x) for x in spec.split(",")]
            if len(fields) not in (5, 6):
                raise SystemExit(f"--variants: {knob!r} needs bm,bn,bk,warps,stages[,split]")
            v.configs[key] = GemmConfig(*fields)
        out.append(v)
    if len({v.name for v in out}) != len(out) or not out:
        raise SystemExit("--variants: give at least one variant, each with its own name")
    return out


def run_ab(variants: list[Variant], device: str, tiny: bool, reps: int, builtin: bool = False,
           rtc: str | None = None, batch: int = 1, valid: list[int] | None = None) -> dict[str, Any]:
    """Capture one engine per variant, alternate their calls `reps` times; every number returned.
    `valid`: each robot's valid prompt tokens (default VALID_TOKENS for every one)."""
    from phyai_edge.engines.cudagraph import CudaGraphEngine
    from phyai_edge.engines.eager import EagerEngine

    if builtin:
        from phyai_edge.adapters.pi05 import builtin_adapter

        adapter = builtin_adapter("tiny" if tiny else "full", device=device)
    else:
        adapter = seeded_adapter(device, tiny)
    cfg = adapter.cfg
    valid = valid or [VALID_TOKENS] * batch
    x = par.model_inputs(par.make_inputs(batch, 3, valid, device, seed=3, max_len=cfg.max_token_len,
                                         vocab=cfg.vocab_size))
    noise = torch.randn(batch, adapter.chunk_size, adapter.model_action_dim,
                        generator=torch.Generator().manual_seed(4)).to(device)
    opts = {} if device.startswith("cuda") else {"triton_ops": "triton", "triton_gemm": True}  # the interpreter
    guidance = rtc_guidance(adapter, batch, rtc) if rtc else None
    engines: dict[str, Any] = {}
    by_name = {v.name: v for v in variants}

    def run(name: str, nz: torch.Tensor | None) -> torch.Tensor:
        with by_name[name].active():
            return engines[name].run(x, noise=nz, rtc=guidance)

    for v in variants:
        engines[v.name] = CudaGraphEngine(copy.deepcopy(adapter), device=device, dtype="bfloat16", **opts, **v.engine)
        with v.active():
            engines[v.name].warmup(batch, 3, max(valid), modes=(rtc or "none",))
        run(v.name, noise)
    ref = EagerEngine(adapter, device=device, dtype="float32").run(x, noise=noise, rtc=guidance)
    chunks = {name: run(name, noise) for name in engines}
    walls: dict[str, list[float]] = {n: [] for n in engines}
    stages: dict[str, dict[str, list[float]]] = {n: {} for n in engines}
    for _ in range(3):  # warm
        for name in engines:
            run(name, noise)
    sync(device)
    timed_noise = None if builtin else noise
    for _ in range(reps):
        for name, eng in engines.items():
            t0 = time.perf_counter()
            run(name, timed_noise)
            sync(device)
            walls[name].append((time.perf_counter() - t0) * 1e3)
            for k, val in eng.last_stage_ms.items():
                stages[name].setdefault(k, []).append(val)

    def q(v: list[float], p: float) -> float:
        return sorted(v)[min(len(v) - 1, int(p * len(v)))]

    first = variants[0].name
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "reps": reps, "rtc": rtc, "batch": batch, "valid_tokens": valid,
                           "device": torch.cuda.get_device_name() if device.startswith("cuda") else device,
                           "engines": {}}
    for v in variants:
        name = v.name
        st = {k: statistics.median(val) for k, val in stages[name].items()}
        res["engines"][name] = {
            "configs": {k: (c.label() if hasattr(c, "label") else str(c)) for k, c in v.configs.items()}, "fold": v.fold, "fold_io": v.fold_io,
            "engine": v.engine,
            "p50": statistics.median(walls[name]), "p90": q(walls[name], 0.9), "stages_p50": st,
            "vs_eager_fp32": par.err(chunks[name], ref),
            "max_abs_vs_first": float((chunks[name] - chunks[first]).abs().max()),
        }
    base = res["engines"][first]
    for e in res["engines"].values():
        e["ratio_p50"] = e["p50"] / base["p50"]
        e["ratio_loop"] = e["stages_p50"].get("solver_loop", 0) / max(base["stages_p50"].get("solver_loop", 1e-9), 1e-9)
    return res


def table(res: dict[str, Any]) -> str:
    lines = ["| engine | chunk p50 ms | p90 | vision / prefix / loop p50 ms | step p50 ms | chunk / first | loop / first "
             "| vs eager fp32 max abs / scale | max abs vs first |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, e in res["engines"].items():
        st = e["stages_p50"]
        lines.append(f"| {name} | {e['p50']:.3f} | {e['p90']:.3f} | {st.get('embed_images', 0):.3f} / "
                     f"{st.get('encode_prefix', 0):.3f} / {st.get('solver_loop', 0):.3f} | "
                     f"{st.get('denoise_step', 0):.4f} | {e['ratio_p50']:.4f} | {e['ratio_loop']:.4f} | "
                     f"{e['vs_eager_fp32']['max_abs_over_scale']:.2e} | {e['max_abs_vs_first']:.3e} |")
    return "\n".join(lines)


def engine_args(doc: str | None, reps: int) -> argparse.ArgumentParser:
    """The arguments every engine A/B script takes (this one, `norm_fold_gpu.py`)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--reps", type=int, default=reps, help="calls of each engine, alternated")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--builtin", action="store_true",
                    help="the full preset as `phyai-edge bench` loads it (`builtin_adapter('full', device=)`), and "
                         "`run` drawing its own noise, instead of this script's seeded adapter and fixed noise")
    return ap


def write_json(res: dict[str, Any], path: Path | None) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=1, default=str))


def main(argv: list[str] | None = None) -> int:
    ap = engine_args(__doc__, reps=150)
    ap.add_argument("--variants", default="default;unfolded:unfolded", help="see above")
    ap.add_argument("--rtc", default=None, choices=("inpaint", "guided-approx", "guided"),
                    help="run every call with this RTC mode (default: none)")
    ap.add_argument("--batch", type=int, default=1, help="robots a call (the same inputs for each)")
    ap.add_argument("--valid-tokens", default=str(VALID_TOKENS),
                    help="valid prompt tokens of each robot, comma-separated and repeated over the batch "
                         f"(default {VALID_TOKENS}: no padding, so from batch 8 the unmasked graphs; e.g. 48,40 for "
                         "a padded batch on the masked ones)")
    args = ap.parse_args(argv)
    if args.batch < 1:
        ap.error("--batch: at least 1")
    try:
        lengths = [int(t) for t in args.valid_tokens.split(",")]
    except ValueError:
        ap.error(f"--valid-tokens: comma-separated integers, got {args.valid_tokens!r}")
    if not lengths or min(lengths) < 1:
        ap.error("--valid-tokens: each at least 1")
    valid = [lengths[i % len(lengths)] for i in range(args.batch)]
    res = run_ab(parse_variants(args.variants), args.device, args.tiny, args.reps, args.builtin, args.rtc, args.batch,
                 valid)
    print(table(res))
    write_json(res, args.json)
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
