"""Two tiny `kinema video train` rounds per post-training method, reduced to the numbers they produced: each round's
losses and diagnostics, and fingerprints of every adapter and of the method's own state. `tests/test_video_train.py`
checks that today's code reproduces the numbers recorded in `fixtures/video_methods_reference/`, one file per
machine kind (`method_regression.numeric_signature`), as `tests/method_regression.py` does for `kinema train`.

    python tests/video_method_regression.py              # records this machine's reference
    python tests/video_method_regression.py --legacy-names   # the same, with the option names before the methods' groups
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from method_regression import environment, fingerprint, numeric_signature

REFERENCES = Path(__file__).parent / "fixtures" / "video_methods_reference"
PROMPTS = ["put the red cube on the blue plate", "open the drawer", "push the green cube to the left"]
TINY = [
    "--data.frames", "5", "--data.size", "16", "--train.prompts_per_round", "2", "--train.group_size", "2",
    "--train.updates_per_round", "2", "--train.batch_size", "4", "--model.num_inference_steps", "3",
    "--eval.prompts", "2", "--eval.samples_per_prompt", "2", "--rewards.names", "[exposure, sharpness]",
]  # fmt: skip
# One run per method, with the options that reach its distinct code paths.
RUNS: dict[str, list[str]] = {
    "awr": ["--train.method", "awr"],
    "awr_faithful": ["--train.method", "awr", "--train.awr.shared_noise", "false", "--anchor.ref_schedule", "flowawr"],
    "nft": ["--train.method", "nft"],
    "distill": ["--train.method", "distill", "--train.distill.dmd_fake_updates", "2"],
    "distill_advantage": ["--train.method", "distill", "--train.distill.tilt_reward", "advantage"],
    "afd": ["--train.method", "afd"],
    "opsd": ["--train.method", "opsd"],
    "opsd_privileged": ["--train.method", "opsd", "--train.opsd.teacher", "privileged_prompt"],
    "flow_grpo": ["--train.method", "flow_grpo"],
}  # fmt: skip
# The options as they were named before each method had its own group (the reference was recorded with these).
LEGACY = {"--train.awr.shared_noise": "--train.options.awr_shared_noise",
          "--train.distill.dmd_fake_updates": "--train.options.dmd_fake_updates",
          "--train.distill.tilt_reward": "--train.options.tilt_reward",
          "--train.opsd.teacher": "--train.options.opsd_teacher"}  # fmt: skip


def _numbers(record: dict, prefix: str) -> dict[str, float]:
    return {f"{prefix}/{k}": v for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("time", "cpu_s")}  # fmt: skip


def run_method(name: str, *, legacy_names: bool = False) -> dict:
    from kinema.video.config import load_video_config
    from kinema.video.trainer import VideoTrainer
    from policies.video.generator import VideoGenerator
    from policies.video.rewards import make_rewards

    args = [LEGACY.get(a, a) for a in RUNS[name]] if legacy_names else list(RUNS[name])
    cfg = load_video_config(None, [*TINY, *args])
    torch.manual_seed(0)  # the adapters' initial weights (peft draws them from the global generator), as the workflow seeds
    gen = VideoGenerator.from_preset("tiny", seed=0, num_frames=5, height=16, width=16)
    trainer = VideoTrainer(cfg, gen, make_rewards(["exposure", "sharpness"]), PROMPTS)
    numbers = {**_numbers(trainer.train_round(), "round1"), **_numbers(trainer.train_round(), "round2")}
    weights = {adapter: fingerprint(gen.adapter_state_dict(adapter)) for adapter in gen.adapters}
    state = trainer.method.state_dict()
    tensors = {k: v for k, v in _flatten(state).items() if isinstance(v, torch.Tensor)}
    return {"numbers": numbers, "adapters": weights, "method_state": fingerprint(tensors) if tensors else 0.0}


def _flatten(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flatten(sub, f"{prefix}{key}.").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, sub in enumerate(tree) for k, v in _flatten(sub, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): tree}


def reference() -> tuple[dict, Path, dict[str, float]]:
    """(the reference, its path, math.isclose's tolerances): this machine kind's own, tight; else another kind's, loose."""
    own = REFERENCES / f"{numeric_signature()}.json"
    if own.exists():
        return json.loads(own.read_text()), own, {"rel_tol": 1e-5, "abs_tol": 1e-7}
    other = sorted(REFERENCES.glob("*.json"))[0]
    return json.loads(other.read_text()), other, {"rel_tol": 2e-2, "abs_tol": 1e-4}


if __name__ == "__main__":
    torch.set_num_threads(1)
    legacy = "--legacy-names" in sys.argv
    out = {"_environment": environment()}
    for name in RUNS:
        out[name] = run_method(name, legacy_names=legacy)
        print(name, json.dumps(out[name])[:200], flush=True)
    path = REFERENCES / f"{numeric_signature()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {path}")
