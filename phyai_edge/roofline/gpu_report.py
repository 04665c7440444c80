"""Converter: the report `benchmarks/pi05_gpu.py` writes (e.g. `benchmarks/runs/pi05_gpu_*.json`)
-> runs in the bench-JSON schema that `sources.parse_bench` reads.

That report is not one run but many, grouped by section, each entry keyed `b<batch>_v<views>` or
`b<batch>_<variant>` and holding whole-chunk `p50` / `p90` / `min` (ms, wall clock per
`engine.run`) and, for our engines, per-stage CUDA-event medians under `stages_p50`:

    {"device": "NVIDIA H200", "command": "benchmarks/pi05_gpu.py ...",
     "lerobot":  {"b1_v3": {"p50": ..., "p90": ..., "min": ...}, ...},          # LeRobot eager
     "ours":     {"b1_v3": {"p50": ..., "stages_p50": {"embed_images": ...}}},  # cudagraph
     "rtc":      {"b1_inpaint": {...}, ...},                                    # cudagraph + RTC
     "ablation": {"b1_compiled": {...}, "b1_graphs_only": {...}, "b1_ours_eager_bf16": {...}},
     "floors":   {"b1_v3": {"denoise_step": {"gflop": ...}, ...}}}

What the conversion fills in, and from where (no timing is invented):
  * adapter / preset / views: pi05 / full / the adapter's views unless the key says `_v<views>` (the script times full-size PI0.5), checked against the report's
    own `floors` GFLOP counts: vision must match our count for that preset.
  * precision: bf16 (every timed section of pi05_gpu.py runs bfloat16).
  * prompt tokens: the engines that trim prompt padding (`ours`, `rtc`, `ablation.*_compiled`) run
    the valid tokens only; that count is not a field of the report, so it is solved from `floors`
    (one denoise step's GFLOP is affine in the prompt length; the integer that reproduces it
    exactly). Untrimmed runs (LeRobot, graphs-only, eager) keep the padded length (left unset).
  * stages: `stages_p50` as p50; the whole-chunk wall clock as `engine` (p50 / p90 / min), and the
    wall clock minus the stages' sum (host-side prompt-bucket check, graph launches, final sync)
    as `preprocess`, so that L is the measured wall clock. Entries with only the whole chunk
    (LeRobot) are booked as inference by the reader.

Select entries with `FILE#key[,key...]` on the command line (`ablation.b1_compiled` or a bare
`b1_compiled` when unambiguous); the selection's order is the points' order, and the first one on
a known GPU calibrates the predictions.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

SECTIONS = ("ours", "ablation", "rtc", "lerobot", "triton", "fp8")
# Engine-variant sections (`pi05_gpu.py --triton-only / --fp8-only`) key their entries by the
# variant first: "triton+compile_b1" is the variant "triton+compile" at batch 1 (3 views).
VARIANT_SECTIONS = {"triton": "ours graphs + {variant}", "fp8": "ours graphs + fp8 {variant}"}

# (section, variant regex) -> (description, backend, prompt trimmed). First match wins.
_KINDS: tuple[tuple[str, str, str, str, bool], ...] = (
    ("lerobot", r"", "LeRobot eager", "lerobot-eager", False),
    ("ours", r"", "ours graphs", "cudagraph", True),
    ("rtc", r"(?P<mode>.+)", "ours graphs + RTC {mode}", "cudagraph", True),
    ("ablation", r"compiled", "ours graphs+compile", "cudagraph+compile", True),
    ("ablation", r"graphs_only", "graphs only (no trim/tables/fusion)", "cudagraph-plain", False),
    ("ablation", r"ours_eager.*", "ours eager", "eager", False),
)
_KEY_RE = re.compile(r"^b(?P<batch>\d+)(?:_v(?P<views>\d+))?(?:_(?P<variant>.+))?$")
_VARIANT_KEY_RE = re.compile(r"^(?P<variant>.+)_b(?P<batch>\d+)$")


def _parse_key(section: str, key: str) -> re.Match[str] | None:
    """batch, views (or None) and variant of an entry's key, or None for a key that is no entry."""
    return (_VARIANT_KEY_RE if section in VARIANT_SECTIONS else _KEY_RE).match(key)
ADAPTER, PRESET, PRECISION = "pi05", "full", "bf16"


def is_gpu_report(data: Any) -> bool:
    """True for a pi05_gpu.py report: no "stages", and a section of timed entries."""
    if not isinstance(data, Mapping) or "stages" in data or "runs" in data or "results" in data:
        return False
    return any(
        isinstance(data.get(s), Mapping)
        and any(isinstance(e, Mapping) and "p50" in e for e in data[s].values())
        for s in SECTIONS
    )


def _kind(section: str, variant: str) -> tuple[str, str, bool]:
    if section in VARIANT_SECTIONS:  # every variant there trims the prompt, as the engine does by default
        return VARIANT_SECTIONS[section].format(variant=variant), "cudagraph+" + variant.replace(" ", "-"), True
    for sec, pattern, desc, backend, trimmed in _KINDS:
        m = re.fullmatch(pattern, variant) if sec == section else None
        if m:
            return desc.format(**m.groupdict()), backend, trimmed
    return f"{section} {variant}".strip(), section, False


def _short_device(name: str) -> str:
    return re.sub(r"^nvidia\s+", "", name.strip(), flags=re.IGNORECASE)


def solve_prompt_tokens(report: Mapping[str, Any], notes: list[str]) -> int | None:
    """The prompt length the report's floors were counted with, from one denoise step's GFLOP
    (our cost model reproduces pi05_gpu.py's count exactly at the right length). None, with a
    note, when no floors entry matches the full preset."""
    from phyai_edge.roofline.costs import cost_model

    cm = cost_model(ADAPTER)
    config = cm.load_config(PRESET)
    floors = report.get("floors")
    if not isinstance(floors, Mapping):
        notes.append("report has no floors: prompt tokens unknown, the padded length is used")
        return None
    for key, fl in floors.items():
        km = _KEY_RE.match(str(key))
        try:
            vision = float(fl["embed_images"]["gflop"]) * 1e9
            step = float(fl["denoise_step"]["gflop"]) * 1e9
        except (KeyError, TypeError, ValueError):
            continue
        batch = int(km["batch"]) if km else 1
        views = int(km["views"]) if km and km["views"] else None

        def costs(p: int, batch: int = batch, views: int | None = views) -> Any:
            return cm.stage_costs(
                config,
                batch=batch,
                views=views or cm.defaults(config)["views"],
                prompt_tokens=p,
                steps=1,
                precision=PRECISION,
            )

        if abs(costs(0)["embed_images"].flops / vision - 1) > 1e-6:
            notes.append(
                f"floors {key}: vision GFLOP does not match PI0.5 {PRESET}: prompt tokens not solved"
            )
            return None
        # Affine in p: solve from two points, then check the integer exactly.
        f0, f1 = costs(0)["denoise_step"].flops, costs(1)["denoise_step"].flops
        p = round((step - f0) / (f1 - f0))
        if 0 <= p <= config.max_token_len and abs(costs(p)["denoise_step"].flops / step - 1) < 1e-9:
            return p
        notes.append(f"floors {key}: no prompt length reproduces the denoise GFLOP; padded length used")
        return None
    notes.append("report floors carry no GFLOP counts: prompt tokens unknown, padded length used")
    return None


def entries(report: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """`section.key` -> the timed entry, in file order."""
    out: dict[str, Mapping[str, Any]] = {}
    for section in SECTIONS:
        sec = report.get(section)
        if not isinstance(sec, Mapping):
            continue
        for key, e in sec.items():
            if isinstance(e, Mapping) and isinstance(e.get("p50"), (int, float)) and _parse_key(section, key):
                out[f"{section}.{key}"] = e
    return out


def resolve(report: Mapping[str, Any], select: Sequence[str] | None) -> list[str]:
    """Selected `section.key` names (bare keys allowed when unique); all entries when None."""
    avail = list(entries(report))
    if not select:
        return avail
    out = []
    for want in select:
        want = want.strip()
        hits = [k for k in avail if k == want] or [k for k in avail if k.split(".", 1)[1] == want]
        if len(hits) != 1:
            why = "is ambiguous" if hits else "is not in the report"
            raise ValueError(f"selection {want!r} {why}; entries: {', '.join(avail)}")
        out.append(hits[0])
    return out


def to_bench_runs(report: Mapping[str, Any], select: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """The report's timed entries (all, or `select`ed) as bench-schema runs."""
    names = resolve(report, select)
    table = entries(report)
    notes: list[str] = []
    prompt = solve_prompt_tokens(report, notes)
    device = str(report.get("device") or "")
    from phyai_edge.roofline.costs import cost_model

    cm = cost_model(ADAPTER)
    default_views = cm.defaults(cm.load_config(PRESET))["views"]  # what the script runs unkeyed
    runs = []
    for name in names:
        section, key = name.split(".", 1)
        e = table[name]
        km = _parse_key(section, key)
        assert km is not None  # entries() only keeps matching keys
        desc, backend, trimmed = _kind(section, km["variant"] or "")
        batch, views = int(km["batch"]), int(km.groupdict().get("views") or default_views)
        whole = {f"{s}_ms": e[s] for s in ("p50", "p90", "min") if isinstance(e.get(s), (int, float))}
        stages: dict[str, Any] = {"engine": whole}
        run_notes = list(notes)
        per_stage = e.get("stages_p50")
        if isinstance(per_stage, Mapping):
            for s, v in per_stage.items():
                stages[s] = {"p50_ms": v}
            step = per_stage.get("denoise_step")
            n_steps = None
            if isinstance(step, (int, float)) and step > 0 and per_stage.get("solver_loop"):
                n_steps = round(per_stage["solver_loop"] / step)
            loop = per_stage.get("solver_loop") or 0.0
            gap = e["p50"] - per_stage.get("embed_images", 0.0) - per_stage.get("encode_prefix", 0.0) - loop
            if gap > 0:
                stages["preprocess"] = {"p50_ms": gap}
                run_notes.append(
                    f"host side of engine.run (wall clock p50 minus the stages' CUDA-event p50s) "
                    f"{gap:.2f} ms booked as preprocess"
                )
        else:
            n_steps = None
        shape = f"b{batch} {views}v"
        run: dict[str, Any] = {
            "label": f"{_short_device(device) or 'GPU'} {desc} {shape} (measured)",
            "key": name,
            "source": "pi05_gpu.py report",
            "adapter": ADAPTER,
            "preset": PRESET,
            "backend": backend,
            "device": device or None,
            "dtype": PRECISION,
            "batch": batch,
            "views": views,
            "steps": n_steps,
            "prompt_tokens": prompt if trimmed else None,
            "stages": stages,
            "notes": run_notes,
        }
        runs.append({k: v for k, v in run.items() if v is not None})
    return runs
