"""Shared timing helpers for the ratio benchmarks (run by hand, never in tests).

Timings on a shared machine stretch with load, so methods are *interleaved*: every round runs each
method once, in turn, and each method's median over the rounds is reported. Ratios between methods
measured this way in one run are what the README quotes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_seconds(fn, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs after ``warmup`` untimed runs."""
    return interleaved_medians({"fn": fn}, repeats, warmup)["fn"]


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int = 7, warmup: int = 1) -> dict[str, float]:
    """Median wall time of each function, over ``repeats`` rounds that run every function once in turn."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def peak_bytes(fn, device: str = "cpu") -> int:
    """The peak of torch's own allocations during one ``fn()`` (after one untimed call), in bytes: on a GPU
    ``torch.cuda.max_memory_allocated``, on the CPU the profiler's memory timeline (``tracemalloc`` can't
    see torch's tensors). Run it in a fresh process: the profiler's stack records can crash the
    interpreter's own shutdown, so the caller sends the number and ends with ``os._exit``."""
    import json
    import os
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()  # warm up outside the measurement
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "timeline.json")
        prof.export_memory_timeline(path, device="cpu")
        with open(path) as f:
            _, sizes = json.load(f)
    return max(sum(s) for s in sizes)


def print_table(title: str, rows: list[tuple[str, float, str]]) -> None:
    """Print ``(name, seconds, ratio text)`` rows as a Markdown table."""
    print(f"\n{title}\n")
    print("| measurement | seconds | ratio |")
    print("|---|---:|---:|")
    for name, seconds, ratio in rows:
        print(f"| {name} | {seconds:.4f} | {ratio} |")


def tiny_problem(batch: int = 8):
    """The ~1M-parameter `tiny` GPT, its loss function, detached parameters and one random batch."""
    import torch

    from curvlab import make_loss_fn
    from curvlab.models.gpt import GPT, get_config

    torch.manual_seed(0)
    cfg = get_config("tiny")
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1))
    params = {k: v.detach() for k, v in model.named_parameters()}
    return cfg, make_loss_fn(model), params, (idx[:, :-1], idx[:, 1:])
