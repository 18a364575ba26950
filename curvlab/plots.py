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
