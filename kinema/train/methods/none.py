"""`rl.method none`: SFT only, no RL round."""

from __future__ import annotations

from kinema.train.methods.base import RLMethod


class SFTOnly(RLMethod):
    name = "none"
    summary = "SFT only: no RL round"
    policy_types = ("vla", "video", "smolvla", "pi0")  # imitation-style: its flow loss covers the video policy's whole sequence
    has_rounds = False

    def update(self, rollouts, record, progress) -> None:
        raise RuntimeError("rl.method none has no rounds")
