"""A task planner's side of docs/protocol.md section 4 in plain pyzmq (no phyai_edge import):
set the instruction a running daemon follows ([task] endpoint), or ask which one runs.

    python examples/task_client_pyzmq.py tcp://127.0.0.1:5557 "put the cup in the sink"
    python examples/task_client_pyzmq.py tcp://127.0.0.1:5557          # which instruction runs
    python examples/task_client_pyzmq.py tcp://127.0.0.1:5557 --hold   # an operator's hold
    python examples/task_client_pyzmq.py tcp://127.0.0.1:5557 "wipe the table" --release
"""

import json
import sys

import zmq

args = sys.argv[1:]
endpoint = args.pop(0) if args else "tcp://127.0.0.1:5557"
request = {"version": 1}
for flag, hold in (("--hold", True), ("--release", False)):
    if flag in args:
        args.remove(flag)
        request["hold"] = hold
if args:
    request["prompt"] = args[0]

sock = zmq.Context().socket(zmq.REQ)
sock.setsockopt(zmq.LINGER, 0)
sock.connect(endpoint)
sock.send(json.dumps(request).encode("utf-8"))
# The daemon answers after its worker has counted the instruction's tokens, which waits for the
# inference in flight: give it seconds. A REQ socket that got no reply cannot send again.
if not sock.poll(10_000):
    raise SystemExit(f"no answer from {endpoint}")
reply = json.loads(sock.recv().decode("utf-8"))
if reply["ok"]:
    # tokens and room are 0 where the daemon did not count (a query, a hold) or cannot.
    size = f"; {reply['tokens']} of {reply['room']} tokens" if reply.get("room") else ""
    held = ", held" if reply.get("holding") else ""
    print(f"running: {reply['prompt']!r} ({reply['changes']} change(s){size}{held})")
else:
    raise SystemExit(f"refused: {reply['error']} (still running {reply['prompt']!r})")
