"""Is the policy short of *where* or of *how*? The VLA trained twice on the same demonstrations: as it is, and with
the true positions of the named object and the goal appended to its state (an oracle no robot has). If the oracle
succeeds, the gap is perception (finding what the instruction names); if it fails too, it is the control.
`--arms plain,oracle,pixel_oracle` adds the oracle given what a perfect locator would give instead: the target's and
the goal's pixel positions in the agentview image (2D, where the grounded encoder's keypoints 0 and 1 point), so that
the grounded policy's gap splits into its locator's error and what 2D image points leave the action head to learn.

Both arms: the default VLA (64 px), the same demos, batch 64, AdamW at 3e-4 on a cosine schedule, the acting
average; each scored on the same evaluation seeds (training templates, strict success, sampled initial noise per
seed as `kinema eval` does). The oracle reads the positions from the simulator at every decision.

    python benchmarks/privileged_oracle.py --demos runs/pick_place-none-s0/demos --steps 12000
    python benchmarks/privileged_oracle.py --quick     # 12 fresh demos, 100 steps, 5 episodes: under a minute

Last line: one JSON object, per arm its success and wrong-target rates, and oracle_minus_plain.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time

import numpy as np
import torch

PRIVILEGED = ("privileged.target_pos", "privileged.goal_pos")
# What each arm appends to its state, from the simulator (none: the plain VLA).
ARMS = {
    "plain": (),
    "oracle": PRIVILEGED,
    "pixel_oracle": ("privileged.target_pixels.agentview", "privileged.goal_pixels.agentview"),
}


def at_image_size(episodes: list, image_size: int) -> list:
    """The episodes with their camera frames resized to `image_size` (demos recorded at another size)."""
    import cv2

    for ep in episodes:
        for key in [k for k in ep.observations if k.startswith("observation.images.")]:
            frames = ep.observations[key]
            if frames.shape[1] != image_size:
                ep.observations[key] = np.stack([cv2.resize(x, (image_size, image_size), interpolation=cv2.INTER_AREA) for x in frames])
    return episodes


def train(episodes: list, *, privileged: tuple[str, ...], steps: int, seed: int) -> torch.nn.Module:
    """SFT of the default VLA; its state is the end-effector pose followed by the `privileged` values (an arm of
    `ARMS`; none: the plain VLA)."""
    from kinema.train.actor import actor_updates, ema_update, policy_optimizer
    from kinema.train.buffer import StepBuffer
    from policies.vla import VLAConfig, VLAPolicy

    if privileged:
        episodes = [copy.copy(ep) for ep in episodes]
        for ep in episodes:
            ep.observations = {**ep.observations, "observation.state": np.concatenate(
                [ep.observations["observation.state"], *(ep.privileged[k] for k in privileged)], axis=1).astype(np.float32)}  # fmt: skip
    buffer = StepBuffer.from_episodes(episodes, ("agentview", "wrist"))
    torch.manual_seed(seed)
    config = VLAConfig(state_dim=buffer.state.shape[1], aux_dim=0 if buffer.aux is None else buffer.aux.shape[1])
    policy = VLAPolicy(config)
    policy.set_normalization(buffer.stats())
    acting = copy.deepcopy(policy)
    optimizer = policy_optimizer(policy, 3e-4, 1e-4)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps, eta_min=3e-5)
    done = [0]

    def on_step() -> None:
        schedule.step()
        done[0] += 1
        ema_update(acting, policy, min(0.995, (1 + done[0]) / (10 + done[0])))

    actor_updates(policy, optimizer, steps=steps, batch_size=64, demos=buffer, replay=None, replay_weights=None,
                  demo_fraction=1.0, aux_weight=1.0, rng=np.random.default_rng(seed), on_step=on_step)  # fmt: skip
    return acting.eval()


def evaluate(policy: torch.nn.Module, task: str, episodes: int, *, privileged: tuple[str, ...]) -> dict[str, float]:
    """Success and wrong-target rates on the first `episodes` evaluation seeds, one env, chunks as configured."""
    from kinema.train.evaluate import EVAL_SEED_OFFSET
    from sim.rollout import make_env

    env, config = make_env(task, image_size=policy.config.image_size), policy.config
    outcomes = []
    for e in range(episodes):
        obs, _ = env.reset(seed=EVAL_SEED_OFFSET + e)
        noise = torch.Generator().manual_seed(EVAL_SEED_OFFSET + e)
        queue, success, wrong = [], False, False
        for _ in range(env.config.horizon):
            if not queue:
                state = obs["observation.state"]
                if privileged:
                    values = env.privileged_with_pixels()
                    state = np.concatenate([state, *(values[k] for k in privileged)])
                batch = {k: torch.as_tensor(v[None]) for k, v in obs.items() if k.startswith("observation.images.")}
                batch |= {"observation.state": torch.as_tensor(state[None], dtype=torch.float32), "task": [obs["task"]]}
                chunk = policy.predict_action_chunk(batch, noise=torch.randn(1, config.chunk_size, config.action_dim, generator=noise))
                queue = list(chunk[0, : config.n_action_steps].numpy())
            obs, _, terminated, truncated, info = env.step(queue.pop(0))
            wrong = wrong or bool(info.get("wrong_target", False))
            if terminated or truncated:
                success = bool(terminated)
                break
        outcomes.append((success, wrong))
    env.close()
    rates = np.asarray(outcomes, float).mean(0)
    return {"success": round(float(rates[0]), 3), "wrong_target": round(float(rates[1]), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="pick_place")
    parser.add_argument("--demos", default="", help="a demonstration folder (LeRobotDataset v3) with privileged positions")
    parser.add_argument("--steps", type=int, default=12000)
    parser.add_argument("--episodes", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arms", default="plain,oracle", help=f"comma-separated, of {', '.join(ARMS)}")
    parser.add_argument("--quick", action="store_true", help="12 fresh scripted demos, 100 steps, 5 episodes")
    args = parser.parse_args()
    arms = [arm.strip() for arm in args.arms.split(",") if arm.strip()]
    unknown = [arm for arm in arms if arm not in ARMS]
    if unknown or not arms:
        parser.error(f"--arms {args.arms!r}: {'unknown ' + ', '.join(unknown) if unknown else 'no arm given'}; valid: {', '.join(ARMS)}")
    if not args.quick and not args.demos:
        parser.error("--demos DIR is needed (or --quick, which collects 12 demos itself)")
    os.environ.setdefault("MUJOCO_GL", "egl")
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    start = time.time()
    if args.quick:
        from sim.rollout import collect_demos

        args.steps, args.episodes = 100, 5
        demos = collect_demos(args.task, 12)
    else:
        from diffusion_rl.data.lerobot_v3 import read_episodes

        demos = read_episodes(args.demos)
    demos = [ep for ep in demos if ep.outcome]
    if not demos:
        raise SystemExit(f"{args.demos or 'the collected demos'}: no successful demonstration to imitate")
    if missing := [k for arm in arms for k in ARMS[arm] if k not in demos[0].privileged]:
        raise SystemExit(f"{args.demos}: the demonstrations hold no {missing}; the oracle needs the simulator's positions")
    demos = at_image_size(demos, 64)
    out: dict = {"task": args.task, "demos": len(demos), "steps": args.steps, "episodes": args.episodes, "seed": args.seed}
    for arm in arms:
        t = time.time()
        policy = train(demos, privileged=ARMS[arm], steps=args.steps, seed=args.seed)
        out[arm] = evaluate(policy, args.task, args.episodes, privileged=ARMS[arm]) | {"seconds": round(time.time() - t, 1)}
        print(arm, out[arm], flush=True)
    for arm in arms:
        if arm != "plain" and "plain" in arms:
            out[f"{arm}_minus_plain"] = round(out[arm]["success"] - out["plain"]["success"], 3)
    out["seconds"] = round(time.time() - start, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
