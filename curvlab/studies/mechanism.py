r"""What makes Muon's step flatter, from the factorial's cells at every analysed point
(:mod:`curvlab.analysis.factorial`; docs/science.md section 16), derived from a
:class:`curvlab.studies.records.LevelData` like the primary family: the paired claim's points (both arms'
runs, the matched windows and the trajectory), per seed the median of each per-point ratio, then the
primary family's seed-level interval (:func:`curvlab.inference.statistics.ratio_inference`).

**Cells** (:func:`cells`, a :class:`CellEntry` each): a cell's NDS, cos(G, Z) and q = cos²/NDS over Muon's own
cell (Nesterov × msign) at the same point, on the hidden matrices and over all parameters, and its NDS and q
ratios under the held-out H.

**Decomposition** (:func:`decomposition`): with :math:`N_{fm}` the NDS of cell (filter f, map m) on the hidden
matrices, E Adam's EMA, N Nesterov, A Adam's map and M msign, the log of AdamW's over Muon's cell splits
exactly, at every point,

.. math::
    \log\frac{N_{EA}}{N_{NM}} = \underbrace{\log\frac{N_{EM}}{N_{NM}}}_\text{filter}
    + \underbrace{\log\frac{N_{NA}}{N_{NM}}}_\text{map}
    + \underbrace{\log\frac{N_{EA} N_{NM}}{N_{EM} N_{NA}}}_\text{interaction}
    = \underbrace{2\log\frac{\cos_{EA}}{\cos_{NM}}}_\text{alignment}
    + \underbrace{\log\frac{q_{NM}}{q_{EA}}}_\text{efficiency},

(the second because NDS = cos²/q). Each term is a seed's *mean* over its points (means add, medians don't),
with a t interval across seeds, reported as a factor :math:`e^{x}`. A point where any of the four cells has
NDS <= 0 has no logs: it is left out of the decomposition and counted.

**The paired ratio's parts** (:func:`paired_parts`, every design): the same alignment and efficiency split of
the paired directions' NDS ratio (the run's own step and its shadow's), which the paired claim reads as a
per-seed median of the total.

**Its Gauss–Newton split** (in :func:`paired_parts`, where measured): with :math:`N = N^{GN}(1 + r)`, r the
residual over the Gauss–Newton part,

.. math::
    \log\frac{N_a}{N_m} = \underbrace{\log\frac{N^{GN}_a}{N^{GN}_m}}_\text{Gauss–Newton}
    + \underbrace{\log\frac{1 + r_a}{1 + r_m}}_\text{residual},

at the points where both NDS are positive (the Gauss–Newton parts are never negative); a point with an NDS
<= 0 has a residual below minus its Gauss–Newton part, and is counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from curvlab.analysis.factorial import factorial_heldout_key, factorial_key
from curvlab.curvature.scalars import CheckpointScalars
from curvlab.inference import statistics
from curvlab.steps.factorial import ADAMW_CELL, CELLS, MUON_CELL, cell_name
from curvlab.studies.controls import SeedMedians, arm_points, q_ratio_of, ratio_of, seed_medians
from curvlab.studies.records import LevelData
from curvlab.util.codec import Record

MUON, ADAMW = cell_name(*MUON_CELL), cell_name(*ADAMW_CELL)
QUANTITIES = ("nds", "cos", "q")
TERMS = ("filter", "map", "interaction", "alignment", "efficiency")


@dataclass(frozen=True)
class CellEntry(Record):
    """One cell against Muon's own, at the same points (module docstring): each ratio's value and 95%
    interval across seeds (``None`` where not measured), ``held_out`` the NDS, cos and q ratios under the
    held-out H (hidden matrices only); ``n_points`` the points with both cells measured, ``n_excluded`` those
    of them where an NDS <= 0 left the NDS or q ratio without a log (kept out of those two, counted)."""

    filter: str
    map: str
    scope: str
    nds_ratio: float | None
    cos_ratio: float | None
    q_ratio: float | None
    ci95: dict[str, list[float] | None]
    held_out: dict[str, Any] = field(default_factory=dict)
    n_seeds: int = 0
    n_points: int = 0
    n_excluded: int = 0


@dataclass(frozen=True)
class Term(Record):
    """One term of the decomposition: a factor e^x (x a seed's mean log over its points) with its interval."""

    value: float | None
    ci95: list[float] | None
    log: float | None
    n_seeds: int
    n_points: int
    excluded_points: int
    note: str = ""


def _inferred(points, value) -> tuple[float | None, list[float] | None, SeedMedians]:
    """A per-point ratio's seed medians, inferred across seeds (value and interval; ``None`` when unmeasured)."""
    m = seed_medians(points, value)
    if not m.seeds:
        return None, None, m
    inf = statistics.ratio_inference(m.medians, [1.0] * len(m.medians))
    return inf.value, None if inf.ci95 is None else [float(x) for x in inf.ci95], m


def _cell(points, f: str, m: str, scope: str) -> CellEntry:
    cell = cell_name(f, m)
    nds, cos = (factorial_key(k, c, scope) for k, c in (("nds", cell), ("cos", cell)))
    muon_nds, muon_cos = factorial_key("nds", MUON, scope), factorial_key("cos", MUON, scope)
    ratios = {
        "nds": ratio_of(nds, muon_nds, positive=True),
        "cos": ratio_of(cos, muon_cos),
        "q": q_ratio_of(nds, cos, muon_nds, muon_cos),
    }
    values, ci, counts = {}, {}, {}
    for quantity, value in ratios.items():
        values[quantity], ci[quantity], counts[quantity] = _inferred(points, value)
    measured = counts["cos"]
    excluded = max(counts["nds"].missing, counts["q"].missing) - measured.missing
    held = {}
    if scope == "hidden":
        h = {k: factorial_heldout_key(k, cell) for k in ("nds", "cos")}
        hm = {k: factorial_heldout_key(k, MUON) for k in ("nds", "cos")}
        got = {
            "nds": _inferred(points, ratio_of(h["nds"], hm["nds"], positive=True)),
            "cos": _inferred(points, ratio_of(h["cos"], hm["cos"])),
            "q": _inferred(points, q_ratio_of(h["nds"], h["cos"], hm["nds"], hm["cos"])),
        }
        held = {f"{k}_ratio": v[0] for k, v in got.items()} | {"ci95": {k: v[1] for k, v in got.items()}}
    n_seeds = len(measured.seeds)
    return CellEntry(
        f, m, scope, values["nds"], values["cos"], values["q"], ci, held, n_seeds, measured.n_points, excluded
    )


def cells(data: LevelData) -> list[CellEntry]:
    """Every cell over Muon's own, per scope (hidden first), at the paired claim's points of both arms."""
    points = arm_points(data, None)
    return [_cell(points, f, m, scope) for scope in ("hidden", "all") for f, m in CELLS]


def _split(nds_a: float | None, nds_b: float | None, cos_a: float | None, cos_b: float | None):
    """(log NDS_a/NDS_b, its alignment part 2 log|cos_a/cos_b|), or ``None`` where an NDS is missing or <= 0
    or a cosine is missing or 0; the efficiency part log(q_b/q_a) is their difference (NDS = cos²/q)."""
    if any(v is None or not v > 0 for v in (nds_a, nds_b)) or any(v is None or v == 0 for v in (cos_a, cos_b)):
        return None
    return math.log(nds_a / nds_b), 2 * math.log(abs(cos_a) / abs(cos_b))


def _point_terms(row: CheckpointScalars) -> dict[str, float] | None:
    """The five log terms at one point (module docstring), or ``None`` where a cell's NDS is missing or <= 0."""
    names = {"EA": ADAMW, "EM": cell_name("ema", "msign"), "NA": cell_name("nesterov", "adam"), "NM": MUON}
    nds = {k: row.paired.get(factorial_key("nds", c, "hidden")) for k, c in names.items()}
    cos = {k: row.paired.get(factorial_key("cos", names[k], "hidden")) for k in ("EA", "NM")}
    total = _split(nds["EA"], nds["NM"], cos["EA"], cos["NM"])
    if total is None or any(v is None or not v > 0 for v in nds.values()):
        return None
    log = {k: math.log(v) for k, v in nds.items()}
    return {
        "filter": log["EM"] - log["NM"],
        "map": log["NA"] - log["NM"],
        "interaction": log["EA"] - log["EM"] - log["NA"] + log["NM"],
        "alignment": total[1],
        "efficiency": total[0] - total[1],  # = log(q_NM / q_EA)
    }


def _paired_terms(row: CheckpointScalars) -> dict[str, float] | None:
    """The paired directions' log NDS ratio (AdamW over Muon, hidden matrices) split into its alignment and
    efficiency parts at one point, or ``None`` where either NDS is missing or <= 0."""
    get = row.paired.get
    split = _split(*(get(f"paired_{k}_{arm}_hidden") for k in ("nds", "cos") for arm in ("adamw", "muon")))
    return None if split is None else {"total": split[0], "alignment": split[1], "efficiency": split[0] - split[1]}


def _terms(data: LevelData, of, names: tuple[str, ...]) -> dict[str, Term]:
    """Per seed the mean of each per-point log term ``of(row)`` over its points, then a t interval across
    seeds, as factors (points where ``of`` gives ``None`` are left out and counted)."""
    per_seed: dict[str, list[float]] = {t: [] for t in names}
    n_points = excluded = 0
    for _, rows in sorted(arm_points(data, None).items()):
        terms = [t for t in (of(row) for row in rows) if t is not None]
        excluded += len(rows) - len(terms)
        n_points += len(terms)
        if terms:
            for t in names:
                per_seed[t].append(float(np.mean([x[t] for x in terms])))
    note = f"{excluded} points with an NDS <= 0 (or unmeasured) left out" if excluded else ""
    out = {}
    for t in names:
        x = per_seed[t]
        if not x:
            out[t] = Term(None, None, None, 0, 0, excluded, note or "not measured")
            continue
        inf = statistics.mean_inference(x)
        ci = None if inf.ci95 is None else [math.exp(v) for v in inf.ci95]
        out[t] = Term(math.exp(inf.value), ci, inf.value, len(x), n_points, excluded, note)
    return out


def decomposition(data: LevelData) -> dict[str, Term]:
    """The factorial's five terms (:data:`TERMS`; module docstring), each across seeds."""
    return _terms(data, _point_terms, TERMS)


def _gauss_newton_terms(row: CheckpointScalars) -> dict[str, float] | None:
    """The paired directions' log NDS ratio (hidden matrices) split into its Gauss–Newton and residual parts at
    one point, or ``None`` where an NDS or a Gauss–Newton part is missing or <= 0."""
    values = [row.paired.get(f"paired_{k}_{arm}_hidden") for k in ("nds", "ndsgn") for arm in ("adamw", "muon")]
    if any(v is None or not v > 0 for v in values):
        return None
    total, gauss_newton = math.log(values[0] / values[1]), math.log(values[2] / values[3])
    return {"total": total, "gauss_newton": gauss_newton, "residual": total - gauss_newton}


GAUSS_NEWTON_PARTS = {"total": "gn_total", "gauss_newton": "gauss_newton", "residual": "gn_residual"}


def paired_parts(data: LevelData) -> dict[str, Term]:
    """What the paired NDS ratio (AdamW's direction over Muon's, hidden matrices, at the same W and batch) is
    made of, in every design: ``total`` = ``alignment`` (cos², AdamW's closer gradient-following) x
    ``efficiency`` (q of Muon's over AdamW's), each a seed's mean log over its points, as factors; where the
    Gauss–Newton part was measured, also ``gn_total`` = ``gauss_newton`` x ``gn_residual`` (module docstring)
    at the points where it was (the keys of :data:`GAUSS_NEWTON_PARTS`)."""
    parts = _terms(data, _paired_terms, ("total", "alignment", "efficiency"))
    if not any("paired_ndsgn_adamw_hidden" in r.paired for rows in arm_points(data, None).values() for r in rows):
        return parts
    split = _terms(data, _gauss_newton_terms, tuple(GAUSS_NEWTON_PARTS))
    return parts | {GAUSS_NEWTON_PARTS[k]: t for k, t in split.items()}
