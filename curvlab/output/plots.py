"""Figures, drawn from saved results only (never recomputing curvature); each saved as PNG and PDF.

Every function takes what curvlab writes, as its typed records (:class:`~curvlab.analysis.report.CurvatureReport`,
:class:`~curvlab.studies.compare.Comparison`, :class:`~curvlab.curvature.scalars.CheckpointScalars` rows, the
records of :mod:`curvlab.studies.records` and :mod:`curvlab.studies.summary`, the
:class:`~curvlab.studies.tuning.TuningRecord`, the :class:`~curvlab.theory.quadratic.QuadraticStudy`) or, for
a spectral density, its JSON, and a path stem; it draws them, computing nothing, and returns the paths written.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")  # headless: figures go to files
import matplotlib.pyplot as plt
import numpy as np

from curvlab.analysis.report import CurvatureReport
from curvlab.curvature.scalars import RATIO_KEYS, CheckpointScalars
from curvlab.studies.compare import pair_reports, within_layer_gap
from curvlab.studies.paper import CLAIMS, MUON_OVER_ADAMW
from curvlab.studies.records import seed_band
from curvlab.studies.track import Track
from curvlab.studies.tuning import TuningRecord
from curvlab.theory.quadratic import QuadraticStudy
from curvlab.util.atomic import atomic_write_with

COLORS = {"muon": "tab:blue", "adamw": "tab:orange", "gd": "tab:orange", "adam": "tab:red", "sign": "tab:green"}
COLORS["muon-moonlight"] = "tab:purple"


def save_figure(fig, stem: str | Path) -> list[Path]:
    """Write ``stem.png`` and ``stem.pdf`` atomically and close the figure."""
    paths = []
    for ext in ("png", "pdf"):
        buffer = io.BytesIO()
        fig.savefig(buffer, format=ext, dpi=150, bbox_inches="tight")
        path = Path(f"{stem}.{ext}")
        atomic_write_with(path, lambda f, b=buffer: f.write(b.getvalue()))
        paths.append(path)
    plt.close(fig)
    return paths


def _color(name: str) -> str:
    return COLORS.get(name, COLORS.get(name.split("-")[0]))


def quadratic_trajectories(study: QuadraticStudy, stem: str | Path) -> list[Path]:
    """The quadratic model: NDS and suboptimality per step for each method (paper figure 7, left)."""
    best = study.closed_forms.optimal_loss
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    variant_style = {"muon-newton_schulz": "--", "muon-polar_express": "-."}
    for name, traj in study.trajectories.items():
        style = variant_style.get(name, "-") if name in study.line_search else ":"
        label = name if traj.lr is None else f"{name} (lr {traj.lr:g})"
        axes[0].plot(range(len(traj.nds)), traj.nds, style, label=label, color=_color(name))
        gap = np.maximum(np.array(traj.loss) - best, 1e-16)
        axes[1].semilogy(range(len(gap)), gap, style, label=label, color=_color(name))
    axes[0].axhline(study.closed_forms.muon_nds, color="gray", lw=0.8, ls="--", label="α w_H + (1-α) w_L")
    axes[0].set(xlabel="step", ylabel="NDS  <Z,HZ>/||Z||²", title="directional sharpness", yscale="log")
    axes[1].set(xlabel="step", ylabel="Q(Y) − Q*", title="suboptimality")
    axes[1].legend(fontsize=7)
    fig.suptitle(study.title, fontsize=9)
    return save_figure(fig, stem)


def quadratic_phase(study: QuadraticStudy, stem: str | Path) -> list[Path]:
    """Where Muon ends below GD after T steps over (ρ, α), one panel per σ_H/σ_L, with the theorem's
    sufficient region outlined (paper figure 7, right)."""
    sweep = study.sweep
    rhos, alphas, ratios = np.array(sweep.rhos), np.array(sweep.alphas), sweep.ratios
    wins, condition, log_ratio = sweep.muon_wins, sweep.condition, sweep.log10_suboptimality_ratio
    fig, axes = plt.subplots(1, len(ratios), figsize=(4 * len(ratios), 3.6), squeeze=False)
    for k, (ax, ratio) in enumerate(zip(axes[0], ratios)):
        limit = max(1e-9, min(12.0, np.abs(log_ratio[k]).max()))
        mesh = ax.pcolormesh(rhos, alphas, log_ratio[k], cmap="RdBu_r", vmin=-limit, vmax=limit, shading="nearest")
        ax.contour(rhos, alphas, condition[k].astype(float), levels=[0.5], colors="k", linewidths=1.2)
        ax.contour(rhos, alphas, wins[k].astype(float), levels=[0.5], colors="gold", linewidths=1.0, linestyles="--")
        ax.set(xscale="log", xlabel="ρ = w_H / w_L", ylabel="α = m / q", title=f"σ_H/σ_L = {ratio:g}")
    fig.colorbar(mesh, ax=axes[0].tolist(), label="log10 (Muon gap / GD gap) after T steps")
    fig.suptitle(
        f"T = {sweep.steps}: blue = Muon lower; black: the theorem's sufficient condition; gold dashed: Muon wins",
        fontsize=9,
    )
    return save_figure(fig, stem)


def _side_arrays(comparisons, key: str, pick: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(matched loss, window mean, window standard error) of one side (0: AdamW, 1: the Muon arm) of
    every level off the plateau, over the comparisons of all seeds."""
    levels = [(lv.target, c.sides(lv)[pick]) for c in comparisons for lv in c.headline_levels]
    err = np.array([side.stderr[key] for _, side in levels])
    return (
        np.array([x for x, _ in levels]),
        np.array([side.mean[key] for _, side in levels]),
        np.where(np.isnan(err), 0.0, err),
    )


def _matched_points(ax, comparisons, key: str, pick: int, label: str, color: str, marker: str = "o") -> np.ndarray:
    x, y, err = _side_arrays(comparisons, key, pick)
    ax.errorbar(x, y, yerr=err, fmt=marker, ms=4, capsize=2, color=color, label=label, alpha=0.85)
    return y


def _symlog(ax, values: list[np.ndarray]) -> None:
    """A symmetric log scale (linear near zero) when values span decades or change sign, as NDS does."""
    y = np.abs(np.concatenate(values))
    y = y[np.isfinite(y) & (y > 0)]
    if y.size and y.max() > 30 * np.median(y):
        ax.set_yscale("symlog", linthresh=float(np.median(y)) / 2)


def taylor_split_vs_loss(comparisons, stem: str | Path) -> list[Path]:
    """Paper figure 1: realized vs predicted one-step decrease, first-order gain and curvature
    penalty of AdamW and Muon against the matched validation loss; one point per seed and level (a
    window mean), with the window's standard error as its bar."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    panels = [
        (("realized", "predicted"), "one-step decrease ΔD"),
        (("first_order",), "first-order gain I1 = <G,Z>"),
        (("curvature_penalty",), "curvature penalty I2 = ½<Z,HZ>"),
    ]
    for ax, (keys, title) in zip(axes, panels):
        values = []
        for key in keys:
            marker = "o" if key != "predicted" else "x"
            values.append(_matched_points(ax, comparisons, key, 1, f"Muon {key}", COLORS["muon"], marker))
            values.append(_matched_points(ax, comparisons, key, 0, f"AdamW {key}", COLORS["adamw"], marker))
        _symlog(ax, values)
        ax.set(xlabel="matched validation loss", title=title)
        ax.invert_xaxis()
        ax.legend(fontsize=7)
    return save_figure(fig, stem)


def _ci_text(entry) -> str:
    if entry is None or entry.value is None:
        return "n/a"
    ci = "" if entry.ci95 is None else f" [{entry.ci95[0]:.3g}, {entry.ci95[1]:.3g}]"
    return f"{entry.value:.3g}{ci}"


def nds_and_norm_vs_loss(arms: dict[str, list], stem: str | Path, ratios: dict[str, Any] | None = None) -> list[Path]:
    """Paper figure 2: NDS (all parameters and hidden matrices) and update norm ||Z||_F against the
    matched validation loss, for AdamW and every Muon arm (``{arm: comparisons over seeds}``), with
    window standard errors; ``ratios`` (headline entries by name) puts the ratios and intervals in the title."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    panels = [("nds", "NDS, all parameters"), ("hidden_nds", "NDS, hidden matrices"), ("update_norm", "||Z||_F")]
    for ax, (key, title) in zip(axes, panels):
        values = []
        for i, (arm, comparisons) in enumerate(arms.items()):
            if i == 0:
                values.append(_matched_points(ax, comparisons, key, 0, "AdamW", COLORS["adamw"]))
            marker = "s" if "moonlight" in arm else "o"
            values.append(_matched_points(ax, comparisons, key, 1, arm, _color(arm), marker))
        if "nds" in key:
            _symlog(ax, values)
        ax.set(xlabel="matched validation loss", title=title)
        ax.invert_xaxis()
        ax.legend(fontsize=7)
    if ratios:
        fig.suptitle(
            f"AdamW/Muon NDS: ratio of means {_ci_text(ratios.get('nds_ratio'))}, median of ratios "
            f"{_ci_text(ratios.get('nds_ratio_median'))} (hidden {_ci_text(ratios.get('nds_ratio_median_hidden'))}; "
            f"paper {CLAIMS['nds_ratio'].paper_text}); update norm {_ci_text(ratios.get('update_norm_ratio'))}; "
            "95% seed-level intervals",
            fontsize=9,
        )
    return save_figure(fig, stem)


def zipf_nds(points: list, stem: str | Path, gap=None) -> list[Path]:
    """Paper figure 3: trajectory-mean NDS normalized by Muon's at the first s, against the Zipf
    exponent s, with 95% seed-level intervals (the baseline's own uncertainty included); one panel per scope."""
    scopes = sorted({p.scope for p in points})
    fig, axes = plt.subplots(1, len(scopes), figsize=(4.8 * len(scopes), 3.6), squeeze=False)
    for ax, scope in zip(axes[0], scopes):
        for arm in sorted({p.arm for p in points}):
            pts = sorted((p for p in points if p.arm == arm and p.scope == scope), key=lambda p: p.s)
            s = np.array([p.s for p in pts])
            y = np.array([p.value for p in pts])
            lo = np.array([p.ci95[0] if p.ci95 else p.value for p in pts])
            hi = np.array([p.ci95[1] if p.ci95 else p.value for p in pts])
            ax.errorbar(s, y, yerr=[y - lo, hi - y], fmt="o-", capsize=3, color=_color(arm), label=arm)
        if scope == "all":  # the paper's values (all parameters), from curvlab.studies.paper
            for arm, (s0, s1) in PAPER_ZIPF.items():
                ax.plot([0.0, 1.0], [s0, s1], "D", mfc="none", color=_color(arm), label=f"{arm} (paper)")
        ax.set(xlabel="Zipf exponent s", ylabel="NDS / NDS(Muon, first s)", title=f"trajectory-mean NDS ({scope})")
        ax.legend(fontsize=8)
    if gap is not None:
        fig.suptitle(f"gap growth (s = last minus first): {_ci_text(gap)}", fontsize=9)
    return save_figure(fig, stem)


PAPER_ZIPF = {
    "muon": (1.0, CLAIMS["normalized_nds_muon_s1"].paper),
    "adamw": (CLAIMS["normalized_nds_adamw_s0"].paper, CLAIMS["normalized_nds_adamw_s1"].paper),
}


def layer_split_over_training(tracks: dict[str, list], stem: str | Path) -> list[Path]:
    """Paper figure 4: within- and cross-layer NDS over training, and rho_within, per optimizer
    (``{arm: TrackRecords over seeds}``): the mean over seeds, with a band from the lowest to the highest seed."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for name, records in tracks.items():
        color = _color(name)
        for ax, key in zip(axes, ("within", "cross", "rho_within")):
            band = seed_band(records, key)
            ax.plot(band.steps, band.mean, "o-", ms=3, color=color, label=f"{name} ({len(records)} seeds)")
            ax.fill_between(band.steps, band.low, band.high, color=color, alpha=0.2)
    for ax, title in zip(axes, ["within-layer NDS", "cross-layer NDS", "rho_within = within / NDS"]):
        ax.set(xlabel="step", title=title)
        ax.legend(fontsize=8)
    axes[2].set_ylim(-1, 2)
    return save_figure(fig, stem)


def tuning_grids(tuning: TuningRecord, stem: str | Path) -> list[Path]:
    """Final validation loss against the learning rate for every tuned grid, with the standard error
    over seeds as bars and the chosen point ringed."""
    searches = tuning.searches
    fig, axes = plt.subplots(1, len(searches), figsize=(3.6 * len(searches), 3.2), squeeze=False)
    for ax, (name, s) in zip(axes[0], searches.items()):
        lrs = sorted(s.grid)
        mean = np.array([s.mean(lr) for lr in lrs])
        se = np.array([0.0 if not np.isfinite(s.stderr(lr)) else s.stderr(lr) for lr in lrs])
        finite = np.isfinite(mean)
        color = _color(name.split(".")[0])
        ax.errorbar(np.array(lrs)[finite], mean[finite], yerr=se[finite], fmt="o-", capsize=3, color=color)
        ax.plot([s.chosen], [s.mean(s.chosen)], "o", ms=12, mfc="none", color="k")
        ax.set_xscale("log", base=2)
        ax.set(xlabel=name, ylabel="final validation loss")
    fig.suptitle(f"learning-rate grids ({tuning.horizon_steps}-step runs, seeds {tuning.seeds})", fontsize=9)
    return save_figure(fig, stem)


def block_heatmaps(reports: dict[str, CurvatureReport], stem: str | Path) -> list[Path]:
    """Beyond the paper: the block interaction matrix M at one matched level, one panel per optimizer."""
    fig, axes = plt.subplots(1, len(reports), figsize=(5 * len(reports), 4.2), squeeze=False)
    limit = max(np.abs(r.blocks.matrix).max() for r in reports.values())
    for ax, (name, report) in zip(axes[0], reports.items()):
        image = ax.imshow(report.blocks.matrix, cmap="RdBu_r", vmin=-limit, vmax=limit)
        names = list(report.blocks.names)
        ax.set_xticks(range(len(names)), names, rotation=60, fontsize=7)
        ax.set_yticks(range(len(names)), names, fontsize=7)
        ax.set_title(f"{name}: NDS {report.split.nds:.3g}, rho_within {report.blocks.rho_within:.2f}", fontsize=9)
    fig.colorbar(image, ax=axes[0].tolist(), label="M[l,m] = <Z_l, H_lm Z_m> / ||Z||²")
    return save_figure(fig, stem)


def within_gap_by_layer(names: list[str], gap: list[float], stem: str | Path, stderr: list[float] | None = None):
    """Beyond the paper: the within-layer NDS gap AdamW − Muon per block (diagonal of M), averaged over
    matched levels, with its standard error over levels as bars. The paper reports most of it in the
    first and last layers."""
    fig, ax = plt.subplots(figsize=(6, 3.4))
    colors = ["tab:red" if g > 0 else "tab:blue" for g in gap]
    ax.bar(range(len(names)), gap, yerr=None if stderr is None else np.nan_to_num(stderr), capsize=3, color=colors)
    ax.set_xticks(range(len(names)), names, rotation=45, fontsize=8)
    ax.axhline(0, color="k", lw=0.8)
    ax.set(ylabel="M[l,l]: AdamW − Muon", title="within-layer NDS gap per block")
    return save_figure(fig, stem)


def spectral_density_plot(density: dict[str, Any], stem: str | Path, title: str = "") -> list[Path]:
    """The Hessian's spectral density (stochastic Lanczos quadrature), on a log scale."""
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.semilogy(density["grid"], np.maximum(density["density"], 1e-12))
    ax.set(xlabel="eigenvalue", ylabel="density", title=title or "Hessian spectral density (SLQ)")
    return save_figure(fig, stem)


def lambda_max_along_run(tracks: dict[str, list[CheckpointScalars]], stem: str | Path) -> list[Path]:
    """λ_max of the Hessian beside the NDS of the update, along each run (NDS <= λ_max always)."""
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for name, rows in tracks.items():
        rows = [r for r in rows if r.lambda_max is not None]
        step = [r.step for r in rows]
        ax.semilogy(step, [r.lambda_max for r in rows], "o-", color=COLORS.get(name), label=f"{name} λ_max")
        ax.semilogy(step, [max(r.all.nds, 1e-12) for r in rows], "x--", color=COLORS.get(name), label=f"{name} NDS")
    ax.set(xlabel="step", title="sharpest direction vs the update's direction")
    ax.legend(fontsize=8)
    return save_figure(fig, stem)


def curvature_during_training(tracks: dict[str, list[CheckpointScalars]], stem: str | Path) -> list[Path]:
    """The monitor's rows along each run (``curvlab train --curvature-every K``): NDS over all
    parameters and the hidden matrices; the Taylor split (I1, I2, predicted and realized decrease);
    the within- and cross-layer NDS when the rows have them. Steps whose row is not ``ok`` are marked
    with a grey line and left as gaps."""
    with_blocks = any(not np.isnan(r.within) for rows in tracks.values() for r in rows)
    fig, axes = plt.subplots(1, 3 if with_blocks else 2, figsize=(13 if with_blocks else 9, 3.6))
    for name, rows in tracks.items():
        color = COLORS.get(name)
        step = np.array([r.step for r in rows])

        def values(key, rows=rows):
            return np.array([r.value(key) for r in rows], dtype=float)

        axes[0].plot(step, values("nds"), "o-", color=color, label=f"{name} all")
        axes[0].plot(step, values("hidden_nds"), "x--", color=color, label=f"{name} hidden")
        for key, style in zip(("first_order", "curvature_penalty", "predicted", "realized"), ("o-", "s-", "x--", "^:")):
            axes[1].plot(step, values(key), style, color=color, label=f"{name} {key}", ms=4)
        if with_blocks:
            axes[2].plot(step, values("within"), "o-", color=color, label=f"{name} within")
            axes[2].plot(step, values("cross"), "x--", color=color, label=f"{name} cross")
        for r in rows:
            if r.status != "ok":
                for ax in axes:
                    ax.axvline(r.step, color="grey", lw=0.8, alpha=0.6)
    titles = [
        "NDS <Z,HZ>/||Z||² (held-out)",
        "one-step decrease: I1, I2, predicted, realized",
        "within / cross-layer NDS",
    ]
    for ax, title in zip(axes, titles):
        ax.set(xlabel="step", title=title)
        ax.legend(fontsize=7)
    return save_figure(fig, stem)


def track_figures(tracked: Track, run: str | Path, out: str | Path, spectrum: bool = False) -> list[Path]:
    """The figures of ``curvlab track`` in ``out``: from monitor rows, :func:`curvature_during_training`
    (the run named by its optimizer, else its directory); from checkpoints with ``spectrum``,
    :func:`lambda_max_along_run`; else none."""
    rows, out = tracked.rows, Path(out)
    if tracked.source == "monitor":
        return curvature_during_training({rows[0].optimizer or Path(run).name: rows}, out / "curvature_during_training")
    return lambda_max_along_run({rows[0].optimizer: rows}, out / "lambda_max_vs_nds") if spectrum else []


def _two_and_five(x: float, _pos) -> str:
    """A log axis's minor label: the value at mantissas 2 and 5, nothing elsewhere."""
    if x <= 0:
        return ""
    mantissa = x / 10 ** np.floor(np.log10(x))
    return f"{x:g}" if min(abs(mantissa - 2), abs(mantissa - 5)) < 1e-6 else ""


def _plain_log_x(ax) -> None:
    """A log x axis labelled with plain numbers (0.2, 1, 5), not 2 x 10^-1; minor labels at 2 and 5 only."""
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(_two_and_five))


def primary_forest(entries: list, stem: str | Path) -> list[Path]:
    """The primary family as a forest plot (:class:`curvlab.studies.primary.PrimaryEntry` records): each claim's
    value and 95% seed-level interval, ratios on a log axis (left, no effect at 1) and differences on a
    linear one (right, no effect at 0), the paper's number as an open diamond, and each row labelled
    with its direction and magnitude verdicts. Unmeasured claims are listed, not drawn; an interval
    that is not positive throughout cannot go on the log axis and is drawn with the differences."""
    ratios = [e for e in entries if e.value is not None and e.kind == "ratio" and e.value > 0]
    ratios = [e for e in ratios if e.ci95 is None or e.ci95[0] > 0]
    differences = [e for e in entries if e.value is not None and e not in ratios]
    missing = [e for e in entries if e.value is None]
    label = "AdamW / Muon (log scale)"
    if any(e.name in MUON_OVER_ADAMW for e in ratios):
        label = "AdamW / Muon, or Muon / AdamW where a row says so (log scale)"
    panels = [(ratios, "log", 1.0, label), (differences, "linear", 0.0, "difference")]
    panels = [p for p in panels if p[0]]
    sizes = [len(p[0]) for p in panels] or [1]
    fig, axes = plt.subplots(
        len(sizes), 1, figsize=(8.5, 1.4 + 0.6 * sum(sizes)), squeeze=False, gridspec_kw={"height_ratios": sizes}
    )
    for ax, (rows, scale, null, label) in zip(axes[:, 0], panels):
        y = np.arange(len(rows))[::-1]
        for yi, e in zip(y, rows):
            if e.ci95 is not None:
                ax.plot(e.ci95, [yi, yi], color="k", lw=1.5)
            ax.plot([e.value], [yi], "o", color="tab:blue", ms=6)
            if e.paper is not None:
                ax.plot([e.paper], [yi], "D", mfc="none", color="tab:red", ms=7)
        ax.axvline(null, color="gray", lw=0.8, ls="--")
        if scale == "log":
            _plain_log_x(ax)
        names = []
        for e in rows:
            verdicts = e.direction if e.magnitude in (None, e.direction) else f"{e.direction}; magnitude {e.magnitude}"
            inverted = ", Muon / AdamW" if e.name in MUON_OVER_ADAMW else ""
            names.append(f"{e.name} ({e.scope}{inverted}, {e.n_seeds} seeds)\n{verdicts}")
        ax.set_yticks(y, names, fontsize=7)
        ax.set_ylim(-0.7, len(rows) - 0.3)
        ax.set(xlabel=label)
    if not panels:
        axes[0][0].set_axis_off()
    title = "Primary family: value (blue) and 95% seed-level interval; the paper's number: red diamond"
    if missing:
        title += "\nnot measured: " + ", ".join(e.name for e in missing)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    return save_figure(fig, stem)


def reproduction_figures(data, summary, tuning: TuningRecord, quadratic: QuadraticStudy, out: str | Path):
    """Every figure of a reproduction, from its per-level data (:class:`curvlab.studies.records.LevelData`),
    summary, tuning and quadratic results; returns ``{figure family: paths}``."""
    out = Path(out)
    s0 = data.s_values[0]
    arms = data.against_adamw()
    entries = {e.name + ("" if e.scope == "all" else "_hidden"): e for e in summary.headline}
    written = {"tuning": tuning_grids(tuning, out / "tuning_grids")}
    if summary.primary:
        written["primary"] = primary_forest(summary.primary, out / "fig0_primary_forest")
    if "muon" in arms:
        written["taylor_split"] = taylor_split_vs_loss(arms["muon"], out / "fig1_taylor_split")
        written["nds_norm"] = nds_and_norm_vs_loss(arms, out / "fig2_nds_update_norm", entries)
        level = next(lv for c in arms["muon"] for lv in c.headline_levels[len(c.headline_levels) // 2 :])
        written["heatmap"] = block_heatmaps(pair_reports(level), out / "block_matrix_heatmap")
        names, gap, se = within_layer_gap(arms["muon"])
        written["within_gap"] = within_gap_by_layer(names, gap, out / "within_gap_by_layer", se)
    if summary.zipf:
        written["zipf"] = zipf_nds(summary.zipf, out / "fig3_zipf_nds", entries.get("gap_change"))
    tracks = {arm: data.track(arm, s0) for arm in ("muon", "adamw") if data.track(arm, s0)}
    if tracks:
        written["layers"] = layer_split_over_training(tracks, out / "fig4_within_cross")
    written["quadratic"] = quadratic_trajectories(quadratic, out / "fig7_quadratic_trajectories")
    written["quadratic"] += quadratic_phase(quadratic, out / "fig7_quadratic_phase")
    return written


def finetune_ratios(result, stem: str | Path) -> list[Path]:
    """The fine-tuning comparison (:class:`curvlab.studies.adapters.FinetuneResult`): left, AdamW over each
    Muon variant of NDS, I1 and I2 at matched validation loss, with 95% seed-level intervals as bars;
    right, each level's NDS of both sides against the matched loss (one marker per seed)."""
    keys = [k for k in RATIO_KEYS if k != "update_norm"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.6))
    width = 0.8 / max(1, len(result.comparisons))
    for i, c in enumerate(result.comparisons):
        entries = [result.entry(f"{k}_ratio", c.variant) for k in keys]
        x = np.arange(len(keys)) + (i - (len(result.comparisons) - 1) / 2) * width
        values = np.array([e.value for e in entries], dtype=float)
        ax.bar(x, values, width, label=f"AdamW / {c.variant}", color=f"C{i}", alpha=0.8)
        # the percentile interval need not contain the ratio of sums (a skewed statistic): drawn as is
        for xi, e in zip(x, entries):
            if e.ci95 is not None:
                ax.errorbar([xi, xi], e.ci95, color="k", lw=1, capsize=3)
        for s in c.seeds():
            levels = [lv for lv in c.levels if lv.seed == s]
            targets = [lv.target for lv in levels]
            marker = "os^v"[s % 4]
            bx.plot(targets, [lv.values[c.variant]["nds"] for lv in levels], marker, color=f"C{i}", ls="none")
            if i == 0:
                bx.plot(targets, [lv.values["adamw"]["nds"] for lv in levels], marker, color="k", mfc="none", ls="none")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(np.arange(len(keys)), ["NDS", "I1", "I2"])
    ax.set_yscale("symlog", linthresh=0.1)
    ax.set(ylabel="AdamW / variant at matched loss", title="ratio of sums, 95% seed-level CI")
    ax.legend(fontsize=7)
    bx.set(
        xlabel="matched validation loss (s = 1)", ylabel="adapter NDS (window mean)", title="per level (black: AdamW)"
    )
    bx.invert_xaxis()
    return save_figure(fig, stem)


def robustness_ratios(settings: list, stem: str | Path, reference: tuple[str, float, list[float] | None] | None = None):
    """The paired direction ratio and its 95% seed-level interval at each robustness setting
    (:class:`curvlab.studies.robustness.SettingResult` records), on a log axis with no effect at 1;
    ``reference`` (label, value, interval: the quick reproduction's) drawn first as a shaded band. A
    setting whose controls did not all pass is an open marker; one not measured is listed, not drawn."""
    rows = [x for x in settings if x.paired_ratio is not None and x.paired_ratio > 0]
    missing = [x.label for x in settings if x not in rows]
    fig, ax = plt.subplots(figsize=(7.5, 1.2 + 0.45 * (len(rows) + (reference is not None))))
    labels = []
    y = len(rows) + (reference is not None) - 1
    if reference is not None:
        label, value, ci = reference
        if ci is not None:
            ax.axvspan(ci[0], ci[1], color="tab:gray", alpha=0.2, lw=0)
            ax.plot(ci, [y, y], color="tab:gray", lw=1.5)
        ax.plot([value], [y], "s", color="tab:gray", ms=6)
        labels.append((y, label))
        y -= 1
    for x in rows:
        if x.ci95 is not None:
            ax.plot(x.ci95, [y, y], color="k", lw=1.5)
        passed = x.controls_passed is True
        ax.plot([x.paired_ratio], [y], "o", color="tab:blue", mfc="tab:blue" if passed else "none", ms=6)
        labels.append((y, f"{x.label} ({x.n_seeds} seeds)"))
        y -= 1
    ax.axvline(1.0, color="gray", lw=0.8, ls="--")
    _plain_log_x(ax)
    ax.set_yticks([p for p, _ in labels], [t for _, t in labels], fontsize=7)
    ax.set_ylim(-0.7, len(labels) - 0.3)
    ax.set(xlabel="NDS of AdamW's direction / Muon's, same W and batch (log scale)")
    title = "Paired direction ratio, 95% seed-level interval; open: a control failed"
    if missing:
        title += "\nnot measured: " + ", ".join(missing)
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    return save_figure(fig, stem)
