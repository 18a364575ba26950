"""The Hessian spectrum of one checkpoint (``curvlab spectrum``): extreme eigenvalues, traces, densities,
per-block and preconditioned sharpness, on the checkpoint's target and evaluation batches. What is asked
(:class:`SpectrumRequest`), what comes back (:class:`CheckpointSpectrum`, JSON ``SPECTRUM_SCHEMA_VERSION``)
and :func:`checkpoint_spectrum`, which computes one from the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from curvlab.analysis.targets import DTYPES, AnalysisSettings, evaluation_batches, open_checkpoint
from curvlab.curvature.groupings import group_parameters
from curvlab.curvature.spectral import (
    DensityResult,
    EigenResult,
    TraceResult,
    hutch_plus_plus,
    hutchinson,
    lanczos,
    spectral_density,
)
from curvlab.engine.loss import make_loss_fn
from curvlab.engine.operator import hessian_operator, preconditioned_operator
from curvlab.errors import CurvlabError
from curvlab.optim.adam import adam_edge_of_stability, adam_preconditioner, adam_step_settings

SPECTRUM_SCHEMA_VERSION = 1  # the JSON of CheckpointSpectrum (``curvlab spectrum --out``)


@dataclass(frozen=True)
class PreconditionedSharpness:
    r""":math:`\lambda_{\max}(P^{-1/2} H P^{-1/2})` for Adam's P (:func:`adam_preconditioner`, with the
    first moment's bias correction :math:`1 - \beta_1^t` when ``bias_correction``), beside its edge of
    stability :math:`(2 + 2\beta_1)/((1 - \beta_1)\eta)` (:func:`adam_edge_of_stability`). With groups at
    different lrs (AdamW's ``hidden_lr``) η is the largest and each group's P is scaled by :math:`\eta/\eta_g`
    (``adam_preconditioner(..., scale_by_lr=True)``: exact, :mod:`curvlab.optim.adam`)."""

    eigen: EigenResult
    lr: float
    beta1: float
    bias_correction: bool = True

    @property
    def edge_of_stability(self) -> float:
        return adam_edge_of_stability(self.lr, self.beta1)

    # by hand: the eigen result's keys sit at the top level, beside the lr, beta1 and the derived edge
    def to_dict(self) -> dict[str, Any]:
        return {
            **self.eigen.to_dict(),
            "lr": self.lr,
            "beta1": self.beta1,
            "bias_correction": self.bias_correction,
            "edge_of_stability": self.edge_of_stability,
        }


# -- results of the analysis pipeline ---------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class SpectrumRequest:
    """Which parts of a checkpoint's Hessian spectrum :func:`curvlab.analysis.spectrum.checkpoint_spectrum`
    computes (``curvlab spectrum``'s options; the batches, dtype and HVP method are its
    :class:`curvlab.analysis.targets.AnalysisSettings`).

    Attributes:
        top, bottom: how many of the largest and smallest eigenvalues (Lanczos; 0: none). By default λ_min
            beside the 5 largest: the negative curvature, which λ_max alone never shows.
        trace: the trace by Hutchinson and by Hutch++.
        density: the spectral density by stochastic Lanczos quadrature.
        blocks: also λ_max of each block of this grouping (``layer``, ``tensor``, ``kind``), or None.
        preconditioned: Adam's preconditioned sharpness (AdamW checkpoints).
        max_iter: Lanczos iterations (HVPs) at most, per eigenproblem.
        memory: bytes every stored Lanczos basis may take (thick restart beyond); None: unbounded.
    """

    top: int = 5
    bottom: int = 1
    trace: bool = False
    density: bool = False
    blocks: str | None = None
    preconditioned: bool = False
    max_iter: int = 100
    memory: int | None = None

    def validate(self) -> None:
        for name in ("top", "bottom"):
            if getattr(self, name) < 0:
                raise CurvlabError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_iter < 1:
            raise CurvlabError(f"max_iter must be >= 1, got {self.max_iter}")
        if self.memory is not None and self.memory <= 0:
            raise CurvlabError(f"memory must be > 0 bytes (or None: unbounded), got {self.memory}")


def _maybe(x: Any) -> Any:
    return None if x is None else x.to_dict()


@dataclass(frozen=True)
class CheckpointSpectrum:
    """The Hessian spectrum at one checkpoint (:func:`curvlab.analysis.spectrum.checkpoint_spectrum`); every
    part is ``None`` when it wasn't asked for. JSON: ``SPECTRUM_SCHEMA_VERSION``."""

    SCHEMA_VERSION: ClassVar[int] = SPECTRUM_SCHEMA_VERSION

    checkpoint: str
    step: int
    optimizer: str
    method: str  # the HVP method
    dtype: str
    top: EigenResult | None = None
    bottom: EigenResult | None = None
    hutchinson: TraceResult | None = None
    hutch_plus_plus: TraceResult | None = None
    density: DensityResult | None = None
    blocks: dict[str, EigenResult] | None = None
    preconditioned: PreconditionedSharpness | None = None

    def traces(self) -> dict[str, TraceResult]:
        """The trace estimates taken, by estimator name."""
        both = {"hutchinson": self.hutchinson, "hutch++": self.hutch_plus_plus}
        return {k: v for k, v in both.items() if v is not None}

    # by hand: the two trace estimates are one "trace" object by estimator name (null when neither)
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.SCHEMA_VERSION,
            "checkpoint": self.checkpoint,
            "step": self.step,
            "optimizer": self.optimizer,
            "method": self.method,
            "dtype": self.dtype,
            "top": _maybe(self.top),
            "bottom": _maybe(self.bottom),
            "trace": {k: v.to_dict() for k, v in self.traces().items()} or None,
            "density": _maybe(self.density),
            "blocks": None if self.blocks is None else {k: v.to_dict() for k, v in self.blocks.items()},
            "preconditioned": _maybe(self.preconditioned),
        }


def checkpoint_spectrum(
    path: str | Path,
    request: SpectrumRequest | None = None,
    settings: AnalysisSettings | None = None,
    *,
    data: str | Path | None = None,
    device: str = "cpu",
) -> CheckpointSpectrum:
    r"""The Hessian spectrum at a checkpoint, the parts ``request`` asks for (default
    :class:`SpectrumRequest`: the 5 largest eigenvalues), on the batches ``settings`` choose, by its
    dtype and HVP method: top/bottom eigenvalues, trace (Hutchinson and Hutch++), spectral density,
    per-block λ_max, and Adam's preconditioned sharpness :math:`\lambda_{\max}(P^{-1/2} H P^{-1/2})`
    beside its edge of stability :math:`(2 + 2\beta_1)/((1 - \beta_1)\eta)`. Every Lanczos basis
    (and SLQ's) within ``request.memory`` bytes. Under torch.distributed the ranks share the batches
    (:func:`curvlab.engine.hvp.shared_batches`) and every rank returns the same result."""
    request = request or SpectrumRequest()
    request.validate()
    settings = settings or AnalysisSettings()
    settings.validate()
    method, memory = settings.method, request.memory
    target = open_checkpoint(path, data, device, settings.batches)
    model, loss_fn = target.model, make_loss_fn(target.model)
    params = {n: p.detach() for n, p in model.named_parameters()}
    D = evaluation_batches(target, settings)
    H = hessian_operator(loss_fn, params, D, dtype=DTYPES[settings.dtype], method=method)

    def extremes(op, k, which="largest"):
        return lanczos(op, k=k, which=which, max_iter=request.max_iter, memory=memory)

    per_block = None
    if request.blocks:
        per_block = {
            name: extremes(hessian_operator(loss_fn, params, D, method=method, dtype=H.dtype, scope=names), 1)
            for name, names in group_parameters(params, blocks=request.blocks, model=model).items()
        }
    sharpness = None
    if request.preconditioned:
        # (the largest lr: each group's P is scaled to it)
        lr, beta1 = adam_step_settings(target.optimizer, mixed_lrs=True)
        diagonal = adam_preconditioner(target.optimizer, model, list(params), scale_by_lr=True)  # (bias-corrected)
        P = preconditioned_operator(H, torch.cat([d.reshape(-1) for d in diagonal.values()]))
        sharpness = PreconditionedSharpness(extremes(P, 1), lr, beta1, bias_correction=True)
    return CheckpointSpectrum(
        checkpoint=str(path),
        step=target.step,
        optimizer=target.optimizer_name,
        method=method,
        dtype=settings.dtype,
        top=extremes(H, request.top) if request.top else None,
        bottom=extremes(H, request.bottom, "smallest") if request.bottom else None,
        hutchinson=hutchinson(H) if request.trace else None,
        hutch_plus_plus=hutch_plus_plus(H) if request.trace else None,
        density=spectral_density(H, memory=memory) if request.density else None,
        blocks=per_block,
        preconditioned=sharpness,
    )
