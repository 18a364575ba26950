"""The factored Kronecker HVP vs the dense Hessian-vector product (run by hand).

python benchmarks/quadratic.py
"""

from __future__ import annotations

import torch
from timing import median_seconds

from curvlab.theory.quadratic_model import TwoLevelSpec, two_level


def main() -> None:
    print("\n| d1 = d2 | factored H[Y] (s) | dense H would hold |")
    print("|---:|---:|---:|")
    for d in (128, 256, 512):
        p = two_level(TwoLevelSpec(d1=d, d2=d, q=min(88, d), m=8))
        Y = torch.randn(d, d, dtype=torch.float64)
        t = median_seconds(lambda p=p, Y=Y: p.hvp(Y), 5)
        print(f"| {d} | {t:.4f} | {(d * d) ** 2 * 8 / 2**30:.1f} GiB |")


if __name__ == "__main__":
    main()
