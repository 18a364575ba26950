"""Block matrix and Taylor split against their naive costs, on the ~1M-parameter `tiny` GPT, and the
seconds of `curvlab nds` on a `tiny` checkpoint. Run by hand, on a quiet machine:

    python benchmarks/curvature.py [--batch 8] [--repeats 5]

Methods are interleaved round by round and each is reported as its median (see timing.py).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from timing import interleaved_medians, print_table, tiny_problem

from curvlab import block_matrix, evaluate_loss, group_parameters, hvp, taylor_split
from curvlab.curvature.taylor import taylor_split_and_block_matrix
from curvlab.engine import params as param_dicts


def curvature_costs(args) -> None:
    cfg, loss_fn, params, batch = tiny_problem(args.batch)
    z = param_dicts.scale({k: torch.randn_like(t) for k, t in params.items()}, 1e-3)
    blocks = group_parameters(params, blocks="layer")
    padded = [param_dicts.restrict(z, names) for names in blocks.values()]
    L = len(blocks)
    t = interleaved_medians(
        {
            "sequential": lambda: [hvp(loss_fn, params, batch, d) for d in padded],
            "block hvp": lambda: block_matrix(loss_fn, params, batch, z),
            "block alpha": lambda: block_matrix(loss_fn, params, batch, z, block_method="alpha"),
            "one hvp": lambda: hvp(loss_fn, params, batch, z),
            "loss": lambda: evaluate_loss(loss_fn, params, batch),
            "split all": lambda: taylor_split(loss_fn, params, batch, z, scope=None),
            "split both": lambda: taylor_split(loss_fn, params, batch, z),
            "split+blocks": lambda: taylor_split_and_block_matrix(loss_fn, params, batch, z),
        },
        args.repeats,
    )
    naive = t["one hvp"] + 2 * t["loss"]
    print_table(
        f"Curvature on `tiny`, {L} layer blocks, batch {args.batch}x{cfg.block_size}, "
        f"{torch.get_num_threads()} threads; medians of {args.repeats} interleaved rounds",
        [
            (f"{L} sequential single HVPs (seq.)", t["sequential"], "1.00x"),
            ("block matrix, via hvp (one point)", t["block hvp"], f"{t['block hvp'] / t['sequential']:.2f}x seq."),
            ("block matrix, via alpha", t["block alpha"], f"{t['block alpha'] / t['sequential']:.2f}x seq."),
            ("one HVP + two loss evaluations", naive, "1.00x"),
            ("Taylor split, all parameters", t["split all"], f"{t['split all'] / naive:.2f}x HVP + 2 losses"),
            ("Taylor split, all + hidden", t["split both"], f"{t['split both'] / naive:.2f}x HVP + 2 losses"),
            (
                "Taylor split (both scopes) + block matrix",
                t["split+blocks"],
                f"{t['split+blocks'] / (t['sequential'] + naive):.2f}x (sequential + HVP + 2 losses)",
            ),
        ],
    )


def nds_seconds(repeats: int) -> None:
    """``curvlab nds`` on a `tiny` checkpoint (batch 16x64, 7 layer blocks): the report's own seconds."""
    from curvlab.analysis.report import analyze_checkpoint
    from curvlab.analysis.targets import AnalysisSettings
    from curvlab.data.dataset import generate_pcfg_dataset
    from curvlab.runs.config import TrainConfig
    from curvlab.runs.train import train

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        generate_pcfg_dataset(data, s=1.0, tokens="300k", val_tokens="30k", progress=False)
        out = str(Path(tmp) / "run")
        cfg = TrainConfig(str(data), out, model="tiny", steps=2, warmup_steps=0, ckpt_every=2, eval_every=2)
        train(cfg, progress=False)
        ckpt = Path(tmp) / "run" / "ckpt_000002.pt"
        seconds = [analyze_checkpoint(ckpt, AnalysisSettings()).seconds for _ in range(repeats)]
    seconds.sort()
    print(f"\n`curvlab nds` on a `tiny` checkpoint: {seconds[len(seconds) // 2]:.2f} s (median of {repeats})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    curvature_costs(args)
    nds_seconds(args.repeats)


if __name__ == "__main__":
    main()
