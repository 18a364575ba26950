"""λ_max to relative error < 1e-3 on the `tiny` GPT: HVPs, seconds and peak memory of curvlab's
Lanczos, scipy's eigsh on curvlab's operator, and PyHessian's power iteration (run by hand); then
Lanczos under memory budgets against the unbounded one (HVPs, seconds, and the time outside HVPs).

    pip install pyhessian   # a benchmark-only dependency
    python benchmarks/spectral.py            # both tables
    python benchmarks/spectral.py --budget   # the memory-budget table alone

Each method of the first table runs in a fresh process, so its peak resident memory (ru_maxrss;
torch's own counters only see CUDA) is its own. The reference λ_max is Lanczos run to a residual of
1e-10. The budget table runs in one process, its configurations in turn, so its ratios share one load.
"""

from __future__ import annotations

import multiprocessing as mp
import resource
import sys
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
    from curvlab.curvature.spectral import eigsh_extremes, lanczos
    from curvlab.engine.operator import hessian_operator

    model, loss_fn, batch = problem()
    params = {k: v.detach() for k, v in model.named_parameters()}
    start = time.perf_counter()
    op = hessian_operator(loss_fn, params, batch)
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


def budget_table(k: int = 3, tol: float = 1e-6, budgets=(None, 24, 12, 8)) -> None:
    """Lanczos for the top k under budgets of so many stored vectors, against the unbounded run."""
    from curvlab.curvature.spectral import lanczos, vector_bytes
    from curvlab.engine.operator import hessian_operator

    model, loss_fn, batch = problem()
    params = {k: v.detach() for k, v in model.named_parameters()}
    rows = []
    for vectors in budgets:
        op = hessian_operator(loss_fn, params, batch)
        inner, in_hvps = op._matmat, [0.0]

        def timed(X, inner=inner, in_hvps=in_hvps):
            start = time.perf_counter()
            out = inner(X)
            in_hvps[0] += time.perf_counter() - start
            return out

        op._matmat = timed
        memory = None if vectors is None else vectors * vector_bytes(op)
        start = time.perf_counter()
        r = lanczos(op, k=k, max_iter=400, tol=tol, memory=memory)
        rows.append((vectors, r, time.perf_counter() - start, in_hvps[0], vector_bytes(op)))
    base = rows[0]
    n = sum(t.numel() for t in params.values())
    print(f"\nLanczos for the top {k} (tol {tol:g}) of `tiny` ({n} parameters, {base[4] / 2**20:.1f} MiB a vector)\n")
    print("| stored vectors | restarts | HVPs | HVPs vs unbounded | seconds | seconds vs unbounded "
          "| outside HVPs | max rel. diff. of λ |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for vectors, r, seconds, in_hvps, _ in rows:
        diff = max(abs(a - b) / abs(b) for a, b in zip(r.eigenvalues, base[1].eigenvalues))
        label = f"unbounded ({r.basis_vectors} used)" if vectors is None else str(vectors)
        print(
            f"| {label} | {r.restarts} | {r.num_matvecs} | {r.num_matvecs / base[1].num_matvecs:.2f}x "
            f"| {seconds:.1f} | {seconds / base[2]:.2f}x | {(seconds - in_hvps) / seconds:.1%} | {diff:.1e} |",
            flush=True,
        )


def main() -> None:
    from curvlab.curvature.spectral import lanczos
    from curvlab.engine.operator import hessian_operator

    if "--budget" in sys.argv[1:]:
        budget_table()
        return
    model, loss_fn, batch = problem()
    params = {k: v.detach() for k, v in model.named_parameters()}
    ref = lanczos(hessian_operator(loss_fn, params, batch, dtype=torch.float64), k=1, max_iter=300, tol=1e-10)
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
    budget_table()


if __name__ == "__main__":
    main()
