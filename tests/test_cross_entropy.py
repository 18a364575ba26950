"""The cross-entropy whose second backward is in closed form (curvlab.engine._cross_entropy) against torch's
own ``F.cross_entropy``: the loss and gradient bit for bit, the second backward against dense float64
Hessians from torch's double-backward rows, and every case it doesn't cover handed to torch."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch.func import grad, jvp, vmap

from curvlab import block_matrix, exact_second_order, hvps, taylor_split
from curvlab.engine import _cross_entropy, exact
from curvlab.engine import params as param_dicts
from curvlab.engine._cross_entropy import closed_form_cross_entropy
from tests.builders import random_direction

CLOSED_FORM = "_CrossEntropyBackward"
# a second backward in closed form is a handful of roundings in its dtype; a third derivative a few more
HVP_ROUNDING, THIRD_ROUNDING = 4, 16  # (units of the dtype's machine epsilon)
CLASSES = 5
# a label outside the classes, one of them, and past them: torch ignores each wherever it stands
IGNORE_INDICES = [-100, 3, CLASSES + 2]


@pytest.fixture(autouse=True)
def closed_form_at_any_size(monkeypatch):
    """The closed form at every size: these tests' logits (7 x 5, a small model's) are below the size where
    it is taken for speed (test_small_logits_keep_torchs_own_second_backward)."""
    monkeypatch.setattr(_cross_entropy, "SMALLEST", 0)


def logits_and_targets(dtype, ignore_index=-100, n=7):
    g = torch.Generator().manual_seed(3)
    x = (3 * torch.randn(n, CLASSES, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
    t = torch.randint(0, CLASSES, (n,), generator=g)
    t[2] = ignore_index  # an ignored position: outside the loss and its derivatives
    return x, t


def seeded(like, seed, requires_grad=False):
    v = torch.randn(like.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return v.to(like.dtype).requires_grad_(requires_grad)


def relative_error(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def torch_hessian(x, t, reduction, scale, ignore_index):
    """Rows of torch's own double backward of ``scale * F.cross_entropy`` in float64."""
    x64 = x.detach().double().requires_grad_()
    loss = scale * F.cross_entropy(x64, t, reduction=reduction, ignore_index=ignore_index)
    (g,) = torch.autograd.grad(loss, x64, create_graph=True)
    eye = torch.eye(x64.numel(), dtype=torch.float64).view(-1, *x64.shape)
    return torch.stack([torch.autograd.grad(g, x64, e, retain_graph=True)[0].flatten() for e in eye])


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ignore_index", IGNORE_INDICES)
def test_loss_and_gradient_are_torchs_bit_for_bit_and_the_second_backward_its_hessian(reduction, dtype, ignore_index):
    x, t = logits_and_targets(dtype, ignore_index)
    kw = {"reduction": reduction, "ignore_index": ignore_index}
    scale = 1.7  # the loss's incoming gradient, as a weighted batch's
    ours, theirs = closed_form_cross_entropy(x, t, **kw), F.cross_entropy(x, t, **kw)
    assert type(ours.grad_fn).__name__ == CLOSED_FORM
    assert torch.equal(ours, theirs)
    (g_ours,) = torch.autograd.grad(scale * ours, x, create_graph=True)
    (g_theirs,) = torch.autograd.grad(scale * theirs, x)
    assert torch.equal(g_ours, g_theirs)

    H = torch_hessian(x, t, reduction, scale, ignore_index)
    assert H[2 * CLASSES : 3 * CLASSES].abs().max() == 0  # (the ignored row)
    v = seeded(x, 5)
    (hv,) = torch.autograd.grad(g_ours, x, v)
    assert hv.dtype == dtype
    assert relative_error(hv.flatten(), H @ v.double().flatten()) <= HVP_ROUNDING * torch.finfo(dtype).eps


@pytest.mark.parametrize("ignore_index", IGNORE_INDICES)
def test_the_incoming_gradient_and_a_third_derivative_are_torchs(ignore_index):
    x, t = logits_and_targets(torch.float64, ignore_index)
    w = torch.tensor(0.8, dtype=torch.float64, requires_grad=True)
    v, u = seeded(x, 5, requires_grad=True), seeded(x, 6)
    second, third = [], []
    for ce in (closed_form_cross_entropy, F.cross_entropy):
        (g,) = torch.autograd.grad(w * ce(x, t, ignore_index=ignore_index), x, create_graph=True)
        (hv, dw) = torch.autograd.grad(g, (x, w), v, create_graph=True)
        second.append((hv, dw))
        third.append(torch.autograd.grad((u * hv).sum(), (x, w, v)))
    for ours, theirs in (*zip(*second), *zip(*third)):
        assert relative_error(ours, theirs) <= THIRD_ROUNDING * torch.finfo(torch.float64).eps


def test_every_label_ignored_gives_torchs_zero_curvature():
    x, t = logits_and_targets(torch.float64)
    t[:] = -100
    rows = []
    for ce in (closed_form_cross_entropy, F.cross_entropy):
        loss = ce(x, t)
        assert loss.isnan()  # (a mean over no terms)
        (g,) = torch.autograd.grad(loss, x, create_graph=True)
        rows.append(torch.autograd.grad(g, x, seeded(x, 5))[0])
    assert torch.equal(rows[0], rows[1])
    assert torch.equal(rows[0], torch.zeros_like(x))


def test_repeated_second_backwards_agree_and_the_incoming_gradient_is_its_own():
    x, t = logits_and_targets(torch.float64)
    incoming = torch.tensor(1.7, dtype=torch.float64)
    (g,) = torch.autograd.grad(closed_form_cross_entropy(x, t), x, incoming, create_graph=True)
    incoming.mul_(2)  # (the caller's tensor, changed after the first backward: the graph kept its value)
    v = seeded(x, 5)
    first = torch.autograd.grad(g, x, v, retain_graph=True)[0]
    again = torch.autograd.grad(g, x, v)[0]
    assert torch.equal(first, again)
    H = torch_hessian(x, t, "mean", 1.7, -100)
    assert relative_error(first.flatten(), H @ v.flatten()) <= HVP_ROUNDING * torch.finfo(torch.float64).eps


@pytest.fixture
def closed_form_forbidden(monkeypatch):
    """The closed form's Function fails the test if it is entered (a call under no grad shows no node)."""

    def entered(*args):
        raise AssertionError("the closed form was taken for a call it does not cover")

    monkeypatch.setattr(_cross_entropy._CrossEntropy, "apply", entered)


@pytest.mark.parametrize(
    "case", ["label_smoothing", "class_weights", "no_reduction", "spatial", "probabilities", "no_grad"]
)
def test_every_call_it_does_not_cover_is_torchs_own(case, closed_form_forbidden):
    x, t = logits_and_targets(torch.float64)
    kwargs = {
        "label_smoothing": {"label_smoothing": 0.1},
        "class_weights": {"weight": torch.linspace(0.5, 2.0, CLASSES, dtype=torch.float64)},
        "no_reduction": {"reduction": "none"},
    }.get(case, {})
    if case == "spatial":
        x, t = x.detach().view(1, *x.shape).transpose(1, 2).requires_grad_(), t.view(1, -1)
    if case == "probabilities":
        t = torch.softmax(seeded(x, 7), -1)
    with torch.set_grad_enabled(case != "no_grad"):
        ours, theirs = closed_form_cross_entropy(x, t, **kwargs), F.cross_entropy(x, t, **kwargs)
    assert torch.equal(ours, theirs)


def _per_sample_gradients(ce, x, t):  # (the logits inside vmap: torch.func tensors)
    return vmap(grad(lambda xi, ti: ce(xi[None], ti[None])))(x.detach(), t.clamp(min=0))


def _over_targets(ce, x, t):  # (vmap over the targets alone: the logits are plain tensors under a transform)
    return vmap(lambda ti: ce(x, ti))(torch.stack([t, t.flip(0)]))


def _grad_of_a_scale(ce, x, t):  # (torch.func.grad of something else than the logits)
    return grad(lambda s: s * ce(x, t))(torch.tensor(2.0, dtype=torch.float64))


def _jvp(ce, x, t):
    return jvp(lambda y: ce(y, t), (x.detach(),), (seeded(x, 8),))


def _forward_ad(ce, x, t):
    with fwAD.dual_level():
        return fwAD.unpack_dual(ce(fwAD.make_dual(x.detach(), seeded(x, 8)), t))


def _autocast(ce, x, t):  # (autocast computes the loss in float32)
    with torch.autocast("cpu", torch.bfloat16):
        return ce(x.detach().bfloat16().requires_grad_(), t)


def _compiled_second_backward(ce, x, t):  # (traced by dynamo; the second backward must still run)
    (g,) = torch.autograd.grad(torch.compile(lambda y: ce(y, t), backend="eager")(x), x, create_graph=True)
    return torch.autograd.grad(g, x, seeded(x, 5))


@pytest.mark.parametrize(
    "run",
    [_per_sample_gradients, _over_targets, _grad_of_a_scale, _jvp, _forward_ad, _autocast, _compiled_second_backward],
)
def test_beyond_autograd_it_is_torchs_own(run, closed_form_forbidden):
    x, t = logits_and_targets(torch.float64)
    torch._dynamo.reset()
    ours, theirs = run(closed_form_cross_entropy, x, t), run(F.cross_entropy, x, t)
    ours, theirs = (ours, theirs) if isinstance(ours, (tuple, list)) else ((ours,), (theirs,))
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


@pytest.mark.parametrize("method", ["rev_rev", "fwd_rev", "fwd_fwd", None])
def test_only_double_backward_takes_the_closed_form(method):
    x, t = logits_and_targets(torch.float64)
    with exact_second_order(method=method):
        loss = F.cross_entropy(x, t)
    assert (type(loss.grad_fn).__name__ == CLOSED_FORM) == (method == "rev_rev")


def test_small_logits_keep_torchs_own_second_backward(monkeypatch):
    x, t = logits_and_targets(torch.float64)
    taken = []
    for smallest in (x.numel() + 1, x.numel()):  # (below the size, then at it)
        monkeypatch.setattr(_cross_entropy, "SMALLEST", smallest)
        with exact_second_order(method="rev_rev"):
            taken.append(type(F.cross_entropy(x, t).grad_fn).__name__ == CLOSED_FORM)
    assert taken == [False, True]


@pytest.fixture
def torch_double_backward(monkeypatch):
    """The exact mode as it was before the closed form: torch's own double backward of the cross-entropy."""

    def run(fn):
        with monkeypatch.context() as m:
            m.setitem(exact.REROUTES, "rev_rev", frozenset())
            return fn()

    return run


@pytest.mark.parametrize("problem", ["mlp_problem", "transformer_problem"])
def test_hvps_split_and_block_matrix_equal_torchs_double_backward(problem, request, monkeypatch, torch_double_backward):
    loss_fn, params, batch = request.getfixturevalue(problem)
    z = random_direction(params, 1)
    stacked = {k: torch.stack([random_direction(params, s)[k] for s in (2, 3)]) for k in params}
    taken = []

    def spy(*args, **kwargs):
        out = closed_form_cross_entropy(*args, **kwargs)
        if torch.is_grad_enabled():  # (the losses at W - Z are forwards alone: torch's own)
            taken.append(type(out.grad_fn).__name__ == CLOSED_FORM)
        return out

    monkeypatch.setattr(exact, "closed_form_cross_entropy", spy)

    def everything():
        return (
            hvps(loss_fn, params, batch, stacked),
            taylor_split(loss_fn, params, batch, z),
            block_matrix(loss_fn, params, batch, z),
        )

    ours_hv, ours_split, ours_block = everything()
    assert taken and all(taken)
    theirs_hv, theirs_split, theirs_block = torch_double_backward(everything)
    # the loss and gradient are torch's bit for bit, so is everything of first order; the curvature is the
    # same to float64 rounding, with a sum's cancellation (measured: 2e-15 at most)
    rounding = 1e-14
    assert (param_dicts.flatten(ours_hv) - param_dicts.flatten(theirs_hv)).norm() <= rounding * param_dicts.flatten(
        theirs_hv
    ).norm()
    for a, b in ((ours_split, theirs_split), (ours_split.hidden, theirs_split.hidden)):
        for field in ("first_order", "realized", "update_norm", "grad_norm"):
            assert getattr(a, field) == getattr(b, field)
        for field in ("curvature_penalty", "nds"):
            assert getattr(a, field) == pytest.approx(getattr(b, field), rel=rounding, abs=0)
    assert abs(ours_block.matrix - theirs_block.matrix).max() <= rounding * abs(theirs_block.matrix).max()
