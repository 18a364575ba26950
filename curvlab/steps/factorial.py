r"""The factorial of step directions: a *filter* of the gradient history, then a *map* per hidden matrix.

AdamW's step and Muon's differ in two ways at once: how the gradients are averaged (the filter) and what
is done to the average (the map). At one checkpoint both arms' states exist (the run's own and its shadow's,
:mod:`curvlab.steps.shadow`), so every filter can meet every map on the same next gradient G, and each
ingredient's part in a difference of curvature can be read off alone (the paired directions of
docs/science.md section 11 are two of its cells).

**Filters**, after absorbing G exactly as the optimizer's own step would (the state itself left untouched),
with t the step count after G:

.. math::
    \text{ema:}\quad \hat m = \frac{m'}{1 - \beta_1^t},\ m' = m + (1-\beta_1)(G - m)
    \qquad
    \text{nesterov:}\quad \tilde B = G + \mu (B' - G),\ B' = B + (1-\mu)(G - B)

(Adam's bias-corrected first moment; Muon's Nesterov momentum, or plain :math:`B'` without Nesterov).

**Maps**, per hidden matrix, of a filtered F:

.. math::
    \text{identity: } F,\quad
    \text{adam: } \frac{F}{\sqrt{\hat v} + \epsilon},\ \hat v = \frac{v'}{1-\beta_2^t},\
        v' = \beta_2 v + (1-\beta_2) G^2,\quad
    \text{sign: } \operatorname{sign}(F),\quad
    \text{msign: } s(r, c)\, \operatorname{msign}(F),\quad
    \text{random\_sv: } U \operatorname{diag}(\sigma) V^\top

with Adam's own second moment (``adam``), Muon's polar method and shape scale (``msign``,
:func:`~curvlab.steps.shadow.muon_step` at lr 1), and for ``random_sv`` the singular vectors of
:math:`F = U S V^\top` (float64) under fresh singular values :math:`\sigma_i` drawn i.i.d. from
:data:`RANDOM_SV_LAW` (singular values F doesn't have, below the rank tolerance of
:func:`curvlab.optim.polar.msign`'s ``"svd"``, stay 0, as msign leaves them).

``ema`` x ``adam`` is Adam's step over its lr (:data:`ADAMW_CELL`), ``nesterov`` x ``msign`` Muon's
(:data:`MUON_CELL`), ``ema``/``nesterov`` x ``identity`` momentum SGD. No cell has a weight-decay term:
each is the pure map of the filter, and no lr (a caller scales them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from curvlab.errors import CurvlabError
from curvlab.optim.muon import as_matrices
from curvlab.steps.shadow import ShadowSettings, muon_step

FILTERS = ("ema", "nesterov")
MAPS = ("identity", "adam", "sign", "msign", "random_sv")
CELLS = tuple((f, m) for f in FILTERS for m in MAPS)
MUON_CELL = ("nesterov", "msign")
ADAMW_CELL = ("ema", "adam")
RANDOM_SV_LAW = "uniform on (0, 1]"  # as drawn: 1 - torch.rand(k, generator=g, dtype=float64), on the CPU


def check_cell(filter: str, map: str) -> tuple[str, str]:
    """``(filter, map)`` if both are known.

    Raises:
        CurvlabError: an unknown filter or map, in one line naming the choices.
    """
    if filter not in FILTERS:
        raise CurvlabError(f"unknown filter {filter!r}; choose one of {', '.join(FILTERS)}")
    if map not in MAPS:
        raise CurvlabError(f"unknown map {map!r}; choose one of {', '.join(MAPS)}")
    return filter, map


def cell_name(filter: str, map: str) -> str:
    """The cell's name, ``"nesterov_msign"`` for ``("nesterov", "msign")``.

    Raises:
        CurvlabError: an unknown filter or map.
    """
    check_cell(filter, map)
    return f"{filter}_{map}"


def parse_cell(name: str) -> tuple[str, str]:
    """The inverse of :func:`cell_name`: ``"ema_random_sv"`` -> ``("ema", "random_sv")``.

    Raises:
        CurvlabError: a name that is no cell's.
    """
    filter, _, map = name.partition("_")  # (no filter's name has an underscore)
    return check_cell(filter, map)


def _cells(cells: Sequence[tuple[str, str] | str]) -> list[tuple[str, str]]:
    """Cells as (filter, map) pairs, given as pairs or names, in order, without repeats."""
    pairs = [parse_cell(c) if isinstance(c, str) else check_cell(*c) for c in cells]
    if not pairs:
        raise CurvlabError("no cell asked for; choose (filter, map) pairs from FILTERS x MAPS")
    return list(dict.fromkeys(pairs))


@dataclass(frozen=True)
class FilterStates:
    """Both filters of every hidden matrix after the next gradient, and Adam's denominator there.

    Attributes:
        ema: ``{name: m̂}``, Adam's bias-corrected first moment.
        nesterov: ``{name: B̃}``, Muon's (Nesterov) momentum.
        adam_denominator: ``{name: sqrt(v̂) + eps}``, with Adam's second moment.
    """

    ema: dict[str, Tensor]
    nesterov: dict[str, Tensor]
    adam_denominator: dict[str, Tensor]

    def filtered(self, filter: str) -> dict[str, Tensor]:
        """``{name: F}`` of one filter.

        Raises:
            CurvlabError: an unknown filter.
        """
        check_cell(filter, MAPS[0])
        return self.ema if filter == "ema" else self.nesterov


def _moment(state: Mapping[str, Tensor], key: str, g: Tensor) -> Tensor:
    """A state's moment on G's device and dtype; zeros before the first step."""
    m = state.get(key)
    return torch.zeros_like(g) if m is None else m.to(device=g.device, dtype=g.dtype)


@torch.no_grad()
def filter_states(
    G: Mapping[str, Tensor],
    adam_states: Mapping[str, Mapping[str, Tensor]],
    muon_states: Mapping[str, Mapping[str, Tensor]],
    *,
    betas: tuple[float, float],
    eps: float,
    momentum: float,
    nesterov: bool,
) -> FilterStates:
    """The filters after absorbing G, with the very ops of ``torch.optim.Adam`` and
    :class:`curvlab.optim.muon.Muon` (and :class:`~curvlab.steps.shadow.ShadowState`); no state is written.

    Args:
        G: ``{name: gradient}`` of the hidden matrices (the next step's, clipped as the optimizer sees it).
        adam_states: ``{name: {exp_avg, exp_avg_sq, step}}`` (a torch Adam's per-parameter state or a shadow
            Adam's); a name or key missing: zeros, step 0 (no step yet).
        muon_states: ``{name: {momentum_buffer}}`` likewise (a Muon's or a shadow Muon's).
        betas, eps: Adam's; momentum, nesterov: Muon's.

    Returns:
        The :class:`FilterStates` of G's names, in G's dtype and on its devices.
    """
    beta1, beta2 = betas
    ema, nest, denom = {}, {}, {}
    for name, g in G.items():
        adam, muon = adam_states.get(name, {}), muon_states.get(name, {})
        t = float(adam["step"]) + 1 if "step" in adam else 1.0
        ema[name] = _moment(adam, "exp_avg", g).lerp(g, 1 - beta1) / (1 - beta1**t)
        v = _moment(adam, "exp_avg_sq", g).mul(beta2).addcmul_(g, g.conj(), value=1 - beta2)
        denom[name] = (v.sqrt() / (1 - beta2**t) ** 0.5).add_(eps)
        buf = _moment(muon, "momentum_buffer", g).lerp(g, 1 - momentum)
        nest[name] = g.lerp(buf, momentum) if nesterov else buf
    return FilterStates(ema, nest, denom)


def random_sv(F: Tensor, shape: tuple[int, ...], generator: torch.Generator) -> Tensor:
    r""":math:`U \operatorname{diag}(\sigma) V^\top` of each matrix of F (a stack's, expert by expert, as
    :func:`~curvlab.optim.muon.as_matrices` splits it), with F's singular vectors (float64 SVD) and
    :math:`\sigma` drawn from :data:`RANDOM_SV_LAW`, min(rows, cols) values per matrix in order, from
    ``generator`` (a CPU one); singular values under msign's ``"svd"`` rank tolerance stay 0.

    Returns:
        A tensor like F (dtype and device).
    """
    matrices = as_matrices(F, shape).double()
    batch = matrices if matrices.dim() == 3 else matrices.unsqueeze(0)
    eps = torch.finfo(F.dtype).eps
    out = []
    for X in batch:
        U, S, Vh = torch.linalg.svd(X, full_matrices=False)
        sigma = (1 - torch.rand(S.shape[0], generator=generator, dtype=torch.float64)).to(X.device)
        keep = S.amax() * max(X.shape) * eps < S  # (as msign's "svd": no arbitrary null-space vectors)
        out.append((U * (sigma * keep)) @ Vh)
    return torch.stack(out).reshape(F.shape).to(dtype=F.dtype, device=F.device)


def apply_map(
    map: str,
    F: Tensor,
    *,
    denominator: Tensor,
    shape: tuple[int, ...],
    muon: ShadowSettings,
    generator: torch.Generator | None = None,
) -> Tensor:
    r"""One map of one filtered matrix F (module docstring).

    Args:
        map: one of :data:`MAPS`.
        denominator: Adam's :math:`\sqrt{\hat v} + \epsilon` of the matrix (``adam``).
        shape: its mathematical shape (:func:`curvlab.models.roles.matrix_shapes`; ``msign``, ``random_sv``).
        muon: Muon's settings (kind ``"muon"``: polar method, steps, dtype, scale; ``msign``).
        generator: a CPU generator (``random_sv``).

    Returns:
        A tensor like F.

    Raises:
        CurvlabError: an unknown map, or ``random_sv`` without a generator.
    """
    check_cell(FILTERS[0], map)
    if map == "identity":
        return F
    if map == "adam":
        return F / denominator
    if map == "sign":
        return torch.sign(F)
    if map == "msign":
        return muon_step(F, shape, muon, lr=1.0)
    if generator is None:
        raise CurvlabError("the random_sv map needs a seeded generator")
    return random_sv(F, shape, generator)


@torch.no_grad()
def factorial_cells(
    states: FilterStates,
    cells: Sequence[tuple[str, str] | str] = CELLS,
    *,
    shapes: Mapping[str, tuple[int, ...]],
    muon: ShadowSettings,
    seed: int,
) -> dict[str, dict[str, Tensor]]:
    """Every cell asked for on every hidden matrix, unscaled.

    Each ``random_sv`` cell draws from its own ``torch.Generator().manual_seed(seed)``, matrix by matrix
    in sorted name order: both filters' ``random_sv`` cells take the same singular values, and differ in
    their singular vectors alone.

    Args:
        states: the filters (:func:`filter_states`).
        cells: ``(filter, map)`` pairs or their names (:func:`cell_name`).
        shapes: ``{name: mathematical shape}`` of the hidden matrices.
        muon: Muon's settings (for ``msign``).
        seed: the seed of ``random_sv``'s singular values.

    Returns:
        ``{cell_name: {name: tensor}}`` in the order of ``cells``, names in sorted order.

    Raises:
        CurvlabError: an unknown filter or map, or Muon settings of another kind.
    """
    if muon.kind != "muon":
        raise CurvlabError(f"the msign map needs Muon's settings, got a {muon.kind} shadow's")
    out = {}
    for filter, map in _cells(cells):
        F = states.filtered(filter)
        generator = torch.Generator().manual_seed(int(seed)) if map == "random_sv" else None
        out[cell_name(filter, map)] = {
            n: apply_map(
                map, F[n], denominator=states.adam_denominator[n], shape=shapes[n], muon=muon, generator=generator
            )
            for n in sorted(F)
        }
    return out
