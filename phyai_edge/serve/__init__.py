"""Many robots on one GPU, RL rollout batches and batch evaluation over the same adapter and
engine as the daemon (docs/scenarios.md).

Deliberately imports nothing: `serve.client` and `serve.wire` (the robot side) must load
without torch, so the torch-using modules are imported by name where they are needed.
"""
