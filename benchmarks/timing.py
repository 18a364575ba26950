"""Shared timing helper for the ratio benchmarks (run by hand, never in tests)."""

from __future__ import annotations

import statistics
import time


def median_seconds(fn, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs after ``warmup`` untimed runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


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
