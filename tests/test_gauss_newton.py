"""The Gauss–Newton split (curvlab.curvature.gauss_newton) against dense float64 references: J by reverse-mode
rows, the loss's output Hessian by double backward in the outputs (not the closed forms), and models whose
Hessian is its Gauss–Newton part (the outputs linear in W)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from curvlab.curvature.gauss_newton import gauss_newton_form, gauss_newton_split
from curvlab.engine import params as param_dicts
from curvlab.engine.loss import make_loss_fn
from curvlab.errors import CurvlabError
from curvlab.models.gpt import GPT, MICRO_OVERRIDES, get_config
from tests.builders import batch_for, tiny_gpt2
from tests.reference import dense_hessian


def params_of(model):
    return {n: p.detach() for n, p in model.named_parameters()}


def direction(params, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in params.items()}


def dense_gauss_newton(outputs, loss_of_outputs, params, z) -> float:
    """<Z, Jᵀ H_l J Z> with J by reverse-mode rows of the outputs and H_l by double backward of the loss in the
    outputs, both dense in float64."""
    flat = param_dicts.flatten(params).double().clone().requires_grad_()
    f = outputs(param_dicts.unflatten(flat, params))
    rows = [torch.autograd.grad(fi, flat, retain_graph=True)[0] for fi in f.reshape(-1)]
    J = torch.stack(rows)
    y = f.detach().reshape(-1).clone().requires_grad_()
    (g,) = torch.autograd.grad(loss_of_outputs(y.reshape(f.shape)), y, create_graph=True)
    H_l = torch.stack([torch.autograd.grad(gi, y, retain_graph=True)[0] for gi in g])
    jz = J @ param_dicts.flatten(z).double()
    return float(jz @ H_l @ jz)


def test_linear_models_are_their_gauss_newton_part():
    """Outputs linear in W: H = JᵀH_l J, so the residual is zero (softmax regression, least squares)."""
    torch.manual_seed(0)
    x = torch.randn(9, 5, dtype=torch.float64)
    for criterion, y in (
        (None, torch.randint(0, 4, (9,))),
        (nn.MSELoss(), torch.randn(9, 4, dtype=torch.float64)),
        (nn.MSELoss(reduction="sum"), torch.randn(9, 4, dtype=torch.float64)),
        (F.mse_loss, torch.randn(9, 4, dtype=torch.float64)),
    ):
        model = nn.Linear(5, 4).double()
        loss_fn = make_loss_fn(model, criterion=criterion)
        params = params_of(model)
        z = direction(params)
        split = gauss_newton_split(loss_fn, params, (x, y), z)
        zf = param_dicts.flatten(z)
        exact = float(zf @ dense_hessian(loss_fn, params, (x, y)) @ zf)
        assert split.zhz == pytest.approx(exact, rel=1e-12)
        assert split.gauss_newton == pytest.approx(exact, rel=1e-12)
        assert abs(split.residual) < 1e-12 * abs(exact)


def test_mlp_with_layer_norm_against_dense_reference():
    """A non-linear network (LayerNorm, tanh), cross-entropy with ignored labels: the Gauss–Newton part
    against dense JᵀH_l J, and the residual against the dense Hessian minus it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Tanh(), nn.Linear(7, 3)).double()
    x = torch.randn(8, 5, dtype=torch.float64)
    y = torch.randint(0, 3, (8,))
    y[[2, 5]] = -100
    loss_fn = make_loss_fn(model)
    params = params_of(model)
    z = direction(params)
    split = gauss_newton_split(loss_fn, params, (x, y), z)
    ref = dense_gauss_newton(
        lambda p: torch.func.functional_call(model, p, (x,)),
        lambda f: F.cross_entropy(f, y, ignore_index=-100),
        params,
        z,
    )
    zf = param_dicts.flatten(z)
    exact = float(zf @ dense_hessian(loss_fn, params, (x, y)) @ zf)
    assert split.gauss_newton == pytest.approx(ref, rel=1e-11)
    assert split.residual == pytest.approx(exact - ref, rel=1e-9, abs=1e-12)
    assert split.nds_gauss_newton == pytest.approx(ref / float(zf @ zf), rel=1e-11)
    assert abs(split.residual) > 1e-3 * abs(split.zhz)  # (a network with a residual worth splitting)


def test_causal_gpt_against_dense_reference_and_batches_by_loss_terms():
    """curvlab's GPT (causal shift, tied head) in float64: the split against the dense reference, and two
    batches weighted by their loss terms give the split of the one batch they make."""
    torch.manual_seed(0)
    model = GPT(get_config("tiny", **{**MICRO_OVERRIDES, "n_layer": 1, "n_embd": 16, "vocab_size": 24,
                                       "block_size": 6})).double()  # fmt: skip
    x, y = batch_for(model, seed=3, batch=3)
    y = y.clone()
    y[0, :4] = -100  # (uneven loss terms between the rows)
    loss_fn = make_loss_fn(model)
    params = params_of(model)
    z = direction(params)
    ref = dense_gauss_newton(
        lambda p: torch.func.functional_call(model, p, (x,)),
        lambda f: F.cross_entropy(f.reshape(-1, f.size(-1)), y.reshape(-1), ignore_index=-100),
        params,
        z,
    )
    whole = gauss_newton_form(loss_fn, params, (x, y), z)
    split = gauss_newton_form(loss_fn, params, [(x[:1], y[:1]), (x[1:], y[1:])], z)
    assert whole == pytest.approx(ref, rel=1e-10)
    assert split == pytest.approx(ref, rel=1e-10)


def test_hugging_face_gpt2_shifted_labels():
    """A Hugging Face GPT-2 (Conv1D, its own causal shift inside curvlab's loss): against the dense reference
    of the shifted cross-entropy."""
    torch.manual_seed(0)
    model = tiny_gpt2(vocab=20, positions=8, n_embd=8, n_layer=1).double().eval()
    ids = torch.randint(0, 20, (2, 6))
    loss_fn = make_loss_fn(model)
    params = params_of(model)
    z = direction(params)
    ref = dense_gauss_newton(
        lambda p: torch.func.functional_call(model, p, (), {"input_ids": ids}).logits,
        lambda f: F.cross_entropy(f[:, :-1].reshape(-1, 20), ids[:, 1:].reshape(-1)),
        params,
        z,
    )
    got = gauss_newton_form(loss_fn, params, {"input_ids": ids, "labels": ids}, z)
    assert got == pytest.approx(ref, rel=1e-9)


def test_negative_curvature_lives_in_the_residual():
    """Along many random directions of a tanh network the Gauss–Newton part is never negative, and where
    <Z, HZ> < 0 the residual is below it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    x, y = torch.randn(16, 4, dtype=torch.float64), torch.randint(0, 3, (16,))
    loss_fn = make_loss_fn(model)
    params = params_of(model)
    splits = [gauss_newton_split(loss_fn, params, (x, y), direction(params, seed)) for seed in range(40)]
    assert all(s.gauss_newton >= 0 for s in splits)
    negative = [s for s in splits if s.zhz < 0]
    assert negative, "the test needs directions of negative curvature"
    assert all(s.residual < s.zhz for s in negative)


def test_refusals():
    model = nn.Linear(3, 2).double()
    params = params_of(model)
    batch = (torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64))
    with pytest.raises(CurvlabError, match="ModuleLoss"):
        gauss_newton_form(lambda p, b: (p["weight"] ** 2).sum(), params, batch, direction(params))
    with pytest.raises(CurvlabError, match="not the criterion l1_loss"):
        gauss_newton_form(make_loss_fn(model, criterion=F.l1_loss), params, batch, direction(params))
    weighted = nn.CrossEntropyLoss(weight=torch.ones(2, dtype=torch.float64))
    with pytest.raises(CurvlabError, match="CrossEntropyLoss"):
        gauss_newton_form(make_loss_fn(model, criterion=weighted), params, (batch[0], torch.tensor([0, 1, 1, 0])),
                          direction(params))  # fmt: skip
    with pytest.raises(CurvlabError, match="zero"):
        gauss_newton_form(make_loss_fn(model), params, (batch[0], torch.tensor([0, 1, 1, 0])),
                          {n: torch.zeros_like(p) for n, p in params.items()})  # fmt: skip
