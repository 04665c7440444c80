"""`phyai-edge task`: set or show the instruction a running daemon's policy follows."""

from __future__ import annotations

import argparse
import json
import sys

HELP = "set or show the instruction (prompt) a running daemon's policy follows"
DESCRIPTION = """Send a new instruction to a running `phyai-edge run` (its [task] endpoint), or show the
one it runs. The daemon answers after checking that the instruction fits the prompt room the
policy was warmed up with; the next chunk runs it (started at once, joined to the executing
chunk by RTC). Exit status: 0 taken (or shown), 1 refused, 2 no answer or a bad argument.

Examples:
  phyai-edge task                                            # which instruction runs
  phyai-edge task "put the cup in the sink"                  # tcp://127.0.0.1:5557
  phyai-edge task --endpoint ipc:///run/phyai-edge/task "fold the towel" --json -
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", default=None, help="the instruction to run; left out: show the current one")
    p.add_argument("--endpoint", default="tcp://127.0.0.1:5557", help="the daemon's task.endpoint")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the daemon's answer")
    p.add_argument("--json", dest="json_path", help="write the daemon's reply as JSON to this file ('-': stdout)")


def main(args: argparse.Namespace) -> int:
    from phyai_edge.control.task import request_instruction

    if args.timeout <= 0:
        print(f"phyai-edge task: --timeout must be positive, got {args.timeout:g}", file=sys.stderr)
        return 2
    try:
        reply = request_instruction(args.endpoint, args.prompt, args.timeout)
    except (TimeoutError, ValueError) as exc:
        print(f"phyai-edge task: {exc}", file=sys.stderr)
        return 2
    if args.json_path:
        body = json.dumps(reply.__dict__, indent=2)
        if args.json_path == "-":
            print(body)
        else:
            with open(args.json_path, "w") as f:
                f.write(body + "\n")
    if not reply.ok:
        print(f"refused: {reply.error}\nstill running: {reply.prompt!r}", file=sys.stderr)
        return 1
    if args.json_path != "-":
        fit = f" ({reply.tokens} of {reply.room} prompt tokens)" if reply.tokens and reply.room else ""
        what = "running" if args.prompt is None else "taken"
        print(f"{what}: {reply.prompt!r}{fit}; {reply.changes} change(s) since start-up")
    return 0
