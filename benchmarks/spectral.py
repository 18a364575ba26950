"""λ_max to relative error < 1e-3 on the `tiny` GPT: HVPs, seconds and peak memory of curvlab's
Lanczos, scipy's eigsh on curvlab's operator, and PyHessian's power iteration (run by hand).

    pip install pyhessian   # a benchmark-only dependency
    python benchmarks/spectral.py

Each method runs in a fresh process, so its peak resident memory (ru_maxrss; torch's own counters
only see CUDA) is its own. The reference λ_max is Lanczos run to a residual of 1e-10.
"""

from __future__ import annotations

import multiprocessing as mp
import resource
import time

import torch

TARGET = 1e-3


def problem():
    from curvlab import make_loss_fn
    from curvlab.models.gpt import GPT, get_config

    torch.manual_seed(0)
    cfg = get_config("tiny")
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (8, cfg.block_size + 1), generator=torch.Generator().manual_seed(1))
    return model, make_loss_fn(model), (idx[:, :-1], idx[:, 1:])


def run_curvlab(method: str, budget: int, reference: float):
    from curvlab.spectral import eigsh_extremes, hessian_operator_flat, lanczos

    model, loss_fn, batch = problem()
    params = {k: v.detach() for k, v in model.named_parameters()}
    start = time.perf_counter()
    op = hessian_operator_flat(loss_fn, params, batch)
    if method == "lanczos":
        result = lanczos(op, k=1, max_iter=budget, tol=1e-12)
    else:
        result = eigsh_extremes(op, k=1, tol=budget)  # budget is eigsh's tolerance here
    return float(result.eigenvalues[0]), result.num_matvecs, time.perf_counter() - start


def run_pyhessian(tol: float, reference: float):
    import sys

    import pyhessian  # noqa: F401
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ph = sys.modules["pyhessian.hessian"]  # the package's __init__ shadows the module with its class

    model, _, (x, y) = problem()

    class Flat(torch.nn.Module):  # PyHessian calls criterion(model(x), y) on 2-D logits
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, inp):
            return self.m(inp).reshape(-1, self.m.config.vocab_size)

    calls = {"n": 0}
    original = ph.hessian_vector_product

    def counted(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    ph.hessian_vector_product = counted
    start = time.perf_counter()
    with sdpa_kernel(SDPBackend.MATH):
        h = ph.hessian(Flat(model).eval(), torch.nn.functional.cross_entropy, data=(x, y.reshape(-1)), cuda=False)
        value = h.eigenvalues(maxIter=1000, tol=tol, top_n=1)[0][0]
    return float(value), calls["n"], time.perf_counter() - start


def worker(queue, kind, arg, reference):
    value, hvps, seconds = run_pyhessian(arg, reference) if kind == "pyhessian" else run_curvlab(kind, arg, reference)
    queue.put((value, hvps, seconds, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))


def measure(kind, arg, reference):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    p = ctx.Process(target=worker, args=(queue, kind, arg, reference))
    p.start()
    try:
        out = queue.get(timeout=900)  # a worker that died never answers
    finally:
        p.join(timeout=10)
        if p.is_alive():
            p.terminate()
    return out


def main() -> None:
    from curvlab.spectral import hessian_operator_flat, lanczos

    model, loss_fn, batch = problem()
    params = {k: v.detach() for k, v in model.named_parameters()}
    ref = lanczos(hessian_operator_flat(loss_fn, params, batch, dtype=torch.float64), k=1, max_iter=300, tol=1e-10)
    reference = float(ref.eigenvalues[0])
    print(f"\nreference λ_max = {reference:.6g} (residual {ref.residuals[0]:.1e}, {ref.num_matvecs} HVPs in float64)\n")
    print("| method | HVPs to rel. error < 1e-3 | seconds | peak RSS (MiB) | rel. error |")
    print("|---|---:|---:|---:|---:|")
    plans = [
        ("curvlab Lanczos", "lanczos", [10, 15, 20, 30, 40, 60, 80]),
        ("scipy eigsh on curvlab's operator", "eigsh", [1e-2, 1e-3, 1e-4, 1e-5]),
        ("PyHessian power iteration", "pyhessian", [1e-3, 1e-4, 1e-5, 1e-6]),
    ]
    for label, kind, args in plans:
        for arg in args:
            try:
                value, hvps, seconds, rss = measure(kind, arg, reference)
            except ImportError:
                print(f"| {label} | (pyhessian not installed) | | | |")
                break
            err = abs(value - reference) / abs(reference)
            if err < TARGET:
                print(f"| {label} | {hvps} | {seconds:.2f} | {rss:.0f} | {err:.1e} |", flush=True)
                break
        else:
            print(f"| {label} | not reached in the plan ({hvps} HVPs, error {err:.1e}) | | | |")


if __name__ == "__main__":
    main()
