"""A full-size SmolVLA's (or π0's) training step and acting on one GPU: the VLM in bf16 against the same model in fp32.

    python benchmarks/smolvla_gpu.py --checkpoint DIR --vlm-path VLM_DIR   # a SmolVLA you have (LeRobot's folder)
    python benchmarks/smolvla_gpu.py                                       # smolvla_base's size, random weights
    python benchmarks/smolvla_gpu.py --quick                               # the tiny test fixture, CPU, seconds
    python benchmarks/smolvla_gpu.py --policy pi0 [--checkpoint DIR] [--quick]   # the same for LeRobot's π0

Without --checkpoint the model is smolvla_base's architecture (SmolVLM2-500M's config: 16 of its 32 text layers, 960
wide; the expert at 0.75 of that width; chunks of 50) with random weights and a stand-in tokenizer: what a step costs
does not depend on the weights, and nothing is downloaded. Each precision trains `--steps` steps of kinema's flow loss
on synthetic batches (`--trainable`: by default the action expert, its projections and state_proj, LeRobot's default;
`lora` adds LoRA on the VLM's text attention) and acts at batch 1. `--policy pi0`: pi0_base's size (PaliGemma's
gemma_2b and SigLIP-so400m at 224 px, the gemma_300m expert: 4.0 B parameters, 0.8 B of them the two unused language
heads, 16 GB in fp32; 315 M train with `--trainable expert`), the tiny π0 fixture with --quick; the fp32 run is the
reference. Last line: one JSON object with per precision `step_s`, `chunk_ms` (batch-1 acting), `peak_memory_gb`
(CUDA), the parameter counts, `bf16_over_fp32` (step time) and `bf16_action_error` (the largest difference of a chunk
from the same inputs and noise).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
FIXTURE = ROOT / "tests" / "fixtures" / "smolvla"
PI0_FIXTURE = ROOT / "tests" / "fixtures" / "pi0" / "tiny-pi0"
# SmolVLM2-500M-Video-Instruct's architecture, as its config.json gives it (what smolvla_base is built on)
SMOLVLM2_500M = dict(
    vision_config=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                       image_size=512, patch_size=16),
    text_config=dict(model_type="llama", hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
                     num_attention_heads=15, num_key_value_heads=5, head_dim=64, vocab_size=49280,
                     max_position_embeddings=8192, rms_norm_eps=1e-5),
    scale_factor=4, image_token_id=49190,
)  # fmt: skip


def random_smolvla_base(device: str, trainable: str):
    from transformers import AutoTokenizer, SmolVLMConfig

    from policies.smolvla import SmolVLAConfig, SmolVLAPolicy

    config = SmolVLAConfig(chunk_size=50, n_action_steps=50, max_state_dim=32, max_action_dim=32, state_dim=8, action_dim=7,
                           resize_imgs_with_padding=(512, 512), num_vlm_layers=16, expert_width_multiplier=0.75,
                           vlm_path=str(FIXTURE / "tiny-smolvlm"), trainable=trainable)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    stats = {"observation.state": {"mean": torch.zeros(8), "std": torch.ones(8)},
             "action": {"mean": torch.zeros(7), "std": torch.ones(7)}}  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(FIXTURE / "tiny-smolvlm", local_files_only=True)  # a stand-in: ids < 320
    torch.manual_seed(int(torch.randint(0, 1000, (1,), generator=g)))
    return SmolVLAPolicy(config, vlm_config=SmolVLMConfig(**SMOLVLM2_500M), tokenizer=tokenizer, stats=stats).to(device)


def random_pi0_base(device: str, trainable: str):
    from policies.pi0 import Pi0Config, Pi0Policy
    from policies.pi0.modeling_pi0 import load_tokenizer

    config = Pi0Config(chunk_size=50, n_action_steps=50, state_dim=8, action_dim=7, trainable=trainable, num_steps=10)
    stats = {"observation.state": {"mean": torch.zeros(8), "std": torch.ones(8)},
             "action": {"mean": torch.zeros(7), "std": torch.ones(7)}}  # fmt: skip
    tokenizer = load_tokenizer(str(PI0_FIXTURE / "tokenizer"))  # a stand-in: ids < 300
    return Pi0Policy(config, tokenizer=tokenizer, stats=stats).to(device)


def load(args, device: str):
    from policies.pi0 import Pi0Policy
    from policies.smolvla import SmolVLAPolicy

    if args.policy == "pi0":
        if args.quick or args.checkpoint:
            return Pi0Policy.from_pretrained(PI0_FIXTURE if args.quick else args.checkpoint, trainable=args.trainable).to(device)
        return random_pi0_base(device, args.trainable)
    if args.quick:
        return SmolVLAPolicy.from_pretrained(FIXTURE / "tiny-smolvla", vlm_path=str(FIXTURE / "tiny-smolvlm"), trainable=args.trainable).to(device)
    if args.checkpoint:
        return SmolVLAPolicy.from_pretrained(args.checkpoint, vlm_path=args.vlm_path or None, trainable=args.trainable).to(device)
    return random_smolvla_base(device, args.trainable)


def batch_for(policy, size: int, side: int, device: str, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    cfg = policy.config
    batch = {f"observation.images.{c}": torch.randint(0, 256, (size, side, side, 3), dtype=torch.uint8, generator=g).to(device)
             for c in cfg.cameras}  # fmt: skip
    batch["observation.state"] = torch.randn(size, cfg.state_dim, generator=g).to(device)
    batch["task"] = ["pick up the red cube and put it on the blue plate"] * size
    batch["action"] = torch.randn(size, cfg.chunk_size, cfg.action_dim, generator=g).to(device)
    return batch


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(policy, args, device: str) -> dict:
    train_batch = batch_for(policy, args.batch_size, args.image_side, device, 0)
    act_batch = {k: v for k, v in batch_for(policy, 1, args.image_side, device, 1).items() if k != "action"}
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-4)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    policy.train()
    times = []
    for step in range(args.steps + 1):  # the first step warms up (kernels, allocator) and is not counted
        sync(device)
        start = time.perf_counter()
        loss = policy.flow_loss(train_batch).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        sync(device)
        if step:
            times.append(time.perf_counter() - start)
    policy.eval()
    noise = torch.randn(1, policy.config.chunk_size, policy.config.max_action_dim, generator=torch.Generator().manual_seed(2)).to(device)
    chunk, latencies = None, []
    for _ in range(args.act_repeats + 1):
        sync(device)
        start = time.perf_counter()
        chunk = policy.predict_action_chunk(act_batch, noise=noise)
        sync(device)
        latencies.append(time.perf_counter() - start)
    return {
        "step_s": round(sorted(times)[len(times) // 2], 4),
        "chunk_ms": round(1000 * sorted(latencies[1:])[len(latencies[1:]) // 2], 2),
        "peak_memory_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.startswith("cuda") else None,
        "loss": round(float(loss.detach()), 4),
        "_chunk": chunk.float().cpu(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", default="smolvla", choices=("smolvla", "pi0"))
    parser.add_argument("--checkpoint", default="", help="a local LeRobot SmolVLA (pi0) folder; empty: smolvla_base's (pi0_base's) size, random")
    parser.add_argument("--vlm-path", default="", help="the checkpoint's VLM (config and tokenizer), locally")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-side", type=int, default=256, help="side of the synthetic camera frames (resized with padding)")
    parser.add_argument("--act-repeats", type=int, default=10)
    parser.add_argument("--trainable", default="expert", choices=("expert", "lora", "vlm", "all"),
                        help="what trains: the action expert (LeRobot's default), plus LoRA on the VLM, the VLM, everything")
    parser.add_argument("--quick", action="store_true", help="the tiny fixture on the CPU: checks the script in seconds")
    args = parser.parse_args()
    if args.quick:
        args.device, args.steps, args.batch_size, args.image_side, args.act_repeats = "cpu", 3, 4, 32, 3
    results = {}
    for dtype in ("float32", "bfloat16"):
        torch.manual_seed(0)
        policy = load(args, args.device)
        vlm = policy.model.paligemma_with_expert.paligemma if args.policy == "pi0" else policy.model.vlm_with_expert.vlm
        vlm.to(getattr(torch, dtype))  # the frozen VLM; the expert trains in fp32
        results[dtype] = measure(policy, args, args.device)
        results[dtype]["parameters"] = sum(p.numel() for p in policy.parameters())
        results[dtype]["trainable_parameters"] = sum(p.numel() for p in policy.parameters() if p.requires_grad)
        print(dtype, {k: v for k, v in results[dtype].items() if not k.startswith("_")}, flush=True)
        del policy
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    error = float((results["bfloat16"].pop("_chunk") - results["float32"].pop("_chunk")).abs().max())
    summary = {
        "model": "tiny fixture" if args.quick else (args.checkpoint or f"{args.policy}_base size, random weights"),
        "policy": args.policy,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "batch_size": args.batch_size, "steps": args.steps, "trainable": args.trainable, **results,
        "bf16_over_fp32": round(results["bfloat16"]["step_s"] / results["float32"]["step_s"], 3),
        "bf16_action_error": round(error, 5),
    }  # fmt: skip
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
