"""Sharded curvature on 1, 2 and 4 ranks: per-rank memory and wall time of a gradient, an HVP and the
block matrix, on a GPT of a few million parameters sharded by FSDP2. Run by hand, on a quiet machine:

    python benchmarks/sharded.py [--ranks 1 2 4] [--backend gloo|nccl] [--repeats 3] [--no-memory]

Each world size runs in its own group of processes (``torch.multiprocessing``, TCP rendezvous on
loopback): every rank holds 1/N of the parameters (``fully_shard`` per block and at the root), and
the same global batch is shared out, one micro-batch per rank. Wall times are medians over
``--repeats`` rounds, each timed between barriers, the slowest rank's. Peak memory is torch's own
count: on the CPU the peak of ``torch.profiler``'s memory timeline during one run of each operation
(``profile_memory``; its allocation events, since its memory timeline can't classify DTensor's
redistribute nodes), on a GPU ``torch.cuda.max_memory_allocated``: in both cases the peak above what
the rank held before (its shard of the parameters, the directions), which is reported beside it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from curvlab import block_matrix, hvp, make_loss_fn
from curvlab.engine.dtensors import shard_like
from curvlab.engine.hvp import CurvaturePoint
from curvlab.models.gpt import GPT, get_config

MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 192, "block_size": 64}  # ~3.5M parameters
MICRO_BATCHES = 4  # the global batch: 4 sequences, shared out over the ranks


def _problem(device):
    torch.manual_seed(0)
    cfg = get_config("tiny", **MODEL)
    model = GPT(cfg).to(device)
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(MICRO_BATCHES):
        idx = torch.randint(0, cfg.vocab_size, (1, cfg.block_size + 1), generator=g).to(device)
        batches.append((idx[:, :-1], idx[:, 1:]))
    return model, batches


def _peak(run, device) -> int:
    """Peak bytes of torch's tensors during ``run()`` on this rank."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    # (the profiler's memory timeline can't classify DTensor's redistribute nodes, so the raw allocation
    # events are summed: the peak of the bytes allocated and not yet freed since the profile began)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def _worker(rank, world, port, backend, repeats, memory, out):
    if backend == "nccl":
        torch.cuda.set_device(rank)
    device = torch.device(f"cuda:{rank}" if backend == "nccl" else "cpu")
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )  # fmt: skip
    mesh = init_device_mesh(device.type, (world,))
    model, batches = _problem(device)
    n_params = sum(p.numel() for p in model.parameters())
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = {k: p.detach() for k, p in model.named_parameters()}
    param_bytes = sum(p.to_local().numel() * p.element_size() for p in params.values())
    loss_fn = make_loss_fn(model)
    g = torch.Generator().manual_seed(2)
    v = shard_like({k: torch.randn(p.shape, generator=g).to(device) for k, p in params.items()}, params)
    ops = {
        "gradient": lambda: CurvaturePoint(loss_fn, params, batches, method="fwd_rev").gradient,
        "HVP": lambda: hvp(loss_fn, params, batches, v),
        "block matrix": lambda: block_matrix(loss_fn, params, batches, v),
    }
    for fn in ops.values():
        fn()  # warm up
    times = {name: [] for name in ops}
    for _ in range(repeats):
        for name, fn in ops.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            times[name].append(time.perf_counter() - start)
    peaks = {name: _peak(fn, device) for name, fn in ops.items()} if memory else {}
    row = {"times": {k: statistics.median(t) for k, t in times.items()}, "peaks": peaks, "param_bytes": param_bytes}
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"world": world, "n_params": n_params, "rows": rows}, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # (the profiler's stack records can crash the interpreter's own shutdown)


def run(world: int, backend: str, repeats: int, memory: bool) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(world, port, backend, repeats, memory, out), nprocs=world, join=True)
        with open(out) as f:
            return json.load(f)


def table(results: list[dict], backend: str) -> None:
    base = results[0]
    n = base["n_params"]
    print(
        f"\nSharded curvature, GPT of {n / 1e6:.2f}M parameters (FSDP2, {backend}, float32, global batch "
        f"{MICRO_BATCHES}x{MODEL['block_size']}, {torch.get_num_threads()} threads per rank)\n"
    )
    ops = list(base["rows"][0]["times"])
    head = ["ranks", "params/rank MiB"] + [f"{op} s" for op in ops] + ["HVP / gradient"]
    if base["rows"][0]["peaks"]:
        head += [f"peak {op} MiB" for op in ops]  # (above what the rank held before)
    print("| " + " | ".join(head) + " |")
    print("|" + "---:|" * len(head))
    for r in results:
        rows = r["rows"]
        t = {op: max(x["times"][op] for x in rows) for op in ops}
        cells = [str(r["world"]), f"{max(x['param_bytes'] for x in rows) / 2**20:.2f}"]
        cells += [f"{t[op]:.3f}" for op in ops] + [f"{t['HVP'] / t['gradient']:.2f}"]
        if rows[0]["peaks"]:
            cells += [f"{max(x['peaks'][op] for x in rows) / 2**20:.1f}" for op in ops]
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory profiles")
    ap.add_argument("--json", help="also write the raw results here")
    args = ap.parse_args()
    results = [run(w, args.backend, args.repeats, not args.no_memory) for w in args.ranks]
    table(results, args.backend)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
