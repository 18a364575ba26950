"""What a curvature analysis reads: its settings, one checkpoint of any format as a :class:`Target`
(curvlab's, nanoGPT's ``ckpt.pt``, a Hugging Face Trainer directory, a Lightning ``.ckpt``, a ``torch.save``'d
state dict: model, optimizer, loader, next batch), and
the evaluation batches D. The reports built from them are in :mod:`curvlab.analysis.report`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from curvlab.data.shards import TokenData, TrainBatches, validation_batches
from curvlab.engine.hvp import check_method
from curvlab.errors import CurvlabError
from curvlab.models.gpt import GPT
from curvlab.models.nanogpt import load_nanogpt
from curvlab.runs.checkpoint import check_device, read_checkpoint
from curvlab.runs.config import TrainConfig
from curvlab.runs.foreign import (
    FOREIGN_FORMATS,
    ForeignCheckpoint,
    Rebuild,
    build_model,
    load_weights,
    rebuild_optimizer,
)
from curvlab.runs.hf import context_length, token_batch, trainer_optimizer
from curvlab.runs.train import build_run, restore
from curvlab.steps.shadow import ShadowState
from curvlab.util.codec import Record

# 2: blocks.nds is the total NDS, blocks.block_nds each block's own; 3: paired; 4: settings.hvp_method is
# settings.method (a report of 3 is read as one of 4: method_renamed)
REPORT_SCHEMA_VERSION = 4
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
    method: str = "rev_rev"  # rev_rev (double backward) or fwd_rev (jvp of grad): equal to rounding
    spectrum_top: int = 0  # > 0: also λ_max, the top-k eigenvalues, Z's overlap with them and the trace
    paired: bool = True  # with a shadow state in the checkpoint: the AdamW and Muon directions at the same point
    # the controls (docs/science.md section 14): the twins' directions (where the checkpoint keeps them) and
    # momentum SGD's, with the paired ones; ``stability`` > 0 also takes, in at most that many Lanczos
    # iterations each, lambda_max(H), the arm's preconditioned sharpness and the injected sharp directions;
    # ``held_out``: both arms' directions and their exchangeable twins (their last gradient from the next
    # training batch after those the point reads) under the H of the first validation batch as well
    controls: bool = False
    stability: int = 0
    held_out: bool = False
    # the factorial of filters and maps (curvlab.analysis.factorial), under the own H and, with held_out, the
    # held-out H: the mechanism design's (ten cells, two second backwards each, per H)
    factorial: bool = False
    # both arms' NDS split into its Gauss–Newton part and the residual (curvlab.curvature.gauss_newton)
    gauss_newton: bool = False

    def validate(self) -> None:
        if self.batch not in BATCHES:
            raise CurvlabError(f"unknown --batch {self.batch!r}; choose train (the next step's batch) or val")
        if self.dtype not in DTYPES:
            raise CurvlabError(f"unknown dtype {self.dtype!r}; choose float32 or float64")
        if self.batches < 1:
            raise CurvlabError(f"batches must be >= 1, got {self.batches}")
        if self.spectrum_top < 0:
            raise CurvlabError(f"spectrum_top must be >= 0, got {self.spectrum_top}")
        if self.stability < 0:
            raise CurvlabError(f"stability (Lanczos iterations) must be >= 0, got {self.stability}")
        check_method(self.method)

    def train_batches(self) -> int:
        """How many steps' training batches a point reads: ``batches``, and one more for the exchangeable
        twins of the held-out control."""
        return self.batches + (1 if self.held_out else 0)

    def key(self) -> str:
        """A short stable hash, for caching reports."""
        settings = {k: v for k, v in asdict(self).items() if k not in ("factorial", "gauss_newton") or v}
        # (what a point measures grew with issue 50, the settings alike: a report cached before is not this one)
        text = json.dumps({**settings, "schema": REPORT_SCHEMA_VERSION, "measures": 2}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:10]


def method_renamed(d: dict[str, Any]) -> dict[str, Any]:
    """The JSON of a record that keeps :class:`AnalysisSettings` under ``settings`` (a report of schema 3,
    a comparison of schema 2, a directions report of schema 1), with the HVP method's old key,
    ``hvp_method``, renamed ``method`` in its place (the keys keep their order): a ``MIGRATIONS`` step
    (:func:`curvlab.util.schema.upgrade`)."""
    settings = d.get("settings")
    if not isinstance(settings, Mapping):
        return d  # (malformed: left for the reader to refuse)
    return {**d, "settings": {("method" if k == "hvp_method" else k): v for k, v in settings.items()}}


@dataclass(frozen=True)
class BatchDraw(Record):
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
    controls: Mapping[str, ShadowState] = field(default_factory=dict)  # its twins, if it keeps them
    seed: int = 0  # the run's training seed (a curvlab run's; 0 where unknown)


def _count(record: object, key: str, default: int, path: Path, least: int = 0) -> int:
    """A nanoGPT checkpoint's counter ``key`` (its default where absent), checked to be an integer >= ``least``:
    the file is anyone's, and a float such as inf or 1e30 is no step or batch size."""
    value = record.get(key, default) if isinstance(record, dict) else None
    if type(value) is not int or not least <= value < 2**63:
        raise CurvlabError(f"{path}: nanoGPT's {key} {value!r:.40} is not an integer >= {least}")
    return value


def open_checkpoint(
    path: str | Path,
    data: str | Path | None = None,
    device: str = "cpu",
    batches: int = 1,
    rebuild: Rebuild | None = None,
) -> Target:
    """Rebuild the model, optimizer and next batches of a checkpoint of any format
    :func:`~curvlab.runs.checkpoint.read_checkpoint` reads (with its errors).

    Args:
        data: the data directory; default the one recorded in a curvlab checkpoint (required for
            every other format: none records where its data lie).
        batches: how many steps' training batches to draw, from the next step's on, and how many
            validation batches to provide at least (where the data hold them).
        rebuild: for a Lightning or state-dict checkpoint, the model, optimizer class and batch size it
            doesn't record (:class:`~curvlab.runs.foreign.Rebuild`); no other format takes them.
    """
    dev = check_device(device)
    ckpt = read_checkpoint(path)
    rebuild = rebuild or Rebuild()
    if rebuild.given() and ckpt.format not in FOREIGN_FORMATS:
        raise CurvlabError(
            f"{ckpt.path}: a {ckpt.format} checkpoint records its model, optimizer and batch size; "
            "--config, --optimizer and --batch-size are for Lightning and state-dict checkpoints"
        )
    if ckpt.format == "curvlab":
        return _curvlab_target(ckpt.path, ckpt.payload, data, device, batches)
    if data is None:
        raise CurvlabError(f"{ckpt.path}: a {ckpt.format} checkpoint doesn't record its data; pass --data DIR")
    if ckpt.format in FOREIGN_FORMATS:
        return _foreign_target(ckpt.path, ckpt.payload, rebuild, data, dev, batches)
    if ckpt.format == "nanogpt":
        model, optimizer = load_nanogpt(ckpt.payload)
        if optimizer is None:
            raise CurvlabError(f"{path}: the checkpoint holds no optimizer state, so the next update can't be known")
        model.to(dev)
        optimizer.load_state_dict(optimizer.state_dict())  # (moves the moments to the parameters' device)
        conf = ckpt.payload.get("config", {})
        step = _count(ckpt.payload, "iter_num", 0, path)
        micro = _count(conf, "gradient_accumulation_steps", 1, path, least=1)
        train, val, draw = _seeded_draw(
            data,
            model.config.vocab_size,
            _count(conf, "batch_size", 12, path, least=1),
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


def _foreign_target(
    path: Path, ckpt: ForeignCheckpoint, rebuild: Rebuild, data, device: torch.device, batches: int
) -> Target:
    """A Lightning or state-dict checkpoint's model (from ``rebuild.config``), optimizer (``rebuild.optimizer``,
    with the saved state) and next batches: curvlab's seeded draw of ``rebuild.batch_size`` windows of the
    model's context. Nothing here records clipping: Z is the optimizer's unclipped step."""
    if rebuild.config is None:
        raise CurvlabError(
            f"{path}: a {ckpt.format} checkpoint doesn't record its model; pass --config (a curvlab config name, "
            "a GPTConfig JSON or a Hugging Face config.json)"
        )
    if rebuild.batch_size is None or rebuild.batch_size < 1:
        raise CurvlabError(f"{path}: a {ckpt.format} checkpoint doesn't record its batch size; pass --batch-size N")
    model = build_model(rebuild.config)
    load_weights(model, ckpt.weights, path)
    model.to(device)
    optimizer, label = rebuild_optimizer(model, rebuild.optimizer, ckpt.optimizer_state, path)
    ours = isinstance(model, GPT)
    seq_len = model.config.block_size if ours else context_length(model.config) - 1
    train, val, draw = _seeded_draw(
        data, model.config.vocab_size, rebuild.batch_size, seq_len, ckpt.step, 1, batches, device
    )
    if not ours:  # (Hugging Face's batches: the model's loss shifts the labels itself)
        train, val = [token_batch(*b) for b in train], [token_batch(*b) for b in val]
    return Target(model, optimizer, train, val, None, ckpt.step, float("nan"), label, draw)


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
        controls=run.controls,
        seed=run.cfg.seed,
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
