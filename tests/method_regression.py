"""A tiny `kinema train` run per RL method, reduced to the numbers its update produced: the losses and diagnostics of
its round, and fingerprints of the trained and acting weights. `tests/test_train_methods.py` checks that today's code
reproduces the numbers recorded in `fixtures/train_methods_reference/`.

Recording them again is a decision, not a chore: it says that a change of behaviour is intended.

    python tests/method_regression.py   # records this machine's reference, fixtures/train_methods_reference/<signature>.json
    python tests/method_regression.py pa_rl dsrl   # records (or re-records) those methods' entries only
    python tests/method_regression.py --unsigned recap   # also adds them to unsigned.json (machines without their own)

Floats depend on the machine as well as the code: two x86 CPUs that both report AVX-512 ran different kernels, and a
success model's last loss after 200 Adam steps moved by 50 %. So each machine kind keeps its own reference, named by
`numeric_signature()` (a hash of a few kernels' output bits), compared tightly; a machine with none is compared loosely
with `unsigned.json` (recorded before references had signatures). Each reference keeps the versions of the packages
its floats depend on (`_environment`); with other versions installed the comparison is skipped, saying which differ.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

import torch
from rich.console import Console
from safetensors.torch import load_file

REFERENCES = Path(__file__).parent / "fixtures" / "train_methods_reference"
UNSIGNED = REFERENCES / "unsigned.json"
TINY = [
    "--task", "drawer", "--demos.episodes", "4", "--sft.steps", "6", "--sft.batch_size", "8", "--rl.rounds", "1",
    "--rl.episodes_per_round", "4", "--rl.updates_per_round", "4", "--rl.batch_size", "8",
    "--eval.episodes", "2", "--eval.round_episodes", "2", "--eval.videos", "0", "--eval.heldout", "false",
    "--workers", "0", "--num_envs", "4", "--policy.image_size", "32", "--task_config", '{"horizon": 100}',
    "--learner_threads", "1",  # as recorded: floats depend on the thread count
]  # fmt: skip
# The recorded numbers are the SFT's and the round's, which no evaluation touches (the same with TINY's evaluations, as
# first recorded): the recorded runs evaluate the least that a run allows.
LEAST_EVALUATION = ["--eval.baseline", "false", "--eval.episodes", "1", "--eval.round_episodes", "1"]
# One run per method, with the options that reach its distinct code paths. The simulated human makes some rollouts
# succeed (an untrained policy never does), so that credit rules see both outcomes.
CRITIC_STEPS = 5
RUNS: dict[str, list[str]] = {
    "none": ["--rl.method", "none"],
    "sft_continued": ["--rl.method", "sft_continued"],
    "habc": ["--rl.method", "habc", "--rl.interventions", "true", "--rl.habc.critic_steps", str(CRITIC_STEPS)],
    "habc_pooled": ["--rl.method", "habc", "--rl.interventions", "true", "--rl.replay_mixing", "pooled",
                    "--rl.habc.critic_steps", str(CRITIC_STEPS)],
    "awr": ["--rl.method", "awr", "--rl.interventions", "true", "--rl.awr.critic_steps", str(CRITIC_STEPS)],
    "nft": ["--rl.method", "nft"],
    "flow_ppo_grpo": ["--rl.method", "flow_ppo", "--rl.ppo.group_size", "2", "--rl.interventions", "true"],
    "flow_ppo_gae": ["--rl.method", "flow_ppo", "--rl.ppo.advantage", "gae", "--rl.ppo.critic_steps", str(CRITIC_STEPS)],
    "pa_rl": ["--rl.method", "pa_rl", "--rl.pa_rl.num_samples", "4", "--rl.pa_rl.refine_steps", "1",
              "--rl.pa_rl.critic_steps", str(CRITIC_STEPS), "--rl.pa_rl.demo_episodes", "2", "--rl.pa_rl.eval_samples", "2"],
    "dsrl": ["--rl.method", "dsrl", "--rl.dsrl.sac_steps", str(CRITIC_STEPS), "--rl.dsrl.distill", "true"],
    "residual": ["--rl.method", "residual", "--rl.residual.sac_steps", str(CRITIC_STEPS)],
    "recap": ["--rl.method", "recap", "--rl.interventions", "true", "--rl.recap.value_steps", str(CRITIC_STEPS),
              "--rl.recap.value_batch_size", "16", "--rl.recap.guidance", "2"],
    "hg_dagger": ["--rl.method", "hg_dagger", "--rl.interventions", "true"],
}  # fmt: skip
# The options as they were named before the methods had their own groups (the reference was recorded with these).
LEGACY = {"--rl.awr.critic_steps": "--rl.habc.critic_steps", "--rl.ppo.group_size": "--rl.group_size",
          "--rl.ppo.advantage": "--rl.ppo_advantage", "--rl.ppo.critic_steps": "--rl.habc.critic_steps"}  # fmt: skip
NOT_NUMBERS = {"time", "cpu_s", "run/seconds_left_estimate"}
# The packages the recorded floats depend on: a new release moves them with no change here (a fresh venv takes the
# newest), so the numbers are compared only in the environment they were recorded in.
NUMERIC_PACKAGES = ("torch", "numpy", "mujoco", "transformers", "diffusers", "av", "pillow")


def numeric_signature() -> str:
    """Which float kernels this machine runs, as 12 hex digits: the output bits of the ops a tiny run leans on (GEMMs
    on both sides of MKL's size thresholds, a strided conv, norms, transcendentals, an Adam step), on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(67, 129, generator=g), torch.randn(129, 33, generator=g)
        big = torch.randn(256, 512, generator=g)
        image, kernel = torch.randn(2, 3, 32, 32, generator=g), torch.randn(16, 3, 4, 4, generator=g)
        w = torch.nn.Parameter(torch.randn(129, generator=g))
        opt = torch.optim.Adam([w], lr=1e-3)
        (a @ w).sigmoid().log().sum().backward()
        opt.step()
        outs = [a @ b, big @ big.T, torch.nn.functional.conv2d(image, kernel, stride=4),
                torch.nn.functional.layer_norm(a, (129,)), torch.nn.functional.gelu(a), a.softmax(-1), a.tanh(),
                a.exp(), w.detach()]  # fmt: skip
        return hashlib.sha256(b"".join(o.contiguous().numpy().tobytes() for o in outs)).hexdigest()[:12]
    finally:
        torch.set_num_threads(threads)


def environment() -> dict[str, str]:
    from importlib.metadata import version

    return {**{name: version(name) for name in NUMERIC_PACKAGES}, "cpu": torch.backends.cpu.get_cpu_capability(),
            "signature": numeric_signature()}  # fmt: skip


def environment_changes(recorded: dict[str, str]) -> dict[str, tuple[str, str | None]]:
    """{package: (installed, recorded)} for each package whose installed version is not the recorded one."""
    return {name: (v, recorded.get(name)) for name, v in environment().items()
            if name not in ("cpu", "signature") and recorded.get(name) != v}  # fmt: skip


def this_machines_reference() -> Path:
    return REFERENCES / f"{numeric_signature()}.json"


def reference(name: str) -> tuple[dict, dict[str, float], Path]:
    """(the reference holding run `name`, math.isclose's tolerances for it, its path): this machine kind's own, tight;
    else (no file, or a method recorded after it) the unsigned one, loose: on another machine kernels sum in another
    order, and the rounds' losses of ~1e-3 moved by up to 6e-5 (an AVX2 machine) or 4e-4 (an AVX-512 one: the
    success model's and GAE's diagnostics, within 5e-6 elsewhere)."""
    own = this_machines_reference()
    if own.exists() and name in (recorded := json.loads(own.read_text())):
        return recorded, {"rel_tol": 1e-5, "abs_tol": 1e-7}, own
    return json.loads(UNSIGNED.read_text()), {"rel_tol": 1e-2, "abs_tol": 1e-4}, UNSIGNED


def fingerprint(tensors: dict[str, torch.Tensor]) -> float:
    """One number that moves with any weight: each tensor against a fixed random tensor of its shape, summed."""
    total = 0.0
    for name in sorted(tensors):
        t = tensors[name]
        if not t.is_floating_point():
            continue
        probe = torch.randn(t.shape, generator=torch.Generator().manual_seed(len(name)), dtype=torch.float64)
        total += float((t.double() * probe).sum())
    return total


def run_method(name: str, root: Path, *, legacy_names: bool = False) -> dict:
    from kinema.common import load_config
    from kinema.train.config import TrainConfig
    from kinema.train.workflow import train

    args = list(RUNS[name])
    if legacy_names:
        args = [LEGACY.get(a, a) for a in args]
    cfg = load_config(None, [*TINY, *LEAST_EVALUATION, *args, "--out", str(root / name)], config_class=TrainConfig)
    run = train(cfg, console=Console(file=open("/dev/null", "w")))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    numbers = {}
    for record in records:
        if record["kind"] in ("sft", "round"):
            for key, value in record.items():
                if key not in NOT_NUMBERS and isinstance(value, (int, float)) and not isinstance(value, bool):
                    numbers[f"{record['kind']}/{key}"] = value
    last = run / "checkpoints" / ("round-001" if (run / "checkpoints" / "round-001").exists() else "sft")
    trainer = torch.load(last / "trainer.pt", weights_only=False)
    return {
        "numbers": numbers,
        "acting": fingerprint(load_file(str(last / "model.safetensors"))),
        "online": fingerprint(trainer["online"]),
    }


def same(a: float, b: float, *, rel_tol: float = 1e-5, abs_tol: float = 1e-7) -> bool:
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return math.isclose(a, b, rel_tol=rel_tol, abs_tol=abs_tol)


if __name__ == "__main__":
    import tempfile

    legacy = "--legacy-names" in sys.argv  # for a kinema from before the methods had their own option groups
    torch.set_num_threads(1)
    names = [a for a in sys.argv[1:] if not a.startswith("--")] or list(RUNS)
    if unknown := [n for n in names if n not in RUNS]:
        raise SystemExit(f"unknown run(s) {unknown}; valid: {', '.join(RUNS)}")
    own = this_machines_reference()
    out = json.loads(own.read_text()) if names != list(RUNS) and own.exists() else {}
    if names != list(RUNS) and not out:
        raise SystemExit(f"{own} does not exist yet: record all methods on this machine first")
    if out and (changed := environment_changes(out.get("_environment", {}))):
        raise SystemExit(f"the other entries were recorded with other package versions {changed} (installed, recorded): record all methods")
    out["_environment"] = environment()
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            out[name] = run_method(name, Path(tmp), legacy_names=legacy)
            print(name, json.dumps(out[name])[:300], flush=True)
    own.parent.mkdir(parents=True, exist_ok=True)
    own.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {own}")
    if "--unsigned" in sys.argv:  # a method new to the registry: the loose reference of every other machine kind
        unsigned = json.loads(UNSIGNED.read_text())
        if changed := environment_changes(unsigned.get("_environment", {})):
            raise SystemExit(f"{UNSIGNED.name} was recorded with other package versions {changed}: not adding to it")
        unsigned.update({name: out[name] for name in names})
        UNSIGNED.write_text(json.dumps(unsigned, indent=1, sort_keys=True) + "\n")
        print(f"added {', '.join(names)} to {UNSIGNED}")
