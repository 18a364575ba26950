"""The curvature monitor's cost per measured step by each estimator of <Z, HZ>, against the exact monitor's
(HVPs), in one process. Run by hand.

    python benchmarks/monitor_estimators.py [--model tiny|pcfg-9m|gpt2-124m] [--steps 12] [--threads N]

A plain Muon loop trains the named model on random tokens (batch ``--batch`` x block_size; what a step costs
does not depend on the tokens), and every step it takes is measured by one monitor per estimator, on the same
held-out set (the monitor's default, ``--windows`` windows of block_size) and the same snapshot, the order
rotated from one step to the next. A round is one measured step: every estimator's row and the training step
itself, timed on the same W and Z under the same load. Per estimator, the medians over rounds (the first,
the warm-up, left out) of: the row's seconds; its ratio to the exact row's in the same round; its ratio to the
training step of that round (the overhead of measuring every step; at K steps a row, divide by K); and
|NDS - exact NDS| / |exact NDS| beside the row's stated error over |exact NDS|.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from curvlab.curvature.estimators import ESTIMATORS
from curvlab.engine.loss import make_loss_fn, token_cross_entropy
from curvlab.models.gpt import GPT, get_config
from curvlab.optim.build import build_optimizer
from curvlab.runs.monitor import CurvatureMonitor


def rounds(args) -> tuple[list[float], dict[str, list]]:
    """Training-step seconds per round and, per estimator, its rows (round by round)."""
    torch.manual_seed(0)
    cfg = get_config(args.model)
    model = GPT(cfg)
    optimizer = build_optimizer("muon", model)
    g = torch.Generator().manual_seed(1)
    held = torch.randint(0, cfg.vocab_size, (args.windows, cfg.block_size + 1), generator=g)
    D = [(held[:, :-1], held[:, 1:])]
    monitors = {e: CurvatureMonitor(model, optimizer, make_loss_fn(model), D, every=1, estimator=e) for e in ESTIMATORS}
    steps, rows = [], {e: [] for e in ESTIMATORS}
    for step in range(args.steps):
        x = torch.randint(0, cfg.vocab_size, (args.batch, cfg.block_size + 1), generator=g)
        before = monitors["exact"].snapshot()
        start = time.perf_counter()
        token_cross_entropy(model(x[:, :-1]), x[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps.append(time.perf_counter() - start)
        order = ESTIMATORS[step % len(ESTIMATORS) :] + ESTIMATORS[: step % len(ESTIMATORS)]
        for e in order:
            rows[e].append(monitors[e].measure_taken(step, before))
        print(f"round {step}: step {steps[-1]:.2f} s; " + ", ".join(f"{e} {rows[e][-1].seconds:.2f} s" for e in order))
    return steps, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="tiny", help="tiny, pcfg-9m or gpt2-124m")
    ap.add_argument("--steps", type=int, default=12, help="rounds, the first a warm-up (not counted)")
    ap.add_argument("--batch", type=int, default=16, help="training windows per step (curvlab train's default)")
    ap.add_argument("--windows", type=int, default=8, help="held-out windows (the monitor's default)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads (1 on a busy machine)")
    args = ap.parse_args()
    if args.steps < 2:
        raise SystemExit("--steps must be at least 2 (the first round is a warm-up)")
    torch.set_num_threads(args.threads)
    steps, rows = rounds(args)
    steps, rows = steps[1:], {e: r[1:] for e, r in rows.items()}
    exact = rows["exact"]
    print(f"\n`{args.model}`, Muon, batch {args.batch}, held-out {args.windows} windows, {args.threads} torch threads;")
    print(f"medians of {len(steps)} rounds; a training step: {statistics.median(steps):.3f} s\n")
    print("| estimator | one row (s) | vs exact | vs a training step | NDS off exact (rel.) | stated error (rel.) |")
    print("|---|---:|---:|---:|---:|---:|")
    for e in ESTIMATORS:
        mine = rows[e]
        vs_exact = statistics.median([r.seconds / x.seconds for r, x in zip(mine, exact)])
        vs_step = statistics.median([r.seconds / s for r, s in zip(mine, steps)])
        off = statistics.median([abs(r.nds - x.nds) / abs(x.nds) for r, x in zip(mine, exact)])
        errors = [r.error / abs(x.nds) for r, x in zip(mine, exact) if r.error is not None]
        stated = f"{statistics.median(errors):.1e}" if errors else "-"
        print(
            f"| {e} | {statistics.median(r.seconds for r in mine):.3f} | {vs_exact:.2f}x | {vs_step:.2f}x "
            f"| {off:.1e} | {stated} |"
        )


if __name__ == "__main__":
    main()
