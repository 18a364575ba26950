r"""The record of one monitored step: a :class:`MonitorRow` (and its :class:`BlockSplit`), the JSON line
:class:`~curvlab.runs.monitor.CurvatureMonitor` writes into ``metrics.jsonl`` (its keys: that module's docstring).

Apart from the monitor so that both stay readable; :mod:`curvlab.runs.monitor` re-exports every name here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from curvlab.curvature.scalars import CheckpointScalars, layer_blocks_split, taylor_error, taylor_holds
from curvlab.curvature.scope import CURVATURE_KEYS, NAN_CURVATURE, DirectionCurvature, ScopeCurvature
from curvlab.util import schema
from curvlab.util.codec import Record

MONITOR_SCHEMA_VERSION = 1
ROW_KIND = "curvature"  # the "kind" of a monitor row in metrics.jsonl; training rows have none


@dataclass(frozen=True)
class BlockSplit(Record):
    """The block interaction matrix M of a monitored step (module docstring), under its ``grouping``
    (``"layer"``, ``"tensor"``, ``"kind"`` or ``"custom"``), with its block ``names`` and its sums."""

    grouping: str
    names: tuple[str, ...]
    matrix: tuple[tuple[float, ...], ...]
    within: float
    cross: float
    nds: float
    rho_within: float


@dataclass(frozen=True)
class MonitorRow:
    r"""The curvature of one monitored step Z (from :math:`W_k` to :math:`W_{k+1}`) on the held-out batches.

    Attributes:
        step: k, the number of steps done at W (the row describes the update that follows).
        status: ``"ok"``, ``"non-finite"`` or ``"undefined"`` (zero step); see ``message``.
        message: what was not finite or undefined, in one line (empty when all is well).
        loss: :math:`L_D(W)` on the held-out batches.
        split: the Taylor split over all trainable parameters (NaN where not computed).
        hidden: the same over the hidden 2-D matrices (``None`` when there are none, or Z is zero there).
        hidden_names: the parameters of that scope.
        blocks: the within/cross split (``None`` without a block grouping).
        heldout_tokens: loss terms in D.
        seconds: wall time of the measurement.
        estimator: what computed :math:`\langle Z, H[Z]\rangle` (so NDS, curvature penalty and predicted decrease):
            ``"exact"`` (HVPs) or another of :data:`~curvlab.curvature.estimators.ESTIMATORS`. The loss, first-order
            term, norms, cosine and realized decrease are exact whatever it is.
        error: the estimator's stated error on ``nds`` (``None``: exact up to rounding; on the curvature
            penalty and the predicted decrease it is ``error`` x ``update_norm``² / 2).
        unmeasured: what the monitor measures exactly but its estimator can't, left ``None`` here (``"hidden"``).
    """

    step: int
    status: str
    message: str
    loss: float
    split: DirectionCurvature
    hidden: DirectionCurvature | None
    blocks: BlockSplit | None
    heldout_tokens: int
    seconds: float
    hidden_names: tuple[str, ...] = ()
    estimator: str = "exact"
    error: float | None = None
    unmeasured: tuple[str, ...] = ()
    SCHEMA_VERSION: ClassVar[int] = MONITOR_SCHEMA_VERSION
    WHAT: ClassVar[str] = "curvature row"
    FIXED_KEYS: ClassVar[dict[str, Any]] = {"kind": ROW_KIND}  # (metrics.jsonl holds training rows too)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def nds(self) -> float:
        return self.split.nds

    # by hand: the all-parameter split's keys sit at the top level, the kind and version first
    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": ROW_KIND,
            "schema_version": MONITOR_SCHEMA_VERSION,
            "step": self.step,
            "status": self.status,
            "message": self.message,
            "loss": self.loss,
            **self.split.to_dict(),
            "hidden": None if self.hidden is None else {**self.hidden.to_dict(), "names": list(self.hidden_names)},
            "blocks": None if self.blocks is None else self.blocks.to_dict(),
            "heldout_tokens": self.heldout_tokens,
            "seconds": self.seconds,
            "estimator": self.estimator,
            "error": self.error,
            "unmeasured": list(self.unmeasured),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MonitorRow:
        """A row read back from its JSON; refuses another kind or schema version."""
        schema.check(d, cls)
        hidden = None if d.get("hidden") is None else ScopeCurvature.from_dict(d["hidden"])
        return cls(
            step=int(d["step"]),
            status=d["status"],
            message=d["message"],
            loss=float(d["loss"]),
            split=DirectionCurvature.from_dict({k: d[k] for k in CURVATURE_KEYS if k in d}),
            hidden=None if hidden is None else hidden.curvature(),
            blocks=None if d.get("blocks") is None else BlockSplit.from_dict(d["blocks"]),
            heldout_tokens=int(d["heldout_tokens"]),
            seconds=float(d["seconds"]),
            hidden_names=() if hidden is None else hidden.names,
            estimator=d.get("estimator", "exact"),  # (rows written before the estimators: exact, by HVPs)
            error=None if d.get("error") is None else float(d["error"]),
            unmeasured=tuple(d.get("unmeasured", ())),
        )

    def log_scalars(self, prefix: str = "curvature/") -> dict[str, float]:
        """The row's finite scalars for a metrics logger: ``{prefix}nds``, ..., ``{prefix}hidden_nds``, ...,
        ``{prefix}within``, ``{prefix}cross``, ``{prefix}rho_within``, ``{prefix}ok`` (1.0 or 0.0) and, by an
        estimator that states one, ``{prefix}nds_error``."""
        values = {"loss": self.loss, **self.split.to_dict(), "ok": float(self.ok)}
        values |= {} if self.error is None else {"nds_error": self.error}
        if self.hidden is not None:
            values |= {f"hidden_{k}": v for k, v in self.hidden.to_dict().items()}
        if self.blocks is not None:
            values |= {"within": self.blocks.within, "cross": self.blocks.cross, "rho_within": self.blocks.rho_within}
        return {f"{prefix}{k}": float(v) for k, v in values.items() if math.isfinite(v)}

    def scalars(self, val_loss: float = math.nan, optimizer: str | None = None) -> CheckpointScalars:
        """The row as the per-checkpoint scalars the studies aggregate; a row whose status is not ``ok``
        keeps its message and fails the Taylor check, and so does a row a cheap estimator measured (its message
        says which, with its stated error): its ⟨Z, HZ⟩ is not exact, so neither is the check."""
        blocks = self.blocks
        within_layers, nds_layers = (
            (math.nan, math.nan) if blocks is None else layer_blocks_split(blocks.names, blocks.matrix)
        )
        return CheckpointScalars(
            step=self.step,
            val_loss=val_loss,
            all=self.split,
            hidden=NAN_CURVATURE if self.hidden is None else self.hidden,
            within=math.nan if blocks is None else blocks.within,
            cross=math.nan if blocks is None else blocks.cross,
            rho_within=math.nan if blocks is None else blocks.rho_within,
            within_layers=within_layers,
            nds_layers=nds_layers,
            embed_head_share=math.nan,
            taylor_error=taylor_error(self.split),
            taylor_ok=self.ok and self.estimator == "exact" and taylor_holds(self.split),
            optimizer=optimizer,
            status=self.status,
            message=self.message if self.estimator == "exact" or self.message else self._estimated_note(),
        )

    def _estimated_note(self) -> str:
        error = "no error stated" if self.error is None else f"stated error {self.error:.3g}"
        return f"NDS estimated by {self.estimator} ({error}): not exact"
