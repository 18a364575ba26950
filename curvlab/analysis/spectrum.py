"""The Hessian spectrum of one checkpoint (``curvlab spectrum``): extreme eigenvalues, traces, densities,
per-block and preconditioned sharpness, on the checkpoint's target and evaluation batches.
"""

from __future__ import annotations

from pathlib import Path

from curvlab.analysis.targets import DTYPES, AnalysisSettings, evaluation_batches, open_checkpoint
from curvlab.curvature.groupings import group_parameters
from curvlab.curvature.spectral import (
    CheckpointSpectrum,
    PreconditionedSharpness,
    SpectrumRequest,
    adam_preconditioner,
    adam_step_settings,
    hutch_plus_plus,
    hutchinson,
    lanczos,
    spectral_density,
)
from curvlab.engine.loss import make_loss_fn
from curvlab.engine.operator import hessian_operator, preconditioned_operator


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
    method, memory = settings.hvp_method, request.memory
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
            name: extremes(hessian_operator(loss_fn, params, D, dtype=H.dtype, subset=names, method=method), 1)
            for name, names in group_parameters(params, request.blocks, model).items()
        }
    sharpness = None
    if request.preconditioned:
        lr, beta1 = adam_step_settings(target.optimizer)
        P = preconditioned_operator(H, adam_preconditioner(target.optimizer, model, list(params)))
        sharpness = PreconditionedSharpness(extremes(P, 1), lr, beta1)
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
