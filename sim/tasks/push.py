"""Pushing: slide the named object into the coloured target region (no grasping needed)."""

from __future__ import annotations

import numpy as np

from sim.env import Instructions, TabletopEnv, TaskConfig
from sim.tasks.objects import HALF, assign_slots, pick_objects, pool_xml

REGION_HALF = 0.06


def default_config() -> TaskConfig:
    return TaskConfig(horizon=150, num_distractors=1)


class PushEnv(TabletopEnv):
    name = "push"
    instructions = Instructions(
        train=(
            "push the {object} into the {region} square",
            "slide the {object} to the {region} area",
            "shove the {object} onto the {region} target",
        ),
        heldout=(
            "nudge the {object} until it sits inside the {region} zone",
            "move the {object} into the {region} region without lifting it",
            "could you slide the {object} over to the {region} patch",
        ),
    )
    shapes = ("cube", "brick")
    max_distractors = 2
    max_objects = 3

    @classmethod
    def default_config(cls) -> TaskConfig:
        return default_config()

    def task_xml(self) -> str:
        xml, self.slots = pool_xml({"cube": self.max_objects, "brick": self.max_objects})
        # The region is a painted square: visual only, it never collides.
        region = (
            f'<body name="region" pos="-1 -1 -0.79"><geom name="region" type="box" '
            f'size="{REGION_HALF} {REGION_HALF} 0.001" rgba="1 1 1 1" contype="0" conaffinity="0"/></body>'
        )
        return xml + region

    def bind(self) -> None:
        self.active = []

    def sample_episode(self, rng: np.random.Generator) -> str:
        cfg = self.config
        n = cfg.num_distractors
        descriptions = pick_objects(rng, cfg.colors, self.shapes, self.object_split, n)
        self.active = assign_slots(self.slots, descriptions)
        for _ in range(100):
            xy = self.sample_layout(rng, len(self.active) + 1, radius=max(cfg.min_separation, 0.13))
            # Keep pushes to a reachable length, and leave the object well outside its region at the start.
            if 0.14 < np.linalg.norm(xy[0] - xy[-1]) < 0.28:
                break
        for i, (slot, (color, _)) in enumerate(zip(self.active, descriptions)):
            self.set_free_body(slot.body, np.array([*xy[i], HALF]), rng.uniform(-cfg.yaw_range, cfg.yaw_range))
            self.set_color(slot.geom, color)
        region_colors = [c for c in cfg.colors if c not in {d[0] for d in descriptions}] or list(cfg.colors)
        self.region_color = region_colors[rng.integers(len(region_colors))]
        self.model.body_pos[self.model.body("region").id] = [*xy[-1], 0.001]
        self.set_color("region", self.region_color)
        self.target, self.descriptions = self.active[0], descriptions  # (colour, shape) of each object, target first
        self.start_distance = float(np.linalg.norm(xy[0] - xy[-1]))
        color, shape = descriptions[0]
        return self.instruction(rng, object=f"{color} {shape}", region=self.region_color)

    def goal_pos(self) -> np.ndarray:
        return self.model.body_pos[self.model.body("region").id].copy()

    def target_reached(self) -> bool:
        obj = self.body_pos(self.target.body)
        inside = np.abs(obj[:2] - self.goal_pos()[:2]).max() < REGION_HALF - 0.015
        return bool(inside and obj[2] < HALF + 0.01)

    def wrong_target(self) -> bool:
        """Another object pushed into the region (its centre inside the painted square, on the table)."""
        region = self.goal_pos()
        objects = [self.body_pos(slot.body) for slot in self.active[1:]]
        return any(np.abs(obj[:2] - region[:2]).max() < REGION_HALF and obj[2] < HALF + 0.01 for obj in objects)

    def progress(self) -> float:
        if self.is_success():
            return 1.0
        obj, goal, ee = self.body_pos(self.target.body), self.goal_pos(), self.ee_pos()
        reach = float(np.clip(1 - np.linalg.norm(ee[:2] - obj[:2]) / 0.4, 0, 1))
        moved = float(np.clip(1 - np.linalg.norm(obj[:2] - goal[:2]) / max(self.start_distance, 1e-6), 0, 1))
        return 0.2 * reach + 0.75 * moved

    def privileged(self) -> dict[str, np.ndarray]:
        objects = np.zeros((self.max_objects, 3), np.float32)
        for i, slot in enumerate(self.active):
            objects[i] = self.body_pos(slot.body)
        return {
            "privileged.objects": objects,
            "privileged.target_pos": objects[0].copy(),
            "privileged.goal_pos": self.goal_pos().astype(np.float32),
            "privileged.contacts": np.array(self.finger_contacts(self.target.body), np.float32),
        }
