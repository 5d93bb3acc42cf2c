"""Articulated: open the named drawer of a two-drawer cabinet by pulling its vertical bar handle."""

from __future__ import annotations

import numpy as np

from sim.env import Instructions, TabletopEnv, TaskConfig
from sim.tasks.objects import HALF, assign_slots, pick_objects, pool_xml

DRAWER_TRAVEL = 0.16
OPEN_THRESHOLD = 0.10
CAB_DEPTH, CAB_HALF_WIDTH, CAB_HEIGHT = 0.09, 0.13, 0.27
HANDLE_STANDOFF = 0.05
DRAWER_Z = {"bottom": 0.07, "top": 0.2}

# Drawer colours held out from training as targets (with objects="heldout", the target drawer has one of these).
HELDOUT_DRAWER_COLORS = ("purple", "orange")


def default_config() -> TaskConfig:
    return TaskConfig(horizon=120, num_distractors=1, x_range=(0.42, 0.55), y_range=(-0.25, 0.25))


class DrawerEnv(TabletopEnv):
    name = "drawer"
    instructions = Instructions(
        train=(
            "open the {which} drawer",
            "pull the {which} drawer open",
            "slide out the {which} drawer",
        ),
        heldout=(
            "grab the handle of the {which} drawer and pull",
            "could you get the {which} drawer open",
            "draw the {which} drawer toward you",
        ),
    )
    max_distractors = 2
    max_objects = 2

    @classmethod
    def default_config(cls) -> TaskConfig:
        return default_config()

    def task_xml(self) -> str:
        xml, self.slots = pool_xml({"cube": self.max_objects})
        cab = 'contype="2" conaffinity="1" rgba="0.55 0.4 0.28 1"'
        wall = []
        d, w, h = CAB_DEPTH, CAB_HALF_WIDTH, CAB_HEIGHT
        # Cabinet shell (open at the front, -x side), origin at the floor of the front face.
        wall.append(f'<geom type="box" size="{d} {w} 0.01" pos="{d} 0 {h - 0.01}" {cab}/>')
        wall.append(f'<geom type="box" size="{d} 0.01 {h / 2}" pos="{d} {w - 0.01} {h / 2}" {cab}/>')
        wall.append(f'<geom type="box" size="{d} 0.01 {h / 2}" pos="{d} {-w + 0.01} {h / 2}" {cab}/>')
        wall.append(f'<geom type="box" size="0.01 {w} {h / 2}" pos="{2 * d - 0.01} 0 {h / 2}" {cab}/>')
        wall.append(f'<geom type="box" size="{d} {w} 0.005" pos="{d} 0 0.135" {cab}/>')
        drawers = []
        for which, z in DRAWER_Z.items():
            drw = 'contype="4" conaffinity="1"'
            drawers.append(
                f"""<body name="drawer_{which}" pos="0 0 {z}">
          <joint name="drawer_{which}" type="slide" axis="-1 0 0" range="0 {DRAWER_TRAVEL}" damping="8" frictionloss="0.5"/>
          <geom name="front_{which}" type="box" size="0.008 {w - 0.02} 0.055" pos="0 0 0" rgba="1 1 1 1" {drw}/>
          <geom type="box" size="{d - 0.01} {w - 0.025} 0.004" pos="{d} 0 -0.045" rgba="0.5 0.36 0.25 1" {drw}/>
          <geom name="handle_{which}" type="capsule" size="0.014" fromto="{-HANDLE_STANDOFF} 0 -0.04 {-HANDLE_STANDOFF} 0 0.04"
                rgba="0.2 0.2 0.2 1" friction="1.5 0.02 0.001" {drw}/>
          <geom type="box" size="{HANDLE_STANDOFF / 2} 0.006 0.006" pos="{-HANDLE_STANDOFF / 2} 0 0.04" rgba="0.2 0.2 0.2 1" {drw}/>
          <geom type="box" size="{HANDLE_STANDOFF / 2} 0.006 0.006" pos="{-HANDLE_STANDOFF / 2} 0 -0.04" rgba="0.2 0.2 0.2 1" {drw}/>
        </body>"""
            )
        return xml + f'<body name="cabinet" pos="0.62 0 0">{"".join(wall)}{"".join(drawers)}</body>'

    def bind(self) -> None:
        self.active = []
        self.joint_adr = {w: self.model.jnt_qposadr[self.model.joint(f"drawer_{w}").id] for w in DRAWER_Z}

    def sample_episode(self, rng: np.random.Generator) -> str:
        cfg = self.config
        # The cabinet's front face sits at a random x; it spans y +- CAB_HALF_WIDTH around a random y.
        cab_x = rng.uniform(cfg.x_range[0] + 0.14, cfg.x_range[1] + 0.14)
        cab_y = rng.uniform(-0.12, 0.12)
        self.model.body_pos[self.model.body("cabinet").id] = [cab_x, cab_y, 0.0]
        self.which = ("top", "bottom")[rng.integers(2)]
        pool = [c for c in cfg.colors if (c in HELDOUT_DRAWER_COLORS) == (self.object_split == "heldout")]
        if not pool:
            raise ValueError(f"no {self.object_split!r} drawer colours among {cfg.colors}")
        target_color = pool[rng.integers(len(pool))]
        others = [c for c in cfg.colors if c != target_color and c not in HELDOUT_DRAWER_COLORS] or [target_color]
        other_color = others[rng.integers(len(others))]
        self.set_color(f"front_{self.which}", target_color)
        self.set_color(f"front_{'bottom' if self.which == 'top' else 'top'}", other_color)
        self.target_color = target_color
        # Distractor blocks sit on the table in front of or beside the cabinet, out of the handle's way.
        n = cfg.num_distractors
        self.active = []
        if n:
            descriptions = pick_objects(rng, cfg.colors, ("cube",), "train", n - 1) if n > 0 else []
            self.active = assign_slots(self.slots, descriptions)
            for slot, (color, _) in zip(self.active, descriptions):
                side = 1 if cab_y < 0 else -1
                pos = [rng.uniform(0.4, 0.5), cab_y + side * rng.uniform(0.2, 0.26), HALF]
                self.set_free_body(slot.body, np.array(pos), rng.uniform(-cfg.yaw_range, cfg.yaw_range))
                self.set_color(slot.geom, color)
        # With held-out objects the drawer is always named by its (held-out) colour, so the split tests colours.
        by_colour = self.object_split == "heldout" or rng.random() < 0.5
        instruction = self.instruction(rng, which=target_color if by_colour else self.which)
        self.target_names = {"which": (self.which, target_color)}  # its place and its colour name the same drawer
        return instruction

    def drawer_opening(self, which: str | None = None) -> float:
        return float(self.data.qpos[self.joint_adr[which or self.which]])

    def handle_pos(self) -> np.ndarray:
        return self.data.geom_xpos[self.model.geom(f"handle_{self.which}").id].copy()

    def target_reached(self) -> bool:
        return self.drawer_opening() > OPEN_THRESHOLD

    def wrong_target(self) -> bool:
        return self.drawer_opening("bottom" if self.which == "top" else "top") > OPEN_THRESHOLD

    def progress(self) -> float:
        if self.is_success():
            return 1.0
        reach = float(np.clip(1 - np.linalg.norm(self.ee_pos() - self.handle_pos()) / 0.4, 0, 1))
        holding = all(self.finger_contacts(f"drawer_{self.which}"))
        return 0.4 * reach + (0.1 if holding else 0.0) + 0.45 * self.drawer_opening() / OPEN_THRESHOLD

    def privileged(self) -> dict[str, np.ndarray]:
        objects = np.zeros((self.max_objects + 1, 3), np.float32)
        objects[0] = self.handle_pos()
        for i, slot in enumerate(self.active):
            objects[i + 1] = self.body_pos(slot.body)
        return {
            "privileged.objects": objects,  # target handle first, then distractor blocks
            "privileged.target_pos": objects[0].copy(),
            "privileged.goal_pos": np.array([self.drawer_opening(), 0.0, 0.0], np.float32),
            "privileged.contacts": np.array(self.finger_contacts(f"drawer_{self.which}"), np.float32),
        }
