"""Text and figure of the scaling design (docs/science.md section 17): the ratios at every rung, their power laws
and the extrapolation to GPT-2 small beside the paper's 1.76, from ``summary.json`` alone, and the publishing of
the page with its data and figure into the docs."""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from curvlab.output.cells import fmt, interval_text, primary_cell
from curvlab.output.files import copy_results
from curvlab.output.plots import save_figure
from curvlab.output.text import run_conditions, stage_times
from curvlab.studies.scaling import PAPER_MODEL, PAPER_NDS_RATIO, QUANTITIES, RungResult, ScalingFit, ScalingSummary
from curvlab.util.atomic import atomic_write_text

SCALING_FIGURE = "scaling"
LABELS = {
    "paired_nds_ratio": "paired NDS, AdamW/Muon (hidden)",
    "alignment_ratio": "cos(G, Z), AdamW/Muon (hidden)",
    "q_ratio": "q = cos²/NDS, Muon/AdamW (hidden)",
    "between_nds_ratio": "between-run NDS, AdamW/Muon (hidden)",
    "between_nds_ratio_all": "between-run NDS, AdamW/Muon (all)",
}


def scaling_figure(rungs: list[RungResult], fits: list[ScalingFit], stem: str | Path) -> list[Path]:
    """Each quantity against non-embedding parameters, log-log: the seeds' values (dots), each rung's estimate
    and interval, the power law fitted to the rungs (solid) and extrapolated (dashed) to GPT-2 small, with
    its 95% prediction interval there and, on the judged quantities, the paper's 1.76 (a star)."""
    fig, axes = plt.subplots(1, len(QUANTITIES), figsize=(3.2 * len(QUANTITIES), 3.2), squeeze=False)
    for ax, fit in zip(axes[0], fits):
        name = fit.quantity
        drawn = False
        for r in rungs:
            values = [v for v in r.seed_values(name) if v > 0]  # (a seed's value <= 0 has no place on a log axis)
            ax.plot([r.n_params] * len(values), values, ".", color="tab:gray", ms=4)
            drawn |= bool(values)
            if r.value(name) is not None and r.value(name) > 0:
                ci = r.ci95(name)
                if ci is not None and ci[0] > 0:
                    ax.plot([r.n_params] * 2, ci, color="k", lw=1.2)
                ax.plot([r.n_params], [r.value(name)], "o", color="tab:blue", ms=5)
        if fit.fit is not None:
            f = fit.fit
            lo, hi = min(r.n_params for r in rungs), max(r.n_params for r in rungs)
            for xs, style in ((np.geomspace(lo, hi, 20), "-"), (np.geomspace(hi, f.at, 20), "--")):
                ax.plot(xs, np.exp(f.intercept) * xs**f.slope, style, color="tab:blue", lw=1)
            ax.plot([f.at] * 2, f.prediction_pi95, color="tab:blue", lw=4, alpha=0.3)
            ax.plot([f.at], [f.prediction], "o", mfc="none", color="tab:blue", ms=6)
        if fit.judged:  # (the paper's 1.76 is a between-run ratio over all parameters; q was registered against it)
            ax.plot([fit.fit.at if fit.fit else 8.5e7], [PAPER_NDS_RATIO], "*", color="tab:red", ms=9)
        ax.set_title(LABELS[name] + ("" if fit.fit is None else f"\nslope {fit.fit.slope:.2f}"), fontsize=8)
        if not drawn:
            ax.text(0.5, 0.5, "not measured", transform=ax.transAxes, ha="center", fontsize=8)
            continue
        ax.axhline(1.0, color="gray", lw=0.8, ls=":")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("non-embedding parameters", fontsize=8)
    fig.suptitle(
        f"Dashed: extrapolated to {PAPER_MODEL} at the ladder's tokens per run, with its 95% prediction interval "
        "(band); star: the paper's 1.76",
        fontsize=8,
    )
    fig.tight_layout()
    return save_figure(fig, stem)


def _millions(n: int) -> str:
    return f"{n / 1e6:.2f}M"


def _fit_rows(summary: ScalingSummary) -> list[str]:
    lines = [
        f"| quantity | slope [95% CI] | points | at {PAPER_MODEL} ({_millions(summary.at_124m)}), **extrapolated** "
        "[95% PI] | judged: trend | judged: against 1.76 |",
        "|---|---:|---:|---:|---|---|",
    ]
    for f in summary.fits:
        if f.fit is None:
            lines.append(f"| {LABELS[f.quantity]} | not measured: {f.note} | | | | |")
            continue
        trend = (f.trend or "withheld") if f.judged else "descriptive"
        holds = (f.against_paper or "withheld") if f.judged else "descriptive"
        lines.append(
            f"| {LABELS[f.quantity]} | {f.fit.slope:.3f}{interval_text(f.fit.slope_ci95)} | {f.fit.n} | "
            f"{fmt(f.fit.prediction)}{interval_text(f.fit.prediction_pi95)} | {trend} | {holds} |"
            + (f" {f.note}" if f.note else "")
        )
    return lines


def render_scaling(summary: ScalingSummary, figures_dir: str = "figures") -> str:
    """The scaling design's page (docs/science.md section 17), from ``summary.json`` alone."""
    t = summary.timing
    rule = summary.rule
    lines = [
        f"# The ratio across model size ({summary.preset})",
        "",
        f"`curvlab reproduce --preset {summary.preset}`: {summary.seconds / 60:.0f} minutes "
        f"({t.get('total_cpu', float('nan')) / 60:.0f} CPU minutes; {run_conditions(summary)}); by stage: "
        f"{stage_times(summary)}.",
        "",
        f"Each rung is `{summary.base}`'s design at another size, both arms on seeds "
        f"{', '.join(map(str, summary.seeds))}, {summary.tokens_per_run:,} training tokens a run. The learning "
        f"rates are transferred from the committed table (tuned at width {summary.base_width}) by update-RMS "
        "matching: AdamW's hidden-matrix lr times w0/w (µP's rule for Adam), Muon's times sqrt(w0/w), so that both "
        "arms' hidden update RMS falls as 1/width (µP's spectral condition would keep Muon's lr constant: the "
        "lr-dependent ratios depend on this choice, q much less); embeddings, head and norms at the table's AdamW "
        "lr. Each rung checks the rule on a 3-point grid with one check seed and runs at the rule's values "
        "whatever the grid says; the table marks where the grid's best point differs (one seed: no noise estimate).",
        "",
        f"Registered {rule['registered']} the first run: judged are the fits of "
        f"{' and '.join(LABELS[q] for q in rule['judged'])}: {rule['fit']}; {rule['slope']}; and {rule['at_124m']}. "
        "Every other fit is descriptive.",
        "",
        "| rung | width | layers | non-embedding | total | tokens / non-emb. param | AdamW lr (hidden) | "
        "Muon lr | check: AdamW best | check: Muon best |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in summary.sizes:
        checks = []
        for arm in ("adamw", "muon"):
            c = r.check.get(arm, {})
            checks.append(f"{fmt(c.get('best'))}" + (" (**differs**)" if c.get("moved") else ""))
        lines.append(
            f"| {r.rung} | {r.n_embd} | {r.n_layer} | {_millions(r.n_params)} | {_millions(r.n_params_total)} | "
            f"{summary.tokens_per_run / r.n_params:.2f} | {r.options['adamw']['lr']:g} ({r.lr['adamw']:g}) | "
            f"{r.lr['muon']:g} | {checks[0]} | {checks[1]} |"
        )
    lines += ["", "| rung | seeds | " + " | ".join(LABELS[q] for q in QUANTITIES) + " |"]
    lines.append("|---|---:|" + "---:|" * len(QUANTITIES))
    for r in summary.sizes:
        cells = [primary_cell(r.quantities[q]) for q in QUANTITIES]
        lines.append(f"| {r.rung} | {r.n_seeds} | " + " | ".join(cells) + " |")
    lines += ["", *_fit_rows(summary), "", f"![{SCALING_FIGURE}]({figures_dir}/{SCALING_FIGURE}.png)", ""]
    return "\n".join(lines)


def publish_scaling(results: Path, docs: Path, page: Path) -> None:
    """Copy a scaling design's ``summary.json``, ``levels.json`` and figure into ``docs`` and write its page
    (:func:`render_scaling`) to ``page``.

    Raises:
        CurvlabError: a missing or unreadable summary.
    """
    summary = ScalingSummary.load(results / "summary.json")
    figures = copy_results(results, docs)
    scaling_figure(summary.sizes, summary.fits, figures / SCALING_FIGURE)
    relative = Path(os.path.relpath(figures, page.parent)).as_posix()
    atomic_write_text(page, render_scaling(summary, relative) + "\n")
