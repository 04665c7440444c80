"""`phyai-edge run`: the real-time control daemon (see phyai_edge/control/daemon.py, docs/daemon.md)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from phyai_edge.control.log import LOG_LEVELS

# `--record` keeps this much of its disk free: a robot computer whose disk fills loses its journal,
# and every other service on it its writes (a recording with three 720p cameras is ~1 GB a minute).
DEFAULT_RECORD_MIN_FREE_GB = 2.0

HELP = "the real-time control daemon (fixed-period loop, RTC, ZeroMQ actions)"
DESCRIPTION = """Run a policy on a robot: a fixed-period loop publishes one action per tick over
ZeroMQ (docs/protocol.md) while inference runs asynchronously with Real-Time Chunking.
With no --config it runs an embedded default (the tiny PI0.5, a synthetic camera and state,
tcp://127.0.0.1:5555), so it works on a fresh machine; watch it with `phyai-edge listen`.

Examples:
  phyai-edge run --duration 10
  phyai-edge run --print-default-config > robot.toml
  phyai-edge run --check-config robot.toml
  phyai-edge run --preflight robot.toml          # on the robot: cameras, state, sockets, real time
  phyai-edge run --config robot.toml --record runs/calib-01
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    # One thing to do: each of these names its own file (a --config beside --check-config was
    # ignored while the other file was checked and called valid).
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--config", metavar="FILE", help="daemon configuration (TOML); default: the embedded one")
    mode.add_argument("--print-default-config", action="store_true",
                      help="print the embedded default configuration and exit")
    mode.add_argument("--check-config", metavar="FILE",
                   help="validate a configuration file, also against the policy's cameras, chunk and dims (read "
                        "without its weights), and exit (0: valid, 2: not)")
    mode.add_argument("--preflight", metavar="FILE",
                   help="open what a configuration names (cameras, state stream, sockets, real-time limits, model "
                        "files, GPU) for --duration seconds (default 3) without loading the policy, print a check "
                        "per item and exit (0: ready, 1: warnings, 2: a failure)")
    p.add_argument("--duration", type=float, default=None,
                   help="stop by itself after this many seconds (default, or 0: run until SIGINT / SIGTERM)")
    p.add_argument("--record", metavar="DIR", help="save every inference's observation and chunk to DIR")
    p.add_argument("--record-min-free-gb", type=float, default=DEFAULT_RECORD_MIN_FREE_GB, metavar="GB",
                   help="with --record: skip records (counted, logged) while DIR's disk has less than this free, so "
                        f"a long recording cannot fill the robot computer's disk (default {DEFAULT_RECORD_MIN_FREE_GB:g}; "
                        "0: no floor)")
    p.add_argument("--no-realtime", action="store_true", help="skip SCHED_FIFO, CPU affinity and mlockall")
    p.add_argument("--summary", metavar="FILE", help="write the run's timing summary as JSON ('-': stdout)")
    p.add_argument("--log-level", default=os.environ.get("PHYAI_EDGE_LOG_LEVEL", "info"),
                   choices=LOG_LEVELS,
                   help="lowest level logged (default: $PHYAI_EDGE_LOG_LEVEL, else info)")


def startup_budget_s(cfg: Any) -> float:
    """The longest start-up the daemon's own limits allow: loading the policy and every warm-up
    inference (each RTC mode's in a solver mode) may each take `model.load_timeout_s` (first calls
    compile Triton kernels and capture CUDA graphs), plus a minute for cameras, state and sockets."""
    from phyai_edge.control.daemon import warmup_inferences_per_round, warmup_rounds

    per_round = warmup_inferences_per_round(cfg.chunking.mode)
    return cfg.model.load_timeout_s * (1 + warmup_rounds(cfg) * per_round) + 60.0


def _preflight(args: argparse.Namespace) -> int:
    from phyai_edge.commands.common import check_writable, write_json
    from phyai_edge.control.config import ConfigError, load_config
    from phyai_edge.control.preflight import exit_code, format_checks, run_preflight

    try:
        cfg = load_config(args.preflight)
    except ConfigError as exc:
        print(f"{args.preflight}: invalid: {exc}", file=sys.stderr)
        return 2
    check_writable("run", "--summary", args.summary)
    seconds = args.duration if args.duration else 3.0
    print(f"{args.preflight}: opening cameras and state for {seconds:g} s ...", file=sys.stderr)
    checks = run_preflight(cfg, seconds)
    print(format_checks(checks), file=sys.stderr if args.summary == "-" else sys.stdout)
    code = exit_code(checks)
    print({0: "ready", 1: "ready, with warnings", 2: "not ready"}[code], file=sys.stderr)
    if args.summary:
        write_json([c.__dict__ for c in checks], args.summary)
    return code


def model_problem(cfg: Any) -> str | None:
    """What the policy's shape says of `cfg`, read without its weights (the adapter built on torch's
    meta device, in well under a second, where the daemon's start would load and warm it up first):
    an unknown adapter, preset or option, a checkpoint or tokenizer that is not there, a camera view
    the policy lacks, a horizon longer than its chunk, dims that differ, an instruction or prompt
    room longer than the model takes. None where it fits, and for
    a model not built from the config (a factory; a bundle, whose manifest `load_config` checks)."""
    import copy

    from phyai_edge.adapters import ADAPTERS, load_adapter
    from phyai_edge.commands.common import LOAD_ERRORS
    from phyai_edge.control.config import ConfigError, check_against_policy, named_instructions

    m = cfg.model
    if m.factory or m.bundle:
        return None
    # The keys a load error is most likely about, checked first so the message names the key.
    if m.adapter not in ADAPTERS:
        return f"model.adapter: unknown adapter {m.adapter!r}; available: {', '.join(sorted(ADAPTERS))}"
    if m.checkpoint and not Path(m.checkpoint).is_dir():
        return f"model.checkpoint: {m.checkpoint!r} is not a folder (the policy's checkpoint folder)"
    try:
        ad = load_adapter(m.adapter, dict(m.adapter_options) or None, checkpoint=m.checkpoint or None,
                          preset_name=m.preset, device="meta", tokenizer=m.tokenizer or None)
    except LOAD_ERRORS as exc:
        return f"{_load_error_key(m, exc, load_adapter)}: {exc}"
    try:
        check_against_policy(copy.deepcopy(cfg), ad.chunk_size, ad.action_dim, ad.state_dim, list(ad.camera_names))
    except ConfigError as exc:
        return str(exc)
    # What start-up checks again against the warmed-up engine's room; the model's own limit is
    # known here already (a 10^8-token room passed the check and failed the start).
    most = getattr(ad, "max_prompt_tokens", None)
    if most is None:
        return None
    if cfg.task.endpoint and cfg.task.prompt_tokens > most:
        return f"task.prompt_tokens: {cfg.task.prompt_tokens} is more than the policy takes ({most})"
    longest = getattr(ad, "longest_prompt_tokens", None)
    for key, prompt in named_instructions(cfg) if longest is not None else ():
        try:
            tokens = int(longest(prompt))
        except ValueError as exc:
            return f"{key}: {exc}"
        if tokens > most:
            return (f"{key}: takes up to {tokens} prompt tokens with some robot states; the model takes at most "
                    f"{most}: shorten it")
    return None


def _load_error_key(m: Any, exc: BaseException, load_adapter: Any) -> str:
    """The config key a failed adapter build is about: the options where the same build without
    them works (one more build on the meta device, on this failure path only), else the tokenizer
    or checkpoint the error names, else the preset."""
    from phyai_edge.commands.common import LOAD_ERRORS

    if m.adapter_options:
        try:
            load_adapter(m.adapter, None, checkpoint=m.checkpoint or None, preset_name=m.preset, device="meta",
                         tokenizer=m.tokenizer or None)
        except LOAD_ERRORS:
            pass
        else:
            return "model.adapter_options"
    if m.tokenizer and "tokenizer" in str(exc):
        return "model.tokenizer"
    return "model.checkpoint" if m.checkpoint else "model.preset"


def main(args: argparse.Namespace) -> int:
    from phyai_edge.commands.common import check_finite, check_seconds
    from phyai_edge.control.config import DEFAULT_CONFIG_TOML, ConfigError, load_config

    check_seconds("run", "--duration", args.duration)
    check_finite("run", ("--record-min-free-gb", args.record_min_free_gb, 0, "GB"), hint="0: no floor")

    if args.print_default_config:
        sys.stdout.write(DEFAULT_CONFIG_TOML)
        return 0
    if args.check_config:
        try:
            cfg = load_config(args.check_config)
        except ConfigError as exc:
            print(f"{args.check_config}: invalid: {exc}", file=sys.stderr)
            return 2
        problem = model_problem(cfg)
        if problem is not None:
            print(f"{args.check_config}: invalid: {problem}", file=sys.stderr)
            return 2
        cams = ", ".join(f"{c.name} ({c.source})" for c in cfg.cameras.values()) or "none"
        m = cfg.model
        # A factory builds the policy itself (e.g. RemotePolicy): adapter and preset are not used.
        model = f"factory {m.factory}" if m.factory else f"{m.adapter} {m.bundle or m.checkpoint or m.preset}"
        print(f"{args.check_config}: valid. {cfg.robot.control_hz:g} Hz, cameras: {cams}, state: {cfg.state.source}, "
              f"model: {model}, "
              f"RTC {cfg.chunking.mode}, publish {cfg.publish.endpoint}"
              + (f", instructions at {cfg.task.endpoint}" if cfg.task.endpoint else ""))
        return 0

    from phyai_edge.control.log import setup_logging

    # argparse checks a given --log-level against its choices, never the default taken from the
    # environment: an unknown one crashed the start with a traceback (exit 1, restarted by systemd).
    if args.log_level.lower() not in LOG_LEVELS:
        print(f"phyai-edge run: PHYAI_EDGE_LOG_LEVEL={args.log_level!r}: expected one of {', '.join(LOG_LEVELS)}",
              file=sys.stderr)
        return 2
    # `--summary -` writes its JSON on stdout: the log then goes to stderr, so the JSON can be piped.
    setup_logging(getattr(logging, args.log_level.upper()), to_stderr=args.summary == "-")
    if args.preflight:
        return _preflight(args)
    log = logging.getLogger("phyai_edge.control")
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        log.error("configuration: %s", exc)
        return 2
    log.info("configuration: %s", cfg.source)
    from phyai_edge.commands.common import check_writable, write_json

    # before the model loads: a summary refused at the end of a run is the run's record lost
    check_writable("run", "--summary", args.summary)
    check_writable("run", "--record", args.record, folder=True)

    from phyai_edge.control.daemon import Daemon, StartupInterruptedError
    from phyai_edge.control.notify import Notifier

    notifier = Notifier()
    # Under systemd a full-size start-up (load, Triton compiles, graph capture) can outlast the
    # unit's TimeoutStartSec=; extend it to what `model.load_timeout_s` allows, so the daemon's
    # own limits (which say what timed out) are the ones that end a start-up that hangs.
    budget = startup_budget_s(cfg)
    notifier.extend_timeout(budget, f"starting: loading and warming up the policy (limit {budget:.0f} s)")
    daemon = Daemon(cfg, record_dir=args.record, record_min_free_gb=args.record_min_free_gb,
                    realtime=not args.no_realtime, notifier=notifier)
    daemon.install_signal_handlers()
    try:
        daemon.setup()
    except StartupInterruptedError:
        log.info("stopped during start-up")
        daemon.shutdown()
        return 0
    except ConfigError as exc:
        log.error("configuration: %s", exc)
        daemon.shutdown()
        return 2
    except Exception as exc:
        log.error("start-up failed: %s", exc)
        daemon.shutdown()
        return 1
    daemon.run(duration_s=args.duration)
    summary = daemon.summary()
    lat = summary["lateness_ms"]
    log.info(
        "stopped: %d ticks, lateness p50 %.3f p99 %.3f max %.3f ms, %d missed slots, %d inferences (%d failed), holds %s",
        summary["ticks"], lat["p50"], lat["p99"], lat["max"], summary["missed_slots"], summary["inferences"],
        summary["failures"], summary["holds"],
    )
    late = summary["late_ticks"]
    if late["count"]:
        log.warning("%d tick(s) published over %g ms late; the worst, tick %d, %.2f ms (see the log lines above)",
                    late["count"], late["limit_ms"], late["worst_tick"], late["worst_ms"])
    if args.summary:
        write_json(summary, args.summary)
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is closed and flushed; skip the interpreter's teardown so that the process is
    # gone within a control period of SIGTERM (systemd's stop, a supervisor's restart).
    os._exit(0)
