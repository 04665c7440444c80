"""Batch evaluation: replay recorded observations through an engine and compare its actions
with the recorded ones and with another backend or bundle, episode by episode.

Inputs:
- a daemon recording (`phyai-edge run --record DIR`): `meta.json` plus one `obs_NNNNNN.npz`
  per inference with `image.<view>`, `state`, `prompt`, `timestamp`, `rtc_mode`, `prefix`,
  `delay` / `delay_estimate`, `actions` (the chunk the robot got) and `error`. One recording is
  one episode; a folder of recordings (subfolders with `meta.json`) is several;
- a LeRobot dataset folder (`meta/info.json`, `data/**/*.parquet`): per-frame
  `observation.state`, `action` and camera columns (embedded images, or v2.x per-episode
  videos); the target of frame t is the recorded actions t .. t+H-1. Needs pyarrow, and
  OpenCV for images.

Noise: every frame gets its own noise from (seed, episode, frame) (`engines.noise`; the
dataset's own episode and frame numbers: `Episode.index`, `Frame.index`), and the evaluated and
the reference engine get the same noise, so their difference is the engines' alone. A daemon
recording says the seed its chunks' noise came from (`noise_seed`, with the inference number):
its frames replay with that noise, so the error against the recorded actions is the engines'
difference too (zero for the same engine at batch one). A dataset's actions, and a recording
without it, were sampled with noise nobody kept: their error includes the policy's sampling
spread.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from phyai_edge.adapters.base import Observation
from phyai_edge.calibration.records import UNREADABLE
from phyai_edge.engines.base import SOLVER_RTC_MODES, RTCRequest
from phyai_edge.engines.noise import frame_noise
from phyai_edge.extras import install_hint
from phyai_edge.serve.batching import BatchItem, run_items

log = logging.getLogger(__name__)


@dataclass
class Frame:
    obs: Observation
    rtc: RTCRequest | None = None
    target: np.ndarray | None = None  # (n <= H, action_dim) recorded actions, robot units
    # The frame's own number for its noise (its position among the recording's files, failed
    # ones included; a dataset's frame_index), so that skipped frames, --stride and
    # --max-frames do not change another frame's noise; None: its position in the episode.
    index: int | None = None
    # The seed the daemon drew this chunk's noise from, with episode 0 and `index` its inference
    # number (`engines.noise`): replayed with that noise, not eval's --seed; None: eval's own.
    noise_seed: int | None = None


@dataclass
class Episode:
    name: str
    frames: list[Frame] = field(default_factory=list)
    # The dataset's episode_index, for its frames' noise (so --episodes does not change it);
    # None: its position in the list evaluated (a folder of recordings: sorted by name).
    index: int | None = None
    # How a daemon ran the recording's chunks (its meta.json), replayed alike: the policy cameras no
    # source fed (`Policy.set_absent_cameras`), and the instructions and tokens of prompt room it
    # kept (`Policy.fix_prompt_positions`); None: not recorded.
    absent_cameras: tuple[str, ...] | None = None
    prompt_room: tuple[tuple[str, ...], int] | None = None


# -- readers -------------------------------------------------------------------------------
def _scalar(z: Any, key: str, default: Any) -> Any:
    if key not in z.files:
        return default
    v = z[key]
    return v.item() if v.ndim == 0 else (default if v.size == 0 else v)


def _recording_dirs(path: str | Path) -> list[Path]:
    """A `run --record` folder, or the recordings in a folder of them (sorted by name)."""
    root = Path(path)
    if root.is_file():
        raise ValueError(f"{root} is a file; expected a `phyai-edge run --record` folder (or a folder of them)")
    if not root.is_dir():
        raise FileNotFoundError(f"recording folder {root} does not exist")
    dirs = [root] if (root / "meta.json").exists() else sorted(p.parent for p in root.glob("*/meta.json"))
    if not dirs:
        raise ValueError(f"{root}: no meta.json here or in its subfolders; is it a `phyai-edge run --record` folder?")
    return dirs


class ModelsDifferError(ValueError):
    """Recordings evaluated together were made by different models."""


def recorded_model(path: str | Path) -> dict[str, Any] | None:
    """The model the recordings' daemon ran (meta.json's `model`: adapter, checkpoint, tokenizer,
    bundle, preset, adapter_options, factory, and how it ran), or None where a recording does not
    say (recorded before it did). ModelsDifferError where recordings evaluated together name different
    models (one replay runs one policy); what `read_recording` raises where `path` is none."""
    models = []
    for d in _recording_dirs(path):
        m = json.loads((d / "meta.json").read_text()).get("model")
        if not isinstance(m, dict):
            return None
        models.append((d, m))
    ident = ("adapter", "checkpoint", "tokenizer", "bundle", "preset", "adapter_options", "factory")
    first_dir, first = models[0]
    for d, m in models[1:]:
        other = [k for k in ident if m.get(k) != first.get(k)]
        if other:
            raise ModelsDifferError(f"{first_dir.name} and {d.name} were recorded with different models (model.{other[0]}: "
                             f"{first.get(other[0])!r} and {m.get(other[0])!r}); evaluate them apart, or choose "
                             "the model with --checkpoint / --preset / --engine")
    return first


def read_recording(path: str | Path, use_rtc: bool = True, max_guidance_weight: float | None = None) -> list[Episode]:
    """A `run --record` folder, or a folder of them, -> episodes (frames in inference order).
    `max_guidance_weight`: RTC's beta for the guided requests; None: the one each recording says
    its daemon ran with (5.0, the daemon's default, for a recording that does not say)."""
    episodes = []
    for d in _recording_dirs(path):
        meta = json.loads((d / "meta.json").read_text())
        s = int(meta.get("execution_horizon") or 0)
        beta = max_guidance_weight if max_guidance_weight is not None else float(meta.get("max_guidance_weight", 5.0))
        ep = Episode(d.name)
        if isinstance(meta.get("absent_cameras"), list):
            ep.absent_cameras = tuple(str(n) for n in meta["absent_cameras"])
        room = meta.get("prompt_room")
        if isinstance(room, dict) and isinstance(room.get("prompts"), list):
            ep.prompt_room = (tuple(str(p) for p in room["prompts"]), int(room.get("tokens") or 0))
        unreadable: list[str] = []
        for number, f in enumerate(sorted(d.glob("obs_*.npz"))):
            try:
                frame = _read_frame(f, number, use_rtc, s, beta)
            except UNREADABLE as exc:  # a copy cut short, an empty file: the others still count
                unreadable.append(f"{f.name} ({type(exc).__name__})")
                continue
            if frame is not None:
                ep.frames.append(frame)
        if unreadable:
            log.warning("%s: left out %d unreadable record(s): %s", d, len(unreadable),
                        ", ".join(unreadable[:5]) + (" ..." if len(unreadable) > 5 else ""))
        episodes.append(ep)
    return episodes


def _read_frame(f: Path, number: int, use_rtc: bool, s: int, beta: float) -> Frame | None:
    """One record -> its frame; None for an inference the daemon got no actions for."""
    with np.load(f, allow_pickle=False) as z:
        if str(_scalar(z, "error", "")):
            return None  # the daemon got no actions for it; nothing to compare against
        images = {k[len("image."):]: z[k] for k in z.files if k.startswith("image.")}
        obs = Observation(images=images, state=z["state"].astype(np.float32), prompt=str(_scalar(z, "prompt", "")),
                          timestamp=float(_scalar(z, "timestamp", 0.0)))
        rtc = None
        mode = str(_scalar(z, "rtc_mode", "none"))
        prefix = z["prefix"] if "prefix" in z.files else np.zeros(0)
        if use_rtc and mode in SOLVER_RTC_MODES and prefix.size:
            # The delay the daemon asked the solver for is its estimate at submit time.
            d_req = int(_scalar(z, "delay_estimate", _scalar(z, "delay", 0)))
            rtc = RTCRequest(mode, prefix.astype(np.float32), min(d_req, len(prefix)), s,  # type: ignore[arg-type]
                             beta)
        target = z["actions"].astype(np.float32) if "actions" in z.files and z["actions"].size else None
        seed = _scalar(z, "noise_seed", None)
        if seed is not None and "job_id" in z.files:
            return Frame(obs, rtc, target, int(_scalar(z, "job_id", 0)), int(seed))
        # recorded before the daemon drew keyed noise, or by a policy without it
        return Frame(obs, rtc, target, number)


def write_synthetic_recording(path: str | Path, episodes: int = 2, frames: int = 4, camera_names: Sequence[str] = (
        "top", "left_wrist", "right_wrist"), state_dim: int = 14, action_dim: int = 14, horizon: int = 50,
        image_hw: tuple[int, int] = (48, 64), rtc_mode: str = "guided-approx", execution_horizon: int = 25,
        seed: int = 0) -> Path:
    """A folder of recordings in the daemon's `--record` layout, with random content (tests,
    and trying `phyai-edge eval` without a robot)."""
    rng = np.random.default_rng(seed)
    root = Path(path)
    for e in range(episodes):
        d = root / f"episode_{e:03d}"
        d.mkdir(parents=True, exist_ok=True)
        meta = {"policy": {"chunk_size": horizon, "action_dim": action_dim, "state_dim": state_dim,
                           "camera_names": list(camera_names)}, "rtc_mode": rtc_mode, "horizon": horizon,
                "execution_horizon": execution_horizon, "synthetic": True}
        (d / "meta.json").write_text(json.dumps(meta, indent=2))
        prev = None
        for i in range(frames):
            arrays: dict[str, Any] = {f"image.{c}": rng.integers(0, 256, (*image_hw, 3), dtype=np.uint8)
                                      for c in camera_names}
            actions = rng.uniform(-1, 1, (horizon, action_dim)).astype(np.float32)
            delay = 3
            prefix = prev[execution_horizon:] if prev is not None else np.zeros((0, action_dim), np.float32)
            arrays.update(state=rng.uniform(-1, 1, state_dim).astype(np.float32), timestamp=np.float64(i * 0.5),
                          prompt=np.array("pick up the cube"), rtc_mode=np.array(rtc_mode), prefix=prefix,
                          delay_estimate=np.int64(delay), start_slot=np.int64(i * execution_horizon),
                          actions=actions, delay=np.int64(delay), error=np.array(""), job_id=np.int64(i + 1))
            np.savez(d / f"obs_{i + 1:06d}.npz", **arrays)
            prev = actions
    return root


def read_lerobot(path: str | Path, horizon: int, camera_map: dict[str, str] | None = None, prompt: str = "",
                 episodes: Sequence[int] | None = None, max_frames: int | None = None, stride: int = 1) -> list[Episode]:
    """A LeRobot dataset folder -> episodes. camera_map: model camera name -> dataset column
    (default: columns `observation.images.<name>` matched by name)."""
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise RuntimeError(f"reading a LeRobot dataset needs pyarrow: {install_hint('pyarrow')}") from exc
    root = Path(path)
    info_path = root / "meta" / "info.json"
    if not info_path.exists():
        raise ValueError(f"{root}: no meta/info.json; is it a LeRobot dataset folder?")
    info = json.loads(info_path.read_text())
    features = info.get("features", {})
    tasks = _lerobot_tasks(root)
    files = sorted((root / "data").rglob("*.parquet"))
    if not files:
        raise ValueError(f"{root}/data: no parquet files")
    table = {}
    for f in files:
        for k, v in pq.read_table(f).to_pydict().items():
            table.setdefault(k, []).extend(v)
    for col in ("observation.state", "action", "episode_index", "frame_index"):
        if col not in table:
            raise ValueError(f"{root}: column {col!r} missing (have {sorted(table)})")
    image_cols = [k for k, f in features.items() if f.get("dtype") in ("image", "video")]
    cmap = camera_map or {k.split(".")[-1]: k for k in image_cols}
    for cam, col in cmap.items():
        if col not in features:
            raise ValueError(f"camera {cam!r}: dataset has no feature {col!r} (image features: {image_cols})")
    ep_ids = np.asarray(table["episode_index"])
    out = []
    for e in sorted(set(ep_ids.tolist())):
        if episodes is not None and e not in episodes:
            continue
        rows = np.flatnonzero(ep_ids == e)
        rows = rows[np.argsort(np.asarray(table["frame_index"])[rows])]
        actions = np.asarray([table["action"][r] for r in rows], dtype=np.float32)
        videos = {cam: _VideoFrames(root, info, col, e) for cam, col in cmap.items() if features[col]["dtype"] == "video"}
        ep = Episode(f"episode_{e:06d}", index=int(e))
        picks = list(range(0, len(rows), stride))[:max_frames]
        for t in picks:
            r = rows[t]
            images = {}
            for cam, col in cmap.items():
                images[cam] = videos[cam].frame(int(table["frame_index"][r])) if cam in videos else _decode_image(table[col][r], cam)
            task = prompt or tasks.get(int(table["task_index"][r]) if "task_index" in table else -1, "")
            obs = Observation(images=images, state=np.asarray(table["observation.state"][r], np.float32), prompt=task,
                              timestamp=float(table["timestamp"][r]) if "timestamp" in table else 0.0)
            ep.frames.append(Frame(obs, None, actions[t:t + horizon], int(table["frame_index"][r])))
        out.append(ep)
    return out


def _lerobot_tasks(root: Path) -> dict[int, str]:
    tasks: dict[int, str] = {}
    jl = root / "meta" / "tasks.jsonl"
    if jl.exists():
        for line in jl.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                tasks[int(rec["task_index"])] = str(rec["task"])
    return tasks


def _decode_image(cell: Any, cam: str) -> np.ndarray:
    import cv2

    data = cell.get("bytes") if isinstance(cell, dict) else cell
    if not data:
        raise ValueError(f"camera {cam!r}: image cell has no embedded bytes")
    img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    if img is None:
        raise ValueError(f"camera {cam!r}: could not decode the embedded image")
    return np.ascontiguousarray(img[..., ::-1])  # OpenCV decodes to BGR; the model takes RGB


class _VideoFrames:
    """LeRobot v2.x: one video per episode and camera, decoded once on first use."""

    def __init__(self, root: Path, info: dict[str, Any], key: str, episode: int) -> None:
        pattern = info.get("video_path", "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4")
        chunk = episode // int(info.get("chunks_size", 1000))
        self.path = root / pattern.format(episode_chunk=chunk, video_key=key, episode_index=episode)
        self._frames: list[np.ndarray] | None = None

    def frame(self, i: int) -> np.ndarray:
        if self._frames is None:
            import cv2

            if not self.path.exists():
                raise FileNotFoundError(f"video {self.path} not found (only LeRobot v2.x per-episode videos are read)")
            cap = cv2.VideoCapture(str(self.path))
            frames = []
            ok, img = cap.read()
            while ok:
                frames.append(np.ascontiguousarray(img[..., ::-1]))
                ok, img = cap.read()
            cap.release()
            self._frames = frames
        return self._frames[min(i, len(self._frames) - 1)]


# -- evaluation ----------------------------------------------------------------------------
@dataclass
class EpisodeReport:
    name: str
    frames: int
    recorded_mae: float = math.nan
    recorded_max: float = math.nan
    reference_mae: float = math.nan
    reference_max: float = math.nan
    failures: int = 0


_Flat = tuple[int, tuple[int, int, int], Frame]  # (episode position, noise key, frame)


def _batches(frames: list[_Flat], size: int) -> Iterator[list[_Flat]]:
    for i in range(0, len(frames), size):
        yield frames[i:i + size]


def _recorded_noise(f: Frame) -> tuple[int, int, int] | None:
    """(seed, 0, frame) of the noise the daemon made the frame's chunk with; None for recordings
    from before keyed noise."""
    if f.noise_seed is None or f.index is None:
        return None
    return f.noise_seed, 0, f.index


def _noise_key(f: Frame, position: int, episode: int, seed: int) -> tuple[int, int, int]:
    """(seed, episode, frame) of the frame's noise: the daemon's own where it recorded it."""
    return _recorded_noise(f) or (seed, episode, f.index if f.index is not None else position)


def _predict(policy: Any, batch: list[_Flat], batch_sizes: Sequence[int] | None) -> list[Any]:
    a = policy.adapter
    items = [BatchItem([f.obs], f.rtc, frame_noise(seed, e, i, a.chunk_size, a.model_action_dim))
             for _, (seed, e, i), f in batch]
    return run_items(policy, items, batch_sizes)


class _Error:
    """Absolute action error pooled over every compared value: a frame weighs by how many
    recorded actions it is compared with (fewer at an episode's end, where the chunk runs past
    the recording), so a frame with one action left counts one action's worth, not a chunk's."""

    def __init__(self) -> None:
        self.total, self.count, self.max = 0.0, 0, -math.inf

    def add(self, diff: np.ndarray) -> None:
        self.total += float(diff.sum(dtype=np.float64))
        self.count += diff.size
        self.max = max(self.max, float(diff.max()))

    def merge(self, other: _Error) -> None:
        self.total, self.count, self.max = self.total + other.total, self.count + other.count, max(self.max, other.max)

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else math.nan

    @property
    def maximum(self) -> float:
        return self.max if self.count else math.nan


def _finite(r: Any) -> bool:
    return r is not None and r.actions is not None and bool(np.isfinite(r.actions).all())


@contextlib.contextmanager
def _as_recorded(policies: Sequence[Any], episodes: list[Episode]) -> Iterator[None]:
    """Run the policies as the recordings' daemon ran them, for as long as the replay lasts: its
    absent cameras left out (where every episode names the same ones) and its prompt room kept.
    A policy without these switches, or episodes that do not say, run as they are."""
    absent = {ep.absent_cameras for ep in episodes}
    rooms = [ep.prompt_room for ep in episodes if ep.prompt_room is not None]
    saved = []
    try:
        for p in policies:
            engine = getattr(p, "engine", None)
            saved.append((p, getattr(p, "absent_cameras", None), getattr(engine, "min_prompt_positions", None)))
            if len(absent) == 1 and None not in absent and hasattr(p, "set_absent_cameras"):
                names = next(iter(absent))
                assert names is not None
                p.set_absent_cameras([n for n in names if n in p.camera_names])
            if rooms and hasattr(p, "fix_prompt_positions"):
                p.fix_prompt_positions([q for prompts, _ in rooms for q in prompts], at_least=max(t for _, t in rooms))
        yield
    finally:
        for p, cams, floor in saved:
            if cams is not None:
                p.set_absent_cameras(sorted(cams))
            if floor is not None:
                p.engine.min_prompt_positions = floor


def evaluate(policy: Any, episodes: list[Episode], reference: Any = None, batch: int = 8, seed: int = 0,
             batch_sizes: Sequence[int] | None = None) -> dict[str, Any]:
    """Replay every frame through `policy` (and `reference`, with the same noise), in batches
    of `batch` frames; returns per-episode and overall error tables as a dict. A frame fails
    when either engine raised or returned a non-finite action (a NaN would otherwise read as
    "nothing to compare"); its errors are not counted."""
    width = policy.action_dim
    for ep in episodes:
        bad = next((f.target.shape for f in ep.frames if f.target is not None and f.target.size
                    and (f.target.ndim != 2 or f.target.shape[1] != width)), None)
        if bad is not None:
            raise ValueError(f"episode {ep.name}: its recorded actions are {tuple(bad)} per frame, the policy "
                             f"outputs {width} values an action: a dataset for another robot, or a camera/state map "
                             "that does not fit this policy")
    flat = [(e, _noise_key(f, i, ep.index if ep.index is not None else e, seed), f)
            for e, ep in enumerate(episodes) for i, f in enumerate(ep.frames)]
    rec = [_Error() for _ in episodes]
    ref = [_Error() for _ in episodes]
    failures = [0] * len(episodes)
    with _as_recorded([policy] if reference is None else [policy, reference], episodes):
        for chunk in _batches(flat, max(1, batch)):
            got = _predict(policy, chunk, batch_sizes)
            other = _predict(reference, chunk, batch_sizes) if reference is not None else [None] * len(chunk)
            for (e, _, f), r, rr in zip(chunk, got, other):
                if not _finite(r) or (reference is not None and not _finite(rr)):
                    failures[e] += 1
                    continue
                pred = r.actions[0]
                if f.target is not None and f.target.size:
                    n = min(len(f.target), len(pred))
                    rec[e].add(np.abs(pred[:n] - f.target[:n]))
                if rr is not None:
                    ref[e].add(np.abs(pred - rr.actions[0]))
    reports = [EpisodeReport(ep.name, len(ep.frames), rec[e].mean, rec[e].maximum, ref[e].mean, ref[e].maximum,
                             failures[e]) for e, ep in enumerate(episodes)]
    rec_all, ref_all = _Error(), _Error()
    for e in range(len(episodes)):
        rec_all.merge(rec[e])
        ref_all.merge(ref[e])
    return {
        "episodes": [r.__dict__ for r in reports],
        "overall": {"frames": len(flat), "recorded_mae": rec_all.mean, "recorded_max": rec_all.maximum,
                    "reference_mae": ref_all.mean, "reference_max": ref_all.maximum, "failures": sum(failures),
                    "recorded_noise": sum(_recorded_noise(f) is not None for _, _, f in flat)},
    }


def format_eval(rep: dict[str, Any]) -> str:
    def f(x: float) -> str:
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3g}"

    lines = [f"{'episode':<24}{'frames':>7}{'rec MAE':>10}{'rec max':>10}{'ref MAE':>10}{'ref max':>10}{'fail':>6}"]
    for r in rep["episodes"]:
        lines.append(f"{r['name'][:23]:<24}{r['frames']:>7}{f(r['recorded_mae']):>10}{f(r['recorded_max']):>10}"
                     f"{f(r['reference_mae']):>10}{f(r['reference_max']):>10}{r['failures']:>6}")
    o = rep["overall"]
    lines.append(f"{'all':<24}{o['frames']:>7}{f(o['recorded_mae']):>10}{f(o['recorded_max']):>10}"
                 f"{f(o['reference_mae']):>10}{f(o['reference_max']):>10}{o['failures']:>6}")
    kept, frames = o.get("recorded_noise", 0), o["frames"]
    if kept and kept == frames:
        lines.append("noise: every frame's as its recorded chunk drew it (rec columns: the engines' difference)")
    elif not math.isnan(o["recorded_mae"]):
        lines.append(f"noise: {kept} of {frames} frames' as their recorded chunk drew it; the rest drew --seed's, so "
                     "their rec columns include the policy's sampling spread")
    return "\n".join(lines)
