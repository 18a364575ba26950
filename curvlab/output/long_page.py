"""Text and figure of the long design (docs/science.md section 18): the primary family, the tuning at each s and
the estimates by third of training, from ``summary.json`` alone."""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib.pyplot as plt

from curvlab.output.cells import fmt, interval_text, primary_cell
from curvlab.output.files import copy_results
from curvlab.output.plots import save_figure
from curvlab.output.text import run_conditions, stage_times
from curvlab.studies.long import LongSummary
from curvlab.studies.thirds import JUDGED, THIRDS, ThirdEstimate
from curvlab.util.atomic import atomic_write_text

LONG_FIGURE = "long_thirds"
S_COLORS = {0.0: "tab:blue", 1.0: "tab:red"}
PANELS = (  # (quantity, scope, label, log scale)
    ("paired_direction_ratio", "hidden", "paired NDS, AdamW/Muon (hidden)", True),
    ("between_nds_ratio_all", "all", "between-run NDS, AdamW/Muon (all)", True),
    ("direction_efficiency_ratio", "hidden", "q, Muon/AdamW (hidden)", True),
    ("rho_within_muon", "all", "Muon's rho_within (all)", False),
    ("rho_within_adamw", "all", "AdamW's rho_within (all)", False),
)


def _find(estimates: list[ThirdEstimate], quantity: str, scope: str, s: float | None, third: str):
    return next(
        (e for e in estimates if (e.quantity, e.scope, e.s, e.third) == (quantity, scope, s, third)),
        None,
    )


def long_figure(estimates: list[ThirdEstimate], stem: str | Path) -> list[Path]:
    """Each quantity by third of training (early, middle, late at matched loss) at each s, with its 95% interval."""
    s_values = sorted({e.s for e in estimates if e.s is not None})
    fig, axes = plt.subplots(1, len(PANELS), figsize=(3.0 * len(PANELS), 3.0), squeeze=False)
    for ax, (quantity, scope, label, log) in zip(axes[0], PANELS):
        for k, s in enumerate(s_values):
            for t, third in enumerate(THIRDS):
                e = _find(estimates, quantity, scope, s, third)
                if e is None or e.value is None or (log and e.value <= 0):
                    continue
                x = t + (k - (len(s_values) - 1) / 2) * 0.15
                if e.ci95 is not None and (not log or e.ci95[0] > 0):
                    ax.plot([x, x], e.ci95, color=S_COLORS.get(s, "k"), lw=1.2)
                ax.plot([x], [e.value], "o", color=S_COLORS.get(s, "k"), ms=5, label=f"s = {s:g}" if t == 0 else None)
        if log:
            ax.set_yscale("log")
            ax.axhline(1.0, color="gray", lw=0.8, ls=":")
        ax.set_xticks(range(len(THIRDS)), THIRDS, fontsize=8)
        ax.set_title(label, fontsize=8)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("By third of training, at matched validation loss; 95% seed-level intervals", fontsize=8)
    fig.tight_layout()
    return save_figure(fig, stem)


def _estimate_row(e: ThirdEstimate) -> str:
    s = "s1/s0" if e.s is None else f"{e.s:g}"
    verdict = e.verdict if e.judged else "descriptive"
    return (
        f"| {e.quantity} | {e.scope} | {s} | {e.third} | {fmt(e.value)}{interval_text(e.ci95)} | {e.n_seeds} | "
        f"{e.method} | {verdict} | {fmt(e.p_holm)} | {e.note or ''} |"
    )


def render_long(summary: LongSummary, figures_dir: str = "figures") -> str:
    """The long design's page (docs/science.md section 18), from ``summary.json`` alone."""
    t = summary.timing
    lines = [
        f"# Observations 3 and 4 over a long horizon ({summary.preset})",
        "",
        f"`curvlab reproduce --preset {summary.preset}`: {summary.seconds / 60:.0f} minutes "
        f"({t.get('total_cpu', float('nan')) / 60:.0f} CPU minutes; {run_conditions(summary)}); by stage: "
        f"{stage_times(summary)}. {summary.steps} steps, seeds {', '.join(map(str, summary.seeds))} per arm and s.",
        "",
        "| s | AdamW lr | Muon lr (AdamW side) | tuning seeds |",
        "|---|---:|---:|---|",
    ]
    for s, tuning in summary.tuning.items():
        adamw, muon = tuning.chosen["adamw"], tuning.chosen["muon"]
        lines.append(
            f"| {s} | {adamw['lr']:g} | {muon['lr']:g} ({muon.get('adam_lr', adamw['lr']):g}) | {tuning.seeds} |"
        )
    lines += ["", "## The primary family", "", "| claim | scope | value [95% CI] | seeds | verdict | p (Holm) |"]
    lines.append("|---|---|---:|---:|---|---:|")
    for e in summary.primary:
        lines.append(f"| {e.name} | {e.scope} | {primary_cell(e)} | {e.n_seeds} | {e.direction} | {fmt(e.p_holm)} |")
    lines += [
        "",
        "## By third of training",
        "",
        f"Registered {JUDGED['registered']} the first run: judged are the rises of {JUDGED['quantity']} at "
        f"s = {JUDGED['s']:g} over {JUDGED['scope']} parameters ({JUDGED['direction']} than {JUDGED['null']:g}, "
        "Holm over the two); every other row is descriptive.",
        "",
        f"![{LONG_FIGURE}]({figures_dir}/{LONG_FIGURE}.png)",
        "",
    ]
    lines += ["| quantity | scope | s | third | value [95% CI] | seeds | method | verdict | p (Holm) | note |"]
    lines.append("|---|---|---|---|---:|---:|---|---|---:|---|")
    lines += [_estimate_row(e) for e in summary.thirds]
    return "\n".join(lines) + "\n"


def publish_long(results: Path, docs: Path, page: Path) -> None:
    """Copy a long design's ``summary.json`` and ``levels.json`` into ``docs``, draw its figure there and write its
    page (:func:`render_long`) to ``page``.

    Raises:
        CurvlabError: a missing or unreadable summary.
    """
    summary = LongSummary.load(results / "summary.json")
    figures = copy_results(results, docs)
    long_figure(summary.thirds, figures / LONG_FIGURE)
    relative = Path(os.path.relpath(figures, page.parent)).as_posix()
    atomic_write_text(page, render_long(summary, relative))
