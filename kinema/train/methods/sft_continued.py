"""`rl.method sft_continued`: the control arm. Every round trains on the demonstrations alone, on the same schedule
as the RL arms, so that continued imitation does not pass for RL gain."""

from __future__ import annotations

from kinema.train.methods.base import RLMethod


class ContinuedSFT(RLMethod):
    name = "sft_continued"
    summary = "the control: continued SFT on the demonstrations, on the RL arms' schedule"
    policy_types = ("vla", "video", "smolvla", "pi0")  # imitation-style: its flow loss covers the video policy's whole sequence
    rolls_out = False
    learns_from_recordings = True

    def roll_out(self, round_index, record, progress):
        return None

    def update(self, rollouts, record, progress) -> None:
        self.imitate(None, None, record, progress)
