"""The op sweep: torch's ops with derivative formulas of their own, over their optional arguments, each
differentiated twice by every method and compared with central differences of torch's own gradient.

The cases are in ``tests/op_cases.py``. The scalar differentiated is
:math:`f(x) = \\sum_k \\langle w_k, y_k\\rangle + \\tfrac12 \\langle u_k, y_k \\odot y_k\\rangle` over the op's
float outputs :math:`y_k` (fixed random w, u), so that both the op's own second derivative and its
backward's derivative in the incoming gradient are exercised.

The reference is :math:`H v` by central differences of torch's gradient along v, extrapolated
(Richardson): :math:`(4 D(h/2) - D(h))/3` with :math:`D(h) = (g(x + hv) - g(x - hv))/2h`, whose error is
O(h⁴) in the step and about eps/h in rounding, about 1e-11 relative at h = 1e-4 (two step sizes agree to
that on every case).

``python -m tests.op_sweep`` prints the table: each case and method, what torch gives natively, and
what curvlab gives inside its exact mode.
"""

from __future__ import annotations

import collections
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.func import grad, jvp

from tests.op_cases import DT, FAMILIES, Case

METHODS = ("rev_rev", "fwd_rev", "fwd_fwd")
STEP = 1e-4


# ------------------------------------------------------------------------------------------- the checks


def scalarize(out: object) -> Tensor:
    r""":math:`\sum_k \langle w_k, y_k\rangle + \tfrac12 \langle u_k, y_k^2\rangle` over the float outputs, with w, u
    drawn from a generator seeded by the output's place (the same on every call)."""
    outputs = [out] if isinstance(out, Tensor) else list(out)
    total = None
    for k, y in enumerate(t for t in outputs if isinstance(t, Tensor) and t.is_floating_point()):
        w, u = _weights(k, tuple(y.shape), y.dtype)
        term = (w * y).sum() + 0.5 * (u * y * y).sum()
        total = term if total is None else total + term
    return total


@functools.cache
def _weights(k: int, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """w and u for output k (drawn once, outside any mode: the first call is the reference's)."""
    gen = torch.Generator().manual_seed(1000 + k)
    return torch.randn(shape, generator=gen, dtype=dtype), torch.randn(shape, generator=gen, dtype=dtype)


def objective(case: Case, keys: tuple[str, ...], *, reference: bool = False) -> Callable[[dict], Tensor]:
    """f of the inputs in ``keys`` (a dict), the others held at their values."""
    const = {k: t for k, t in case.inputs.items() if k not in keys}
    op = case.reference if reference and case.reference is not None else case.op
    return lambda x: scalarize(op(**const, **x))


def torch_gradient(f: Callable[[dict], Tensor], x: dict[str, Tensor]) -> dict[str, Tensor]:
    leaves = {k: t.detach().clone().requires_grad_() for k, t in x.items()}
    loss = f(leaves)
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True, materialize_grads=True)
    return dict(zip(leaves, grads))


def _shifted(x: dict, v: dict, h: float) -> dict:
    return {k: x[k] + h * v[k] for k in x}


def _difference(f, x, v, h) -> dict[str, Tensor]:
    plus, minus = torch_gradient(f, _shifted(x, v, h)), torch_gradient(f, _shifted(x, v, -h))
    return {k: (plus[k] - minus[k]) / (2 * h) for k in x}


def richardson(f, x, v, h) -> dict[str, Tensor]:
    """:math:`(4 D(h/2) - D(h)) / 3`: central differences of the gradient with their h² error removed."""
    d1, d2 = _difference(f, x, v, h), _difference(f, x, v, h / 2)
    return {k: (4 * d2[k] - d1[k]) / 3 for k in x}


def reference_hvp(f, x: dict[str, Tensor], *, seed: int = 0) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """A direction v and :math:`Hv` by central differences of torch's gradient, at two step sizes that
    must agree to 1e-9 (a kink of a piecewise op between the two would not: another v is drawn then)."""
    for attempt in range(4):
        gen = torch.Generator().manual_seed(seed + attempt)
        v = {k: torch.randn(t.shape, generator=gen, dtype=t.dtype) for k, t in x.items()}
        coarse, fine = richardson(f, x, v, STEP), richardson(f, x, v, STEP / 4)
        if _norm_difference(coarse, fine) <= 1e-9 * max(_norm(fine), 1e-30):
            return v, fine
    raise ValueError("central differences disagree at every direction drawn: f is not smooth here")


def _norm(d: dict[str, Tensor]) -> float:
    return math.sqrt(sum(float((t * t).sum()) for t in d.values()))


def _norm_difference(a: dict, b: dict) -> float:
    return math.sqrt(sum(float(((a[k] - b[k]) ** 2).sum()) for k in a))


def native(method: str, f, x: dict[str, Tensor], v: dict[str, Tensor]) -> dict[str, Tensor] | float:
    """torch's own second derivative by ``method``, outside curvlab: Hv, or vᵀHv for ``"fwd_fwd"``."""
    if method == "rev_rev":
        leaves = {k: t.detach().clone().requires_grad_() for k, t in x.items()}
        g = torch.autograd.grad(
            f(leaves), list(leaves.values()), create_graph=True, allow_unused=True, materialize_grads=True
        )
        dot = sum((gi * v[k]).sum() for gi, k in zip(g, leaves))
        if not dot.requires_grad:
            return {k: torch.zeros_like(t) for k, t in x.items()}
        hv = torch.autograd.grad(dot, list(leaves.values()), allow_unused=True, materialize_grads=True)
        return dict(zip(leaves, hv))
    if method == "fwd_rev":
        return jvp(grad(f), (x,), (v,))[1]
    one = torch.ones((), dtype=DT)
    along = lambda s: f(_shifted(x, v, s))  # noqa: E731
    return float(jvp(lambda t: jvp(along, (t,), (one,))[1], (0 * one,), (one,))[1])


def curvlab_second(method: str, f, x: dict[str, Tensor], v: dict[str, Tensor]) -> dict[str, Tensor] | float:
    """curvlab's second derivative by ``method`` (its exact mode): Hv, or vᵀHv for ``"fwd_fwd"``."""
    from curvlab import forward_quadratic_form, hvp

    loss_fn = lambda params, batch: f(dict(params))  # noqa: E731
    if method == "fwd_fwd":
        return forward_quadratic_form(loss_fn, x, (), v)[1]
    return hvp(loss_fn, x, (), v, method=method)


def curvlab_value(method: str, f, x: dict[str, Tensor]) -> float:
    """f inside curvlab's exact mode for ``method``, where its reroutes replace torch's ops."""
    from curvlab import exact_second_order

    with exact_second_order(method=method):
        return float(f(x))


def error(got: dict[str, Tensor] | float, v: dict[str, Tensor], ref: dict[str, Tensor]) -> float:
    """The relative error of Hv (or of vᵀHv, scaled by ‖v‖ ‖Hv‖) against the reference."""
    scale = max(_norm(ref), 1e-30)
    if isinstance(got, float):
        exact = sum(float((v[k] * ref[k]).sum()) for k in ref)
        return abs(got - exact) / (_norm(v) * scale)
    return _norm_difference({k: got[k].double() for k in ref}, ref) / scale


VALUE_TOLERANCE = 1e-12  # float64 rounding of a sum in another order (relative, or absolute near 0)
TOLERANCE = 1e-7  # the reference agrees with itself to 1e-9 at two step sizes; the methods are exact to rounding


def outcome(compute: Callable[[], object], v, ref) -> str:
    """``"ok"``, ``"wrong (relative error e)"``, or ``"error: <type>: <first line>"``."""
    try:
        got = compute()
    except Exception as e:  # the sweep records every failure, as it is
        return f"error: {type(e).__name__}: {str(e).strip().splitlines()[0][:160] if str(e).strip() else ''}"
    err = error(got, v, ref)
    return "ok" if err <= TOLERANCE else f"wrong ({err:.1e})"


@dataclass(frozen=True)
class Row:
    case: str
    family: str
    inputs: tuple[str, ...]
    native: dict[str, str]
    curvlab: dict[str, str]


def check(case: Case, keys: tuple[str, ...], *, methods=METHODS, curvlab: bool = True) -> Row:
    """One case with the inputs ``keys`` differentiated: torch's outcome and curvlab's by each method."""
    x = {k: case.inputs[k] for k in keys}
    try:
        v, ref = reference_hvp(objective(case, keys, reference=True), x)
    except Exception as e:  # a case the reference can't judge is a row of its own, never dropped
        return Row(case.name, case.family, keys, {"reference": f"error: {e}"}, {})
    f = objective(case, keys)
    theirs = {m: outcome(lambda m=m: native(m, f, x, v), v, ref) for m in methods}
    ours = {m: outcome(lambda m=m: curvlab_second(m, f, x, v), v, ref) for m in methods} if curvlab else {}
    if curvlab:  # a composite must give torch's value, not only a right second derivative
        value = float(f(x))
        for m in (m for m in methods if not ours[m].startswith("error: CurvlabError")):  # (refused: no value)
            moved = abs(curvlab_value(m, f, x) - value)
            ours[m] = ours[m] if moved <= VALUE_TOLERANCE * (abs(value) + 1) else f"value moved by {moved:.1e}"
    return Row(case.name, case.family, keys, theirs, ours)


def sweep(cases: list[Case], *, methods=METHODS, curvlab: bool = True) -> list[Row]:
    """Every case with each of its differentiated subsets."""
    return [check(c, keys, methods=methods, curvlab=curvlab) for c in cases for keys in c.differentiated()]


def table(rows: list[Row]) -> str:
    """Each op torch differentiates wrongly or not at all (natively), by method: its first error, and what
    curvlab gives inside its exact mode in those cases (exact or refused, with counts)."""
    by_op: dict[tuple[str, str], tuple[str, collections.Counter]] = {}
    for r in rows:
        for m, result in r.native.items():
            if result != "ok":
                mine = r.curvlab.get(m, "")
                ours = "exact" if mine == "ok" else "refused" if mine.startswith("error: CurvlabError") else mine
                _, counts = by_op.setdefault((r.case.split("[")[0], m), (_short(result), collections.Counter()))
                counts[ours] += 1
    lines = ["| op | method | torch 2.13 natively (first case) | curvlab in those cases |", "|---|---|---|---|"]
    for (op, m), (theirs, counts) in by_op.items():
        ours = ", ".join(f"{k} ({n})" for k, n in counts.items())
        lines.append(f"| `{op}` | {m} | {theirs} | {ours} |")
    cases = len({r.case for r in rows})
    checks = sum(len(r.native) for r in rows)
    lines.append(f"\n{cases} cases, {len(rows)} differentiated subsets, {checks} checks by each of torch and curvlab.")
    return "\n".join(lines)


def _short(result: str) -> str:
    return result.replace("error: ", "").replace("|", "/").split(" that does not support it")[0][:120]


if __name__ == "__main__":
    import sys
    import warnings

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    rows = []
    for name in sys.argv[1:] or FAMILIES:
        torch.manual_seed(0)  # (as the test seeds each family)
        rows += sweep(list(FAMILIES[name]()))
    print(table(rows))
