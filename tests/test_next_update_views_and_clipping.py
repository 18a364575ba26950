"""next_update (issue 47): optimizers whose state keeps views of their parameters (heavyball's SOAP), and
clipping by any norm or by value. Each Z against the same optimizer's real step, taken after next_update
(which changes nothing), with torch's own clip functions in the loop."""

import math

import heavyball
import pytest
import torch

from curvlab import make_loss_fn, next_update
from curvlab.errors import CurvlabError
from tests.builders import batch_for
from tests.test_next_update_clients import (
    WithUnused,
    check_next_update_is_the_real_step,
    real_step,
    regression,
    regression_batch,
    tiny_gpt,
    views_of_parameters,
)

# -- an optimizer whose state keeps views of its parameters ------------------------------------------------


def test_heavyball_soap_keeps_views_of_its_parameters(monkeypatch):
    monkeypatch.setattr(heavyball.utils, "compile_mode", None)  # eager: no minutes of inductor on a CPU
    model = tiny_gpt()
    opt = heavyball.SOAP(model.parameters(), lr=1e-2, precondition_frequency=1)
    real_step(model, [opt], make_loss_fn(model), batch_for(model))
    params = {id(p) for p in model.parameters()}
    views = views_of_parameters(list(model.parameters()), list(opt.mapping.values()))
    assert views and all(id(v) not in params for v in views)  # what the copy must keep on the parameters
    # (then: original state unchanged, Z and G those of the real step, bit for bit)
    assert check_next_update_is_the_real_step(model, [opt], warmup=1) == 0.0


class FlatViewSGD(torch.optim.Optimizer):
    """SGD with momentum that steps each parameter through a flat view of it kept in its state since the first
    step (as an optimizer working on flattened matrices does): a copy that gave the view memory of its own
    would step that memory, and leave the parameter where it was."""

    def __init__(self, params, lr=1e-2, momentum=0.9):
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "flat" not in state:
                    state["flat"], state["buf"] = p.detach().view(-1), torch.zeros(p.numel(), dtype=p.dtype)
                state["buf"].mul_(group["momentum"]).add_(p.grad.reshape(-1))
                state["flat"].sub_(state["buf"], alpha=group["lr"])


def test_an_optimizer_stepping_through_views_it_keeps():
    model = tiny_gpt()
    opt = FlatViewSGD(model.parameters())
    assert check_next_update_is_the_real_step(model, [opt]) == 0.0
    assert all(opt.state[p]["flat"].data_ptr() == p.data_ptr() for p in model.parameters())


# -- clipping: by the L2 norm (the default), any other norm, or by value ----------------------------------


@pytest.mark.parametrize(
    ("options", "clip"),
    [
        ({"max_grad_norm": 0.05}, lambda ps: torch.nn.utils.clip_grad_norm_(ps, 0.05)),
        (
            {"max_grad_norm": 0.01, "grad_norm_type": math.inf},
            lambda ps: torch.nn.utils.clip_grad_norm_(ps, 0.01, norm_type=math.inf),
        ),
        (
            {"max_grad_norm": 0.1, "grad_norm_type": 1.0},
            lambda ps: torch.nn.utils.clip_grad_norm_(ps, 0.1, norm_type=1.0),
        ),
        ({"max_grad_value": 2e-3}, lambda ps: torch.nn.utils.clip_grad_value_(ps, 2e-3)),
    ],
    ids=["l2-norm", "inf-norm", "1-norm", "value"],
)
def test_clipping_is_the_loops_torch_clipping(options, clip):
    torch.manual_seed(4)
    model = WithUnused().double()  # (its unused head keeps .grad None: torch's clipping skips it, as curvlab's)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    loss_fn = regression(model)

    def loop(batch):  # the user's loop: backward, torch's clipping, step; the gradients it stepped with
        opt.zero_grad(set_to_none=True)
        loss_fn(dict(model.named_parameters()), batch).backward()
        clip([p for p in model.parameters() if p.grad is not None])
        grads = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        return grads

    loop(regression_batch(0))  # momentum in the state
    batch = regression_batch(1)
    G, Z = next_update(model, opt, loss_fn, batch, **options)
    _, unclipped = next_update(model, opt, loss_fn, batch)
    W = {n: p.detach().clone() for n, p in model.named_parameters()}
    clipped = loop(batch)
    for n, p in model.named_parameters():
        assert torch.equal(Z[n], W[n] - p.detach()), n
        assert torch.equal(G[n], clipped[n]), n
    assert any(not torch.equal(Z[n], unclipped[n]) for n in Z)  # the bound was reached: the clipping did something


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_grad_norm": 1.0, "max_grad_value": 1.0}, "not both"),
        ({"max_grad_value": -1.0}, "max_grad_value must be a number >= 0"),
        ({"max_grad_norm": float("nan")}, "max_grad_norm must be a number >= 0"),
        ({"max_grad_norm": 1.0, "grad_norm_type": 0}, "grad_norm_type must be a number p > 0"),
        ({"max_grad_norm": 1.0, "grad_norm_type": "fro"}, "grad_norm_type must be a number p > 0"),
    ],
)
def test_clipping_that_cannot_be_done_is_refused(options, message):
    model = WithUnused().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(CurvlabError, match=message) as e:
        next_update(model, opt, regression(model), regression_batch(0), **options)
    assert "\n" not in str(e.value)
    assert all(p.grad is None for p in model.parameters())
