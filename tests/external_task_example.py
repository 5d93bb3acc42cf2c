"""A task defined outside kinema's packages, meeting the external-task contract (sim/tasks/external.py): slide a
marker along a line past its goal. Used by tests/test_external_tasks.py, which puts this folder on PYTHONPATH."""

from __future__ import annotations

import gymnasium as gym
import numpy as np


class SlideMarker(gym.Env):
    """The marker starts at x = 0 and moves 0.05 per unit of action[0] a step; success once x >= goal. Both cameras
    show the marker as a bright column on a dark image, so a policy can see where it is."""

    def __init__(self, image_size: int = 32, goal: float = 0.15) -> None:
        self.size, self.goal, self.x, self.rng = image_size, goal, 0.0, np.random.default_rng(0)
        image = gym.spaces.Box(0, 255, (image_size, image_size, 3), np.uint8)
        self.observation_space = gym.spaces.Dict({
            "camera_front": image, "camera_hand": image, "state": gym.spaces.Box(-np.inf, np.inf, (8,), np.float32),
        })  # fmt: skip
        self.action_space = gym.spaces.Box(-1, 1, (7,), np.float32)

    def _obs(self) -> dict:
        image = np.zeros((self.size, self.size, 3), np.uint8)
        column = int(np.clip((self.x + 0.5) * self.size, 0, self.size - 1))
        image[:, column] = (255, 220, 40)
        state = np.array([self.x, 0, 0, 1, 0, 0, 0, 1], np.float32)
        return {"camera_front": image, "camera_hand": image.copy(), "state": state}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.x = 0.0
        return self._obs(), {}

    def step(self, action):
        self.x += 0.05 * float(np.clip(action[0], -1, 1))
        success = self.x >= self.goal
        return self._obs(), float(success), success, False, {"is_success": bool(success)}

    def render(self):
        return np.repeat(np.repeat(self._obs()["camera_front"], 4, axis=0), 4, axis=1)


gym.register(id="SlideMarker-v0", entry_point="external_task_example:SlideMarker", max_episode_steps=20)
