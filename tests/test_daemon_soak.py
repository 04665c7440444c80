"""A randomized fault-injection soak of the control daemon (phyai_edge/control/daemon.py).

On a seeded schedule over a few seconds, faults come and go while a listener keeps every
message: the state stream stops and resumes, its e-stop bit flips, a required camera and an
optional one go silent, an operator holds and releases through the task channel (and sends new
instructions), the clock thread stalls for whole periods, and the policy returns NaN or Inf
chunks, chunks of the wrong width, too few rows or the wrong batch shape, raises, runs past the
horizon, or aims far outside the position limits. Every message is checked against what the
injected sources really gave the daemon (protocol.md section 1, docs/daemon.md "One tick"):

- `seq` runs 0, 1, 2, ... in one session, and the last message is the only HOLD | SHUTDOWN;
- no payload (either topic) is non-finite or of the wrong width, and the guard never had to act
  (NONFINITE): bad chunks are refused before they run;
- STALE / ESTOP / PAUSED are set on exactly the ticks whose inputs said so. A tick reads its
  inputs after the previous message went out and before its own does, so a condition that
  held over that whole window must be flagged, one that held nowhere in it must not; the one
  tick that straddles a change may go either way (the detection bound: one tick);
- a flagged message is a HOLD, and a HOLD carries no chunk; every policy action comes from a
  chunk that passed (finite, the robot's width, H rows), whose inference a tick after the last
  held one started (a hold drops the executing chunk and what is in flight; the chunk's inputs
  may be older than that tick, each within its age limit);
- payloads stay within `robot.limits` (positions, and the rate from one message to the next),
  and a HOLD repeats the last action (`safety.hold = "last"`);
- a tick after a stall of three periods carries LATE; instruction counts never go back;
- the daemon acts again once faults clear: every stretch without a fault longer than
  `RECOVERY_S` holds a policy action, and so does the end of the run.

Three seeds run in CI (~3 s each); `PHYAI_SOAK_SEEDS=0-29` runs others (a hunt for rare
interleavings), `PHYAI_SOAK_S` makes each run's fault phase longer.
"""

from __future__ import annotations

import math
import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from test_control_daemon import Running

from phyai_edge.control.cameras import Frame
from phyai_edge.control.daemon import Daemon
from phyai_edge.control.fakes import FakePolicy, free_tcp_endpoint, test_config
from phyai_edge.control.protocol import Flag
from phyai_edge.control.state import StateSample
from phyai_edge.control.task import request_instruction

PERIOD_S = 0.02  # 50 Hz
H = 20  # the fake policy's chunk: a slow inference (SLOW_S) runs past it
SLOW_S = 0.5
STATE_MAX_AGE_S = 0.06
CAMERA_MAX_AGE_S = 0.08
LIMIT = 1.0  # |action| <= LIMIT
MAX_RATE = 3.0  # units per second: the fake's sinusoid moves at most ~1.6
RECOVERY_S = 0.8  # a fault-free stretch this long must see a policy action
FAULT_PHASE_S = float(os.environ.get("PHYAI_SOAK_S", "2.5"))
POLICY_MODES = ("nan", "inf", "wide", "short", "batch", "raise", "slow", "wild")
BLOCKING = Flag.STALE | Flag.ESTOP | Flag.PAUSED


def _seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


SEEDS = _seeds(os.environ.get("PHYAI_SOAK_SEEDS", "0-2"))


# ---------------------------------------------------------------- what held, and when


@dataclass
class Span:
    """One stretch of a condition: it began within [on_lo, on_hi] and ended within [off_lo, off_hi]
    (monotonic seconds; inf while it lasts)."""

    on_lo: float
    on_hi: float
    off_lo: float = math.inf
    off_hi: float = math.inf


class Condition:
    """A reason to hold as the daemon could read it, recorded by the fault's own source."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.spans: list[Span] = []
        self.active = False

    def begin(self, lo: float, hi: float | None = None) -> None:
        if not self.active:
            self.spans.append(Span(lo, lo if hi is None else hi))
            self.active = True

    def end(self, lo: float, hi: float | None = None) -> None:
        if self.active:
            span = self.spans[-1]
            span.off_lo, span.off_hi = lo, lo if hi is None else hi
            self.active = False
            if span.on_lo >= span.off_hi:  # a stream back before it went stale: nothing held
                self.spans.pop()

    def must(self, a: float, b: float) -> bool:
        """Held for the whole of (a, b): a tick reading its inputs in that window sees it."""
        return any(a >= s.on_hi and b <= s.off_lo for s in self.spans)

    def may(self, a: float, b: float) -> bool:
        """Held at some instant of (a, b)."""
        return any(s.on_lo < b and a < s.off_hi for s in self.spans)


class AllOf:
    """Every one of some conditions (every camera optional and every one silent)."""

    def __init__(self, *conds: Condition) -> None:
        self.conds = conds
        self.spans = [s for c in conds for s in c.spans]  # for the fault-free stretches

    def must(self, a: float, b: float) -> bool:
        return all(c.must(a, b) for c in self.conds)

    def may(self, a: float, b: float) -> bool:
        return all(c.may(a, b) for c in self.conds)


class SoakState:
    """Robot state read at the instant the daemon asks (its age is then exactly what the daemon
    computes), which can stop, carry the e-stop bit, or stall the clock thread that reads it."""

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.lock = threading.Lock()
        self.alive = True
        self.estop = False
        self.stale = Condition("state")
        self.estop_seen = Condition("estop")
        self.stall_s = 0.0
        self.reads = 0  # latest() calls: the daemon reads once a tick, so read k is the tick of seq k
        self.stalled_reads: list[int] = []
        self._last: StateSample | None = None

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def describe(self) -> str:
        return "soak state"

    def latest(self) -> StateSample | None:
        read, self.reads = self.reads, self.reads + 1
        stall, self.stall_s = self.stall_s, 0.0
        if stall:
            self.stalled_reads.append(read)
            time.sleep(stall)  # the clock thread itself is held: the next tick wakes periods late
        with self.lock:
            if self.alive:
                t = time.monotonic()
                values = (0.3 * np.sin(0.4 * t + np.arange(self.dim))).astype(np.float32)
                self._last = StateSample(values, t, read, self.estop)
            return self._last

    def freeze(self) -> None:
        with self.lock:
            self.alive = False
            onset = -math.inf if self._last is None else self._last.time_s + STATE_MAX_AGE_S
            self.stale.begin(onset)
            # A bit flipped since the last read never reached the daemon: the last sample's stays.
            self._estop_seen(time.monotonic(), self._last is not None and self._last.estop)

    def resume(self) -> None:
        with self.lock:
            t = time.monotonic()
            self.alive = True
            self.stale.end(t)
            self._estop_seen(t, self.estop)  # a bit flipped while the stream was silent shows from here

    def set_estop(self, on: bool) -> None:
        with self.lock:
            self.estop = on
            if self.alive:  # a silent stream cannot say so: its last sample's bit stays
                self._estop_seen(time.monotonic(), on)

    def _estop_seen(self, t: float, on: bool) -> None:
        (self.estop_seen.begin if on else self.estop_seen.end)(t)


class SoakCamera:
    """A camera whose frame is captured the instant the daemon asks, until it goes silent."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.lock = threading.Lock()
        self.alive = True
        self.stale = Condition(f"camera {name}")
        self._image = np.zeros((32, 32, 3), np.uint8)
        self._image.setflags(write=False)
        self._last: Frame | None = None
        self._seq = 0

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def describe(self) -> str:
        return f"soak camera {self.name}"

    def latest(self) -> Frame | None:
        with self.lock:
            if self.alive:
                self._seq += 1
                self._last = Frame(self._image, time.monotonic(), self._seq)
            return self._last

    def freeze(self) -> None:
        with self.lock:
            self.alive = False
            self.stale.begin(-math.inf if self._last is None else self._last.capture_s + CAMERA_MAX_AGE_S)

    def resume(self) -> None:
        with self.lock:
            self.alive = True
            self.stale.end(time.monotonic())


class SoakPolicy(FakePolicy):
    """The fake policy, misbehaving as `mode` says when a call starts. It records each call's mode
    and observation time: the thread worker runs the daemon's jobs one at a time in order, so call
    n is the job, and the chunk, numbered n (`chunk_id` on the wire)."""

    def __init__(self, rng: random.Random, required: tuple[str, ...], **kw: Any) -> None:
        super().__init__(**kw)
        self.rng = rng
        self.required = required
        self.mode = "ok"
        self.modes: list[str] = []
        self.obs_times: list[float] = []
        self.problems: list[str] = []

    def infer(self, observations: list[Any], rtc: Any = None, noise: Any = None) -> Any:
        mode = self.mode
        obs = observations[0]
        self.modes.append(mode)
        self.obs_times.append(obs.timestamp)
        missing = [n for n in self.required if obs.images.get(n) is None]
        if missing:
            self.problems.append(f"an inference ran without the required camera(s) {missing}")
        if mode == "slow":
            time.sleep(SLOW_S)  # past the horizon: its chunk arrives too late to run
        out = super().infer(observations, rtc, noise)
        a = out.actions
        if mode == "raise":
            raise RuntimeError("soak: the policy raised")
        if mode in ("nan", "inf"):
            a[0, self.rng.randrange(a.shape[1]), self.rng.randrange(a.shape[2])] = np.nan if mode == "nan" else -np.inf
        elif mode == "wide":
            out.actions = np.concatenate([a, a[..., :1]], axis=-1)
        elif mode == "short":
            out.actions = a[:, : self.rng.randrange(1, a.shape[1])]
        elif mode == "batch":
            out.actions = a[0]  # (H, dim): not (1, H, dim)
        elif mode == "wild":
            out.actions = a * 8.0  # a valid chunk far outside the limits: clamped, not refused
        return out


class SoakDaemon(Daemon):
    """The daemon, noting for each inference it starts the sequence number of the tick that
    started it (a chunk must come from an observation taken after the last held tick; its
    `obs_mono_ns` cannot say: the oldest input in it may well be older than that tick and still
    within its age limit)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.started: dict[int, tuple[int, float]] = {}  # job id -> (seq of the tick that started it, obs time)

    def _start_inference(self, job_id: int, slot: int, frames: dict[str, Any], sample: Any, now_s: float) -> Any:
        inflight = super()._start_inference(job_id, slot, frames, sample, now_s)
        assert self.publisher is not None
        self.started[job_id] = (self.publisher.seq, inflight.obs_time_s)
        return inflight


# ---------------------------------------------------------------- the schedule


@dataclass
class Soak:
    state: SoakState
    cameras: dict[str, SoakCamera]
    policy: SoakPolicy
    endpoint: str
    paused: Condition = field(default_factory=lambda: Condition("paused"))
    policy_bad: Condition = field(default_factory=lambda: Condition("policy"))
    stalls: Condition = field(default_factory=lambda: Condition("stall"))
    instructions: int = 0

    def apply(self, kind: str, on: bool, arg: Any) -> None:
        now = time.monotonic()
        if kind == "state":
            self.state.freeze() if on else self.state.resume()
        elif kind == "estop":
            self.state.set_estop(on)
        elif kind in self.cameras:
            self.cameras[kind].freeze() if on else self.cameras[kind].resume()
        elif kind == "hold":
            reply = request_instruction(self.endpoint, hold=on)
            assert reply.ok and reply.holding == on, reply
            (self.paused.begin if on else self.paused.end)(now, time.monotonic())
        elif kind == "policy":
            self.policy.mode = arg if on else "ok"
            if arg != "wild":  # a clamped chunk still runs; the others keep the robot from acting
                # a call started just before the switch back still runs as it was told
                self.policy_bad.begin(now) if on else self.policy_bad.end(now + SLOW_S + 0.1)
        elif kind == "stall":
            self.stalls.begin(now)
            self.state.stall_s = arg
            self.stalls.end(now + arg + 0.1)
        elif kind == "instruction":
            self.instructions += 1
            reply = request_instruction(self.endpoint, f"soak instruction {self.instructions}")
            assert reply.ok, reply


def schedule(rng: random.Random, cameras: list[str], length_s: float) -> list[tuple[float, str, bool, Any]]:
    """(time from the start, fault, on, argument), sorted: each fault comes and goes on its own
    timeline, and different faults overlap freely."""
    events: list[tuple[float, str, bool, Any]] = []
    for kind in ["state", "estop", *cameras, "hold", "policy", "stall", "instruction"]:
        t = rng.uniform(0.05, 0.6)
        while t < length_s:
            if kind == "stall":
                events.append((t, kind, True, rng.choice((3, 4)) * PERIOD_S))
            elif kind == "instruction":
                events.append((t, kind, True, None))
            else:
                # Mostly short stretches (a tick or a few), some long enough for a chunk to run out.
                length = rng.choice((0.01, 0.03, 0.05, 0.1, 0.2, 0.4, 0.7))
                arg = rng.choice(POLICY_MODES) if kind == "policy" else None
                events += [(t, kind, True, arg), (min(t + length, length_s), kind, False, arg)]
                t += length
            # The policy misbehaves often (each mode needs a chunk to show), the rest now and then.
            t += rng.uniform(0.05, 0.3) if kind == "policy" else rng.uniform(0.3, 2.0)
    return sorted(events, key=lambda e: e[0])


# ---------------------------------------------------------------- the checks


def violations(soak: Soak, started: dict[int, tuple[int, float]], msgs: list[tuple[Any, np.ndarray]],
               limit_step: float, camera_stale: Any, quiet_faults: list[Any]) -> list[str]:
    bad: list[str] = list(soak.policy.problems)
    pol = soak.policy
    if [started[k][1] for k in sorted(started)][: len(pol.obs_times)] != pol.obs_times:
        bad.append("the policy's calls are not the daemon's jobs in order: the checks below would misread chunks")

    def made(chunk_id: int) -> str:
        return pol.modes[chunk_id - 1] if 0 < chunk_id <= len(pol.modes) else "never run"

    acts = [(h, v) for h, v in msgs if h.kind == 1]
    seqs = [h.seq for h, _ in acts]
    if seqs != list(range(len(seqs))):
        first = next(i for i, s in enumerate(seqs) if s != i)
        bad.append(f"sequence numbers not 0, 1, 2, ...: around index {first}: {seqs[max(0, first - 3):first + 3]}")
    if len({h.session for h, _ in msgs}) != 1:
        bad.append("more than one session")
    if not acts or not acts[-1][0].flags & Flag.SHUTDOWN or any(h.flags & Flag.SHUTDOWN for h, _ in acts[:-1]):
        bad.append("HOLD | SHUTDOWN is not the last message alone")
    for h, v in msgs:
        if not np.isfinite(v).all() or v.ndim != 2 or v.shape[1] != 6:
            bad.append(f"seq {h.seq} kind {h.kind}: a payload of shape {v.shape} or non-finite")
    good = ("ok", "wild")
    last_blocked = -1  # seq of the last message held for stale inputs, an e-stop or an operator
    instruction = 0
    conds = [(Flag.STALE, "stale", [soak.state.stale, camera_stale]),
             (Flag.ESTOP, "e-stop", [soak.state.estop_seen]),
             (Flag.PAUSED, "operator hold", [soak.paused])]
    for i, (h, v) in enumerate(acts):
        f = Flag(h.flags)
        where = f"seq {h.seq} ({f!r})"
        # This tick read its inputs after the previous message went out and before its own did.
        a = acts[i - 1][0].publish_mono_ns / 1e9 if i else -math.inf
        b = h.publish_mono_ns / 1e9
        if f & Flag.SHUTDOWN:
            continue  # the final HOLD reads no inputs but the state
        for flag, what, cs in conds:
            if any(c.must(a, b) for c in cs) and not f & flag:
                bad.append(f"{where}: the {what} held over the whole tick but the message does not say so")
            if f & flag and not any(c.may(a, b) for c in cs):
                bad.append(f"{where}: flagged {what} though nothing of the kind held during the tick")
        if f & Flag.NONFINITE:
            bad.append(f"{where}: the guard had to replace a non-finite action (a bad chunk ran)")
        if f & (BLOCKING | Flag.WARMUP | Flag.STARVED) and not f & Flag.HOLD:
            bad.append(f"{where}: a reason to hold without HOLD")
        if i and not np.all(np.abs(v - acts[i - 1][1]) <= limit_step + 1e-5):
            bad.append(f"{where}: moved {np.abs(v - acts[i - 1][1]).max():.4f} in one tick, over the rate limit")
        if np.abs(v).max() > LIMIT + 1e-6:
            bad.append(f"{where}: {np.abs(v).max():.3f} outside the position limits")
        if f & Flag.HOLD:
            if h.chunk_id or h.obs_mono_ns or h.instruction:
                bad.append(f"{where}: a HOLD that names a chunk")
            if i and not np.array_equal(v, acts[i - 1][1]):
                bad.append(f"{where}: a HOLD that does not repeat the last action (safety.hold = last)")
            if f & BLOCKING:
                last_blocked = h.seq
            continue
        if made(h.chunk_id) not in good:
            bad.append(f"{where}: a policy action from chunk {h.chunk_id}, whose inference was {made(h.chunk_id)!r}")
        start_seq, obs_s = started.get(h.chunk_id, (-1, 0.0))
        if start_seq <= last_blocked:
            bad.append(f"{where}: a policy action from chunk {h.chunk_id}, started at seq {start_seq}, before the hold "
                       f"at seq {last_blocked} (the hold should have dropped it)")
        if h.obs_mono_ns != round(obs_s * 1e9):
            bad.append(f"{where}: obs_mono_ns is not the observation time of chunk {h.chunk_id}")
        if h.instruction < instruction:
            bad.append(f"{where}: instruction {h.instruction} after {instruction}")
        instruction = h.instruction
    by_seq = {h.seq: (i, h) for i, (h, _) in enumerate(msgs) if h.kind == 1}
    for i, (h, _) in enumerate(msgs):
        if h.kind != 2:
            continue
        prev = msgs[i - 1][0] if i else None
        if prev is None or prev.kind != 1 or prev.seq != h.seq or not prev.flags & Flag.CHUNK_START:
            bad.append(f"chunk message seq {h.seq}: not right after its CHUNK_START action")
        if made(h.chunk_id) not in good:
            bad.append(f"chunk message seq {h.seq}: chunk {h.chunk_id} from a {made(h.chunk_id)!r} inference")
    for read in soak.state.stalled_reads:
        nxt = by_seq.get(read + 1)
        if nxt is not None and not nxt[1].flags & Flag.LATE and not nxt[1].flags & Flag.SHUTDOWN:
            bad.append(f"seq {read + 1}: no LATE after the tick of seq {read} stalled for 3+ periods")
    # Liveness: every stretch free of faults, RECOVERY_S long or longer, saw a policy action.
    spans = sorted((s.on_lo, s.off_hi) for c in quiet_faults for s in c.spans)
    start = acts[0][0].publish_mono_ns / 1e9 + 0.2 if acts else 0.0
    end = acts[-1][0].publish_mono_ns / 1e9 if acts else 0.0
    edges, t = [], start
    for lo, hi in spans:
        if lo > t:
            edges.append((t, lo))
        t = max(t, hi)
    edges.append((t, end))
    policy_times = [h.publish_mono_ns / 1e9 for h, _ in acts if not h.flags & Flag.HOLD]
    for lo, hi in edges:
        if hi - lo >= RECOVERY_S and not any(lo <= t <= hi for t in policy_times):
            bad.append(f"no policy action in a fault-free stretch of {hi - lo:.2f} s ({lo - start + 0.2:.2f} s "
                       f"into the run)")
    return bad


def run_soak(seed: int) -> tuple[list[str], dict[str, Any]]:
    rng = random.Random(seed)
    # Either a required camera beside an optional one, or both optional (then only both silent hold).
    top_required = seed % 2 == 0
    endpoint = free_tcp_endpoint()
    cfg = test_config(
        cameras={"top": {"source": "synthetic", "width": 32, "height": 32, "fps": 50.0, "required": top_required},
                 "wrist": {"source": "synthetic", "width": 32, "height": 32, "fps": 50.0, "required": False}},
        robot={"control_hz": 1 / PERIOD_S,
               "limits": {"action_min": -LIMIT, "action_max": LIMIT, "max_rate": MAX_RATE}},
        chunking={"mode": rng.choice(("inpaint", "none", "crossfade")), "execution_horizon": 6, "delay_initial": 3},
        safety={"state_max_age_ms": STATE_MAX_AGE_S * 1e3, "camera_max_age_ms": CAMERA_MAX_AGE_S * 1e3, "hold": "last"},
        task={"endpoint": endpoint},
    )
    cameras = {"top": SoakCamera("top"), "wrist": SoakCamera("wrist")}
    state = SoakState(6)
    policy = SoakPolicy(rng, ("top",) if top_required else (), chunk_size=H, action_dim=6, state_dim=6,
                        camera_names=("top", "wrist"), latency_s=0.02)
    soak = Soak(state, cameras, policy, endpoint)
    events = schedule(rng, list(cameras), FAULT_PHASE_S)
    daemon = SoakDaemon(cfg, policy=policy, cameras=dict(cameras), state=state, realtime=False, status_line=False)
    run = Running(daemon)
    t0 = time.monotonic()
    try:
        for at, kind, on, arg in events:
            while (left := t0 + at - time.monotonic()) > 0:
                run.listener.poll(min(left, 0.02))
            soak.apply(kind, on, arg)
        # Every fault cleared (the schedule ends each one it starts): the robot must act again.
        n = len(run.actions())
        run.wait_for(lambda: sum(not h.flags & Flag.HOLD for h, _ in run.actions()[n:]) >= 10,
                     timeout=SLOW_S + 3.0, what="policy actions after the faults cleared")
    finally:
        run.stop()
    camera_stale = cameras["top"].stale if top_required else AllOf(cameras["top"].stale, cameras["wrist"].stale)
    quiet_faults = [state.stale, state.estop_seen, camera_stale, soak.paused, soak.policy_bad, soak.stalls]
    bad = violations(soak, daemon.started, run.listener.messages, MAX_RATE * PERIOD_S, camera_stale, quiet_faults)
    flags: dict[str, int] = {}
    for h, _ in run.actions():
        for fl in Flag:
            if h.flags & fl:
                flags[fl.name] = flags.get(fl.name, 0) + 1
    return bad, {"events": events, "flags": flags, "summary": run.daemon.summary(), "mode": cfg.chunking.mode}


@pytest.mark.parametrize("seed", SEEDS)
def test_the_daemon_keeps_its_invariants_under_random_faults(seed):
    bad, info = run_soak(seed)
    assert not bad, f"seed {seed} ({info['mode']}): {len(bad)} violation(s):\n" + "\n".join(bad[:20]) + (
        f"\nflags seen: {info['flags']}\nschedule: {info['events']}")
    # The soak must really have gone through the faults it injected, not around them.
    seen = info["flags"]
    assert seen.get("CHUNK_START", 0) >= 3 and seen.get("HOLD", 0) >= 5, seen
