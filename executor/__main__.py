"""Multi-node launch: `torchrun --nnodes M --nproc-per-node G -m executor STRATEGY MODEL [--steps K] [--verify]`.

Each rank reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from torchrun and initialises the
process group itself (nccl when CUDA is available, else gloo); rank 0 prints the report as JSON.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from executor.preflight import RunOptions
from executor.train import run_rank
from planner.strategy import load_strategy


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m executor")
    ap.add_argument("strategy")
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--verify", action="store_true")
    args = ap.parse_args()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    report = run_rank(load_strategy(args.strategy), args.model,
                      RunOptions(steps=args.steps, warmup=args.warmup, verify=args.verify))
    if dist.get_rank() == 0:
        print(json.dumps(report, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
