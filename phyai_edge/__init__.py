"""PhyAI-Edge: one model code path from a VLA checkpoint to a robot."""

__version__ = "0.1.0"
