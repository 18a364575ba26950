"""HVP cost as a ratio to one gradient, on the ~1M-parameter `tiny` GPT (LayerNorm, vocabulary 4416).
Run by hand, on a quiet machine:

    python benchmarks/hvp.py [--batch 8] [--repeats 7] [--compile] [--memory]

Every method runs once per round, interleaved, and the median over the rounds is reported, so the
ratios hold within one run even when the machine's speed drifts. The references are written here by
hand: plain double backward and plain ``jvp`` of ``grad`` (torch.func), each with attention pinned to
the math backend. ``--compile`` adds ``torch.compile`` of forward-over-reverse (compiling takes
minutes; torch.compile has no double backward). ``--memory`` measures the peak memory of one gradient
and one HVP, each in a fresh process, from torch's own counters (the profiler's CPU memory timeline;
on a GPU ``torch.cuda.max_memory_allocated``, see ``benchmarks/gpu_check.py``).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp

import torch
import torch.nn.functional as F
from timing import interleaved_medians, peak_bytes, print_table, tiny_problem
from torch.func import functional_call, grad, jvp
from torch.nn.attention import SDPBackend, sdpa_kernel

from curvlab import CurvaturePoint, exact_second_order, forward_quadratic_form, hvp


def plain_loss(model, x, y):
    def f(p):
        logits = functional_call(model, p, (x,))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    return f


def plain_double_backward(f, params, v):
    leaves = {k: t.clone().requires_grad_() for k, t in params.items()}
    g = torch.autograd.grad(f(leaves), list(leaves.values()), create_graph=True)
    return torch.autograd.grad(g, list(leaves.values()), list(v.values()))


def measurements(args) -> dict[str, object]:
    cfg, loss_fn, params, batch = tiny_problem(args.batch)
    f = plain_loss(loss_fn.model, *batch)
    g = torch.Generator().manual_seed(1)
    v = {k: torch.randn(t.shape, generator=g) for k, t in params.items()}
    vs = {k: torch.randn((8, *t.shape), generator=g) for k, t in params.items()}
    kept = CurvaturePoint(loss_fn, params, batch)  # for "one more HVP at a kept point"

    def gradient():
        leaves = {k: t.clone().requires_grad_() for k, t in params.items()}
        torch.autograd.grad(f(leaves), list(leaves.values()))

    def math(fn):
        def run():
            with sdpa_kernel(SDPBackend.MATH):
                fn()

        return run

    def point_k(method):
        def run():
            with CurvaturePoint(loss_fn, params, batch, method=method) as point:
                point.hvps(vs)

        return run

    fns = {
        "gradient": math(gradient),
        "plain double backward": math(lambda: plain_double_backward(f, params, v)),
        "plain double backward in exact_second_order()": lambda: _in_mode(lambda: plain_double_backward(f, params, v)),
        "plain jvp(grad)": math(lambda: jvp(grad(f), (params,), (v,))),
        "curvlab hvp (default rev_rev)": lambda: hvp(loss_fn, params, batch, v),
        "curvlab hvp, fwd_rev": lambda: hvp(loss_fn, params, batch, v, method="fwd_rev"),
        "one more HVP at a kept point": lambda: kept.hvp(v),
        "8 directions at one point, rev_rev": point_k("rev_rev"),
        "8 directions at one point, fwd_rev": point_k("fwd_rev"),
        "quadratic form (jvp of jvp)": lambda: forward_quadratic_form(loss_fn, params, batch, v),
    }
    if args.compile:
        compiled = torch.compile(lambda p, d: jvp(grad(f), (p,), (d,))[1])
        with sdpa_kernel(SDPBackend.MATH):
            compiled(params, v)  # compile outside the timing
        fns["torch.compile of jvp(grad), compiled"] = math(lambda: compiled(params, v))
    return cfg, params, interleaved_medians(fns, args.repeats)


def _in_mode(fn):
    with exact_second_order():
        fn()


def report(cfg, params, t, args) -> None:
    grad_s = t["gradient"]
    plain = t["plain double backward"]
    rows = [(name, s, f"{s / grad_s:.2f}x gradient") for name, s in t.items() if not name.startswith("8 ")]
    rows = [
        (n, s, r + (f" ({s / plain:.2f}x plain double backward)" if n.startswith("curvlab") else ""))
        for n, s, r in rows
    ]
    per_direction = [(name, s, f"{s / 8 / grad_s:.2f}x gradient per direction") for name, s in t.items()]
    rows += [row for row in per_direction if row[0].startswith("8 ")]
    n = sum(p.numel() for p in params.values())
    print_table(
        f"HVP cost on `tiny` ({n / 1e6:.2f}M parameters, batch {args.batch}x{cfg.block_size}, "
        f"{torch.get_num_threads()} threads; medians of {args.repeats} interleaved rounds)",
        rows,
    )


def _peak(kind: str, batch: int, conn) -> None:
    """In a fresh process: the peak of torch's own CPU allocations during one gradient or one HVP."""
    import os

    _, loss_fn, params, b = tiny_problem(batch)
    v = {k: torch.randn_like(t) for k, t in params.items()}
    f = plain_loss(loss_fn.model, *b)

    def gradient():
        leaves = {k: t.clone().requires_grad_() for k, t in params.items()}
        with sdpa_kernel(SDPBackend.MATH):
            torch.autograd.grad(f(leaves), list(leaves.values()))

    run = gradient if kind == "gradient" else (lambda: hvp(loss_fn, params, b, v, method=kind))
    conn.send(peak_bytes(run))  # a pipe's send returns once written: safe before _exit
    os._exit(0)  # (the profiler's stack records can crash the interpreter's own shutdown)


def memory(batch: int) -> None:
    ctx = mp.get_context("spawn")
    peaks = {}
    for kind in ("gradient", "rev_rev", "fwd_rev"):
        receive, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_peak, args=(kind, batch, send))
        proc.start()
        send.close()  # so that a child that dies unsent ends recv() with EOFError instead of a hang
        peaks[kind] = receive.recv()
        proc.join()
    print("\nPeak memory of torch's tensors (torch.profiler's CPU memory timeline, each in a fresh process):\n")
    for kind, size in peaks.items():
        print(f"- {kind}: {size / 2**20:.0f} MiB ({size / peaks['gradient']:.2f}x the gradient's)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--compile", action="store_true", help="also torch.compile of jvp(grad) (slow to compile)")
    ap.add_argument("--memory", action="store_true", help="also peak memory of a gradient and an HVP")
    args = ap.parse_args()
    report(*measurements(args), args)
    if args.memory:
        memory(args.batch)


if __name__ == "__main__":
    main()
