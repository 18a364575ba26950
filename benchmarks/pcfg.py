"""Zipf-PCFG sampler throughput on one core (run by hand; target >= 1M tokens/s).

python benchmarks/pcfg.py [--tokens 10M]
"""

from __future__ import annotations

import argparse
import os
import time

from curvlab.data.dataset import parse_count
from curvlab.data.pcfg import make_grammar


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", default="10M")
    args = ap.parse_args()
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core
    n = parse_count(args.tokens)
    grammar = make_grammar(seed=0)
    print("\n| s | tokens | seconds | tokens/s (one core) |")
    print("|---|---:|---:|---:|")
    for s in (0.0, 0.5, 1.0):
        start = time.perf_counter()
        produced = sum(chunk.size for chunk in grammar.stream(n, s, seed=1))
        dt = time.perf_counter() - start
        print(f"| {s:g} | {produced} | {dt:.2f} | {produced / dt / 1e6:.2f}M |")


if __name__ == "__main__":
    main()
