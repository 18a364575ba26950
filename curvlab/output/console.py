"""What the commands print: each result record as the lines ``curvlab`` shows on the terminal, and the one
aligned plain-text table (:func:`table`) they are laid out with.

Every function returns text and prints nothing, so that the command line only echoes it (and a test can
read it); lines meant for stderr (refusals, a monitored step's message) come from their own functions.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from curvlab.analysis.direction_report import DirectionReport
from curvlab.analysis.directions import PairedDirections
from curvlab.analysis.estimate import EstimateReport
from curvlab.analysis.report import CurvatureReport
from curvlab.analysis.spectrum import CheckpointSpectrum
from curvlab.curvature.scalars import RATIO_KEYS, SCOPE_KEYS
from curvlab.output.cells import primary_cell
from curvlab.output.finetune_text import finetune_table
from curvlab.output.text import calibration_line, primary_table
from curvlab.studies.adapters import FinetuneResult
from curvlab.studies.compare import Comparison
from curvlab.studies.long import LongSummary
from curvlab.studies.robustness import RobustnessSummary
from curvlab.studies.scaling import ScalingSummary
from curvlab.studies.summary import Summary
from curvlab.studies.track import Track
from curvlab.theory.quadratic import QuadraticStudy


def table(rows: Iterable[Sequence[Any]], header: Sequence[str], left: int = 1) -> str:
    """``rows`` under ``header`` as an aligned plain-text table: the header and the first ``left`` columns
    flush left, the other cells flush right, a float to 6 significant figures, a rule under the header."""
    cells = [tuple(str(c) for c in header)] + [tuple(_cell(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = []
    for k, r in enumerate(cells):
        lines.append(
            "  ".join(c.rjust(w) if k and i >= left else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
        )
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(x: Any) -> str:
    return f"{x:.6g}" if isinstance(x, float) else str(x)


def wrote(paths: Iterable[str | Path]) -> str:
    """``wrote a, b, ...``: the files a command wrote."""
    return "wrote " + ", ".join(map(str, paths))


def pcfg_stats_text(stats: dict[str, Any]) -> str:
    """A Zipf-PCFG data directory's ``stats.json``: its vocabulary and config, and a row per split."""
    rows = [
        (split, st["s"], st["tokens"], st["sentences"], st["entropy_bits"], st["zipf_exponent_mean"])
        for split, st in ((k, stats[k]) for k in ("train", "val"))
    ]
    head = f"vocabulary: {stats['vocab_size']} tokens (separator included); config: {json.dumps(stats['config'])}"
    return head + "\n" + table(rows, ("split", "s", "tokens", "sentences", "entropy (bits)", "fitted Zipf exponent"))


def text_stats_text(stats: dict[str, Any]) -> str:
    """A ``curvlab data text`` directory's ``stats.json``: its vocabulary, tokenizer and split rule, and a row
    per split."""
    rows = [
        (k, stats[k]["documents"], stats[k]["tokens"], stats[k]["shards"], stats[k]["entropy_nats"])
        for k in ("train", "val")
    ]
    tokenizer = stats["tokenizer"]
    kind = "trained byte-level BPE" if tokenizer["trained"] else "given tokenizer.json"
    head = (
        f"vocabulary: {stats['vocab_size']} tokens ({kind}, sha256 {tokenizer['sha256'][:12]}); split: {stats['split']}"
    )
    return head + "\n" + table(rows, ("split", "documents", "tokens", "shards", "unigram entropy (nats)"))


def trained_line(
    optimizer: str, step: int, val_loss: float, tokens_per_second: float, out: str | Path, resumed_from: int, world: int
) -> str:
    """One line: the step a run reached, its validation loss, its speed and where its checkpoints are.

    Args:
        optimizer: the run's optimizer, by name.
        step, val_loss, tokens_per_second, out, resumed_from: the run's result (``resumed_from`` 0: not resumed).
        world: the number of ranks it ran on.
    """
    resumed = f" (resumed from step {resumed_from})" if resumed_from else ""
    ranks = f" on {world} ranks" if world > 1 else ""
    return (
        f"trained {optimizer} to step {step}{resumed}{ranks}: val loss {val_loss:.4f}, "
        f"{tokens_per_second:.0f} tokens/s per rank; checkpoints in {out}"
    )


def _checkpoint_line(checkpoint: str | Path, step: int, optimizer: str, val_loss: float | None) -> str:
    val = "none recorded" if val_loss is None or not math.isfinite(val_loss) else f"{val_loss:.4f}"
    return f"{checkpoint}: step {step}, optimizer {optimizer}, val loss {val}"


def report_text(report: CurvatureReport, checkpoint: str | Path) -> str:
    """A checkpoint's report: the Taylor split over all parameters and the hidden matrices, the block
    split and a row per block, and the time it took."""
    d = report.to_dict()
    keys = ("nds", *(k for k in SCOPE_KEYS if k != "nds"))
    hidden = d["hidden"] or {}
    b = d["blocks"]
    split = f"within {b['within']:.6g}, cross {b['cross']:.6g}, rho_within {b['rho_within']:.3f}"
    own = b["block_nds"]
    rows = [
        (name, b["norm"][i], b["first_order"][i], b["matrix"][i][i], own[i] if own[i] is not None else "-")
        for i, name in enumerate(b["names"])
    ]
    t = d["timing"]
    return "\n".join(
        [
            _checkpoint_line(checkpoint, d["step"], d["optimizer"], d["val_loss"]),
            table([(k, d[k], hidden.get(k, "")) for k in keys], ("quantity", "all parameters", "hidden matrices")),
            f"\nblocks ({b['grouping']}): {split}",
            table(rows, ("block", "||Z_l||", "<G_l,Z_l>", "M[l,l]", "own NDS")),
            f"\n{t['seconds']:.2f} s, {t['hvp_seconds'] / t['seconds']:.0%} in Hessian-vector products",
        ]
    )


def estimate_text(report: EstimateReport) -> str:
    """A checkpoint's next step by one estimator: its NDS with its own error and cost, and the Taylor split."""
    e = report.estimate
    error = "exact to rounding" if e.error is None else f"± {e.error:.3g} (its own estimate)"
    return "\n".join([
        _checkpoint_line(report.checkpoint, report.step, report.optimizer, report.val_loss),
        f"  estimator {e.estimator}: NDS {e.nds:.6g} {error}; cost {e.forwards} forwards, {e.backwards} backwards",
        f"  <Z,HZ> {e.zhz:.6g}   ||Z|| {report.update_norm:.6g}",
        f"  first order {report.first_order:.6g}  curvature penalty {report.curvature_penalty:.6g}  "
        f"predicted {report.predicted:.6g}  realized {report.realized:.6g}",
    ])  # fmt: skip


def directions_report_text(report: DirectionReport) -> str:
    """A checkpoint's directions compared: a header line and :func:`directions_table`."""
    head = _checkpoint_line(report.checkpoint, report.step, report.optimizer, report.val_loss)
    return head + "\n" + directions_table(report.paired)


def directions_table(paired: PairedDirections) -> str:
    """The directions as an aligned table, each one's source below it, and the hidden-scope NDS of each over
    the real step's (the paired direction ratio)."""
    real = paired.get(paired.real) if paired.real in paired.names else None
    header = ("direction", "scaling", "NDS all", "NDS hidden", "cos all", "cos hidden", "q all", "q hidden")
    header += ("||Z|| all", "||Z|| hidden", f"NDS/NDS({paired.real}) hidden")
    rows = []
    for d in paired.directions:
        a, h = d.all, d.hidden
        ratio = h.nds / real.hidden.nds if real is not None and real.hidden.nds != 0 else float("nan")
        rows.append(
            (d.name, d.scaling, a.nds, h.nds, a.cosine, h.cosine, a.q, h.q, a.update_norm, h.update_norm, ratio)
        )
    lines = [table(rows, header, left=2), ""]
    lines += [f"{d.name}: {d.source}" for d in paired.directions]
    lines.append(
        f"(base state: {paired.base}; schedule multiplier {paired.multiplier:.6g}; off the hidden matrices every "
        "direction is the real step)"
    )
    if paired.shadow is not None:
        lines.append(f"(shadow {paired.shadow['kind']}: peak lr {paired.shadow['lr']:g} times the multiplier)")
    return "\n".join(lines + gauss_newton_lines(paired))


def gauss_newton_lines(paired: PairedDirections) -> list[str]:
    """Each measured direction's NDS split into its Gauss–Newton part and the residual, with the AdamW/Muon ratio
    of each part on the hidden matrices (none where the split wasn't asked for)."""
    split = [d for d in paired.directions if not math.isnan(getattr(d.hidden, "nds_gauss_newton", math.nan))]
    if not split:
        return []
    header = ("direction", "NDS all", "GN all", "residual all", "NDS hidden", "GN hidden", "residual hidden")
    rows = [
        (d.name, *(v for c in (d.all, d.hidden) for v in (c.nds, c.nds_gauss_newton, c.nds - c.nds_gauss_newton)))
        for d in split
    ]
    lines = ["", "Gauss–Newton split (GN >= 0; the residual carries all negative curvature):"]
    lines.append(table(rows, header, left=2))
    a, m = (paired.get(n).hidden if n in paired.names else None for n in ("adamw", "muon"))
    if a is not None and m is not None and min(a.nds, m.nds, a.nds_gauss_newton, m.nds_gauss_newton) > 0:
        # NDS = GN (1 + r): the ratio is the GN parts' times the residual's factor (1 + r_a)/(1 + r_m)
        gn = a.nds_gauss_newton / m.nds_gauss_newton
        lines.append(
            f"adamw/muon on the hidden matrices: NDS {a.nds / m.nds:.4g} = GN {gn:.4g} x residual factor "
            f"{a.nds / m.nds / gn:.4g}"
        )
    return lines


def comparison_text(result: Comparison, out: str | Path) -> str:
    """Two runs compared: the ratios at each matched level, their means, and the files written to ``out``."""
    out = Path(out)
    rows = [(r["target"], r["step_a"], r["step_b"], *(r[f"ratio_{k}"] for k in RATIO_KEYS)) for r in result.rows]
    return "\n".join(
        [
            f"ratios {result.ratio_label} at matched validation loss:",
            table(rows, ("val loss", "step A", "step B", *RATIO_KEYS)),
            "mean: " + ", ".join(f"{k} {v:.3f}" for k, v in result.mean_ratios.items()),
            f"wrote {out / 'compare.csv'} and {out / 'compare.json'}",
        ]
    )


def refusals(result: Comparison) -> list[str]:
    """The levels a comparison refused, a line each (for stderr)."""
    return [f"refused {message}" for message in result.refused]


# the columns of a track drawn from checkpoints (with the spectrum's two where it was asked for) and from monitor rows
TRACK_KEYS = ("step", "val_loss", "nds", "within", "cross", "rho_within", "update_norm")
SPECTRUM_KEYS = ("lambda_max", "overlap_top_k")
MONITOR_KEYS = ("step", "val_loss", "status", "nds", "hidden_nds", "predicted", "realized", *TRACK_KEYS[3:6])


def track_table(tracked: Track, spectrum: bool = False) -> str:
    """A track's rows: from monitor rows, their status and Taylor split (``-`` where a row has none); from
    checkpoints, the NDS and block split (and λ_max with ``spectrum``)."""
    if tracked.source == "monitor":
        return table([tuple(r.to_dict().get(k, "-") for k in MONITOR_KEYS) for r in tracked.rows], MONITOR_KEYS)
    keys = TRACK_KEYS + (SPECTRUM_KEYS if spectrum else ())
    return table([tuple(r.to_dict().get(k) for k in keys) for r in tracked.rows], keys)


def track_messages(tracked: Track) -> list[str]:
    """What the monitor said of the steps it could not measure, a line each (for stderr)."""
    if tracked.source != "monitor":
        return []
    return [f"step {r.step}: {r.message}" for r in tracked.rows if r.message]


def spectrum_text(result: CheckpointSpectrum) -> str:
    """A checkpoint's spectrum: each eigenvalue with its residual and convergence, the blocks' and the
    preconditioned λ_max, then the trace estimates."""
    rows: list[tuple] = []
    for key, r in (("top", result.top), ("bottom", result.bottom)):
        if r is not None:
            rows += [(key, f"{v:.6g}", f"{res:.2g}", r.converged) for v, res in zip(r.eigenvalues, r.residuals)]
    for name, r in (result.blocks or {}).items():
        rows.append((f"λ_max {name}", f"{r.eigenvalues[0]:.6g}", f"{r.residuals[0]:.2g}", r.converged))
    if result.preconditioned is not None:
        p, r = result.preconditioned, result.preconditioned.eigen
        rows.append(("P^-1/2 H P^-1/2", f"{r.eigenvalues[0]:.6g}", f"{r.residuals[0]:.2g}", r.converged))
        rows.append((f"(2+2β1)/((1-β1)lr), β1={p.beta1:g}", f"{p.edge_of_stability:.6g}", "", ""))
    lines = [table(rows, ("what", "eigenvalue", "residual", "converged"))]
    lines += [
        f"trace ({name}): {t.trace:.6g} ± {t.std_error:.2g} ({t.num_matvecs} HVPs)"
        for name, t in result.traces().items()
    ]
    return "\n".join(lines)


def quadratic_text(study: QuadraticStudy) -> str:
    """The quadratic model's worked example: each method's final gap, mean NDS and step size, and the
    closed forms."""
    closed = study.closed_forms
    rows = [
        (name, traj.loss[-1] - closed.optimal_loss, float(np.mean(traj.nds)), traj.lr or "line search")
        for name, traj in study.trajectories.items()
    ]
    return (
        table(rows, ("method", "final gap", "mean NDS", "step size"))
        + f"\nclosed forms: Muon NDS {closed.muon_nds:.6g}, Muon Γ² {closed.muon_contraction:.6f}, "
        f"GD two-step {closed.gd_two_step_contraction:.6f}; theorem condition holds: {closed.theorem_condition}"
    )


def reproduction_text(summary: Summary, out: str | Path) -> str:
    """A reproduction's primary family, its A/A calibration, and how long it took."""
    lines = [*primary_table(summary.primary), calibration_line(summary.calibration)]
    return "\n".join([*lines, f"finished in {summary.seconds:.0f} s; report: {Path(out) / 'report.md'}"])


def robustness_text(summary: RobustnessSummary, out: str | Path) -> str:
    """A robustness design: each setting's paired ratio, its verdict and its controls, and how long it took."""
    lines = []
    for x in summary.settings:
        ci = "" if x.ci95 is None else f" [{x.ci95[0]:.3g}, {x.ci95[1]:.3g}]"
        value = "not measured" if x.paired_ratio is None else f"{x.paired_ratio:.3g}{ci}"
        lines.append(f"{x.label}: paired ratio {value}, {x.verdict}; controls passed: {x.controls_passed}")
    return "\n".join([*lines, f"finished in {summary.seconds:.0f} s; report: {Path(out) / 'report.md'}"])


def scaling_text(summary: ScalingSummary, out: str | Path) -> str:
    """A scaling design: each judged fit's slope and its 124M extrapolation, and how long it took."""
    lines = []
    for f in summary.fits:
        if f.fit is None:
            lines.append(f"{f.quantity}: not fitted ({f.note})")
            continue
        lo, hi = f.fit.prediction_pi95
        verdicts = f"; {f.trend}, against 1.76: {f.against_paper}" if f.trend else " (descriptive)"
        lines.append(
            f"{f.quantity}: slope {f.fit.slope:.3f} [{f.fit.slope_ci95[0]:.3f}, {f.fit.slope_ci95[1]:.3f}], "
            f"extrapolated to 124M {f.fit.prediction:.3g} [{lo:.3g}, {hi:.3g}]{verdicts}"
        )
    return "\n".join([*lines, f"finished in {summary.seconds:.0f} s; report: {Path(out) / 'report.md'}"])


def long_text(summary: LongSummary, out: str | Path) -> str:
    """The long design: the judged claims' verdicts (the primary family's and the thirds'), and how long it took."""
    lines = [f"{e.name} ({e.scope}): {primary_cell(e)}, {e.direction}" for e in summary.primary if e.p_holm is not None]
    for e in (e for e in summary.thirds if e.judged):
        value = "not measured" if e.value is None else f"{e.value:.3g}"
        lines.append(f"{e.quantity} {e.third} (s = {e.s:g}, {e.scope}): {value}, {e.verdict}")
    return "\n".join([*lines, f"finished in {summary.seconds:.0f} s; report: {Path(out) / 'report.md'}"])


def finetune_text(result: FinetuneResult, out: str | Path) -> str:
    """A fine-tuning comparison: its table, and how long it took."""
    lines = finetune_table(result)
    return "\n".join([*lines, f"finished in {result.timing['total']:.0f} s; results: {Path(out) / 'finetune.json'}"])
