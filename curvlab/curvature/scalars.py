r"""The per-checkpoint scalars that the studies aggregate (:class:`CheckpointScalars`), and their names.

One record per analysed checkpoint (:meth:`curvlab.analysis.report.CurvatureReport.scalars`) or per
monitored step (:meth:`curvlab.runs.monitor.MonitorRow.scalars`); window means, track rows and the
headline read these.

JSON (flat, one object per checkpoint; the shape of a compare window member and of a track row)::

    step, val_loss, <SCOPE_KEYS>, hidden_<SCOPE_KEYS>, within, cross, rho_within, within_layers,
    nds_layers, embed_head_share, taylor_error, taylor_ok, [paired_{nds,cos,q,norm}_{direction}_{scope}],
    [control_*], [factorial_*],
    [optimizer, multiplier, lr, phase, on_plateau, lambda_max, overlap_top_k, status, message]

The bracketed context keys are written only where known (a track row has them, a window member not).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np

from curvlab.curvature.scope import DirectionCurvature
from curvlab.curvature.taylor import BlockMatrix

SCOPE_KEYS = tuple(f.name for f in fields(DirectionCurvature))  # the Taylor split of one scope
HIDDEN_KEYS = tuple(f"hidden_{k}" for k in SCOPE_KEYS)
BLOCK_KEYS = ("within", "cross", "rho_within", "within_layers", "nds_layers")  # the layer-block decomposition
CHECK_KEYS = ("embed_head_share", "taylor_error")
# every float scalar of a checkpoint, by its flat name (paired ones come on top, where measured)
SCALAR_KEYS = ("val_loss", *SCOPE_KEYS, *HIDDEN_KEYS, *BLOCK_KEYS, *CHECK_KEYS)
# the quantities the matched comparisons put one run over the other on
RATIO_KEYS = ("nds", "first_order", "curvature_penalty", "update_norm")
CONTEXT_KEYS = (
    *("optimizer", "multiplier", "lr", "phase", "on_plateau"),  # where a tracked checkpoint sits
    *("lambda_max", "overlap_top_k"),  # a tracked report's spectrum
    *("status", "message"),  # a monitored step's
)
TAYLOR_TOLERANCE = 0.5
PAIRED_PREFIXES = ("paired_", "control_", "factorial_")  # the keys of CheckpointScalars.paired
_LAYER_BLOCK = re.compile(r"^layer\d+$")


def scope_key(quantity: str, scope: str) -> str:
    """The flat name of a scalar in a scope: ``nds`` over all parameters, ``hidden_nds`` on the hidden matrices."""
    return quantity if scope == "all" else f"hidden_{quantity}"


def taylor_error(curvature: DirectionCurvature) -> float:
    r"""The scale-aware Taylor error :math:`|I_1 - I_2 - \Delta| / \max(|\Delta|, |I_1|)` (Δ the realized
    decrease; :math:`I_1` keeps a step whose realized decrease happens to be near zero from failing)."""
    scale = max(abs(curvature.realized), abs(curvature.first_order))
    return abs(curvature.predicted - curvature.realized) / scale if scale else 0.0


def taylor_holds(curvature: DirectionCurvature, *, tolerance: float = TAYLOR_TOLERANCE) -> bool:
    """Whether the second-order prediction is within ``tolerance`` of the realized decrease
    (:func:`taylor_error`); a step that fails it still has an NDS."""
    return taylor_error(curvature) <= tolerance


def embed_head_share(blocks: BlockMatrix, grouping: str, update_norm: float) -> float:
    """Share of ||Z||² in the ``embedding`` and ``head`` blocks of a ``layer`` grouping (``nan`` for
    other groupings)."""
    if grouping != "layer":
        return math.nan
    norms = dict(zip(blocks.names, blocks.norm.tolist()))
    return (norms.get("embedding", 0.0) ** 2 + norms.get("head", 0.0) ** 2) / update_norm**2


def layer_blocks_split(names: Sequence[str], matrix: Any) -> tuple[float, float]:
    """(within, total) of a block matrix (``names``, L x L ``matrix``) restricted to the transformer-layer
    blocks (``layerN``): within / total is rho_within of the step without its embedding, final-norm and
    head parts. NaN without layer blocks."""
    idx = [i for i, n in enumerate(names) if _LAYER_BLOCK.match(n)]
    if not idx:
        return math.nan, math.nan
    M = np.asarray(matrix, dtype=float)[np.ix_(idx, idx)]
    return float(np.trace(M)), float(M.sum())


def _float(x: Any) -> float:
    return math.nan if x is None else float(x)


@dataclass(frozen=True)
class CheckpointScalars:
    r"""The scalars of one checkpoint's step (see the module docstring for the JSON).

    Attributes:
        all, hidden: the Taylor split over all parameters and over the hidden matrices (NaN where the
            model has none).
        within, cross, rho_within: the block matrix's trace, off-diagonal sum and trace / NDS.
        within_layers, nds_layers: trace and sum of the block matrix restricted to the transformer
            layers (``layerN``): rho_within of the hidden scope is their ratio.
        embed_head_share: share of :math:`\|Z\|^2` in the embedding and head blocks (NaN unless the
            grouping is ``layer``).
        taylor_error, taylor_ok: :func:`taylor_error` and :func:`taylor_holds`.
        paired: ``paired_{nds,cos,q,norm}_{direction}_{scope}`` of the paired directions (empty without a
            shadow), the ``control_*`` scalars of the controls (:mod:`curvlab.analysis.controls`), and the
            ``factorial_*`` scalars of the factorial's cells (:mod:`curvlab.analysis.factorial`).
        optimizer ... message: where the checkpoint sits (a track row's context), ``None`` where unknown.
    """

    step: int
    val_loss: float
    all: DirectionCurvature
    hidden: DirectionCurvature
    within: float
    cross: float
    rho_within: float
    within_layers: float
    nds_layers: float
    embed_head_share: float
    taylor_error: float
    taylor_ok: bool
    paired: Mapping[str, float] = field(default_factory=dict)
    optimizer: str | None = None
    multiplier: float | None = None
    lr: float | None = None
    phase: str | None = None
    on_plateau: bool | None = None
    lambda_max: float | None = None
    overlap_top_k: float | None = None
    status: str | None = None
    message: str | None = None

    def value(self, key: str) -> float:
        """The float scalar named ``key`` (a name of :data:`SCALAR_KEYS`, or a paired one).

        Raises:
            KeyError: no such scalar here (a paired one where the checkpoint has no shadow).
        """
        if key in self.paired:
            return self.paired[key]
        if key in SCOPE_KEYS:
            return getattr(self.all, key)
        if key in HIDDEN_KEYS:
            return getattr(self.hidden, key.removeprefix("hidden_"))
        if key in SCALAR_KEYS:
            return getattr(self, key)
        raise KeyError(key)

    def has(self, key: str) -> bool:
        return key in self.paired or key in SCALAR_KEYS

    def floats(self) -> dict[str, float]:
        """Every float scalar by name (:data:`SCALAR_KEYS`, then the paired ones): what window means average."""
        return {**{k: self.value(k) for k in SCALAR_KEYS}, **self.paired}

    def with_context(self, **context: Any) -> CheckpointScalars:
        """A copy with context fields (``optimizer``, ``multiplier``, ..., :data:`CONTEXT_KEYS`) set."""
        return replace(self, **context)

    # by hand: the JSON is flat (both scopes' DirectionCurvature keys, the hidden one's prefixed, the paired
    # scalars at the top level; context keys only where known; a scalar an older file lacks reads as NaN)
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"step": self.step, **{k: self.value(k) for k in SCALAR_KEYS}}
        out.update({"taylor_ok": self.taylor_ok, **self.paired})
        out.update({k: getattr(self, k) for k in CONTEXT_KEYS if getattr(self, k) is not None})
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CheckpointScalars:
        """The record of :meth:`to_dict`'s JSON; a scalar it lacks (a file from before it was recorded,
        or null in strict JSON) reads as NaN."""
        scope = {k: _float(d.get(k)) for k in SCOPE_KEYS}
        hidden = {k: _float(d.get(f"hidden_{k}")) for k in SCOPE_KEYS}
        return cls(
            step=int(d["step"]),
            val_loss=_float(d.get("val_loss")),
            all=DirectionCurvature(**scope),
            hidden=DirectionCurvature(**hidden),
            **{k: _float(d.get(k)) for k in (*BLOCK_KEYS, *CHECK_KEYS)},
            taylor_ok=bool(d["taylor_ok"]),
            paired={k: _float(v) for k, v in d.items() if k.startswith(PAIRED_PREFIXES)},
            **{k: d.get(k) for k in CONTEXT_KEYS},
        )
