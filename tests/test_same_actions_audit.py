"""ARCHITECTURE.md's invariant "every scenario (daemon, batch, serve) gives the same actions as a
direct engine call", for what tests/test_scenarios.py, test_serve*.py and test_rollout.py leave
out: a real daemon's `--record` replayed (by hand and through `evaluate`), several robots in one
served batch over the wire, prompts of many lengths and the prompt room kept (eager, and the
cudagraph engine's trimming run on the CPU), and the gymnasium example's own rollout loop.

Tolerances (tiny PI0.5, float32, CPU; actions are robot units of order 1):
- bit for bit (`assert_array_equal`) where the same policy runs the same inputs and noise in a
  batch of the same composition: the same arithmetic in the same order;
- TOL = 1e-5 where the sample shares its batch with others (other robots, padding rows, other
  prompt lengths, another backend's kernels): CPU GEMMs and reductions block differently with
  the batch size and the padded prompt length, which moves the last bits (measured up to 1e-6);
- SENSITIVE = 1e-3 is the least a change of one input (the prompt, a robot's own observation)
  moves a chunk here: asserted so that a comparison at TOL cannot pass on a model that ignores
  what a padding, masking or routing error would garble.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from phyai_edge.adapters.base import Observation
from phyai_edge.control.daemon import Daemon
from phyai_edge.control.fakes import run_ticks, test_config
from phyai_edge.engines.base import InferenceResult, RTCRequest
from phyai_edge.engines.noise import frame_noise
from phyai_edge.engines.policy import Policy, load_policy
from phyai_edge.serve.batching import BatchItem, ItemResult, run_items
from phyai_edge.serve.client import RemotePolicy, RemoteResult
from phyai_edge.serve.evaluate import Episode, evaluate, format_eval, read_recording
from phyai_edge.serve.rollout import RolloutPolicy
from phyai_edge.serve.scheduler import SchedulerConfig
from phyai_edge.serve.server import LocalExecutor, PolicyServer

TOL = 1e-5
SEED = 11  # the daemon's model.noise_seed in the recordings below
SENSITIVE = 1e-3
SIZES = [1, 2, 4, 8]
# Instructions whose prompts (instruction plus the state's bins) take from about 55 to 85 tokens.
PROMPTS = ("go", "pick up the red cube",
           "pick up the red cube and put it in the blue bowl on the left side of the table",
           "fold the towel twice", "stack the three blocks", "open the drawer")


def _noise(policy: Policy, rows: int, seed: int) -> torch.Tensor:
    a = policy.adapter
    return torch.randn(rows, a.chunk_size, a.model_action_dim, generator=torch.Generator().manual_seed(seed))


def _prefix(rows: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, (rows, 14)).astype(np.float32)


def _alone(policy: Policy, item: BatchItem) -> np.ndarray:
    return policy.infer(item.observations, rtc=item.rtc, noise=item.noise).actions


def _prompt_tokens(policy: Policy, obs: Observation) -> int:
    return int(policy.adapter.prompt_tokens([obs])[1].sum())


# -- the daemon's recording ------------------------------------------------------------------
class NoiseKeeping:
    """The daemon's policy, keeping the noise every chunk is made with (the worker's keyed draw;
    a job without it would take the engine's stream, drawn here alike), so that the tests can
    compare it with what the recording says and hand it to the direct call."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.drawn: list[tuple[float, torch.Tensor]] = []  # (observation time, noise) per inference

    def __getattr__(self, name: str) -> Any:
        return getattr(self.policy, name)

    def infer(self, observations: Sequence[Observation], rtc: Any = None,
              noise: torch.Tensor | None = None) -> InferenceResult:
        obs = list(observations)
        if noise is None:
            noise = self.policy.engine.sample_noise(len(obs))
        self.drawn.append((obs[0].timestamp, noise.clone()))
        return self.policy.infer(obs, rtc=rtc, noise=noise)


@dataclass
class DaemonRun:
    policy: Policy
    episodes: list[Episode]
    noise: dict[int, torch.Tensor]  # the recording's frame number -> the noise its chunk was made with
    root: Path  # the recording's folder


@pytest.fixture(scope="module")
def daemon_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], DaemonRun]:
    """One real daemon run per RTC mode (a few seconds each), shared by the tests below."""
    runs: dict[str, DaemonRun] = {}

    def run(mode: str) -> DaemonRun:
        if mode not in runs:
            root = tmp_path_factory.mktemp(f"record-{mode}")
            keeping = NoiseKeeping(load_policy(preset="tiny"))
            # A camera with a crop, a rotation and a mirror, one of another size, and the third
            # with no source (left out of the model): the recording must hold each frame as the
            # policy saw it. One warm-up round runs before the clock (job 0).
            cfg = test_config(
                cameras={"top": {"source": "synthetic", "width": 64, "height": 48, "crop": [4, 2, 40, 36],
                                 "rotate": 90, "flip": "horizontal"},
                         "left_wrist": {"source": "synthetic", "width": 32, "height": 24}},
                model={"worker": "thread", "warmup": 1, "noise_seed": SEED},
                chunking={"mode": mode, "execution_horizon": 25, "delay_initial": 3},
            )
            run_ticks(Daemon(cfg, policy=keeping, record_dir=str(root), realtime=False, status_line=False), 200)
            episodes = read_recording(root)
            frames = episodes[0].frames
            assert len(frames) >= 3, f"only {len(frames)} chunks recorded"
            # The observation time finds a recorded frame's noise: the recording keeps it, and no
            # other inference ran on it (a warm-up's frames are stamped when they are made).
            noise: dict[int, torch.Tensor] = {}
            for f in frames:
                same = [n for t, n in keeping.drawn if t == f.obs.timestamp]
                assert len(same) == 1 and f.index is not None, f"{len(same)} inferences at one observation time"
                noise[f.index] = same[0]
            runs[mode] = DaemonRun(keeping.policy, episodes, noise, root)
        return runs[mode]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["none", "guided-approx", "inpaint"])
def test_a_daemon_recording_replays_to_its_chunks_with_the_noise_they_were_made_with(
        daemon_run: Callable[[str], DaemonRun], mode: str) -> None:
    run = daemon_run(mode)
    frames = run.episodes[0].frames
    guided = [f for f in frames if f.rtc is not None]
    if mode == "none":
        assert not guided
    else:
        assert len(guided) >= 2 and {f.rtc.mode for f in guided} == {mode}
    # The recorded observation and RTC request (as `eval` reads them back) and the chunk's noise
    # are all the direct call needs: the same policy, batch of one, bit for bit.
    for f in frames:
        assert f.target is not None and f.index is not None
        got = run.policy.infer([f.obs], rtc=f.rtc, noise=run.noise[f.index]).actions[0]
        np.testing.assert_array_equal(got, f.target)
    # and a frame given other noise lands far off: what a replay with noise of its own would do
    other = run.policy.infer([frames[0].obs], rtc=frames[0].rtc, noise=run.noise[frames[0].index] + 1.0).actions[0]
    assert np.abs(other - frames[0].target).max() > SENSITIVE


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["none", "guided-approx"])
def test_eval_reproduces_a_daemon_recording_from_the_recording_alone(
        daemon_run: Callable[[str], DaemonRun], mode: str) -> None:
    run = daemon_run(mode)
    frames = run.episodes[0].frames
    # Each file says where its chunk's noise came from, and that is the noise the policy got.
    assert {f.noise_seed for f in frames} == {SEED}
    for f in frames:
        assert f.index is not None
        a = run.policy.adapter
        torch.testing.assert_close(frame_noise(SEED, 0, f.index, a.chunk_size, a.model_action_dim),
                                   run.noise[f.index], rtol=0, atol=0)
    rep = evaluate(run.policy, run.episodes, batch=1, seed=SEED + 1)  # eval's own seed plays no part
    o = rep["overall"]
    assert o["failures"] == 0 and o["recorded_noise"] == len(frames) and o["recorded_max"] == 0.0
    rep = evaluate(run.policy, run.episodes, batch=4, batch_sizes=[8])
    assert rep["overall"]["failures"] == 0 and rep["overall"]["recorded_max"] < TOL
    assert "every frame's as its recorded chunk drew it" in format_eval(rep)


@pytest.mark.slow
def test_eval_runs_the_policy_as_the_recordings_daemon_ran_it(daemon_run: Callable[[str], DaemonRun]) -> None:
    """The recording says which policy cameras no source fed and the prompt room the daemon kept;
    `evaluate` runs the policy so for the replay (another backend here: the cudagraph engine's
    CPU path, which keeps prompt room), then gives it back as it was."""
    import json

    run = daemon_run("guided-approx")
    meta = json.loads((run.root / "meta.json").read_text())
    names = run.policy.camera_names
    assert meta["absent_cameras"] == [names[2]]  # the fixture's third camera has no source
    assert meta["prompt_room"]["prompts"][0] == run.episodes[0].frames[0].obs.prompt
    ep = run.episodes[0]
    assert ep.absent_cameras == (names[2],) and ep.prompt_room is not None

    policy = load_policy(preset="tiny", backend="cudagraph")
    seen: list[tuple[frozenset[str], int]] = []

    class Spy:
        def __getattr__(self, name: str) -> Any:
            return getattr(policy, name)

        def infer(self, *args: Any, **kwargs: Any) -> InferenceResult:
            seen.append((policy.absent_cameras, policy.engine.min_prompt_positions))
            return policy.infer(*args, **kwargs)

    longest = policy.adapter.longest_prompt_tokens(meta["prompt_room"]["prompts"][0])
    rep = evaluate(Spy(), run.episodes, batch=1)
    assert seen and set(seen) == {(frozenset({names[2]}), longest)}
    assert policy.absent_cameras == frozenset() and policy.engine.min_prompt_positions == 0
    assert rep["overall"]["failures"] == 0 and rep["overall"]["recorded_max"] < TOL


@pytest.mark.slow
def test_a_recording_without_its_noise_replays_with_evals_own(
        daemon_run: Callable[[str], DaemonRun], tmp_path: Path) -> None:
    """A recording made before the daemon kept its noise (no `noise_seed` in its files) replays
    with --seed's, and says that its rec columns are sampling spread."""
    import json
    import shutil

    run = daemon_run("guided-approx")
    src = Path(run.root)
    shutil.copy(src / "meta.json", tmp_path / "meta.json")
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["noise_seed"] == SEED
    for f in sorted(src.glob("obs_*.npz")):
        with np.load(f, allow_pickle=False) as z:
            np.savez(tmp_path / f.name, **{k: z[k] for k in z.files if k != "noise_seed"})
    old = read_recording(tmp_path)[0].frames
    assert all(f.noise_seed is None for f in old) and len(old) == len(run.episodes[0].frames)
    rep = evaluate(run.policy, read_recording(tmp_path), batch=1)
    assert rep["overall"]["recorded_noise"] == 0 and rep["overall"]["recorded_max"] > SENSITIVE
    assert "include the policy's sampling spread" in format_eval(rep)


# -- the multi-robot server ------------------------------------------------------------------
class GatedExecutor(LocalExecutor):
    """Holds its first batch until `release`, so that every later request is queued by then and
    the batches form from all of them; keeps what each batch ran and gave."""

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy, batch_sizes=SIZES, max_batch=max(SIZES))
        self.entered, self.release = threading.Event(), threading.Event()
        self.batches: list[tuple[list[BatchItem], list[ItemResult]]] = []

    def run(self, items: list[BatchItem]) -> list[ItemResult]:
        self.entered.set()
        assert self.release.wait(120)
        results = super().run(items)
        self.batches.append((list(items), results))
        return results


def _robots(policy: Policy, make_obs: Callable[..., Observation]) -> dict[str, BatchItem]:
    """Robots whose requests differ in every way a batch must keep apart: prompt length, camera
    set and frame size, RTC mode, delay and prefix length, observations per request."""
    a = policy.adapter

    def obs(seed: int, prompt: str, size: tuple[int, int] = (24, 32), cameras: Sequence[str] | None = None) -> list[Observation]:
        return [make_obs(a, seed=seed, size=size, prompt=prompt, cameras=cameras)]

    top = ["top", "left_wrist"]
    return {
        "ga-short": BatchItem(obs(1, PROMPTS[0]), RTCRequest("guided-approx", _prefix(25, 1), 3, 25), _noise(policy, 1, 1)),
        "ga-long": BatchItem(obs(2, PROMPTS[2], (48, 64), top), RTCRequest("guided-approx", _prefix(30, 2), 7, 25),
                             _noise(policy, 1, 2)),
        "unguided": BatchItem(obs(3, PROMPTS[3]), None, _noise(policy, 1, 3)),
        "crossfade": BatchItem(obs(4, PROMPTS[4]), RTCRequest("crossfade", _prefix(25, 4), 3, 25), _noise(policy, 1, 4)),
        "ga-pair": BatchItem(obs(5, PROMPTS[1]) + obs(6, PROMPTS[1], (36, 36)),
                             RTCRequest("guided-approx", _prefix(25, 5), 0, 25), _noise(policy, 2, 5)),
        "inpaint-2": BatchItem(obs(7, PROMPTS[5]), RTCRequest("inpaint", _prefix(25, 7), 2, 25), _noise(policy, 1, 7)),
        "inpaint-5": BatchItem(obs(8, PROMPTS[2], cameras=["top"]), RTCRequest("inpaint", _prefix(40, 8), 5, 25),
                               _noise(policy, 1, 8)),
        "inpaint-9": BatchItem(obs(9, PROMPTS[0]), RTCRequest("inpaint", _prefix(20, 9), 9, 25), _noise(policy, 1, 9)),
    }


@pytest.mark.slow
def test_robots_batched_by_the_server_get_their_direct_actions(tiny_policy: Policy,
                                                               make_obs: Callable[..., Observation]) -> None:
    robots = _robots(tiny_policy, make_obs)
    first = BatchItem([make_obs(tiny_policy.adapter, seed=0, size=(24, 32))], None, _noise(tiny_policy, 1, 0))
    executor = GatedExecutor(tiny_policy)
    answers: dict[str, RemoteResult] = {}
    errors: dict[str, BaseException] = {}

    def ask(name: str, item: BatchItem, endpoint: str) -> None:
        try:
            with RemotePolicy(endpoint, robot=name, timeout_s=120.0) as remote:
                answers[name] = remote.infer(item.observations, rtc=item.rtc, noise=item.noise)
        except BaseException as exc:
            errors[name] = exc

    # A long budget: the latency rule must not split the batches this test is about.
    with PolicyServer(executor, "tcp://127.0.0.1:*", SchedulerConfig(max_batch=8, window_s=0.05),
                      default_budget_ms=600_000.0) as srv:
        threads = [threading.Thread(target=ask, args=("first", first, srv.endpoint), daemon=True)]
        threads[0].start()
        assert executor.entered.wait(60), "the first request never reached the engine"
        for name, item in robots.items():
            threads.append(threading.Thread(target=ask, args=(name, item, srv.endpoint), daemon=True))
            threads[-1].start()
        end = time.monotonic() + 60
        while len(srv.sched) < len(robots) and time.monotonic() < end:
            time.sleep(0.01)
        assert len(srv.sched) == len(robots), "not every robot's request was queued"
        executor.release.set()
        for t in threads:
            t.join(120)
    assert not errors, errors
    assert set(answers) == {"first", *robots}

    # What each robot got is what its batch computed for it (the wire and the routing change
    # nothing), and that is what it gets alone within rounding.
    owner = {np.asarray(it.noise).tobytes(): name for name, it in {"first": first, **robots}.items()}
    shared = []
    for items, results in executor.batches:
        names = [owner[np.asarray(it.noise).tobytes()] for it in items]
        shared.append((names, results[0].batch, items))
        for name, result in zip(names, results):
            assert result.actions is not None, result.error
            np.testing.assert_array_equal(answers[name].actions, result.actions)
            assert answers[name].batch == result.batch
    for name, item in {"first": first, **robots}.items():
        np.testing.assert_allclose(answers[name].actions, _alone(tiny_policy, item), atol=TOL, rtol=0)

    # The batches were the ones this test is about: robots of both solver modes shared calls,
    # with riders, prompts of several lengths and padding rows.
    modes = [{it.rtc.mode for it in items if it.rtc is not None} for _, _, items in shared]
    assert {"guided-approx", "crossfade"} <= set().union(*modes) and any("inpaint" in m for m in modes)
    big = [(names, padded, items) for names, padded, items in shared if len(names) >= 3]
    assert big, f"no batch of three robots or more: {[names for names, _, _ in shared]}"
    for _, padded, items in big:
        observations = [o for it in items for o in it.observations]
        assert padded > len(observations), "the batch was not padded to a captured size"
        assert len({_prompt_tokens(tiny_policy, o) for o in observations}) >= 3
    # A chunk moves far more than TOL with the robot's own inputs: a mix-up would show.
    chunks = [answers[n].actions[0] for n in robots]
    assert min(np.abs(p - q).max() for i, p in enumerate(chunks) for q in chunks[i + 1:]) > SENSITIVE


# -- prompt lengths, padding and the prompt room ---------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["eager", "cudagraph"])
def test_prompt_lengths_padding_and_prompt_room_change_no_robots_actions(
        backend: str, make_obs: Callable[..., Observation]) -> None:
    """The cudagraph engine runs its own code on the CPU (no capture): it trims each batch's
    prompts to the longest, rounded up to its bucket, keeps exactly one length where every
    prompt has it (and then, from batch 8, the unmasked prefix and expert), and keeps the room
    `fix_prompt_positions` asks for. Each is padding a robot's prompt differently from alone."""
    policy = load_policy(preset="tiny", backend=backend)
    a = policy.adapter
    items = [BatchItem([make_obs(a, seed=20 + i, size=(24, 32), prompt=p)],
                       None if i % 3 == 2 else RTCRequest("guided-approx", _prefix(25 + i, 20 + i), i % 4, 25),
                       _noise(policy, 1, 20 + i)) for i, p in enumerate(PROMPTS)]
    assert len({_prompt_tokens(policy, it.observations[0]) for it in items}) >= 4
    alone = [_alone(policy, it) for it in items]
    for sizes in (None, [8]):  # six prompts of several lengths, as they are and padded to 8
        for want, r in zip(alone, run_items(policy, items, sizes)):
            np.testing.assert_allclose(r.actions, want, atol=TOL, rtol=0)
    # One prompt length for a full batch of 8: the same state and instruction, other frames.
    state = np.linspace(-0.8, 0.8, a.state_dim).astype(np.float32)
    same = [BatchItem([make_obs(a, seed=40 + i, size=(24, 32), state=state, prompt=PROMPTS[1])], None,
                      _noise(policy, 1, 40 + i)) for i in range(8)]
    for it, r in zip(same, run_items(policy, same)):
        np.testing.assert_allclose(r.actions, _alone(policy, it), atol=TOL, rtol=0)
    # Room kept for the longest of the prompts with any state (the daemon's and the server's
    # warm-up): every robot's prompt is padded to it, alone or batched.
    if policy.fix_prompt_positions(list(PROMPTS)) is not None:
        assert policy.prompt_fit(PROMPTS[0])[1] is not None
        for it, want in zip(items, alone):
            np.testing.assert_allclose(_alone(policy, it), want, atol=TOL, rtol=0)
        for want, r in zip(alone, run_items(policy, items, SIZES)):
            np.testing.assert_allclose(r.actions, want, atol=TOL, rtol=0)
    # The prompt moves the chunk far more than TOL, so a prompt padded or masked wrongly would show.
    other = make_obs(a, seed=20, size=(24, 32), prompt=PROMPTS[2])
    moved = policy.infer([other], rtc=items[0].rtc, noise=items[0].noise).actions
    assert np.abs(moved - alone[0]).max() > SENSITIVE


# -- RL rollouts: the gymnasium example's own loop -------------------------------------------
def _load_example() -> Any:
    path = Path(__file__).resolve().parents[1] / "examples" / "rollout_gymnasium.py"
    spec = importlib.util.spec_from_file_location("rollout_gymnasium_audit", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("gymnasium") is None,
                    reason="gymnasium not installed (pip install 'phyai-edge[rl]')")
@pytest.mark.parametrize(("mode", "options"), [("guided-approx", None), ("inpaint", {"relative_actions": "6,-1,6,-1"})])
def test_the_gymnasium_example_acts_as_direct_calls(mode: str, options: dict[str, str] | None,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Every batched `act` of the example (environments due on their own schedule, RTC with a
    delay, resets), padded to captured sizes, against each environment alone with the noise its
    stream gave it; once with a policy whose actions are relative to the state."""
    mod = _load_example()
    calls: list[tuple[int, int]] = []  # (environments, of them with an RTC request)

    class Checked(RolloutPolicy):
        def __init__(self, policy: Policy, seed: int = 0) -> None:
            super().__init__(policy, batch_sizes=[4], seed=seed)

        def act(self, observations: Sequence[Observation], rtc: Sequence[RTCRequest | None] | None = None,
                noise: torch.Tensor | np.ndarray | None = None, env_ids: Sequence[int] | None = None) -> Any:
            ids = list(range(len(observations))) if env_ids is None else list(env_ids)
            drawn = self.env_noise(ids) if noise is None else torch.as_tensor(noise)
            out = super().act(observations, rtc=rtc, noise=drawn, env_ids=ids)
            reqs = list(rtc) if rtc is not None else [None] * len(observations)
            for i, (o, r) in enumerate(zip(observations, reqs)):
                want = self.policy.infer([o], rtc=r, noise=drawn[i:i + 1]).actions[0]
                np.testing.assert_allclose(out.actions[i], want, atol=TOL, rtol=0)
            calls.append((len(observations), sum(r is not None for r in reqs)))
            return out

    monkeypatch.setattr(mod, "RolloutPolicy", Checked)
    res = mod.rollout(num_envs=3, steps=70, execution_horizon=25, delay=3, mode=mode, adapter_options=options)
    assert res["inferences"] == len(calls) >= 4
    assert any(guided for _, guided in calls), "no call carried RTC"
    assert any(n == 3 and guided == 3 for n, guided in calls), "no batch of every environment with RTC"
