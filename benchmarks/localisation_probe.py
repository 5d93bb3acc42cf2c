"""Can a camera encoder say where a small object is? A known-answer probe for the VLA's vision encoders.

A pick_place cube (4 cm, three to four pixels wide at 64 px) is put at random places on the table and rendered from
the agentview camera; each encoder (with a linear head, no instruction) is trained to regress the cube's pixel
position, computed from the camera's pose, and is scored on frames it never saw. The spatial softmax keeps *where*;
the stride-4 patchify puts the cube inside one patch, and from few frames memorises them instead (benchmarks/RESULTS.md
has both budgets). `--named` asks what the policy must do at full difficulty: find the object the instruction names
among a distractor and two plates, the instruction read by the VLA's word encoder and fed to the convs (FiLM).

    python benchmarks/localisation_probe.py            # 2048 training frames, 2000 steps per encoder
    python benchmarks/localisation_probe.py --quick    # 512 frames, 800 steps: under a minute

    python benchmarks/localisation_probe.py --named    # the named object among two, read from the instruction

Last line: one JSON object, per encoder the held-out median and mean error in pixels (and the training error), and
patchify_over_best, patchify's held-out median error over the best encoder's. `patchify_grounded` runs twice: read by a
linear head like the others, and `patchify_grounded_direct`, its first keypoint trained to classify the cells around the
label (soft labels, as the policy trains it), beside `..._hard_cells` (the one cell holding it) and soft_over_hard_cells,
and `..._stride2` (its map at image_size / 2: `locator_stride=2`) and stride4_over_stride2.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import mujoco
import numpy as np
import torch

ENCODERS = ("patchify", "spatial_softmax", "patchify_grounded")


def pixel_position(env, image_size: int) -> list[float]:
    """The named object's centre in the agentview image, (column, row) in pixels (`TabletopEnv.image_positions`)."""
    x, y = env.image_positions(env.body_pos(env.target.body)[None])[env.cameras.index("agentview"), 0]
    return [(x + 1) / 2 * image_size, (y + 1) / 2 * image_size]


def cube_frames(n: int, seed: int, *, image_size: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """`n` agentview frames (n, H, W, 3) of pick_place's one cube at random table positions and yaws, and its
    centre's pixel position (n, 2) as (column, row)."""
    from sim.tasks import make

    env = make("pick_place", {"num_distractors": 0}, image_size=image_size)
    rng = np.random.default_rng(seed)
    images, pixels = [], []
    for _ in range(n):
        obs, _ = env.reset(seed=int(rng.integers(1 << 30)))
        xy = [rng.uniform(*env.config.x_range), rng.uniform(*env.config.y_range)]
        env.set_free_body(env.target.body, np.array([*xy, 0.02]), rng.uniform(-0.4, 0.4))
        mujoco.mj_forward(env.model, env.data)
        images.append(env._observation()["observation.images.agentview"])
        pixels.append(pixel_position(env, image_size))
    env.close()
    return np.stack(images), np.asarray(pixels, np.float32)


def named_object_frames(n: int, seed: int, *, image_size: int = 64) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """`n` first agentview frames of pick_place at full difficulty (the named object, one distractor, two plates,
    random colours, shapes and yaws), the named object's pixel position (n, 2) and the instructions: finding it takes
    reading which object the instruction names."""
    from sim.tasks import make

    env = make("pick_place", image_size=image_size)
    rng = np.random.default_rng(seed)
    images, pixels, instructions = [], [], []
    for _ in range(n):
        obs, _ = env.reset(seed=int(rng.integers(1 << 30)))
        images.append(obs["observation.images.agentview"])
        pixels.append(pixel_position(env, image_size))
        instructions.append(obs["task"])
    env.close()
    return np.stack(images), np.asarray(pixels, np.float32), instructions


def probe(encoder: str, train: tuple, test: tuple, *, steps: int, batch_size: int = 32, lr: float = 1e-3, seed: int = 0,
          direct: bool = False, hard_cells: bool = False, **config) -> dict[str, float]:  # fmt: skip
    """Train `encoder` (a VLAConfig.vision_encoder, with `config` overrides) and a linear head to regress the pixel
    position; its errors in pixels on `test` (median, mean) and on the last training batches (rms). `train` and `test`
    are (frames, pixels) or, for a named object, (frames, pixels, instructions): the VLA's word encoder then reads the
    instruction and modulates the convs (FiLM), as in the policy. An encoder with keypoints is read through its
    coordinates alone (as `aux_input="keypoints"` reads them); `direct`: its first keypoint *is* the prediction, with
    no head in between, its cells trained to classify the ones around the label (`InstructionLocator.cell_distribution`,
    as the policy trains it), or with `hard_cells` the one cell that holds it (the policy until 12-07: the reference)."""
    from policies.vla.configuration_vla import VLAConfig
    from policies.vla.modeling_vla import VISION_ENCODERS
    from policies.vla.text import HashTokenizer, TextEncoder

    torch.manual_seed(seed)
    size = train[0].shape[1]
    cfg = VLAConfig(vision_encoder=encoder, image_size=size, **config)
    net = VISION_ENCODERS[encoder](cfg)
    if direct and not hasattr(net, "locator"):
        raise ValueError(f"direct supervision needs an encoder with an instruction locator; {encoder!r} has none")
    head = (lambda c: c[:, :2]) if direct else torch.nn.Linear(net.where_dim or cfg.vision_dim, 2)
    named = len(train) == 3
    words = TextEncoder(cfg.ngram_buckets, cfg.text_dim, cfg.text_layers, cfg.max_words) if named else None
    tokenizer = HashTokenizer(cfg.ngram_buckets, cfg.max_words)
    opt = torch.optim.Adam([*net.parameters(), *([] if direct else head.parameters()), *(words.parameters() if named else ())], lr)
    images = {k: torch.as_tensor(d[0]).permute(0, 3, 1, 2).float() / 255 for k, d in (("train", train), ("test", test))}
    targets = {k: torch.as_tensor(d[1]) for k, d in (("train", train), ("test", test))}
    texts = {k: d[2] if named else None for k, d in (("train", train), ("test", test))}

    def instruction(split: str, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pooled, per-word features, mask) of the frames' instructions."""
        if named:
            ids, mask = tokenizer([texts[split][i] for i in idx.tolist()])
            per_word, text = words(ids, mask)
            return text, per_word, mask
        # no instruction: FiLM starts as the identity, and a grounded encoder's one "word" is blank
        return torch.zeros(len(idx), cfg.text_dim), torch.zeros(len(idx), 1, cfg.text_dim), torch.ones(len(idx), 1, dtype=torch.bool)

    def predict(split: str, idx: torch.Tensor) -> torch.Tensor:
        features = net(images[split][idx], *instruction(split, idx))
        return head(features[:, features.shape[1] - net.where_dim :] if net.where_dim else features) * (size / 2) + size / 2

    def cell_loss(idx: torch.Tensor) -> torch.Tensor:  # direct: the first keypoint classifies the labelled cell
        _, per_word, mask = instruction("train", idx)
        logits = net.locator.logits(net.inputs(images["train"][idx]), per_word, mask)[:, 0]
        xy = targets["train"][idx] / (size / 2) - 1
        if hard_cells:
            side = int(np.sqrt(logits.shape[-1]))
            cell = ((xy + 1) / 2 * side).long().clamp(0, side - 1)
            return torch.nn.functional.cross_entropy(logits, cell[:, 1] * side + cell[:, 0])
        return net.locator.cell_loss(logits, xy).mean()

    losses = []
    for _ in range(steps):
        idx = torch.randint(len(images["train"]), (batch_size,))
        error = (predict("train", idx) - targets["train"][idx]).pow(2).sum(-1).mean()
        loss = cell_loss(idx) if direct else error
        error = error.detach()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(error.item())
    with torch.no_grad():
        err = (predict("test", torch.arange(len(images["test"]))) - targets["test"]).norm(dim=-1)
    return {"test_median_px": round(float(err.median()), 3), "test_mean_px": round(float(err.mean()), 3),
            "train_rms_px": round(float(np.sqrt(np.mean(losses[-50:]))), 3)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="512 frames and 800 steps per encoder (under a minute)")
    parser.add_argument("--frames", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--named", action="store_true",
                        help="the named object among a distractor and two plates, the instruction read through FiLM")
    parser.add_argument("--encoders", default=",".join(ENCODERS), help=f"comma-separated, of {', '.join(ENCODERS)}")
    args = parser.parse_args()
    if args.quick:
        args.frames, args.steps = 512, 800
    encoders = args.encoders.split(",")
    if unknown := set(encoders) - set(ENCODERS):
        parser.error(f"--encoders: unknown {sorted(unknown)}; expected some of {', '.join(ENCODERS)}")
    os.environ.setdefault("MUJOCO_GL", "egl")
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    start = time.time()
    frames = named_object_frames if args.named else cube_frames
    train, test = frames(args.frames, 0, image_size=args.image_size), frames(256, 1, image_size=args.image_size)
    out: dict = {"frames": args.frames, "steps": args.steps, "image_size": args.image_size, "named": args.named,
                 "label_spread_px": round(float(test[1].std(0).mean()), 2)}  # fmt: skip
    # Each encoder read by a linear head; the grounded one also with its first keypoint's cells classified directly,
    # on soft labels (as the policy trains it), on the one cell holding the label (the reference), and on a map of
    # twice the resolution (locator_stride 2).
    arms = [(e, e, False, False, {}) for e in encoders]
    if "patchify_grounded" in encoders:
        arms += [("patchify_grounded_direct", "patchify_grounded", True, False, {}),
                 ("patchify_grounded_direct_hard_cells", "patchify_grounded", True, True, {}),
                 ("patchify_grounded_direct_stride2", "patchify_grounded", True, False, {"locator_stride": 2})]
    for name, encoder, direct, hard_cells, extra in arms:
        t = time.time()
        out[name] = probe(encoder, train, test, steps=args.steps, direct=direct, hard_cells=hard_cells, **extra) | {"seconds": round(time.time() - t, 1)}
        print(name, out[name], flush=True)
    best = min((name for name, *_ in arms), key=lambda e: out[e]["test_median_px"])
    if "patchify" in encoders and best != "patchify":
        out["patchify_over_best"] = round(out["patchify"]["test_median_px"] / out[best]["test_median_px"], 2)
        out["best"] = best
    if "patchify_grounded" in encoders:
        out["soft_over_hard_cells"] = round(out["patchify_grounded_direct"]["test_median_px"] / out["patchify_grounded_direct_hard_cells"]["test_median_px"], 2)
        out["stride4_over_stride2"] = round(out["patchify_grounded_direct"]["test_median_px"] / out["patchify_grounded_direct_stride2"]["test_median_px"], 2)
    out["seconds"] = round(time.time() - start, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
