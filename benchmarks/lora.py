"""Adapter optimizers: step-time overhead over AdamW at r = 8 and r = 64, and how far sMuon's direction is
from the projection of the full Muon step (run by hand).

python benchmarks/lora.py [--repeats 15] [--width 384] [--layers 4] [--batch 8] [--seq 128]

Each optimizer trains its own copy of one peft-wrapped GPT (LoRA on every attention and MLP matrix). The
methods are interleaved, one training step each per round in a rotating order, so that load drifting over
the run hits them alike. The table gives medians over rounds, the median of the per-round ratios to AdamW,
and the difference of the optimizer steps alone over AdamW's whole step. The seed reports about 0.8%
overhead for sMuon over AdamW at r = 64 (large models on GPUs, where the forward and backward passes
dominate far more than here). One thread by default: on a loaded machine multithreaded LAPACK calls spin
and their times swing by 100x.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
from peft import LoraConfig, get_peft_model

from curvlab import build_optimizer, make_loss_fn
from curvlab.models.gpt import GPT, get_config
from curvlab.optim.lora import lora_layers

METHODS = ("adamw", "smuon", "lora-muon", "per-factor-muon")
TARGETS = ["c_q", "c_k", "c_v", "c_proj", "c_fc"]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def overheads(args, rank: int) -> dict[str, dict[str, list[float]]]:
    """Per method: seconds of a full training step and of the optimizer step alone, per round."""
    torch.manual_seed(0)
    cfg = get_config("tiny", n_embd=args.width, n_layer=args.layers, n_head=args.width // 64, block_size=args.seq)
    base = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1))
    batch = (idx[:, :-1], idx[:, 1:])
    runs = {}
    for name in METHODS:
        model = get_peft_model(copy.deepcopy(base), LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGETS))
        runs[name] = (model, make_loss_fn(model), build_optimizer(name, model))

    def train_step(name):
        model, loss_fn, opt = runs[name]
        opt.zero_grad(set_to_none=True)
        loss_fn(dict(model.named_parameters()), batch).backward()
        opt.step()

    times = {name: {"step": [], "optimizer": []} for name in METHODS}
    for round_ in range(args.warmup + args.repeats):
        order = METHODS[round_ % len(METHODS) :] + METHODS[: round_ % len(METHODS)]
        for name in order:
            step = timed(lambda name=name: train_step(name))
            opt_only = timed(runs[name][2].step)  # the same gradients again: the optimizer alone
            if round_ >= args.warmup:
                times[name]["step"].append(step)
                times[name]["optimizer"].append(opt_only)
    n_layers = len(lora_layers(runs["smuon"][0]))
    shape = f"width {args.width}, {args.layers} layers, batch {args.batch}x{args.seq}"
    print(f"\nr = {rank}: {n_layers} adapted matrices, {shape}, {args.repeats} rounds")
    return times


def report(times: dict[str, dict[str, list[float]]]) -> None:
    """Two estimates of the overhead: the median of per-round ratios of whole training steps (noisy on a
    loaded machine), and the optimizer-step difference over AdamW's whole step (the optimizer alone is
    short, so its median is steadier)."""
    print(
        "\n| optimizer | training step (s) | overhead: per-round step ratios | optimizer step alone (s) "
        "| overhead: optimizer-step difference / AdamW step |"
    )
    print("|---|---:|---:|---:|---:|")
    ref_step, ref_opt = statistics.median(times["adamw"]["step"]), statistics.median(times["adamw"]["optimizer"])
    for name in METHODS:
        t = times[name]
        ratios = [a / b for a, b in zip(t["step"], times["adamw"]["step"])]
        step, opt = statistics.median(t["step"]), statistics.median(t["optimizer"])
        print(
            f"| {name} | {step:.3f} | {100 * (statistics.median(ratios) - 1):+.1f}% | {opt:.4f} "
            f"| {100 * (opt - ref_opt) / ref_step:+.1f}% |"
        )


def cosines() -> None:
    """cos(proj_T(msign(H)), proj_T(msign(G))) and the share of msign(H) outside T, dense float64."""

    def nonzero_svd(X):
        U, S, Vh = torch.linalg.svd(X, full_matrices=False)
        keep = S.max() * max(X.shape) * torch.finfo(X.dtype).eps < S
        return U[:, keep], Vh[keep]

    def polar(X):
        U, Vh = nonzero_svd(X)
        return U @ Vh

    print("\nsMuon's direction against the projection of the full Muon step (Gaussian A, B, G; float64)\n")
    print("| d_out x d_in, r | cos(proj_T msign(H), proj_T msign(G)) | ||msign(H) - proj_T msign(H)|| / ||msign(H)|| |")
    print("|---|---:|---:|")
    for m, n, r in [(64, 64, 8), (384, 384, 8), (384, 1536, 8), (384, 384, 64), (384, 1536, 64)]:
        cos, out = [], []
        for seed in range(3):
            g = torch.Generator().manual_seed(seed)
            A, B, G = (torch.randn(s, generator=g, dtype=torch.float64) for s in [(r, n), (m, r), (m, n)])
            Ub, _ = nonzero_svd(B)
            _, Vha = nonzero_svd(A)
            Pb, Pa = Ub @ Ub.T, Vha.T @ Vha

            def proj(X, Pb=Pb, Pa=Pa):
                return Pb @ X + X @ Pa - Pb @ X @ Pa

            OH = polar(proj(G))
            x, y = proj(OH), proj(polar(G))
            cos.append(float((x * y).sum() / (x.norm() * y.norm())))
            out.append(float((OH - x).norm() / OH.norm()))
        print(f"| {m} x {n}, {r} | {min(cos):.3f}-{max(cos):.3f} | {min(out):.3f}-{max(out):.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: LAPACK's OpenMP spins on a loaded machine)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average at start {load[0]:.1f}")
    for rank in args.ranks:
        report(overheads(args, rank))
    print(f"\nload average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    cosines()


if __name__ == "__main__":
    main()
