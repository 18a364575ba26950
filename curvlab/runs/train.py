"""The training loop: a GPT on token shards with one of curvlab's optimizers, checkpointing every
state the curvature analysis needs to reproduce the next step exactly.

Setup (:class:`curvlab.runs.config.TrainConfig`, :mod:`curvlab.runs.schedule`), resume, then
:func:`train_loop`: the validation loss on fixed windows, and an atomic checkpoint every ``ckpt_every``
steps and at step 0; metrics go to ``metrics.jsonl``. One loop serves a full-model run (:func:`train`), an
adapter run (:func:`curvlab.runs.adapt.adapt`, which checkpoints the trainable parameters and the base's
reference only) and a sharded one (:func:`curvlab.runs.sharded_train.train_sharded`, whose forward,
evaluation and checkpoints are its :class:`RunLayout`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from curvlab.data.shards import TokenData, TrainBatches, data_vocab_size, validation_batches
from curvlab.engine.loss import count_loss_terms, token_cross_entropy
from curvlab.errors import CurvlabError
from curvlab.models.gpt import GPT, get_config
from curvlab.optim.build import build_optimizer
from curvlab.runs.checkpoint import add_to_index, checkpoint_name, load_checkpoint, read_index, save_checkpoint
from curvlab.runs.config import TrainConfig
from curvlab.runs.metrics import METRICS_FILE, row_line, truncate_metrics
from curvlab.runs.monitor import CurvatureMonitor, MonitorRow, MonitorSettings, NonFiniteCurvature, training_monitor
from curvlab.runs.run_folder import check_new_run, check_no_foreign_files, check_resume
from curvlab.runs.schedule import lr_multiplier
from curvlab.steps.shadow import ShadowState, build_controls, build_shadow
from curvlab.util.atomic import (
    atomic_write_text,
    remove_stale_temporaries,
    write_errors,
    writes_confined_to,
)
from curvlab.util.distributed import all_reduce_sum, barrier, device_for_rank, my_share, rank_and_world
from curvlab.util.lock import check_still_owner, own_directory
from curvlab.util.progress import progress as progress_bar
from curvlab.util.safe_stop import check_stop, stop_at_safe_points


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise CurvlabError(f"device {name!r} was asked for but CUDA is not available")
    return torch.device(name)


@dataclass
class Run:
    """A training run's live objects, built from a config (and, on resume, a checkpoint). ``base``: an
    adapter run's frozen base (JSON: where it comes from, how it is adapted), whose checkpoints hold the
    trainable parameters (``"adapter"``) and this reference in place of the model (``"model"``)."""

    cfg: TrainConfig
    model: nn.Module  # a GPT, or a peft model around one
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    loader: TrainBatches
    val_batches: list
    device: torch.device
    step: int = 0
    shadow: ShadowState | None = None
    controls: dict[str, ShadowState] = field(default_factory=dict)  # the twins (TrainConfig.controls)
    base: dict[str, Any] | None = None

    def autocast(self):
        if self.device.type == "cuda":
            return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()


def build_run(cfg: TrainConfig, rank: int = 0, world: int = 1) -> Run:
    """Data, model, optimizer, schedule and loaders for ``cfg``, at step 0."""
    cfg.validate()
    device = pick_device(cfg.device)
    data = TokenData.open(cfg.data)
    model_cfg = get_config(cfg.model, **cfg.model_overrides)
    vocab = data_vocab_size(cfg.data) or 1 + max(int(s.max()) for s in data.train + data.val if s.size)
    if vocab > model_cfg.vocab_size:
        raise CurvlabError(
            f"{cfg.data}: the data's vocabulary ({vocab}) is larger than the model's ({model_cfg.vocab_size}); "
            "set model_overrides vocab_size"
        )
    seq_len = cfg.seq_len or model_cfg.block_size
    if seq_len > model_cfg.block_size:
        raise CurvlabError(f"seq_len {seq_len} exceeds the model's block_size {model_cfg.block_size}")
    torch.manual_seed(cfg.seed)
    model = GPT(model_cfg).to(device)
    optimizer = build_optimizer(cfg.optimizer, model, **cfg.optimizer_options)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg))
    loader = TrainBatches(data.train, cfg.batch_size, seq_len, seed=cfg.seed, rank=rank, world=world)
    val = validation_batches(data.val, cfg.batch_size, seq_len, cfg.val_windows)
    shadow = build_shadow(cfg.optimizer, model, **cfg.shadow_options) if cfg.shadow else None
    controls = build_controls(optimizer, model) if cfg.controls else {}
    return Run(cfg, model, optimizer, scheduler, loader, val, device, shadow=shadow, controls=controls)


def restore(run: Run, ckpt: dict[str, Any]) -> None:
    """Put a checkpoint's model (or adapter), optimizer, scheduler, loader and RNG states into ``run``."""
    if run.base is None:
        run.model.load_state_dict(ckpt["model"])
    else:
        load_trainable_state(run.model, ckpt["adapter"])
    run.optimizer.load_state_dict(ckpt["optimizer"])
    run.scheduler.load_state_dict(ckpt["scheduler"])
    run.loader.load_state_dict(ckpt["data"])
    torch.set_rng_state(ckpt["rng"])
    run.step = int(ckpt["step"])
    if run.shadow is not None:
        if "shadow" not in ckpt:
            raise CurvlabError(f"the checkpoint of step {run.step} holds no shadow state, which this run keeps")
        run.shadow.load_state_dict(ckpt["shadow"])
        run.shadow.to(run.device)
    if run.controls:
        saved = ckpt.get("controls", {})
        if set(saved) != set(run.controls):
            raise CurvlabError(f"the checkpoint of step {run.step} holds no control shadows, which this run keeps")
        for name, control in run.controls.items():
            control.load_state_dict(saved[name])
            control.to(run.device)


@torch.no_grad()
def evaluate(run: Run, every_window: bool = False) -> float:
    """Mean validation loss over every token of the fixed validation windows: under torch.distributed each
    rank evaluates its share and the sums are all-reduced, or, ``every_window`` (an FSDP2 forward needs
    every rank), each rank evaluates them all."""
    was_training = run.model.training
    run.model.eval()
    sums = torch.zeros(2, dtype=torch.float64)
    for x, y in run.val_batches if every_window else my_share(run.val_batches):
        x, y = x.to(run.device), y.to(run.device)
        with run.autocast():
            loss = token_cross_entropy(run.model(x), y)
        n = count_loss_terms((x, y))
        sums += torch.tensor([float(loss) * n, n], dtype=torch.float64)
    if not every_window:
        all_reduce_sum(sums)
    run.model.train(was_training)
    return float(sums[0] / sums[1])


def trainable_state(model: nn.Module) -> dict[str, Tensor]:
    """The trainable parameters (``requires_grad``) by name: an adapter run's checkpointed weights."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def load_trainable_state(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Copy ``state`` (from :func:`trainable_state`) into the model's trainable parameters; another
    adapter's names are a ``CurvlabError``."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if set(params) != set(state):
        odd = sorted(set(params) ^ set(state))
        raise CurvlabError(f"the checkpoint's adapter does not fit the model's trainable parameters ({odd[0]}, ...)")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(state[n])


def checkpoint_payload(run: Run, val_loss: float, train_loss: float) -> dict[str, Any]:
    if run.base is None:
        weights = {"model_config": run.model.config.to_dict(), "model": run.model.state_dict()}
    else:
        weights = {"base": run.base, "adapter": trainable_state(run.model)}
    return {
        "step": run.step,
        "config": run.cfg.to_dict(),
        **weights,
        "optimizer": run.optimizer.state_dict(),
        "scheduler": run.scheduler.state_dict(),
        "data": run.loader.state_dict(),
        "rng": torch.get_rng_state(),
        "val_loss": val_loss,
        "train_loss": train_loss,
        **({"shadow": run.shadow.state_dict()} if run.shadow is not None else {}),
        **({"controls": {k: c.state_dict() for k, c in run.controls.items()}} if run.controls else {}),
    }


class TrainingDiverged(CurvlabError):
    """The training loss became non-finite; the last good checkpoint stays."""


@dataclass(frozen=True)
class TrainResult:
    out: str
    step: int
    val_loss: float
    tokens_per_second: float
    resumed_from: int


@dataclass(frozen=True)
class RunLayout:
    """How a run's model lies over the ranks: all that differs between the dense run (:data:`DENSE`) and
    the sharded one (:data:`curvlab.runs.sharded_train.SHARDED`) in :func:`train_loop`. Every rank calls
    each: ``forward(run, world)``, the module a step calls; ``evaluate(run)``, the validation loss;
    ``save(run, val_loss, train_loss, is_main)``, the checkpoint of ``run.step``, listed in the index;
    ``load(run, path)``, the checkpoint at ``path`` put into ``run``.
    """

    forward: Callable[[Run, int], nn.Module]
    evaluate: Callable[[Run], float]
    save: Callable[[Run, float, float, bool], None]
    load: Callable[[Run, Path], None]


def _dense_forward(run: Run, world: int) -> nn.Module:
    forward = DistributedDataParallel(run.model) if world > 1 else run.model  # averages the gradients
    return torch.compile(forward) if run.cfg.compile else forward


def _save(run: Run, val_loss: float, train_loss: float, is_main: bool) -> None:
    if is_main:
        out, name = Path(run.cfg.out), checkpoint_name(run.step)
        save_checkpoint(out / name, checkpoint_payload(run, val_loss, train_loss))
        add_to_index(out, run.step, val_loss, name)


def _load(run: Run, path: Path) -> None:
    restore(run, load_checkpoint(path, map_location=run.device))


# the whole model on every rank (DistributedDataParallel under torch.distributed); rank 0 writes
# each checkpoint as one file
DENSE = RunLayout(forward=_dense_forward, evaluate=evaluate, save=_save, load=_load)


@contextlib.contextmanager
def _open_metrics(path: Path, is_main: bool):
    """``metrics.jsonl``'s descriptor, open for appending on rank 0 (``None`` elsewhere), never through a
    link. Unbuffered: a failed write (a full disk) fails once, in :func:`_write_row`, not again at close."""
    if not is_main:
        yield None
        return
    with write_errors(path):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    try:
        yield fd
    finally:
        os.close(fd)


def _write_row(log: int | None, path: Path, row: dict[str, Any]) -> None:
    """Append ``row`` to ``metrics.jsonl`` open as ``log`` (``None``: not rank 0); a failed write is one line
    naming the file (a line it cut short ends the file for readers: runs.metrics)."""
    if log is not None:
        data = (row_line(row) + "\n").encode()  # (with its digest: runs.metrics)
        with write_errors(path):
            while data:  # (a write may take part of it, and fail on the rest)
                data = data[os.write(log, data) :]


def _record_curvature(row: MonitorRow, log, path: Path, stop: bool) -> None:
    _write_row(log, path, row.to_dict())
    if stop and row.status == "non-finite":
        raise NonFiniteCurvature(f"non-finite curvature at step {row.step} ({row.message}); stopped as asked")


def summary_writer_class() -> type:
    try:
        from torch.utils.tensorboard import SummaryWriter  # optional: only --tensorboard needs it
    except ImportError as e:
        raise CurvlabError("--tensorboard needs the tensorboard package: pip install 'curvlab[tensorboard]'") from e
    return SummaryWriter


def _write_scalars(writer, step: int, scalars: dict[str, float]) -> None:
    if writer is not None:
        for tag, value in scalars.items():
            if math.isfinite(value):
                writer.add_scalar(tag, value, step)


def train(
    cfg: TrainConfig,
    *,
    progress: bool = True,
    rank: int | None = None,
    world: int | None = None,
    monitor: MonitorSettings | None = None,
    tensorboard: str | Path | None = None,
) -> TrainResult:
    """Train (or resume) the run ``cfg`` describes, in :func:`train_loop`.

    With ``monitor``, every ``monitor.every`` steps the curvature of the step taken
    (:mod:`curvlab.runs.monitor`) goes into ``metrics.jsonl`` as a row of kind ``"curvature"``; the run is
    the same, bit for bit, with or without it. With ``tensorboard`` (a directory), rank 0 writes
    ``train/loss`` and ``train/lr`` at every step, ``val/loss`` when evaluated, and each curvature row's
    :meth:`~curvlab.runs.monitor.MonitorRow.log_scalars` at the step it measured (steps done, as in
    ``metrics.jsonl``). Under ``torchrun`` the model is wrapped in DistributedDataParallel, each rank trains
    on rows ``rank::world`` of the same global batch (results don't depend on the number of ranks), and
    rank 0 alone writes metrics and checkpoints. Raises what :func:`train_loop` raises, and
    ``CurvlabError`` for bad data or config.
    """
    if rank is None or world is None:
        rank, world = rank_and_world()
    if world > 1:
        cfg = replace(cfg, device=device_for_rank(cfg.device))
    if tensorboard is not None:
        summary_writer_class()  # a missing package is refused before anything runs
    run = build_run(cfg, rank, world)
    curvature = None
    if monitor is not None:
        curvature = training_monitor(run.model, run.optimizer, run.val_batches, monitor, cfg.grad_clip)
    stop = monitor is not None and monitor.stop_on_nonfinite
    return train_loop(
        run, progress=progress, rank=rank, world=world, curvature=curvature, stop_on_nonfinite=stop,
        tensorboard=tensorboard,
    )  # fmt: skip


def stopped_where(out: Path, step: int, last_checkpoint: int) -> str:
    """What a run stopped by a signal says: where it stopped, and how to resume."""
    return (
        f"after step {step} in {out}; its last checkpoint is step {last_checkpoint}: run the same command "
        "again to resume from it"
    )


def _take_step(
    run: Run,
    forward: Callable[[Tensor], Tensor],
    world: int,
    trainable: list[torch.nn.Parameter],
    curvature: CurvatureMonitor | None,
    due: Callable[[int], bool] | None,
) -> tuple[Tensor, float, Any]:
    """One optimizer step of ``run`` (see :func:`train_loop`); returns the loss over all ranks, the learning
    rate the step took and ``curvature``'s snapshot of the state before it where ``due`` (else ``None``)."""
    cfg = run.cfg
    x, y = (t.to(run.device) for t in run.loader.next())
    with run.autocast():
        loss = token_cross_entropy(forward(x), y)
    # every rank's share of the global batch has as many tokens: the mean of the means is the loss
    global_loss = all_reduce_sum(loss.detach().double()) / world if world > 1 else loss.detach()
    if not torch.isfinite(global_loss):
        raise _diverged(Path(cfg.out), run.step + 1)
    loss.backward()  # (DDP all-reduces, FSDP2 reduce-scatters the gradients, averaged over the ranks)
    if cfg.grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(trainable, cfg.grad_clip)
    if run.shadow is not None:  # the gradient the optimizer sees (clipped); reads it, changes nothing
        run.shadow.update_from(run.model)
    for control in run.controls.values():
        control.update_from(run.model)
    lr = run.optimizer.param_groups[0]["lr"]
    before = curvature.snapshot() if due is not None and due(run.step) else None
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.step += 1
    return global_loss, lr, before


def train_loop(
    run: Run,
    *,
    layout: RunLayout = DENSE,
    progress: bool = True,
    rank: int = 0,
    world: int = 1,
    curvature: CurvatureMonitor | None = None,
    measure_at: Callable[[int], bool] | None = None,
    stop_on_nonfinite: bool = False,
    tensorboard: str | Path | None = None,
    desc: str | None = None,
    leave: bool = True,
) -> TrainResult:
    r"""Train (or resume) ``run`` in ``run.cfg.out`` to ``run.cfg.steps``: the one loop of :func:`train`,
    :func:`curvlab.runs.adapt.adapt` and :func:`curvlab.runs.sharded_train.train_sharded` (``layout``).

    A step from :math:`\theta_k`: next batch, loss, a non-finite check, backward, clipping of the trainable
    parameters (``grad_clip``), the shadow and control states read the gradient, optimizer and schedule
    steps; the validation loss every ``eval_every`` steps and a checkpoint every ``ckpt_every`` (and at the
    end). A run in ``out`` resumes from its last checkpoint under the same config (:func:`check_resume`),
    bit for bit. With ``curvature``, the step taken from step k is measured when ``measure_at(k)`` (default
    ``curvature.due``) and written to ``metrics.jsonl``.

    The run holds ``out`` while it trains (:func:`curvlab.util.lock.own_directory`; one that took it over
    stops this one: :func:`curvlab.util.lock.check_still_owner`), begins only in a folder of its own files
    (:func:`check_new_run`), writes through no link out of ``out``
    (:func:`curvlab.util.atomic.writes_confined_to`), and stops after the step in progress on a SIGINT or
    SIGTERM, on every rank (:mod:`curvlab.util.safe_stop`).

    Raises:
        CurvlabError: see above; a resume with a different config, a corrupt checkpoint, config or metrics.
        TrainingDiverged: a non-finite training loss (the last good checkpoint is kept).
        NonFiniteCurvature: a non-finite curvature row, with ``stop_on_nonfinite``.
        Stopped: a SIGINT or SIGTERM, honoured at the safe point after a step.
    """
    cfg, out, is_main = run.cfg, Path(run.cfg.out), rank == 0
    with contextlib.ExitStack() as stack:  # (holds out, the safe points and the TensorBoard writer)
        check_no_foreign_files(out)  # (before the lock too: such a folder gets no lock file)
        previous = stack.enter_context(own_directory(cfg.out, "train"))  # before anything in out is read
        if previous is not None and progress and is_main:
            print(f"[train] took {cfg.out} over from {previous.describe()}, which is no longer running", flush=True)
        stack.enter_context(writes_confined_to(out))  # (no link in out leads a write elsewhere)
        stack.enter_context(stop_at_safe_points())
        resumed_from = _resume_or_begin(run, layout, is_main)
        writer = None
        if tensorboard is not None and is_main:  # (made once the run is known good: no empty event files)
            writer = stack.enter_context(contextlib.closing(summary_writer_class()(log_dir=str(tensorboard))))
        forward = layout.forward(run, world)
        due = measure_at if measure_at is not None else curvature.due if curvature is not None else None
        run.model.train()
        trainable = [p for p in run.model.parameters() if p.requires_grad]  # (an adapter run: the adapters)
        tokens_per_step = cfg.batch_size * run.loader.seq_len
        val_loss, shown_val, elapsed, steps_done = float("nan"), float("nan"), 0.0, 0
        last_checkpoint = run.step
        metrics_path = out / METRICS_FILE
        desc = desc or f"train {cfg.optimizer}"
        bar = progress_bar(range(run.step, cfg.steps), desc=desc, disable=not (progress and is_main), leave=leave)
        log = stack.enter_context(_open_metrics(metrics_path, is_main))
        for _ in bar:
            start = time.perf_counter()
            global_loss, lr, before = _take_step(run, forward, world, trainable, curvature, due)
            elapsed += time.perf_counter() - start
            steps_done += 1
            train_loss = float(global_loss)
            checkpoint_now = run.step % cfg.ckpt_every == 0 or run.step == cfg.steps
            evaluate_now = checkpoint_now or run.step % cfg.eval_every == 0
            val_loss = layout.evaluate(run) if evaluate_now else float("nan")
            record = {"step": run.step, "train_loss": train_loss, "lr": lr, "tokens": run.step * tokens_per_step}
            if evaluate_now:
                record["val_loss"] = val_loss
            # out's lock file removed by hand and another process training there: it writes, this one stops
            check_still_owner(out, f"stopped after step {run.step}, writing nothing more there", world)
            _write_row(log, metrics_path, record)
            scalars = {"train/loss": train_loss, "train/lr": lr} | ({"val/loss": val_loss} if evaluate_now else {})
            _write_scalars(writer, run.step, scalars)
            if before is not None:  # every rank measures (the held-out batches are shared out); rank 0 writes
                row = curvature.measure_taken(run.step - 1, before)
                _write_scalars(writer, row.step, row.log_scalars())
                _record_curvature(row, log, metrics_path, stop_on_nonfinite)
            if checkpoint_now:
                layout.save(run, val_loss, train_loss, is_main)
                last_checkpoint = run.step
            # the safe point: this step's checkpoint (if due) and metrics are written, and every rank stops
            # after the same step; the rerun retakes the steps after the last checkpoint, bit for bit
            check_stop(stopped_where(out, run.step, last_checkpoint), world)
            tps = tokens_per_step * steps_done / max(elapsed, 1e-9)
            shown_val = val_loss if evaluate_now else shown_val
            val_text = {} if math.isnan(shown_val) else {"val": f"{shown_val:.3f}"}  # none before the first evaluation
            bar.set_postfix(loss=f"{train_loss:.3f}", **val_text, tok_s=f"{tps:.0f}")
        barrier()
        index = read_index(out)
        last_val = index[-1]["val_loss"] if index else val_loss
        tps = tokens_per_step * steps_done / elapsed if elapsed else float("nan")
        return TrainResult(str(out), run.step, last_val, tps, resumed_from)


def _diverged(out: Path, step: int) -> TrainingDiverged:
    """The refusal of a non-finite training loss at ``step``, naming the last good checkpoint."""
    index = read_index(out)
    last = index[-1]["path"] if index else "none"
    return TrainingDiverged(f"non-finite training loss at step {step}; last good checkpoint: {last}")


def _resume_or_begin(run: Run, layout: RunLayout, is_main: bool) -> int:
    """Resume ``run`` from its last checkpoint, or begin it (``config.json``, the checkpoint of step 0);
    returns the step resumed from (0 for a new run)."""
    out = Path(run.cfg.out)
    if is_main:  # what a killed write left (kill -9 mid-checkpoint): never read, so removed
        remove_stale_temporaries(out)
    index = read_index(out)
    if not index:
        check_new_run(out, run.cfg)
    barrier()  # every rank has decided whether to resume before rank 0 writes anything
    if index:
        check_resume(out, run.cfg)
        layout.load(run, out / index[-1]["path"])
    elif is_main:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "config.json", json.dumps(run.cfg.to_dict(), indent=1))
    barrier()  # out is made before any rank writes there (each writes its shards of a sharded checkpoint)
    if is_main:  # a resumed run rewrites what came after its checkpoint
        truncate_metrics(out, run.step)
    if not index:
        layout.save(run, layout.evaluate(run), float("nan"), is_main)
    return run.step if index else 0
