import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.sparse.linalg import eigsh
from torch.func import hessian

import curvlab
from curvlab import (
    Batches,
    CurvaturePoint,
    exact_second_order,
    forward_quadratic_form,
    forward_quadratic_forms,
    gradient_and_hvps,
    hessian_operator,
    hvp,
    hvps,
    make_loss_fn,
)
from curvlab.engine import params as param_dicts
from curvlab.engine.finite_difference import FiniteDifferenceHVP, finite_difference_hvp
from curvlab.engine.hvp import METHODS
from curvlab.errors import CurvlabError
from tests.builders import random_direction
from tests.reference import MLP, dense_gradient, dense_hessian, deterministic

PROBLEMS = ["mlp_problem", "transformer_problem"]


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("problem", PROBLEMS)
@pytest.mark.parametrize("method", ["fwd_rev", "rev_rev"])
def test_hvp_equals_dense_hessian(problem, method, request):
    loss_fn, params, batch = request.getfixturevalue(problem)
    H = dense_hessian(loss_fn, params, batch)
    v = random_direction(params)
    hv = param_dicts.flatten(hvp(loss_fn, params, batch, v, method=method))
    assert hv.dtype == torch.float64
    assert rel_err(hv, H @ param_dicts.flatten(v)) <= 1e-8


@pytest.mark.parametrize("problem", PROBLEMS)
def test_hvp_is_symmetric(problem, request):
    loss_fn, params, batch = request.getfixturevalue(problem)
    u, v = random_direction(params, 1), random_direction(params, 2)
    uhv = param_dicts.dot(u, hvp(loss_fn, params, batch, v))
    vhu = param_dicts.dot(v, hvp(loss_fn, params, batch, u))
    assert abs(uhv - vhu) <= 1e-10 * abs(uhv)


def test_hvp_matches_central_differences_of_gradient(transformer_problem):
    loss_fn, params, batch = transformer_problem
    v = random_direction(params)
    eps = 1e-5
    plus = dense_gradient(loss_fn, param_dicts.add(params, v, eps), batch)
    minus = dense_gradient(loss_fn, param_dicts.add(params, v, -eps), batch)
    fd = (plus - minus) / (2 * eps)
    assert rel_err(param_dicts.flatten(hvp(loss_fn, params, batch, v)), fd) <= 1e-7


@pytest.mark.parametrize("method", ["fwd_rev", "rev_rev"])
def test_batched_equals_one_by_one(transformer_problem, method):
    loss_fn, params, batch = transformer_problem
    dirs = [random_direction(params, s) for s in range(5)]
    stacked = {k: torch.stack([d[k] for d in dirs]) for k in params}
    for chunk in (None, 2):
        out = hvps(loss_fn, params, batch, stacked, chunk_size=chunk, method=method)
        for i, d in enumerate(dirs):
            single = hvp(loss_fn, params, batch, d, method=method)
            assert rel_err(param_dicts.flatten({k: out[k][i] for k in params}), param_dicts.flatten(single)) <= 1e-12


def test_gradient_and_loss_come_with_the_hvps(transformer_problem):
    loss_fn, params, batch = transformer_problem
    stacked = {k: t.unsqueeze(0) for k, t in random_direction(params).items()}
    loss, g, _ = gradient_and_hvps(loss_fn, params, batch, stacked)
    assert rel_err(param_dicts.flatten(g), dense_gradient(loss_fn, params, batch)) <= 1e-12
    assert loss == pytest.approx(float(deterministic(loss_fn)(params, batch)), rel=1e-12)


def test_uneven_batches_are_weighted_by_loss_terms(transformer_problem):
    loss_fn, params, (idx, tgt) = transformer_problem
    tgt = tgt.clone()
    tgt[0, :4] = -100  # ignored tokens: the batches hold 2, 6 and 6 loss terms
    whole = (idx, tgt)
    parts = [(idx[:1], tgt[:1]), (idx[1:2], tgt[1:2]), (idx[2:], tgt[2:])]
    v = random_direction(params)
    ref = dense_hessian(loss_fn, params, whole) @ param_dicts.flatten(v)
    acc = param_dicts.flatten(hvp(loss_fn, params, parts, v))
    assert rel_err(acc, ref) <= 1e-10
    equal_weights = param_dicts.flatten(hvp(loss_fn, params, Batches(parts, weights=[1, 1, 1]), v))
    assert rel_err(equal_weights, ref) > 1e-3  # the naive average is measurably wrong here
    gz, zhz = forward_quadratic_form(loss_fn, params, parts, v)
    assert zhz == pytest.approx(float(param_dicts.flatten(v) @ ref), rel=1e-10)
    assert gz == pytest.approx(float(param_dicts.flatten(v) @ dense_gradient(loss_fn, params, whole)), rel=1e-10)


@pytest.mark.heavy
def test_a_batch_with_every_label_ignored_weighs_nothing(transformer_problem):
    """Its mean loss is 0/0, but its weight is 0: the list means the other batches' loss, exactly."""
    loss_fn, params, (idx, tgt) = transformer_problem
    tgt = tgt.clone()
    tgt[0] = -100  # the first row holds no loss term
    parts = [(idx[:1], tgt[:1]), (idx[1:], tgt[1:])]
    v = random_direction(params)
    ref = dense_hessian(loss_fn, params, (idx[1:], tgt[1:])) @ param_dicts.flatten(v)
    for method in METHODS:
        assert rel_err(param_dicts.flatten(hvp(loss_fn, params, parts, v, method=method)), ref) <= 1e-10, method
    gz, zhz = forward_quadratic_form(loss_fn, params, parts, v)
    assert zhz == pytest.approx(float(param_dicts.flatten(v) @ ref), rel=1e-10)
    assert gz == pytest.approx(
        float(param_dicts.flatten(v) @ dense_gradient(loss_fn, params, (idx[1:], tgt[1:]))), rel=1e-10
    )
    with pytest.raises(CurvlabError, match="hold no loss terms"):
        hvp(loss_fn, params, [parts[0], parts[0]], v)  # every batch empty: no loss at all


def test_a_direction_on_the_meta_device_is_refused_in_one_line(transformer_problem):
    loss_fn, params, batch = transformer_problem
    v = {k: torch.empty_like(t, device="meta") for k, t in random_direction(params).items()}
    with pytest.raises(CurvlabError, match="meta device") as e:
        hvp(loss_fn, params, batch, v)
    assert "\n" not in str(e.value)
    stacked = {k: t.unsqueeze(0) for k, t in v.items()}
    with pytest.raises(CurvlabError, match="meta device"):
        gradient_and_hvps(loss_fn, params, batch, stacked)


@pytest.mark.parametrize("problem", PROBLEMS)
def test_forward_over_reverse_equals_double_backward(problem, request):
    loss_fn, params, batch = request.getfixturevalue(problem)
    v = random_direction(params)
    a = param_dicts.flatten(hvp(loss_fn, params, batch, v, method="fwd_rev"))
    b = param_dicts.flatten(hvp(loss_fn, params, batch, v, method="rev_rev"))
    assert rel_err(a, b) <= 1e-12


@pytest.mark.parametrize("problem", PROBLEMS)
def test_quadratic_form_equals_hvp_inner_product(problem, request):
    loss_fn, params, batch = request.getfixturevalue(problem)
    z = random_direction(params)
    gz, zhz = forward_quadratic_form(loss_fn, params, batch, z)
    H = dense_hessian(loss_fn, params, batch)
    flat = param_dicts.flatten(z)
    assert zhz == pytest.approx(float(flat @ H @ flat), rel=1e-10)
    assert zhz == pytest.approx(param_dicts.dot(z, hvp(loss_fn, params, batch, z)), rel=1e-10)
    assert gz == pytest.approx(float(flat @ dense_gradient(loss_fn, params, batch)), rel=1e-10)


def test_batched_quadratic_forms_in_chunks(transformer_problem):
    loss_fn, params, batch = transformer_problem
    dirs = [random_direction(params, s) for s in range(3)]
    stacked = {k: torch.stack([d[k] for d in dirs]) for k in params}
    gz, zhz = forward_quadratic_forms(loss_fn, params, batch, stacked, chunk_size=2)
    with CurvaturePoint(loss_fn, params, batch) as point:  # the same pair by double backward
        by_hvps = point.quadratic_forms(stacked)
    torch.testing.assert_close((gz, zhz), by_hvps, rtol=1e-10, atol=0)
    for i, d in enumerate(dirs):
        assert (float(gz[i]), float(zhz[i])) == pytest.approx(
            forward_quadratic_form(loss_fn, params, batch, d), rel=1e-12
        )


def test_exact_mode_makes_torch_func_hessian_right_through_layernorm(transformer_problem):
    """torch.func.hessian (jacrev of jacrev) through an affine LayerNorm is wrong on torch 2.13;
    inside exact_second_order the composite LayerNorm makes it exact."""
    loss_fn, params, batch = transformer_problem
    names = ["h.0.ln_1.weight", "h.0.ln_1.bias", "h.0.attn_qkv.weight"]
    sub = {k: params[k] for k in names}

    def f(s):
        return loss_fn({**params, **s}, batch)

    with exact_second_order():
        H = hessian(f)(sub)
    dense = torch.cat([torch.cat([H[a][b].reshape(sub[a].numel(), -1) for b in names], 1) for a in names])
    full = dense_hessian(loss_fn, params, batch)
    index = {}
    start = 0
    for k, t in params.items():
        index[k] = torch.arange(start, start + t.numel())
        start += t.numel()
    rows = torch.cat([index[k] for k in names])
    assert rel_err(dense, full[rows][:, rows]) <= 1e-10


def test_float32_model_in_float64_and_bf16_upcast():
    torch.manual_seed(0)
    model = MLP()
    x, y = torch.randn(9, 5), torch.randint(0, 3, (9,))
    loss_fn = make_loss_fn(model, criterion=torch.nn.functional.cross_entropy)
    params = {k: v.detach() for k, v in model.named_parameters()}
    v = random_direction(params)
    H = dense_hessian(loss_fn, params, (x.double(), y))
    hv64 = hvp(loss_fn, params, (x, y), v, dtype=torch.float64)
    assert hv64["fc1.weight"].dtype == torch.float64
    assert rel_err(param_dicts.flatten(hv64), H @ param_dicts.flatten(v).double()) <= 1e-8
    hv32 = hvp(loss_fn, params, (x, y), v)
    assert hv32["fc1.weight"].dtype == torch.float32
    assert rel_err(param_dicts.flatten(hv32).double(), H @ param_dicts.flatten(v).double()) <= 1e-5
    bf16 = {k: t.bfloat16() for k, t in params.items()}
    hvb = hvp(loss_fn, bf16, (x, y), v)
    assert hvb["fc1.weight"].dtype == torch.float32


@pytest.mark.parametrize("problem", PROBLEMS)
def test_linear_operator_top_eigenvalue(problem, request):
    loss_fn, params, batch = request.getfixturevalue(problem)
    H = dense_hessian(loss_fn, params, batch)
    top = float(torch.linalg.eigvalsh(H)[-1])
    op = hessian_operator(loss_fn, params, batch)
    assert op.shape == H.shape and op.dtype == torch.float64 and op.device == torch.device("cpu")
    lin = op.to_scipy()
    assert lin.shape == H.shape and lin.dtype == np.float64
    val = eigsh(lin, k=1, which="LA", tol=1e-12, return_eigenvectors=False)[0]
    assert val == pytest.approx(top, rel=1e-8)
    assert op.num_matvecs > 0
    X = torch.randn(H.shape[0], 3, dtype=torch.float64)
    assert rel_err(op @ X, H @ X) <= 1e-10
    block = ["fc1.weight"] if "fc1.weight" in params else ["h.1.mlp_fc.weight"]
    sub = hessian_operator(loss_fn, params, batch, scope=block, method="rev_rev")
    x = np.random.default_rng(0).standard_normal(sub.dim)
    start = sum(t.numel() for k, t in params.items() if list(params).index(k) < list(params).index(block[0]))
    sl = slice(start, start + sub.dim)
    np.testing.assert_allclose(sub.to_scipy() @ x, H[sl, sl].numpy() @ x, rtol=1e-9, atol=1e-12)
    assert rel_err(sub @ torch.as_tensor(x), H[sl, sl] @ torch.as_tensor(x)) <= 1e-10


def test_bad_input_is_named(mlp_problem):
    loss_fn, params, batch = mlp_problem
    v = random_direction(params)
    with pytest.raises(ValueError, match=r"missing 'fc2\.bias'"):
        hvp(loss_fn, params, batch, {k: t for k, t in v.items() if k != "fc2.bias"})
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        hvp(loss_fn, params, batch, {**v, "fc1.bias": torch.zeros(3, dtype=torch.float64)})
    with pytest.raises(ValueError, match="non-finite"):
        hvp(loss_fn, params, batch, {**v, "fc1.bias": torch.full((7,), float("nan"), dtype=torch.float64)})
    with pytest.raises(ValueError, match="unknown HVP method"):
        hvp(loss_fn, params, batch, v, method="magic")
    with pytest.raises(ValueError, match="scalar"):
        hvp(lambda p, b: loss_fn(p, b) * torch.ones(2, dtype=torch.float64), params, batch, v)
    with pytest.raises(ValueError, match="not finite"):
        hvp(lambda p, b: loss_fn(p, b) / 0.0, params, batch, v)
    with pytest.raises(ValueError, match="no batches"):
        hvp(loss_fn, params, [], v)


@pytest.mark.parametrize("method", ["rev_rev", "fwd_rev"])
def test_a_point_answers_many_hvps_exactly_and_directions_may_touch_few_parameters(transformer_problem, method):
    """One CurvaturePoint (forward and first backward once) gives every HVP asked of it; a direction
    naming only some parameters is zero elsewhere; loss and gradient equal the dense references."""
    loss_fn, params, batch = transformer_problem
    H = dense_hessian(loss_fn, params, batch)
    with CurvaturePoint(loss_fn, params, batch, method=method) as point:
        for seed in (1, 2, 3):
            v = random_direction(params, seed)
            assert rel_err(param_dicts.flatten(point.hvp(v)), H @ param_dicts.flatten(v)) <= 1e-10
        top = {n: t for n, t in random_direction(params, 4).items() if n.startswith(("h.1.", "lm_head"))}
        padded = param_dicts.flatten({n: top.get(n, torch.zeros_like(t)) for n, t in params.items()})
        assert rel_err(param_dicts.flatten(point.hvp(top)), H @ padded) <= 1e-10
        pieces = point.hvp_each([top, random_direction(params, 5)])
        assert rel_err(param_dicts.flatten(pieces[0]), H @ padded) <= 1e-10
        z = random_direction(params, 6)
        gz, zhz = point.quadratic_forms({n: t.unsqueeze(0) for n, t in z.items()})
        assert float(zhz[0]) == pytest.approx(float(param_dicts.flatten(z) @ H @ param_dicts.flatten(z)), rel=1e-10)
        assert rel_err(param_dicts.flatten(point.gradient), dense_gradient(loss_fn, params, batch)) <= 1e-12
        assert float(gz[0]) == pytest.approx(
            float(dense_gradient(loss_fn, params, batch) @ param_dicts.flatten(z)), rel=1e-10
        )
    if method == "rev_rev":
        with pytest.raises(ValueError, match="closed"):
            point.hvp(z)


@pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad=True")  # the mistake under test
@pytest.mark.parametrize("method", ["rev_rev", "fwd_rev"])
def test_a_loss_detached_from_the_parameters_is_refused(mlp_problem, method):
    loss_fn, params, batch = mlp_problem
    v = random_direction(params)
    with pytest.raises(ValueError, match="does not depend on the parameters"):
        hvp(lambda p, b: torch.tensor(float(loss_fn(p, b)), dtype=torch.float64), params, batch, v, method=method)
    detached = {k: t.detach().clone() for k, t in params.items()}
    with pytest.raises(ValueError, match="does not depend on the parameters"):
        hvp(lambda p, b: loss_fn(detached, b), params, batch, v, method=method)


def test_a_non_finite_hessian_vector_product_is_refused(mlp_problem):
    loss_fn, params, batch = mlp_problem
    v = random_direction(params)

    def kinked(p, b):  # finite loss and gradient, infinite second derivative at 0
        return loss_fn(p, b) + (p["fc2.bias"] - p["fc2.bias"].detach()).abs().pow(1.5).sum()

    with pytest.raises(ValueError, match=r"Hessian-vector product is not finite .* 'fc2\.bias'"):
        hvp(kinked, params, batch, v)


FACTORIES = frozenset({torch.zeros, torch.ones, torch.empty, torch.full, torch.randn, torch.rand, torch.eye})


class DeviceCheck(torch.overrides.TorchFunctionMode):
    """Fails when curvlab's own code calls a tensor factory without an explicit device (the tensor would
    land on the default device, not necessarily the parameters'). The model's code is not checked."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and "device" not in kwargs:
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(str(Path(curvlab.__file__).parent)):
                raise AssertionError(f"{func.__name__} without a device in {caller}")
        return func(*args, **kwargs)


def test_the_engine_keeps_the_parameters_dtype_and_never_creates_tensors_without_a_device(transformer_problem):
    from curvlab import block_matrix, taylor_split

    loss_fn, params, batch = transformer_problem
    z = random_direction(params, 8)
    with DeviceCheck():
        for method in ("rev_rev", "fwd_rev"):
            with CurvaturePoint(loss_fn, params, batch, method=method) as point:
                hv = point.hvp(z)
            assert all(t.dtype == torch.float64 for t in hv.values())
            taylor_split(loss_fn, params, batch, z, method=method)
            block_matrix(loss_fn, params, batch, z, method=method)
            block_matrix(loss_fn, params, batch, z, block_method="alpha", method=method)


def test_finite_difference_hvp_within_its_stated_error_and_its_record(mlp_problem):
    loss_fn, params, batch = mlp_problem
    v = random_direction(params)
    fd = finite_difference_hvp(loss_fn, params, batch, v)
    exact = dense_hessian(loss_fn, params, batch) @ param_dicts.flatten(v)
    assert float((param_dicts.flatten(fd.hvp) - exact).norm()) <= fd.error < 1e-6 * float(exact.norm())
    d = json.loads(json.dumps(fd.to_dict()))
    assert d["schema_version"] == 1 and "schema" not in d
    back = FiniteDifferenceHVP.from_dict(d)
    assert (back.step, back.error, back.norm) == (fd.step, fd.error, fd.norm) and back.hvp == {}
    old = {("schema" if k == "schema_version" else k): x for k, x in d.items()}  # the key before it was renamed
    assert FiniteDifferenceHVP.from_dict(old).error == fd.error
    for bad in ({**d, "schema_version": 2}, {**old, "schema": 2}):
        with pytest.raises(CurvlabError, match="finite-difference record schema 2 is not 1"):
            FiniteDifferenceHVP.from_dict(bad)


@pytest.mark.parametrize("problem", PROBLEMS)
@pytest.mark.parametrize("method", ["rev_rev", "fwd_rev"])
@pytest.mark.parametrize("order", ["network", "reversed", "shuffled"])
def test_interactions_equal_whole_hvps_and_the_dense_hessian_in_any_order(problem, method, order, request):
    """R[l, m] = <Z_l, H Z_m> from the triangle (each part's second backward on its own and the later
    parts' parameters) equals both the same matrix from whole HVPs at the point (the path it replaces)
    and the dense float64 Hessian's blocks, whichever order the parts come in."""
    loss_fn, params, batch = request.getfixturevalue(problem)
    H = dense_hessian(loss_fn, params, batch)
    z = random_direction(params, 7)
    names = list(params)
    if order == "reversed":
        names = names[::-1]
    elif order == "shuffled":
        names = [names[i] for i in torch.randperm(len(names), generator=torch.Generator().manual_seed(0))]
    cuts = [names[i : i + 2] for i in range(0, len(names), 2)]  # parts of two tensors each
    parts = [{n: z[n] for n in cut} for cut in cuts]
    padded = [param_dicts.flatten({n: part.get(n, torch.zeros_like(t)) for n, t in params.items()}) for part in parts]
    dense = torch.stack([torch.stack([u @ H @ v for v in padded]) for u in padded])
    with CurvaturePoint(loss_fn, params, batch, method=method) as point:
        R = point.interactions(parts)
        whole = point.hvp_each(parts)
        replaced = torch.tensor(
            [[param_dicts.dot(parts[l], whole[m], cuts[l]) for m in range(len(parts))] for l in range(len(parts))],
            dtype=torch.float64,
        )
        if method == "rev_rev":  # the triangle, and its transpose
            assert torch.equal(R, R.T)
        assert rel_err(R.flatten(), R.T.flatten()) <= 1e-12
        assert rel_err(R.flatten(), dense.flatten()) <= 1e-10
        assert rel_err(R.flatten(), replaced.flatten()) <= 1e-12
        assert float(point.interactions([z])[0, 0]) == pytest.approx(
            float(param_dicts.flatten(z) @ H @ param_dicts.flatten(z)), rel=1e-10
        )
        assert R.sum() == pytest.approx(float(param_dicts.flatten(z) @ H @ param_dicts.flatten(z)), rel=1e-10)


def test_dot_table_is_the_float64_sum_piece_by_piece():
    """Inner products taken piece by piece, each tensor converted once per piece however many pairs hold
    it, against math.fsum of the products (a float32 product is exact in float64, so that reference is the
    correctly rounded sum): several pieces and a ragged last one, a transposed view, an empty tensor,
    float64 entries, and the sums over a subset of the keys. The bound is a float64 sum's in any order,
    gamma_n = n u / (1 - n u) of the sum of |products| (Higham, Accuracy and Stability of Numerical Algorithms,
    section 3.1), with n the longest chain of additions: one piece's, then the pieces'; a float32 sum, or a
    piece lost or counted twice, is orders of magnitude outside it."""
    g = torch.Generator().manual_seed(0)
    a = {
        "big": torch.randn(3 * param_dicts.PIECE + 17, generator=g),
        "view": torch.randn(40, 30, generator=g).T,
        "empty": torch.zeros(0),
        "f64": torch.randn(7, generator=g, dtype=torch.float64),
    }
    b = {k: torch.randn(t.shape, generator=g, dtype=t.dtype) for k, t in a.items()}
    pairs = [(a, b), (a, a), (b, b)]
    table = param_dicts.dot_table(pairs, list(a))
    assert table.shape == (4, 3) and table.dtype == torch.float64
    for i, k in enumerate(a):
        for j, (x, y) in enumerate(pairs):
            products = [p * q for p, q in zip(x[k].double().flatten().tolist(), y[k].double().flatten().tolist())]
            exact, scale = math.fsum(products), math.fsum(abs(t) for t in products)
            n = min(x[k].numel(), param_dicts.PIECE) + -(-x[k].numel() // param_dicts.PIECE)
            gamma = n * 2.0**-53 / (1 - n * 2.0**-53)
            assert abs(float(table[i, j]) - exact) <= gamma * scale
    keys = ["big", "f64"]  # sums over a subset of the keys, against the exact sum of those keys' products
    for total, (x, y) in zip(param_dicts.dots(pairs, keys), pairs):
        products = [
            p * q for k in keys for p, q in zip(x[k].double().flatten().tolist(), y[k].double().flatten().tolist())
        ]
        n = param_dicts.PIECE + 4 + len(keys)
        assert abs(total - math.fsum(products)) <= n * 2.0**-53 / (1 - n * 2.0**-53) * math.fsum(map(abs, products))
    assert param_dicts.dots(pairs, []) == [0.0, 0.0, 0.0]


def test_interactions_name_a_non_finite_part_or_row(transformer_problem):
    """Their finiteness checks come from the float64 dots the matrix takes anyway: a NaN in a part, or a
    Hessian row that is not finite, is still refused by name."""
    loss_fn, params, batch = transformer_problem
    z = random_direction(params)
    names = list(z)
    with CurvaturePoint(loss_fn, params, batch) as point:
        bad = {**{n: z[n] for n in names[2:]}, names[-1]: torch.full_like(z[names[-1]], float("nan"))}
        with pytest.raises(CurvlabError, match=f"directions\\[{names[-1]!r}\\] holds non-finite"):
            point.interactions([{n: z[n] for n in names[:2]}, bad])

    def cusp(p, b):  # |w|^1.5 at w = 0: finite loss and gradient, an infinite second derivative
        return p["w"].abs().pow(1.5).sum() + (p["u"] ** 2).sum()

    at = {"w": torch.zeros(3, dtype=torch.float64), "u": torch.ones(2, dtype=torch.float64)}
    with CurvaturePoint(cusp, at, None) as point, pytest.raises(CurvlabError, match="not finite .* in 'w'"):
        point.interactions([{"w": torch.ones(3, dtype=torch.float64)}, {"u": torch.ones(2, dtype=torch.float64)}])


@pytest.mark.parametrize("method", METHODS)
def test_a_non_finite_direction_of_one_hvp_is_named_wherever_it_is(transformer_problem, method):
    """One HVP by double backward checks its direction's finiteness with its product's, after it (one
    synchronization): a NaN or an inf is still named, in a part the loss reaches and in one it doesn't."""
    loss_fn, params, batch = transformer_problem
    v = random_direction(params)
    names = list(v)
    with CurvaturePoint(loss_fn, params, batch, method=method) as point:
        for name, bad in ((names[0], float("nan")), (names[-1], float("inf"))):
            poisoned = {**v, name: v[name].clone().view(-1).index_fill_(0, torch.tensor([1]), bad).view_as(v[name])}
            match = f"directions?\\[{name!r}\\] holds non-finite"
            with pytest.raises(CurvlabError, match=match):
                point.hvp(poisoned)
            with pytest.raises(CurvlabError, match=match):
                hvp(loss_fn, params, batch, poisoned, method=method)
            with pytest.raises(CurvlabError, match=match):
                point.hvp({name: poisoned[name]})

    def half_used(p, b):  # u is not in the loss: its row of H is zero, and H[v] can't carry its NaN
        return (p["w"] ** 2).sum()

    at = {"w": torch.ones(3, dtype=torch.float64), "u": torch.ones(2, dtype=torch.float64)}
    bad = {"w": torch.ones(3, dtype=torch.float64), "u": torch.tensor([1.0, math.nan], dtype=torch.float64)}
    with pytest.raises(CurvlabError, match="directions?\\['u'\\] holds non-finite"):
        hvp(half_used, at, None, bad, method=method)


class _HalfSquare(torch.autograd.Function):
    """½‖w‖², whose backward hands out w itself as a view: double backward then returns its grad output."""

    @staticmethod
    def forward(ctx, w):
        ctx.save_for_backward(w)
        return 0.5 * (w * w).sum()

    @staticmethod
    def backward(ctx, grad):
        (w,) = ctx.saved_tensors
        return w.view_as(w) if float(grad) == 1.0 else grad * w


def test_an_hvp_never_shares_memory_with_its_direction():
    """Where autograd passes a direction through as the row (a gradient that is a view of its leaf), the
    engine's result is still a tensor of its own: changing the direction after leaves H[v] = v as it was."""
    params = {"w": torch.randn(5, dtype=torch.float64)}
    v = {"w": torch.randn(5, dtype=torch.float64)}
    with CurvaturePoint(lambda p, b: _HalfSquare.apply(p["w"]), params, None) as point:
        hv = point.hvp(v)["w"]
        expected = v["w"].clone()
        assert torch.equal(hv, expected)  # H = I
        v["w"].add_(1.0)
        assert torch.equal(hv, expected)


@pytest.mark.parametrize("method", METHODS)
def test_hvp_rows_are_tensors_of_their_own(method):
    """Autograd hands one gradient to both inputs of an addition as the same tensor, and a sum's gradient as
    an expanded view (stride 0): the engine's rows are still each on their own writable memory. Against
    the closed forms H = [[I, I], [I, I]] of 1/2 ||w1 + w2||^2 and H = 1 1^T of 1/2 (sum w)^2."""
    params = {"w1": torch.randn(4, dtype=torch.float64), "w2": torch.randn(4, dtype=torch.float64)}
    v = {n: torch.randn(4, dtype=torch.float64) for n in params}
    with CurvaturePoint(lambda p, b: 0.5 * ((p["w1"] + p["w2"]) ** 2).sum(), params, None, method=method) as point:
        hv = point.hvp(v)
    expected = v["w1"] + v["w2"]
    assert torch.equal(hv["w1"], expected) and torch.equal(hv["w2"], expected)
    hv["w1"].mul_(2.0)
    assert torch.equal(hv["w2"], expected)
    w = {"w": torch.randn(5, dtype=torch.float64)}
    u = {"w": torch.randn(5, dtype=torch.float64)}
    with CurvaturePoint(lambda p, b: 0.5 * p["w"].sum() ** 2, w, None, method=method) as point:
        row = point.hvp(u)["w"]
    assert torch.allclose(row, u["w"].sum().expand(5), rtol=1e-15, atol=0)
    row.add_(torch.arange(5.0, dtype=torch.float64))  # (raises on an expanded view)
    assert torch.allclose(row, u["w"].sum() + torch.arange(5.0, dtype=torch.float64), rtol=1e-15, atol=0)


def test_interactions_refuse_overlapping_or_no_parts(transformer_problem):
    loss_fn, params, batch = transformer_problem
    z = random_direction(params)
    with CurvaturePoint(loss_fn, params, batch) as point:
        for bad in ([], [z, {next(iter(z)): z[next(iter(z))]}]):
            with pytest.raises(CurvlabError, match="disjoint"):
                point.interactions(bad)
