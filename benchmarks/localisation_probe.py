"""Can a camera encoder say where a small object is? A known-answer probe for the VLA's vision encoders.

A pick_place cube (4 cm, three to four pixels wide at 64 px) is put at random places on the table and rendered from
the agentview camera; each encoder (with a linear head, no instruction) is trained to regress the cube's pixel
position, computed from the camera's pose, and is scored on frames it never saw. The spatial softmax keeps *where*;
the stride-4 patchify puts the cube inside one patch, and from few frames memorises them instead (benchmarks/RESULTS.md
has both budgets).

    python benchmarks/localisation_probe.py            # 2048 training frames, 2000 steps per encoder
    python benchmarks/localisation_probe.py --quick    # 512 frames, 800 steps: under a minute

Last line: one JSON object, per encoder the held-out median and mean error in pixels (and the training error), and
patchify_over_spatial_softmax, the ratio of their held-out median errors.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import mujoco
import numpy as np
import torch

ENCODERS = ("patchify", "spatial_softmax")


def cube_frames(n: int, seed: int, *, image_size: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """`n` agentview frames (n, H, W, 3) of pick_place's one cube at random table positions and yaws, and its
    centre's pixel position (n, 2) as (column, row) from the camera's pose and field of view."""
    from sim.tasks import make

    env = make("pick_place", {"num_distractors": 0}, image_size=image_size)
    rng = np.random.default_rng(seed)
    cam = env.model.camera("agentview").id
    focal = (image_size / 2) / np.tan(np.deg2rad(env.model.cam_fovy[cam]) / 2)
    images, pixels = [], []
    for _ in range(n):
        obs, _ = env.reset(seed=int(rng.integers(1 << 30)))
        xy = [rng.uniform(*env.config.x_range), rng.uniform(*env.config.y_range)]
        env.set_free_body(env.target.body, np.array([*xy, 0.02]), rng.uniform(-0.4, 0.4))
        mujoco.mj_forward(env.model, env.data)
        images.append(env._observation()["observation.images.agentview"])
        world = env.data.xpos[env.model.body(env.target.body).id]
        x, y, z = env.data.cam_xmat[cam].reshape(3, 3).T @ (world - env.data.cam_xpos[cam])  # camera looks along -z
        pixels.append([image_size / 2 + focal * x / -z, image_size / 2 - focal * y / -z])
    env.close()
    return np.stack(images), np.asarray(pixels, np.float32)


def probe(encoder: str, train: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray], *, steps: int,
          batch_size: int = 32, lr: float = 1e-3, seed: int = 0, **config) -> dict[str, float]:  # fmt: skip
    """Train `encoder` (a VLAConfig.vision_encoder, with `config` overrides) and a linear head to regress the pixel
    position; its errors in pixels on `test` (median, mean) and on the last training batches (rms)."""
    from policies.vla.configuration_vla import VLAConfig
    from policies.vla.modeling_vla import VISION_ENCODERS

    torch.manual_seed(seed)
    size = train[0].shape[1]
    cfg = VLAConfig(vision_encoder=encoder, image_size=size, **config)
    net, head = VISION_ENCODERS[encoder](cfg), torch.nn.Linear(cfg.vision_dim, 2)
    opt = torch.optim.Adam([*net.parameters(), *head.parameters()], lr)
    images = {k: torch.as_tensor(x).permute(0, 3, 1, 2).float() / 255 for k, (x, _) in (("train", train), ("test", test))}
    targets = {k: torch.as_tensor(y) for k, (_, y) in (("train", train), ("test", test))}
    text = torch.zeros(1, cfg.text_dim)  # no instruction: FiLM starts as the identity

    def predict(x: torch.Tensor) -> torch.Tensor:
        return head(net(x, text.expand(len(x), -1))) * (size / 2) + size / 2

    losses = []
    for _ in range(steps):
        idx = torch.randint(len(images["train"]), (batch_size,))
        loss = (predict(images["train"][idx]) - targets["train"][idx]).pow(2).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        err = (predict(images["test"]) - targets["test"]).norm(dim=-1)
    return {"test_median_px": round(float(err.median()), 3), "test_mean_px": round(float(err.mean()), 3),
            "train_rms_px": round(float(np.sqrt(np.mean(losses[-50:]))), 3)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="512 frames and 800 steps per encoder (under a minute)")
    parser.add_argument("--frames", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--image-size", type=int, default=64)
    args = parser.parse_args()
    if args.quick:
        args.frames, args.steps = 512, 800
    os.environ.setdefault("MUJOCO_GL", "egl")
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    start = time.time()
    train, test = cube_frames(args.frames, 0, image_size=args.image_size), cube_frames(256, 1, image_size=args.image_size)
    out: dict = {"frames": args.frames, "steps": args.steps, "image_size": args.image_size,
                 "label_spread_px": round(float(test[1].std(0).mean()), 2)}  # fmt: skip
    for encoder in ENCODERS:
        t = time.time()
        out[encoder] = probe(encoder, train, test, steps=args.steps) | {"seconds": round(time.time() - t, 1)}
        print(encoder, out[encoder], flush=True)
    out["patchify_over_spatial_softmax"] = round(out["patchify"]["test_median_px"] / out["spatial_softmax"]["test_median_px"], 2)
    out["seconds"] = round(time.time() - start, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
