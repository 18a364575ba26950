"""HVP cost as a ratio to one gradient, on the ~1M-parameter `tiny` GPT (run by hand).

python benchmarks/hvp.py [--batch 8] [--repeats 5]
"""

from __future__ import annotations

import argparse

import torch
from timing import median_seconds, print_table, tiny_problem

from curvlab import hvp, hvps, quadratic_form


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    cfg, loss_fn, params, batch = tiny_problem(args.batch)
    v = {k: torch.randn_like(t) for k, t in params.items()}
    vs = {k: torch.stack([torch.randn_like(t) for _ in range(8)]) for k, t in params.items()}

    def gradient():
        leaves = {k: t.clone().requires_grad_() for k, t in params.items()}
        torch.autograd.grad(loss_fn(leaves, batch), list(leaves.values()))

    r = args.repeats
    t_grad = median_seconds(gradient, r)
    t_fr = median_seconds(lambda: hvp(loss_fn, params, batch, v), r)
    t_rr = median_seconds(lambda: hvp(loss_fn, params, batch, v, method="rev_rev"), r)
    t_8 = median_seconds(lambda: hvps(loss_fn, params, batch, vs), r)
    t_8rr = median_seconds(lambda: hvps(loss_fn, params, batch, vs, method="rev_rev"), r)
    t_q = median_seconds(lambda: quadratic_form(loss_fn, params, batch, v), r)
    n = sum(t.numel() for t in params.values())
    print_table(
        f"HVP cost on `tiny` ({n / 1e6:.2f}M parameters, batch {args.batch}x{cfg.block_size}, "
        f"{torch.get_num_threads()} threads)",
        [
            ("gradient", t_grad, "1.00x gradient"),
            ("HVP, fwd_rev (jvp of grad)", t_fr, f"{t_fr / t_grad:.2f}x gradient"),
            ("HVP, rev_rev (double backward)", t_rr, f"{t_rr / t_grad:.2f}x gradient"),
            ("8 HVPs batched, fwd_rev", t_8, f"{t_8 / (8 * t_fr):.2f}x of 8 single"),
            ("8 HVPs batched, rev_rev", t_8rr, f"{t_8rr / (8 * t_rr):.2f}x of 8 single"),
            ("quadratic form (jvp of jvp)", t_q, f"{t_q / t_fr:.2f}x one HVP"),
        ],
    )


if __name__ == "__main__":
    main()
