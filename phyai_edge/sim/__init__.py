"""A simulated robot for the daemon: gym-aloha's MuJoCo ALOHA arm pair as a separate process.

Nothing in `phyai_edge.control` imports this package: the daemon never pulls in MuJoCo. The
`sim` extra (gym-aloha, dm-control, mujoco) is needed only by `phyai-edge sim` and its tests.
"""
