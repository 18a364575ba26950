"""Block matrix and Taylor split vs their naive costs, on the ~1M-parameter `tiny` GPT (run by hand).

python benchmarks/curvature.py [--batch 8] [--repeats 3]
"""

from __future__ import annotations

import argparse

import torch
from timing import median_seconds, print_table, tiny_problem

from curvlab import block_matrix, evaluate_loss, group_parameters, hvp, taylor_split
from curvlab import params as P


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cfg, loss_fn, params, batch = tiny_problem(args.batch)
    z = P.scale({k: torch.randn_like(t) for k, t in params.items()}, 1e-3)
    blocks = group_parameters(params, "layer")
    padded = [P.restrict(z, names) for names in blocks.values()]
    r = args.repeats

    t_seq = median_seconds(lambda: [hvp(loss_fn, params, batch, d) for d in padded], r)
    t_hvp = median_seconds(lambda: block_matrix(loss_fn, params, batch, z, via="hvp"), r)
    t_alpha = median_seconds(lambda: block_matrix(loss_fn, params, batch, z, via="alpha"), r)
    t_one = median_seconds(lambda: hvp(loss_fn, params, batch, z), r)
    t_loss = median_seconds(lambda: evaluate_loss(loss_fn, params, batch), r)
    t_split = median_seconds(lambda: taylor_split(loss_fn, params, batch, z), r)
    t_split_all = median_seconds(lambda: taylor_split(loss_fn, params, batch, z, subset=[]), r)
    L = len(blocks)
    naive = t_one + 2 * t_loss
    print_table(
        f"Curvature on `tiny`, {L} layer blocks, batch {args.batch}x{cfg.block_size}, "
        f"{torch.get_num_threads()} threads",
        [
            (f"{L} sequential single HVPs", t_seq, "1.00x"),
            ("block matrix, method=hvp (vmapped)", t_hvp, f"{t_hvp / t_seq:.2f}x sequential"),
            ("block matrix, method=alpha", t_alpha, f"{t_alpha / t_seq:.2f}x sequential"),
            ("one HVP + two loss evaluations", naive, "1.00x"),
            ("Taylor split, all parameters", t_split_all, f"{t_split_all / naive:.2f}x HVP + 2 losses"),
            ("Taylor split, all + hidden subset", t_split, f"{t_split / naive:.2f}x HVP + 2 losses"),
        ],
    )


if __name__ == "__main__":
    main()
