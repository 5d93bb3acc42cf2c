"""Video post-training methods at an equal training budget, on a reward computable exactly.

The toy, with a known answer:
- data: synthetic clips of one coloured square on a grey background (random brightness), anywhere across the
  frame and moving left or right; prompt = "a <colour> square";
- model: the tiny default video generator (`VideoGenerator.from_preset("tiny")`, 16² × 5 frames so that a CPU
  budget holds hundreds of updates), pre-trained in this run on those clips (`kinema.video.workflow.pretrain`);
- reward `position`: −mean over frames of |c_x − 0.8|, c_x the horizontal centroid (as a fraction of the width)
  of the pixels that differ from the frame's median colour (weighted by the 4th power of that difference). Its
  maximum, 0, is a square centred at 80 % of the width. It cannot be bought cheaply: a global tint cancels
  against the median, and noise or texture puts the centroid in the middle, no better than an average sample;
- each method (VideoAWR, DiffusionNFT, reward-weighted distillation à la Stream-R1, Flow-GRPO) starts from the
  same pre-trained weights, with the same LoRA learning rate, and each keeps its reference anchor (Flow-GRPO:
  its KL). Every method but Flow-GRPO trains for the same budget; Flow-GRPO, the reference the speed-ups are
  measured against, gets `--grpo-budget-factor` times as much (default 4), so that its own time to the target is
  measured rather than bounded;
- the clock is the CPU time of this process (`time.process_time()`, torch on one thread), not wall-clock: the
  machine is shared, and another process on the other core must not count against a method. Evaluation is
  excluded from the budget;
- evaluation: CFG-free samples at fixed noise every few rounds: the mean reward and the diversity (mean pairwise
  RMS distance between the samples of one prompt), and a held-out judge on the same samples (`PositionJudge`: a
  conv net fitted to the square's true centre on toy clips of another seed, not the reward's formula; never used in
  training; fitted outside the budgets).

Reported: reward against training CPU seconds per method; time to the target reward (start + half the gap to
the known maximum, `--target-fraction`; a trailing mean of two evaluations must reach it) and the best method's
ratio to Flow-GRPO's (Flow-GRPO's whole budget when even its longer budget does not get there: the ratio is then
a lower bound, `speedup_is_lower_bound`), and the same at targets 25 / 50 / 75 % of the gap
(`speedup_by_target_fraction`: how much the headline depends on where the target sits); the time each method took
to reach Flow-GRPO's reward at the end of the common budget, and that ratio; diversity relative to the start; each
method's gain by the reward and by the held-out judge (`reward_gain`, `judge_gain`, `hacking_gap` = their
difference: the reward-hacking signal), and the judge's agreement with the ground truth on clips nobody trained on
(`judge`); peak RSS. The last line is one JSON object.

    PYTHONPATH=. python benchmarks/video_rl.py --quick     # < 1 minute on an idle machine (a smoke run)
    PYTHONPATH=. python benchmarks/video_rl.py             # the comparison (~12 minutes of CPU)
    PYTHONPATH=. python benchmarks/video_rl.py --seeds 5 --methods awr,flow_grpo --pretrained runs/video_toy/pre{seed}
                                                           # the median speed-up over 5 seeds (~8 CPU-minutes each)

With `--seeds N` each seed's JSON comes first, one line each, and the last line is the seeds' summary: the lower
median speed-up, in which a seed that never reached the target ranks lowest.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kinema.video.config import load_video_config  # noqa: E402
from kinema.video.trainer import VideoTrainer  # noqa: E402
from kinema.video.workflow import pretrain  # noqa: E402
from policies.video.generator import VideoGenerator  # noqa: E402
from policies.video.rewards import VideoReward, make_rewards  # noqa: E402
from policies.video.rewards.registry import REWARDS  # noqa: E402

COLOURS = {"red": (0.9, 0.15, 0.1), "green": (0.1, 0.8, 0.2), "blue": (0.15, 0.25, 0.95), "yellow": (0.95, 0.9, 0.1)}
METHODS = ("awr", "nft", "distill", "flow_grpo")
MIN_DIVERSITY = 0.5  # diversity_ratio (final / initial within-prompt diversity) below this counts as collapsed


# ----------------------------------------------------------------------------------------------------------------
# The toy: data and an exactly computable reward
# ----------------------------------------------------------------------------------------------------------------


def square_clips(n: int, *, frames: int, size: int, seed: int, centres: bool = False):
    """n clips (n, F, 3, S, S) in [0, 1] of a square moving at a random horizontal speed, and their prompts
    [, and the true horizontal centre of the square per frame, as a fraction of the width (n, F)]."""
    rng = np.random.default_rng(seed)
    truth = np.empty((n, frames), np.float32)
    scale = size / 32.0
    side = max(3, size // 4)
    names = list(COLOURS)
    videos = np.empty((n, frames, 3, size, size), np.float32)
    prompts = []
    ys, xs = np.mgrid[0:size, 0:size]
    for i in range(n):
        colour = names[i % len(names)]
        bg = rng.uniform(0.35, 0.65)
        vx = rng.integers(-2, 3) * scale
        vy = rng.uniform(-0.5, 0.5) * scale
        span = abs(vx) * (frames - 1)
        x0 = rng.uniform(0, max(0.0, size - side - span)) + (span if vx < 0 else 0.0)
        y0 = rng.uniform(0, size - side - abs(vy) * (frames - 1)) + (abs(vy) * (frames - 1) if vy < 0 else 0.0)
        for f in range(frames):
            x, y = x0 + vx * f, y0 + vy * f
            truth[i, f] = (x + side / 2) / size
            # Anti-aliased edges: coverage of each pixel by the square, so sub-pixel motion is visible.
            cover = np.clip(np.minimum(xs + 1 - x, x + side - xs), 0, 1) * np.clip(np.minimum(ys + 1 - y, y + side - ys), 0, 1)
            for c in range(3):
                videos[i, f, c] = bg * (1 - cover) + COLOURS[colour][c] * cover
        prompts.append(f"a {colour} square")
    if centres:
        return torch.from_numpy(videos), prompts, torch.from_numpy(truth)
    return torch.from_numpy(videos), prompts


class PositionTarget(VideoReward):
    """−mean over frames of |c_x − x*| / W: c_x is the horizontal centroid of the foreground, x* the target column.

    Foreground weight of a pixel = its distance to the frame's median colour (to the 4th power), so a global tint or exposure change
    moves nothing, and noise puts the centroid near the middle (no better than an average sample). The maximum, 0,
    is a square centred on x* in every frame. Differentiable in torch."""

    names = ("position",)
    differentiable = True

    def __init__(self, target_fraction: float = 0.8) -> None:
        self.target_fraction = target_fraction

    def centroid(self, videos: Tensor) -> Tensor:
        """Horizontal foreground centroid per frame, as a fraction of the width: (B, F)."""
        median = videos.flatten(3).median(dim=3).values[..., None, None]  # (B, F, C, 1, 1)
        # The 4th power: the square (a deviation of ~0.3) outweighs faint texture (~0.03) by 10^4, so the
        # centroid follows the object, not the grain a generator leaves over the background.
        m = (videos - median).abs().sum(2).pow(4)  # (B, F, H, W)
        w = videos.shape[-1]
        x = (torch.arange(w, dtype=videos.dtype) + 0.5) / w
        return (m.sum(2) * x).sum(-1) / m.sum((2, 3)).clamp_min(1e-6)

    def score(self, videos: Tensor, prompts: list[str]) -> dict[str, Tensor]:
        return {"position": -(self.centroid(videos) - self.target_fraction).abs().mean(1)}


REWARDS.setdefault("position", PositionTarget)  # by name, as a user's reward can be: configs check their reward names


class PositionJudge(VideoReward):
    """The held-out judge of the toy: the same target, −mean over frames of |ĉ_x − x*|, but ĉ_x comes from a learned
    model, not the reward's formula: a small conv net regressing the square's true horizontal centre per frame,
    fitted on toy clips disjoint from the generator's (another seed) with their ground-truth centres.

    It shares no code path with `PositionTarget` (no median, no 4th-power weights), so a sample that buys the
    formula without a square at x* (a streak, a blob the median misreads) does not buy the judge as well; each
    frame is standardised per channel and the fit sees random tints, so a global tint does not move it either."""

    names = ("position",)
    differentiable = False

    def __init__(self, size: int, target_fraction: float = 0.8, *, seed: int = 0) -> None:
        self.target_fraction = target_fraction
        g = torch.Generator().manual_seed(seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=g)))
            self.net = torch.nn.Sequential(
                torch.nn.Conv2d(3, 16, 3, stride=2, padding=1), torch.nn.GELU(),
                torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.GELU(),
                torch.nn.Flatten(), torch.nn.Linear(32 * (size // 4) ** 2, 64), torch.nn.GELU(), torch.nn.Linear(64, 1),
            )  # fmt: skip
        self.net.eval()

    @staticmethod
    def _standardise(frames: Tensor) -> Tensor:
        mean = frames.mean(dim=(-2, -1), keepdim=True)
        return (frames - mean) / (frames.std(dim=(-2, -1), keepdim=True, correction=0) + 0.02)

    def centres(self, videos: Tensor) -> Tensor:
        """Predicted horizontal centre per frame, as a fraction of the width: (B, F)."""
        B, F = videos.shape[:2]
        return torch.sigmoid(self.net(self._standardise(videos.flatten(0, 1).float()))).view(B, F)

    def fit(self, videos: Tensor, centres: Tensor, *, steps: int, seed: int, batch_size: int = 64, lr: float = 2e-3) -> float:
        """MSE on the true centres of single frames, each with a random per-channel gain and offset; final loss."""
        g = torch.Generator().manual_seed(seed)
        frames, target = videos.flatten(0, 1), centres.flatten()
        opt = torch.optim.Adam(self.net.parameters(), lr=lr)
        self.net.train()
        loss = torch.tensor(float("nan"))
        for _ in range(steps):
            idx = torch.randint(0, len(frames), (batch_size,), generator=g)
            x = frames[idx]
            gain = 1.0 + 0.3 * (2 * torch.rand(len(idx), 3, 1, 1, generator=g) - 1)
            x = (x * gain + 0.15 * (2 * torch.rand(len(idx), 3, 1, 1, generator=g) - 1)).clamp(0, 1)
            pred = torch.sigmoid(self.net(self._standardise(x))).squeeze(1)
            loss = torch.nn.functional.mse_loss(pred, target[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        self.net.eval()
        return float(loss.detach())

    @torch.no_grad()
    def score(self, videos: Tensor, prompts: list[str]) -> dict[str, Tensor]:
        return {"position": -(self.centres(videos) - self.target_fraction).abs().mean(1)}


def fit_judge(args: argparse.Namespace, reward: PositionTarget) -> tuple[PositionJudge, dict]:
    """The toy's held-out judge, fitted on clips of another seed than the generator's, and its agreement with the
    ground truth (and with the reward) on clips of a third seed that neither the generator nor the judge saw."""
    n = 128 if args.quick else 256
    videos, _, truth = square_clips(n, frames=args.frames, size=args.size, seed=args.seed + 7_919, centres=True)
    judge = PositionJudge(args.size, reward.target_fraction, seed=args.seed + 1)
    loss = judge.fit(videos, truth, steps=300 if args.quick else 800, seed=args.seed + 1)
    held, held_prompts, held_truth = square_clips(64, frames=args.frames, size=args.size, seed=args.seed + 15_838, centres=True)
    with torch.no_grad():
        j_centre, r_centre = judge.centres(held), reward.centroid(held)
        j_score, r_score = judge.score(held, held_prompts)["position"], reward(held, held_prompts)["position"]
    true_score = -(held_truth - reward.target_fraction).abs().mean(1)

    def corr(a: Tensor, b: Tensor) -> float:
        return round(float(torch.corrcoef(torch.stack([a.float(), b.float()]))[0, 1]), 4)

    return judge, {
        "model": "conv net regressing the square's centre per frame (not the reward's formula)",
        "train_clips": n, "train_seed": args.seed + 7_919, "heldout_clips": len(held), "heldout_seed": args.seed + 15_838,
        "fit_mse": round(loss, 5),
        "heldout_centre_mae": round(float((j_centre - held_truth).abs().mean()), 4),
        "reward_heldout_centre_mae": round(float((r_centre - held_truth).abs().mean()), 4),
        "heldout_corr_with_truth": corr(j_score, true_score),
        "reward_heldout_corr_with_truth": corr(r_score, true_score),
        "heldout_corr_with_reward": corr(j_score, r_score),
    }  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# Pre-training and one method's run
# ----------------------------------------------------------------------------------------------------------------


def pretrain_toy(videos: Tensor, prompts: list[str], *, frames: int, size: int, steps: int, seed: int) -> VideoGenerator:
    gen = VideoGenerator.from_preset("tiny", seed=seed, num_frames=frames, height=size, width=size)
    pretrain(gen, videos, prompts, steps=steps, lr=1e-3, batch_size=16, seed=seed)
    return gen


def method_config(method: str, args: argparse.Namespace):
    """One method's config: the same toy, schedule and learning rate for every method, plus its `--set` overrides."""
    overrides = [
        "--train.method", method, "--seed", str(args.seed), "--data.frames", str(args.frames), "--data.size", str(args.size),
        "--model.num_inference_steps", str(args.steps), "--train.prompts_per_round", "4",
        "--train.batch_size", "8", "--train.lr", str(args.lr),
        "--eval.prompts", "4", "--eval.samples_per_prompt", str(args.eval_samples), "--rewards.names", "[position]",
    ]  # fmt: skip
    if args.group is not None:
        overrides += ["--train.group_size", str(args.group)]
    if args.updates is not None:
        overrides += ["--train.updates_per_round", str(args.updates)]
    if args.ref_weight is not None:  # every method's anchor: λ of ‖v_θ − v_base‖², Flow-GRPO's per-step KL weight β
        overrides += ["--anchor.kl_weight" if method == "flow_grpo" else "--anchor.ref_weight", str(args.ref_weight)]
    overrides += [o for spec in args.set for o in _method_override(spec, method)]
    return load_video_config(None, overrides)


def run_method(method: str, base_dir: Path, args: argparse.Namespace, reward: PositionTarget, *, budget: float,
               marks: tuple[float, ...] = (), judge: PositionJudge | None = None) -> dict:
    """Train one method for `budget` CPU seconds of this process (evaluation excluded); evaluate every
    `args.eval_every` rounds, at the end, and on crossing each of `marks` (Flow-GRPO: the others' budget)."""
    cfg = method_config(method, args)
    # peft draws the LoRA A matrices from torch's global generator: re-seeded per method, every method starts from
    # the same adapter whatever ran before it in this process (and a `--methods` subset reproduces its run).
    torch.manual_seed(args.seed)
    gen = VideoGenerator.from_pretrained(base_dir)
    trainer = VideoTrainer(cfg, gen, make_rewards([reward]), [f"a {c} square" for c in COLOURS], judge=judge)
    curve = []
    ev, _ = trainer.evaluate()
    curve.append({"time_s": 0.0, "round": 0, "reward": ev["eval/position"], "diversity": ev["eval/diversity"],
                  **({"judge": ev["eval/judge_position"]} if judge is not None else {})})
    train_time = 0.0
    pending = sorted(m for m in marks if m < budget)
    while train_time < budget:
        t0 = time.process_time()
        trainer.train_round()
        train_time += time.process_time() - t0
        crossed = bool(pending) and train_time >= pending[0]
        while pending and train_time >= pending[0]:
            pending.pop(0)
        if trainer.round % args.eval_every == 0 or train_time >= budget or crossed:
            ev, _ = trainer.evaluate()
            curve.append({"time_s": round(train_time, 2), "round": trainer.round, "reward": ev["eval/position"],
                          "diversity": ev["eval/diversity"],
                          **({"judge": ev["eval/judge_position"]} if judge is not None else {})})  # fmt: skip
    return {"curve": curve, "rounds": trainer.round, "updates_per_round": cfg.train.updates_per_round,
            "group_size": cfg.train.group_size}


def _method_override(spec: str, method: str) -> list[str]:
    """`--set awr:train.awr.temperature=0.5` -> that override for method awr only (`*:` for all)."""
    who, _, kv = spec.partition(":")
    key, sep, value = kv.partition("=")
    if not sep or not key:
        raise SystemExit(f"--set {spec!r}: expected METHOD:KEY=VALUE, e.g. awr:train.updates_per_round=16")
    return ["--" + key, value] if who in ("*", method) else []


def smoothed(curve: list[dict]) -> list[float]:
    """Trailing mean of two consecutive evaluations: one lucky evaluation does not count as arriving."""
    r = [p["reward"] for p in curve]
    return [r[0]] + [(a + b) / 2 for a, b in zip(r, r[1:])]


def time_to(curve: list[dict], target: float) -> float | None:
    """Training seconds until the smoothed evaluation reward first reaches `target` (None: never)."""
    for point, value in zip(curve, smoothed(curve)):
        if value >= target:
            return point["time_s"]
    return None


def speedup_at(results: dict[str, dict], target: float, grpo_budget: float) -> dict:
    """Who of the methods other than Flow-GRPO reached `target` first, and its speed-up over Flow-GRPO: Flow-GRPO's
    measured time, or its whole (longer) budget when it never got there (then the speed-up is a lower bound)."""
    times = {m: time_to(r["curve"], target) for m, r in results.items()}
    reached = {m: t for m, t in times.items() if t is not None and m != "flow_grpo"}
    best = min(reached, key=reached.get) if reached else None
    grpo_time = times.get("flow_grpo")
    speedup = None
    if best is not None and "flow_grpo" in results:
        speedup = (grpo_time if grpo_time is not None else grpo_budget) / max(reached[best], 1e-9)
    return {"times": times, "best": best, "speedup": speedup, "lower_bound": speedup is not None and grpo_time is None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="16x16, 5 frames, a few seconds per method (< 1 minute)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=1,
                        help="run seeds --seed .. --seed + N - 1 (each pre-trains its own toy) and report the median "
                        "speed-up: one seed's time to the target moves by tens of percent with the trajectory")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--budget", type=float, default=None, help="training CPU seconds per method")
    parser.add_argument("--grpo-budget-factor", type=float, default=None,
                        help="Flow-GRPO (the reference) trains this many times the budget, so that its time to the "
                        "target is measured (default 4; 2 with --quick, to stay under a minute)")
    parser.add_argument("--group", type=int, default=None, help="train.group_size of every method (default: config)")
    parser.add_argument("--updates", type=int, default=None, help="train.updates_per_round of every method (default: config)")
    parser.add_argument("--eval-every", type=int, default=None, help="evaluate every this many rounds")
    parser.add_argument("--set", action="append", default=[], metavar="METHOD:KEY=VALUE",
                        help="a config override for one method (* for all), e.g. awr:train.awr.temperature=0.5")
    parser.add_argument("--size", type=int, default=None, help="frame height and width (multiple of 16)")
    parser.add_argument("--frames", type=int, default=None, help="frames per clip (4k + 1)")
    parser.add_argument("--pretrain-steps", type=int, default=None)
    parser.add_argument("--lr", type=float, default=1e-3, help="LoRA learning rate, the same for every method")
    parser.add_argument("--ref-weight", type=float, default=None,
                        help="anchor.ref_weight of every method and anchor.kl_weight of Flow-GRPO (default: the config's)")
    parser.add_argument("--target-fraction", type=float, default=0.5,
                        help="target reward = start + this fraction of the gap to the known maximum 0")
    parser.add_argument("--pretrained", default="",
                        help="reuse (or create) the pre-trained toy generator in this folder; with --seeds > 1 it must "
                        "hold {seed}, e.g. runs/video_toy/pre{seed}")
    args = parser.parse_args()
    if args.seeds < 1:
        parser.error(f"--seeds must be >= 1; got {args.seeds}")
    if args.seeds > 1 and args.pretrained and "{seed}" not in args.pretrained:
        parser.error(f"--pretrained {args.pretrained!r}: with --seeds {args.seeds} each seed pre-trains its own toy, "
                     "so the folder must hold {seed} (e.g. runs/video_toy/pre{seed})")
    for spec in args.set:  # refused now, not after pre-training
        _method_override(spec, "")
    q = args.quick
    # The tiny default generator at 16² × 5 frames: a CPU budget then holds hundreds of updates per method.
    args.frames = args.frames or 5
    args.size = args.size or 16
    args.pretrain_steps = args.pretrain_steps if args.pretrain_steps is not None else (300 if q else 800)
    args.budget = args.budget or (5.0 if q else 90.0)
    args.steps = 4  # sampling steps
    if q and args.updates is None:
        args.updates = 4
    args.eval_samples = 4 if q else 8  # per prompt (4 prompts) at every evaluation
    args.eval_every = args.eval_every or 3
    args.grpo_budget_factor = args.grpo_budget_factor or (2.0 if q else 4.0)
    torch.set_num_threads(1)
    seeds = range(args.seed, args.seed + args.seeds)
    summaries = []
    for seed in seeds:
        summaries.append(run_seed(argparse.Namespace(**{**vars(args), "seed": seed,
                                                        "pretrained": args.pretrained.format(seed=seed)})))
        if args.seeds > 1:
            print(json.dumps(summaries[-1]), flush=True)
    print(json.dumps(summaries[0] if args.seeds == 1 else across_seeds(summaries)))


def run_seed(args: argparse.Namespace) -> dict:
    """Pre-train (or load) the toy for `args.seed`, train every method on it, and summarise that seed."""
    q = args.quick
    grpo_budget = args.budget * args.grpo_budget_factor
    torch.manual_seed(args.seed)
    started = time.time()

    videos, prompts = square_clips(64 if q else 256, frames=args.frames, size=args.size, seed=args.seed)
    reward = PositionTarget(0.8)
    data_reward = float(reward(videos, prompts)["position"].mean())
    t0 = time.time()
    cached = Path(args.pretrained) if args.pretrained else None
    if cached is not None and (cached / "model_index.json").exists():
        gen = VideoGenerator.from_pretrained(cached)
        if (gen.config.num_frames, gen.config.height) != (args.frames, args.size):
            raise SystemExit(f"--pretrained {cached} holds a {gen.config.num_frames}-frame {gen.config.height}px model")
    else:
        gen = pretrain_toy(videos, prompts, frames=args.frames, size=args.size, steps=args.pretrain_steps, seed=args.seed)
        if cached is not None:
            gen.save_pretrained(cached)
    pretrain_s = time.time() - t0
    # The held-out judge: fitted outside every method's budget, scored on the evaluation samples only.
    judge, judge_info = fit_judge(args, reward)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        base_dir = gen.save_pretrained(Path(tmp) / "base")
        for method in args.methods.split(","):
            if method not in METHODS:
                raise SystemExit(f"--methods: unknown method {method!r}; valid: {', '.join(METHODS)}")
            is_grpo = method == "flow_grpo"
            results[method] = run_method(method, base_dir, args, reward, budget=grpo_budget if is_grpo else args.budget,
                                         marks=(args.budget,) if is_grpo else (), judge=judge)
            first, last = results[method]["curve"][0], results[method]["curve"][-1]
            print(f"{method:10s} rounds {results[method]['rounds']:3d}  reward {first['reward']:+.3f} -> "
                  f"{last['reward']:+.3f}  judge {first['judge']:+.3f} -> {last['judge']:+.3f}  "
                  f"diversity {first['diversity']:.3f} -> {last['diversity']:.3f}", flush=True)  # fmt: skip

    start = float(np.mean([r["curve"][0]["reward"] for r in results.values()]))
    target = start + args.target_fraction * (0.0 - start)  # part of the way to the known maximum 0
    headline = speedup_at(results, target, grpo_budget)
    times = headline["times"]
    for m, r in results.items():
        print(f"{m:10s} reward (judge) vs training seconds: "
              + ", ".join(f"{p['time_s']:.0f}s {p['reward']:+.3f} ({p['judge']:+.3f})" for p in r["curve"]))
    grpo = results.get("flow_grpo")
    grpo_time = times.get("flow_grpo")
    div_by_method = {m: r["curve"][-1]["diversity"] / max(r["curve"][0]["diversity"], 1e-9) for m, r in results.items()}
    # Nobody reached the target: the best final reward among the methods that kept diversity_ratio >= MIN_DIVERSITY
    # (a collapsed method's reward is not a result).
    kept = [m for m in results if m != "flow_grpo" and div_by_method[m] >= MIN_DIVERSITY]
    best = headline["best"] or max(kept, key=lambda m: results[m]["curve"][-1]["reward"], default=None)
    best_rule = "first to reach the target" if headline["best"] else f"best final reward with diversity_ratio >= {MIN_DIVERSITY}"
    speedup = headline["speedup"]
    # The same at other targets: how the speed-up depends on how far along the gap the target sits (the headline
    # stays at --target-fraction).
    by_fraction = {}
    for fraction in sorted({0.25, 0.5, 0.75, args.target_fraction}):
        at = speedup_at(results, start + fraction * (0.0 - start), grpo_budget)
        by_fraction[str(fraction)] = {
            "best_method": at["best"], "speedup_vs_flow_grpo": None if at["speedup"] is None else round(at["speedup"], 2),
            "speedup_is_lower_bound": at["lower_bound"],
            "time_to_target_s": {m: (round(t, 2) if t is not None else None) for m, t in at["times"].items()},
        }  # fmt: skip
    # Flow-GRPO's reward (smoothed) at the end of the budget every other method had: how much sooner did the
    # others get there?
    grpo_at_budget = None
    if grpo:
        # The evaluation forced on crossing the common budget (the last one, had Flow-GRPO no longer budget).
        past = [v for p, v in zip(grpo["curve"], smoothed(grpo["curve"])) if p["time_s"] >= args.budget]
        grpo_at_budget = past[0] if past else smoothed(grpo["curve"])[-1]
    to_grpo = {m: time_to(r["curve"], grpo_at_budget) for m, r in results.items()} if grpo else {}
    grpo_end = to_grpo.get("flow_grpo") or args.budget
    others = {m: t for m, t in to_grpo.items() if t is not None and m != "flow_grpo"}
    speedup_equal = grpo_end / max(min(others.values()), 1e-9) if others else None
    div_ratio = (
        results[best]["curve"][-1]["diversity"] / max(results[best]["curve"][0]["diversity"], 1e-9) if best else None
    )
    summary = {
        "benchmark": "video_rl",
        "quick": q,
        "clock": "process_cpu_s",  # time.process_time() of this process, torch on 1 thread; evaluation excluded
        "frames": args.frames,
        "size": args.size,
        "budget_s_per_method": args.budget,
        "budget_s_flow_grpo": grpo_budget,
        "pretrain_s": round(pretrain_s, 1),
        "data_reward_mean": round(data_reward, 4),
        "start_reward": round(start, 4),
        "target_reward": round(target, 4),
        "target_fraction_of_gap": args.target_fraction,
        "time_to_target_s": {m: (round(t, 2) if t is not None else None) for m, t in times.items()},
        "final_reward": {m: round(r["curve"][-1]["reward"], 4) for m, r in results.items()},
        # The held-out judge beside the reward: each method's gain (last evaluation − first) by both, and the gap
        # (reward gain − judge gain; well above 0: the reward rose where the judge did not, the hacking signal).
        "reward_gain": {m: round(gain(r, "reward"), 4) for m, r in results.items()},
        "judge_gain": {m: round(gain(r, "judge"), 4) for m, r in results.items()},
        "hacking_gap": {m: round(gain(r, "reward") - gain(r, "judge"), 4) for m, r in results.items()},
        "final_judge": {m: round(r["curve"][-1]["judge"], 4) for m, r in results.items()},
        "judge": judge_info,
        "diversity_ratio_by_method": {m: round(v, 3) for m, v in div_by_method.items()},
        "rounds": {m: r["rounds"] for m, r in results.items()},
        "updates_per_round": {m: r["updates_per_round"] for m, r in results.items()},
        "group_size": {m: r["group_size"] for m, r in results.items()},
        "overrides": args.set,
        "best_method": best,
        "best_method_rule": best_rule,
        "flow_grpo_reached_target": grpo_time is not None,
        "speedup_vs_flow_grpo": round(speedup, 2) if speedup is not None else None,
        "speedup_is_lower_bound": headline["lower_bound"],
        "speedup_by_target_fraction": by_fraction,
        "flow_grpo_reward_at_common_budget": round(grpo_at_budget, 4) if grpo_at_budget is not None else None,
        "time_to_flow_grpo_common_budget_reward_s": {m: (None if t is None else round(t, 2)) for m, t in to_grpo.items()},
        "speedup_to_flow_grpo_common_budget_reward": round(speedup_equal, 2) if speedup_equal is not None else None,
        "diversity_ratio": round(div_ratio, 3) if div_ratio is not None else None,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "process_cpu_s": round(time.process_time(), 1),
        "wall_s": round(time.time() - started, 1),
        "seed": args.seed,
    }
    return summary


def gain(result: dict, key: str) -> float:
    """Last evaluation − first of `key` ("reward" or "judge") on one method's curve."""
    return result["curve"][-1][key] - result["curve"][0][key]


def across_seeds(summaries: list[dict]) -> dict:
    """The seeds' headline figures side by side, and their lower median: a seed whose methods never reached the
    target (speed-up None) ranks below every measured one, so a failing seed cannot raise the median."""

    def median_low(values: list) -> float | None:
        ranked = sorted(values, key=lambda v: -np.inf if v is None else v)
        return ranked[(len(ranked) - 1) // 2]

    speedups = [s["speedup_vs_flow_grpo"] for s in summaries]
    first = summaries[0]
    return {
        "benchmark": "video_rl",
        "quick": first["quick"],
        "clock": first["clock"],
        "frames": first["frames"],
        "size": first["size"],
        "budget_s_per_method": first["budget_s_per_method"],
        "budget_s_flow_grpo": first["budget_s_flow_grpo"],
        "target_fraction_of_gap": first["target_fraction_of_gap"],
        "overrides": first["overrides"],
        "seeds": [s["seed"] for s in summaries],
        "speedup_vs_flow_grpo": median_low(speedups),
        "speedup_rule": "lower median over seeds; a seed that never reached the target ranks lowest",
        "speedup_per_seed": speedups,
        "speedup_is_lower_bound_per_seed": [s["speedup_is_lower_bound"] for s in summaries],
        "best_method_per_seed": [s["best_method"] for s in summaries],
        "time_to_target_s_per_seed": [s["time_to_target_s"] for s in summaries],
        "speedup_at_quarter_gap_per_seed": [s["speedup_by_target_fraction"]["0.25"]["speedup_vs_flow_grpo"] for s in summaries],
        "final_reward_per_seed": [s["final_reward"] for s in summaries],
        "reward_gain_per_seed": [s.get("reward_gain") for s in summaries],
        "judge_gain_per_seed": [s.get("judge_gain") for s in summaries],
        "hacking_gap_per_seed": [s.get("hacking_gap") for s in summaries],
        "diversity_ratio": median_low([s["diversity_ratio"] for s in summaries]),
        "diversity_ratio_per_seed": [s["diversity_ratio"] for s in summaries],
        "peak_rss_mb": max(s["peak_rss_mb"] for s in summaries),
        "process_cpu_s": round(time.process_time(), 1),
        "wall_s": round(sum(s["wall_s"] for s in summaries), 1),
    }


if __name__ == "__main__":
    main()
