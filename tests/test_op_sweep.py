"""The op sweep (``tests/op_sweep.py``) as a test: inside curvlab's exact mode, every op of the sweep is
exact by every method against central differences of torch's gradient, or refused by name with the
way out; and torch's own second derivatives fail exactly where this file records them, so that a torch
upgrade that changes any op (fixes one, breaks another) fails here and names it.
"""

import pytest
import torch

from tests.op_cases import FAMILIES
from tests.op_sweep import METHODS, Row, sweep

ALL, FORWARD, FWD_FWD = set(METHODS), {"fwd_rev", "fwd_fwd"}, {"fwd_fwd"}

# torch 2.13's second derivatives that are wrong or missing (natively: no exact mode, no vmap), by op and
# method; docs/op-sweep.md gives each one's error and what curvlab does about it
TORCH_FAILS = {
    "layer_norm": ALL - {"fwd_rev"},  # rev_rev: a bias without a weight; fwd_fwd: every form
    "batch_norm": ALL - {"fwd_rev"},  # rev_rev: a bias without a weight; fwd_fwd: batch statistics
    "instance_norm": ALL - {"fwd_rev"},  # (as batch_norm)
    "group_norm": {"rev_rev", "fwd_rev"},  # a bias without a weight: torch's first derivative fails
    "_weight_norm": ALL,
    "weight_norm (parametrization)": ALL,
    "weight_norm (parametrization, dim=1)": ALL,
    "weight_norm (hook)": ALL,
    "weight_norm (conv1d)": ALL,
    "orthogonal": FWD_FWD,  # (cayley: linalg.solve; householder: householder_product)
    "embedding": ALL,  # padding_idx, scale_grad_by_freq: torch's gradient is not f's; max_norm: in place
    "embedding_bag": ALL,
    "scaled_dot_product_attention": ALL,  # (natively on the CPU: the flash kernel)
    "MultiheadAttention": FWD_FWD,  # (its fast path, taken under forward mode without grad)
    "TransformerEncoderLayer": ALL,
    "multi_margin_loss": ALL,
    "multilabel_margin_loss": ALL,
    "soft_margin_loss": FORWARD,
    "mse_loss": {"fwd_rev"},
    "huber_loss": FORWARD,
    "cdist": ALL,
    "pdist": ALL,
    "ctc_loss": ALL,
    "hardsigmoid": ALL,
    "glu": FWD_FWD,
    "solve": FWD_FWD,
    "householder_product": FWD_FWD,
    "det": FWD_FWD,
    "slogdet": FWD_FWD,
    "logdet": FWD_FWD,
    "Tensor.det": FWD_FWD,
    "Tensor.slogdet": FWD_FWD,
    "Tensor.logdet": FWD_FWD,
    "orgqr": FWD_FWD,
    "Tensor.orgqr": FWD_FWD,
    "solve_ex": FWD_FWD,
    "grid_sample": FORWARD,
}
# what curvlab refuses by name (no second derivative in torch, and no composite), by op and method
REFUSED = {
    "ctc_loss": ALL,
    "grid_sample": FORWARD,
    "embedding[max_norm=1.0]": ALL,  # (renormalizes the weight in place during the forward)
    "embedding_bag[max_norm=1.0]": ALL,
}


# what curvlab gives that is not exact, and says so by a NaN (docs/op-sweep.md): the determinant's
# forward-over-forward composite goes through A's LU factors, whose derivatives divide by U's diagonal
LIMITS = {"det[singular]": {"fwd_fwd": "wrong (nan)"}}


def op_of(row: Row) -> str:
    return row.case.split("[")[0]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The ops are tiny: one thread runs them fastest, and alike on every machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def expected(row: Row, method: str) -> str:
    """``"ok"``, the start of the one-line refusal that names the op, or a recorded limit."""
    if method in LIMITS.get(row.case, {}):
        return LIMITS[row.case][method]
    refused = method in REFUSED.get(row.case, REFUSED.get(op_of(row), set()))
    return f"error: CurvlabError: {op_of(row)} " if refused else "ok"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_op_is_exact_in_curvlab_and_torch_fails_where_recorded(family):
    torch.manual_seed(0)
    rows = sweep(list(FAMILIES[family]()))
    unjudged = [r.case for r in rows if "reference" in r.native]
    assert not unjudged, f"central differences can't judge {unjudged}"
    wrong = [
        f"{r.case} in {r.inputs} by {m}: {o}"
        for r in rows
        for m, o in r.curvlab.items()
        if not o.startswith(expected(r, m))
    ]
    assert not wrong, "curvlab is not exact (or refuses what it should not):\n" + "\n".join(wrong)
    fails = {(op_of(r), m) for r in rows for m, o in r.native.items() if o != "ok"}
    ops = {op_of(r) for r in rows}
    recorded = {(op, m) for op, methods in TORCH_FAILS.items() if op in ops for m in methods}
    assert fails == recorded, f"torch changed: now failing {fails - recorded}, now right {recorded - fails}"


def test_the_reference_is_exact_on_closed_forms():
    """The sweep's central differences against Hessians known in closed form: f = ½ xᵀAx + sum(sin x)."""
    from tests.op_sweep import reference_hvp

    torch.manual_seed(1)
    a = torch.randn(5, 5, dtype=torch.float64)
    a = a + a.T
    x = {"x": torch.randn(5, dtype=torch.float64)}
    v, hv = reference_hvp(lambda p: 0.5 * p["x"] @ a @ p["x"] + torch.sin(p["x"]).sum(), x)
    exact = a @ v["x"] - torch.sin(x["x"]) * v["x"]
    assert (hv["x"] - exact).norm() <= 1e-9 * exact.norm()


@pytest.mark.parametrize("scale", [40.0, 1e-4])
def test_the_weight_norm_composite_keeps_half_precision(scale):
    """Weight norm's composite in float16 against the float64 value: its norm accumulates in float32, as
    torch's kernel does (a float16 sum of squares overflows at scale 40 and loses 9% at 1e-4)."""
    from curvlab.engine.composites import composite_weight_norm

    torch.manual_seed(0)
    v, g = scale * torch.randn(4, 300, dtype=torch.float64), torch.rand(4, 1, dtype=torch.float64) + 0.5
    exact = g * v / v.norm(dim=1, keepdim=True)
    half = composite_weight_norm(v.half(), g.half(), 0).double()
    assert (half - exact).abs().max() <= 2 * torch.finfo(torch.float16).eps * exact.abs().max()
