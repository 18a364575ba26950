"""The curvature monitor's overhead as a share of training time: `tiny` trained with
`curvlab train --curvature-every K`, on the CPU. Run by hand.

    python benchmarks/monitor.py [--steps 100] [--every 50] [--repeats 3] [--threads N]

Every setting trains the same run (Muon, batch 16x64, validation and checkpoints every 50 steps: the
defaults of `curvlab train`) for ``--steps`` steps, a multiple of K, so that it measures one row per K
steps. Two estimates of the overhead, both as medians over interleaved rounds (one run of each
setting per round, the order rotated):

* in-run: the rows' own ``seconds`` over the rest of the same run's wall time. Rows and training
  steps alternate within one run, so a busy machine slows both alike: the robust number;
* whole-run: a monitored run's wall time over that of the run without the monitor in the same round,
  minus one. On a shared machine this difference is at the mercy of the load between runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from curvlab.data.dataset import generate_pcfg_dataset
from curvlab.runs.config import TrainConfig
from curvlab.runs.monitor import MonitorSettings
from curvlab.runs.train import train

SETTINGS = {  # name -> (batches, windows per batch, blocks)
    "1 batch of 16 windows (the training batch)": (1, 16, None),
    "1 batch of 8 windows": (1, 8, None),
    "1 batch of 4 windows": (1, 4, None),
    "1 batch of 8 windows, --blocks layer": (1, 8, "layer"),
    "1 batch of 4 windows, --blocks layer": (1, 4, "layer"),
}


def one_run(data: str, out: Path, steps: int, every: int, setting, model: str = "tiny") -> tuple[float, float]:
    """Wall time of a whole ``train`` call and the seconds its curvature rows took (``setting``: ``None``, no
    monitor, or ``(batches, windows, blocks)``)."""
    cfg = TrainConfig(data=data, out=str(out), model=model, steps=steps, warmup_steps=min(20, steps - 1), device="cpu")
    monitor = None if setting is None else MonitorSettings(every, *setting[:2], blocks=setting[2])
    start = time.perf_counter()
    train(cfg, progress=False, monitor=monitor)
    seconds = time.perf_counter() - start
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return seconds, sum(r["seconds"] for r in rows if r.get("kind") == "curvature")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads (1 on a busy machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.steps % args.every:
        raise SystemExit("--steps must be a multiple of --every (one row per K steps)")
    arms = {"no monitor": None, **SETTINGS}
    totals: dict[str, list[float]] = {name: [] for name in arms}
    in_run: dict[str, list[float]] = {name: [] for name in arms}
    rows: dict[str, list[float]] = {name: [] for name in arms}
    with tempfile.TemporaryDirectory() as tmp:
        data = f"{tmp}/d"
        generate_pcfg_dataset(data, s=1.0, tokens="500k", val_tokens="100k", progress=False)
        one_run(data, Path(tmp) / "warmup", args.every, args.every, SETTINGS["1 batch of 8 windows"])
        names = list(arms)
        for r in range(args.repeats):
            for k, name in enumerate(names[r % len(names) :] + names[: r % len(names)]):
                seconds, row_seconds = one_run(data, Path(tmp) / f"{r}-{k}", args.steps, args.every, arms[name])
                totals[name].append(seconds)
                in_run[name].append(row_seconds / (seconds - row_seconds))
                rows[name].append(row_seconds / (args.steps // args.every))
                print(f"round {r} {name}: {seconds:.1f} s, of which rows {row_seconds:.1f} s", flush=True)
    base = statistics.median(totals["no monitor"])
    print(f"\n`tiny`, Muon, batch 16x64, {args.steps} steps, K = {args.every}, {args.threads} torch threads;")
    print(f"medians of {args.repeats} interleaved rounds; a run without the monitor: {base:.1f} s\n")
    print("| held-out set | one row (s) | in-run overhead | whole-run overhead |")
    print("|---|---:|---:|---:|")
    for name in SETTINGS:
        row = statistics.median(rows[name])
        whole = statistics.median([t / b - 1 for t, b in zip(totals[name], totals["no monitor"])])
        print(f"| {name} | {row:.2f} | {statistics.median(in_run[name]):.1%} | {whole:+.1%} |")


if __name__ == "__main__":
    main()
