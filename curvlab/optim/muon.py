"""Muon (docs/science.md section 5): momentum, then the polar factor msign(B) of each hidden matrix's update,
scaled by its shape (:func:`muon_scale`); :class:`Muon` is ``torch.optim.Muon`` with more polar methods and scales.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from curvlab.errors import CurvlabError
from curvlab.optim._sharded import sharded_polar_factors
from curvlab.optim.polar import NEWTON_SCHULZ_COEFFICIENTS, POLAR_METHODS, msign
from curvlab.util.distributed import rank_and_world

SCALES = ("original", "moonlight", "spectral")


def evaluate_closure(closure) -> Tensor | None:
    """The loss a ``step(closure)`` returns: the closure evaluated with gradients on, if given."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def ema_momentum(state: dict, grad: Tensor, group: dict) -> tuple[Tensor, Tensor]:
    r"""Muon's EMA momentum: the buffer ``state["momentum_buffer"]`` after taking in ``grad``
    (:math:`m \leftarrow \mu m + (1-\mu) g`), and the update it gives (Nesterov: :math:`g + \mu(m - g)`; else m)."""
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
    buf, mu = state["momentum_buffer"], group["momentum"]
    buf.lerp_(grad, 1 - mu)
    return buf, grad.lerp(buf, mu) if group["nesterov"] else buf


def muon_scale(shape: tuple[int, ...], scale: str) -> float:
    r"""Muon's per-matrix learning-rate multiplier for a weight of mathematical shape ``rows x cols``
    (:math:`d_\text{out} \times d_\text{in}`, or ``n x rows x cols`` for a stack of n; see :func:`matrix_shape`).

    ``"original"``: :math:`\max(1, r/c)^{1/2}` (Keller Jordan); ``"moonlight"``:
    :math:`0.2\max(r, c)^{1/2}` (matches AdamW's update RMS); ``"spectral"``: :math:`(r/c)^{1/2}`.
    """
    rows, cols = shape[-2], shape[-1]  # (a stack's leading count aside)
    if scale == "original":
        return math.sqrt(max(1, rows / cols))
    if scale == "moonlight":
        return 0.2 * math.sqrt(max(rows, cols))
    if scale == "spectral":
        return math.sqrt(rows / cols)
    raise CurvlabError(f"unknown Muon scale {scale!r}; choose one of {', '.join(SCALES)}")


def matrix_shape(p: Tensor, transposed: bool = False, stacked: bool | int = False) -> tuple[int, ...]:
    """The matrix Muon orthogonalizes for parameter ``p``: (out, in) for a 2-D weight (swapped when it
    is stored transposed, as Hugging Face's ``Conv1D``), out x (in/groups * prod k) for a
    convolution kernel; (n, out, in) for a stack of n matrices, each orthogonalized and scaled on its own:
    ``stacked=True``, the first dimension of a 3-D stack (an MoE's fused experts,
    :func:`~curvlab.models.roles.stacked_matrices`); ``stacked=n``, a 3-D stack of n or n matrices stacked
    by rows in a 2-D parameter (DBRX's experts, (n * out) x in)."""
    if stacked is False or stacked is None:
        rows, cols = p.shape[0], math.prod(p.shape[1:])
        return (cols, rows) if transposed else (rows, cols)
    n = p.shape[0] if stacked is True else int(stacked)
    cols = p.shape[-1]
    rows = p.numel() // (n * cols)
    return (n, *((cols, rows) if transposed else (rows, cols)))


def check_polar_settings(scale: str, polar: str, polar_dtype: torch.dtype | str) -> torch.dtype:
    """Refuse an unknown Muon ``scale`` or ``polar`` method, and return ``polar_dtype`` as a dtype (a JSON
    config names it, e.g. ``"float32"``)."""
    muon_scale(torch.Size([1, 1]), scale)  # validates the name
    if polar not in POLAR_METHODS:
        raise CurvlabError(f"unknown polar method {polar!r}; choose one of {', '.join(POLAR_METHODS)}")
    return getattr(torch, polar_dtype.removeprefix("torch.")) if isinstance(polar_dtype, str) else polar_dtype


def polar_options(group: dict) -> dict[str, Any]:
    """:func:`~curvlab.optim.polar.msign`'s options from a param group (its ``ns_coefficients`` where it has
    them)."""
    options = {
        "polar": group["polar"],
        "steps": group["ns_steps"],
        "dtype": group["polar_dtype"],
        "eps": group["eps"],
    }
    if "ns_coefficients" in group:
        options["coefficients"] = tuple(group["ns_coefficients"])
    return options


def as_matrices(update: Tensor, shape: tuple[int, ...]) -> Tensor:
    """``update`` as what msign acts on: its stored rows x the rest, or for a stack of n matrices (three
    entries in ``shape``, from :func:`matrix_shape`) n of them, each its stored rows x its last dimension
    (a 3-D stack's slices; the row blocks of a 2-D one)."""
    if len(shape) == 3:
        return update.reshape(shape[0], -1, update.shape[-1])
    return update.reshape(update.shape[0], -1)


class Muon(torch.optim.Muon):
    r"""``torch.optim.Muon``, computing its step out of place, with a choice of polar factor and scale.

    Per 2-D parameter W with gradient G (EMA momentum, as torch's):

    .. math::
        B \leftarrow \mu B + (1-\mu) G,\quad
        \tilde B = (1-\mu) G + \mu B \text{ (Nesterov) or } B,\quad
        W \leftarrow (1 - \eta\lambda) W - \eta\, s(W)\, \operatorname{msign}(\tilde B)

    With the defaults (``polar="newton_schulz"``, ``scale="original"``) every step equals
    ``torch.optim.Muon``'s bit for bit, and the state dict has the same layout.

    Parameters of more than 2 dimensions (convolution kernels, out x in/groups x k...) are
    orthogonalized as the out x (in/groups * prod k) matrix they flatten to, and scaled by that
    shape, as Keller Jordan's CIFAR-10 speedrun does (``torch.optim.Muon`` refuses them). A param
    group with ``transposed=True`` holds matrices stored (in, out), like Hugging Face's ``Conv1D``:
    the polar factor doesn't care (msign(Xᵀ) = msign(X)ᵀ) but the scale uses the (out, in) shape. A
    group with ``stacked`` (``True`` or a count, see :func:`matrix_shape`) holds stacks of matrices (an
    MoE's experts): each gets its own polar factor and scale, as if it were a parameter of its own.

    Under torch.distributed (gradients already averaged by DDP) the polar factors are shared out: the
    matrices, sorted by size, go round-robin to the ranks, each rank orthogonalizes its own and
    broadcasts them, as Keller Jordan's and modded-nanogpt's distributed Muon do; momentum buffers,
    cheap and elementwise, are updated on every rank. Unlike torch's, the momentum buffer is never
    normalized in place (:mod:`curvlab.optim.polar`). ``weight_decay`` defaults to 0 (torch's to 0.1),
    as in the reference runs.
    """

    def __init__(
        self,
        params,
        lr: float = 0.02,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NEWTON_SCHULZ_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        scale: str = "original",
        polar: str = "newton_schulz",
        polar_dtype: torch.dtype | str = torch.bfloat16,
    ):
        polar_dtype = check_polar_settings(scale, polar, polar_dtype)
        adjust = {"original": "original", "moonlight": "match_rms_adamw", "spectral": None}[scale]
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise CurvlabError(f"Muon needs lr, momentum and weight_decay >= 0, got {lr}, {momentum}, {weight_decay}")
        # torch.optim.Muon's own __init__ refuses parameters that aren't 2-D: set up as it does, minus that
        defaults = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov}
        defaults |= {"ns_coefficients": ns_coefficients, "eps": eps, "ns_steps": ns_steps, "adjust_lr_fn": adjust}
        torch.optim.Optimizer.__init__(self, params, defaults)
        flat = [tuple(p.shape) for g in self.param_groups for p in g["params"] if p.dim() < 2]
        if flat:
            raise CurvlabError(f"Muon takes matrices (2 or more dimensions); got parameters of shape {flat[:3]}")
        extra = {"scale": scale, "polar": polar, "polar_dtype": polar_dtype, "transposed": False, "stacked": False}
        self.defaults.update(extra)
        for group in self.param_groups:
            for k, v in extra.items():
                group.setdefault(k, v)
            _check_stacks(group)

    @torch.no_grad()
    def step(self, closure=None):
        loss = evaluate_closure(closure)
        work = []  # (group, param, momentum-averaged update) for every param with a gradient
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    work.append((group, p, ema_momentum(self.state[p], p.grad, group)[1]))
        if any(isinstance(u, DTensor) for _, _, u in work):  # FSDP2: each whole matrix on one rank
            orthos = sharded_polar_factors(work, _polar_factor)
        else:
            orthos = self._replicated_polar_factors(work)
        for (group, p, _), ortho in zip(work, orthos):
            lr = group["lr"]
            p.mul_(1 - lr * group["weight_decay"])
            # (a state dict from before has neither flag)
            shape = matrix_shape(p, group.get("transposed", False), group.get("stacked", False))
            p.add_(ortho, alpha=-(lr * muon_scale(shape, group["scale"])))
        return loss

    @staticmethod
    def _replicated_polar_factors(work: list) -> list[Tensor]:
        """Polar factors of replicated updates: round robin by size, each broadcast by its owner."""
        rank, world = rank_and_world()
        order = sorted(range(len(work)), key=lambda i: -work[i][1].numel())
        owner = {i: k % world for k, i in enumerate(order)}  # round-robin by size
        orthos = []
        for i, (group, p, update) in enumerate(work):
            if owner[i] == rank:
                # (a tall matrix's factor is a transposed view; collectives need memory order)
                ortho = _polar_factor(group, update).to(p.dtype).contiguous().view(p.shape)
            else:
                ortho = torch.empty_like(p)
            orthos.append(ortho)
        if world > 1:
            for i, ortho in enumerate(orthos):
                dist.broadcast(ortho, src=owner[i])
        return orthos


def _check_stacks(group: dict) -> None:
    """Refuse a group whose ``stacked`` flag doesn't fit its parameters: ``True`` takes 3-D stacks
    (n x out x in); a number n, 3-D stacks of n or 2-D parameters whose rows are n blocks.

    Raises:
        CurvlabError: a flag that is neither, or a parameter that doesn't hold that many matrices.
    """
    stacked = group["stacked"]
    if stacked is False:
        return
    if stacked is True:
        if any(p.dim() != 3 for p in group["params"]):
            raise CurvlabError("a stacked Muon group takes 3-D stacks of matrices (n x out x in) only")
        return
    if not isinstance(stacked, int) or stacked < 1:  # (True and False were taken above)
        raise CurvlabError(f"a Muon group's stacked is True, False or a number of matrices, got {stacked!r}")
    for p in group["params"]:
        fits = p.shape[0] == stacked if p.dim() == 3 else p.dim() == 2 and p.shape[0] % stacked == 0
        if not fits:
            raise CurvlabError(f"a Muon group stacked={stacked} can't split a parameter of shape {tuple(p.shape)}")


def _polar_factor(group: dict, update: Tensor) -> Tensor:
    """msign of one whole update with its group's polar settings, shaped like the update."""
    matrices = as_matrices(update, matrix_shape(update, stacked=group.get("stacked", False)))
    return msign(matrices, **polar_options(group)).reshape(update.shape)
