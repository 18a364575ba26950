"""Every norm layer under every way curvlab differentiates twice, against dense double-backward Hessians.

Each model puts one norm between two linear maps. The reference is float64 double backward through
torch.autograd on a copy of the model, outside curvlab (``tests/reference.py``). The last tests show
that each rerouting of the exact mode is needed where it is used, and not needed where it is not.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, jvp

from curvlab import CurvaturePoint, exact_second_order, forward_quadratic_form, hvp, make_loss_fn
from curvlab.engine import params as param_dicts
from tests.builders import random_direction
from tests.reference import dense_hessian


class NormNet(nn.Module):
    """``head(tanh(norm(lin(x))))`` on ``(N, L, 4)`` inputs; channel-first norms see ``(N, 4, L)``."""

    def __init__(self, norm: nn.Module, channels_first: bool):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = norm
        self.head = nn.Linear(4, 3)
        self.channels_first = channels_first

    def forward(self, x):
        h = self.lin(x)
        h = self.norm(h.transpose(1, 2)).transpose(1, 2) if self.channels_first else self.norm(h)
        return self.head(torch.tanh(h)).mean(1)


NORMS = {
    "layer_norm": lambda: (nn.LayerNorm(4), False),
    "layer_norm_plain": lambda: (nn.LayerNorm(4, elementwise_affine=False), False),
    "rms_norm": lambda: (nn.RMSNorm(4), False),
    "instance_norm": lambda: (nn.InstanceNorm1d(4), True),
    "instance_norm_affine": lambda: (nn.InstanceNorm1d(4, affine=True, track_running_stats=True), True),
    "batch_norm_train": lambda: (nn.BatchNorm1d(4), True),
    "batch_norm_eval": lambda: (nn.BatchNorm1d(4), True),
    "group_norm": lambda: (nn.GroupNorm(2, 4), True),
}


def norm_problem(name: str):
    torch.manual_seed(0)
    norm, channels_first = NORMS[name]()
    model = NormNet(norm, channels_first).double()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.startswith("norm."):
                p.add_(0.3 * torch.randn_like(p))  # the affine case is where bugs hide
        if name == "batch_norm_eval":
            model.norm.running_mean.normal_()
            model.norm.running_var.uniform_(0.5, 2.0)
    model.train(name != "batch_norm_eval")
    x, y = torch.randn(3, 5, 4, dtype=torch.float64), torch.randint(0, 3, (3,))
    params = {k: v.detach() for k, v in model.named_parameters()}
    return model, make_loss_fn(model, criterion=F.cross_entropy), params, (x, y)


def buffers_of(model):
    return {k: b.clone() for k, b in model.named_buffers()}


@pytest.mark.parametrize("name", list(NORMS))
def test_every_path_is_exact_through_every_norm_and_leaves_the_model_alone(name):
    model, loss_fn, params, batch = norm_problem(name)
    before = buffers_of(model)
    reference_model = copy.deepcopy(model)  # the reference may update its own running statistics
    H = dense_hessian(make_loss_fn(reference_model, criterion=F.cross_entropy), params, batch)
    v = random_direction(params, 3)
    exact = H @ param_dicts.flatten(v)
    for method in ("rev_rev", "fwd_rev"):
        got = param_dicts.flatten(hvp(loss_fn, params, batch, v, method=method))
        assert (got - exact).norm() <= 1e-12 * exact.norm(), method
    _, zhz = forward_quadratic_form(loss_fn, params, batch, v)
    assert zhz == pytest.approx(float(param_dicts.flatten(v) @ exact), rel=1e-10)
    with CurvaturePoint(loss_fn, params, batch, method="rev_rev") as point:  # several directions at once
        stacked = {n: torch.stack([v[n], 2 * v[n]]) for n in params}
        two = point.hvps(stacked)
        assert (param_dicts.flatten({n: t[1] for n, t in two.items()}) - 2 * exact).norm() <= 1e-12 * exact.norm()
    for k, b in buffers_of(model).items():  # curvature never changes running statistics
        assert torch.equal(b, before[k]), k


def reroutes_needed(name: str) -> bool:
    """Whether forward-over-forward through the *native* norm kernel is wrong, per norm."""
    model, loss_fn, params, batch = norm_problem(name)
    v = random_direction(params, 3)
    flat = param_dicts.flatten(params)
    exact = float(param_dicts.flatten(v) @ dense_hessian(loss_fn, params, batch) @ param_dicts.flatten(v))

    def along(t):  # the native kernels, on copies of the buffers (batch norm updates them in place)
        p = {**param_dicts.unflatten(flat + t * param_dicts.flatten(v), params), **buffers_of(model)}
        return F.cross_entropy(functional_call(model, p, (batch[0],)), batch[1])

    one = torch.ones((), dtype=torch.float64)
    native = float(jvp(lambda t: jvp(along, (t,), (one,))[1], (0 * one,), (one,))[1])
    return abs(native - exact) > 1e-6 * abs(exact)


@pytest.mark.parametrize(
    "name,wrong",
    [
        ("layer_norm", True),
        ("layer_norm_plain", True),
        ("instance_norm", True),
        ("batch_norm_train", True),
        ("rms_norm", False),
        ("group_norm", False),
        ("batch_norm_eval", False),
    ],
)
def test_forward_over_forward_needs_the_composites_exactly_where_they_are_used(name, wrong):
    """The native kernels' jvp-of-jvp is wrong through layer, instance and batch-statistics batch norm
    (so ``fwd_fwd`` reroutes them), and right through RMSNorm, GroupNorm and running-statistics batch
    norm (so nothing reroutes those)."""
    assert reroutes_needed(name) is wrong


def test_rev_rev_and_fwd_rev_need_no_composite_norms():
    """jvp of grad and double backward through the fused LayerNorm equal the dense reference, which is
    why ``rev_rev`` and ``fwd_rev`` keep the fused kernels."""
    from torch.func import grad

    model, loss_fn, params, batch = norm_problem("layer_norm")
    v = random_direction(params, 5)
    exact = dense_hessian(loss_fn, params, batch) @ param_dicts.flatten(v)

    def f(p):
        return F.cross_entropy(functional_call(model, p, (batch[0],)), batch[1])

    native = param_dicts.flatten(jvp(grad(f), (params,), (v,))[1])
    assert (native - exact).norm() <= 1e-12 * exact.norm()


def test_float64_requested_from_a_model_that_computes_in_float32_warns_with_the_place():
    class Downcasting(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            return self.lin(x).float()  # what Hugging Face's .loss does to the logits

    model = Downcasting().double()
    loss_fn = make_loss_fn(model, criterion=F.cross_entropy)
    params = {k: v.detach() for k, v in model.named_parameters()}
    batch = (torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,)))
    with pytest.warns(UserWarning, match=r"float64 was requested.*float\(\) to float32 at test_exact_ops\.py"):
        hvp(loss_fn, params, batch, random_direction(params))
    fine = make_loss_fn(nn.Linear(4, 3).double(), criterion=F.cross_entropy)
    p = {k: v.detach() for k, v in fine.model.named_parameters()}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hvp(fine, p, batch, random_direction(p))  # a model computing in float64 throughout: no warning


def test_exact_mode_rejects_an_unknown_method():
    with pytest.raises(ValueError, match="unknown method"), exact_second_order(method="magic"):
        pass
