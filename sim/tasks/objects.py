"""Graspable objects shared by the tabletop tasks: a fixed pool per model, coloured and placed per episode.

Every object that a task may ever use exists in the compiled model; unused ones are parked on the floor under the
table. Recompiling MJCF per episode would cost ~50 ms; recolouring and re-placing costs microseconds.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

HALF = 0.02  # half extent of every graspable object (m)
SHAPES = ("cube", "brick")
BRICK_HALF_LENGTH = 0.032  # a brick is a cube stretched along its local y axis

# Object descriptions never shown as a task's target in training; `objects="heldout"` draws targets only from these.
HELDOUT_COMBOS: frozenset[tuple[str, str]] = frozenset(
    {("purple", "cube"), ("orange", "brick"), ("yellow", "cube"), ("green", "brick")}
)


@dataclass(frozen=True)
class ObjectSlot:
    body: str
    geom: str
    shape: str


def pool_xml(shapes: dict[str, int]) -> tuple[str, list[ObjectSlot]]:
    """MJCF bodies for `count` objects of each shape, and their slots."""
    xml, slots = [], []
    for shape, count in shapes.items():
        for i in range(count):
            name = f"{shape}{i}"
            size = f"{HALF} {HALF if shape == 'cube' else BRICK_HALF_LENGTH} {HALF}"
            xml.append(
                f'<body name="{name}" pos="{-1.0 - 0.1 * len(slots)} 0 -0.7"><freejoint/>'
                f'<geom name="{name}" type="box" size="{size}" mass="0.05" condim="4" '
                f'friction="1.2 0.01 0.0005" rgba="1 1 1 1"/></body>'
            )
            slots.append(ObjectSlot(name, name, shape))
    return "\n".join(xml), slots


def object_choices(colors: tuple[str, ...], shapes: tuple[str, ...], split: str) -> list[tuple[str, str]]:
    """(colour, shape) descriptions allowed as a target in this split."""
    combos = list(itertools.product(colors, shapes))
    if split == "heldout":
        chosen = [c for c in combos if c in HELDOUT_COMBOS]
    else:
        chosen = [c for c in combos if c not in HELDOUT_COMBOS]
    if not chosen:
        raise ValueError(
            f"no {split!r} object descriptions among colours {colors} x shapes {shapes}; "
            f"held-out combinations are {sorted(HELDOUT_COMBOS)}"
        )
    return chosen


def pick_objects(
    rng: np.random.Generator, colors: tuple[str, ...], shapes: tuple[str, ...], split: str, n_distractors: int
) -> list[tuple[str, str]]:
    """A target description, then `n_distractors` distinct descriptions (never a held-out one in the train split)."""
    targets = object_choices(colors, shapes, split)
    target = targets[rng.integers(len(targets))]
    others = [
        c for c in itertools.product(colors, shapes) if c != target and (split == "heldout" or c not in HELDOUT_COMBOS)
    ]
    # Distractors of the same colour *and* shape as the target would make the instruction ambiguous.
    picks = rng.choice(len(others), size=min(n_distractors, len(others)), replace=False)
    return [target] + [others[i] for i in picks]


def assign_slots(slots: list[ObjectSlot], descriptions: list[tuple[str, str]]) -> list[ObjectSlot]:
    """Map each (colour, shape) description to a free slot of that shape."""
    free = {s: [slot for slot in slots if slot.shape == s] for s in SHAPES}
    out = []
    for color, shape in descriptions:
        if not free.get(shape):
            raise ValueError(f"the object pool has too few {shape}s for {len(descriptions)} objects")
        out.append(free[shape].pop(0))
    return out
