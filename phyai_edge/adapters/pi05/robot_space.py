"""Robot conventions a policy was trained in that its checkpoint folder does not record.

openpi trains its ALOHA policies (`AlohaInputs` / `AlohaOutputs` with `adapt_to_pi`, on by
default in its configs) in the joint space of Physical Intelligence's own ALOHA runtime, while the
robots, their LeRobot datasets and gym-aloha report the standard ALOHA space. openpi converts
both ways in its policy transforms; an openpi folder keeps only the weights and the statistics
(computed in the policy's space), so a robot in ALOHA space needs the conversion here
(`robot_space = "aloha"`). Without it the shoulder and elbow would be driven the wrong way and
the gripper commanded on the wrong scale.

Where it sits: the robot's state is converted before it is normalised (the prompt's bins) and
before a relative policy's offsets are anchored to it; the chunk is converted back after those
offsets are added; an RTC prefix goes the other way first. As openpi orders its transforms.
"""

from __future__ import annotations

import numpy as np

ROBOT_SPACES = ("model", "aloha")


class AlohaSpace:
    """Standard ALOHA (2 x [6 joint angles, gripper]) <-> the space openpi's ALOHA policies use."""

    name = "aloha"
    width = 14
    grippers = (6, 13)
    # The shoulder and elbow of each arm turn the other way in the policy's space.
    sign = np.array([1, -1, -1, 1, 1, 1, 1] * 2, dtype=np.float64)
    # The state's gripper: ALOHA reports the puppet's finger position normalised over its travel
    # (metres, closed .. open); the policy was trained on the servo angle normalised over the
    # encoder range it was calibrated to (2405 .. 3110 of 4096 counts about 2048, in radians).
    finger_m = (0.01844, 0.05800)
    servo_rad = (0.5476, 1.6296)
    # The linkage between the servo horn and the finger (Interbotix's gripper geometry).
    horn_m, link_m = 0.022, 0.036
    # The action's gripper: the policy predicts the servo angle less its lower end (radians);
    # ALOHA takes the puppet's gripper joint normalised over its range (radians, closed .. open).
    joint_rad = (-0.6213, 1.4910)

    def state_to_model(self, states: np.ndarray) -> np.ndarray:
        """(..., 14) robot states -> the policy's space."""
        s = np.asarray(states, dtype=np.float64) * self.sign
        g = s[..., self.grippers]
        lo, hi = self.finger_m
        finger = lo + g * (hi - lo)
        r, link = self.horn_m, self.link_m
        with np.errstate(divide="ignore", invalid="ignore"):
            angle = np.arcsin(np.clip((r * r + finger * finger - link * link) / (2 * r * finger), -1.0, 1.0))
        wrong = (finger <= 0) | ~np.isfinite(angle)  # a finger at or past the gripper's centre
        if wrong.any():
            bad = g[wrong].ravel()[0]
            raise ValueError(f"robot_space 'aloha': gripper state {bad:g} is outside what an ALOHA gripper reports "
                             "(its finger position normalised over its travel, 0 closed to 1 open)")
        lo, hi = self.servo_rad
        s[..., self.grippers] = (angle - lo) / (hi - lo)
        return s.astype(np.float32)

    def actions_from_model(self, actions: np.ndarray) -> np.ndarray:
        """(..., 14) actions in the policy's space -> the robot's."""
        a = np.asarray(actions, dtype=np.float64) * self.sign
        lo, hi = self.joint_rad
        a[..., self.grippers] = (a[..., self.grippers] + self.servo_rad[0] - lo) / (hi - lo)
        return a.astype(np.float32)

    def actions_to_model(self, actions: np.ndarray) -> np.ndarray:
        """(..., 14) robot actions -> the policy's space (`actions_from_model`'s inverse)."""
        a = np.asarray(actions, dtype=np.float64) * self.sign
        lo, hi = self.joint_rad
        a[..., self.grippers] = a[..., self.grippers] * (hi - lo) + lo - self.servo_rad[0]
        return a.astype(np.float32)


def robot_space(name: str) -> AlohaSpace | None:
    """The conversion `name` names; None for "model" (the robot speaks the policy's space)."""
    if name == "model":
        return None
    if name == "aloha":
        return AlohaSpace()
    raise ValueError(f"robot_space {name!r}: choose one of {', '.join(ROBOT_SPACES)}")


def check_robot_space(name: str, state_dim: int, action_dim: int) -> None:
    """ValueError where the policy's widths do not fit the conversion `name`."""
    space = robot_space(name)
    if space is not None and (state_dim, action_dim) != (space.width, space.width):
        raise ValueError(f"robot_space {name!r}: ALOHA's state and actions have {space.width} values (6 joints and "
                         f"a gripper per arm); this policy's state has {state_dim}, its actions {action_dim}")
