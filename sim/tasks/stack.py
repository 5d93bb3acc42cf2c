"""Stacking: put the named block on top of another named block."""

from __future__ import annotations

import numpy as np

from sim.env import Instructions, TabletopEnv, TaskConfig
from sim.tasks.objects import HALF, assign_slots, pick_objects, pool_xml


def default_config() -> TaskConfig:
    return TaskConfig(horizon=150, num_distractors=1)


class StackEnv(TabletopEnv):
    name = "stack"
    instructions = Instructions(
        train=(
            "stack the {object} on the {base}",
            "put the {object} on top of the {base}",
            "place the {object} onto the {base}",
        ),
        heldout=(
            "build a tower with the {object} above the {base}",
            "set the {object} on the {base} so they form a stack",
            "could you rest the {object} on top of the {base}",
        ),
    )
    shapes = ("cube",)
    max_distractors = 2
    max_objects = 4

    @classmethod
    def default_config(cls) -> TaskConfig:
        return default_config()

    def task_xml(self) -> str:
        xml, self.slots = pool_xml({"cube": self.max_objects})
        return xml

    def bind(self) -> None:
        self.active = []

    def sample_episode(self, rng: np.random.Generator) -> str:
        cfg = self.config
        n = cfg.num_distractors + 1  # the base block, then distractors
        descriptions = pick_objects(rng, cfg.colors, self.shapes, self.object_split, n)
        # The base is never a held-out description in the train split (pick_objects guarantees it); it is the
        # second object drawn.
        self.active = assign_slots(self.slots, descriptions)
        xy = self.sample_layout(rng, len(self.active))
        for i, (slot, (color, _)) in enumerate(zip(self.active, descriptions)):
            self.set_free_body(slot.body, np.array([*xy[i], HALF]), rng.uniform(-cfg.yaw_range, cfg.yaw_range))
            self.set_color(slot.geom, color)
        self.target, self.base = self.active[0], self.active[1]
        return self.instruction(rng, object=f"{descriptions[0][0]} block", base=f"{descriptions[1][0]} block")

    def goal_pos(self) -> np.ndarray:
        return self.body_pos(self.base.body)

    def place_height(self) -> float:
        return float(self.goal_pos()[2] + 2 * HALF)

    def wrong_target(self) -> bool:
        """Another block left on the named base, or the named block left on another one (resting on it and let go: a
        block carried over another is on its way, not stacked)."""

        def left_on(top, base) -> bool:
            a, b = self.body_pos(top.body), self.body_pos(base.body)
            resting = abs(a[2] - b[2] - 2 * HALF) < 0.008 and not any(self.finger_contacts(top.body))
            return bool(np.linalg.norm(a[:2] - b[:2]) < 2 * HALF and resting)

        others = self.active[2:]
        return any(left_on(slot, self.base) for slot in others) or any(left_on(self.target, slot) for slot in others)

    def target_reached(self) -> bool:
        top, base = self.body_pos(self.target.body), self.body_pos(self.base.body)
        aligned = np.linalg.norm(top[:2] - base[:2]) < 0.02
        stacked = abs(top[2] - base[2] - 2 * HALF) < 0.008 and base[2] < HALF + 0.005
        return bool(aligned and stacked and not any(self.finger_contacts(self.target.body)))

    def progress(self) -> float:
        goal = self.goal_pos()
        place = np.array([goal[0], goal[1], self.place_height()])
        return self.carry_progress(self.body_pos(self.target.body), place, HALF)

    def privileged(self) -> dict[str, np.ndarray]:
        objects = np.zeros((self.max_objects, 3), np.float32)
        for i, slot in enumerate(self.active):
            objects[i] = self.body_pos(slot.body)
        return {
            "privileged.objects": objects,  # target, base, then distractors; zero rows pad
            "privileged.target_pos": objects[0].copy(),
            "privileged.goal_pos": objects[1].copy(),
            "privileged.contacts": np.array(self.finger_contacts(self.target.body), np.float32),
        }
