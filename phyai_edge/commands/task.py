"""`phyai-edge task`: set or show the instruction a running daemon's policy follows."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from phyai_edge.commands.common import check_positive, check_writable, fail, write_json
from phyai_edge.control.protocol import KIND_ACTION

MAX_TIMEOUT_S = 3600.0  # a daemon answers in milliseconds; an hour is any real wait

HELP = "set or show the instruction (prompt) a running daemon's policy follows"
DESCRIPTION = """Send a new instruction to a running `phyai-edge run` (its [task] endpoint), or show the
one it runs. The daemon answers after checking that the instruction fits the prompt room the
policy was warmed up with; the next chunk runs it (started at once, joined to the executing
chunk by RTC). Exit status: 0 taken (or shown), 1 refused, 2 no answer or a bad argument, 3 taken
but (with --wait) no action computed with it came within --timeout.

With --wait it also subscribes to the daemon's actions (--actions, its publish.endpoint) before
asking, and returns once the first action of a chunk computed with the new instruction is published
(the header's `instruction` field, docs/protocol.md): when the robot began on it.

--hold holds the robot (the daemon publishes HOLD | PAUSED and runs no inference, its engine
staying warm) until --release, which may come with the instruction to resume on.

Examples:
  phyai-edge task                                            # which instruction runs
  phyai-edge task --hold                                     # pause the robot
  phyai-edge task "wipe the table" --release                 # resume on a new instruction
  phyai-edge task "put the cup in the sink"                  # tcp://127.0.0.1:5557
  phyai-edge task "put the cup in the sink" --wait           # ... and wait until the robot acts on it
  phyai-edge task --endpoint ipc:///run/phyai-edge/task "fold the towel" --json -
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", default=None, help="the instruction to run; left out: show the current one")
    p.add_argument("--endpoint", default="tcp://127.0.0.1:5557", help="the daemon's task.endpoint")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the daemon's answer")
    p.add_argument("--json", dest="json_path", help="write the daemon's reply as JSON to this file ('-': stdout)")
    pause = p.add_mutually_exclusive_group()
    pause.add_argument("--hold", dest="hold", action="store_const", const=True, default=None,
                       help="hold the robot: HOLD | PAUSED, no inference, until --release")
    pause.add_argument("--release", dest="hold", action="store_const", const=False,
                       help="release a hold (with PROMPT: resume on that instruction)")
    p.add_argument("--wait", action="store_true",
                   help="after the instruction is taken, wait (up to --timeout) for its first published action")
    p.add_argument("--actions", default="tcp://127.0.0.1:5555", help="--wait: the daemon's publish.endpoint")
    p.add_argument("--topic", default="action", help="--wait: the daemon's publish.topic")


def main(args: argparse.Namespace) -> int:
    import zmq

    from phyai_edge.control.task import request_instruction

    # argparse's float takes "inf" and "nan": ZeroMQ's poll then raised a traceback (exit 1, read as
    # "refused") or a line about converting NaN.
    check_positive("task", ("--timeout", args.timeout))
    if args.timeout > MAX_TIMEOUT_S:  # 1e30 s overflowed ZeroMQ's poll in milliseconds: a traceback
        fail("task", f"--timeout {args.timeout:g}: expected at most {MAX_TIMEOUT_S:g} seconds")
    # Checked before asking: a reply that cannot be written was a traceback after the daemon took it.
    check_writable("task", "--json", args.json_path)
    if args.wait and args.hold:
        print("phyai-edge task: --wait waits for an action, and --hold stops them", file=sys.stderr)
        return 2
    if args.wait and args.prompt is None:
        # It waits for an instruction's first action; without one it would return at once, as if seen.
        print("phyai-edge task: --wait waits for an instruction's first action: give the instruction", file=sys.stderr)
        return 2
    listener = None
    try:
        if args.wait and args.prompt is not None:
            from phyai_edge.control.listener import Listener

            # Subscribed before asking: on a fast GPU the takeover follows the reply within a tick or two.
            try:
                listener = Listener(args.actions, args.topic, keep=True)
            except zmq.ZMQError as exc:
                raise ValueError(f"--actions {args.actions!r}: {exc}") from None
            time.sleep(SUBSCRIBE_S)
        # With --wait, what ran before: an instruction already running has no takeover to wait for.
        before = request_instruction(args.endpoint, None, args.timeout) if listener is not None else None
        reply = request_instruction(args.endpoint, args.prompt, args.timeout, hold=args.hold)
        replied = time.monotonic()
        _report(args, reply)
        if not reply.ok:
            return 1
        if listener is not None and before is not None and reply.changes != before.changes:
            seq, at = _wait_for_takeover(listener, args.actions, args.topic, reply.changes, args.timeout)
            if args.json_path != "-":
                print(f"the robot began on it at action seq {seq}, {(at - replied) * 1e3:.0f} ms after the reply")
    except NoTakeoverError as exc:
        print(f"phyai-edge task: {exc}", file=sys.stderr)
        return 3
    except (TimeoutError, ValueError) as exc:
        print(f"phyai-edge task: {exc}", file=sys.stderr)
        return 2
    finally:
        if listener is not None:
            listener.close()
    return 0


def _report(args: argparse.Namespace, reply: Any) -> None:
    if args.json_path:
        write_json(json.loads(reply.encode()), args.json_path)  # the reply as the daemon sent it, version included
    if not reply.ok:
        print(f"refused: {reply.error}\nstill running: {reply.prompt!r}", file=sys.stderr)
    elif args.json_path != "-":
        fit = f" ({reply.tokens} of {reply.room} prompt tokens)" if reply.tokens and reply.room else ""
        what = "running" if args.prompt is None else "taken"
        held = "; the robot is held (HOLD | PAUSED) until --release" if reply.holding else ""
        print(f"{what}: {reply.prompt!r}{fit}; {reply.changes} change(s) since start-up{held}")


SUBSCRIBE_S = 0.3  # a SUB socket's subscription takes a moment to reach the publisher


class NoTakeoverError(TimeoutError):
    """The instruction was taken, but no action computed with it was published in time."""


def _wait_for_takeover(listener: Any, endpoint: str, topic: str, instruction: int, timeout_s: float) -> tuple[int, float]:
    """(seq, local receive time) of the first action computed with `instruction` (it carries
    CHUNK_START). TimeoutError if none comes within `timeout_s`."""
    end = time.monotonic() + timeout_s
    seen = 0
    while time.monotonic() < end:
        listener.poll(0.05)
        for header, _ in listener.messages[seen:]:
            if header.kind == KIND_ACTION and header.instruction == instruction:
                return header.seq, time.monotonic()
        seen = len(listener.messages)
    raise NoTakeoverError(f"instruction {instruction} was taken, but no action computed with it arrived on {endpoint} "
                       f"(topic {topic!r}) within {timeout_s:g} s: is --actions the daemon's publish.endpoint? "
                       "is the daemon holding (stale inputs, e-stop)?")
