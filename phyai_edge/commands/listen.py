"""`phyai-edge listen`: subscribe to a daemon's actions and report rate, gaps and latency."""

from __future__ import annotations

import argparse
import signal
import sys
import time

HELP = "subscribe to a daemon's actions and report rate, gaps and latency"
DESCRIPTION = """Subscribe to a `phyai-edge run` action stream (docs/protocol.md) and print, once a
second, the message rate, sequence gaps and repeats, publish-to-receive latency and flag counts.

Examples:
  phyai-edge listen                                   # tcp://127.0.0.1:5555, topic "action"
  phyai-edge listen --endpoint ipc:///run/phyai-edge/actions --duration 60 --json summary.json
  phyai-edge listen --print                           # one line per action
  phyai-edge listen --record actions.npz              # every header and payload
  phyai-edge listen --duration 10 --json - | jq .rate_hz   # the summary alone on stdout

Exit status: 0 when messages arrived, 1 when none did (a silent stream), 2 for a usage error.
"""


SILENT_HINT_S = 5.0  # no message for this long: say what to check, once


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", default="tcp://127.0.0.1:5555", help="the daemon's publish endpoint")
    p.add_argument("--topic", default="action", help="action topic (publish.topic)")
    p.add_argument("--chunk-topic", default="",
                   help="also count whole-chunk messages on this topic, e.g. chunk (publish.chunk_topic); default: none")
    p.add_argument("--duration", type=float, default=None,
                   help="stop after this many seconds (default, or 0: at Ctrl-C, or when the daemon sends SHUTDOWN)")
    p.add_argument("--count", type=int, default=None,
                   help="stop after this many actions (default: at Ctrl-C, or when the daemon sends SHUTDOWN)")
    p.add_argument("--print", dest="print_each", action="store_true", help="print every action")
    p.add_argument("--wall", action="store_true", help="latency from CLOCK_REALTIME (other host, PTP-synced)")
    p.add_argument("--json", dest="json_path",
                   help="write the final summary as JSON to this file ('-': stdout, the per-second lines then on stderr)")
    p.add_argument("--record", help="save every received header and payload to this .npz file: one entry per "
                   "message in the header arrays (session, seq, kind, ...); actions holds the kind-1 payloads in "
                   "order, chunk_rows the kind-2 rows one message after another (rows says how many each)")
    p.add_argument("--quiet", action="store_true", help="no per-second lines")
    p.add_argument("--priority", type=int, default=0,
                   help="SCHED_FIFO priority for this process, as a real-time controller would run (0: off)")


def main(args: argparse.Namespace) -> int:
    from phyai_edge.commands.common import check_at_least, check_seconds, fail

    check_seconds("listen", "--duration", args.duration)
    # --count 0 never stopped and no longer stopped at SHUTDOWN; --count -1 stopped at the first
    # message; a negative --priority left the listener unprioritised without a word.
    check_at_least("listen", ("--count", args.count, 1), ("--priority", args.priority, 0))
    if args.print_each and args.json_path == "-":
        fail("listen", "--print and --json - both write to stdout: give --json a file")
    import numpy as np

    from phyai_edge.control.listener import Listener
    from phyai_edge.control.protocol import KIND_ACTION, Flag

    if args.priority:
        from phyai_edge.control.clock import setup_realtime

        for line in setup_realtime(args.priority, (), False):
            print(line.replace("clock thread", "listener"), file=sys.stderr)
    from phyai_edge.commands.common import check_writable, json_text

    check_writable("listen", "--json", args.json_path)
    check_writable("listen", "--record", args.record)
    try:
        lis = Listener(args.endpoint, args.topic, args.chunk_topic, args.wall,
                       keep=bool(args.record or args.print_each), priority=args.priority)
    except Exception as exc:  # zmq.ZMQError: an endpoint ZeroMQ cannot parse
        fail("listen", f"--endpoint {args.endpoint!r}: {exc} (expected tcp://host:port or ipc://path)")
    started = time.monotonic()
    said_silent = False
    stop = False

    def on_signal(signum, frame):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    import gc

    gc.collect()
    gc.freeze()  # no full collection over start-up objects in the middle of measuring
    t_end = time.monotonic() + args.duration if args.duration else None
    # With the summary on stdout, the per-second lines go to stderr: stdout stays one JSON object.
    lines_to = sys.stderr if args.json_path == "-" else sys.stdout
    next_report = time.monotonic() + 1.0
    last_count, printed = 0, 0
    while not stop:
        lis.poll(0.1)
        st = lis.stats
        if args.print_each:
            for h, v in lis.messages[printed:]:
                names = [f.name for f in Flag if h.flags & f]
                instr = f" instruction {h.instruction}" if h.instruction else ""
                if h.kind != KIND_ACTION:
                    # Its seq is the CHUNK_START action's: printed as an action it read as a repeat.
                    print(f"chunk {h.chunk_id}@{h.index}: {h.rows} rows from seq {h.seq}{instr}")
                    continue
                print(f"seq {h.seq} chunk {h.chunk_id}@{h.index}{instr} flags {'|'.join(names) or '-'} "
                      f"{np.array2string(v[0], precision=3, max_line_width=1 << 20)}")
            printed = len(lis.messages)
            if not args.record:
                # Kept only to be printed: a listener left running for hours grew without bound.
                lis.messages.clear()
                printed = 0
        now = time.monotonic()
        if not st.received and not said_silent and now - started >= SILENT_HINT_S:
            print(f"no message from {args.endpoint} in {SILENT_HINT_S:g} s (topic {args.topic!r}): is the daemon "
                  f"running, and is this its publish.endpoint?", file=sys.stderr, flush=True)
            said_silent = True
        if now >= next_report and not args.quiet:
            rate = st.received - last_count
            lat = st.latency_ns.recent(rate).astype(np.float64) / 1e3
            p99 = f"{np.percentile(lat, 99):.0f}" if lat.size else "-"
            p50 = f"{np.percentile(lat, 50):.0f}" if lat.size else "-"
            print(f"{rate} msg/s  seq {st.last_seq}  gaps {st.gaps}  repeats {st.repeats}  latency p50 {p50} us p99 {p99} us  "
                  f"holds {st.flags.get('HOLD', 0)}", file=lines_to, flush=True)
            last_count = st.received
            next_report = now + 1.0
        if (t_end and now >= t_end) or (args.count and st.received >= args.count):
            break
        if st.flags.get("SHUTDOWN") and args.count is None and not args.duration:
            break  # the daemon said goodbye (--duration 0 means no limit, as leaving it out does)
    summary = lis.stats.summary()
    lis.close()
    if args.record:
        msgs = lis.messages
        actions = [v[0] for h, v in msgs if h.kind == KIND_ACTION]
        chunk_rows = [v for h, v in msgs if h.kind != KIND_ACTION]
        dim = msgs[0][1].shape[1] if msgs else 0
        np.savez(
            args.record,
            # A restarted daemon's seq starts again at 0: without its session a restart read as repeats.
            session=np.array([h.session for h, _ in msgs], dtype=np.uint32),
            seq=np.array([h.seq for h, _ in msgs], dtype=np.uint64),
            kind=np.array([h.kind for h, _ in msgs], dtype=np.uint16),
            flags=np.array([h.flags for h, _ in msgs], dtype=np.uint32),
            chunk_id=np.array([h.chunk_id for h, _ in msgs], dtype=np.uint32),
            index=np.array([h.index for h, _ in msgs], dtype=np.uint16),
            instruction=np.array([h.instruction for h, _ in msgs], dtype=np.uint32),
            publish_mono_ns=np.array([h.publish_mono_ns for h, _ in msgs], dtype=np.int64),
            obs_mono_ns=np.array([h.obs_mono_ns for h, _ in msgs], dtype=np.int64),
            rows=np.array([h.rows for h, _ in msgs], dtype=np.uint16),
            actions=np.array(actions, dtype=np.float32) if actions else np.zeros((0, dim), np.float32),
            chunk_rows=np.concatenate(chunk_rows).astype(np.float32) if chunk_rows else np.zeros((0, dim), np.float32),
        )
    text = json_text(summary)
    if args.json_path == "-":
        print(text)
    elif args.json_path:
        with open(args.json_path, "w") as f:
            f.write(text + "\n")  # a text file ends in one, as write_json's do
    if not args.quiet and args.json_path != "-":
        print(text, file=sys.stderr)
    if not lis.stats.received:
        # A script or health check must tell a dead stream from a healthy one by the status alone.
        print(f"phyai-edge listen: no message arrived from {args.endpoint} (topic {args.topic!r})", file=sys.stderr)
        return 1
    return 0
