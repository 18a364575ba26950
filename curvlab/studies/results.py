"""The results of a reproduction, as typed data: the per-level data and the headline derived from it.

``analysis/levels.json`` (:class:`LevelData`, ``LEVELS_SCHEMA_VERSION``) holds everything measured:
every matched comparison of every seed (each level's windows, with every analysed checkpoint's scalars)
and every tracked trajectory. ``summary.json`` (:class:`Summary`, ``SUMMARY_SCHEMA_VERSION``) holds
the headline, a list of :class:`HeadlineEntry`::

    name, scope ("all" | "hidden"), quantity, value, ci95 [lo, hi] (or null), n_levels, n_seeds,
    per_level [{seed, ... , value}], paper, paper_text, verdict, note

:func:`headline` derives every entry from a :class:`LevelData` alone (so the summary can be
re-derived from ``levels.json``, and the tests do so), with the statistics of
:mod:`curvlab.studies.statistics` and the claims of :mod:`curvlab.studies.paper`:

* matched-loss ratios (AdamW over Muon, and over the RMS-matched Muon arm): ratio of the sums over
  seeds and levels off the unigram plateau of the window means, e.g. sum NDS_AdamW / sum NDS_Muon;
* each optimizer's embedding+head share of ||Z||² at matched loss: the mean over levels;
* the Taylor error |predicted − realized| / max(|realized|, |I1|): the median over levels of each
  window's median (judges the claim "predicted ≈ realized", and nothing else);
* the equal-step NDS ratio: tracked checkpoints at equal steps, both in the stable phase and off
  the plateau;
* the Zipf sweep: trajectory-mean NDS (all tracked checkpoints after warmup, unfiltered) divided by
  Muon's at the first s, pooled over seeds; the Muon baseline is part of each seed's statistic, so its
  uncertainty is carried;
* rho_within in the first and last third of training (s = first s): sum(within) / sum(NDS) over the
  tracked checkpoints there; the hidden scope uses the transformer-layer blocks only.

Headline intervals are seed-level (:func:`curvlab.studies.statistics.estimate`): every headline entry is
*descriptive* (no verdict, no tally).

``summary.json`` also holds the pre-registered **primary family** (:func:`primary_family`, a list of
:class:`PrimaryEntry`, one per :data:`curvlab.studies.paper.PRIMARY` claim)::

    name, scope, quantity, statement, claimed, kind, method, value, ci95, n_seeds, n_units, paper,
    paper_text, direction, magnitude, p, p_holm, per_seed [{seed, ...}], note

Per seed, each claim aggregates that seed's units (the mean over its matched levels, or over its
trajectory), then infers across seeds (:func:`curvlab.studies.statistics.ratio_inference` or
:func:`curvlab.studies.statistics.mean_inference`); Holm's correction runs over the claims that got a test
(3 seeds or more). And the **A/A calibration** (:func:`calibration`, a :class:`Calibration`)::

    false_verdict_rate, n_tests, per_test [{comparison, claim, n_seeds, p_holm, direction}]

from same-arm comparisons (``"adamw/adamw"``, ``"muon/muon"``: two disjoint seeds of one arm per
record), put through the same pipeline for the claims that compare the two sides of a comparison.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from curvlab.curvature.scalars import RATIO_KEYS, CheckpointScalars, scope_key
from curvlab.errors import CurvlabError
from curvlab.studies import statistics as st
from curvlab.studies.compare import Comparison
from curvlab.studies.paper import CLAIMS, PRIMARY, Claim, PrimaryClaim, judged_claims
from curvlab.studies.tuning import TuningRecord
from curvlab.util import schema
from curvlab.util.atomic import atomic_write_text

LEVELS_SCHEMA_VERSION = 1
SUMMARY_SCHEMA_VERSION = 2  # 2: the primary family and the A/A calibration; headline descriptive
SCOPES = ("all", "hidden")
MATCHED = {"muon": "adamw/muon", "muon-moonlight": "adamw/muon-moonlight"}  # Muon arm -> comparison name
RATIO_NAMES = {k: f"{k}_ratio" for k in RATIO_KEYS}  # quantity -> its headline entry


@dataclass
class ComparisonRecord:
    """One matched comparison of one seed: AdamW's run against one Muon arm's (or why there is none)."""

    name: str  # "adamw/muon" or "adamw/muon-moonlight"
    seed: int
    s: float
    comparison: Comparison | None
    error: str | None = None  # why no comparison (e.g. the runs never overlap in the stable phase)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "seed": self.seed,
            "s": self.s,
            "error": self.error,
            "comparison": None if self.comparison is None else self.comparison.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ComparisonRecord:
        c = None if d["comparison"] is None else Comparison.from_dict(d["comparison"])
        return cls(d["name"], d["seed"], d["s"], c, d["error"])


@dataclass
class TrackRecord:
    """The tracked checkpoints of one run (``track_run`` rows)."""

    arm: str
    s: float
    seed: int
    steps: int  # the run's length (the thirds of training are thirds of it)
    warmup_steps: int
    rows: list[CheckpointScalars]

    def to_dict(self) -> dict[str, Any]:
        return {
            "arm": self.arm,
            "s": self.s,
            "seed": self.seed,
            "steps": self.steps,
            "warmup_steps": self.warmup_steps,
            "rows": [r.to_dict() for r in self.rows],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrackRecord:
        rows = [CheckpointScalars.from_dict(r) for r in d["rows"]]
        return cls(d["arm"], d["s"], d["seed"], d["steps"], d["warmup_steps"], rows)

    def after_warmup(self) -> list[CheckpointScalars]:
        """The checkpoints in the stable phase (after warmup, before the decay) and off the unigram plateau:
        what trajectory means average. The decay phase is left out: there Z shrinks with the multiplier,
        and the arms spend it at different losses."""
        stable = [r for r in self.off_plateau() if r.phase in (None, "stable")]
        return [r for r in stable if r.step >= self.warmup_steps]

    def off_plateau(self) -> list[CheckpointScalars]:
        """The checkpoints off the unigram plateau (kept out of the headline, like matched levels there:
        NDS is tiny and changes sign there, and the arms spend different times on it)."""
        return [r for r in self.rows if not r.on_plateau]


@dataclass(frozen=True)
class SeedBand:
    """One scalar along the trajectories of several seeds: at each step every track has, the mean over
    the seeds and the lowest and highest seed's value."""

    steps: list[int]
    mean: np.ndarray
    low: np.ndarray
    high: np.ndarray


def seed_band(tracks: Sequence[TrackRecord], key: str) -> SeedBand:
    """:class:`SeedBand` of the scalar ``key`` (a :data:`~curvlab.curvature.scalars.SCALAR_KEYS` name) over ``tracks``,
    at the steps common to all of them."""
    steps = sorted(set.intersection(*({r.step for r in t.rows} for t in tracks)))
    values = np.array([[next(r.value(key) for r in t.rows if r.step == k) for k in steps] for t in tracks])
    return SeedBand(steps, values.mean(0), values.min(0), values.max(0))


@dataclass
class LevelData:
    """Everything measured in one reproduction (``analysis/levels.json``)."""

    comparisons: list[ComparisonRecord]
    tracks: list[TrackRecord]
    plateau_ceiling: float | None
    s_values: list[float]
    schema_version: int = LEVELS_SCHEMA_VERSION
    SCHEMA_VERSION: ClassVar[int] = LEVELS_SCHEMA_VERSION
    WHAT: ClassVar[str] = "levels.json"

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "plateau_ceiling": self.plateau_ceiling,
            "s_values": self.s_values,
            "comparisons": [c.to_dict() for c in self.comparisons],
            "tracks": [t.to_dict() for t in self.tracks],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LevelData:
        schema.check(d, cls)
        return cls(
            [ComparisonRecord.from_dict(c) for c in d["comparisons"]],
            [TrackRecord.from_dict(t) for t in d["tracks"]],
            d["plateau_ceiling"],
            d["s_values"],
        )

    def save(self, path: str | Path) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> LevelData:
        return schema.load(path, cls)

    def track(self, arm: str, s: float) -> list[TrackRecord]:
        return sorted((t for t in self.tracks if t.arm == arm and t.s == s), key=lambda t: t.seed)

    def matched(self, name: str) -> list[ComparisonRecord]:
        return sorted((c for c in self.comparisons if c.name == name), key=lambda c: c.seed)

    def against_adamw(self) -> dict[str, list[Comparison]]:
        """Muon arm -> its comparisons with AdamW that have levels off the plateau, in seed order (the A/A
        calibration comparisons, "adamw/adamw" and "muon/muon", are not among them)."""
        arms: dict[str, list[Comparison]] = {}
        for r in sorted(self.comparisons, key=lambda c: c.seed):
            first, second = r.name.split("/")
            if first == "adamw" != second and r.comparison is not None and r.comparison.headline_levels:
                arms.setdefault(second, []).append(r.comparison)
        return arms


@dataclass
class HeadlineEntry:
    """One descriptive headline number with its seed-level interval, its units and the paper's number
    (``verdict`` is always ``"descriptive"``: only the primary family is judged)."""

    name: str
    scope: str
    quantity: str
    value: float | None
    ci95: list[float] | None
    n_levels: int
    n_seeds: int
    per_level: list[dict[str, Any]]
    paper: float | None
    paper_text: str
    verdict: str
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ZipfPoint:
    """Trajectory-mean NDS of one optimizer at one s, over Muon's at the first s (both pooled over seeds)."""

    arm: str
    s: float
    scope: str
    value: float
    ci95: list[float] | None
    n_seeds: int
    n_checkpoints: int
    per_seed: list[float]  # each seed's trajectory mean (not normalized)
    seeds: list[int] = field(default_factory=list)  # the seed of each per_seed value (older summaries: none)


@dataclass(frozen=True)
class PrimaryEntry:
    """One claim of the primary family, judged (module docstring; :mod:`curvlab.studies.statistics`).

    ``direction``: supported / contradicted / inconclusive, ``"descriptive: fewer than 3 seeds"`` or
    ``"not measured"``; ``magnitude``: consistent / larger / smaller / uninformative against ``paper``
    (``None`` without a paper number); ``p`` the unadjusted two-sided p-value, ``p_holm`` Holm's over
    the family (``None`` when not tested); ``kind`` what was judged (``"ratio"``, or ``"difference"``,
    also when a ratio's denominator had no settled sign: then ``note`` says so)."""

    name: str
    scope: str
    quantity: str
    statement: str
    claimed: str  # e.g. "greater than 1"
    kind: str
    method: str
    value: float | None
    ci95: list[float] | None
    n_seeds: int
    n_units: int
    paper: float | None
    paper_text: str
    direction: str
    magnitude: str | None
    p: float | None
    p_holm: float | None
    per_seed: list[dict[str, Any]] = field(default_factory=list)
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PrimaryEntry:
        return cls(**d)


@dataclass(frozen=True)
class Calibration:
    """The A/A calibration: the share of same-arm tests whose direction verdict asserted a difference
    (NaN when there were no tests), over ``n_tests`` tests with 3 seeds or more, and each test."""

    false_verdict_rate: float = float("nan")
    n_tests: int = 0
    per_test: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Calibration:
        return cls(d["false_verdict_rate"], d["n_tests"], d.get("per_test", []))


@dataclass(frozen=True)
class QuadraticRecord:
    """The quadratic model's closed-form checks in ``summary.json`` (:func:`curvlab.studies.quadratic.quadratic_study`'s
    example): Muon's NDS, its contraction Γ² and gradient descent's two-step contraction."""

    muon_nds: float
    muon_contraction: float
    gd_two_step_contraction: float

    @classmethod
    def from_study(cls, study: Mapping[str, Any]) -> QuadraticRecord:
        closed = study["example"]["closed_forms"]
        return cls(*(float(closed[k]) for k in ("muon_nds", "muon_contraction", "gd_two_step_contraction")))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> QuadraticRecord:
        return cls(d["muon_nds"], d["muon_contraction"], d["gd_two_step_contraction"])


@dataclass(frozen=True)
class FinewebRecord:
    """Muon against AdamW on FineWeb at the paper's learning rates (one seed: no interval):
    AdamW/Muon ratios of means per quantity over ``levels`` matched levels."""

    ratio_of_means: dict[str, float]
    levels: int
    seeds: int = 1
    note: str = "one seed: no interval"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FinewebRecord:
        return cls(dict(d["ratio_of_means"]), d["levels"], d["seeds"], d["note"])


@dataclass
class Summary:
    """``summary.json``: the headline, the Taylor check, tuning, caveats, timings and figures."""

    preset: str
    headline: list[HeadlineEntry]
    zipf: list[ZipfPoint]  # normalized NDS per (optimizer, s), for the figure and the report
    taylor: dict[str, dict[str, int]]  # arm -> {"checked", "failed"}
    tuning: TuningRecord
    notes: list[str]
    final_val_loss: dict[str, dict[str, list[float]]]  # s -> arm -> per seed
    quadratic: QuadraticRecord
    timing: dict[str, float] = field(default_factory=dict)  # stage -> seconds, over every invocation
    seconds: float = 0.0
    invocations: int = 1
    figures: dict[str, list[str]] = field(default_factory=dict)
    fineweb: FinewebRecord | None = None
    disk_bytes: int = 0  # what the job leaves in its output directory
    primary: list[PrimaryEntry] = field(default_factory=list)  # the primary family (primary_family)
    calibration: Calibration = field(default_factory=Calibration)  # the A/A calibration (calibration)
    schema_version: int = SUMMARY_SCHEMA_VERSION
    SCHEMA_VERSION: ClassVar[int] = SUMMARY_SCHEMA_VERSION
    WHAT: ClassVar[str] = "summary.json"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tuning": self.tuning.to_dict()}  # tuning.json's form: grids keyed by "lr:g"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Summary:
        schema.check(d, cls)
        d = dict(d)
        d["headline"] = [HeadlineEntry(**e) for e in d["headline"]]
        d["zipf"] = [ZipfPoint(**e) for e in d["zipf"]]
        d["primary"] = [PrimaryEntry.from_dict(e) for e in d["primary"]]
        d["calibration"] = Calibration.from_dict(d["calibration"])
        d["tuning"] = TuningRecord.from_dict(d["tuning"])
        d["quadratic"] = QuadraticRecord.from_dict(d["quadratic"])
        d["fineweb"] = None if d.get("fineweb") is None else FinewebRecord.from_dict(d["fineweb"])
        return cls(**d)

    @classmethod
    def load(cls, path: str | Path) -> Summary:
        return schema.load(path, cls)

    def entry(self, name: str, scope: str = "all") -> HeadlineEntry:
        for e in self.headline:
            if e.name == name and e.scope == scope:
                return e
        raise CurvlabError(f"no headline entry {name!r} ({scope})")

    def primary_entry(self, name: str) -> PrimaryEntry:
        for e in self.primary:
            if e.name == name:
                return e
        raise CurvlabError(f"no primary entry {name!r}")


# -- the headline -------------------------------------------------------------------------------


def claim_for(name: str) -> Claim:
    """The paper's claim about headline quantity ``name``. Variants of a claimed ratio inherit its
    direction: ``*_median`` (the median of per-level ratios, beside the ratio of means) keeps the
    paper's number; ``*_moonlight`` (the RMS-matched Muon arm, which the paper did not run) does not."""
    if name in CLAIMS:
        return CLAIMS[name]
    base = name.removesuffix("_moonlight")
    moonlight = base != name
    median = base.endswith("_median")
    base = base.removesuffix("_median")
    if base not in CLAIMS or not (moonlight or median):
        return Claim(name, name, "", None, "—", None)
    c = CLAIMS[base]
    quantity = c.quantity.replace("AdamW/Muon", "AdamW/Muon-moonlight") if moonlight else c.quantity
    if median:
        quantity = quantity.replace("ratio of means", "median of per-level ratios")
    paper = None if moonlight else c.paper
    text = c.paper_text if paper is not None or c.paper is None else f"> {c.null:g}"  # the direction only
    return Claim(name, quantity, c.statement, paper, text, c.direction, c.null, c.band)


def _entry(name: str, scope: str, est: st.Estimate | None, per_level: list[dict], note: str = "") -> HeadlineEntry:
    """A descriptive headline entry from an estimate (``None``: nothing to estimate from, ``note`` says why)."""
    claim = claim_for(name)
    ci = None if est is None or est.ci95 is None else list(est.ci95)
    notes = [note] if note else []
    if est is not None and ci is None and not note and est.n_seeds < 2:
        notes.append(f"{est.n_seeds} seed(s): no interval")
    if est is not None and not np.isfinite(est.value):
        notes.append("no finite value (e.g. no checkpoint off the unigram plateau where one is needed)")
    if est is not None and est.failed_replicates:
        notes.append(f"{est.failed_replicates} seed(s) without a finite value of their own: no interval")
    if est is not None and est.denominator_spans_zero:
        notes.append(st.DENOMINATOR_NOTE)
    return HeadlineEntry(
        name=name,
        scope=scope,
        quantity=claim.quantity,
        value=None if est is None else est.value,
        ci95=ci,
        n_levels=0 if est is None else est.n_units,
        n_seeds=0 if est is None else est.n_seeds,
        per_level=per_level,
        paper=claim.paper,
        paper_text=claim.paper_text,
        verdict=st.DESCRIPTIVE,  # only the primary family is judged
        note="; ".join(notes),
    )


def _ratio_entries(
    base: str, suffix: str, scope: str, groups, per_level, n_boot: int, note: str
) -> list[HeadlineEntry]:
    """Both estimates of one AdamW/Muon ratio (:func:`curvlab.studies.statistics.ratio_estimates`)."""
    both = {"": None, "_median": None} if groups is None else st.ratio_estimates(groups["levels"], n_boot)
    mean, median = both[""], both["_median"]
    return [
        _entry(base + suffix, scope, mean, per_level, note),
        _entry(base + "_median" + suffix, scope, median, per_level, note),
    ]


def _matched_entries(data: LevelData, arm: str, n_boot: int) -> list[HeadlineEntry]:
    name = MATCHED[arm]
    records = data.matched(name)
    usable = [r for r in records if r.comparison is not None and r.comparison.headline_levels]
    why = "; ".join(
        f"seed {r.seed}: {r.error or 'every level on the unigram plateau'}" for r in records if r not in usable
    )
    suffix = "" if arm == "muon" else "_moonlight"
    out = []
    for quantity, base in RATIO_NAMES.items():
        for scope in SCOPES:
            key = scope_key(quantity, scope)
            groups, per_level = {"levels": []}, []
            for r in usable:
                rows = []
                for lv in r.comparison.headline_levels:
                    num, den = r.comparison.sides(lv)
                    x, y = num.mean[key], den.mean[key]
                    rows.append([x, y])
                    per_level.append(
                        {"seed": r.seed, "target": lv.target, "adamw": x, arm: y, "value": x / y if y else None}
                    )
                groups["levels"].append(np.array(rows))
            out += _ratio_entries(base, suffix, scope, groups if usable else None, per_level, n_boot, why)
    # each optimizer's share of ||Z||^2 in embedding + head, and the Taylor error at matched loss
    for side_name, pick in (("adamw", 0), (arm, 1)):
        if arm != "muon" and side_name == "adamw":
            continue  # AdamW's are reported once, from its comparison with the default Muon arm
        groups, per_level = {"levels": []}, []
        taylor, taylor_levels = {"levels": []}, []
        for r in usable:
            shares, errors = [], []
            for lv in r.comparison.headline_levels:
                side = r.comparison.sides(lv)[pick]
                shares.append([side.mean["embed_head_share"]])
                err = float(np.median([m.taylor_error for m in side.members]))
                errors.append([err])
                per_level.append({"seed": r.seed, "target": lv.target, "value": shares[-1][0]})
                taylor_levels.append({"seed": r.seed, "target": lv.target, "value": err})
            groups["levels"].append(np.array(shares))
            taylor["levels"].append(np.array(errors))
        share = st.estimate(groups, lambda g: st.mean(g["levels"]), n_boot) if usable else None
        err = st.estimate(taylor, lambda g: st.median(g["levels"]), n_boot) if usable else None
        out.append(_entry(f"embed_head_share_{side_name}", "all", share, per_level, why))
        out.append(_entry(f"taylor_error_{side_name}", "all", err, taylor_levels, why))
    return out


def _equal_step_entries(data: LevelData, n_boot: int) -> list[HeadlineEntry]:
    s0 = data.s_values[0]
    adam, muon = {t.seed: t for t in data.track("adamw", s0)}, {t.seed: t for t in data.track("muon", s0)}
    out = []
    for scope in SCOPES:
        key = scope_key("nds", scope)
        groups, per_level = {"steps": []}, []
        for seed in sorted(set(adam) & set(muon)):
            a = {r.step: r for r in adam[seed].rows if r.phase == "stable" and not r.on_plateau}
            m = {r.step: r for r in muon[seed].rows if r.phase == "stable" and not r.on_plateau}
            rows = [[a[k].value(key), m[k].value(key)] for k in sorted(set(a) & set(m))]
            per_level += [
                {"seed": seed, "step": k, "adamw": x, "muon": y, "value": x / y if y else None}
                for k, (x, y) in zip(sorted(set(a) & set(m)), rows)
            ]
            if rows:
                groups["steps"].append(np.array(rows))
        usable = {"levels": groups["steps"]} if groups["steps"] else None
        note = "" if usable else "no tracked step where both runs are in the stable phase and off the plateau"
        out += _ratio_entries("nds_ratio_equal_step", "", scope, usable, per_level, n_boot, note)
    return out


def _trajectory_groups(data: LevelData, key: str) -> dict[tuple[str, float], dict[int, np.ndarray]]:
    """(arm, s) -> {seed: its trajectory's rows after warmup}; a track without such rows is left out
    (keyed by seed, so the other seeds keep their own ids)."""
    groups = {}
    for t in data.tracks:
        rows = t.after_warmup()
        if rows:
            groups.setdefault((t.arm, t.s), {})[t.seed] = np.array([[r.value(key)] for r in rows])
    return groups


def _unshared(groups: Mapping[str, Mapping[int, np.ndarray]], labels: Mapping[str, str]) -> str:
    """A note naming the seeds some group has but another lacks (left out of a paired estimate)."""
    shared = set(st.shared_seeds(groups))
    out = []
    for k, v in groups.items():
        extra = sorted(set(v) - shared)
        if extra:
            out.append(f"{labels.get(k, k)} seed(s) {', '.join(map(str, extra))}")
    return f"left out, not in every group: {'; '.join(out)}" if out else ""


def _mean(x: np.ndarray) -> float:
    return float(x[:, 0].mean())


ZIPF_STATISTICS: dict[str, tuple[tuple[str, ...], Callable[[Mapping[str, np.ndarray]], float]]] = {
    # name -> (groups it reads, from: "a0"/"m0" AdamW/Muon at the first s, "a1"/"m1" at the last)
    "normalized_nds_adamw_s0": (("a0", "m0"), lambda g: _mean(g["a0"]) / _mean(g["m0"])),
    "normalized_nds_muon_s1": (("m1", "m0"), lambda g: _mean(g["m1"]) / _mean(g["m0"])),
    "normalized_nds_adamw_s1": (("a1", "m0"), lambda g: _mean(g["a1"]) / _mean(g["m0"])),
    "normalized_nds_adamw_change": (("a1", "a0", "m0"), lambda g: (_mean(g["a1"]) - _mean(g["a0"])) / _mean(g["m0"])),
    "gap_s0": (("a0", "m0"), lambda g: (_mean(g["a0"]) - _mean(g["m0"])) / _mean(g["m0"])),
    "gap_s1": (("a1", "m1", "m0"), lambda g: (_mean(g["a1"]) - _mean(g["m1"])) / _mean(g["m0"])),
    "gap_change": (
        ("a1", "m1", "a0", "m0"),
        lambda g: (_mean(g["a1"]) - _mean(g["m1"]) - _mean(g["a0"]) + _mean(g["m0"])) / _mean(g["m0"]),
    ),
}


def _zipf_entries(data: LevelData, n_boot: int) -> tuple[list[HeadlineEntry], list[ZipfPoint]]:
    """The headline's Zipf entries, and the normalized NDS of every (optimizer, s) for the figure."""
    s0, s1 = data.s_values[0], data.s_values[-1]
    headline, per_s = [], []
    for scope in SCOPES:
        groups = _trajectory_groups(data, scope_key("nds", scope))
        named = {"a0": ("adamw", s0), "m0": ("muon", s0), "a1": ("adamw", s1), "m1": ("muon", s1)}
        for name, (needs, stat) in ZIPF_STATISTICS.items():
            missing = [f"{named[k][0]} at s = {named[k][1]:g}" for k in needs if named[k] not in groups]
            if s0 == s1 and any(k.endswith("1") for k in needs):
                missing = ["a second value of s"]
            if missing:
                headline.append(_entry(name, scope, None, [], f"no trajectory for {', '.join(missing)}"))
                continue
            g = {k: groups[named[k]] for k in needs}
            seeds = st.shared_seeds(g)  # paired by seed id: seed k of every (arm, s) together
            per_level = [
                {"arm": named[k][0], "s": named[k][1], "seed": seed, "mean": float(g[k][seed][:, 0].mean())}
                for k in needs
                for seed in seeds
            ]
            labels = {k: f"{named[k][0]} at s = {named[k][1]:g}" for k in needs}
            note = _unshared(g, labels) if seeds else "no seed has a trajectory in every group"
            muon_s0 = lambda g: _mean(g["m0"])  # noqa: E731 (every Zipf statistic divides by it)
            est = st.estimate(g, stat, n_boot, denominator=muon_s0)
            headline.append(_entry(name, scope, est, per_level, note))
        if ("muon", s0) not in groups:
            continue
        for arm, s in sorted(groups):
            x = "m0" if (arm, s) == ("muon", s0) else "x"  # the baseline over itself is 1 in every resample
            g = {x: groups[(arm, s)], "m0": groups[("muon", s0)]}
            est = st.estimate(
                g, lambda g, x=x: _mean(g[x]) / _mean(g["m0"]), n_boot, denominator=lambda g: _mean(g["m0"])
            )
            seeds = st.shared_seeds(g)
            per_seed = [float(groups[(arm, s)][seed][:, 0].mean()) for seed in seeds]
            per_s.append(
                ZipfPoint(
                    arm,
                    s,
                    scope,
                    est.value,
                    None if est.ci95 is None else list(est.ci95),
                    est.n_seeds,
                    est.n_units,
                    per_seed,
                    seeds,
                )
            )
    return headline, per_s


def _rho_entries(data: LevelData, n_boot: int) -> list[HeadlineEntry]:
    s0 = data.s_values[0]
    out = []

    def rows_of(arm: str, scope: str, notes: list[str]) -> dict[int, np.ndarray]:
        """{seed: rows (within, total, in the first third, in the last third)} of the tracks with a
        checkpoint off the plateau; the others are left out, with a note."""
        within, total = ("within", "nds") if scope == "all" else ("within_layers", "nds_layers")
        seeds = {}
        for t in data.track(arm, s0):
            third = t.steps / 3
            rows = t.off_plateau()
            x = np.array(
                [[r.value(within), r.value(total), r.step <= third, r.step > 2 * third] for r in rows], dtype=float
            ).reshape(-1, 4)  # (0, 4) for a track wholly on the plateau, not (0,)
            if len(x):
                seeds[t.seed] = x
            else:
                notes.append(f"{arm} seed {t.seed}: every checkpoint on the unigram plateau, left out")
        return seeds

    def rho(rows: np.ndarray, col: int) -> float:
        pick = rows[:, col] > 0
        den = rows[pick, 1].sum()
        return float(rows[pick, 0].sum() / den) if pick.any() and den else float("nan")

    for scope in SCOPES:
        notes: list[str] = []
        groups = {arm: rows_of(arm, scope, notes) for arm in ("muon", "adamw")}
        if not all(groups[a] for a in groups):
            out += [
                _entry(n, scope, None, [], "; ".join(["no trajectory off the plateau at the first s", *notes]))
                for n in (
                    "rho_within_muon_early",
                    "rho_within_muon_late",
                    "rho_within_adamw_early",
                    "rho_within_adamw_late",
                    "rho_within_muon_change",
                    "rho_within_adamw_change",
                    "rho_within_change_gap",
                )
            ]
            continue
        for arm in ("muon", "adamw"):
            per_seed = [{"seed": k, "early": rho(x, 2), "late": rho(x, 3)} for k, x in groups[arm].items()]
            g = {"x": groups[arm]}
            note = "; ".join(n for n in notes if n.startswith(f"{arm} "))
            early = st.estimate(g, lambda g: rho(g["x"], 2), n_boot)
            out.append(_entry(f"rho_within_{arm}_early", scope, early, per_seed, note))
            late = st.estimate(g, lambda g: rho(g["x"], 3), n_boot)
            out.append(_entry(f"rho_within_{arm}_late", scope, late, per_seed, note))
            change = st.estimate(g, lambda g: rho(g["x"], 3) - rho(g["x"], 2), n_boot)
            out.append(_entry(f"rho_within_{arm}_change", scope, change, per_seed, note))

        def gap_of(g: Mapping[str, np.ndarray]) -> float:
            return rho(g["muon"], 3) - rho(g["muon"], 2) - rho(g["adamw"], 3) + rho(g["adamw"], 2)

        gap = st.estimate(groups, gap_of, n_boot)  # paired by seed id: the seeds both arms have
        per_seed = [{"seed": k, "value": gap_of({a: groups[a][k] for a in groups})} for k in gap.seeds]
        gap_note = "; ".join(n for n in [*notes, _unshared(groups, {})] if n)
        out.append(_entry("rho_within_change_gap", scope, gap, per_seed, gap_note))
    return out


DECOMPOSITION = {
    # name -> (side the numerator is read at, its direction, side the denominator is read at, its direction)
    "direction_term_adamw_w": (0, "adamw", 0, "muon"),
    "direction_term_muon_w": (1, "adamw", 1, "muon"),
    "landscape_term": (0, "muon", 1, "muon"),
}


def _decomposition_entries(data: LevelData, n_boot: int) -> list[HeadlineEntry]:
    """The between-run NDS ratio split at each matched level (descriptive): the direction term
    NDS(AdamW's direction) / NDS(Muon's direction) at one W (AdamW's, or Muon's), and the landscape
    term NDS(Muon's direction at AdamW's W) / NDS(Muon's direction at Muon's W); direction term at
    AdamW's W x landscape term = the between-run ratio, level by level. A scope without paired
    scalars (older runs) has no such entries."""
    usable = _usable(data.matched(PRIMARY_COMPARISON))
    out = []
    for scope in SCOPES:
        for name, (i, num_dir, j, den_dir) in DECOMPOSITION.items():
            kn, kd = f"paired_nds_{num_dir}_{scope}", f"paired_nds_{den_dir}_{scope}"
            groups, per_level = {"levels": []}, []
            for r in usable:
                rows = []
                for lv in r.comparison.headline_levels:
                    sides = r.comparison.sides(lv)
                    mn, md = sides[i].mean, sides[j].mean
                    if kn in mn and kd in md:
                        rows.append([mn[kn], md[kd]])
                        per_level.append(
                            {"seed": r.seed, "target": lv.target, "numerator": mn[kn], "denominator": md[kd]}
                        )
                if rows:
                    groups["levels"].append(np.array(rows))
            complete = len(per_level) == sum(len(r.comparison.headline_levels) for r in usable)
            if usable and per_level and complete:
                out += _ratio_entries(name, "", scope, groups, per_level, n_boot, "")
    return out


def headline(data: LevelData, n_boot: int = st.N_BOOT) -> tuple[list[HeadlineEntry], list[ZipfPoint]]:
    """Every headline entry (module docstring) and the per-s normalized NDS, from the per-level data alone."""
    entries = []
    for arm in MATCHED:
        if data.matched(MATCHED[arm]):
            entries += _matched_entries(data, arm, n_boot)
    entries += _decomposition_entries(data, n_boot)
    entries += _equal_step_entries(data, n_boot)
    zipf, per_s = _zipf_entries(data, n_boot)
    entries += zipf + _rho_entries(data, n_boot)
    return entries, per_s


def taylor_counts(data: LevelData) -> dict[str, dict[str, int]]:
    """Per arm, how many distinct analysed checkpoints (matched windows and trajectories) the Taylor
    check judged, and how many it failed."""
    seen: dict[str, dict[tuple, bool]] = {}
    for r in data.comparisons:
        first, arm = r.name.split("/")
        if r.comparison is None or first == arm:
            continue  # (an A/A calibration record's runs are keyed by pair, not by seed: not counted here)
        for lv in r.comparison.levels:
            for side_arm, side in zip(("adamw", arm), r.comparison.sides(lv)):
                for m in side.members:
                    seen.setdefault(side_arm, {})[(r.s, r.seed, m.step)] = m.taylor_ok
    for t in data.tracks:
        for row in t.rows:
            seen.setdefault(t.arm, {})[(t.s, t.seed, row.step)] = row.taylor_ok
    return {arm: {"checked": len(v), "failed": sum(not ok for ok in v.values())} for arm, v in sorted(seen.items())}


# -- the primary family -------------------------------------------------------------------------

PRIMARY_COMPARISON = "adamw/muon"


@dataclass(frozen=True)
class _SeedValues:
    """What one claim infers from: per-seed aggregates (numerator and denominator for a ratio or a
    normalized difference, values alone for a difference), with per-seed details and notes."""

    seeds: list[int]
    numerator: list[float]
    denominator: list[float] | None
    units: list[int]
    notes: list[str] = field(default_factory=list)


def _usable(records: list[ComparisonRecord]) -> list[ComparisonRecord]:
    return [r for r in records if r.comparison is not None and r.comparison.headline_levels]


def _own(arm: str, quantity: str, scope: str) -> str:
    """The paired-direction key of an arm's own step (``paired_cos_adamw_hidden`` on AdamW's side)."""
    return f"paired_{quantity}_{arm}_{scope}"


def _sign_note(values: list[float], what: str, kept: str = "the per-seed means") -> str:
    bad = sum(1 for v in values if not v > 0)
    return f"{bad} of {len(values)} {what} <= 0 (kept in {kept})" if bad else ""


def _between(records: list[ComparisonRecord], key_of) -> _SeedValues | str:
    """Per seed (record), the mean over its levels off the plateau of the numerator side's and the
    denominator side's window means of ``key_of(arm)`` (the arms as the record's name gives them,
    numerator first: ``"adamw/muon"``, or ``"adamw/adamw"`` for an A/A record); a string says what is
    missing."""
    usable = _usable(records)
    if not usable:
        return "no matched comparison with a level off the unigram plateau"
    seeds, num, den, units, raw = [], [], [], [], []
    for r in usable:
        xs, ys = [], []
        ka, kb = (key_of(arm) for arm in r.name.split("/"))
        for lv in r.comparison.headline_levels:
            a, b = r.comparison.sides(lv)
            ma, mb = a.mean, b.mean  # (a property that averages every key)
            if ka not in ma or kb not in mb:
                return f"no {ka if ka not in ma else kb} in the matched windows (older runs)"
            xs.append(ma[ka])
            ys.append(mb[kb])
        seeds.append(r.seed)
        num.append(float(np.mean(xs)))
        den.append(float(np.mean(ys)))
        units.append(len(xs))
        raw += xs + ys
    notes = [n for n in [_sign_note(raw, "window means")] if n]
    return _SeedValues(seeds, num, den, units, notes)


def _paired(records: list[ComparisonRecord], data: LevelData, scope: str) -> _SeedValues | str:
    """Per seed, the median over every distinct analysed checkpoint of both arms at the first s, in the
    stable phase and off the plateau (the members of the matched windows and the tracked trajectory),
    of the ratio NDS(AdamW's next-step direction) / NDS(Muon's) at that checkpoint. Both directions are
    at the same W and batch, so any analysed point counts; pooling the trajectory with the windows gives
    each seed a dozen points or more instead of the few the matched levels hold.

    A median of the per-point ratios, not a ratio of means over points: NDS spans two orders of
    magnitude along a run, and one checkpoint where the curvature spikes (×700 its neighbours) set a
    seed's ratio of means, and moved with float noise between a 1- and a 2-thread rerun
    (docs/science.md section 12). The median weighs every point alike and is defined for either sign;
    a point where Muon's NDS is exactly 0 has no ratio and is counted in a note."""
    usable = _usable(records)
    if not usable:
        return "no matched comparison with a level off the unigram plateau"
    ka, km = f"paired_nds_adamw_{scope}", f"paired_nds_muon_{scope}"
    s0 = data.s_values[0]
    seeds, num, units, xs_all, ys_all = [], [], [], [], []
    agree = undefined = 0
    for r in usable:
        points: dict[tuple[str, int], CheckpointScalars] = {}
        for lv in r.comparison.headline_levels:
            for side in (lv.a, lv.b):
                for m in side.members:
                    points[(side.optimizer, m.step)] = m
        if any(ka not in p.paired or km not in p.paired for p in points.values()):
            return f"no {ka} / {km} in the matched windows (older runs)"
        for arm in ("adamw", "muon"):
            for t in (t for t in data.track(arm, s0) if t.seed == r.seed):
                for row in t.after_warmup():
                    if ka in row.paired and km in row.paired:  # a trajectory analysed without shadows adds nothing
                        points.setdefault((row.optimizer or arm, row.step), row)
        xs = [p.paired[ka] for p in points.values()]
        ys = [p.paired[km] for p in points.values()]
        agree += sum((x > 0) == (y > 0) for x, y in zip(xs, ys))
        ratios = [x / y for x, y in zip(xs, ys) if y != 0]
        undefined += len(xs) - len(ratios)
        if not ratios:
            continue
        seeds.append(r.seed)
        num.append(float(np.median(ratios)))
        units.append(len(ratios))
        xs_all += xs
        ys_all += ys
    if not seeds:
        return f"no point with a nonzero {km}"
    notes = [
        n
        for n in (
            _sign_note(xs_all, "points along AdamW's direction have NDS", "the per-seed medians of the ratios"),
            _sign_note(ys_all, "along Muon's", "the medians, with the sign their ratios take"),
            f"both directions take the same sign at {agree} of {len(xs_all)} points",
            f"{undefined} points with Muon's NDS exactly 0 have no ratio" if undefined else "",
        )
        if n
    ]
    return _SeedValues(seeds, num, [1.0] * len(num), units, notes)


def _trajectory_mean(t: TrackRecord, key: str) -> float:
    rows = t.after_warmup()
    return float(np.mean([r.value(key) for r in rows])) if rows and all(r.has(key) for r in rows) else float("nan")


def _zipf_gap(data: LevelData, scope: str) -> _SeedValues | str:
    """Per seed (present in all four runs), the change of the AdamW − Muon trajectory-mean NDS gap from
    the first s to the last, (a1 − m1 − a0 + m0) / m0, normalized by that seed's Muon at the first s.
    A seed whose baseline m0 is not positive cannot be normalized: it is left out, and the note says so."""
    if len(data.s_values) < 2:
        return "one value of s only"
    s0, s1 = data.s_values[0], data.s_values[-1]
    key = scope_key("nds", scope)
    runs = {(arm, s): {t.seed: t for t in data.track(arm, s)} for arm in ("adamw", "muon") for s in (s0, s1)}
    common = sorted(set.intersection(*(set(v) for v in runs.values())))
    if not common:
        return f"no seed with trajectories of both arms at s = {s0:g} and s = {s1:g}"
    seeds, values, units, notes = [], [], [], []
    for seed in common:
        m = {k: _trajectory_mean(v[seed], key) for k, v in runs.items()}
        if not all(np.isfinite(x) for x in m.values()):
            notes.append(f"seed {seed}: a trajectory without a checkpoint after warmup off the plateau, left out")
            continue
        if not m[("muon", s0)] > 0:
            notes.append(
                f"seed {seed}: Muon's trajectory-mean NDS at s = {s0:g} is {m[('muon', s0)]:.3g} (<= 0), left out"
            )
            continue
        seeds.append(seed)
        change = m[("adamw", s1)] - m[("muon", s1)] - m[("adamw", s0)] + m[("muon", s0)]
        values.append(change / m[("muon", s0)])
        units.append(sum(len(v[seed].after_warmup()) for v in runs.values()))
    if not seeds:
        return "; ".join(notes)
    return _SeedValues(seeds, values, None, units, notes)


def _rho_gap(data: LevelData, scope: str) -> _SeedValues | str:
    """Per seed (present in both arms at the first s), the rise of rho_within from the first third of
    training to the last, Muon's minus AdamW's (rho over a third = sum within / sum NDS there)."""
    s0 = data.s_values[0]
    within, total = ("within", "nds") if scope == "all" else ("within_layers", "nds_layers")
    runs = {arm: {t.seed: t for t in data.track(arm, s0)} for arm in ("muon", "adamw")}
    common = sorted(set(runs["muon"]) & set(runs["adamw"]))
    if not common:
        return f"no seed with trajectories of both arms at s = {s0:g}"

    def rise(t: TrackRecord) -> tuple[float, int]:
        rows = t.off_plateau()
        thirds = []
        for pick in (lambda r: r.step <= t.steps / 3, lambda r: r.step > 2 * t.steps / 3):
            chosen = [r for r in rows if pick(r)]
            den = sum(r.value(total) for r in chosen)
            thirds.append(sum(r.value(within) for r in chosen) / den if chosen and den else float("nan"))
        return thirds[1] - thirds[0], len(rows)

    seeds, values, units, notes = [], [], [], []
    for seed in common:
        (m, nm), (a, na) = rise(runs["muon"][seed]), rise(runs["adamw"][seed])
        if not (np.isfinite(m) and np.isfinite(a)):
            notes.append(f"seed {seed}: no checkpoint off the plateau in the first or the last third, left out")
            continue
        seeds.append(seed)
        values.append(m - a)
        units.append(nm + na)
    if not seeds:
        return "; ".join(notes)
    return _SeedValues(seeds, values, None, units, notes)


def _claim_inputs(claim: PrimaryClaim, data: LevelData, records: list[ComparisonRecord]) -> _SeedValues | str:
    if claim.name == "paired_direction_ratio":
        return _paired(records, data, claim.scope)
    if claim.name == "between_nds_ratio":
        return _between(records, lambda arm: scope_key("nds", claim.scope))
    if claim.name == "alignment_ratio":
        return _between(records, lambda arm: _own(arm, "cos", claim.scope))
    if claim.name == "zipf_gap_change":
        return _zipf_gap(data, claim.scope)
    if claim.name == "rho_within_change_gap":
        return _rho_gap(data, claim.scope)
    raise CurvlabError(f"no data rule for primary claim {claim.name!r}")


def _claimed(claim: PrimaryClaim) -> str:
    if claim.direction == "about":
        lo, hi = claim.band
        return f"about {claim.null:g} (within [{lo:g}, {hi:g}])"
    return f"{claim.direction} than {claim.null:g}"


def _infer(claim: PrimaryClaim, values: _SeedValues, confidence: float) -> st.SeedInference:
    if values.denominator is None:
        return st.mean_inference(values.numerator, claim.null, confidence)
    return st.ratio_inference(values.numerator, values.denominator, claim.null, confidence)


def _judge(
    claims: tuple[PrimaryClaim, ...],
    data: LevelData,
    records: list[ComparisonRecord],
    confidence: float,
    judged: frozenset[str] | None = None,
) -> list[PrimaryEntry]:
    """Every claim's entry: per-seed inference, Holm over the claims tested (3 seeds or more, and named
    in ``judged`` when given: the others are estimated but descriptive, outside the correction), verdicts."""
    inputs = [_claim_inputs(c, data, records) for c in claims]
    inferences = [None if isinstance(v, str) else _infer(c, v, confidence) for c, v in zip(claims, inputs)]
    is_judged = [judged is None or c.name in judged for c in claims]
    tested = [
        i
        for i, inf in enumerate(inferences)
        if is_judged[i] and inf is not None and inf.p is not None and inf.n_seeds >= st.MIN_SEEDS
    ]
    adjusted = dict(zip(tested, st.holm([inferences[i].p for i in tested])))
    entries = []
    for i, (claim, values, inf) in enumerate(zip(claims, inputs, inferences)):
        common = dict(
            name=claim.name, scope=claim.scope, quantity=claim.quantity, statement=claim.statement,
            claimed=_claimed(claim), paper=claim.paper, paper_text=claim.paper_text,
        )  # fmt: skip
        if inf is None:
            entries.append(
                PrimaryEntry(
                    **common,
                    kind=claim.kind,
                    method="",
                    value=None,
                    ci95=None,
                    n_seeds=0,
                    n_units=0,
                    direction=st.NOT_MEASURED,
                    magnitude=None,
                    p=None,
                    p_holm=None,
                    note=f"not measured: {values}; needs {claim.data}",
                )
            )
            continue
        p_holm = adjusted.get(i)
        band = None if inf.method == st.DIFFERENCE_T else claim.band  # a fallen-back difference has no band
        direction = st.direction_verdict(claim.direction, inf, p_holm, band) if is_judged[i] else st.DESCRIPTIVE
        # the paper's number is on the claim's scale: a quantity that fell back to a difference (its
        # denominator's sign not settled) cannot be set beside it
        fell_back = inf.method == st.DIFFERENCE_T
        kind = "difference" if fell_back else claim.kind
        ci = None if inf.ci95 is None else list(inf.ci95)
        if claim.paper is None or not is_judged[i]:
            magnitude = None
        elif fell_back:
            magnitude = st.FEW_SEEDS if inf.n_seeds < st.MIN_SEEDS else st.UNINFORMATIVE
        else:
            magnitude = st.magnitude_verdict(ci, claim.paper, inf.n_seeds)
        notes = ([inf.note] if inf.note else []) + values.notes
        if not is_judged[i]:
            notes.append(f"descriptive in this design: {DESCRIPTIVE_NOTE}")
        if inf.n_seeds < 2:
            notes.append(f"{inf.n_seeds} seed: no interval")
        per_seed = [
            {"seed": seed, "numerator": x, "units": u}
            | ({} if values.denominator is None else {"denominator": values.denominator[k]})
            | {"value": inf.per_seed[k]}
            for k, (seed, x, u) in enumerate(zip(values.seeds, values.numerator, values.units))
        ]
        entries.append(
            PrimaryEntry(
                **common,
                kind=kind,
                method=inf.method,
                value=inf.value,
                ci95=ci,
                n_seeds=inf.n_seeds,
                n_units=sum(values.units),
                direction=direction,
                magnitude=magnitude,
                p=inf.p,
                p_holm=p_holm,
                per_seed=per_seed,
                note="; ".join(notes),
            )
        )
    return entries


DESCRIPTIVE_NOTE = "the preset judges only its own primary claims (docs/science.md section 12): no verdict, no Holm"


def primary_family(
    data: LevelData, confidence: float = st.CONFIDENCE, judged: tuple[str, ...] | None = None
) -> list[PrimaryEntry]:
    """The primary family (:data:`curvlab.studies.paper.PRIMARY`), judged from the per-level data alone: the
    matched comparisons of AdamW and Muon (``"adamw/muon"``) and the trajectories. A claim whose data
    are missing (e.g. older runs without paired-direction scalars, or one value of s) is an entry marked
    not measured, never a verdict. ``judged`` names the claims a design has the power to judge (a
    preset's ``primary``; None: all): the others keep their estimate and interval, as descriptive
    entries outside Holm's correction."""
    return _judge(PRIMARY, data, data.matched(PRIMARY_COMPARISON), confidence, judged_claims(judged))


def _false(direction: str, claim: PrimaryClaim) -> bool:
    """Whether an A/A verdict asserts a difference between two runs of one arm: any verdict on a
    greater/less claim, and "contradicted" on an about-equal claim ("supported" is right there)."""
    if direction in (st.SUPPORTED, st.CONTRADICTED):
        return not (claim.direction == "about" and direction == st.SUPPORTED)
    return False


def calibration(records: list[ComparisonRecord], confidence: float = st.CONFIDENCE) -> Calibration:
    """The A/A calibration from same-arm comparisons (records named ``"x/x"``, e.g. ``"adamw/adamw"``;
    each record two seeds of one arm). The reproduction pairs neighbouring seeds (k - 1, k), so that 5
    seeds give 4 records: neighbouring records share a seed, and their log ratios correlate by -0.5,
    which makes the t interval over records wider than it needs to be (conservative: about 2.2x the
    width in this design), never narrower. Each
    same-arm family goes through the primary pipeline for the claims comparing the two sides of a
    comparison (``between_runs``), with Holm over those claims. A test is a claim with 3 or more
    records; the false-verdict rate is the share of tests whose direction verdict asserted a
    difference (:func:`_false`). NaN when there is no test."""
    names = sorted({r.name for r in records if r.name.split("/")[0] == r.name.split("/")[-1] and "/" in r.name})
    claims = tuple(c for c in PRIMARY if c.between_runs)
    empty = LevelData([], [], None, [0.0])
    per_test = []
    for name in names:
        group = sorted((r for r in records if r.name == name), key=lambda r: r.seed)
        for claim, e in zip(claims, _judge(claims, empty, group, confidence)):
            if e.p_holm is None:
                continue
            per_test.append(
                {"comparison": name, "claim": claim.name, "n_seeds": e.n_seeds, "p_holm": e.p_holm,
                 "direction": e.direction, "false": _false(e.direction, claim)}
            )  # fmt: skip
    n = len(per_test)
    rate = sum(t["false"] for t in per_test) / n if n else float("nan")
    return Calibration(rate, n, per_test)
