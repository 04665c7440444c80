"""Drive a gymnasium vector environment with the RL rollout API: N environments, one batched
engine call per chunk, per-environment noise and Real-Time Chunking state.

    python examples/rollout_gymnasium.py --envs 8 --steps 100
    python examples/rollout_gymnasium.py --envs 64 --device cuda --checkpoint ~/ckpt/pi05 --dtype bfloat16

The environment is a toy bimanual "reach": 14 joints that should move towards a target, seen by
three small cameras that draw the joint error. It stands in for a simulator (ALOHA in MuJoCo,
LIBERO, ...): what matters here is the loop, not the task. Needs `pip install 'phyai-edge[rl]'`.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

try:
    import gymnasium as gym
    from gymnasium import spaces
except ImportError as exc:  # the example is optional; say what to install
    raise SystemExit("this example needs gymnasium: pip install 'phyai-edge[rl]'") from exc

from phyai_edge.adapters.base import Observation
from phyai_edge.engines.policy import load_policy
from phyai_edge.serve.rollout import RolloutChunks, RolloutPolicy

CAMERAS = ("top", "left_wrist", "right_wrist")


class ReachEnv(gym.Env):
    """Joints in [-1, 1] move by the commanded delta; reward is minus the distance to a target."""

    metadata = {"render_modes": []}  # noqa: RUF012 - gymnasium reads this class attribute

    def __init__(self, dim: int = 14, image_hw: tuple[int, int] = (48, 64), max_steps: int = 60) -> None:
        self.dim, self.image_hw, self.max_steps = dim, image_hw, max_steps
        img = spaces.Box(0, 255, (*image_hw, 3), np.uint8)
        self.observation_space = spaces.Dict({
            "state": spaces.Box(-1.0, 1.0, (dim,), np.float32),
            **{c: img for c in CAMERAS},
        })
        self.action_space = spaces.Box(-1.0, 1.0, (dim,), np.float32)

    def _obs(self) -> dict[str, np.ndarray]:
        h, w = self.image_hw
        err = self.target - self.state
        out = {"state": self.state.copy()}
        for i, c in enumerate(CAMERAS):
            # Each camera draws a bar per joint whose height is that joint's error: a cheap
            # image that still changes with the state.
            img = np.zeros((h, w, 3), np.uint8)
            cols = np.linspace(0, w, self.dim + 1).astype(int)
            for j in range(self.dim):
                top = int((1 - (err[j] + 2) / 4) * (h - 1))
                img[top:, cols[j]:cols[j + 1], i] = 200
            out[c] = img
        return out

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        super().reset(seed=seed)
        self.state = self.np_random.uniform(-0.5, 0.5, self.dim).astype(np.float32)
        self.target = self.np_random.uniform(-0.5, 0.5, self.dim).astype(np.float32)
        self.t = 0
        return self._obs(), {}

    def step(self, action: np.ndarray) -> tuple[dict, float, bool, bool, dict]:
        self.state = np.clip(self.state + 0.05 * np.clip(action, -1, 1), -1, 1).astype(np.float32)
        self.t += 1
        reward = -float(np.linalg.norm(self.target - self.state))
        return self._obs(), reward, False, self.t >= self.max_steps, {}


def observations(obs: dict[str, np.ndarray], n: int, prompt: str) -> list[Observation]:
    """The vector env's batched dict -> one `Observation` per environment."""
    return [Observation(images={c: obs[c][i] for c in CAMERAS}, state=obs["state"][i], prompt=prompt) for i in range(n)]


def rollout(num_envs: int = 8, steps: int = 100, execution_horizon: int = 25, delay: int = 0,
            mode: str = "guided-approx", seed: int = 0, **load_kwargs: Any) -> dict[str, Any]:
    """Run `steps` environment steps in each of `num_envs` environments; returns a summary."""
    policy = load_policy(seed=seed, **load_kwargs)
    runner = RolloutPolicy(policy, seed=seed)
    envs = gym.vector.SyncVectorEnv([lambda: ReachEnv() for _ in range(num_envs)],
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    chunks = RolloutChunks(num_envs, mode=mode, execution_horizon=execution_horizon)  # type: ignore[arg-type]
    obs, _ = envs.reset(seed=seed)
    total_reward = np.zeros(num_envs)
    since = np.zeros(num_envs, dtype=np.int64)  # actions each environment ran from its newest chunk
    fresh = np.ones(num_envs, dtype=bool)  # no chunk yet (start, or its episode just ended)
    infer_s, calls, samples = 0.0, 0, 0
    for _ in range(steps):
        # Environments infer on their own schedule: every s actions, or at once after a reset.
        due = np.flatnonzero(fresh | (since >= execution_horizon))
        if due.size:
            all_obs = observations(obs, num_envs, "reach the target")
            requests = chunks.requests(delay)
            t0 = time.perf_counter()
            out = runner.act([all_obs[e] for e in due], rtc=[requests[e] for e in due], env_ids=due.tolist())
            infer_s += time.perf_counter() - t0
            calls, samples = calls + 1, samples + due.size
            chunks.update(out.actions, delay, env_ids=due.tolist())
            since[due] = 0
            fresh[due] = False
        obs, reward, terminated, truncated, _ = envs.step(chunks.next_actions())
        since += 1
        total_reward += reward
        done = np.flatnonzero(terminated | truncated)
        if done.size:
            chunks.reset(done.tolist())  # a new episode starts without RTC against the old one
            fresh[done] = True
    envs.close()
    return {"envs": num_envs, "steps": steps, "inferences": calls, "mean_return": float(total_reward.mean()),
            "samples_per_s": samples / infer_s if infer_s else 0.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--envs", type=int, default=8)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--execution-horizon", type=int, default=25, help="s: actions run before the next inference")
    p.add_argument("--delay", type=int, default=0, help="simulated inference delay d in control ticks")
    p.add_argument("--checkpoint")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    a = p.parse_args()
    res = rollout(a.envs, a.steps, a.execution_horizon, a.delay, checkpoint=a.checkpoint, preset=a.preset,
                  device=a.device, dtype=a.dtype)
    print(f"{res['envs']} envs x {res['steps']} steps: {res['inferences']} batched inferences, "
          f"mean return {res['mean_return']:.2f}, {res['samples_per_s']:.1f} samples/s")


if __name__ == "__main__":
    main()
