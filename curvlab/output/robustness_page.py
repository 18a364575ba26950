"""Text of the robustness design (docs/science.md section 15): its page, the paired direction ratio at every
setting beside a reproduction's, rendered from its ``summary.json`` alone, and the publishing of that page with
its data and figure into the docs."""

from __future__ import annotations

import os
from pathlib import Path

from curvlab.output.cells import fmt, interval_text
from curvlab.output.files import copy_results
from curvlab.output.plots import robustness_ratios
from curvlab.output.text import controls_table, run_conditions, stability_table, stage_times
from curvlab.studies.robustness import RobustnessSummary
from curvlab.studies.summary import Summary
from curvlab.util.atomic import atomic_write_text

ROBUSTNESS_FIGURE = "robustness_ratios"


def _lr_cell(lr: dict[str, float]) -> str:
    return f"{lr['lr']:g}" + (f" (AdamW side {lr['adam_lr']:g})" if "adam_lr" in lr else "")


def render_robustness(
    summary: RobustnessSummary,
    figures_dir: str = "figures",
    reference: tuple[str, float, list[float] | None] | None = None,
) -> str:
    """The robustness design's page (docs/science.md section 15): the paired ratio at every setting, its
    controls and edge-of-stability context, from ``summary.json`` alone; ``reference`` (a reproduction's
    paired ratio: label, value, interval) is quoted beside it."""
    t = summary.timing
    lines = [
        f"# The paired direction ratio across settings ({summary.preset})",
        "",
        f"`curvlab reproduce --preset {summary.preset}`: {summary.seconds / 60:.0f} minutes "
        f"({t.get('total_cpu', float('nan')) / 60:.0f} CPU minutes; {run_conditions(summary)}); by stage: "
        f"{stage_times(summary)}.",
        "",
        f"Each setting changes one thing in the `{summary.base}` design and runs both arms on seeds "
        f"{', '.join(map(str, summary.seeds))} (disjoint from `{summary.base}`'s measured, tuning and check seeds). "
        "The learning rates are the committed table's, times the setting's factor: nothing is re-tuned, for "
        "either arm. Each ratio is judged alone (one claim; no Holm correction across settings), with the "
        "exact one-sided sign-flip p beside the t model's verdict. A setting is one estimate under changed "
        "conditions, not a test of its own.",
        "",
    ]
    if reference is not None:
        label, value, ci = reference
        lines += [f"Reference, the {label}: {fmt(value)}{interval_text(ci)}.", ""]
    lines += [
        "| setting | AdamW lr | Muon lr | paired ratio [95% CI] | seeds, points | verdict (alone) | exact p | "
        "q Muon/AdamW [95% CI] | its verdict | controls | failed |",
        "|---|---:|---:|---:|---:|---|---:|---:|---|---|---|",
    ]
    for x in summary.settings:
        controls = {True: "all passed", False: "**not all**", None: "not measured"}[x.controls_passed]
        q = x.efficiency or {}
        judged = q.get("verdict", "not measured") if x.registered else "descriptive (run before its rule)"
        lines.append(
            f"| {x.label} | {_lr_cell(x.lr['adamw'])} | {_lr_cell(x.lr['muon'])} | "
            f"{fmt(x.paired_ratio)}{interval_text(x.ci95)} | "
            f"{x.n_seeds}, {x.n_points} | {x.verdict} | {fmt(x.p_exact)} | "
            f"{fmt(q.get('value'))}{interval_text(q.get('ci95'))} | {judged} | {controls} | "
            f"{', '.join(x.failed_controls) or '—'} |"
        )
    lines += ["", f"![{ROBUSTNESS_FIGURE}]({figures_dir}/{ROBUSTNESS_FIGURE}.png)", ""]
    for x in summary.settings:
        lines += [f"## {x.label}", "", *controls_table(x.controls)]
        lines += stability_table(x.edge_of_stability) if x.edge_of_stability else []
    return "\n".join(lines)


def paired_reference(summary: Summary) -> tuple[str, float, list[float] | None] | None:
    """A reproduction's paired ratio as the robustness page's reference (``None``: not measured)."""
    e = summary.primary_entry("paired_direction_ratio")
    return None if e.value is None else (f"{summary.preset} reproduction ({e.n_seeds} seeds)", e.value, e.ci95)


def publish_robustness(results: Path, docs: Path, page: Path, reference: Path | None = None) -> None:
    """Copy a robustness design's ``summary.json``, ``levels.json`` and figure into ``docs`` and write its page
    (:func:`render_robustness`) to ``page``, quoting ``reference`` (a reproduction's ``summary.json``, e.g.
    quick's committed one) beside it and in the figure, which is drawn again with it.

    Raises:
        CurvlabError: a missing or unreadable summary.
    """
    summary = RobustnessSummary.load(results / "summary.json")
    ref = None if reference is None else paired_reference(Summary.load(reference))
    figures = copy_results(results, docs)
    robustness_ratios(summary.settings, figures / ROBUSTNESS_FIGURE, ref)
    relative = Path(os.path.relpath(figures, page.parent)).as_posix()
    atomic_write_text(page, render_robustness(summary, relative, ref) + "\n")
