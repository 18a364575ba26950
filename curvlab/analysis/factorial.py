r"""The factorial of step directions at a checkpoint (:mod:`curvlab.steps.factorial`): every filter (Adam's
EMA, Muon's Nesterov momentum) under every map (identity, Adam's preconditioner, sign, msign, random singular
values) on the hidden matrices, from the run's own optimizer state and its shadow of the other arm.

As for :func:`~curvlab.analysis.directions.counterfactual_directions`, each direction is the real next step
Z on every other parameter; on the hidden matrices each cell is scaled to the Frobenius norm of Z there
(``scaling = "matched"``): NDS, cos and q on the hidden matrices don't depend on it, and over all
parameters every cell then takes the real step's share.

Measured at a point (:func:`measure_factorial`, a :class:`FactorialPoint`) like the paired directions
(:func:`~curvlab.analysis.directions.measure_directions`): NDS, cos(G, Z) and q = cos²/NDS over all parameters
and the hidden matrices under the point's own H, and, where the point takes the held-out control, NDS and
cos(G', Z) on the hidden matrices under the held-out H (G' the held-out batch's gradient). The random
singular values are drawn with a seed of the run's seed and the step (:func:`random_sv_seed`, recorded).

JSON (``FactorialPoint.to_dict``)::

    seed, law, cells[PairedDirection (name: "<filter>_<map>")], held_out{cell: {nds, cos}} or null
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from curvlab.analysis.directions import Direction, PairedDirection, _hidden_state, measure_directions
from curvlab.curvature.groupings import hidden_matrices
from curvlab.curvature.scope import SCOPES
from curvlab.engine import params as param_dicts
from curvlab.engine.hvp import CurvaturePoint
from curvlab.errors import CurvlabError
from curvlab.models.roles import matrix_shapes
from curvlab.steps.factorial import CELLS, RANDOM_SV_LAW, factorial_cells, filter_states, parse_cell
from curvlab.steps.shadow import ShadowState, own_settings
from curvlab.util.codec import Record

_MAP_TEXT = {
    "identity": "itself",
    "adam": "over Adam's sqrt(v_hat) + eps",
    "sign": "its sign",
    "msign": "Muon's msign and shape scale",
    "random_sv": f"its singular vectors, singular values {RANDOM_SV_LAW}",
}
_FILTER_TEXT = {"ema": "Adam's bias-corrected first moment", "nesterov": "Muon's Nesterov momentum"}


@torch.no_grad()
def factorial_directions(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    G: Mapping[str, Tensor],
    Z: Mapping[str, Tensor],
    shadow: ShadowState | None,
    cells: Sequence[tuple[str, str] | str] = CELLS,
    *,
    seed: int,
) -> list[Direction]:
    """The factorial's cells at the model's current W, as directions over all of Z's parameters.

    The Adam side (m, v, step; betas, eps) and the Muon side (momentum buffer; momentum, Nesterov, polar
    method and scale) come from the run's optimizer on the hidden matrices and from its shadow of the other
    arm; nothing is written to either, nor to the parameters.

    Args:
        G: the next step's gradient (clipped, as the optimizer sees it) and Z: the real next step, both
            from :func:`~curvlab.steps.update.next_update`.
        shadow: the run's shadow state of the other arm (:func:`curvlab.steps.shadow.build_shadow`).
        cells: ``(filter, map)`` pairs or their names (:data:`~curvlab.steps.factorial.CELLS`: all ten).
        seed: the seed of the ``random_sv`` map's singular values.

    Returns:
        One :class:`~curvlab.analysis.directions.Direction` per cell, named by
        :func:`~curvlab.steps.factorial.cell_name`, in the order of ``cells``: the cell scaled to Z's norm
        on the hidden matrices, Z elsewhere, in the parameters' dtype.

    Raises:
        CurvlabError: an unknown cell, a state that is neither Adam nor Muon, no shadow of the other arm
            (or one over other matrices), or a cell that is zero on the hidden matrices.
    """
    params = {n: p for n, p in model.named_parameters() if n in Z}
    hidden = hidden_matrices(params, model=model)
    if not hidden:
        raise CurvlabError("the model has no hidden matrices: the factorial's cells differ only there")
    base, held = _hidden_state(optimizer, params, hidden)
    other = "muon" if base == "adam" else "adamw"
    if shadow is None or shadow.settings.kind != other:
        raise CurvlabError(f"the factorial needs a shadow {other} state beside the run's {base}: train with shadow on")
    if set(shadow.names) != set(hidden):
        raise CurvlabError("the shadow state covers other matrices than the model's hidden ones")
    own = own_settings(optimizer, model)  # (the hidden matrices' one param group, read as shadow settings)
    adam, muon = (own, shadow.settings) if base == "adam" else (shadow.settings, own)
    real = {n: state for n, (_, state) in held.items()}
    adam_states, muon_states = (real, shadow.state) if base == "adam" else (shadow.state, real)
    Gh = {n: G[n].to(device=params[n].device, dtype=params[n].dtype) for n in hidden}
    states = filter_states(
        Gh, adam_states, muon_states, betas=adam.betas, eps=adam.eps, momentum=muon.momentum, nesterov=muon.nesterov
    )
    shapes = matrix_shapes(model)
    on_hidden = factorial_cells(states, cells, shapes={n: shapes[n] for n in hidden}, muon=muon, seed=seed)
    real_norm = param_dicts.norm(Z, hidden)
    out = []
    for name, cell in on_hidden.items():
        norm = param_dicts.norm(cell)
        if norm == 0.0:
            raise CurvlabError(f"the {name} cell is zero on the hidden matrices")
        filter, map = parse_cell(name)
        seeded = f" (seed {seed})" if map == "random_sv" else ""
        source = f"{_FILTER_TEXT[filter]}, {_MAP_TEXT[map]}{seeded}, scaled to the real step's hidden norm"
        scaled = param_dicts.scale(cell, real_norm / norm)
        z = {n: scaled.get(n, t).to(params[n].dtype) for n, t in Z.items()}  # the real step off the hidden matrices
        out.append(Direction(name, z, source, "matched"))
    return out


# -- measured at a point ---------------------------------------------------------------------------

FACTORIAL_SCHEMA_VERSION = 1


def random_sv_seed(run_seed: int, step: int) -> int:
    """The seed of a point's random singular values: fresh at every step of every run, and recorded."""
    return int(run_seed) * 1_000_003 + int(step)


def factorial_key(quantity: str, cell: str, scope: str) -> str:
    """A per-point scalar of a cell: ``quantity`` (``nds``, ``cos``, ``q``) over ``scope``."""
    return f"factorial_{quantity}_{cell}_{scope}"


def factorial_heldout_key(quantity: str, cell: str) -> str:
    """A per-point scalar of a cell under the held-out H, on the hidden matrices: ``nds`` or ``cos``."""
    return f"factorial_heldout_{quantity}_{cell}_hidden"


@dataclass(frozen=True)
class FactorialPoint(Record):
    """The factorial's cells at one point (module docstring).

    Attributes:
        seed: the seed of the random singular values' draw.
        law: their law.
        cells: each cell's curvature over both scopes, under the point's own H.
        held_out: ``{cell: {"nds", "cos"}}`` under the held-out H on the hidden matrices, or ``None``.
    """

    seed: int
    law: str
    cells: tuple[PairedDirection, ...]
    held_out: dict[str, dict[str, float]] | None = None
    SCHEMA_VERSION: ClassVar[int] = FACTORIAL_SCHEMA_VERSION
    WHAT: ClassVar[str] = "factorial"

    def scalars(self) -> dict[str, float]:
        """:func:`factorial_key` and :func:`factorial_heldout_key` scalars of every cell."""
        keys = {"nds": "nds", "cos": "cosine", "q": "q"}
        out = {
            factorial_key(k, d.name, scope): getattr(d.scope(scope), attribute)
            for d in self.cells
            for scope in SCOPES
            for k, attribute in keys.items()
        }
        for cell, values in (self.held_out or {}).items():
            out |= {factorial_heldout_key(k, cell): v for k, v in values.items()}
        return out


def measure_factorial(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn,
    params: Mapping[str, Tensor],
    batch: Any,
    held_out_batch: Any | None,
    G: Mapping[str, Tensor],
    Z: Mapping[str, Tensor],
    hidden: Sequence[str],
    *,
    shadow,
    seed: int,
    method: str,
    dtype: torch.dtype | None,
) -> FactorialPoint:
    """Every cell at ``params``: under the H of ``batch`` over both scopes, and under the H of
    ``held_out_batch`` (when given) on the hidden matrices.

    Args:
        G, Z: the next step's gradient and update (:func:`~curvlab.steps.update.next_update`).
        hidden: the hidden matrices (the cells differ there only).
        shadow: the run's shadow of the other arm.
        seed: the random singular values' seed.

    Raises:
        CurvlabError: no shadow of the other arm, or a cell that is zero on the hidden matrices.
    """
    directions = factorial_directions(model, optimizer, G, Z, shadow, seed=seed)
    with CurvaturePoint(loss_fn, params, batch, method=method, dtype=dtype) as point:
        cells = measure_directions(point, directions, hidden)
    held = None
    if held_out_batch is not None:
        with CurvaturePoint(loss_fn, params, held_out_batch, method=method, dtype=dtype) as point:
            measured = measure_directions(point, directions, hidden)
        held = {d.name: {"nds": d.hidden.nds, "cos": d.hidden.cosine} for d in measured}
    return FactorialPoint(seed, RANDOM_SV_LAW, cells, held)
