r"""What ``curvlab reproduce --preset scaling`` concludes (``summary.json``, :class:`ScalingSummary`): the
AdamW/Muon ratios at each model size of a ladder, and their power laws in the non-embedding parameter count,
extrapolated to GPT-2 small beside the paper's 1.76 (issue 51; docs/science.md section 17).

* The learning rates are transferred across widths by one rule (:func:`transferred_lrs`): the hidden
  matrices' update RMS falls as 1/width for both arms. AdamW's hidden-matrix lr goes as :math:`w_0/w` (µP:
  its update is entrywise about lr), Muon's as :math:`\sqrt{w_0/w}` (at its original scale an orthogonalized
  step of an :math:`m \times n` matrix with aspect ratio fixed has entries of RMS :math:`\propto 1/\sqrt{w}`);
  embeddings, head and norms keep the base lr (µP leaves them). Each rung checks the rule on a 3-point grid.
* At each rung (:func:`rung_result`), from its ``levels.json`` alone: the paired NDS, alignment (cos) and
  direction-efficiency (q) ratios, and the between-run NDS ratio on the hidden matrices and on all
  parameters, each a primary family entry estimated per seed (descriptive: a rung judges nothing).
* Across rungs (:func:`scaling_fits`): each quantity's rung estimates fitted as a power law of the
  non-embedding parameters (:func:`curvlab.inference.loglog.log_log_fit`), predicted at GPT-2 small's
  (85M: an extrapolation, and labelled one). What the fit is judged on was registered before the run
  (:data:`SCALING_RULE`): the slope's sign, and the 124M prediction interval against the paper's 1.76.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np
import torch

from curvlab.errors import CurvlabError
from curvlab.inference.loglog import LogLogFit, log_log_fit
from curvlab.inference.statistics import magnitude_verdict
from curvlab.models.gpt import GPT, get_config
from curvlab.models.roles import parameter_roles
from curvlab.studies.design import Network
from curvlab.studies.paper import CLAIMS, PRIMARY
from curvlab.studies.primary import PrimaryEntry, estimated
from curvlab.studies.records import JsonFile, LevelData
from curvlab.util.codec import Record
from curvlab.util.versions import SoftwareVersions

SCALING_SCHEMA_VERSION = 1
PAPER_NDS_RATIO = CLAIMS["nds_ratio"].paper  # 1.76: all parameters, between runs at matched loss, 124M
PAPER_MODEL = "gpt2-124m"
_CLAIM = {c.name: c for c in PRIMARY}
# each rung's quantities: the primary family's claims (the between-run ratio also over all parameters, the
# scope of the paper's 1.76), estimated per seed. q is Muon over AdamW, the others AdamW over Muon
QUANTITIES = {
    "paired_nds_ratio": _CLAIM["paired_direction_ratio"],
    "alignment_ratio": _CLAIM["alignment_ratio"],
    "q_ratio": _CLAIM["direction_efficiency_ratio"],
    "between_nds_ratio": _CLAIM["between_nds_ratio"],
    "between_nds_ratio_all": replace(_CLAIM["between_nds_ratio"], scope="all"),
}
# Registered before the scaling design's first run (issue 51): the fits judged, and on what. Each fit is over the
# rungs' estimates (a rung's seeds share its learning rates and whatever else a rung gets wrong: one point a rung,
# not one a seed). A slope whose 95% interval lies above 0 "rises with size", below 0 "falls with size", else "no
# trend resolved"; the 124M prediction interval against 1.76 by the magnitude rule of the primary family
# (statistics.magnitude_verdict: "larger", "smaller", "consistent", or "uninformative" when wider than a factor of
# 2 each way). No judged verdict when a rung has no estimate. The between-run ratio over all parameters is the
# paper's own quantity; q is the learning-rate-free one (docs/science.md section 12). The other fits are shown,
# descriptive.
SCALING_RULE = {
    "judged": ["between_nds_ratio_all", "q_ratio"],
    "fit": "least squares of the log of each rung's estimate (its seeds' geometric mean) on log N, n_rungs - 2 df",
    "slope": "the sign of the slope by its 95% interval",
    "at_124m": (
        f"the 95% prediction interval of one new rung at {PAPER_MODEL}'s non-embedding parameters against 1.76, by the "
        "primary family's magnitude rule; an extrapolation at the ladder's tokens per run, not a trained GPT-2 small"
    ),
    "registered": "before",
}


def transferred_lrs(base: dict[str, dict[str, float]], base_width: int, width: int) -> dict[str, dict[str, float]]:
    r"""The learning rates at ``width`` by the scaling rule (module docstring), from those tuned at ``base_width``.

    .. math::
        \eta^{\text{AdamW}}_{\text{hidden}}(w) = \eta^{\text{AdamW}} \frac{w_0}{w}, \qquad
        \eta^{\text{Muon}}(w) = \eta^{\text{Muon}} \sqrt{\frac{w_0}{w}},

    the embeddings, head and norms (AdamW's ``lr``, Muon's AdamW side ``adam_lr``) at the base's (its AdamW lr, and
    its Muon AdamW side's, equal in the committed table).

    Args:
        base: the tuned options at ``base_width``: ``{"adamw": {"lr"}, "muon": {"lr", "adam_lr"}}``.
        base_width: the width (``n_embd``) they were tuned at.
        width: the rung's width.

    Returns:
        ``{"adamw": {"lr", "hidden_lr"}, "muon": {"lr", "adam_lr"}}`` (6 significant digits).

    Raises:
        CurvlabError: a width that is not a positive integer.
    """
    if not (isinstance(width, int) and isinstance(base_width, int) and width > 0 and base_width > 0):
        raise CurvlabError(f"widths must be positive integers, got {base_width} and {width}")
    ratio = base_width / width
    adamw, muon = base["adamw"]["lr"], base["muon"]["lr"]

    def rounded(x: float) -> float:
        return float(f"{x:.6g}")

    return {
        "adamw": {"lr": rounded(adamw), "hidden_lr": rounded(adamw * ratio)},
        "muon": {"lr": rounded(muon * math.sqrt(ratio)), "adam_lr": rounded(base["muon"].get("adam_lr", adamw))},
    }


def parameter_counts(model: str, overrides: dict[str, Any] | None = None) -> tuple[int, int]:
    """A curvlab GPT's parameters outside its embeddings and head (the count scaling laws use), and all of them,
    by the parameters' structural roles, on the meta device (nothing is allocated)."""
    with torch.device("meta"):
        net = GPT(get_config(model, **(overrides or {})))
    roles = parameter_roles(net)
    params = dict(net.named_parameters())  # (a tied head once)
    inner = sum(p.numel() for n, p in params.items() if roles[n] not in ("embedding", "head"))
    return inner, sum(p.numel() for p in params.values())


def model_size(network: Network) -> dict[str, int]:
    """A design's model: ``n_params`` (non-embedding), ``n_params_total``, ``n_embd`` and ``n_layer``."""
    config = get_config(network.model, **network.model_overrides)
    inner, total = parameter_counts(network.model, network.model_overrides)
    return {"n_params": inner, "n_params_total": total, "n_embd": config.n_embd, "n_layer": config.n_layer}


@dataclass(frozen=True)
class RungResult(Record):
    """One rung: its size, the learning rates it ran at (``lr``: each arm's hidden-matrix lr; ``options``:
    every option), the 3-point check of the rule (``check``: per arm the grid, its best point and whether that
    differs from the rule's, on one check seed), and each quantity's estimate (a :class:`PrimaryEntry`, per seed)."""

    rung: str
    n_params: int  # non-embedding
    n_params_total: int
    n_embd: int
    n_layer: int
    lr: dict[str, float]
    options: dict[str, dict[str, float]]
    check: dict[str, dict[str, Any]]
    n_seeds: int
    quantities: dict[str, PrimaryEntry]

    def value(self, name: str) -> float | None:
        return self.quantities[name].value

    def ci95(self, name: str) -> list[float] | None:
        return self.quantities[name].ci95

    def seed_values(self, name: str) -> list[float]:
        """The quantity's per-seed values, when it was estimated as a ratio."""
        e = self.quantities[name]
        return [x["value"] for x in e.per_seed] if e.kind == "ratio" else []

    def fit_value(self, name: str) -> float | None:
        """What the fit takes at this rung: the seeds' geometric mean, when every seed's value is positive
        (``None``: not estimated as a ratio, or a seed's value <= 0)."""
        values = np.asarray(self.seed_values(name), dtype=float)
        if values.size == 0 or not np.all(np.isfinite(values) & (values > 0)):
            return None
        return float(np.exp(np.log(values).mean()))


def rung_result(
    name: str,
    size: dict[str, int],
    lrs: dict[str, dict[str, float]],
    check: dict[str, dict[str, Any]],
    levels: LevelData,
) -> RungResult:
    """One rung's row (module docstring) from its ``levels.json``, its size (:func:`model_size`), the options it
    ran at and its tuning check."""
    entries = dict(zip(QUANTITIES, estimated(levels, tuple(QUANTITIES.values()))))
    hidden = {"adamw": lrs["adamw"].get("hidden_lr", lrs["adamw"]["lr"]), "muon": lrs["muon"]["lr"]}
    n_seeds = max((e.n_seeds for e in entries.values()), default=0)
    return RungResult(name, **size, lr=hidden, options=lrs, check=check, n_seeds=n_seeds, quantities=entries)


@dataclass(frozen=True)
class ScalingFit(Record):
    """One quantity's power law across rungs (``fit``; ``None``: not measured, ``note`` says why), at
    ``at_124m`` non-embedding parameters, with its verdicts where :data:`SCALING_RULE` judges it (``None``: not
    judged, or withheld because a rung has no estimate)."""

    quantity: str
    fit: LogLogFit | None
    judged: bool
    trend: str | None = None  # "rises with size", "falls with size", "no trend resolved"
    against_paper: str | None = None  # the 124M interval against 1.76: larger, smaller, consistent, uninformative
    note: str = ""


def _trend(fit: LogLogFit) -> str:
    lo, hi = fit.slope_ci95
    return "rises with size" if lo > 0 else "falls with size" if hi < 0 else "no trend resolved"


def scaling_fits(rungs: list[RungResult], at: int) -> list[ScalingFit]:
    """Each quantity's fit over the rungs' estimates (:meth:`RungResult.fit_value`), predicted at ``at``; a rung
    without one is left out of that fit and named, and the fit's judged verdicts are then withheld."""
    out = []
    for name in QUANTITIES:
        judged = name in SCALING_RULE["judged"]
        points = [(r.n_params, r.fit_value(name)) for r in rungs]
        missing = [r.rung for r, (_, y) in zip(rungs, points) if y is None]
        note = f"no estimate (a seed's value <= 0, or not a ratio) at {', '.join(missing)}" if missing else ""
        try:
            fit = log_log_fit([x for x, y in points if y is not None], [y for _, y in points if y is not None], at)
        except CurvlabError as e:
            out.append(ScalingFit(name, None, judged, note="; ".join(filter(None, [str(e), note]))))
            continue
        if not judged or missing:
            why = "; judged verdicts withheld" if judged and missing else ""
            out.append(ScalingFit(name, fit, judged, note=note + why))
            continue
        out.append(ScalingFit(name, fit, judged, _trend(fit), magnitude_verdict(fit.prediction_pi95, PAPER_NDS_RATIO)))
    return out


@dataclass(frozen=True)
class ScalingSummary(JsonFile):
    """``summary.json`` of the scaling design: one :class:`RungResult` per rung (``sizes``) in the ladder's order,
    the fits (``fits``, and ``fit``: each fitted quantity's slope and 124M prediction, the schema issue 51
    reads), where the prediction is made (``at_124m``: GPT-2 small's non-embedding parameters), the rule
    registered before the run, and how long it took."""

    STRICT: ClassVar[bool] = True

    preset: str
    base: str
    seeds: list[int]
    base_width: int
    tokens_per_run: int
    sizes: list[RungResult]
    fits: list[ScalingFit]
    fit: dict[str, dict[str, Any]]
    at_124m: int
    rule: dict[str, Any]
    timing: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    versions: SoftwareVersions | None = None
    figures: list[str] = field(default_factory=list)
    schema_version: int = SCALING_SCHEMA_VERSION
    SCHEMA_VERSION: ClassVar[int] = SCALING_SCHEMA_VERSION
    WHAT: ClassVar[str] = "scaling summary.json"


def fit_table(fits: list[ScalingFit]) -> dict[str, dict[str, Any]]:
    """The ``fit`` field: per fitted quantity its slope, the slope's interval, the 124M prediction and its
    prediction interval."""
    return {
        f.quantity: {
            "slope": f.fit.slope,
            "slope_ci95": f.fit.slope_ci95,
            "at_124m": f.fit.prediction,
            "at_124m_pi95": f.fit.prediction_pi95,
        }
        for f in fits
        if f.fit is not None
    }


@dataclass
class ScalingLevels(JsonFile):
    """``levels.json`` of the scaling design: every rung's :class:`LevelData`, by rung name."""

    rungs: dict[str, LevelData]
    schema_version: int = SCALING_SCHEMA_VERSION
    SCHEMA_VERSION: ClassVar[int] = SCALING_SCHEMA_VERSION
    WHAT: ClassVar[str] = "scaling levels.json"
    JSON_KEYS: ClassVar[tuple] = ("schema_version", ...)

    def save(self, path, indent: int | None = None) -> None:
        """Unindented, as the robustness design's levels."""
        super().save(path, indent)
