"""The ALOHA bimanual scene of gym-aloha, driven as raw MuJoCo with one cheap camera.

gym-aloha's `AlohaEnv.step` renders three 640x480 cameras with shadows and 4x multisampling on
every step (about 3 steps/s on a 2-core CPU). A robot process at 50 Hz needs much less: we load
the same XML, apply actions and read joints exactly as `gym_aloha.tasks.sim` does, and render
only the top camera with shadows, reflections and multisampling off, when asked.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

# Order of the 14 joint values in state and actions (gym_aloha.constants.JOINTS).
JOINT_NAMES: tuple[str, ...] = (
    "left_waist", "left_shoulder", "left_elbow", "left_forearm_roll", "left_wrist_angle",
    "left_wrist_rotate", "left_gripper",
    "right_waist", "right_shoulder", "right_elbow", "right_forearm_roll", "right_wrist_angle",
    "right_wrist_rotate", "right_gripper",
)
GRIPPERS = (6, 13)  # normalised gripper opening (0 closed, 1 open), not an angle
TASKS = {"transfer_cube": "bimanual_viperx_transfer_cube.xml", "insertion": "bimanual_viperx_insertion.xml"}


@dataclass
class RenderSettings:
    shadows: bool = False  # shadows alone cost ~8x per frame on a CPU GL path
    reflections: bool = False
    samples: int = 0  # offscreen multisampling; the scene XML asks for 4


class AlohaSim:
    """Physics at 2 ms or less, one control step = whole substeps of exactly `control_dt` (10 at 50 Hz)."""

    def __init__(
        self,
        task: str = "transfer_cube",
        control_dt: float = 0.02,
        render: RenderSettings | None = None,
        seed: int | None = 0,
    ) -> None:
        # Headless unless told otherwise: EGL needs no X server. MuJoCo reads this when it is
        # first imported, so a process that imported it earlier keeps its own choice.
        os.environ.setdefault("MUJOCO_GL", "egl")
        import mujoco  # lazily: the `sim` extra
        from gym_aloha.constants import ASSETS_DIR

        if task not in TASKS:
            raise ValueError(f"task: expected one of {', '.join(TASKS)}, got {task!r}")
        self._mj = mujoco
        self.task = task
        self.model = mujoco.MjModel.from_xml_path(str(ASSETS_DIR / TASKS[task]))
        self.data = mujoco.MjData(self.model)
        self.control_dt = control_dt
        # Whole substeps that add up to exactly one control period, none longer than the scene's
        # 2 ms: rounding the count alone ran the physics 4% slow at 60 Hz and twice as fast as the
        # clock at 1000 Hz (one 2 ms step per 1 ms period). The 1e-9 keeps a whole number of steps
        # that float division left a hair above it (no extra substep for rounding noise).
        self.substeps = max(1, math.ceil(control_dt / self.model.opt.timestep - 1e-9))
        self.model.opt.timestep = control_dt / self.substeps
        self.settings = render or RenderSettings()
        self._renderers: dict[tuple[int, int], Any] = {}
        self._scene_option = mujoco.MjvOption()
        self.reset(seed)

    # ------------------------------------------------------------ episode

    def reset(self, seed: int | None = 0) -> np.ndarray:
        """Arms at gym-aloha's start pose, objects at the pose gym-aloha samples for `seed`."""
        from gym_aloha.constants import START_ARM_POSE
        from gym_aloha.utils import sample_box_pose, sample_insertion_pose

        mj, m, d = self._mj, self.model, self.data
        mj.mj_resetData(m, d)
        d.qpos[:16] = START_ARM_POSE
        d.ctrl[:] = START_ARM_POSE
        if self.task == "transfer_cube":
            d.qpos[-7:] = sample_box_pose(seed)
        else:
            d.qpos[-14:] = np.concatenate(sample_insertion_pose(seed))
        mj.mj_forward(m, d)
        self.target = self.joint_state().astype(np.float64)
        return self.target.astype(np.float32)

    # ------------------------------------------------------------ control

    def step(self, target: np.ndarray) -> None:
        """Hold `target` (14 absolute joint targets, grippers normalised) for one control period."""
        from gym_aloha.constants import unnormalize_puppet_gripper_position as unnorm

        a = np.asarray(target, dtype=np.float64)
        if a.shape != (14,):
            raise ValueError(f"action: expected 14 values, got shape {a.shape}")
        self.target = a
        # The same mapping as gym_aloha BimanualViperXTask.before_step: each gripper value drives
        # two mirrored finger sliders. MuJoCo clamps to ctrlrange (ctrllimited="true").
        left_g, right_g = unnorm(a[6]), unnorm(a[13])
        ctrl = np.concatenate([a[:6], [left_g, -left_g], a[7:13], [right_g, -right_g]])
        self.data.ctrl[:] = ctrl
        self._mj.mj_step(self.model, self.data, nstep=self.substeps)

    def joint_state(self) -> np.ndarray:
        """14 values as gym-aloha's `qpos` observation: 6 arm joints + normalised gripper, per arm."""
        from gym_aloha.constants import normalize_puppet_gripper_position as norm

        q = self.data.qpos
        return np.concatenate([q[0:6], [norm(q[6])], q[8:14], [norm(q[14])]]).astype(np.float32)

    def joint_velocity(self) -> np.ndarray:
        v = self.data.qvel
        return np.concatenate([v[0:6], [v[6]], v[8:14], [v[14]]]).astype(np.float32)

    @property
    def sim_time(self) -> float:
        return float(self.data.time)

    # ------------------------------------------------------------ camera

    def _renderer_for(self, width: int, height: int) -> Any:
        """One renderer (GL context and buffers) per image size, made on first use."""
        key = (width, height)
        r = self._renderers.get(key)
        if r is None:
            mj, s = self._mj, self.settings
            # Buffer size and multisampling are read from the model when the GL context is made.
            self.model.vis.quality.offsamples = s.samples
            self.model.vis.global_.offwidth = max(self.model.vis.global_.offwidth, width)
            self.model.vis.global_.offheight = max(self.model.vis.global_.offheight, height)
            r = mj.Renderer(self.model, height, width)
            self._renderers[key] = r
        return r

    def render(self, camera: str = "top", width: int = 640, height: int = 480) -> np.ndarray:
        """One MuJoCo camera as uint8 HxWx3 RGB (a fresh array the caller may keep)."""
        mj, s = self._mj, self.settings
        r = self._renderer_for(width, height)
        r.update_scene(self.data, camera=camera, scene_option=self._scene_option)
        # update_scene leaves the scene flags alone, but set them every frame anyway: they are
        # two integer stores and a renderer made elsewhere would otherwise keep its defaults.
        r.scene.flags[mj.mjtRndFlag.mjRND_SHADOW] = int(s.shadows)
        r.scene.flags[mj.mjtRndFlag.mjRND_REFLECTION] = int(s.reflections)
        return r.render()

    def camera_names(self) -> list[str]:
        return [self.model.camera(i).name for i in range(self.model.ncam)]

    def time_render(self, camera: str = "top", width: int = 640, height: int = 480, n: int = 20) -> float:
        """Median seconds per frame (after a warm-up frame), for the start-up log and the docs."""
        self.render(camera, width, height)
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.render(camera, width, height)
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    def close(self) -> None:
        for r in self._renderers.values():
            r.close()
        self._renderers.clear()
