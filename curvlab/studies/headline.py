"""The headline of a reproduction: every descriptive AdamW/Muon quantity, derived from a
:class:`curvlab.studies.records.LevelData` alone, as a list of :class:`HeadlineEntry`, with the statistics of
:mod:`curvlab.inference.statistics` and the claims of :mod:`curvlab.studies.paper`:

* matched-loss ratios (AdamW over Muon, and over the RMS-matched Muon arm): ratio of the sums over
  seeds and levels off the unigram plateau of the window means, e.g. sum NDS_AdamW / sum NDS_Muon;
* each optimizer's embedding+head share of ||Z||² at matched loss: per seed the mean over levels,
  then the mean over seeds;
* the Taylor error |predicted − realized| / max(|realized|, |I1|): per seed the median over levels of
  each window's median, then the mean over seeds (judges "predicted ≈ realized", and nothing else);
* the equal-step NDS ratio: tracked checkpoints at equal steps, both in the stable phase and off
  the plateau;
* the direction efficiency with every paired point kept, q(Muon's direction) / q(AdamW's) (Muon over AdamW),
  beside the primary claim that leaves out the points without a quadratic optimum, and the realized decrease
  at each direction's optimal step η*: per arm over the predicted one, and Muon's over AdamW's (per seed the
  median over the paired points, then log-t, Fieller or a t interval across seeds, as the primary family);
* the Zipf sweep: trajectory-mean NDS (all tracked checkpoints after warmup, unfiltered) divided by
  Muon's at the first s, pooled over seeds; the Muon baseline is part of each seed's statistic, so its
  uncertainty is carried;
* rho_within early and late (s = first s): sum(within) / sum(NDS) over the tracked checkpoints in the
  first and the last third of each run's stable phase off the plateau
  (:meth:`~curvlab.studies.records.TrackRecord.early_and_late`), per seed, then the mean over seeds;
  the hidden scope uses the transformer-layer blocks only.

Headline intervals are seed-level (:func:`curvlab.inference.statistics.estimate`): every headline entry is
*descriptive* (no verdict, no tally); only :mod:`curvlab.studies.primary` judges.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from curvlab.curvature.scalars import RATIO_KEYS, scope_key
from curvlab.inference import statistics
from curvlab.studies.paper import CLAIMS, Claim
from curvlab.studies.records import MATCHED, PRIMARY_COMPARISON, SCOPES, LevelData, with_levels_off_plateau
from curvlab.studies.seed_values import SeedValues, efficiency_values, optimal_step_values
from curvlab.util.codec import Record

RATIO_NAMES = {k: f"{k}_ratio" for k in RATIO_KEYS}  # quantity -> its headline entry


@dataclass
class HeadlineEntry(Record):
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


@dataclass
class ZipfPoint(Record):
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


def claim_for(name: str) -> Claim:
    """The paper's claim about headline quantity ``name``. Variants of a claimed ratio inherit its
    direction: ``*_median`` (each seed's median of its per-level ratios, averaged over seeds, beside the
    ratio of means) keeps the paper's number; ``*_moonlight`` (the RMS-matched Muon arm, which the paper
    did not run) does not."""
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
        quantity = quantity.replace("ratio of means", "per-seed median of per-level ratios, mean over seeds")
    paper = None if moonlight else c.paper
    text = c.paper_text if paper is not None or c.paper is None else f"> {c.null:g}"  # the direction only
    return Claim(name, quantity, c.statement, paper, text, c.direction, c.null, c.band)


def _entry(
    name: str, scope: str, est: statistics.Estimate | None, per_level: list[dict], note: str = ""
) -> HeadlineEntry:
    """A descriptive headline entry from an estimate (``None``: nothing to estimate from, ``note`` says why)."""
    c = claim_for(name)
    ci = None if est is None or est.ci95 is None else list(est.ci95)
    notes = [note] if note else []
    if est is not None and ci is None and not note and est.n_seeds < 2:
        notes.append(f"{est.n_seeds} seed(s): no interval")
    if est is not None and not np.isfinite(est.value):
        notes.append("no finite value (e.g. no checkpoint off the unigram plateau where one is needed)")
    if est is not None and est.failed_replicates:
        notes.append(f"{est.failed_replicates} seed(s) without a finite value of their own: no interval")
    if est is not None and est.denominator_spans_zero:
        notes.append(statistics.DENOMINATOR_NOTE)
    value, n_levels, n_seeds = (None, 0, 0) if est is None else (est.value, est.n_units, est.n_seeds)
    note = "; ".join(notes)
    return HeadlineEntry(
        name,
        scope,
        c.quantity,
        value,
        ci,
        n_levels,
        n_seeds,
        per_level,
        c.paper,
        c.paper_text,
        statistics.DESCRIPTIVE,
        note,
    )


def _ratio_entries(base: str, suffix: str, scope: str, groups, per_level, note: str) -> list[HeadlineEntry]:
    """Both estimates of one AdamW/Muon ratio (:func:`curvlab.inference.statistics.ratio_estimates`)."""
    both = {"": None, "_median": None} if groups is None else statistics.ratio_estimates(groups["levels"])
    return [_entry(base + kind + suffix, scope, est, per_level, note) for kind, est in both.items()]


def _matched_entries(data: LevelData, arm: str) -> list[HeadlineEntry]:
    name = MATCHED[arm]
    records = data.matched(name)
    usable = with_levels_off_plateau(records)
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
            out += _ratio_entries(base, suffix, scope, groups if usable else None, per_level, why)
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
        share = statistics.estimate(groups, lambda g: statistics.mean(g["levels"])) if usable else None
        err = statistics.estimate(taylor, lambda g: statistics.median(g["levels"])) if usable else None
        out.append(_entry(f"embed_head_share_{side_name}", "all", share, per_level, why))
        out.append(_entry(f"taylor_error_{side_name}", "all", err, taylor_levels, why))
    return out


def _equal_step_entries(data: LevelData) -> list[HeadlineEntry]:
    s0 = data.s_values[0]
    adam, muon = {t.seed: t for t in data.track("adamw", s0)}, {t.seed: t for t in data.track("muon", s0)}
    out = []
    for scope in SCOPES:
        key = scope_key("nds", scope)
        groups, per_level = {"levels": []}, []
        for seed in sorted(set(adam) & set(muon)):
            a, m = ({r.step: r for r in t[seed].rows if r.phase == "stable" and not r.on_plateau} for t in (adam, muon))
            steps = sorted(set(a) & set(m))
            rows = [[a[k].value(key), m[k].value(key)] for k in steps]
            per_level += [
                {"seed": seed, "step": k, "adamw": x, "muon": y, "value": x / y if y else None}
                for k, (x, y) in zip(steps, rows)
            ]
            if rows:
                groups["levels"].append(np.array(rows))
        usable = groups if groups["levels"] else None
        note = "" if usable else "no tracked step where both runs are in the stable phase and off the plateau"
        out += _ratio_entries("nds_ratio_equal_step", "", scope, usable, per_level, note)
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
    shared = set(statistics.shared_seeds(groups))
    extra = {k: sorted(set(v) - shared) for k, v in groups.items()}
    out = [f"{labels.get(k, k)} seed(s) {', '.join(map(str, seeds))}" for k, seeds in extra.items() if seeds]
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


def _zipf_entries(data: LevelData) -> tuple[list[HeadlineEntry], list[ZipfPoint]]:
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
            seeds = statistics.shared_seeds(g)  # paired by seed id: seed k of every (arm, s) together
            per_level = [
                {"arm": named[k][0], "s": named[k][1], "seed": seed, "mean": float(g[k][seed][:, 0].mean())}
                for k in needs
                for seed in seeds
            ]
            labels = {k: f"{named[k][0]} at s = {named[k][1]:g}" for k in needs}
            note = _unshared(g, labels) if seeds else "no seed has a trajectory in every group"
            muon_s0 = lambda g: _mean(g["m0"])  # noqa: E731 (every Zipf statistic divides by it)
            est = statistics.estimate(g, stat, denominator=muon_s0)
            headline.append(_entry(name, scope, est, per_level, note))
        if ("muon", s0) not in groups:
            continue
        for arm, s in sorted(groups):
            x = "m0" if (arm, s) == ("muon", s0) else "x"  # the baseline over itself is 1 in every resample
            g = {x: groups[(arm, s)], "m0": groups[("muon", s0)]}
            est = statistics.estimate(
                g, lambda g, x=x: _mean(g[x]) / _mean(g["m0"]), denominator=lambda g: _mean(g["m0"])
            )
            seeds = statistics.shared_seeds(g)
            per_seed = [float(groups[(arm, s)][seed][:, 0].mean()) for seed in seeds]
            ci = None if est.ci95 is None else list(est.ci95)
            per_s.append(ZipfPoint(arm, s, scope, est.value, ci, est.n_seeds, est.n_units, per_seed, seeds))
    return headline, per_s


def _rho_entries(data: LevelData) -> list[HeadlineEntry]:
    s0 = data.s_values[0]
    few = "two stable checkpoints off the plateau"
    out = []

    def rows_of(arm: str, scope: str, notes: list[str]) -> dict[int, np.ndarray]:
        """{seed: rows (within, total, early, late)} of the tracks with an early and a late third
        (:meth:`~curvlab.studies.records.TrackRecord.early_and_late`); the others are left out, with a note."""
        within, total = ("within", "nds") if scope == "all" else ("within_layers", "nds_layers")
        seeds = {}
        for t in data.track(arm, s0):
            early, late = t.early_and_late()  # (disjoint)
            if early:
                seeds[t.seed] = np.array(
                    [[r.value(within), r.value(total), 1, 0] for r in early]
                    + [[r.value(within), r.value(total), 0, 1] for r in late]
                )
            else:
                notes.append(f"{arm} seed {t.seed}: fewer than {few}, left out")
        return seeds

    def rho(rows: np.ndarray, col: int) -> float:
        pick = rows[:, col] > 0
        den = rows[pick, 1].sum()
        return float(rows[pick, 0].sum() / den) if pick.any() and den else float("nan")

    for scope in SCOPES:
        notes: list[str] = []
        groups = {arm: rows_of(arm, scope, notes) for arm in ("muon", "adamw")}
        if not all(groups[a] for a in groups):
            names = [f"rho_within_{arm}_{third}" for arm in ("muon", "adamw") for third in ("early", "late")]
            names += ["rho_within_muon_change", "rho_within_adamw_change", "rho_within_change_gap"]
            note = "; ".join([f"no trajectory with {few} at the first s", *notes])
            out += [_entry(n, scope, None, [], note) for n in names]
            continue
        for arm in ("muon", "adamw"):
            per_seed = [{"seed": k, "early": rho(x, 2), "late": rho(x, 3)} for k, x in groups[arm].items()]
            g = {"x": groups[arm]}
            note = "; ".join(n for n in notes if n.startswith(f"{arm} "))
            early = statistics.estimate(g, lambda g: rho(g["x"], 2))
            out.append(_entry(f"rho_within_{arm}_early", scope, early, per_seed, note))
            late = statistics.estimate(g, lambda g: rho(g["x"], 3))
            out.append(_entry(f"rho_within_{arm}_late", scope, late, per_seed, note))
            change = statistics.estimate(g, lambda g: rho(g["x"], 3) - rho(g["x"], 2))
            out.append(_entry(f"rho_within_{arm}_change", scope, change, per_seed, note))

        def gap_of(g: Mapping[str, np.ndarray]) -> float:
            return rho(g["muon"], 3) - rho(g["muon"], 2) - rho(g["adamw"], 3) + rho(g["adamw"], 2)

        gap = statistics.estimate(groups, gap_of)  # paired by seed id: the seeds both arms have
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


def _decomposition_entries(data: LevelData) -> list[HeadlineEntry]:
    """The between-run NDS ratio split at each matched level (descriptive): the direction term
    NDS(AdamW's direction) / NDS(Muon's direction) at one W (AdamW's, or Muon's), and the landscape
    term NDS(Muon's direction at AdamW's W) / NDS(Muon's direction at Muon's W); direction term at
    AdamW's W x landscape term = the between-run ratio, level by level. A scope without paired
    scalars (older runs) has no such entries."""
    usable = with_levels_off_plateau(data.matched(PRIMARY_COMPARISON))
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
                out += _ratio_entries(name, "", scope, groups, per_level, "")
    return out


def _seed_entry(name: str, scope: str, values: SeedValues | str) -> HeadlineEntry:
    """A descriptive entry from per-seed values (:mod:`curvlab.studies.seed_values`; a string: why there are
    none): a ratio's as the primary family infers it (log-t, else Fieller), a mean's by a t interval."""
    if isinstance(values, str):
        return _entry(name, scope, None, [], values)
    c = claim_for(name)
    if values.denominator is None:
        inf = statistics.mean_inference(values.numerator, c.null)
    else:
        inf = statistics.ratio_inference(values.numerator, values.denominator, c.null)
    per_seed = [{"seed": seed, "value": x, "units": u} for seed, x, u in zip(values.seeds, inf.per_seed, values.units)]
    notes = [n for n in (inf.note, *values.notes) if n]
    if inf.n_seeds < 2:
        notes.append(f"{inf.n_seeds} seed(s): no interval")
    ci = None if inf.ci95 is None else list(inf.ci95)
    return HeadlineEntry(
        name, scope, c.quantity, inf.value, ci, sum(values.units), inf.n_seeds, per_seed, c.paper, c.paper_text,
        statistics.DESCRIPTIVE, "; ".join(notes),
    )  # fmt: skip


def _efficiency_entries(data: LevelData) -> list[HeadlineEntry]:
    """Beside the primary direction efficiency (Muon over AdamW, on the hidden matrices): the same ratio with
    every point kept (those without a quadratic optimum too, their q negative), and the optimal step's
    realized decrease: per arm over the predicted one, and Muon's over AdamW's (:mod:`curvlab.studies.seed_values`'s
    :func:`~.efficiency_values` and :func:`~.optimal_step_values`)."""
    records = data.matched(PRIMARY_COMPARISON)
    every = efficiency_values(records, data, "hidden", every_point=True)
    out = [_seed_entry("direction_efficiency_ratio_all_points", "hidden", every)]
    for key, values in optimal_step_values(records, data).items():
        out.append(_seed_entry(f"optimal_{key}", "hidden", values))
    return out


def headline(data: LevelData) -> tuple[list[HeadlineEntry], list[ZipfPoint]]:
    """Every headline entry (module docstring) and the per-s normalized NDS, from the per-level data alone."""
    entries = []
    for arm in MATCHED:
        if data.matched(MATCHED[arm]):
            entries += _matched_entries(data, arm)
    entries += _decomposition_entries(data)
    entries += _efficiency_entries(data)
    entries += _equal_step_entries(data)
    zipf, per_s = _zipf_entries(data)
    entries += zipf + _rho_entries(data)
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
