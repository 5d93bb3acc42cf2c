"""Does a trained VLA read its instruction's meaning, or the training templates' wording?

For each layout (the task's resets with seeds 0, 1, ...), the policy's first action chunk is planned from the same
observation and the same initial noise under three kinds of instruction:

- `train`: the other training templates, same object (and plate or region): rewording it knows;
- `heldout`: the held-out paraphrases, same object: rewording it never saw;
- `wrong_object` (the reference): the training templates naming a distractor instead of the target.

Each is the mean absolute difference (end-effector translation, first chunk) from the chunk under the layout's own
training instruction. A policy that reads meaning keeps `heldout` near `train` and well under `wrong_object`:
`heldout_over_wrong_object` < 1. Above 1, a paraphrase moves the arm more than naming another object does.

    python benchmarks/instruction_probe.py --task pick_place --policy RUN/checkpoints/sft [--policy OTHER ...]

Last line: one JSON object (per policy, the three distances and the ratio). `--quick`: 3 layouts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import string

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("LP_NUM_THREADS", "1")

import numpy as np
import torch

from policies import load_policy
from sim.rollout import make_env


def template_fields(text: str, templates: tuple[str, ...]) -> dict[str, str]:
    """The field values ({object}, {plate}, ...) of an instruction written from one of `templates`."""
    for template in templates:
        parts = string.Formatter().parse(template)
        pattern = "".join(re.escape(lit) + (f"(?P<{name}>.+?)" if name else "") for lit, name, _, _ in parts)
        if match := re.fullmatch(pattern, text):
            return match.groupdict()
    raise ValueError(f"instruction {text!r} was not written from any of the task's training templates {templates}")


def probe(policy, task: str, layouts: int) -> dict[str, float]:
    env = make_env(task, image_size=policy.config.image_size)
    train, heldout = env.instructions.train, env.instructions.heldout
    if not all("{object}" in t for t in (*train, *heldout)):
        raise ValueError(f"task {task!r}: its templates must name an {{object}} to swap for a distractor")
    gen = torch.Generator().manual_seed(0)
    distances: dict[str, list[float]] = {"train": [], "heldout": [], "wrong_object": []}
    for seed in range(layouts):
        obs, _ = env.reset(seed=seed)
        if len(env.descriptions) < 2:
            raise ValueError(f"task {task!r} has no distractor in its layout: nothing to name instead of the target")
        fields = template_fields(obs["task"], train)
        wrong = {**fields, "object": " ".join(env.descriptions[1])}
        noise = torch.randn(1, policy.config.chunk_size, policy.config.action_dim, generator=gen)
        batch = {k: v[None] for k, v in obs.items() if isinstance(v, np.ndarray)}

        def chunk(text: str) -> np.ndarray:
            with torch.no_grad():
                return policy.predict_action_chunk({**batch, "task": [text]}, noise=noise.clone())[0, :, :3].numpy()

        own = chunk(obs["task"])
        groups = {"train": [t.format(**fields) for t in train], "heldout": [t.format(**fields) for t in heldout],
                  "wrong_object": [t.format(**wrong) for t in train]}  # fmt: skip
        for name, texts in groups.items():
            distances[name] += [float(np.abs(chunk(t) - own).mean()) for t in texts if t != obs["task"]]
    env.close()
    out = {name: round(float(np.mean(v)), 5) for name, v in distances.items()}
    out["heldout_over_wrong_object"] = round(out["heldout"] / out["wrong_object"], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--policy", action="append", required=True, help="a checkpoint folder (repeat to compare)")
    parser.add_argument("--task", default="pick_place")
    parser.add_argument("--layouts", type=int, default=12)
    parser.add_argument("--quick", action="store_true", help="3 layouts")
    args = parser.parse_args()
    torch.set_num_threads(1)
    layouts = 3 if args.quick else args.layouts
    results = {}
    for path in args.policy:
        policy = load_policy(path).eval()
        results[path] = probe(policy, args.task, layouts)
        print(f"{path}: {results[path]}", flush=True)
    print(json.dumps({"task": args.task, "layouts": layouts, "policies": results, "machine": platform.machine()}))


if __name__ == "__main__":
    main()
