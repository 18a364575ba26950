"""Training throughput: tokens/s of `tiny` for Muon and AdamW on this machine, and on a GPU (when there
is one) tokens/s and model FLOPs utilization of `gpt2-124m` in bf16. Run by hand.

    python benchmarks/train.py [--steps 30]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from curvlab.data.dataset import generate_pcfg_dataset
from curvlab.engine.loss import token_cross_entropy
from curvlab.models.gpt import GPT, get_config
from curvlab.optim.build import build_optimizer
from curvlab.runs.config import TrainConfig
from curvlab.runs.train import build_run


def step_seconds(run, steps: int) -> float:
    """Median seconds of a full training step (forward, backward, clip, optimizer, schedule)."""
    times = []
    for _ in range(steps):
        x, y = (t.to(run.device) for t in run.loader.next())
        if run.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with run.autocast():
            loss = token_cross_entropy(run.model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), 1.0)
        run.optimizer.step()
        run.scheduler.step()
        run.optimizer.zero_grad(set_to_none=True)
        if run.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times[2:])[len(times[2:]) // 2]


def gpu_mfu(steps: int) -> None:
    cfg = get_config("gpt2-124m")
    model = GPT(cfg).cuda()
    batch, seq = 16, cfg.block_size
    for name in ("adamw", "muon"):
        opt = build_optimizer(name, model)
        x = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device="cuda")
        times = []
        for _ in range(steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = token_cross_entropy(model(x[:, :-1]), x[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        t = sorted(times[2:])[len(times[2:]) // 2]
        n = model.num_parameters()
        flops_per_token = 6 * n + 12 * cfg.n_layer * cfg.n_embd * seq  # PaLM appendix B
        achieved = flops_per_token * batch * seq / t
        peak = 989e12  # H100/H200 dense bf16
        print(f"| gpt2-124m {name} | {batch * seq / t:.0f} tokens/s | MFU {achieved / peak:.1%} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        generate_pcfg_dataset(f"{tmp}/d", s=1.0, tokens="500k", val_tokens="20k", progress=False)
        times = {}
        for name in ("adamw", "muon"):
            run = build_run(TrainConfig(data=f"{tmp}/d", out=f"{tmp}/{name}", optimizer=name, device="cpu"))
            times[name] = step_seconds(run, args.steps)
        tokens = run.cfg.batch_size * run.loader.seq_len
    print(f"\n`tiny` on the CPU ({torch.get_num_threads()} threads), batch {run.cfg.batch_size}x{run.loader.seq_len}\n")
    print("| optimizer | seconds per step | tokens/s |")
    print("|---|---:|---:|")
    for name, t in times.items():
        print(f"| {name} | {t:.4f} | {tokens / t:.0f} |")
    print(f"\nMuon/AdamW step-time ratio: {times['muon'] / times['adamw']:.2f}")
    if torch.cuda.is_available():
        print("\nOn the GPU:\n")
        gpu_mfu(args.steps)


if __name__ == "__main__":
    main()
