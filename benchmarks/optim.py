"""msign by Newton–Schulz / Polar Express vs SVD, and a hybrid-Muon step vs an AdamW step (run by hand).

python benchmarks/optim.py [--repeats 3]
"""

from __future__ import annotations

import argparse

import torch
from timing import median_seconds

from curvlab import build_optimizer, make_loss_fn, msign
from curvlab.models.gpt import GPT, get_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    r = args.repeats
    print(f"\nmsign on float32 Gaussian matrices ({torch.get_num_threads()} threads)\n")
    print("| shape | method | seconds | speed vs SVD | rel. Frobenius error vs U Vᵀ |")
    print("|---|---|---:|---:|---:|")
    for shape in [(1024, 1024), (768, 3072)]:
        X = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
        exact = msign(X, polar="svd").double()
        t_svd = median_seconds(lambda X=X: msign(X, polar="svd"), r)
        print(f"| {shape[0]}x{shape[1]} | svd (float64) | {t_svd:.3f} | 1.0x | 0 |")
        variants = [
            ("newton_schulz", torch.bfloat16),
            ("newton_schulz", torch.float32),
            ("polar_express", torch.bfloat16),
        ]
        for method, dtype in variants:
            t = median_seconds(lambda X=X, m=method, d=dtype: msign(X, polar=m, dtype=d), r)
            err = float((msign(X, polar=method, dtype=dtype).double() - exact).norm() / exact.norm())
            name = f"{method} ({str(dtype).removeprefix('torch.')})"
            print(f"| {shape[0]}x{shape[1]} | {name} | {t:.3f} | {t_svd / t:.1f}x faster | {err:.3f} |")

    torch.manual_seed(0)
    cfg = get_config("tiny")
    idx = torch.randint(0, cfg.vocab_size, (8, cfg.block_size + 1))
    batch = (idx[:, :-1], idx[:, 1:])
    times = {}
    for name in ("adamw", "muon"):
        model = GPT(cfg)
        loss_fn = make_loss_fn(model)
        opt = build_optimizer(name, model)
        loss_fn(dict(model.named_parameters()), batch).backward()
        times[name] = median_seconds(opt.step, max(r, 5))
    print(f"\nOptimizer step alone on `tiny` ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters)\n")
    print("| optimizer | seconds per step | ratio |")
    print("|---|---:|---:|")
    print(f"| adamw | {times['adamw']:.4f} | 1.00x |")
    print(f"| muon (hybrid) | {times['muon']:.4f} | {times['muon'] / times['adamw']:.2f}x AdamW |")


if __name__ == "__main__":
    main()
