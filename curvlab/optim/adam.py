r"""Adam's diagonal preconditioner and its edge of stability, read from an optimizer's state: what the
preconditioned sharpness :math:`\lambda_{\max}(P^{-1/2} H P^{-1/2})` of ``curvlab spectrum --preconditioned``
is measured with and against.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from curvlab.errors import CurvlabError

# -- preconditioned sharpness ------------------------------------------------------------------------


def adam_preconditioner(optimizer: torch.optim.Optimizer, model: torch.nn.Module, names: Sequence[str]) -> Tensor:
    r"""Adam's diagonal :math:`P = \sqrt{\hat v} + \epsilon`, :math:`\hat v = v / (1 - \beta_2^t)`, from an
    optimizer's state, flattened in the order of ``names`` (on the state's device, in float64).

    Raises:
        CurvlabError: a parameter without Adam state (``exp_avg_sq``), e.g. Muon's matrices.
    """
    table = dict(model.named_parameters())
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    pieces = []
    for n in names:
        p = table[n]
        state = optimizer.state.get(p, {})
        if "exp_avg_sq" not in state:
            raise CurvlabError(
                f"{n} has no Adam state (exp_avg_sq): the preconditioned sharpness needs an Adam checkpoint"
            )
        group = group_of[id(p)]
        beta2, eps = group["betas"][1], group["eps"]
        step = float(state["step"])
        v_hat = state["exp_avg_sq"].double() / (1 - beta2**step)
        pieces.append((v_hat.sqrt() + eps).reshape(-1))
    return torch.cat(pieces)


def adam_edge_of_stability(lr: float, beta1: float) -> float:
    r"""Adam's edge of stability :math:`(2 + 2\beta_1) / ((1 - \beta_1)\eta)`: on a quadratic, heavy-ball
    momentum :math:`\beta_1` with step :math:`\eta` is stable while the (preconditioned) sharpness stays
    below it (Cohen et al. 2022, "Adaptive gradient methods at the edge of stability"); 38/η at
    :math:`\beta_1 = 0.9`, and gradient descent's 2/η at :math:`\beta_1 = 0`."""
    if not lr > 0:
        raise CurvlabError(f"the learning rate must be positive for an edge of stability, got {lr}")
    if not 0 <= beta1 < 1:
        raise CurvlabError(f"beta1 must lie in [0, 1), got {beta1}")
    return (2 + 2 * beta1) / ((1 - beta1) * lr)


def adam_step_settings(optimizer: torch.optim.Optimizer) -> tuple[float, float]:
    """The ``(lr, beta1)`` that every Adam group of ``optimizer`` shares (the edge of stability needs one of each).

    Raises:
        CurvlabError: no Adam group, or groups that disagree.
    """
    pairs = {(float(g["lr"]), float(g["betas"][0])) for g in optimizer.param_groups if "betas" in g}
    if len(pairs) != 1:
        raise CurvlabError(
            "the preconditioned sharpness needs one Adam learning rate and beta1, "
            f"found {len(pairs)} (lr, beta1) pairs among the optimizer's groups"
        )
    return pairs.pop()
