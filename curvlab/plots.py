"""Figures, drawn from saved results only (never recomputing curvature); each saved as PNG and PDF.

Every function takes the plain data that curvlab writes (report/compare/track/quadratic JSON, read
back as dicts) and a path stem; it returns the paths written.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: figures go to files
import matplotlib.pyplot as plt
import numpy as np

from curvlab.atomic import atomic_write_with

COLORS = {"muon": "tab:blue", "adamw": "tab:orange", "gd": "tab:orange", "adam": "tab:red", "sign": "tab:green"}


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
    return COLORS.get(name.split("-")[0])


def quadratic_trajectories(result: dict[str, Any], stem: str | Path) -> list[Path]:
    """The quadratic model: NDS and suboptimality per step for each method (paper figure 7, left)."""
    example = result["example"]
    best = example["closed_forms"]["optimal_loss"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    variant_style = {"muon-newton_schulz": "--", "muon-polar_express": "-."}
    for name, traj in {**example["line_search"], **example["fixed_lr"]}.items():
        style = variant_style.get(name, "-") if name in example["line_search"] else ":"
        label = name if traj.get("lr") is None else f"{name} (lr {traj['lr']:g})"
        axes[0].plot(range(len(traj["nds"])), traj["nds"], style, label=label, color=_color(name))
        gap = np.maximum(np.array(traj["loss"]) - best, 1e-16)
        axes[1].semilogy(range(len(gap)), gap, style, label=label, color=_color(name))
    axes[0].axhline(example["closed_forms"]["muon_nds"], color="gray", lw=0.8, ls="--", label="α w_H + (1-α) w_L")
    axes[0].set(xlabel="step", ylabel="NDS  <Z,HZ>/||Z||²", title="directional sharpness", yscale="log")
    axes[1].set(xlabel="step", ylabel="Q(Y) − Q*", title="suboptimality")
    axes[1].legend(fontsize=7)
    fig.suptitle(example["title"], fontsize=9)
    return save_figure(fig, stem)


def quadratic_phase(result: dict[str, Any], stem: str | Path) -> list[Path]:
    """Where Muon ends below GD after T steps over (ρ, α), one panel per σ_H/σ_L, with the theorem's
    sufficient region outlined (paper figure 7, right)."""
    sweep = result["sweep"]
    rhos, alphas, ratios = np.array(sweep["rhos"]), np.array(sweep["alphas"]), sweep["ratios"]
    wins = np.array(sweep["muon_wins"])
    condition = np.array(sweep["condition"])
    log_ratio = np.array(sweep["log10_suboptimality_ratio"])
    fig, axes = plt.subplots(1, len(ratios), figsize=(4 * len(ratios), 3.6), squeeze=False)
    for k, (ax, ratio) in enumerate(zip(axes[0], ratios)):
        limit = max(1e-9, min(12.0, np.abs(log_ratio[k]).max()))
        mesh = ax.pcolormesh(rhos, alphas, log_ratio[k], cmap="RdBu_r", vmin=-limit, vmax=limit, shading="nearest")
        ax.contour(rhos, alphas, condition[k].astype(float), levels=[0.5], colors="k", linewidths=1.2)
        ax.contour(rhos, alphas, wins[k].astype(float), levels=[0.5], colors="gold", linewidths=1.0, linestyles="--")
        ax.set(xscale="log", xlabel="ρ = w_H / w_L", ylabel="α = m / q", title=f"σ_H/σ_L = {ratio:g}")
    fig.colorbar(mesh, ax=axes[0].tolist(), label="log10 (Muon gap / GD gap) after T steps")
    fig.suptitle(
        f"T = {sweep['steps']}: blue = Muon lower; black: the theorem's sufficient condition; gold dashed: Muon wins",
        fontsize=9,
    )
    return save_figure(fig, stem)


def _pair_arrays(compare: dict[str, Any], key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(matched loss, value for Muon, value for AdamW) along the matched pairs of a compare.json."""
    rows = sorted(compare["pairs"], key=lambda r: -r["target"])
    muon, adam = ("a", "b") if compare["optimizers"][0] == "muon" else ("b", "a")
    return (
        np.array([r["target"] for r in rows]),
        np.array([r[f"{key}_{muon}"] for r in rows]),
        np.array([r[f"{key}_{adam}"] for r in rows]),
    )


def taylor_split_vs_loss(compare: dict[str, Any], stem: str | Path) -> list[Path]:
    """Paper figure 1: realized vs predicted one-step decrease, first-order gain and curvature
    penalty, Adam vs Muon, against the matched validation loss."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    panels = [
        (("realized", "predicted"), "one-step decrease ΔD"),
        (("first_order",), "first-order gain I1 = <G,Z>"),
        (("curvature_penalty",), "curvature penalty I2 = ½<Z,HZ>"),
    ]
    for ax, (keys, title) in zip(axes, panels):
        for key in keys:
            x, muon, adam = _pair_arrays(compare, key)
            style = "o-" if key != "predicted" else "x--"
            ax.plot(x, muon, style, color=COLORS["muon"], label=f"Muon {key}")
            ax.plot(x, adam, style, color=COLORS["adamw"], label=f"AdamW {key}")
        ax.set(xlabel="matched validation loss", title=title)
        ax.invert_xaxis()
        ax.legend(fontsize=7)
    return save_figure(fig, stem)


def nds_and_norm_vs_loss(compare: dict[str, Any], stem: str | Path) -> list[Path]:
    """Paper figure 2: NDS and update norm ||Z||_F against the matched validation loss."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, (key, title) in zip(axes, [("nds", "NDS <Z,HZ>/||Z||²"), ("update_norm", "update norm ||Z||_F")]):
        x, muon, adam = _pair_arrays(compare, key)
        ax.plot(x, muon, "o-", color=COLORS["muon"], label="Muon")
        ax.plot(x, adam, "o-", color=COLORS["adamw"], label="AdamW")
        ax.set(xlabel="matched validation loss", title=title)
        ax.invert_xaxis()
        ax.legend(fontsize=8)
    fig.suptitle(f"mean AdamW/Muon NDS ratio {compare['mean_ratios']['nds']:.2f}", fontsize=9)
    return save_figure(fig, stem)


def zipf_nds(zipf: dict[str, Any], stem: str | Path) -> list[Path]:
    """Paper figure 3: trajectory-averaged NDS normalized by Muon at s = 0, against the Zipf exponent s,
    and the Adam-Muon gap."""
    s = np.array(zipf["s"])
    muon, adam = np.array(zipf["normalized"]["muon"]), np.array(zipf["normalized"]["adamw"])
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    axes[0].plot(s, muon, "o-", color=COLORS["muon"], label="Muon")
    axes[0].plot(s, adam, "o-", color=COLORS["adamw"], label="AdamW")
    axes[0].set(xlabel="Zipf exponent s", ylabel="NDS / NDS(Muon, s=0)", title="trajectory-averaged NDS")
    axes[0].legend(fontsize=8)
    axes[1].plot(s, adam - muon, "o-", color="k")
    axes[1].set(xlabel="Zipf exponent s", title="gap AdamW − Muon")
    return save_figure(fig, stem)


def layer_split_over_training(tracks: dict[str, list[dict[str, Any]]], stem: str | Path) -> list[Path]:
    """Paper figure 4: within- and cross-layer NDS over training, and rho_within, per optimizer."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for name, rows in tracks.items():
        step = [r["step"] for r in rows]
        color = COLORS.get(name)
        axes[0].plot(step, [r["within"] for r in rows], "o-", color=color, label=name)
        axes[1].plot(step, [r["cross"] for r in rows], "o-", color=color, label=name)
        axes[2].plot(step, [r["rho_within"] for r in rows], "o-", color=color, label=name)
    for ax, title in zip(axes, ["within-layer NDS", "cross-layer NDS", "rho_within = within / NDS"]):
        ax.set(xlabel="step", title=title)
        ax.legend(fontsize=8)
    return save_figure(fig, stem)


def block_heatmaps(reports: dict[str, dict[str, Any]], stem: str | Path) -> list[Path]:
    """Beyond the paper: the block interaction matrix M at one matched level, one panel per optimizer."""
    fig, axes = plt.subplots(1, len(reports), figsize=(5 * len(reports), 4.2), squeeze=False)
    limit = max(np.abs(np.array(r["blocks"]["matrix"])).max() for r in reports.values())
    for ax, (name, report) in zip(axes[0], reports.items()):
        M = np.array(report["blocks"]["matrix"])
        image = ax.imshow(M, cmap="RdBu_r", vmin=-limit, vmax=limit)
        names = report["blocks"]["names"]
        ax.set_xticks(range(len(names)), names, rotation=60, fontsize=7)
        ax.set_yticks(range(len(names)), names, fontsize=7)
        ax.set_title(f"{name}: NDS {report['nds']:.3g}, rho_within {report['blocks']['rho_within']:.2f}", fontsize=9)
    fig.colorbar(image, ax=axes[0].tolist(), label="M[l,m] = <Z_l, H_lm Z_m> / ||Z||²")
    return save_figure(fig, stem)


def within_gap_by_layer(names: list[str], gap: list[float], stem: str | Path) -> list[Path]:
    """Beyond the paper: the within-layer NDS gap AdamW − Muon per block (diagonal of M), averaged over
    matched levels. The paper reports most of it in the first and last layers."""
    fig, ax = plt.subplots(figsize=(6, 3.4))
    ax.bar(range(len(names)), gap, color=["tab:red" if g > 0 else "tab:blue" for g in gap])
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


def lambda_max_along_run(tracks: dict[str, list[dict[str, Any]]], stem: str | Path) -> list[Path]:
    """λ_max of the Hessian beside the NDS of the update, along each run (NDS <= λ_max always)."""
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for name, rows in tracks.items():
        rows = [r for r in rows if "lambda_max" in r]
        step = [r["step"] for r in rows]
        ax.semilogy(step, [r["lambda_max"] for r in rows], "o-", color=COLORS.get(name), label=f"{name} λ_max")
        ax.semilogy(step, [max(r["nds"], 1e-12) for r in rows], "x--", color=COLORS.get(name), label=f"{name} NDS")
    ax.set(xlabel="step", title="sharpest direction vs the update's direction")
    ax.legend(fontsize=8)
    return save_figure(fig, stem)


def curvature_during_training(tracks: dict[str, list[dict[str, Any]]], stem: str | Path) -> list[Path]:
    """The monitor's rows along each run (``curvlab train --curvature-every K``): NDS over all
    parameters and the hidden matrices; the Taylor split (I1, I2, predicted and realized decrease);
    the within- and cross-layer NDS when the rows have them. Steps whose row is not ``ok`` are marked
    with a grey line and left as gaps."""
    with_blocks = any(r.get("within") is not None for rows in tracks.values() for r in rows)
    fig, axes = plt.subplots(1, 3 if with_blocks else 2, figsize=(13 if with_blocks else 9, 3.6))
    for name, rows in tracks.items():
        color = COLORS.get(name)
        step = np.array([r["step"] for r in rows])

        def values(key, rows=rows):
            return np.array([np.nan if r.get(key) is None else r[key] for r in rows], dtype=float)

        axes[0].plot(step, values("nds"), "o-", color=color, label=f"{name} all")
        axes[0].plot(step, values("hidden_nds"), "x--", color=color, label=f"{name} hidden")
        for key, style in (
            ("first_order", "o-"),
            ("curvature_penalty", "s-"),
            ("predicted", "x--"),
            ("realized", "^:"),
        ):
            axes[1].plot(step, values(key), style, color=color, label=f"{name} {key}", ms=4)
        if with_blocks:
            axes[2].plot(step, values("within"), "o-", color=color, label=f"{name} within")
            axes[2].plot(step, values("cross"), "x--", color=color, label=f"{name} cross")
        for r in rows:
            if r["status"] != "ok":
                for ax in axes:
                    ax.axvline(r["step"], color="grey", lw=0.8, alpha=0.6)
    titles = [
        "NDS <Z,HZ>/||Z||² (held-out)",
        "one-step decrease: I1, I2, predicted, realized",
        "within / cross-layer NDS",
    ]
    for ax, title in zip(axes, titles):
        ax.set(xlabel="step", title=title)
        ax.legend(fontsize=7)
    return save_figure(fig, stem)
