import itertools
import math

import numpy as np
import pytest
import torch

from curvlab import CurvaturePoint, block_matrix, group_parameters, hidden_matrices, taylor_split
from curvlab.engine import params as param_dicts
from tests.builders import random_direction
from tests.reference import MLP, dense_gradient, dense_hessian, deterministic


def quadratic_problem(seed=0):
    """L(w) = ½ wᵀAw - bᵀw over two tensors ("hidden" 3x2 matrix, "head" 4-vector): closed forms known."""
    g = torch.Generator().manual_seed(seed)
    n = 10
    Q = torch.randn(n, n, generator=g, dtype=torch.float64)
    A = Q @ Q.T / n + 0.1 * torch.eye(n, dtype=torch.float64)
    b = torch.randn(n, generator=g, dtype=torch.float64)
    params = {
        "layer.0.w": torch.randn(3, 2, generator=g, dtype=torch.float64),
        "head.bias": torch.randn(4, generator=g, dtype=torch.float64),
    }

    def loss_fn(p, batch):
        w = torch.cat([p["layer.0.w"].reshape(-1), p["head.bias"]])
        return 0.5 * w @ A @ w - b @ w

    return loss_fn, params, A, b


def test_taylor_split_on_a_quadratic_equals_closed_forms():
    loss_fn, params, A, b = quadratic_problem()
    z = random_direction(params, 3)
    w, zf = param_dicts.flatten(params), param_dicts.flatten(z)
    G = A @ w - b
    s = taylor_split(loss_fn, params, None, z)
    assert s.first_order == pytest.approx(float(G @ zf), rel=1e-12)
    assert s.curvature_penalty == pytest.approx(float(0.5 * zf @ A @ zf), rel=1e-12)
    assert s.nds == pytest.approx(float(zf @ A @ zf / (zf @ zf)), rel=1e-12)
    assert s.realized == pytest.approx(s.predicted, rel=1e-10)  # a quadratic's Taylor series is exact
    assert s.update_norm == pytest.approx(float(zf.norm()), rel=1e-12)
    assert s.grad_norm == pytest.approx(float(G.norm()), rel=1e-12)
    assert s.cosine == pytest.approx(float(G @ zf / (G.norm() * zf.norm())), rel=1e-12)
    # the hidden scope defaults to the hidden 2-D matrices: here "layer.0.w", the first 6 coordinates
    assert s.hidden_names == ("layer.0.w",)
    zs = torch.cat([zf[:6], torch.zeros(4, dtype=torch.float64)])
    assert s.hidden.nds == pytest.approx(float(zs @ A @ zs / (zs @ zs)), rel=1e-12)
    assert s.hidden.first_order == pytest.approx(float(G @ zs), rel=1e-12)
    assert s.hidden.realized == pytest.approx(float(G @ zs - 0.5 * zs @ A @ zs), rel=1e-10)


def test_block_matrix_on_a_quadratic_equals_closed_forms():
    loss_fn, params, A, _ = quadratic_problem()
    z = random_direction(params, 4)
    zf = param_dicts.flatten(z)
    for via, method in itertools.product(("hvp", "alpha"), ("rev_rev", "fwd_rev")):
        bm = block_matrix(loss_fn, params, None, z, blocks="tensor", block_method=via, method=method)
        z1 = torch.cat([zf[:6], torch.zeros(4, dtype=torch.float64)])
        z2 = zf - z1
        expected = np.array([[z1 @ A @ z1, z1 @ A @ z2], [z2 @ A @ z1, z2 @ A @ z2]]) / float(zf @ zf)
        np.testing.assert_allclose(bm.matrix, expected, rtol=1e-12)
        assert bm.nds == pytest.approx(float(zf @ A @ zf / (zf @ zf)), rel=1e-12)


@pytest.mark.parametrize("via", ["hvp", "alpha"])
@pytest.mark.parametrize("method", ["rev_rev", "fwd_rev"])
@pytest.mark.parametrize("grouping", ["layer", "kind"])
def test_block_matrix_equals_dense_hessian_blocks(transformer_problem, via, method, grouping):
    loss_fn, params, batch = transformer_problem
    z = random_direction(params, 5)
    H = dense_hessian(loss_fn, params, batch)
    bm = block_matrix(loss_fn, params, batch, z, blocks=grouping, block_method=via, method=method, chunk_size=3)
    zf = param_dicts.flatten(z)
    members = group_parameters(
        params, blocks=grouping, model=loss_fn.model
    )  # the structural grouping block_matrix uses
    masks = [
        param_dicts.flatten({n: torch.full_like(t, float(n in set(b))) for n, t in params.items()})
        for b in members.values()
    ]
    expected = np.array([[float((zf * ml) @ H @ (zf * mm)) for mm in masks] for ml in masks]) / float(zf @ zf)
    np.testing.assert_allclose(bm.matrix, expected, rtol=1e-9, atol=1e-12 * np.abs(expected).max())
    assert np.allclose(bm.matrix, bm.matrix.T)
    assert bm.within + bm.cross == pytest.approx(bm.nds, rel=1e-12)
    assert bm.nds == pytest.approx(float(zf @ H @ zf / (zf @ zf)), rel=1e-9)
    assert bm.rho_within == pytest.approx(bm.within / bm.nds)
    if via == "hvp" and method == "rev_rev":  # the triangle by double backward, the rest by symmetry
        assert math.isnan(bm.asymmetry)
    else:
        assert bm.asymmetry < 1e-10
    g = dense_gradient(loss_fn, params, batch)
    np.testing.assert_allclose(bm.first_order, [float(g @ (zf * m)) for m in masks], rtol=1e-9, atol=1e-14)
    np.testing.assert_allclose(bm.norm, [float((zf * m).norm()) for m in masks], rtol=1e-12)


def test_per_tensor_blocks_sum_to_per_layer_blocks(transformer_problem):
    loss_fn, params, batch = transformer_problem
    z = random_direction(params, 6)
    per_tensor = block_matrix(loss_fn, params, batch, z, blocks="tensor")
    per_layer = block_matrix(loss_fn, params, batch, z, blocks="layer")
    layer_of = {
        n: b for b, names in group_parameters(params, blocks="layer", model=loss_fn.model).items() for n in names
    }
    idx = [per_layer.names.index(layer_of[n]) for n in per_tensor.names]
    S = np.zeros((len(per_layer.names), len(per_tensor.names)))
    S[idx, np.arange(len(idx))] = 1.0
    np.testing.assert_allclose(S @ per_tensor.matrix @ S.T, per_layer.matrix, rtol=1e-9, atol=1e-14)


def test_block_matrix_sums_to_the_taylor_nds(transformer_problem):
    loss_fn, params, batch = transformer_problem
    z = random_direction(params, 7)
    s = taylor_split(loss_fn, params, batch, z)
    bm = block_matrix(loss_fn, params, batch, z)
    assert bm.nds == pytest.approx(s.nds, rel=1e-10)
    assert float(bm.first_order.sum()) == pytest.approx(s.first_order, rel=1e-10)


def test_taylor_remainder_shrinks_like_the_cube_of_the_step(transformer_problem):
    loss_fn, params, batch = transformer_problem
    z = param_dicts.scale(random_direction(params, 8), 0.01)
    remainders = []
    for c in (1.0, 0.5, 0.25):
        s = taylor_split(loss_fn, params, batch, param_dicts.scale(z, c), scope=None)
        remainders.append(abs(s.realized - s.predicted))
    for big, small in itertools.pairwise(remainders):
        assert 6.5 < big / small < 9.5
    small_step = taylor_split(loss_fn, params, batch, param_dicts.scale(z, 0.1), scope=None)
    assert small_step.realized == pytest.approx(small_step.predicted, rel=1e-3)
    L0 = float(deterministic(loss_fn)(params, batch))
    assert small_step.loss == pytest.approx(L0, rel=1e-12)


def test_taylor_split_in_float32_agrees_with_float64():
    torch.manual_seed(0)
    model = MLP()
    from curvlab import make_loss_fn

    loss_fn = make_loss_fn(model, criterion=torch.nn.functional.cross_entropy)
    params = {k: v.detach() for k, v in model.named_parameters()}
    batch = (torch.randn(32, 5), torch.randint(0, 3, (32,)))
    z = param_dicts.scale(random_direction(params, 9), 0.01)
    s32 = taylor_split(loss_fn, params, batch, z)
    s64 = taylor_split(loss_fn, params, batch, z, dtype=torch.float64)
    assert s32.nds == pytest.approx(s64.nds, rel=1e-4)
    assert s32.first_order == pytest.approx(s64.first_order, rel=1e-4)


@pytest.mark.parametrize("problem", ["mlp_problem", "transformer_problem"])
@pytest.mark.parametrize("method", ["rev_rev", "fwd_rev"])
def test_taylor_split_of_both_scopes_equals_the_dense_hessian(problem, method, request):
    """Both scopes of the split (S's second backward on every parameter, then the rest's on the rest alone,
    and the first-order sums of both from one float64 table) equal the dense float64 Hessian, the dense
    gradient and the losses evaluated directly, on the models of tests/test_hvp.py."""
    loss_fn, params, batch = request.getfixturevalue(problem)
    H, G = dense_hessian(loss_fn, params, batch), dense_gradient(loss_fn, params, batch)
    z = param_dicts.scale(random_direction(params, 3), 1e-2)
    names = list(params)[1::2]  # every other tensor: a scope that is neither a layer nor a kind
    zs = param_dicts.flatten(param_dicts.restrict(z, names))
    zf = param_dicts.flatten(z)
    s = taylor_split(loss_fn, params, batch, z, scope=names, method=method)
    assert s.nds == pytest.approx(float(zf @ H @ zf / (zf @ zf)), rel=1e-10)
    assert s.hidden.nds == pytest.approx(float(zs @ H @ zs / (zs @ zs)), rel=1e-10)
    for scope, v in ((s, zf), (s.hidden, zs)):
        assert scope.first_order == pytest.approx(float(G @ v), rel=1e-12)
        assert scope.update_norm == pytest.approx(float(v.norm()), rel=1e-12)
        assert scope.curvature_penalty == pytest.approx(0.5 * float(v @ H @ v), rel=1e-10)
    assert s.grad_norm == pytest.approx(float(G.norm()), rel=1e-12)
    inside = param_dicts.flatten({n: torch.full_like(t, float(n in names)) for n, t in params.items()}).bool()
    assert s.hidden.grad_norm == pytest.approx(float(G[inside].norm()), rel=1e-12)
    plain = deterministic(loss_fn)
    loss = plain(params, batch)
    assert s.realized == pytest.approx(float(loss - plain(param_dicts.add(params, z, -1.0), batch)), rel=1e-9)
    stepped = param_dicts.add(params, param_dicts.restrict(z, names), -1.0)
    assert s.hidden.realized == pytest.approx(float(loss - plain(stepped, batch)), rel=1e-9)


def test_taylor_split_takes_s_on_every_parameter_then_the_rest_on_the_rest(transformer_problem, monkeypatch):
    """The order the split's cost rests on (docs/benchmarks.md): S's second backward with respect to every
    parameter, then the rest's with respect to the rest alone; the values are the dense test's above."""
    loss_fn, params, batch = transformer_problem
    calls = []
    original = CurvaturePoint._hvps_rev_rev

    def spy(self, vs, wrt=None):
        calls.append((list(vs), None if wrt is None else list(wrt)))
        return original(self, vs, wrt)

    monkeypatch.setattr(CurvaturePoint, "_hvps_rev_rev", spy)
    names = list(params)[1::2]
    rest = [n for n in params if n not in names]
    taylor_split(loss_fn, params, batch, random_direction(params), scope=names)
    assert calls == [(names, names + rest), (rest, rest)]


def test_a_direction_too_large_for_its_working_dtype_is_named(transformer_problem):
    """A float64 direction whose entries overflow once cast to float32 is refused by name, and one whose
    squared norm overflows float64 itself is refused too (neither passes silently as inf)."""
    loss_fn, params, batch = transformer_problem
    z = random_direction(params)
    big = {**z, "lm_head.weight": torch.full_like(z["lm_head.weight"], 1e300)}
    with pytest.raises(ValueError, match=r"\['lm_head\.weight'\] holds values beyond the range of torch\.float32"):
        taylor_split(loss_fn, params, batch, big, dtype=torch.float32)
    with pytest.raises(ValueError, match="squared norm overflows float64"):
        taylor_split(loss_fn, params, batch, big)


def test_bad_directions_and_blocks(transformer_problem):
    loss_fn, params, batch = transformer_problem
    z = random_direction(params)
    with pytest.raises(ValueError, match="zero"):
        taylor_split(loss_fn, params, batch, param_dicts.zeros_like(params))
    with pytest.raises(ValueError, match="zero"):
        block_matrix(loss_fn, params, batch, param_dicts.zeros_like(params))
    nan = {**z, "lm_head.weight": torch.full_like(z["lm_head.weight"], float("nan"))}
    with pytest.raises(ValueError, match="non-finite"):
        taylor_split(loss_fn, params, batch, nan)
    with pytest.raises(ValueError, match=r"missing 'lm_head\.weight'"):
        block_matrix(loss_fn, params, batch, {k: v for k, v in z.items() if k != "lm_head.weight"})
    with pytest.raises(ValueError, match="leave parameters out"):
        block_matrix(loss_fn, params, batch, z, blocks={"attn": ["h.*.attn_*"]})
    with pytest.raises(ValueError, match="claimed by two blocks"):
        block_matrix(loss_fn, params, batch, z, blocks={"all": ["*"], "head": ["lm_head.*"]})
    with pytest.raises(ValueError, match="unknown block grouping"):
        block_matrix(loss_fn, params, batch, z, blocks="row")
    with pytest.raises(ValueError, match="unknown block method"):
        block_matrix(loss_fn, params, batch, z, block_method="dense")
    with pytest.raises(ValueError, match="unknown HVP method"):
        block_matrix(loss_fn, params, batch, z, method="dense")


def test_groupings_read_names():
    names = [
        "transformer.wte.weight",
        "transformer.wpe.weight",
        "transformer.h.0.ln_1.weight",
        "transformer.h.0.attn.c_q.weight",
        "transformer.h.0.attn.c_proj.weight",
        "transformer.h.0.mlp.c_fc.weight",
        "transformer.h.0.mlp.c_proj.weight",
        "transformer.h.10.attn.c_k.weight",
        "transformer.ln_f.weight",
        "lm_head.weight",
    ]
    layer = group_parameters(names, blocks="layer")
    assert list(layer) == ["embedding", "layer0", "layer10", "final_norm", "head"]
    kind = {n: b for b, ns in group_parameters(names, blocks="kind").items() for n in ns}
    assert kind["transformer.h.0.attn.c_proj.weight"] == "attn_o"
    assert kind["transformer.h.0.mlp.c_proj.weight"] == "mlp_out"
    assert kind["transformer.h.10.attn.c_k.weight"] == "attn_k"
    assert kind["transformer.h.0.ln_1.weight"] == "norm"
    assert kind["lm_head.weight"] == "head"
    assert group_parameters(["fc1.weight", "fc1.bias", "fc2.weight"], blocks="layer") == {
        "fc1": ["fc1.weight", "fc1.bias"],
        "fc2": ["fc2.weight"],
    }
    shapes = {n: torch.zeros(2, 2) if n.endswith("weight") and "ln" not in n else torch.zeros(2) for n in names}
    assert "transformer.wte.weight" not in hidden_matrices(shapes)
    assert "transformer.h.0.attn.c_q.weight" in hidden_matrices(shapes)
    with pytest.raises(ValueError, match="matches no parameter"):
        group_parameters(names, blocks={"x": ["nothing*"], "rest": ["*"]})


def test_combined_call_equals_the_separate_ones(transformer_problem):
    from curvlab.curvature.taylor import taylor_split_and_block_matrix

    loss_fn, params, batch = transformer_problem
    z = random_direction(params, 11)
    split, bm = taylor_split_and_block_matrix(loss_fn, params, batch, z, blocks="kind", chunk_size=4)
    alone = taylor_split(loss_fn, params, batch, z)
    for key in (
        "first_order",
        "curvature_penalty",
        "predicted",
        "realized",
        "nds",
        "update_norm",
        "grad_norm",
        "cosine",
    ):
        assert getattr(split, key) == pytest.approx(getattr(alone, key), rel=1e-10)
        assert getattr(split.hidden, key) == pytest.approx(getattr(alone.hidden, key), rel=1e-10)
    np.testing.assert_allclose(
        bm.matrix, block_matrix(loss_fn, params, batch, z, blocks="kind").matrix, rtol=1e-10, atol=1e-14
    )
    assert bm.nds == pytest.approx(split.nds, rel=1e-10)
