"""From a checkpoint to a curvature report: the next update Z, its Taylor split and block matrix.

For one checkpoint: rebuild model, optimizer and data position; take the batch the run would train
on next; compute the gradient and the next update Z with :func:`~curvlab.optim.next_update` (the
real step: schedule, momentum, clipping and weight decay included); then, on the evaluation batch D
(the same next batch by default, or fixed validation windows), the Taylor split over all parameters
and over the hidden matrices, and the block interaction matrix. Nothing is written to the checkpoint.

Report JSON (``REPORT_SCHEMA_VERSION`` = 2)::

    schema_version, checkpoint, step, val_loss, optimizer, settings{blocks, batch, batches, dtype,
    block_method}, loss, nds, first_order, curvature_penalty, predicted, realized, update_norm,
    grad_norm, cosine, hidden{the same eight, over the hidden 2-D matrices, or null},
    blocks{grouping, names, matrix, within, cross, nds (the total, = sum(matrix)), rho_within, first_order[],
    norm[], block_nds[] (each block's own NDS), asymmetry, members}, timing{seconds, hvp_seconds}

Identities that always hold: sum(blocks.matrix) = blocks.nds = nds, within + cross = nds,
predicted = first_order - curvature_penalty.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from curvlab.atomic import atomic_write_text
from curvlab.checkpoint import check_checkpoint
from curvlab.curvature import BlockMatrix, TaylorSplit, block_matrix, taylor_split, taylor_split_and_block_matrix
from curvlab.distributed import is_main
from curvlab.errors import CurvlabError
from curvlab.loss import ModuleLoss, make_loss_fn
from curvlab.models.nanogpt import is_nanogpt_checkpoint, load_nanogpt
from curvlab.operator import DEFAULT_METHOD
from curvlab.optim import next_update
from curvlab.spectral import CheckpointSpectrum, UpdateSpectrum

REPORT_SCHEMA_VERSION = 2  # 2: blocks.nds is the total NDS, blocks.block_nds each block's own
BATCHES = ("train", "val")
DTYPES = {"float32": torch.float32, "float64": torch.float64}
SCALAR_KEYS = ("nds", "first_order", "curvature_penalty", "predicted", "realized", "update_norm", "grad_norm", "cosine")


@dataclass(frozen=True)
class AnalysisSettings:
    """How a checkpoint is analysed; two reports with equal settings are interchangeable."""

    blocks: str = "layer"
    batch: str = "train"
    batches: int = 1  # train: the step's batch and the N - 1 after it; val: the first N validation batches
    dtype: str = "float32"
    block_method: str = "hvp"
    spectrum_top: int = 0  # > 0: also λ_max, the top-k eigenvalues, Z's overlap with them and the trace

    def validate(self) -> None:
        if self.batch not in BATCHES:
            raise CurvlabError(f"unknown --batch {self.batch!r}; choose train (the next step's batch) or val")
        if self.dtype not in DTYPES:
            raise CurvlabError(f"unknown dtype {self.dtype!r}; choose float32 or float64")
        if self.batches < 1:
            raise CurvlabError(f"batches must be >= 1, got {self.batches}")
        if self.spectrum_top < 0:
            raise CurvlabError(f"spectrum_top must be >= 0, got {self.spectrum_top}")

    def key(self) -> str:
        """A short stable hash, for caching reports."""
        text = json.dumps({**asdict(self), "schema": REPORT_SCHEMA_VERSION}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:10]


@dataclass
class Target:
    """What the analysis needs from a checkpoint, whoever wrote it."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    train_batches: list  # the batch of the next step first, then the ones after it
    val_batches: list
    grad_clip: float | None
    step: int
    val_loss: float
    optimizer_name: str


def open_checkpoint(
    path: str | Path, data: str | Path | None = None, device: str = "cpu", train_batches: int = 1
) -> Target:
    """Rebuild the model, optimizer and next batches of a curvlab or nanoGPT checkpoint.

    Args:
        train_batches: how many training batches to draw, from the one the next step trains on.
        data: the data directory; default the one recorded in a curvlab checkpoint (required for
            nanoGPT checkpoints, which don't record where their data lie).
    """
    from curvlab.data.shards import TokenData, TrainBatches, validation_batches
    from curvlab.train import TrainConfig, build_run, restore

    path = Path(path)
    if not path.is_file():
        raise CurvlabError(f"{path}: no such checkpoint")
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # corrupt zip, truncated pickle, ...: all mean "unreadable"
        raise CurvlabError(f"{path}: corrupt or unreadable checkpoint ({type(e).__name__})") from e
    if is_nanogpt_checkpoint(raw):
        if data is None:
            raise CurvlabError(f"{path}: a nanoGPT checkpoint doesn't record its data; pass --data DIR")
        model, optimizer = load_nanogpt(raw)
        if optimizer is None:
            raise CurvlabError(f"{path}: the checkpoint holds no optimizer state, so the next update can't be known")
        conf = raw.get("config", {})
        seq = model.config.block_size
        tokens = TokenData.open(data, model.config.vocab_size)
        # nanoGPT doesn't save its data sampler: the next batch is drawn from the data with a fixed seed.
        loader = TrainBatches(tokens.train, int(conf.get("batch_size", 12)), seq, seed=int(raw.get("iter_num", 0)))
        val = validation_batches(tokens.val, int(conf.get("batch_size", 12)), seq, 64)
        return Target(
            model.to(device),
            optimizer,
            [loader.next() for _ in range(train_batches)],
            val,
            conf.get("grad_clip", 1.0) or None,
            int(raw.get("iter_num", 0)),
            float(raw.get("best_val_loss", float("nan"))),
            "adamw",
        )
    ckpt = check_checkpoint(raw, path)
    if not ckpt.get("optimizer"):  # (an empty "state" is fine: a step-0 optimizer has none yet)
        raise CurvlabError(f"{path}: the checkpoint holds no optimizer state, so the next update can't be known")
    fields = dict(ckpt["config"])
    if data is not None:
        fields["data"] = str(data)
    fields["device"] = device
    cfg = TrainConfig.from_dict(fields)
    if not Path(cfg.data).is_dir():
        raise CurvlabError(f"{path}: its data directory {cfg.data} is gone; pass --data DIR")
    run = build_run(cfg)
    restore(run, ckpt)
    return Target(
        run.model,
        run.optimizer,
        [tuple(t.to(run.device) for t in run.loader.next()) for _ in range(train_batches)],
        [tuple(t.to(run.device) for t in b) for b in run.val_batches],
        cfg.grad_clip,
        run.step,
        float(ckpt.get("val_loss", float("nan"))),
        cfg.optimizer,
    )


@dataclass(frozen=True)
class CurvatureReport:
    """The curvature of one checkpoint's next step (see the module docstring for the JSON)."""

    checkpoint: str
    step: int
    val_loss: float
    optimizer: str
    settings: AnalysisSettings
    split: TaylorSplit
    blocks: BlockMatrix
    seconds: float
    hvp_seconds: float
    spectrum: UpdateSpectrum | None = None

    def to_dict(self) -> dict[str, Any]:
        split = self.split.to_dict()
        hidden = split.pop("subset")
        names = split.pop("subset_names")
        return {
            "schema_version": REPORT_SCHEMA_VERSION,
            "checkpoint": self.checkpoint,
            "step": self.step,
            "val_loss": self.val_loss,
            "optimizer": self.optimizer,
            "settings": asdict(self.settings),
            **split,
            "hidden": None if hidden is None else {**hidden, "names": names},
            "blocks": {"grouping": self.settings.blocks, **self.blocks.to_dict()},
            "spectrum": None if self.spectrum is None else self.spectrum.to_dict(),
            "timing": {"seconds": self.seconds, "hvp_seconds": self.hvp_seconds},
        }

    def save(self, path: str | Path) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1, allow_nan=True))


def evaluation_batches(target: Target, settings: AnalysisSettings):
    """The batch D that G, H and the realized decrease are taken on: the next step's own batch (one),
    the next ``batches`` training batches, or the first ``batches`` validation batches (a list)."""
    if settings.batch == "train" and settings.batches == 1:
        return target.train_batches[0]
    pool = target.train_batches if settings.batch == "train" else target.val_batches
    return list(pool[: settings.batches])


def analyze(target: Target, settings: AnalysisSettings, checkpoint: str = "") -> CurvatureReport:
    """The curvature report of ``target``'s next step."""
    settings.validate()
    start = time.perf_counter()
    model = target.model
    loss_fn: ModuleLoss = make_loss_fn(model)
    step_batch = target.train_batches[0]
    _, Z = next_update(model, target.optimizer, loss_fn, step_batch, max_grad_norm=target.grad_clip)
    D = evaluation_batches(target, settings)
    params = {n: p.detach() for n, p in model.named_parameters()}
    dtype = DTYPES[settings.dtype]
    hvp_start = time.perf_counter()
    if settings.block_method == "hvp":  # one vectorized call serves both
        split, blocks = taylor_split_and_block_matrix(loss_fn, params, D, Z, settings.blocks, dtype=dtype)
    else:
        split = taylor_split(loss_fn, params, D, Z, dtype=dtype)
        blocks = block_matrix(loss_fn, params, D, Z, blocks=settings.blocks, method=settings.block_method, dtype=dtype)
    spectrum = None
    if settings.spectrum_top:
        spectrum = update_spectrum(loss_fn, params, D, Z, split.nds, settings.spectrum_top, dtype)
    hvp_seconds = time.perf_counter() - hvp_start
    return CurvatureReport(
        checkpoint=checkpoint,
        step=target.step,
        val_loss=target.val_loss,
        optimizer=target.optimizer_name,
        settings=settings,
        split=split,
        blocks=blocks,
        seconds=time.perf_counter() - start,
        hvp_seconds=hvp_seconds,
        spectrum=spectrum,
    )


def update_spectrum(
    loss_fn,
    params,
    batch,
    Z,
    nds: float,
    k: int,
    dtype: torch.dtype,
    trace_samples: int = 32,
    method: str = DEFAULT_METHOD,
    memory: int | None = None,
) -> UpdateSpectrum:
    r"""λ_max and the top-k eigenpairs of H (Lanczos, its basis within ``memory`` bytes), the share of
    :math:`\|Z\|^2` in their span, and the trace (Hutchinson): is NDS low because the landscape is flat, or
    because Z steers around the sharp directions? Checks NDS <= λ_max (a Rayleigh quotient can't exceed it)."""
    from curvlab import params as P
    from curvlab.operator import hessian_operator
    from curvlab.spectral import hutchinson, lanczos, overlap_with

    op = hessian_operator(loss_fn, params, batch, dtype=dtype, method=method)
    top = lanczos(op, k=k, max_iter=max(60, 4 * k), tol=1e-4, memory=memory)
    lam = float(top.eigenvalues[0])
    slack = 1e-4 * abs(lam) + float(top.residuals.max())
    if top.converged and nds > lam + slack:
        raise RuntimeError(f"NDS {nds:.6g} exceeds λ_max {lam:.6g}: the HVPs or the update are inconsistent")
    trace = hutchinson(op, samples=trace_samples)
    overlap = overlap_with(top.eigenvectors, P.flatten({n: Z[n] for n in params}))
    return UpdateSpectrum(top, trace, overlap, nds, op.dim)


def analyze_checkpoint(
    path: str | Path, settings: AnalysisSettings | None = None, data: str | Path | None = None, device: str = "cpu"
) -> CurvatureReport:
    """Open a checkpoint and analyse its next step (see :func:`analyze`)."""
    settings = settings or AnalysisSettings()
    settings.validate()
    return analyze(open_checkpoint(path, data, device, settings.batches), settings, str(path))


def load_report(path: str | Path) -> dict[str, Any]:
    """A saved report's JSON, checked for its schema version."""
    path = Path(path)
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CurvlabError(f"{path}: unreadable report ({e})") from e
    if report.get("schema_version") != REPORT_SCHEMA_VERSION:
        raise CurvlabError(f"{path}: report schema {report.get('schema_version')} is not {REPORT_SCHEMA_VERSION}")
    return report


def report_cache_path(cache_dir: str | Path, checkpoint: str | Path, settings: AnalysisSettings) -> Path:
    """Where the report of ``checkpoint`` under ``settings`` is cached: the name hashes the settings
    and the checkpoint file's identity (path, size, modification time)."""
    checkpoint = Path(checkpoint).resolve()
    stat = checkpoint.stat() if checkpoint.is_file() else None
    ident = f"{checkpoint}:{stat.st_size if stat else 0}:{stat.st_mtime_ns if stat else 0}"
    digest = hashlib.sha256(ident.encode()).hexdigest()[:8]
    return Path(cache_dir) / f"{checkpoint.parent.name}-{checkpoint.stem}-{settings.key()}-{digest}.json"


def cached_report(
    cache_dir: str | Path, checkpoint: str | Path, settings: AnalysisSettings, data=None, device="cpu"
) -> dict[str, Any]:
    """The report of ``checkpoint`` under ``settings``: read from ``cache_dir`` when it was made
    before, else computed and saved there (see :func:`report_cache_path`)."""
    path = report_cache_path(cache_dir, checkpoint, settings)
    if path.is_file():
        return load_report(path)
    report = analyze_checkpoint(Path(checkpoint).resolve(), settings, data, device)
    if is_main():  # under torch.distributed every rank computed it; one writes it
        report.save(path)
    return report.to_dict()


def checkpoint_spectrum(
    path: str | Path,
    top: int = 5,
    bottom: int = 0,
    trace: bool = False,
    density: bool = False,
    blocks: str | None = None,
    preconditioned: bool = False,
    settings: AnalysisSettings | None = None,
    data: str | Path | None = None,
    device: str = "cpu",
    max_iter: int = 100,
    method: str = DEFAULT_METHOD,
    memory: int | None = None,
) -> CheckpointSpectrum:
    r"""The Hessian spectrum at a checkpoint (on the batches ``settings`` choose): top/bottom
    eigenvalues, trace (Hutchinson and Hutch++), spectral density, per-block λ_max, and Adam's
    preconditioned sharpness :math:`\lambda_{\max}(P^{-1/2} H P^{-1/2})` beside its edge of stability
    :math:`(2 + 2\beta_1)/((1 - \beta_1)\eta)`. HVPs by ``method``; every Lanczos basis (and SLQ's)
    within ``memory`` bytes (``None``: unbounded)."""
    from curvlab.blocks import group_parameters
    from curvlab.operator import hessian_operator, preconditioned_operator
    from curvlab.spectral import (
        PreconditionedSharpness,
        adam_preconditioner,
        adam_step_settings,
        hutch_plus_plus,
        hutchinson,
        lanczos,
        spectral_density,
    )

    settings = settings or AnalysisSettings()
    settings.validate()
    target = open_checkpoint(path, data, device, settings.batches)
    model, loss_fn = target.model, make_loss_fn(target.model)
    params = {n: p.detach() for n, p in model.named_parameters()}
    D = evaluation_batches(target, settings)
    H = hessian_operator(loss_fn, params, D, dtype=DTYPES[settings.dtype], method=method)

    def extremes(op, k, which="largest"):
        return lanczos(op, k=k, which=which, max_iter=max_iter, memory=memory)

    per_block = None
    if blocks:
        per_block = {
            name: extremes(hessian_operator(loss_fn, params, D, dtype=H.dtype, subset=names, method=method), 1)
            for name, names in group_parameters(params, blocks).items()
        }
    sharpness = None
    if preconditioned:
        lr, beta1 = adam_step_settings(target.optimizer)
        P = preconditioned_operator(H, adam_preconditioner(target.optimizer, model, list(params)))
        sharpness = PreconditionedSharpness(extremes(P, 1), lr, beta1)
    return CheckpointSpectrum(
        checkpoint=str(path),
        step=target.step,
        optimizer=target.optimizer_name,
        method=method,
        dtype=settings.dtype,
        top=extremes(H, top) if top else None,
        bottom=extremes(H, bottom, "smallest") if bottom else None,
        hutchinson=hutchinson(H) if trace else None,
        hutch_plus_plus=hutch_plus_plus(H) if trace else None,
        density=spectral_density(H, memory=memory) if density else None,
        blocks=per_block,
        preconditioned=sharpness,
    )
