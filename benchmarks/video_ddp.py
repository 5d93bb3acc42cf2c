"""`kinema video train`'s round on 2 gloo ranks against 1 process: seconds per `VideoTrainer.train_round`.

    python benchmarks/video_ddp.py [--quick] [--rounds 3] [-- --train.group_size 8 ...]  (config overrides after --)

The tiny generator (5 frames of 16²), the rewards exposure and sharpness; the same global round on both sides
(`train.prompts_per_round` × `train.group_size` rollouts, `train.updates_per_round` steps of `train.batch_size`):
2 ranks each roll out half of the groups and take half of each minibatch. Prints JSON: the median round time of
each and `ddp_round_ratio` (2 ranks / 1 process; < 1 is a speed-up). On one machine the ranks share its cores.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.multiprocessing as mp

ROUND = ["--data.frames", "5", "--data.size", "16", "--train.prompts_per_round", "4", "--train.group_size", "4",
         "--train.updates_per_round", "4", "--train.batch_size", "8", "--model.num_inference_steps", "8",
         "--rewards.names", "[exposure, sharpness]"]  # fmt: skip


def round_times(overrides: list[str], rounds: int) -> list[float]:
    from kinema.video.config import load_video_config
    from kinema.video.trainer import VideoTrainer
    from policies.video.generator import VideoGenerator
    from policies.video.rewards import make_rewards

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = load_video_config(None, [*ROUND, *overrides])
    gen = VideoGenerator.from_preset("tiny", seed=0, num_frames=5, height=16, width=16)
    prompts = ["open the drawer", "push the green cube to the left", "put the red cube on the blue plate", "close the drawer"]
    trainer = VideoTrainer(cfg, gen, make_rewards(["exposure", "sharpness"]), prompts)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        trainer.train_round()
        times.append(time.perf_counter() - start)
    return times


def rank_main(rank: int, port: int, overrides: list[str], rounds: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      GLOO_SOCKET_IFNAME="lo")  # fmt: skip
    from kinema.train import distributed

    distributed.init_from_env()
    times = round_times(overrides, rounds)
    if rank == 0:
        torch.save(times, out)
    distributed.barrier()
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one round each (about half a minute)")
    parser.add_argument("overrides", nargs="*", help="config overrides (default method: awr)")
    args = parser.parse_args()
    if args.quick:
        args.rounds = 1
    single = round_times(args.overrides, args.rounds)
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        out = os.path.join(tmp, "times.pt")
        mp.start_processes(rank_main, args=(port, args.overrides, args.rounds, out), nprocs=2, start_method="spawn")
        ddp = torch.load(out)
    one, two = statistics.median(single), statistics.median(ddp)
    print(json.dumps({"benchmark": "video_ddp", "quick": args.quick, "overrides": " ".join(args.overrides), "rounds": args.rounds, "round_s_1_process": round(one, 2),
                      "round_s_2_ranks": round(two, 2), "ddp_round_ratio": round(two / one, 3),
                      "load_average": round(os.getloadavg()[0], 1)}))  # fmt: skip


if __name__ == "__main__":
    main()
