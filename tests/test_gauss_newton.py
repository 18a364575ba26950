"""The Gauss–Newton split (curvlab.curvature.gauss_newton) against dense float64 references: J by reverse-mode
rows, the loss's output Hessian by double backward in the outputs (not the closed forms), and models whose
Hessian is its Gauss–Newton part (the outputs linear in W)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from curvlab.curvature.gauss_newton import cross_entropy_form, gauss_newton_form, gauss_newton_split
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


def test_cross_entropy_form_keeps_its_digits_under_a_common_logit_shift():
    """Softmax ignores a tangent's common shift per position: the form must too, in float32 (E[v²] - E[v]²
    would cancel to nothing, or below zero, at a shift of 1e3)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=g, dtype=torch.float64)
    v = 1e-2 * torch.randn(64, 50, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 50, (64,), generator=g)
    form = cross_entropy_form()
    f = logits.float()
    p = torch.softmax(f.double(), -1)
    # at a shift s, float32 holds each entry to s * 6e-8 (6e-4 at 1e4, against the tangent's spread of 1e-2), and
    # removing the shift leaves that much: the form is good to (6e-4 / 1e-2)^2 ~ 4e-3 there, to 1e-4 up to 1e3
    for shift, rel in ((0.0, 1e-4), (1e2, 1e-4), (1e3, 1e-4), (1e4, 1e-2)):
        t = (v + shift).float()  # (the float32 tangent itself: its own rounding is not the form's)
        # the reference: the dense H_l = diag(p) - p pᵀ per row, mean over rows, in float64 on the same inputs
        w = t.double()
        dense = torch.stack([w[i] @ (torch.diag(p[i]) - torch.outer(p[i], p[i])) @ w[i] for i in range(64)]).mean()
        assert float(form(f, t, targets)) == pytest.approx(float(dense), rel=rel), shift


def test_module_cross_entropy_ignore_index_and_sequence_regression():
    """nn.CrossEntropyLoss(ignore_index=k) leaves class k's targets out, as the loss does; a Hugging Face sequence
    classifier with one label is regression (squared error), whose Gauss–Newton part is <Z, HZ> for a linear head."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 4)).double()
    x, y = torch.randn(10, 5, dtype=torch.float64), torch.randint(0, 4, (10,))
    params = params_of(model)
    z = direction(params)
    loss_fn = make_loss_fn(model, criterion=nn.CrossEntropyLoss(ignore_index=2))
    ref = dense_gauss_newton(
        lambda p: torch.func.functional_call(model, p, (x,)), lambda f: F.cross_entropy(f, y, ignore_index=2), params, z
    )
    assert gauss_newton_form(loss_fn, params, (x, y), z) == pytest.approx(ref, rel=1e-11)
    import transformers  # (the dev extra's; tests/builders imports it too)

    config = transformers.BertConfig(vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=16, num_labels=1, max_position_embeddings=16)  # fmt: skip
    bert = transformers.BertForSequenceClassification(config).double().eval()
    ids, labels = torch.randint(0, 30, (3, 6)), torch.randn(3, dtype=torch.float64)
    bert_params = params_of(bert)
    bz = direction(bert_params)
    ref = dense_gauss_newton(
        lambda p: torch.func.functional_call(bert, p, (), {"input_ids": ids}).logits,
        lambda f: F.mse_loss(f.squeeze(), labels),
        {n: bert_params[n] for n in bert_params},
        bz,
    )
    got = gauss_newton_form(make_loss_fn(bert), bert_params, {"input_ids": ids, "labels": labels}, bz)
    assert got == pytest.approx(ref, rel=1e-9)
    config.num_labels, config.problem_type = 3, None
    multi = transformers.BertForSequenceClassification(config).double().eval()
    batch = {"input_ids": ids, "labels": torch.rand(3, 3, dtype=torch.float64)}
    with pytest.raises(CurvlabError, match="not a multi_label_classification model"):
        gauss_newton_form(make_loss_fn(multi), params_of(multi), batch, direction(params_of(multi)))
