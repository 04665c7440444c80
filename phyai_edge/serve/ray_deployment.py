"""The same server beyond one machine: the engine as a Ray Serve deployment.

`PolicyDeployment` holds one `Policy` per replica (one GPU each with `gpus_per_replica=1`;
Ray places replicas across GPUs and hosts) and runs requests through the same batcher as the
local server (`batching.run_items`), so a replica gives the same actions as the daemon,
`eval`, the rollout API and the local server for the same observation and noise.

Two ways in:
- `run(items)`: an already formed batch from the ZeroMQ front (`phyai-edge serve --ray`):
  the front keeps intake, deadlines, back-pressure and fairness; `RayExecutor` sends each
  batch to a replica, one batch in flight per replica (the front runs one worker thread each);
- `infer(item)`: one request from a Ray-native caller (e.g. RL rollout workers in the same
  cluster); Ray Serve's own `@serve.batch` joins concurrent calls inside the replica.

Needs `pip install 'phyai-edge[ray]'` (ray[serve]); nothing else in the package imports ray.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from phyai_edge.extras import install_hint
from phyai_edge.serve.batching import BatchItem, ItemResult, run_items
from phyai_edge.serve.server import describe_policy

try:
    from ray import serve
except ImportError as exc:  # pragma: no cover - exercised only without ray
    raise ImportError(f"the Ray Serve deployment needs ray[serve]: {install_hint('ray')}") from exc


@serve.deployment(name="phyai_edge_policy", max_ongoing_requests=64)
class PolicyDeployment:
    def __init__(self, load_kwargs: dict[str, Any], batch_sizes: Sequence[int] | None = None,
                 max_batch: int | None = None, threads: int = 0) -> None:
        import torch

        from phyai_edge.engines.policy import load_policy

        if threads:
            torch.set_num_threads(threads)
        self.policy = load_policy(**load_kwargs)
        self.batch_sizes = list(batch_sizes) if batch_sizes else None
        self.max_batch = max_batch
        if max_batch:
            self.infer.set_max_batch_size(max_batch)

    def describe(self) -> dict[str, Any]:
        return describe_policy(self.policy)

    def run(self, items: list[BatchItem]) -> list[ItemResult]:
        return run_items(self.policy, items, self.batch_sizes, self.max_batch, strict_prompts=True)

    def prompt_fit(self, prompt: str) -> tuple[int | None, int | None, int | None]:
        """`Policy.prompt_fit` in the replica: every replica loads the same policy and none keeps
        prompt room (no warm-up), so any one answers for all."""
        return self.policy.prompt_fit(prompt)

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.005)
    async def infer(self, items: list[BatchItem]) -> list[ItemResult]:
        return run_items(self.policy, items, self.batch_sizes, self.max_batch, strict_prompts=True)


class RayExecutor:
    """The server's executor when the engine runs as Ray Serve replicas."""

    def __init__(self, handle: Any, app_name: str = "phyai_edge") -> None:
        self.handle = handle
        self.app_name = app_name
        self._describe = handle.describe.remote().result()

    @classmethod
    def deploy(cls, load_kwargs: dict[str, Any], replicas: int = 1, gpus_per_replica: float = 0.0,
               cpus_per_replica: float = 1.0, batch_sizes: Sequence[int] | None = None, max_batch: int | None = None,
               address: str | None = None, threads: int = 0, app_name: str = "phyai_edge") -> RayExecutor:
        """Start (or join) Ray, deploy `replicas` copies of the policy, return the executor."""
        import ray

        if not ray.is_initialized():
            ray.init(address=address, include_dashboard=False, logging_level="warning")
        app = PolicyDeployment.options(
            num_replicas=replicas,
            ray_actor_options={"num_gpus": gpus_per_replica, "num_cpus": cpus_per_replica},
        ).bind(load_kwargs, list(batch_sizes) if batch_sizes else None, max_batch, threads)
        handle = serve.run(app, name=app_name, route_prefix=None)
        return cls(handle, app_name)

    def describe(self) -> dict[str, Any]:
        return dict(self._describe)

    def run(self, items: list[BatchItem]) -> list[ItemResult]:
        return self.handle.run.remote(items).result()

    @property
    def policy(self) -> _ReplicaPromptFit:
        """What the server asks of its executor's policy (`prompt_fit`), answered by a replica."""
        return _ReplicaPromptFit(self.handle)

    def shutdown(self) -> None:
        serve.delete(self.app_name)


class _ReplicaPromptFit:
    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def prompt_fit(self, prompt: str) -> tuple[int | None, int | None, int | None]:
        tokens, room, most = self.handle.prompt_fit.remote(prompt).result()
        return tokens, room, most
