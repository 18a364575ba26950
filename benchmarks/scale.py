"""The engine at every size: one gradient, one HVP, the Taylor split over both scopes, K = 8 directions at
one point and the block matrix, as ratios to one gradient on the same batch, at `tiny` (1.02M), `pcfg-9m`
(8.56M) and `gpt2-124m` (123.7M); and the curvature monitor's share of training time on `pcfg-9m`.
Run by hand, on a quiet machine:

    python benchmarks/scale.py [--models tiny,pcfg-9m,gpt2-124m] [--batch 4] [--seq 128] [--repeats 3] [--warmup 1]
                               [--memory] [--monitor] [--device cpu|cuda] [--json FILE]

Within one model every measurement runs once per round, in turn, and each figure is the median over the
rounds (`timing.py`), so the ratios hold within one run when the machine's speed drifts. The gradient is
plain ``torch.autograd.grad`` of the same loss on the same batch, attention pinned to the math backend
as inside curvlab's exact mode. ``--memory`` measures each figure's peak in a fresh process from torch's
own counters: on the CPU the profiler's memory timeline (`tracemalloc` can't see torch's tensors), on a
GPU ``torch.cuda.max_memory_allocated``. ``--device cuda`` runs the GPU half on a lent device; where no
GPU is present it says so and measures nothing.

On the CPU each figure also carries the minor page faults of one call (the median over the rounds): each
is a page the kernel maps and zeroes, 4 KiB (2 MiB for a transparent huge page). torch's CPU allocator
hands tensors above glibc's mmap threshold (32 MiB at most) fresh pages, and glibc gives a freed heap top
back to the kernel, so a computation that makes and drops large temporaries pays for their pages each
time. The header names the allocator settings in force (``THP_MEM_ALLOC_ENABLE``, torch's switch for
transparent huge pages, and glibc's ``MALLOC_*_`` tunables), which move that cost: docs/benchmarks.md
shows both.

Floors count matrix products per linear layer (a gradient is 3 units: docs/benchmarks.md): an HVP 9
(3 + 6); the Taylor split over both scopes 17 as the issue counts it (one first-order graph, H[Z] and
H[Z_S] at 6 each, two losses at 1 each), and on the triangle that the split takes (S's second backward on
every parameter, the rest's on the rest alone) 13 for a hidden matrix (3 + 6 + 2 + 2) and 15 for the head
(3 + 4 + 6 + 2), weighted by their sizes; K directions at one point 3 + 6K, so 2.0x a gradient each at a
kept point; the block matrix of L layer blocks about 3 + 2L on the triangle for equal layers, against L
sequential HVPs at 9 each, and by the model's own matrices (block_floor_on_the_triangle: a large head lies
above every block, and every block's second backward passes through it).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import tempfile
from pathlib import Path

import torch
from monitor import one_run
from timing import interleaved_medians, peak_bytes
from torch.nn.attention import SDPBackend, sdpa_kernel

from curvlab import CurvaturePoint, block_matrix, group_parameters, hidden_matrices, hvp, make_loss_fn, taylor_split
from curvlab.data.dataset import generate_pcfg_dataset
from curvlab.models.gpt import CONFIGS, GPT, get_config
from curvlab.runs.monitor import MonitorSettings

MODELS = ("tiny", "pcfg-9m", "gpt2-124m")
K = 8
FLOORS = {"hvp": 9 / 3, "split": 17 / 3, "k8": (3 + 6 * K) / (3 * K), "k8 at a kept point": 6 / 3}
MEASUREMENTS = ("gradient", "hvp", "split", "k8", "block")  # (runners' keys: each peak in its own process)


def problem(name: str, batch: int, seq: int, device: str):
    """A model of config ``name`` in float32 on ``device``, its loss, detached parameters, one random batch
    of ``batch`` x ``seq`` tokens, a direction Z, K stacked directions and the layer blocks."""
    torch.manual_seed(0)
    cfg = get_config(name, block_size=max(CONFIGS[name].block_size, seq))  # (tiny has 64 positions: 128 here)
    model = GPT(cfg).to(device)
    idx = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device=device)
    params = {k: v.detach() for k, v in model.named_parameters()}
    g = torch.Generator(device=device).manual_seed(1)
    z = {k: 1e-3 * torch.randn(t.shape, generator=g, device=device) for k, t in params.items()}
    vs = {k: torch.randn((K, *t.shape), generator=g, device=device) for k, t in params.items()}
    return make_loss_fn(model), params, (idx[:, :-1], idx[:, 1:]), z, vs


def split_floor_on_the_triangle(params, model) -> float:
    """The split's floor in gradients by matrix products on the triangle: 13 units a hidden matrix, 15 the
    head, weighted by their entries (the products per token); a gradient is 3."""
    hidden = sum(params[n].numel() for n in hidden_matrices(params, model=model))
    head = model.lm_head.weight.numel()
    return (13 * hidden + 15 * head) / (3 * (hidden + head))


def block_floor_on_the_triangle(params, model) -> float:
    """The block matrix's floor in L whole HVPs by matrix products on the triangle, weighted by the
    matrices' entries: block m's second backward (the layer blocks bottom first, each taken on itself and
    the blocks after it) costs 2 units on block m's own matrices, 4 on each matrix above it that it is
    taken on and 2 on each it only passes through (a head tied to the embedding is in the first block but
    used on top); with the first-order graph's 3, against L HVPs at 9 each."""
    blocks = list(group_parameters(params, blocks="layer").values())
    hidden = set(hidden_matrices(params, model=model))
    head, top = model.lm_head.weight.data_ptr(), len(blocks) - 1
    matrices = []  # (entries, block, height in the network: the block's index, the head's on top)
    for index, names in enumerate(blocks):
        for n in names:
            if n in hidden or params[n].data_ptr() == head:
                height = index if n in hidden or index == top else len(blocks)
                matrices.append((params[n].numel(), index, height))
    entries = sum(e for e, _, _ in matrices)
    units = 3 * entries
    for m in range(len(blocks)):
        for e, block, height in matrices:
            units += e * ((2 if block == m else 0) + (0 if height <= m else 4 if block >= m else 2))
    return units / (9 * len(blocks) * entries)


def runners(loss_fn, params, batch, z, vs) -> dict[str, object]:
    def gradient():
        leaves = {k: t.clone().requires_grad_() for k, t in params.items()}
        with sdpa_kernel(SDPBackend.MATH):
            torch.autograd.grad(loss_fn(leaves, batch), list(leaves.values()))

    def k_directions():
        with CurvaturePoint(loss_fn, params, batch) as point:
            point.hvps(vs)

    return {
        "gradient": gradient,
        "hvp": lambda: hvp(loss_fn, params, batch, z),
        "split": lambda: taylor_split(loss_fn, params, batch, z),
        "k8": k_directions,
        "block": lambda: block_matrix(loss_fn, params, batch, z),
    }


def _synchronized(fn, device: str):
    if device != "cuda":
        return fn

    def run():
        fn()
        torch.cuda.synchronize()

    return run


def _counting_faults(fn, faults: list[int]):
    """``fn`` that appends the minor page faults of each call to ``faults``."""

    def run():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        fn()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

    return run


def timings(name: str, args) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Each measurement's median seconds and median count of minor page faults, and the model's figures
    (its parameters, layer blocks and the split's floor on the triangle)."""
    loss_fn, params, batch, z, vs = problem(name, args.batch, args.seq, args.device)
    fns = {k: _synchronized(f, args.device) for k, f in runners(loss_fn, params, batch, z, vs).items()}
    with CurvaturePoint(loss_fn, params, batch) as kept:  # "K more directions at a kept point"
        fns["k8 at a kept point"] = _synchronized(lambda: kept.hvps(vs), args.device)
        faults: dict[str, list[int]] = {k: [] for k in fns}
        counted = {k: _counting_faults(f, faults[k]) for k, f in fns.items()}
        t = interleaved_medians(counted, args.repeats, warmup=args.warmup)
    model = {
        "parameters": sum(p.numel() for p in params.values()),
        "blocks": len(group_parameters(params, blocks="layer")),
        "split floor on the triangle": split_floor_on_the_triangle(params, loss_fn.model),
        "block floor on the triangle": block_floor_on_the_triangle(params, loss_fn.model),
    }
    return t, {k: statistics.median(f[args.warmup :]) for k, f in faults.items()}, model


def _peak_in_child(name: str, what: str, args, conn) -> None:
    loss_fn, params, batch, z, vs = problem(name, args.batch, args.seq, args.device)
    conn.send(peak_bytes(runners(loss_fn, params, batch, z, vs)[what], args.device))
    os._exit(0)  # (the profiler's stack records can crash the interpreter's own shutdown)


def memory(name: str, args) -> dict[str, int]:
    """Each measurement's peak, each in its own fresh process."""
    ctx, peaks = mp.get_context("spawn"), {}
    for what in MEASUREMENTS:
        receive, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_peak_in_child, args=(name, what, args, send))
        proc.start()
        send.close()  # (a child that dies unsent ends recv() with EOFError, not a hang)
        peaks[what] = receive.recv()
        proc.join()
    return peaks


def table(name: str, t: dict[str, float], faults: dict[str, float], model: dict[str, float], peaks) -> list[str]:
    g, L = t["gradient"], int(model["blocks"])
    rows = [
        ("gradient", t["gradient"], "1", "1"),
        ("one HVP", t["hvp"], f"{t['hvp'] / g:.2f}x", f"{FLOORS['hvp']:.1f}x"),
        (
            "Taylor split, both scopes",
            t["split"],
            f"{t['split'] / g:.2f}x",
            f"{FLOORS['split']:.2f}x ({model['split floor on the triangle']:.2f}x on the triangle)",
        ),
        (f"K = {K} at one point, per direction", t["k8"] / K, f"{t['k8'] / K / g:.2f}x", f"{FLOORS['k8']:.2f}x"),
        (
            f"K = {K} at a kept point, per direction",
            t["k8 at a kept point"] / K,
            f"{t['k8 at a kept point'] / K / g:.2f}x",
            f"{FLOORS['k8 at a kept point']:.1f}x",
        ),
        (
            f"block matrix, {L} layer blocks",
            t["block"],
            f"{t['block'] / (L * t['hvp']):.2f}x {L} HVPs",
            f"{(3 + 2 * L) / (9 * L):.2f}x {L} HVPs ({model['block floor on the triangle']:.2f}x by the model)",
        ),
    ]
    key = {"gradient": "gradient", "one HVP": "hvp", "Taylor split, both scopes": "split"}
    key |= {f"K = {K} at one point, per direction": "k8", f"block matrix, {L} layer blocks": "block"}
    key[f"K = {K} at a kept point, per direction"] = "k8 at a kept point"
    per = {"k8": K, "k8 at a kept point": K}  # (the K rows are per direction)
    out = [f"\n`{name}` ({model['parameters'] / 1e6:.2f}M parameters)\n"]
    out.append("| measurement | seconds | ratio | floor | page faults | peak memory |")
    out.append("|---|---:|---:|---:|---:|---:|")
    for label, s, ratio, floor in rows:
        what = key[label]
        peak = "" if peaks is None or what not in MEASUREMENTS else f"{peaks[what] / 2**20:.0f} MiB"
        out.append(f"| {label} | {s:.4f} | {ratio} | {floor} | {faults[what] / per.get(what, 1):.0f} | {peak} |")
    return out


def monitor_overhead(args) -> dict[str, float]:
    """`curvlab train --curvature-every 50` on `pcfg-9m` (the monitor's defaults: 1 held-out batch of 8
    windows): the rows' seconds over the rest of the same run's time (in-run, the robust figure), and the
    monitored run's wall time over an unmonitored run's in the same round, minus one."""
    steps, every = 100, 50
    defaults = MonitorSettings(every)
    settings = (defaults.batches, defaults.windows, defaults.blocks)
    in_run, whole = [], []
    with tempfile.TemporaryDirectory() as tmp:
        data = f"{tmp}/d"
        generate_pcfg_dataset(data, s=1.0, tokens="500k", val_tokens="100k", progress=False)
        for r in range(args.repeats):
            plain, _ = one_run(data, Path(tmp) / f"plain{r}", steps, every, None, model="pcfg-9m")
            seconds, rows = one_run(data, Path(tmp) / f"mon{r}", steps, every, settings, model="pcfg-9m")
            in_run.append(rows / (seconds - rows))
            whole.append(seconds / plain - 1)
            print(f"monitor round {r}: {plain:.1f} s plain, {seconds:.1f} s monitored, rows {rows:.1f} s", flush=True)
    return {"in_run": statistics.median(in_run), "whole_run": statistics.median(whole), "steps": steps, "every": every}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first (0: gpt2-124m's round is minutes)")
    ap.add_argument("--memory", action="store_true", help="also each figure's peak memory, in fresh processes")
    ap.add_argument("--monitor", action="store_true", help="also the monitor's overhead at K = 50 on pcfg-9m")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("GPU half: not run (no CUDA device on this machine)")
        return
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    allocator = {k: v for k, v in os.environ.items() if k == "THP_MEM_ALLOC_ENABLE" or k.startswith("MALLOC_")}
    print(f"{where}; batch {args.batch}x{args.seq}; medians of {args.repeats} interleaved rounds")
    print(f"allocator settings: {allocator or 'the defaults'}")
    results = {}
    for name in args.models.split(","):
        t, faults, model = timings(name, args)
        peaks = memory(name, args) if args.memory else None
        print("\n".join(table(name, t, faults, model, peaks)), flush=True)
        results[name] = {"seconds": t, "page_faults": faults, "model": model, "peak_bytes": peaks}
    if args.monitor:
        m = monitor_overhead(args)
        print(f"\nmonitor at K = {m['every']} on pcfg-9m: {m['in_run']:.1%} in-run, {m['whole_run']:+.1%} whole-run")
        results["monitor"] = m
    if args.json:
        head = {"device": where, "batch": [args.batch, args.seq], "allocator": allocator}
        Path(args.json).write_text(json.dumps({**head, **results}, indent=1))


if __name__ == "__main__":
    main()
