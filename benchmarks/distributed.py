"""Step time of `tiny` on 2 gloo ranks vs 1, and the share of a Muon step spent in Newton–Schulz with
and without sharing it out across ranks (run by hand).

    python benchmarks/distributed.py [--steps 20]

On this 2-core CPU each rank gets one thread (OMP_NUM_THREADS=1) in both settings, so the ratio says
what the second rank buys, not what threads do.
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def measure(rank: int, world: int, tmp: str, steps: int, result_path: str) -> None:
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{tmp}/store",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=60),
        )
    import curvlab.optim.muon as optim  # msign as Muon looks it up
    from curvlab.engine.loss import token_cross_entropy
    from curvlab.runs.config import TrainConfig
    from curvlab.runs.train import build_run

    spent = {"ns": 0.0}
    original = optim.msign

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = original(*args, **kwargs)
        spent["ns"] += time.perf_counter() - start
        return out

    optim.msign = timed
    run = build_run(TrainConfig(data=f"{tmp}/data", out=f"{tmp}/run", optimizer="muon", device="cpu"), rank, world)
    model = torch.nn.parallel.DistributedDataParallel(run.model) if world > 1 else run.model
    times = []
    for i in range(steps):
        x, y = run.loader.next()
        start = time.perf_counter()
        if i == 2:
            spent["ns"] = 0.0
        token_cross_entropy(model(x), y).backward()
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    step = sum(times[2:]) / len(times[2:])
    ns = spent["ns"] / len(times[2:])
    if rank == 0:
        torch.save({"step": step, "ns": ns}, result_path)
    if world > 1:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    from curvlab.data.dataset import generate_pcfg_dataset

    with tempfile.TemporaryDirectory() as tmp:
        generate_pcfg_dataset(f"{tmp}/data", s=1.0, tokens="500k", val_tokens="20k", progress=False)
        measure(0, 1, tmp, args.steps, f"{tmp}/one.pt")
        mp.spawn(measure, args=(2, tmp, args.steps, f"{tmp}/two.pt"), nprocs=2, join=True)
        one, two = torch.load(f"{tmp}/one.pt"), torch.load(f"{tmp}/two.pt")
    print("\n`tiny`, Muon, global batch 16x64, one thread per rank\n")
    print("| ranks | seconds per step | Newton–Schulz per step (rank 0) | NS share of the step |")
    print("|---:|---:|---:|---:|")
    for n, r in ((1, one), (2, two)):
        print(f"| {n} | {r['step']:.4f} | {r['ns']:.4f} | {r['ns'] / r['step']:.0%} |")
    print(f"\n2 ranks vs 1: {two['step'] / one['step']:.2f}x the step time")


if __name__ == "__main__":
    main()
