"""Batch-1 inference latency of the default VLA against the time its chunk takes to execute at 20 Hz.

Reference (measured in the same run): one env step with 2 cameras, i.e. what the control loop must also fit in.
The ratio `latency_over_chunk_time` must stay well below 1 for asynchronous 20 Hz control.
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

import numpy as np
import torch

from policies.vla import VLAConfig, VLAPolicy
from sim.env import CONTROL_HZ
from sim.tasks import make


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--backbone-path", default="", help="a local SmolVLM/Idefics3 folder; 'tiny-random' writes a tiny one")
    parser.add_argument("--backbone-image-size", type=int, default=0, help="vision side for the smolvlm backbone (0: native)")
    parser.add_argument("--backbone-layers", type=int, default=0, help="text layers run by the smolvlm backbone (0: all)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    repeats = 30 if args.quick else 200

    config = VLAConfig(aux_dim=15)
    if args.backbone_path:
        path = args.backbone_path
        if path == "tiny-random":
            from policies.vla.smolvlm import write_tiny_idefics3

            path = write_tiny_idefics3(tempfile.mkdtemp(prefix="tiny-idefics3-"))
        config = VLAConfig(
            aux_dim=15, backbone="smolvlm", backbone_path=path, backbone_image_size=args.backbone_image_size,
            backbone_layers=args.backbone_layers,
        )
    policy = VLAPolicy(config).eval()
    env = make("drawer", image_size=config.image_size)
    obs, _ = env.reset(seed=0)
    batch = {k: (torch.from_numpy(v[None]) if isinstance(v, np.ndarray) else [v]) for k, v in obs.items()}
    for _ in range(5):
        policy.predict_action_chunk(batch)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        policy.predict_action_chunk(batch)
        times.append(time.perf_counter() - t0)
    step_times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        env.step(np.zeros(7))
        step_times.append(time.perf_counter() - t0)
    env.close()
    latency = np.array(times) * 1e3
    chunk_ms = 1e3 * config.n_action_steps / CONTROL_HZ
    print(
        json.dumps(
            {
                "benchmark": "vla_latency",
                "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, {args.threads} thread(s)",
                "backbone": config.backbone if config.backbone == "tiny" else f"smolvlm:{config.backbone_path}",
                "parameters_m": round(sum(p.numel() for p in policy.parameters()) / 1e6, 2),
                "latency_ms_median": round(float(np.median(latency)), 2),
                "latency_ms_p99": round(float(np.percentile(latency, 99)), 2),
                "chunk_execution_ms": chunk_ms,
                "env_step_ms_median": round(float(np.median(step_times)) * 1e3, 2),
                "latency_over_chunk_time": round(float(np.percentile(latency, 99)) / chunk_ms, 4),
            }
        )
    )


if __name__ == "__main__":
    main()
