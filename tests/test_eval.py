"""`phyai-edge eval`: recording reader, the command end to end, and the LeRobot dataset reader."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from phyai_edge.adapters.base import Observation
from phyai_edge.cli import main as cli
from phyai_edge.serve.evaluate import (
    Episode,
    Frame,
    evaluate,
    read_lerobot,
    read_recording,
    write_synthetic_recording,
)


class ConstantPolicy:
    """Just enough of `Policy` for `evaluate`: every chunk is `value` everywhere (the prompt
    "nan" gets NaN, as a broken low-precision engine might), so the metrics are known exactly."""

    def __init__(self, value: float = 0.0, horizon: int = 4, action_dim: int = 2) -> None:
        self.value, self.chunk_size, self.action_dim = value, horizon, action_dim
        self.adapter = type("A", (), {"chunk_size": horizon, "model_action_dim": action_dim})()
        self.device, self.per_sample_rtc = "cpu", True

    def infer(self, observations, rtc=None, noise=None):
        actions = np.full((len(observations), self.chunk_size, self.action_dim), self.value, np.float32)
        for i, o in enumerate(observations):
            if o.prompt == "nan":
                actions[i, 1] = np.nan
        return type("R", (), {"actions": actions, "stage_ms": {}})()


def _frame(target_rows: list[float] | None, prompt: str = "", action_dim: int = 2) -> Frame:
    target = None if target_rows is None else np.repeat(np.asarray(target_rows, np.float32)[:, None], action_dim, 1)
    return Frame(Observation(images={}, state=np.zeros(2, np.float32), prompt=prompt), None, target)


def test_read_recording_in_the_daemons_layout(tmp_path):
    root = write_synthetic_recording(tmp_path / "rec", episodes=2, frames=3, image_hw=(8, 12))
    eps = read_recording(root)
    assert [e.name for e in eps] == ["episode_000", "episode_001"] and all(len(e.frames) == 3 for e in eps)
    f0, f1 = eps[0].frames[0], eps[0].frames[1]
    assert f0.rtc is None  # the first inference had nothing executing
    assert f1.rtc.mode == "guided-approx" and f1.rtc.delay == 3 and f1.rtc.execution_horizon == 25
    assert f1.rtc.prefix.shape == (25, 14) and f1.target.shape == (50, 14)
    assert set(f1.obs.images) == {"top", "left_wrist", "right_wrist"} and f1.obs.prompt == "pick up the cube"
    # A single recording folder is one episode; frames whose inference failed are skipped.
    one = root / "episode_001"
    with np.load(one / "obs_000002.npz") as z:
        arrays = dict(z)
    arrays["error"] = np.array("timeout")
    np.savez(one / "obs_000002.npz", **arrays)
    assert len(read_recording(one)[0].frames) == 2
    # A frame keeps its number (its noise's) when one before it is skipped.
    assert [f.index for f in read_recording(one)[0].frames] == [0, 2]
    assert read_recording(one, use_rtc=False)[0].frames[1].rtc is None
    with pytest.raises(ValueError, match=r"no meta\.json"):
        read_recording(tmp_path)


def test_damaged_records_are_left_out_by_name_and_the_rest_is_read(tmp_path, caplog):
    """A record cut short, an empty one and one without its state crashed `eval` with a
    BadZipFile / EOFError / KeyError traceback (exit 1, read as "frames failed")."""
    one = write_synthetic_recording(tmp_path / "rec", episodes=1, frames=5, image_hw=(8, 12)) / "episode_000"
    files = sorted(one.glob("obs_*.npz"))
    files[1].write_bytes(files[1].read_bytes()[:300])
    files[2].write_bytes(b"")
    with np.load(files[3]) as z:
        arrays = {k: z[k] for k in z.files if k != "state"}
    np.savez(files[3], **arrays)
    with caplog.at_level("WARNING"):
        (ep,) = read_recording(one)
    assert [f.index for f in ep.frames] == [0, 4]
    (line,) = [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]
    assert "left out 3 unreadable record(s)" in line
    assert all(f.name in line for f in files[1:4]) and "BadZipFile" in line and "KeyError" in line


def test_eval_command_reports_per_episode_tables(tmp_path, capsys):
    data = tmp_path / "rec"
    rc = cli(["eval", str(data), "--synthetic", "--reference-backend", "eager", "--batch", "4", "--json"])
    assert rc == 0
    rep = json.loads(capsys.readouterr().out)
    assert [e["name"] for e in rep["episodes"]] == ["episode_000", "episode_001"]
    assert rep["overall"]["frames"] == 8 and rep["overall"]["failures"] == 0
    # Same backend, same noise, same batches: the reference agrees exactly.
    assert rep["overall"]["reference_max"] == 0.0
    # Random recorded actions vs a random tiny model: a finite, non-zero error.
    assert rep["overall"]["recorded_mae"] > 0
    rc = cli(["eval", str(data / "episode_000"), "--no-rtc"])
    out = capsys.readouterr().out
    assert rc == 0 and "episode_000" in out and "no reference engine" in out
    assert cli(["eval", str(tmp_path / "missing")]) == 2


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is None or importlib.util.find_spec("cv2") is None,
                    reason="the LeRobot reader needs pyarrow and OpenCV")
def test_lerobot_dataset_with_embedded_images(tmp_path, tiny_policy):
    import cv2
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / "ds"
    (root / "meta").mkdir(parents=True)
    (root / "data" / "chunk-000").mkdir(parents=True)
    cams = tiny_policy.camera_names
    feats = {"observation.state": {"dtype": "float32", "shape": [14]}, "action": {"dtype": "float32", "shape": [14]},
             **{f"observation.images.{c}": {"dtype": "image", "shape": [16, 20, 3]} for c in cams}}
    (root / "meta" / "info.json").write_text(json.dumps({"codebase_version": "v2.1", "features": feats}))
    (root / "meta" / "tasks.jsonl").write_text(json.dumps({"task_index": 0, "task": "fold the towel"}) + "\n")
    rng = np.random.default_rng(0)
    for ep in range(2):
        n = 6
        png = {c: [{"bytes": cv2.imencode(".png", rng.integers(0, 256, (16, 20, 3), dtype=np.uint8))[1].tobytes(),
                    "path": None} for _ in range(n)] for c in cams}
        cols = {"observation.state": rng.uniform(-1, 1, (n, 14)).astype(np.float32).tolist(),
                "action": rng.uniform(-1, 1, (n, 14)).astype(np.float32).tolist(),
                "episode_index": [ep] * n, "frame_index": list(range(n)), "task_index": [0] * n,
                "timestamp": [i / 50 for i in range(n)], **{f"observation.images.{c}": png[c] for c in cams}}
        pq.write_table(pa.table(cols), root / "data" / "chunk-000" / f"episode_{ep:06d}.parquet")
    eps = read_lerobot(root, horizon=50, max_frames=4, stride=2)
    assert [e.name for e in eps] == ["episode_000000", "episode_000001"]
    f = eps[0].frames[1]  # frame 2: the target is the recorded actions 2 .. 5
    assert len(eps[0].frames) == 3 and f.target.shape == (4, 14) and f.obs.prompt == "fold the towel"
    assert f.index == 2 and [e.index for e in eps] == [0, 1]  # the dataset's numbers, for the noise
    assert read_lerobot(root, horizon=50, episodes=[1])[0].index == 1
    assert f.obs.images["top"].shape == (16, 20, 3) and f.obs.images["top"].dtype == np.uint8
    rep = evaluate(tiny_policy, eps, batch=3)
    assert rep["overall"]["frames"] == 6 and np.isfinite(rep["overall"]["recorded_mae"])
    with pytest.raises(ValueError, match="no feature"):
        read_lerobot(root, 50, camera_map={"top": "observation.images.nope"})


def test_mean_error_is_over_every_compared_action_value():
    """At an episode's end a frame's target is shorter than the chunk (the recorded actions that
    remain): it weighs by the actions it compares, not as much as a full chunk."""
    full, tail = _frame([1.0, 1.0, 1.0, 1.0]), _frame([3.0])  # errors 1 x 4 rows, 3 x 1 row
    other = Episode("b", [_frame([2.0, 2.0, 2.0, 2.0])])
    rep = evaluate(ConstantPolicy(0.0), [Episode("a", [full, tail]), other], ConstantPolicy(0.5), batch=2)
    a, b = rep["episodes"]
    assert a["recorded_mae"] == pytest.approx((4 * 1.0 + 1 * 3.0) / 5)  # not (1 + 3) / 2
    assert a["recorded_max"] == 3.0 and b["recorded_mae"] == 2.0
    # Overall: pooled over every compared value of every episode, as each episode is.
    assert rep["overall"]["recorded_mae"] == pytest.approx((4 * 1.0 + 1 * 3.0 + 4 * 2.0) / 9)
    assert rep["overall"]["reference_mae"] == 0.5 and rep["overall"]["reference_max"] == 0.5


def test_non_finite_actions_fail_the_frame():
    """A chunk with NaN in it is a failed inference (exit status 1), not a metric of NaN that
    the table prints as "-" (nothing to compare) and the JSON as null."""
    ep = Episode("a", [_frame([1.0] * 4), _frame([1.0] * 4, prompt="nan")])
    rep = evaluate(ConstantPolicy(0.0), [ep], batch=2)
    assert rep["overall"]["failures"] == 1 and rep["episodes"][0]["failures"] == 1
    assert rep["overall"]["recorded_mae"] == 1.0  # the finite frame still counts
    # The same for the reference: a broken reference is no reference.
    rep = evaluate(ConstantPolicy(0.0), [ep], reference=ConstantPolicy(0.0), batch=2)
    assert rep["overall"]["failures"] == 1 and rep["overall"]["reference_max"] == 0.0
    rep = evaluate(ConstantPolicy(0.0), [Episode("a", [_frame([1.0] * 4, prompt="nan")])], batch=1)
    assert rep["overall"]["failures"] == 1 and np.isnan(rep["overall"]["recorded_mae"])


def test_recorded_actions_of_another_width_are_one_clear_error(tmp_path, capsys):
    """A dataset recorded for another robot (3 action values where the policy outputs 2) is named
    before any engine runs, not a numpy broadcast error out of the middle of the loop; and an
    evaluation left with no frame at all is an error, not exit status 0."""
    ep = Episode("other_robot", [_frame([1.0] * 4), _frame([1.0] * 4, action_dim=3)])
    with pytest.raises(ValueError, match=r"episode other_robot: its recorded actions are \(4, 3\) .* outputs 2"):
        evaluate(ConstantPolicy(0.0), [ep], batch=2)
    data = tmp_path / "rec"
    assert cli(["eval", str(data), "--synthetic", "--json"]) == 0
    capsys.readouterr()
    for f in data.glob("episode_*/obs_*.npz"):
        f.unlink()
    assert cli(["eval", str(data)]) == 2
    assert "no frames to evaluate" in capsys.readouterr().err


class NoisePolicy(ConstantPolicy):
    """Its chunk is the noise it was given: shows which noise each frame got."""

    def infer(self, observations, rtc=None, noise=None):
        return type("R", (), {"actions": noise[:, :, :self.action_dim].numpy().copy(), "stage_ms": {}})()


def test_a_frames_noise_depends_on_its_own_episode_and_frame_numbers():
    """Not on which episodes (--episodes) or frames (--stride, --max-frames, failed frames
    skipped) are evaluated beside it."""
    from phyai_edge.serve.evaluate import frame_noise

    def episode() -> Episode:
        target = frame_noise(3, 7, 4, 4, 2)[0].numpy()  # dataset episode 7, frame 4, seed 3
        return Episode("e7", [Frame(_frame(None).obs, None, target, index=4)], index=7)

    alone = evaluate(NoisePolicy(), [episode()], seed=3)
    beside = evaluate(NoisePolicy(), [Episode("e1", [_frame([0.0] * 4)] * 3), episode()], seed=3)
    assert alone["episodes"][0]["recorded_max"] == beside["episodes"][1]["recorded_max"] == 0.0


def test_a_recording_replays_with_the_guidance_weight_its_daemon_ran(tmp_path):
    """The daemon records its RTC beta (`chunking.max_guidance_weight`); eval replays guided requests
    with it unless told another, and with the daemon's default 5.0 for a recording that does not say."""
    root = write_synthetic_recording(tmp_path / "rec", episodes=2, frames=3)
    first, _ = sorted(root.glob("*/meta.json"))
    meta = json.loads(first.read_text())
    first.write_text(json.dumps({**meta, "max_guidance_weight": 2.0}))

    def betas(**kw):
        return [{f.rtc.max_guidance_weight for f in ep.frames if f.rtc is not None} for ep in read_recording(root, **kw)]

    assert betas() == [{2.0}, {5.0}]
    assert betas(max_guidance_weight=1.5) == [{1.5}, {1.5}]
