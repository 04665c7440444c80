"""`phyai-edge eval`: replay recorded observations through an engine and compare actions."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from phyai_edge.commands.common import adapter_options, add_adapter_option_argument

HELP = "replay recorded observations through an engine and compare actions"
DESCRIPTION = """Replay a recorded observation set (`phyai-edge run --record DIR`, or a folder of
such recordings, one per episode) or a LeRobot dataset folder through an engine, and report per
episode the action error against the recorded actions and against a reference engine (another
backend, precision or bundle) given the same noise.

The model: a daemon recording names the one that made its chunks (checkpoint, engine bundle or
built-in preset, adapter options), and it is replayed through that one unless --checkpoint,
--preset, --engine, --adapter or --adapter-option choose another; how it runs (--backend,
--device, --dtype) is this command's (default eager, CPU, float32). A LeRobot dataset, and a
recording from before daemons said, take the tiny built-in model unless told otherwise.

Examples:
  phyai-edge eval runs/rec1                                    # the recording's model, eager, CPU
  phyai-edge eval runs/ --checkpoint ~/ckpt/pi05 --device cuda --engine engines/pi05-trt \\
      --reference-backend eager --reference-dtype float32       # optimised vs official path
  phyai-edge eval ~/datasets/aloha_sim --lerobot --checkpoint ~/ckpt/pi05_aloha --max-frames 100
  phyai-edge eval --synthetic /tmp/rec                          # write a synthetic recording, then eval it
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("data", help="recording folder (run --record), a folder of them, or a LeRobot dataset folder")
    p.add_argument("--lerobot", action="store_true", help="DATA is a LeRobot dataset folder")
    p.add_argument("--synthetic", action="store_true", help="first write a synthetic recording into DATA (2 episodes)")
    p.add_argument("--adapter", help="model adapter (default: the recording's, else pi05)")
    add_adapter_option_argument(p)
    p.add_argument("--checkpoint", help="checkpoint folder (LeRobot, openpi or native; default: the recording's)")
    p.add_argument("--preset", help="built-in size without a checkpoint (default: the recording's, else tiny)")
    p.add_argument("--engine", help="engine bundle folder to evaluate (overrides --backend)")
    p.add_argument("--backend", default="eager", help="eager | cudagraph | onnxruntime | tensorrt")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--reference-backend", help="compare against this backend on the same checkpoint")
    p.add_argument("--reference-engine", help="compare against this engine bundle")
    p.add_argument("--reference-dtype", help="precision of the reference (default: --dtype)")
    p.add_argument("--reference-device", help="device of the reference (default: --device)")
    p.add_argument("--batch", type=int, default=8, help="frames per engine call")
    p.add_argument("--batch-sizes", help="captured batch sizes to pad to, e.g. 1,2,4,8 (default: the sizes the "
                   "--engine / --reference-engine bundles were exported for, else any size)")
    p.add_argument("--seed", type=int, default=0,
                   help="noise seed (frame noise depends on seed, episode, frame); also the built-in preset's "
                        "weight seed when no --checkpoint is given")
    p.add_argument("--no-rtc", action="store_true", help="replay without the recorded RTC prefixes")
    p.add_argument("--max-guidance-weight", type=float, default=None,
                   help="RTC beta for recorded guided requests (default: the one the recording's daemon ran with)")
    p.add_argument("--camera-map", help="LeRobot: model camera=dataset column, comma separated")
    p.add_argument("--prompt", default="", help="LeRobot: prompt for every frame (default: the dataset's task)")
    p.add_argument("--episodes", help="LeRobot: episode indices, comma separated")
    p.add_argument("--max-frames", type=int, default=None, help="LeRobot: frames per episode at most")
    p.add_argument("--stride", type=int, default=1, help="LeRobot: evaluate every n-th frame")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _clean(x: Any) -> Any:
    """NaN (a metric with nothing to compare) -> null, so the JSON is standard."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def fixed_sizes(*policies: Any) -> list[int] | None:
    """The batch sizes every engine built for fixed sizes (an ONNX or TensorRT bundle) takes; None
    when none is. Both engines run the same padded calls, and a bundle run at a size it was not
    exported for fails every call (each then reruns one sample at a time, with a warning)."""
    common: set[int] | None = None
    for policy in policies:
        sizes = getattr(getattr(policy, "engine", None), "batch_sizes", None)
        if sizes:
            common = set(sizes) if common is None else common & set(sizes)
    return sorted(common) if common else None


def _the_recordings_model(args: argparse.Namespace, common: dict[str, Any]) -> None:
    """Point `common` (and `args.engine`) at the model the recording's daemon ran, saying so."""
    from phyai_edge.commands.common import fail
    from phyai_edge.engines.bundle import BundleError
    from phyai_edge.serve.evaluate import ModelsDifferError, recorded_model

    try:
        m = recorded_model(args.data)
    except ModelsDifferError as exc:
        fail("eval", str(exc))
    except (OSError, ValueError):
        return  # not a recording: reading it below says what is wrong, after the flags are checked
    if m is None:
        return
    if m.get("factory"):
        fail("eval", f"the recording's daemon built its policy with model.factory {m['factory']!r}, which eval cannot "
             "rebuild; choose the model with --checkpoint, --preset or --engine")
    for key, flag in (("checkpoint", "--checkpoint"), ("bundle", "--engine"), ("tokenizer", "--checkpoint")):
        if m.get(key) and not Path(m[key]).exists():
            fail("eval", f"the recording's model.{key} {m[key]} is not on this machine; give its copy with {flag}")
    common.update(adapter=m.get("adapter") or "pi05", checkpoint=m.get("checkpoint") or None,
                  preset=m.get("preset") or "tiny", adapter_options=dict(m.get("adapter_options") or {}))
    if m.get("tokenizer"):
        common["tokenizer"] = m["tokenizer"]
    # The daemon draws a built-in preset's weights from seed 0 (--seed picks eval's own noise).
    common["seed"] = 0
    if m.get("bundle"):
        args.engine = m["bundle"]
    what = (f"engine bundle {m['bundle']}" if m.get("bundle") else f"checkpoint {m['checkpoint']}"
            if m.get("checkpoint") else f"built-in preset {common['preset']} (weights from seed 0, as the daemon's)")
    options = ", ".join(f"{k}={v}" for k, v in common["adapter_options"].items())
    ran = f"{m.get('backend')} {m.get('precision') or m.get('dtype')}"
    replay = f"{args.backend} {args.dtype}"
    if args.engine:
        try:
            said = _precision(args.engine, args.dtype)
            replay = f"the bundle ({said.get('precision') or said['dtype']})"
        except BundleError:
            replay = "the bundle"  # loading it says what is wrong with it
    print(f"phyai-edge eval: the model the recording's daemon ran: {what}" + (f", adapter options {options}" if options
          else "") + f" (it ran {ran} on {m.get('device')}; this replay: {replay} on {args.device})", file=sys.stderr)


def _wants_reference(args: argparse.Namespace) -> bool:
    return bool(args.reference_backend or args.reference_engine or args.reference_dtype or args.reference_device)


def _exported_from(bundle: str) -> str | None:
    """The weights `bundle` was exported from (its manifest's checkpoint source: a folder, or a
    built-in preset and seed); None where the manifest cannot say (loading the bundle says why)."""
    from phyai_edge.engines.bundle import BundleError, read_manifest

    try:
        return str(read_manifest(bundle)["checkpoint"].get("source", ""))
    except (BundleError, KeyError, TypeError):
        return None


def _the_bundles_model(bundle: str, common: dict[str, Any]) -> None:
    """Point `common` at the weights `bundle` was exported from, so an engine compared with it
    runs the same model."""
    from phyai_edge.commands.common import fail
    from phyai_edge.engines.bundle import parse_builtin_source

    source = _exported_from(bundle)
    if source is None:
        return
    if (built := parse_builtin_source(source)) is not None:
        common.update(preset=built[0], seed=built[1])
    elif Path(source).is_dir():
        common["checkpoint"] = source
    else:
        fail("eval", f"the engine bundle {bundle} was exported from {source or 'a checkpoint it does not name'}, "
             "which is not on this machine; give its copy with --checkpoint, so the other engine runs the same weights")


def _precision(bundle: str | None, dtype: str) -> dict[str, str]:
    """An engine's dtype for the report, and a bundle's quantised weights ("int8", "fp8"): a bundle
    runs its manifest's, whatever --dtype says (an int8 bundle's report said float32)."""
    if not bundle:
        return {"dtype": dtype}
    from phyai_edge.engines.bundle import bundle_precision, read_manifest

    manifest = read_manifest(bundle)  # it loaded, so it reads
    precision = bundle_precision(manifest)
    return {"dtype": str(manifest.get("dtype", dtype)), **({"precision": precision} if precision else {})}


def _check_the_bundles_preset(bundle: str, common: dict[str, Any]) -> None:
    """`fail` where --preset / --seed name other weights than the preset `bundle` was exported
    from: the engine compared with it would run another model (its differences read as the
    engines')."""
    from phyai_edge.commands.common import fail
    from phyai_edge.engines.bundle import parse_builtin_source

    built = parse_builtin_source(_exported_from(bundle) or "")
    if built is not None and built != (common["preset"], common["seed"]):
        fail("eval", f"--preset {common['preset']} --seed {common['seed']}: the engine bundle {bundle} was exported "
             f"from the preset {built[0]} at seed {built[1]}, so the engine compared with it would run other weights; "
             "leave --preset out (it then loads the bundle's)")


def main(args: argparse.Namespace) -> int:
    from phyai_edge.commands.common import check_at_least, fail, load_policy_or_fail
    from phyai_edge.serve.evaluate import (
        evaluate,
        format_eval,
        read_lerobot,
        read_recording,
        write_synthetic_recording,
    )

    if not 0 <= args.seed < 2**31:
        fail("eval", f"--seed {args.seed}: expected 0 to {2**31 - 1}")
    # --batch 0 evaluated no frame and reported a perfect score.
    check_at_least("eval", ("--batch", args.batch, 1), ("--max-frames", args.max_frames, 1), ("--stride", args.stride, 1))
    if not args.lerobot:
        # Frame selection is the LeRobot reader's; a recording is evaluated whole, and these were
        # accepted and ignored there (the whole recording ran where 3 frames were asked for).
        given = [flag for flag, on in (("--episodes", args.episodes), ("--max-frames", args.max_frames is not None),
                                       ("--stride", args.stride != 1)) if on]
        if given:
            fail("eval", f"{', '.join(given)}: select frames of a LeRobot dataset (--lerobot) only; a recording "
                 "is evaluated whole")
    try:
        sizes = [int(x) for x in args.batch_sizes.split(",")] if args.batch_sizes else None
    except ValueError:
        fail("eval", f"--batch-sizes {args.batch_sizes!r}: expected sizes like 1,2,4,8")
    if sizes is not None and (not sizes or min(sizes) < 1):
        fail("eval", f"--batch-sizes {args.batch_sizes!r}: every size must be at least 1")
    common = {"adapter": args.adapter or "pi05", "checkpoint": args.checkpoint, "preset": args.preset or "tiny",
              "seed": args.seed, "adapter_options": adapter_options("eval", args)}
    chosen = args.checkpoint or args.preset or args.engine or args.adapter or args.adapter_option
    if not (args.lerobot or args.synthetic or chosen):
        _the_recordings_model(args, common)
    bundle = args.engine or args.reference_engine
    one_side_loads_weights = not args.engine or (_wants_reference(args) and not args.reference_engine)
    if bundle and one_side_loads_weights:
        if not (args.checkpoint or args.preset or common["checkpoint"]):
            # The side that is no bundle loads the weights the bundle was exported from, not the preset.
            _the_bundles_model(bundle, common)
        elif args.preset:
            _check_the_bundles_preset(bundle, common)  # (a checkpoint given is checked against its hash)
    policy = load_policy_or_fail("eval", backend=args.backend, device=args.device, dtype=args.dtype,
                                 bundle=args.engine, **common)
    reference = None
    if _wants_reference(args):
        device_flag = "--reference-device" if args.reference_device else "--device"
        reference = load_policy_or_fail("eval", device_flag, backend=args.reference_backend or "eager",
                                        device=args.reference_device or args.device,
                                        dtype=args.reference_dtype or args.dtype, bundle=args.reference_engine, **common)
    if bundle and one_side_loads_weights:
        # ... and runs the bundle's flow steps (an export --steps 3 was compared with 10 steps).
        from phyai_edge.adapters.base import SolverSpec

        bundled = policy if args.engine else reference
        assert bundled is not None  # a bundle is one of the two
        steps = bundled.adapter.solver.num_steps
        for side, its_bundle in ((policy, args.engine), (reference, args.reference_engine)):
            if side is not None and not its_bundle:
                side.adapter.solver = SolverSpec(steps)
    if args.synthetic:
        write_synthetic_recording(args.data, camera_names=policy.camera_names, state_dim=policy.state_dim,
                                  action_dim=policy.action_dim, horizon=policy.chunk_size, seed=args.seed)
    try:
        if args.lerobot:
            cmap = dict(kv.split("=", 1) for kv in args.camera_map.split(",")) if args.camera_map else None
            eps = [int(x) for x in args.episodes.split(",")] if args.episodes else None
            episodes = read_lerobot(args.data, policy.chunk_size, cmap, args.prompt, eps, args.max_frames, args.stride)
        else:
            episodes = read_recording(args.data, use_rtc=not args.no_rtc, max_guidance_weight=args.max_guidance_weight)
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"phyai-edge eval: {exc}", file=sys.stderr)
        return 2
    if not any(ep.frames for ep in episodes):
        # Exit 0 would read as "every frame passed" for a run that compared nothing.
        where = "check --episodes, --max-frames, --stride" if args.lerobot else \
            "every record is unreadable or its inference failed"
        print(f"phyai-edge eval: no frames to evaluate in {args.data} ({where})", file=sys.stderr)
        return 2
    fixed = fixed_sizes(policy, reference)
    if sizes and fixed and set(sizes) - set(fixed):
        # Every call at such a size fails, and each of its frames then fails alone, padded to it again.
        fail("eval", f"--batch-sizes {args.batch_sizes}: the engine bundle takes batch sizes "
             f"{', '.join(map(str, fixed))} only; leave --batch-sizes out to use those")
    sizes = sizes or fixed
    try:
        rep = evaluate(policy, episodes, reference, batch=args.batch, seed=args.seed, batch_sizes=sizes)
    except ValueError as exc:
        print(f"phyai-edge eval: {exc}", file=sys.stderr)
        return 2
    rep["policy"] = {"backend": getattr(policy.engine, "backend", args.backend), "device": args.device,
                     **_precision(args.engine, args.dtype), "engine": args.engine}
    if reference is not None:
        rep["reference"] = {"backend": getattr(reference.engine, "backend", ""), "engine": args.reference_engine,
                            **_precision(args.reference_engine, args.reference_dtype or args.dtype)}
    if args.json:
        print(json.dumps(_clean(rep), indent=2))
    else:
        print(format_eval(rep))
        if reference is None:
            print("(no reference engine given: --reference-backend / --reference-engine compare two engines "
                  "on the same noise)")
    return 1 if rep["overall"]["failures"] else 0
