"""Float64 inner products of float32 tensors on the CPU: ``curvlab.engine.params.dot_table``, a piece of
``PIECE`` entries at a time, against the whole-tensor conversion it replaced (``torch.sum(a.double() *
b.double())``), for one pair and for the Taylor split's three pairs of two tensors (<G, Z>, <Z, Z>, <G, G>).
Run by hand, on a quiet machine:

    python benchmarks/inner_products.py [--entries 74000000] [--repeats 7]

Medians of interleaved rounds (`timing.py`). The whole conversion makes float64 copies and their product as
fresh memory of 8 bytes an entry each, which the kernel maps and zeroes page by page; a piece comes back
from the heap each time and stays in cache.
"""

from __future__ import annotations

import argparse

import torch
from timing import interleaved_medians

from curvlab.engine import params as param_dicts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=74_000_000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    a = {"w": torch.randn(args.entries, generator=g)}
    b = {"w": torch.randn(args.entries, generator=g)}
    three = ((a, b), (b, b), (a, a))
    fns = {
        "one pair, whole": lambda: torch.sum(a["w"].double() * b["w"].double()),
        "one pair, piecewise": lambda: param_dicts.dot_table([(a, b)], ["w"]),
        "three pairs, whole": lambda: [torch.sum(x["w"].double() * y["w"].double()) for x, y in three],
        "three pairs, piecewise": lambda: param_dicts.dot_table(list(three), ["w"]),
    }
    t = interleaved_medians(fns, args.repeats)
    threads = torch.get_num_threads()
    print(f"CPU, {threads} threads; {args.entries:,} float32 entries; medians of {args.repeats} rounds\n")
    print("| inner products | whole (s) | piecewise (s) | speed-up |")
    print("|---|---:|---:|---:|")
    for what in ("one pair", "three pairs"):
        whole, piecewise = t[f"{what}, whole"], t[f"{what}, piecewise"]
        print(f"| {what} | {whole:.3f} | {piecewise:.3f} | {whole / piecewise:.1f}x |")


if __name__ == "__main__":
    main()
