"""Lion (Chen et al. 2023): the sign of an interpolation of the gradient and the momentum."""

from __future__ import annotations

import torch

from curvlab.errors import CurvlabError
from curvlab.optim.muon import evaluate_closure


class Lion(torch.optim.Optimizer):
    r"""Lion (Chen et al. 2023), a sign-based optimizer:

    .. math::
        W \leftarrow (1 - \eta\lambda) W - \eta\,\operatorname{sign}(\beta_1 m + (1-\beta_1) G),\quad
        m \leftarrow \beta_2 m + (1-\beta_2) G
    """

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0):
        if lr < 0:
            raise CurvlabError(f"Lion learning rate must be >= 0, got {lr}")
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = evaluate_closure(closure)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(m.lerp(p.grad, 1 - beta1)), alpha=-group["lr"])
                m.lerp_(p.grad, 1 - beta2)
        return loss
