"""`phyai-edge sim`: a simulated ALOHA robot process for the daemon (see phyai_edge/sim, docs/sim.md)."""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
import zipfile
from pathlib import Path

from phyai_edge.commands.common import check_at_least, check_seconds, check_writable, fail, write_json
from phyai_edge.control.log import LOG_LEVELS, setup_logging
from phyai_edge.extras import install_hint

HELP = "a simulated ALOHA robot process that talks to the daemon over ZeroMQ"
DESCRIPTION = """Run gym-aloha's MuJoCo ALOHA arm pair as a robot with its own 50 Hz clock: it
publishes joint state and camera frames over ZeroMQ (docs/protocol.md) and applies the daemon's
newest action every step, holding its last target on HOLD. Endpoints, rates and cameras come
from the daemon's config, so both sides read the same file. Needs the `sim` extra.

SIGUSR1 stops the camera stream, SIGUSR2 restarts it; Ctrl-C ends the run.

Examples:
  phyai-edge sim --config adapters/pi05_aloha.toml --log run.npz
  phyai-edge sim --config adapters/pi05_aloha.toml --duration 20 --camera-outage 8:2 --log run.npz
  phyai-edge sim --report run.npz --plot run.png --roofline-json loop.json --metrics-file metrics.txt
"""


def _outage(text: str) -> tuple[float, float]:
    try:
        start, length = (float(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected START:LENGTH in seconds, got {text!r}") from None
    # float() takes "nan" and "inf": the loop then died on its first step, turning them into ns.
    if not (math.isfinite(start) and math.isfinite(length) and start >= 0 and length > 0):
        raise argparse.ArgumentTypeError(f"expected finite START >= 0 and LENGTH > 0, got {text!r}")
    return start, length


def _size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WxH like 640x480, got {text!r}") from None
    if w < 1 or h < 1:  # 0x240 published empty frames without a word
        raise argparse.ArgumentTypeError(f"expected a width and height >= 1, got {text!r}")
    return w, h


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="the daemon's TOML (endpoints, control rate, zmq cameras); "
                   "default: adapters/pi05_aloha.toml's endpoints")
    p.add_argument("--task", default="transfer_cube", choices=["transfer_cube", "insertion"],
                   help="gym-aloha task: the scene and objects")
    p.add_argument("--seed", type=int, default=0, help="object placement (gym-aloha's sampler)")
    p.add_argument("--duration", type=float, default=0.0, help="seconds to run; 0: until Ctrl-C")
    p.add_argument("--render-every", type=int, default=None,
                   help="render every camera every N control steps (default: control rate / each camera's fps)")
    p.add_argument("--size", type=_size, default=None, metavar="WxH",
                   help="override every camera's image size, e.g. 320x240")
    p.add_argument("--shadows", action="store_true", help="render shadows and reflections (slow on a CPU)")
    p.add_argument("--samples", type=int, default=0, help="offscreen multisampling (0: off)")
    p.add_argument("--camera-outage", type=_outage, action="append", default=[], metavar="START:LENGTH",
                   help="stop the camera stream for LENGTH s at START s (repeatable)")
    p.add_argument("--log", metavar="NPZ", help="save every step, action and frame to this file (kept in memory "
                   "until exit: roughly 3 MB per minute)")
    p.add_argument("--summary", metavar="FILE", help="write the run's summary as JSON ('-': stdout)")
    p.add_argument("--report-every", type=float, default=5.0, help="seconds between status lines (0: off)")
    rep = p.add_argument_group("report (analyse a saved --log instead of running)")
    rep.add_argument("--report", metavar="NPZ", help="analyse a log: sequence, latency, camera age, HOLDs; "
                     "prints the analysis as JSON (or writes it to --summary FILE)")
    rep.add_argument("--plot", metavar="PNG", help="joint trajectories and timing as a chart")
    rep.add_argument("--roofline-json", metavar="FILE", help="stage times for `phyai-edge roofline --bench`")
    rep.add_argument("--metrics-file", metavar="TXT", help="the daemon's /metrics text, for inference times")
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                   help="lowest level logged")


# gym-aloha seeds numpy's legacy generator, which takes 0 .. 2**32 - 1.
MAX_SEED = 2**32 - 1


def main(args: argparse.Namespace) -> int:
    check_seconds("sim", "--duration", args.duration)
    # Each of these ran with a traceback from deep inside (a modulo by zero, the GL context), or
    # silently (a negative --render-every rendered every step, a negative --report-every logged
    # every step, a zero --render-every without --config was ignored).
    check_at_least("sim", ("--render-every", args.render_every, 1), ("--samples", args.samples, 0),
                   ("--seed", args.seed, 0), ("--report-every", args.report_every, 0))
    if args.seed > MAX_SEED:
        fail("sim", f"--seed {args.seed}: expected an integer <= {MAX_SEED} (gym-aloha's sampler)")
    # A path that cannot be written failed after the run (or the analysis), with a traceback and
    # nothing saved: refuse it before anything runs.
    for flag, path in (("--log", args.log), ("--summary", args.summary), ("--plot", args.plot),
                       ("--roofline-json", args.roofline_json)):
        check_writable("sim", flag, path)
    # As the daemon logs, on stderr: stdout carries `--summary -`'s JSON.
    setup_logging(getattr(logging, args.log_level.upper()), to_stderr=True)
    log = logging.getLogger("phyai_edge.sim")
    if args.report:
        from phyai_edge.sim.report import analyse, load_log, plot_run, roofline_bench

        if not Path(args.report).is_file():
            print(f"phyai-edge sim: --report {args.report}: no such file (a run's --log .npz)", file=sys.stderr)
            return 2
        try:
            run = load_log(args.report)
        except (OSError, ValueError, KeyError, zipfile.BadZipFile):
            # numpy's own message for a file that is no .npz at all speaks of pickles.
            fail("sim", f"--report {args.report}: not a run's log (the .npz `phyai-edge sim --log` saves)")
        try:
            metrics = Path(args.metrics_file).read_text() if args.metrics_file else None
        except OSError as exc:
            fail("sim", f"--metrics-file {args.metrics_file}: cannot read it ({exc.strerror or exc})")
        result = analyse(run, metrics)
        write_json(result, args.summary or "-")
        if args.plot:
            plot_run(run, result, args.plot)
            log.info("plot: %s", args.plot)
        if args.roofline_json:
            write_json(roofline_bench(result), args.roofline_json)
            log.info("roofline input: %s (phyai-edge roofline --bench %s)", args.roofline_json, args.roofline_json)
        return 0

    # Headless by default: EGL needs no X server and no extra system packages. Must be set
    # before mujoco is imported; a user's own MUJOCO_GL (osmesa, glfw) wins.
    os.environ.setdefault("MUJOCO_GL", "egl")
    try:
        import gym_aloha  # noqa: F401
        import mujoco  # noqa: F401
    except ImportError as exc:
        log.error("the simulator needs the `sim` extra: %s (%s)", install_hint("mujoco"), exc)
        return 2

    from phyai_edge.control.config import load_config
    from phyai_edge.sim.aloha import RenderSettings
    from phyai_edge.sim.robot import CameraStream, SimRobot, SimSettings, settings_from_config

    render = RenderSettings(shadows=args.shadows, reflections=args.shadows, samples=args.samples)
    common = {"task": args.task, "seed": args.seed, "duration_s": args.duration, "render": render,
              "report_every_s": args.report_every, "camera_outages": args.camera_outage}
    if args.config:
        try:
            cfg = load_config(args.config)
            settings = settings_from_config(cfg, **common)
        except ValueError as exc:  # ConfigError is one
            log.error("configuration: %s", exc)
            return 2
    else:
        settings = SimSettings(cameras=[CameraStream("top", "top", "tcp://127.0.0.1:5560")], **common)
    if args.render_every is not None:
        settings.render_every = args.render_every
        for cam in settings.cameras:
            cam.every = 0  # one rate for every camera, as asked
    if args.size:
        for cam in settings.cameras:
            cam.width, cam.height = args.size

    try:
        robot = SimRobot(settings, log_data=bool(args.log))
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    # Before the render timing (seconds with several cameras): a Ctrl-C there was a traceback.
    robot.install_signal_handlers()
    for cam in settings.cameras:
        ms = robot.sim.time_render(cam.mujoco_camera, cam.width, cam.height) * 1e3
        log.info("camera %s: %dx%d on %s, %.1f ms per frame (MUJOCO_GL=%s, shadows %s, %d samples)",
                 cam.name, cam.width, cam.height, cam.endpoint, ms, os.environ.get("MUJOCO_GL"),
                 "on" if render.shadows else "off", render.samples)
    try:
        robot.open()
    except Exception as exc:
        log.error("cannot open the sockets: %s", exc)
        robot.close()
        return 1
    started = time.monotonic()
    failure = ""
    try:
        summary = robot.run()
    except Exception as exc:
        # The loop died: what it logged up to then is what explains it, so --log still keeps it.
        log.exception("the simulation loop failed")
        failure = f"{type(exc).__name__}: {exc}"
        summary = robot.summary(robot.steps, time.monotonic() - started)
    finally:
        robot.close()
    log.info(
        "stopped: %d steps at %.2f Hz (%d late), %d actions received, %d applied, %d HOLD, "
        "%d seq gaps (%d lost), %d repeats, %d frames",
        summary["steps"], summary["rate_hz"], summary["late_steps"], summary["received"], summary["applied"],
        summary["hold_messages"], summary["seq_gaps"], summary["seq_lost"], summary["seq_repeats"], summary["frames"],
    )
    if args.log:
        meta = {"task": settings.task, "control_hz": settings.control_hz, "render_every": settings.render_every,
                "cameras": [c.__dict__ for c in settings.cameras], "config": args.config or "",
                "camera_max_age_ms": settings.camera_max_age_ms, "summary": summary, "error": failure,
                # Timings on a shared 2-core machine mean little without the load they ran under.
                "cpus": os.cpu_count(), "loadavg_end": list(os.getloadavg())}
        robot.log.save(args.log, meta)
        log.info("log: %s", args.log)
    if args.summary:
        write_json(summary, args.summary)
    sys.stdout.flush()
    return 1 if failure else 0
