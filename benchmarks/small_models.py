"""The fixed cost of one `curvlab.hvp` call, on a model small enough that it shows: a 3.5k-parameter MLP
against a hand-written double backward. Run by hand:

    python benchmarks/small_models.py [--batch 32] [--repeats 31] [--calls 20] [--threads 1] [--profile]
                                      [--cross-entropy] [--checks]

The model is an MLP 32-48-32-10 with tanh (3482 parameters, float32) on one batch of ``--batch`` points, its
loss ``make_loss_fn(model, criterion=F.cross_entropy)``. The reference is written here by hand: the loss on the
same ``functional_call`` of the same parameter dict, ``torch.autograd.grad`` with ``create_graph``, then the
gradient of ⟨g, v⟩. The same is timed inside the exact mode, then with make_loss_fn's loss in the mode, so that
each step to curvlab hvp shows what it adds: the mode, the loss function's wrapper, and the rest (the point's
checks, casts and bookkeeping). Each round runs every measurement ``--calls`` times in turn, and each figure is
the median over the rounds of its mean call (`timing.py`), so the ratios hold within one run while a shared
machine's speed drifts. One thread by default: on a loaded machine OpenMP's threads spin at every small op,
which swamps what is measured here. ``--profile`` prints cProfile's view of the curvlab calls, by the time spent
in each function itself. ``--cross-entropy`` times a cross-entropy's forward and two backwards alone, torch's
own against the closed form of curvlab.engine._cross_entropy, over logits of growing size: where the closed form
starts to pay (its ``SMALLEST``). ``--checks`` times curvlab hvp with the finiteness check of its direction and
of its result (``curvlab.engine.dtensors._plain_finite``) done each way it could be, and not at all: inside a
call its kernels and Python run cold, and cost several times what a loop over them alone shows.
"""

from __future__ import annotations

import argparse
import cProfile
import math
import os
import platform
import pstats

import torch
import torch.nn.functional as F
from timing import interleaved_medians
from torch import nn
from torch._utils import _flatten_dense_tensors
from torch.func import functional_call

from curvlab import CurvaturePoint, exact_second_order, hvp, make_loss_fn
from curvlab.engine import _cross_entropy, dtensors


def problem(batch: int):
    """The MLP, its loss, detached parameters, one batch and a direction v."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.Tanh(), nn.Linear(48, 32), nn.Tanh(), nn.Linear(32, 10))
    params = {k: t.detach() for k, t in model.named_parameters()}
    x, y = torch.randn(batch, 32), torch.randint(0, 10, (batch,))
    v = {k: torch.randn_like(t) for k, t in params.items()}
    return model, make_loss_fn(model, criterion=F.cross_entropy), params, (x, y), v


def repeated(fn, calls: int):
    def run():
        for _ in range(calls):
            fn()

    return run


def measurements(args) -> dict[str, float]:
    model, loss_fn, params, batch, v = problem(args.batch)
    x, y = batch

    def by_hand():
        leaves = {k: t.detach().requires_grad_() for k, t in params.items()}
        loss = F.cross_entropy(functional_call(model, leaves, (x,)), y)
        g = torch.autograd.grad(loss, list(leaves.values()), create_graph=True)
        return torch.autograd.grad(g, list(leaves.values()), list(v.values()))

    def by_hand_in_mode():
        with exact_second_order(method="rev_rev"):
            return by_hand()

    def by_hand_through_loss_fn():  # (the same again, the loss now make_loss_fn's: its wrapper's cost)
        with exact_second_order(method="rev_rev"):
            leaves = {k: t.detach().requires_grad_() for k, t in params.items()}
            g = torch.autograd.grad(loss_fn(leaves, batch), list(leaves.values()), create_graph=True)
            return torch.autograd.grad(g, list(leaves.values()), list(v.values()))

    kept = CurvaturePoint(loss_fn, params, batch)
    fns = {
        "hand-written double backward": by_hand,
        "the same inside exact_second_order()": by_hand_in_mode,
        "the same, the loss make_loss_fn's": by_hand_through_loss_fn,
        "curvlab hvp": lambda: hvp(loss_fn, params, batch, v),
        "one more HVP at a kept CurvaturePoint": lambda: kept.hvp(v),
    }
    seconds = interleaved_medians({n: repeated(fn, args.calls) for n, fn in fns.items()}, args.repeats, warmup=2)
    return {name: s / args.calls for name, s in seconds.items()}


def cross_entropy(args) -> None:
    """torch's cross-entropy against the closed form, forward and two backwards, at growing sizes."""

    def both_backwards(ce, logits, targets, v):
        (g,) = torch.autograd.grad(ce(logits, targets), logits, create_graph=True)
        return torch.autograd.grad(g, logits, v)

    print("\n| logits (rows x classes) | torch's (ms) | closed form (ms) | closed form / torch's |")
    print("|---|---:|---:|---:|")
    closed = _cross_entropy.closed_form_cross_entropy
    smallest, _cross_entropy.SMALLEST = _cross_entropy.SMALLEST, 0  # (the closed form at every size, here)
    try:
        for rows, classes in [(32, 10), (64, 256), (128, 256), (64, 1024), (128, 1024), (256, 1024)]:
            g = torch.Generator().manual_seed(0)
            logits = torch.randn(rows, classes, generator=g).requires_grad_()
            targets, v = torch.randint(0, classes, (rows,), generator=g), torch.randn(rows, classes, generator=g)
            calls = max(3, args.calls * 2048 // (rows * classes))
            fns = {
                name: repeated(lambda ce=ce, x=logits, t=targets, d=v: both_backwards(ce, x, t, d), calls)
                for name, ce in (("torch", F.cross_entropy), ("closed", closed))
            }
            t = interleaved_medians(fns, args.repeats)
            torch_s, closed_s = t["torch"] / calls, t["closed"] / calls
            print(f"| {rows} x {classes} | {torch_s * 1e3:.3f} | {closed_s * 1e3:.3f} | {closed_s / torch_s:.2f}x |")
    finally:
        _cross_entropy.SMALLEST = smallest


def checks(args) -> None:
    """curvlab hvp with each way of checking a few small tensors for NaN and inf."""
    _, loss_fn, params, batch, v = problem(args.batch)
    flat = _flatten_dense_tensors
    ways = {
        "isfinite and all, a tensor at a time (before)": lambda ts: bool(
            torch.stack([torch.isfinite(t).all() for t in ts]).all()
        ),
        "infinity norms in one foreach call": lambda ts: all(
            map(math.isfinite, torch.stack(torch._foreach_norm(ts, math.inf)).tolist())
        ),
        "the infinity norm of them flattened": lambda ts: math.isfinite(flat(ts).abs().max().item()),
        "the sum of them flattened (now)": dtensors._plain_finite,
        "no check": lambda ts: True,
    }
    original = dtensors._plain_finite

    def with_way(way):
        def run():
            dtensors._plain_finite = way
            try:
                hvp(loss_fn, params, batch, v)
            finally:
                dtensors._plain_finite = original

        return run

    t = interleaved_medians({n: repeated(with_way(w), args.calls) for n, w in ways.items()}, args.repeats, warmup=2)
    print("\n| the two finiteness checks of an hvp call | ms a call | over no check |")
    print("|---|---:|---:|")
    for name, s in t.items():
        print(f"| {name} | {s / args.calls * 1e3:.3f} | {(s - t['no check']) / args.calls * 1e3:.3f} |")


def profile(args) -> None:
    _, loss_fn, params, batch, v = problem(args.batch)
    for _ in range(20):
        hvp(loss_fn, params, batch, v)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls * args.repeats):
        hvp(loss_fn, params, batch, v)
    prof.disable()
    print(f"\ncProfile of {args.calls * args.repeats} calls of curvlab hvp (its own overhead inflates them):\n")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=31)
    ap.add_argument("--calls", type=int, default=20, help="calls of each measurement a round")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", action="store_true", help="also cProfile's view of curvlab hvp")
    ap.add_argument("--cross-entropy", action="store_true", help="also the closed-form cross-entropy's crossover")
    ap.add_argument("--checks", action="store_true", help="also the finiteness checks, each way")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    start = os.getloadavg()[0]
    t = measurements(args)
    end = os.getloadavg()[0]
    hand = t["hand-written double backward"]
    print(
        f"\ntorch {torch.__version__}, {platform.processor() or platform.machine()}, {torch.get_num_threads()} "
        f"thread(s), batch {args.batch}; medians of {args.repeats} interleaved rounds of {args.calls} calls each; "
        f"load average {start:.1f} at the start, {end:.1f} at the end, on {os.cpu_count()} cores\n"
    )
    print("| measurement | ms a call | against the hand-written |")
    print("|---|---:|---:|")
    for name, s in t.items():
        print(f"| {name} | {s * 1e3:.3f} | {s / hand:.2f}x |")
    if args.cross_entropy:
        cross_entropy(args)
    if args.checks:
        checks(args)
    if args.profile:
        profile(args)


if __name__ == "__main__":
    main()
