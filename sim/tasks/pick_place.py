"""Pick-and-place: put the named object on the named plate."""

from __future__ import annotations

import numpy as np

from sim.env import COLORS, Instructions, TabletopEnv, TaskConfig
from sim.tasks.objects import HALF, assign_slots, pick_objects, pool_xml

PLATE_RADIUS = 0.05
PLATE_HALF_HEIGHT = 0.005


def default_config() -> TaskConfig:
    return TaskConfig(horizon=150, num_distractors=1, x_range=(0.38, 0.64), y_range=(-0.22, 0.22), min_separation=0.11)


class PickPlaceEnv(TabletopEnv):
    name = "pick_place"
    instructions = Instructions(
        train=(
            "put the {object} on the {plate} plate",
            "pick up the {object} and place it on the {plate} plate",
            "move the {object} onto the {plate} plate",
        ),
        heldout=(
            "set the {object} down on the {plate} dish",
            "grab the {object} and drop it onto the plate that is {plate}",
            "could you transfer the {object} to the {plate} plate",
        ),
    )
    shapes = ("cube", "brick")
    max_distractors = 3
    max_objects = 4

    @classmethod
    def default_config(cls) -> TaskConfig:
        return default_config()

    def task_xml(self) -> str:
        xml, self.slots = pool_xml({"cube": self.max_objects, "brick": self.max_objects})
        plates = "".join(
            f'<body name="plate{i}" pos="{-1 - i} 1 -0.79"><geom name="plate{i}" type="cylinder" '
            f'size="{PLATE_RADIUS} {PLATE_HALF_HEIGHT}" rgba="1 1 1 1" condim="3"/></body>'
            for i in range(2)
        )
        return xml + plates

    def bind(self) -> None:
        self.active = []

    def sample_episode(self, rng: np.random.Generator) -> str:
        cfg = self.config
        n = cfg.num_distractors
        descriptions = pick_objects(rng, cfg.colors, self.shapes, self.object_split, n)
        self.active = assign_slots(self.slots, descriptions)
        plate_colors = rng.choice(len(cfg.colors), size=2, replace=False)
        self.plate_color = cfg.colors[plate_colors[0]]
        xy = self.sample_layout(rng, len(self.active) + 2)
        for i, (slot, (color, _)) in enumerate(zip(self.active, descriptions)):
            self.set_free_body(slot.body, np.array([*xy[i], HALF]), rng.uniform(-cfg.yaw_range, cfg.yaw_range))
            self.set_color(slot.geom, color)
        for i in range(2):
            self.model.body_pos[self.model.body(f"plate{i}").id] = [*xy[len(self.active) + i], PLATE_HALF_HEIGHT]
            self.set_color(f"plate{i}", cfg.colors[plate_colors[i]])
        self.target, self.descriptions = self.active[0], descriptions  # (colour, shape) of each object, target first
        color, shape = descriptions[0]
        return self.instruction(rng, object=f"{color} {shape}", plate=self.plate_color)

    def goal_pos(self) -> np.ndarray:
        return self.model.body_pos[self.model.body("plate0").id].copy()

    def place_height(self) -> float:
        return 2 * PLATE_HALF_HEIGHT + HALF

    def target_reached(self) -> bool:
        obj = self.body_pos(self.target.body)
        on_plate = np.linalg.norm(obj[:2] - self.goal_pos()[:2]) < PLATE_RADIUS - 0.01
        resting = abs(obj[2] - self.place_height()) < 0.01
        return bool(on_plate and resting and not any(self.finger_contacts(self.target.body)))

    def wrong_target(self) -> bool:
        """Another object left on the named plate, or the named object left on the other plate (resting and let go:
        an object carried over a plate is on its way, not placed)."""

        def left_on(slot, plate: np.ndarray) -> bool:
            obj = self.body_pos(slot.body)
            resting = abs(obj[2] - self.place_height()) < 0.01 and not any(self.finger_contacts(slot.body))
            return bool(np.linalg.norm(obj[:2] - plate[:2]) < PLATE_RADIUS and resting)

        other_plate = self.model.body_pos[self.model.body("plate1").id]
        return any(left_on(slot, self.goal_pos()) for slot in self.active[1:]) or left_on(self.target, other_plate)

    def progress(self) -> float:
        goal = self.goal_pos()
        place = np.array([goal[0], goal[1], self.place_height()])
        return self.carry_progress(self.body_pos(self.target.body), place, HALF)

    def privileged(self) -> dict[str, np.ndarray]:
        objects = np.zeros((self.max_objects, 3), np.float32)
        for i, slot in enumerate(self.active):
            objects[i] = self.body_pos(slot.body)
        return {
            "privileged.objects": objects,  # target first, then distractors; zero rows pad
            "privileged.target_pos": objects[0].copy(),
            "privileged.goal_pos": self.goal_pos().astype(np.float32),
            "privileged.contacts": np.array(self.finger_contacts(self.target.body), np.float32),
        }
