"""The GPU check, in one command: gpt2-124m trained a few steps with Muon (bf16 autocast), then analysed in
float32 from its checkpoint: NDS with the layer-block matrix, and the top of the Hessian spectrum.

    python benchmarks/gpu_check.py [--steps 5] [--batch 8] [--device cuda]

Prints the seconds of each stage and ``torch.cuda.max_memory_allocated`` of one gradient and one HVP
(the goal on one H200: NDS plus the block matrix in 30 s or less per checkpoint, HVP peak memory at
most 2.5x a gradient's). ``--model tiny --device cpu`` runs the same path on a CPU, to check the
script itself. Data: a small Zipf-PCFG language generated into a temporary directory (its 4412
tokens fit gpt2-124m's vocabulary).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from curvlab import CurvaturePoint, make_loss_fn
from curvlab.analysis.report import analyze_checkpoint
from curvlab.analysis.spectrum import SpectrumRequest, checkpoint_spectrum
from curvlab.analysis.targets import AnalysisSettings
from curvlab.data.dataset import generate_pcfg_dataset
from curvlab.runs.config import TrainConfig
from curvlab.runs.train import build_run, train


def peak_bytes(fn, device: torch.device) -> int:
    """Peak memory allocated while ``fn`` runs, above what was allocated before (CUDA counters; on a
    CPU there is no such counter, and 0 is returned)."""
    if device.type != "cuda":
        fn()
        return 0
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2-124m")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8, help="sequences of the model's block size per batch")
    ap.add_argument("--top", type=int, default=3)
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("error: no CUDA device here; pass --device cpu --model tiny to check the script on a CPU")
    timings: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        data = Path(tmp) / "data"
        generate_pcfg_dataset(data, s=1.0, tokens="4M", val_tokens="200k", progress=False)
        timings["data"] = time.perf_counter() - start

        cfg = TrainConfig(
            str(data), str(Path(tmp) / "run"), model=args.model, optimizer="muon", batch_size=args.batch,
            steps=args.steps, warmup_steps=0, ckpt_every=args.steps, eval_every=args.steps, val_windows=8,
            device=args.device,
        )  # fmt: skip
        start = time.perf_counter()
        train(cfg, progress=False)
        timings[f"train {args.steps} Muon steps (bf16 autocast on CUDA)"] = time.perf_counter() - start
        ckpt = Path(tmp) / "run" / f"ckpt_{args.steps:06d}.pt"

        start = time.perf_counter()
        report = analyze_checkpoint(ckpt, AnalysisSettings(blocks="layer"), device=args.device)
        timings[f"nds + {len(report.blocks.names)}-block matrix (float32)"] = time.perf_counter() - start

        start = time.perf_counter()
        spectrum = checkpoint_spectrum(ckpt, SpectrumRequest(top=args.top), device=args.device)
        timings[f"spectrum --top {args.top}"] = time.perf_counter() - start

        run = build_run(cfg)  # a fresh model of the same shape, for the memory of one gradient and one HVP
        device = run.device
        x, y = (t.to(device) for t in run.loader.next())
        loss_fn = make_loss_fn(run.model)
        params = {k: p.detach() for k, p in run.model.named_parameters()}
        v = {k: torch.randn_like(p) for k, p in params.items()}

        def gradient():
            leaves = {k: p.clone().requires_grad_() for k, p in params.items()}
            torch.autograd.grad(loss_fn(leaves, (x, y)), list(leaves.values()))

        def one_hvp():
            with CurvaturePoint(loss_fn, params, (x, y)) as point:
                point.hvp(v)

        grad_peak, hvp_peak = peak_bytes(gradient, device), peak_bytes(one_hvp, device)

    n = sum(p.numel() for p in params.values())
    print(f"{args.model}: {n / 1e6:.1f}M parameters, batch {args.batch}x{x.shape[1]}, {device}")
    for stage, seconds in timings.items():
        print(f"  {stage}: {seconds:.1f} s")
    print(f"  NDS {report.split.nds:.6g}, rho_within {report.blocks.rho_within:.3f}")
    top = [round(float(x), 4) for x in spectrum.top.eigenvalues]
    print(f"  top eigenvalues: {top} ({spectrum.top.num_matvecs} HVPs)")
    if device.type == "cuda":
        print(
            f"  peak memory: gradient {grad_peak / 2**30:.2f} GiB, HVP {hvp_peak / 2**30:.2f} GiB "
            f"({hvp_peak / grad_peak:.2f}x the gradient's)"
        )


if __name__ == "__main__":
    main()
