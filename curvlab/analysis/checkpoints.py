"""From a checkpoint to a curvature report: the next update Z, its Taylor split and block matrix.

For one checkpoint (curvlab's, nanoGPT's ``ckpt.pt``, or a Hugging Face Trainer directory): rebuild
model, optimizer and data position; take the batch the run would train on next; compute the gradient
and the next update Z with :func:`~curvlab.optim.optimizers.next_update` (the real step: schedule, momentum,
gradient accumulation, clipping and weight decay included); then, on the evaluation batch D (the same
next batch by default, or fixed validation windows), the Taylor split over all parameters and over
the hidden matrices, and the block interaction matrix. Nothing is written to the checkpoint.

Two choices, stated because they differ from a literal replay of the run:

* Dropout is off for Z, as it is for G and H (curvature is taken on the deterministic loss), so Z is
  the step from the dropout-free gradient and is the same on every run. With dropout 0 it is the
  run's own next step, bit for bit.
* nanoGPT and the Trainer don't save their data sampler, so their next batch is curvlab's own draw
  from ``--data``, seeded with the checkpoint's step; the report's ``next_batch`` records the seed
  and the (shard, offset) of every row. A curvlab checkpoint resumes its own loader.

Report JSON (``REPORT_SCHEMA_VERSION`` = 3)::

    schema_version, checkpoint, step, val_loss (null where the checkpoint has none), optimizer,
    settings{blocks, batch, batches, dtype, block_method, hvp_method, spectrum_top}, loss, nds,
    first_order, curvature_penalty, predicted, realized, update_norm, grad_norm, cosine,
    hidden{the same eight, over the hidden 2-D matrices, or null}, blocks{grouping, names, matrix,
    within, cross, nds (the total, = sum(matrix)), rho_within, first_order[], norm[], block_nds[] (each
    block's own NDS), asymmetry, members}, spectrum, next_batch{source, seed, micro_batches, rows},
    paired (or null), timing{seconds, hvp_seconds}

``paired``: at a checkpoint whose run keeps a shadow state of the other arm (:mod:`curvlab.optim.shadow`),
the AdamW and Muon directions at the same W, on the same batch D, under the same H
(:class:`curvlab.analysis.directions.PairedDirections`: the run's real step and the shadow's step, each with
NDS, cos(G, Z) and q = cos²/NDS over all parameters and the hidden matrices); null without a shadow.

Identities that always hold: sum(blocks.matrix) = blocks.nds = nds, within + cross = nds,
predicted = first_order - curvature_penalty.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from curvlab.analysis.directions import PAIRED, PairedDirections, directions_table, paired_directions, parse_directions
from curvlab.curvature.groupings import group_parameters
from curvlab.curvature.scalars import (
    NAN_SCOPE,
    CheckpointScalars,
    embed_head_share,
    layer_blocks_split,
    taylor_error,
    taylor_holds,
)
from curvlab.curvature.spectral import (
    CheckpointSpectrum,
    PreconditionedSharpness,
    SpectrumRequest,
    UpdateSpectrum,
    adam_preconditioner,
    adam_step_settings,
    hutch_plus_plus,
    hutchinson,
    lanczos,
    overlap_with,
    spectral_density,
)
from curvlab.curvature.taylor import (
    BlockMatrix,
    TaylorScope,
    TaylorSplit,
    block_matrix,
    taylor_split,
    taylor_split_and_block_matrix,
)
from curvlab.data.shards import TokenData, TrainBatches, validation_batches
from curvlab.engine import params as P
from curvlab.engine.hvp import DEFAULT_METHOD, check_method
from curvlab.engine.loss import ModuleLoss, make_loss_fn
from curvlab.engine.operator import hessian_operator, preconditioned_operator
from curvlab.errors import CurvlabError
from curvlab.models.nanogpt import load_nanogpt
from curvlab.optim.optimizers import next_update
from curvlab.optim.shadow import ShadowState
from curvlab.runs.checkpoint import check_device, read_checkpoint
from curvlab.runs.dcp import META as SHARDED_META
from curvlab.runs.hf import token_batch, trainer_optimizer
from curvlab.runs.train import TrainConfig, build_run, restore
from curvlab.util.atomic import atomic_write_text
from curvlab.util.distributed import from_main, is_distributed, is_main

REPORT_SCHEMA_VERSION = 3  # 2: blocks.nds is the total NDS, blocks.block_nds each block's own; 3: paired
DIRECTIONS_SCHEMA_VERSION = 1
BATCHES = ("train", "val")
DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass(frozen=True)
class AnalysisSettings:
    """How a checkpoint is analysed; two reports with equal settings are interchangeable."""

    blocks: str = "layer"
    batch: str = "train"
    batches: int = 1  # train: the step's batch and the N - 1 after it; val: the first N validation batches
    dtype: str = "float32"
    block_method: str = "hvp"
    hvp_method: str = "rev_rev"  # rev_rev (double backward) or fwd_rev (jvp of grad): equal to rounding
    spectrum_top: int = 0  # > 0: also λ_max, the top-k eigenvalues, Z's overlap with them and the trace
    paired: bool = True  # with a shadow state in the checkpoint: the AdamW and Muon directions at the same point

    def validate(self) -> None:
        if self.batch not in BATCHES:
            raise CurvlabError(f"unknown --batch {self.batch!r}; choose train (the next step's batch) or val")
        if self.dtype not in DTYPES:
            raise CurvlabError(f"unknown dtype {self.dtype!r}; choose float32 or float64")
        if self.batches < 1:
            raise CurvlabError(f"batches must be >= 1, got {self.batches}")
        if self.spectrum_top < 0:
            raise CurvlabError(f"spectrum_top must be >= 0, got {self.spectrum_top}")
        check_method(self.hvp_method)

    def key(self) -> str:
        """A short stable hash, for caching reports."""
        text = json.dumps({**asdict(self), "schema": REPORT_SCHEMA_VERSION}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:10]


@dataclass(frozen=True)
class BatchDraw:
    """Where the next step's batch came from.

    Attributes:
        source: ``"checkpoint"`` (a curvlab checkpoint's own data loader, resumed: the batch the run
            really trained on next) or ``"seeded draw"`` (nanoGPT and Hugging Face Trainer checkpoints
            don't save their sampler, so curvlab draws the batch itself, with ``seed``).
        seed: the seed of the draw (the checkpoint's step), or ``None``.
        micro_batches: micro-batches accumulated into the step (``gradient_accumulation_steps``).
        rows: ``[shard, offset]`` of every row of the step's micro-batches, in order (train shards
            that hold a window, in file order), for a seeded draw.
    """

    source: str
    seed: int | None = None
    micro_batches: int = 1
    rows: tuple[tuple[int, int], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "rows": [list(r) for r in self.rows]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BatchDraw:
        return cls(d["source"], d["seed"], d["micro_batches"], tuple(tuple(r) for r in d["rows"]))


@dataclass
class Target:
    """What the analysis needs from a checkpoint, whoever wrote it."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    train_batches: list  # one entry per step from the next one on: a batch, or a list of micro-batches
    val_batches: list
    grad_clip: float | None
    step: int
    val_loss: float
    optimizer_name: str
    draw: BatchDraw = BatchDraw("checkpoint")
    shadow: ShadowState | None = None  # the run's shadow of the other arm, if it keeps one


def open_checkpoint(path: str | Path, data: str | Path | None = None, device: str = "cpu", batches: int = 1) -> Target:
    """Rebuild the model, optimizer and next batches of a curvlab, nanoGPT or Hugging Face Trainer
    checkpoint (read by :func:`~curvlab.runs.checkpoint.read_checkpoint`, with its errors).

    Args:
        data: the data directory; default the one recorded in a curvlab checkpoint (required for
            nanoGPT and Trainer checkpoints, which don't record where their data lie).
        batches: how many steps' training batches to draw, from the next step's on, and how many
            validation batches to provide at least (where the data hold them).
    """
    dev = check_device(device)
    ckpt = read_checkpoint(path)
    if ckpt.format == "curvlab":
        return _curvlab_target(ckpt.path, ckpt.payload, data, device, batches)
    if data is None:
        raise CurvlabError(f"{ckpt.path}: a {ckpt.format} checkpoint doesn't record its data; pass --data DIR")
    if ckpt.format == "nanogpt":
        model, optimizer = load_nanogpt(ckpt.payload)
        if optimizer is None:
            raise CurvlabError(f"{path}: the checkpoint holds no optimizer state, so the next update can't be known")
        model.to(dev)
        optimizer.load_state_dict(optimizer.state_dict())  # (moves the moments to the parameters' device)
        conf = ckpt.payload.get("config", {})
        step = int(ckpt.payload.get("iter_num", 0))
        micro = int(conf.get("gradient_accumulation_steps", 1))
        train, val, draw = _seeded_draw(
            data,
            model.config.vocab_size,
            int(conf.get("batch_size", 12)),
            model.config.block_size,
            step,
            micro,
            batches,
            dev,
        )
        val_loss = float(ckpt.payload.get("best_val_loss", float("nan")))
        return Target(model, optimizer, train, val, conf.get("grad_clip", 1.0) or None, step, val_loss, "adamw", draw)

    hf = ckpt.payload
    hf.model.to(dev)
    optimizer = trainer_optimizer(hf)  # (its state lands on the parameters' device)
    train, val, draw = _seeded_draw(
        data, hf.model.config.vocab_size, hf.batch_size, hf.context - 1, hf.step, hf.accumulation_steps, batches, dev
    )
    train = [[token_batch(*b) for b in s] if isinstance(s, list) else token_batch(*s) for s in train]
    val = [token_batch(*b) for b in val]
    return Target(hf.model, optimizer, train, val, hf.max_grad_norm, hf.step, float("nan"), "adamw", draw)


def analysis_config(path: Path, saved: dict, data, device: str, batches: int) -> TrainConfig:
    """A curvlab run's config as saved, on ``device`` and (when given) other ``data``, with enough
    validation windows for ``batches`` batches where the data hold them (the run's own come first)."""
    fields = dict(saved)
    if data is not None:
        fields["data"] = str(data)
    fields["device"] = device
    cfg = TrainConfig.from_dict(fields)
    cfg = replace(cfg, val_windows=max(cfg.val_windows, batches * cfg.batch_size))
    if not Path(cfg.data).is_dir():
        raise CurvlabError(f"{path}: its data directory {cfg.data} is gone; pass --data DIR")
    return cfg


def run_target(run, batches: int, val_loss: float) -> Target:
    """A restored curvlab run (:class:`curvlab.runs.train.Run`) as an analysis target: its next ``batches``
    training batches and its validation batches, on the run's device."""
    return Target(
        run.model,
        run.optimizer,
        [tuple(t.to(run.device) for t in run.loader.next()) for _ in range(batches)],
        [tuple(t.to(run.device) for t in b) for b in run.val_batches],
        run.cfg.grad_clip,
        run.step,
        val_loss,
        run.cfg.optimizer,
        shadow=run.shadow,
    )


def _curvlab_target(path: Path, ckpt: dict, data, device: str, batches: int) -> Target:
    if not ckpt.get("optimizer"):  # (an empty "state" is fine: a step-0 optimizer has none yet)
        raise CurvlabError(f"{path}: the checkpoint holds no optimizer state, so the next update can't be known")
    run = build_run(analysis_config(path, ckpt["config"], data, device, batches))
    restore(run, ckpt)
    return run_target(run, batches, float(ckpt.get("val_loss", float("nan"))))


def _seeded_draw(data, vocab_size: int, batch_size: int, seq_len: int, step: int, micro: int, steps: int, device):
    """Training batches for ``steps`` steps of ``micro`` micro-batches, drawn from the data with the
    checkpoint's step as seed (the sampler of nanoGPT and the Trainer isn't saved), and validation
    batches: at least 64 windows, and enough for ``steps`` batches where the data hold them."""
    if micro < 1:
        raise CurvlabError(f"gradient_accumulation_steps must be >= 1, got {micro}")
    tokens = TokenData.open(data, vocab_size)
    loader = TrainBatches(tokens.train, batch_size, seq_len, seed=step)
    train, rows = [], []
    for k in range(steps):
        step_batches = []
        for _ in range(micro):
            step_batches.append(tuple(t.to(device) for t in loader.next()))
            if k == 0:
                rows += loader.last_rows
        train.append(step_batches if micro > 1 else step_batches[0])
    val = validation_batches(tokens.val, batch_size, seq_len, max(64, steps * batch_size))
    val = [tuple(t.to(device) for t in b) for b in val]
    return train, val, BatchDraw("seeded draw", step, micro, tuple(rows))


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
    next_batch: BatchDraw | None = None
    paired: PairedDirections | None = None

    def to_dict(self) -> dict[str, Any]:
        split = self.split.to_dict()
        hidden = split.pop("subset")
        names = split.pop("subset_names")
        return {
            "schema_version": REPORT_SCHEMA_VERSION,
            "checkpoint": self.checkpoint,
            "step": self.step,
            # nanoGPT and Trainer checkpoints record no validation loss: null, not NaN (strict JSON)
            "val_loss": self.val_loss if math.isfinite(self.val_loss) else None,
            "optimizer": self.optimizer,
            "settings": asdict(self.settings),
            **split,
            "hidden": None if hidden is None else {**hidden, "names": names},
            "blocks": {"grouping": self.settings.blocks, **self.blocks.to_dict()},
            "spectrum": None if self.spectrum is None else self.spectrum.to_dict(),
            "next_batch": None if self.next_batch is None else self.next_batch.to_dict(),
            "paired": None if self.paired is None else self.paired.to_dict(),
            "timing": {"seconds": self.seconds, "hvp_seconds": self.hvp_seconds},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CurvatureReport:
        """The report of :meth:`to_dict`'s JSON (see :meth:`UpdateSpectrum.from_dict
        <curvlab.curvature.spectral.UpdateSpectrum.from_dict>` for what a saved spectrum keeps).

        Raises:
            CurvlabError: another schema version.
        """
        if d.get("schema_version") != REPORT_SCHEMA_VERSION:
            raise CurvlabError(f"report schema {d.get('schema_version')} is not {REPORT_SCHEMA_VERSION}")
        hidden = d["hidden"]
        split = TaylorSplit.from_dict(
            {**d, "subset": hidden, "subset_names": () if hidden is None else hidden["names"]}
        )
        blocks = {k: v for k, v in d["blocks"].items() if k != "grouping"}
        return cls(
            checkpoint=d["checkpoint"],
            step=d["step"],
            val_loss=math.nan if d["val_loss"] is None else d["val_loss"],
            optimizer=d["optimizer"],
            settings=AnalysisSettings(**d["settings"]),
            split=split,
            blocks=BlockMatrix.from_dict(blocks),
            seconds=d["timing"]["seconds"],
            hvp_seconds=d["timing"]["hvp_seconds"],
            spectrum=None if d["spectrum"] is None else UpdateSpectrum.from_dict(d["spectrum"], split.nds),
            next_batch=None if d["next_batch"] is None else BatchDraw.from_dict(d["next_batch"]),
            paired=None if d.get("paired") is None else PairedDirections.from_dict(d["paired"]),
        )

    def scalars(self) -> CheckpointScalars:
        """The scalars that tables, figures and aggregates use (both scopes; the paired directions'
        where the run keeps a shadow state, :mod:`curvlab.analysis.directions`): both arms' directions at this
        checkpoint's W, on its batch, under its H."""
        split = self.split
        within_layers, nds_layers = layer_blocks_split(self.blocks.names, self.blocks.matrix)
        return CheckpointScalars(
            step=self.step,
            val_loss=self.val_loss,
            all=TaylorScope.from_dict(split.to_dict()),
            hidden=NAN_SCOPE if split.subset is None else split.subset,
            within=self.blocks.within,
            cross=self.blocks.cross,
            rho_within=self.blocks.rho_within,
            within_layers=within_layers,
            nds_layers=nds_layers,
            embed_head_share=embed_head_share(self.blocks, self.settings.blocks, split.update_norm),
            taylor_error=taylor_error(split),
            taylor_ok=taylor_holds(split),
            paired={} if self.paired is None else self.paired.scalars(),
        )

    def save(self, path: str | Path) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1, allow_nan=True))


def evaluation_batches(target: Target, settings: AnalysisSettings):
    """The batch D that G, H and the realized decrease are taken on: the next step's own batch (its
    micro-batches, if it accumulates), the batches of the next ``batches`` steps, or the first
    ``batches`` validation batches.

    Raises:
        CurvlabError: fewer batches than ``settings.batches`` exist (never silently fewer).
    """
    pool = target.train_batches if settings.batch == "train" else target.val_batches
    if len(pool) < settings.batches:
        raise CurvlabError(
            f"--batches {settings.batches} asks for {settings.batches} {settings.batch} batches, "
            f"but there are {len(pool)}"
        )
    chosen = [b for entry in pool[: settings.batches] for b in (entry if isinstance(entry, list) else [entry])]
    return chosen[0] if len(chosen) == 1 else chosen


def analyze(target: Target, settings: AnalysisSettings, checkpoint: str = "") -> CurvatureReport:
    """The curvature report of ``target``'s next step."""
    settings.validate()
    start = time.perf_counter()
    model = target.model
    # Dropout off, for Z as for G and H (which the curvature functions take without it): the step is
    # the one the optimizer takes from the deterministic gradient, the same on every run.
    model.eval()
    loss_fn: ModuleLoss = make_loss_fn(model)
    step_batch = target.train_batches[0]  # (a list of micro-batches when the run accumulates gradients)
    G, Z = next_update(model, target.optimizer, loss_fn, step_batch, max_grad_norm=target.grad_clip)
    D = evaluation_batches(target, settings)
    params = {n: p.detach() for n, p in model.named_parameters()}
    dtype = DTYPES[settings.dtype]
    hvp_start = time.perf_counter()
    method = settings.hvp_method
    if settings.block_method == "hvp":  # one point and one set of HVPs serve both
        split, blocks = taylor_split_and_block_matrix(
            loss_fn, params, D, Z, settings.blocks, dtype=dtype, method=method
        )
    else:
        split = taylor_split(loss_fn, params, D, Z, dtype=dtype, method=method)
        blocks = block_matrix(
            loss_fn, params, D, Z, blocks=settings.blocks, via=settings.block_method, dtype=dtype, method=method
        )
    spectrum = None
    if settings.spectrum_top:
        spectrum = update_spectrum(loss_fn, params, D, Z, split.nds, settings.spectrum_top, dtype)
    paired = None
    if settings.paired and target.shadow is not None:
        paired = paired_directions(
            model, target.optimizer, loss_fn, params, D, G, Z, PAIRED, target.shadow, dtype, method
        )
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
        next_batch=target.draw,
        paired=paired,
    )


@dataclass(frozen=True)
class DirectionReport:
    """Counterfactual directions at one checkpoint (``curvlab nds CKPT --directions ...``): each
    direction's NDS, cos(G, Z) and q over all parameters and the hidden matrices, at the same W, on the
    same batch D, under the same H (:mod:`curvlab.analysis.directions`).

    JSON (``DIRECTIONS_SCHEMA_VERSION`` = 1)::

        schema_version, checkpoint, step, val_loss (or null), optimizer, settings{...}, paired{base, real, multiplier,
        hidden_names, shadow (its settings, or null), directions[{name, source, scaling, all{nds,
        first_order, curvature_penalty, update_norm, grad_norm, cosine, q}, hidden{...}}]}, seconds
    """

    checkpoint: str
    step: int
    val_loss: float
    optimizer: str
    settings: AnalysisSettings
    paired: PairedDirections
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": DIRECTIONS_SCHEMA_VERSION,
            "checkpoint": self.checkpoint,
            "step": self.step,
            "val_loss": self.val_loss if math.isfinite(self.val_loss) else None,  # (strict JSON: no NaN)
            "optimizer": self.optimizer,
            "settings": asdict(self.settings),
            "paired": self.paired.to_dict(),
            "seconds": self.seconds,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DirectionReport:
        if d.get("schema_version") != DIRECTIONS_SCHEMA_VERSION:
            raise CurvlabError(f"directions schema {d.get('schema_version')} is not {DIRECTIONS_SCHEMA_VERSION}")
        return cls(
            d["checkpoint"],
            d["step"],
            math.nan if d["val_loss"] is None else d["val_loss"],
            d["optimizer"],
            AnalysisSettings(**d["settings"]),
            PairedDirections.from_dict(d["paired"]),
            d["seconds"],
        )

    def text(self) -> str:
        """The report as printed: a header line and :func:`~curvlab.analysis.directions.directions_table`."""
        val = f"{self.val_loss:.4f}" if math.isfinite(self.val_loss) else "none recorded"
        head = f"{self.checkpoint}: step {self.step}, optimizer {self.optimizer}, val loss {val}"
        return head + "\n" + directions_table(self.paired)

    def save(self, path: str | Path) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1, allow_nan=True))


def analyze_directions(target: Target, names, settings: AnalysisSettings, checkpoint: str = "") -> DirectionReport:
    """The directions ``names`` (``"adamw,muon,sgd,sign"`` or a list; :data:`curvlab.analysis.directions.DIRECTIONS`)
    at ``target``'s W, with G and H on the evaluation batch D of ``settings``, and the real step and the
    optimizer state from the next step's batch, as :func:`analyze` takes them (dropout off).

    Raises:
        CurvlabError: an unknown direction, a state the directions can't be formed from (see
            :func:`curvlab.analysis.directions.counterfactual_directions`), bad settings.
    """
    settings.validate()
    names = parse_directions(names)
    start = time.perf_counter()
    model = target.model
    model.eval()  # dropout off, as in analyze
    loss_fn = make_loss_fn(model)
    G, Z = next_update(model, target.optimizer, loss_fn, target.train_batches[0], max_grad_norm=target.grad_clip)
    D = evaluation_batches(target, settings)
    params = {n: p.detach() for n, p in model.named_parameters()}
    paired = paired_directions(
        model, target.optimizer, loss_fn, params, D, G, Z, names, target.shadow, DTYPES[settings.dtype],
        settings.hvp_method,
    )  # fmt: skip
    return DirectionReport(
        checkpoint,
        target.step,
        target.val_loss,
        target.optimizer_name,
        settings,
        paired,
        time.perf_counter() - start,
    )


def checkpoint_directions(
    path: str | Path,
    names,
    settings: AnalysisSettings | None = None,
    data: str | Path | None = None,
    device: str = "cpu",
) -> DirectionReport:
    """Open a checkpoint (any format :func:`open_checkpoint` reads) and compare the directions ``names``
    at it (see :func:`analyze_directions`)."""
    settings = settings or AnalysisSettings()
    settings.validate()
    names = parse_directions(names)  # (bad names fail before the checkpoint is opened)
    return analyze_directions(open_checkpoint(path, data, device, settings.batches), names, settings, str(path))


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


def load_report(path: str | Path) -> CurvatureReport:
    """A saved report, checked for its schema version; an unreadable or malformed file is a one-line
    ``CurvlabError``."""
    path = Path(path)
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CurvlabError(f"{path}: unreadable report ({e})") from e
    try:
        return CurvatureReport.from_dict(d)
    except CurvlabError as e:
        raise CurvlabError(f"{path}: {e}") from e
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise CurvlabError(f"{path}: malformed report ({type(e).__name__}: {e})") from e


def report_cache_path(cache_dir: str | Path, checkpoint: str | Path, settings: AnalysisSettings) -> Path:
    """Where the report of ``checkpoint`` under ``settings`` is cached: the name hashes the settings
    and the checkpoint file's identity (path, size, modification time; of a sharded checkpoint
    directory, those of its ``curvlab.pt``, which its writer puts last).

    A sharded analysis of a checkpoint gives the same report as the unsharded one (to rounding), so
    the key doesn't say which of the two made it."""
    checkpoint = Path(checkpoint).resolve()
    stamped = checkpoint / SHARDED_META if (checkpoint / SHARDED_META).is_file() else checkpoint
    stat = stamped.stat() if stamped.is_file() else None
    ident = f"{checkpoint}:{stat.st_size if stat else 0}:{stat.st_mtime_ns if stat else 0}"
    digest = hashlib.sha256(ident.encode()).hexdigest()[:8]
    return Path(cache_dir) / f"{checkpoint.parent.name}-{checkpoint.stem}-{settings.key()}-{digest}.json"


def cached_report(
    cache_dir: str | Path,
    checkpoint: str | Path,
    settings: AnalysisSettings,
    data=None,
    device="cpu",
    analyze_fn: Callable[..., CurvatureReport] | None = None,
) -> CurvatureReport:
    """The report of ``checkpoint`` under ``settings``: read from ``cache_dir`` when it was made
    before, else computed by ``analyze_fn`` (default :func:`analyze_checkpoint`; the sharded
    analysis passes its own) and saved there (see :func:`report_cache_path`).

    Under torch.distributed rank 0 decides whether the report is cached and hands the cached one to
    the others: every rank then analyses, or none does (a rank that saw rank 0's fresh file while
    another didn't would leave it alone in the analysis's collectives)."""
    analyze_fn = analyze_fn or analyze_checkpoint
    path = report_cache_path(cache_dir, checkpoint, settings)
    if is_distributed():
        cached = from_main(load_report(path) if is_main() and path.is_file() else None)
        if cached is not None:
            return cached
    elif path.is_file():
        return load_report(path)
    report = analyze_fn(Path(checkpoint).resolve(), settings, data, device)
    if is_main():  # under torch.distributed every rank computed it; one writes it
        report.save(path)
    return report


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
