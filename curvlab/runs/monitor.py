r"""Curvature while training runs: every K steps, the NDS and Taylor split of the step the run takes.

A :class:`CurvatureMonitor` holds a model, its optimizer, a loss function and a fixed held-out batch set D, chosen
once. Called at step k, it measures the step :math:`Z_k = W_k - W_{k+1}` on D (docs/science.md sections 1-2):

.. math::
    I_1 = \langle G_D, Z\rangle,\quad I_2 = \tfrac12\langle Z, H_D[Z]\rangle,\quad
    \text{predicted} = I_1 - I_2,\quad \text{realized} = L_D(W) - L_D(W - Z),\quad
    \mathrm{NDS} = \frac{\langle Z, H_D[Z]\rangle}{\|Z\|^2},

over all trainable parameters and over the hidden matrices, and with a block grouping the
interaction matrix :math:`M_{lm} = \langle Z_l, H_{lm}[Z_m]\rangle/\|Z\|^2`: within = tr M,
cross = the off-diagonal sum, rho_within = within / NDS. Each measurement is a :class:`MonitorRow`.

With ``estimator=`` one of :data:`~curvlab.curvature.estimators.ESTIMATORS` other than ``"exact"``,
:math:`\langle Z, H_D[Z]\rangle` over all parameters comes from that estimator instead, with its stated error,
and the rest of the split from one gradient and two losses; the hidden scope and the blocks need HVPs and are
left out (the row's ``unmeasured``; blocks are refused).

Z comes from one of two places:

* the step taken: :meth:`CurvatureMonitor.snapshot` before ``optimizer.step()``, then
  :meth:`CurvatureMonitor.measure_taken` after it. Z is exactly the step the loop took, whatever went into it
  (clipping, autocast, accumulation, DDP). ``curvlab train`` and the callbacks for the Hugging Face Trainer
  (:func:`trainer_curvature_callback`) and Lightning (:func:`lightning_curvature_callback`) do this;
* the step it would take: :meth:`CurvatureMonitor.measure_next` at a step boundary, given the batch
  the next step trains on, runs :func:`~curvlab.steps.update.next_update` (gradient, clipping, optimizer on
  cloned state). With the same batch, loss and clipping as the loop, that is the next step, bit for bit.

Measuring changes nothing in the run: parameters, gradients and optimizer state are only read (or put
back), under ``torch.random.fork_rng``, so dropout and data order draw as they would have.

A step whose curvature is not finite stops nothing: its row has status ``"non-finite"`` and a message
naming the quantity; a zero step's is ``"undefined"`` (NDS is 0/0). Stopping is the loop's choice
(``curvlab train --curvature-stop``, ``stop_on_nonfinite=True``).

Row JSON (``MONITOR_SCHEMA_VERSION`` = 1), one line per row in ``metrics.jsonl``::

    kind ("curvature"), schema_version, step, status, message, loss, nds, first_order,
    curvature_penalty, predicted, realized, update_norm, grad_norm, cosine,
    hidden{the same eight over the hidden matrices, names} or null,
    blocks{grouping, names, matrix, within, cross, nds, rho_within} or null, heldout_tokens, seconds,
    estimator, error (on nds, null when exact), unmeasured[...] (``"hidden"``, left null by an estimator)
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

from curvlab.curvature.estimators import ESTIMATORS, directional_curvature
from curvlab.curvature.groupings import GROUPINGS, group_parameters
from curvlab.curvature.scope import NAN_CURVATURE, DirectionCurvature, scope_names
from curvlab.curvature.taylor import Scope, taylor_split, taylor_split_and_block_matrix
from curvlab.engine import params as param_dicts
from curvlab.engine.exact import exact_second_order
from curvlab.engine.hvp import CurvaturePoint, working_dtype
from curvlab.engine.loss import LossFn, count_loss_terms, make_loss_fn, weighted_batches
from curvlab.errors import CurvlabError
from curvlab.optim.combined import Optimizers
from curvlab.runs.monitor_row import MONITOR_SCHEMA_VERSION, ROW_KIND, BlockSplit, MonitorRow  # noqa: F401 (re-exported)
from curvlab.steps.update import next_update


def _check_estimator(estimator: str, blocks: object) -> None:
    if estimator not in ESTIMATORS:
        raise CurvlabError(f"unknown curvature estimator {estimator!r}; choose one of {', '.join(ESTIMATORS)}")
    if blocks is not None and estimator != "exact":
        raise CurvlabError(f"the block split needs the exact estimator (HVPs), not {estimator!r}")


@dataclass(frozen=True)
class MonitorSettings:
    """What ``curvlab train --curvature-every K`` measures (not in the training config: it changes nothing
    in the run): at steps k % ``every`` == 0, on the run's first ``batches`` x ``windows`` validation
    windows (the defaults keep the overhead at K = 50 on ``tiny`` under 10%: ``benchmarks/monitor.py``),
    with a ``blocks`` grouping or none, by ``estimator`` (:class:`CurvatureMonitor`); ``stop_on_nonfinite``
    stops training at a non-finite row."""

    every: int
    batches: int = 1
    windows: int = 8
    blocks: str | None = None
    stop_on_nonfinite: bool = False
    estimator: str = "exact"

    def validate(self) -> None:
        for name in ("every", "batches", "windows"):
            value = getattr(self, name)
            if value < 1:
                raise CurvlabError(f"curvature {name} must be >= 1, got {value}")
        if self.blocks is not None and self.blocks not in GROUPINGS:
            raise CurvlabError(f"unknown block grouping {self.blocks!r}; choose one of {', '.join(GROUPINGS)}")
        _check_estimator(self.estimator, self.blocks)


class NonFiniteCurvature(CurvlabError):
    """A monitored step's curvature was not finite and the user asked training to stop."""


def _all_finite(tensors: Mapping[str, Tensor]) -> str | None:
    """The name of the first tensor holding a NaN or inf, else ``None``."""
    return next((n for n, t in tensors.items() if not torch.isfinite(t).all()), None)


class CurvatureMonitor:
    r"""Measures the curvature of a run's steps on a fixed held-out batch set (see the module docstring).

    Args:
        model: the model being trained; its trainable parameters (``requires_grad``) are W.
        optimizer: its optimizer, or a list of them (for :meth:`measure_next` only).
        loss_fn: ``loss_fn(params, batch) -> scalar``, e.g. :func:`~curvlab.engine.loss.make_loss_fn`.
        batches: the held-out batch set D (a batch or a list, weighted by loss terms), on the model's device.
        every: measure at steps k with ``k % every == 0`` (:meth:`due`).
        blocks: a block grouping (``"layer"``, ``"tensor"``, ``"kind"`` or ``{block: [globs]}``), or
            ``None`` (no within/cross split: 2 HVPs per row instead of L + 1).
        scope: the rows' ``hidden`` scope: ``"hidden"`` (the hidden matrices by the model's structure, as
            :func:`~curvlab.curvature.taylor.taylor_split` chooses them), parameter names, or ``None``.
        max_grad_norm: gradient clipping of the run, for :meth:`measure_next`.
        dtype: computation dtype (default float32, float64 for float64 parameters).
        on_row: called with every row as it is made.
        estimator: what computes the step's :math:`\langle Z, H[Z]\rangle`: ``"exact"`` (default, HVPs) or
            another of :data:`~curvlab.curvature.estimators.ESTIMATORS`, its stated error in the row's ``error``;
            the hidden scope is then not measured (``row.unmeasured``), and ``blocks`` is refused.

    Attributes:
        rows: every row measured so far, in order.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Optimizers | None,
        loss_fn: LossFn,
        batches: Any,
        *,
        every: int = 50,
        blocks: str | Mapping[str, Sequence[str]] | None = None,
        scope: Scope = "hidden",
        max_grad_norm: float | None = None,
        dtype: torch.dtype | None = None,
        on_row: Callable[[MonitorRow], None] | None = None,
        estimator: str = "exact",
    ):
        if every < 1:
            raise CurvlabError(f"the monitor's every must be >= 1, got {every}")
        _check_estimator(estimator, blocks)
        self.estimator = estimator
        self.model, self.optimizer, self.loss_fn, self.batches = model, optimizer, loss_fn, batches
        self.every, self.blocks, self.max_grad_norm, self.on_row = every, blocks, max_grad_norm, on_row
        params = self._params()
        if not params:
            raise CurvlabError("the model has no trainable parameters to monitor")
        self.dtype = working_dtype(params, dtype=dtype)
        if blocks is not None:
            group_parameters(params, blocks=blocks)  # a bad grouping fails here, not mid-run
        # by structure, as taylor_split's default (a ViT's classifier is not hidden, its patch conv may be)
        self.hidden_names = scope_names(scope, params, model)
        pieces = batches if isinstance(batches, list) else list(getattr(batches, "batches", [batches]))
        if not pieces:
            raise CurvlabError("no held-out batches given")
        self.heldout_tokens = sum(count_loss_terms(b) for b in pieces)  # (of a Batches: its batches')
        self.rows: list[MonitorRow] = []

    def _params(self) -> dict[str, Tensor]:
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    def due(self, step: int) -> bool:
        """Whether step ``step`` (steps done so far) is one to measure."""
        return step % self.every == 0

    def snapshot(self) -> dict[str, Tensor]:
        """A copy of the trainable parameters W, taken before ``optimizer.step()`` for :meth:`measure_taken`."""
        return {n: p.detach().clone() for n, p in self._params().items()}

    def measure_taken(self, step: int, before: Mapping[str, Tensor]) -> MonitorRow:
        r"""The row of the step just taken: :math:`Z = W_\text{before} - W_\text{now}`, measured at
        :math:`W_\text{before}` (``before`` from :meth:`snapshot`)."""
        now = self._params()
        param_dicts.check_like(now, before, "snapshot")
        z = {
            n: (before[n].double() - p.detach().double()).to(torch.promote_types(p.dtype, torch.float32))
            for n, p in now.items()
        }
        return self.measure(step, before, z)

    def measure_next(self, step: int, batch: Any) -> MonitorRow:
        """The row of the step the optimizer would take next on ``batch`` (the batch the next step
        trains on), from :func:`~curvlab.steps.update.next_update`."""
        if self.optimizer is None:
            raise CurvlabError("measure_next needs the optimizer: give it to CurvatureMonitor")
        start = time.perf_counter()
        with self._isolated():
            try:
                _, z = next_update(self.model, self.optimizer, self.loss_fn, batch, max_grad_norm=self.max_grad_norm)
            except CurvlabError:
                params = {n: p.detach() for n, p in self._params().items()}
                loss = self._loss_or_none(params, batch)
                if loss is None:  # the training loss was fine: not ours to swallow
                    raise
                return self._emit(self._failed(step, "non-finite", f"the loss on the step's batch is {loss}", start))
        return self.measure(step, {n: p.detach() for n, p in self._params().items()}, z)

    def measure(self, step: int, params: Mapping[str, Tensor], z: Mapping[str, Tensor]) -> MonitorRow:
        r"""The row of the step :math:`W \to W - Z` on the held-out batches (the other methods end here)."""
        start = time.perf_counter()
        with self._isolated():
            row = self._measure(step, params, z, start)
        return self._emit(row)

    def _emit(self, row: MonitorRow) -> MonitorRow:
        self.rows.append(row)
        if self.on_row is not None:
            self.on_row(row)
        return row

    @contextmanager
    def _isolated(self) -> Iterator[None]:
        """Fork the CPU's and the parameters' devices' random streams (put back on exit)."""
        devices = {p.device for p in self._params().values() if p.device.type not in ("cpu", "meta")}
        kinds = {d.type for d in devices}
        if len(kinds) > 1:
            raise CurvlabError(f"parameters on several device types ({sorted(kinds)}): can't fork their RNGs")
        kind = kinds.pop() if kinds else None
        indices = sorted({d.index or 0 for d in devices})
        with torch.random.fork_rng(devices=indices, device_type=kind):
            yield

    def _measure(self, step: int, params: Mapping[str, Tensor], z: Mapping[str, Tensor], start: float) -> MonitorRow:
        bad = _all_finite(z)
        if bad is not None:
            return self._failed(step, "non-finite", f"the step Z holds NaN or inf (in {bad})", start)
        if param_dicts.norm(z) == 0.0:
            return self._failed(step, "undefined", "the step Z is zero: NDS = <Z,HZ>/||Z||² is 0/0", start)
        # a scope on which Z is zero (frozen by the optimizer, say) has no NDS: leave it out, not the row
        hidden = self.hidden_names if self.hidden_names and param_dicts.norm(z, self.hidden_names) > 0 else []
        exact = self.estimator == "exact"
        unmeasured, hidden = ((), hidden) if exact or not hidden else (("hidden",), [])
        try:
            measured = self._exact(params, z, hidden) if exact else self._estimated(params, z)
        except CurvlabError:
            # (in the mode the losses were taken in: an estimator's are graph-free points, "fwd_rev")
            what = self._non_finite_loss(params, z, hidden, None if exact else "fwd_rev")
            if what is None:  # everything is finite: a genuine error, keep its traceback
                raise
            return self._failed(step, "non-finite", what, start)
        loss, scope, on_hidden, blocks, error = measured
        values = {"loss": loss, **asdict(scope), **({} if error is None else {"nds error": error})}
        values.update({f"hidden {k}": v for k, v in (asdict(on_hidden) if on_hidden else {}).items()})
        values.update({} if blocks is None else {"within": blocks.within, "cross": blocks.cross})
        bad = [k for k, v in values.items() if not math.isfinite(v)]
        status, message = ("non-finite", f"not finite: {', '.join(bad)}") if bad else ("ok", "")
        return MonitorRow(
            step=step,
            status=status,
            message=message,
            loss=loss,
            split=scope,
            hidden=on_hidden,
            blocks=blocks,
            heldout_tokens=self.heldout_tokens,
            seconds=time.perf_counter() - start,
            hidden_names=tuple(hidden),
            estimator=self.estimator,
            error=error,
            unmeasured=unmeasured,
        )

    def _exact(self, params, z, hidden: list[str]):
        """Loss, the split over all parameters and over ``hidden``, and the block split, by HVPs (no error)."""
        if self.blocks is None:
            split, bm = taylor_split(self.loss_fn, params, self.batches, z, scope=hidden, dtype=self.dtype), None
        else:
            split, bm = taylor_split_and_block_matrix(
                self.loss_fn, params, self.batches, z, blocks=self.blocks, scope=hidden, dtype=self.dtype
            )
        blocks = None
        if bm is not None:
            grouping = self.blocks if isinstance(self.blocks, str) else "custom"
            matrix = tuple(tuple(float(x) for x in r) for r in bm.matrix)
            blocks = BlockSplit(grouping, bm.names, matrix, bm.within, bm.cross, bm.nds, bm.rho_within)
        on_hidden = split.hidden.curvature() if hidden else None
        return split.loss, split.curvature(), on_hidden, blocks, None

    def _estimated(self, params, z):
        """Loss and the split over all parameters with <Z, HZ> by the monitor's estimator (its stated error on
        the NDS), the rest exact: one gradient at W with no graph kept, and the loss at W - Z."""
        dt = self.dtype
        estimate = directional_curvature(self.loss_fn, params, self.batches, z, estimator=self.estimator, dtype=dt)
        point = CurvaturePoint(self.loss_fn, params, self.batches, method="fwd_rev", dtype=dt)
        zc, g = param_dicts.cast(z, point.dtype), point.gradient
        gz, gg, zz = param_dicts.dots([(g, zc), (g, g), (zc, zc)], list(zc))
        realized = point.loss - point.loss_at(param_dicts.add(point.params, zc, -1.0))
        split = DirectionCurvature.of(gz, estimate.zhz, zz, gg, realized)
        return point.loss, split, None, None, estimate.error

    def _failed(self, step: int, status: str, message: str, start: float) -> MonitorRow:
        return MonitorRow(
            step, status, message, math.nan, NAN_CURVATURE, None, None, self.heldout_tokens,
            time.perf_counter() - start, estimator=self.estimator,
        )  # fmt: skip

    def _loss_or_none(self, params: Mapping[str, Tensor], batch: Any, method: str | None = None) -> float | None:
        """The loss on ``batch`` (one batch or a list, token-weighted) when it is not finite, else ``None``."""
        p = param_dicts.cast(params, self.dtype)
        with torch.no_grad(), exact_second_order(method=method):
            total = sum(w * float(self.loss_fn(p, b)) for b, w in weighted_batches(batch))
        return None if math.isfinite(total) else total

    def _non_finite_loss(self, params, z, hidden, method: str | None = None) -> str | None:
        """Which held-out loss the split needs is not finite (L(W), L(W - Z), L(W - Z_S)), else ``None``."""
        bad = _all_finite(params)
        if bad is not None:
            return f"the parameters W hold NaN or inf (in {bad})"
        points = {"L(W)": params, "L(W - Z)": param_dicts.add(params, z, -1.0)}
        if hidden:
            points["L(W - Z_S)"] = param_dicts.add(params, param_dicts.restrict(z, hidden), -1.0)
        for name, point in points.items():
            loss = self._loss_or_none(point, self.batches, method)
            if loss is not None:
                return f"the held-out loss {name} is {loss}"
        return None


def training_monitor(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    val_batches: list,
    settings: MonitorSettings,
    max_grad_norm: float | None,
) -> CurvatureMonitor:
    """The monitor of ``curvlab train``: the run's first ``batches x windows`` validation windows, in batches
    of ``windows`` on the model's device, under the training loss."""
    settings.validate()
    rows = settings.windows
    need = settings.batches * rows
    x, y = (torch.cat([b[i] for b in val_batches]) for i in (0, 1))
    if need > len(x):
        raise CurvlabError(
            f"{settings.batches} held-out batches of {rows} windows need {need} validation windows; "
            f"the run has {len(x)} (raise --val-windows)"
        )
    device = next(model.parameters()).device
    held = [(x[i : i + rows].to(device), y[i : i + rows].to(device)) for i in range(0, need, rows)]
    return CurvatureMonitor(
        model,
        optimizer,
        make_loss_fn(model),
        held,
        every=settings.every,
        blocks=settings.blocks,
        max_grad_norm=max_grad_norm,
        estimator=settings.estimator,
    )


def trainer_curvature_callback(monitor: CurvatureMonitor, *, stop_on_nonfinite: bool = False, trainer: Any = None):
    """A ``transformers.TrainerCallback`` that measures ``monitor``'s rows during ``Trainer.train()``.

    Before each due optimizer step (``on_pre_optimizer_step``, after clipping) it snapshots W; after it
    (``on_optimizer_step``) it measures the step taken, so Z is the Trainer's real step, and the row's step is
    ``state.global_step`` before it. Rows land in ``monitor.rows``. With the ``trainer`` (given here, by
    ``callback.attach(trainer)``, or by :func:`add_trainer_curvature_callback`), each row also goes to
    ``trainer.log(row.log_scalars())`` at the end of its step, reaching ``state.log_history`` and every
    ``report_to`` integration as the loss does (transformers hands a callback no trainer to log through).

    Args:
        monitor: the :class:`CurvatureMonitor` that measures the rows (its schedule, batches and scopes).
        stop_on_nonfinite: a non-finite row stops training (default off: a measurement never ends a run).
        trainer: the ``transformers.Trainer`` to log through (default ``None``: ``monitor.rows`` alone).

    Returns:
        (transformers.TrainerCallback): the callback, for ``Trainer(callbacks=[...])``.
    """
    from transformers import TrainerCallback  # optional (the hf extra): only this callback needs it

    class CurvatureCallback(TrainerCallback):
        def __init__(self):
            self.monitor = monitor
            self.trainer = trainer
            self._before: dict[str, Tensor] | None = None
            self._row: MonitorRow | None = None

        def attach(self, trainer):
            """Log the rows through ``trainer.log`` (returns the callback)."""
            self.trainer = trainer
            return self

        def on_train_begin(self, args, state, control, **kwargs):
            integrations = [r for r in (args.report_to or []) if r not in ("none", None)]
            if self.trainer is None and integrations:
                warnings.warn(
                    f"trainer_curvature_callback has no trainer: its rows stay in monitor.rows and don't reach "
                    f"report_to {integrations}; pass trainer= or use curvlab.add_trainer_curvature_callback",
                    stacklevel=2,
                )

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if monitor.due(state.global_step):
                self._before = monitor.snapshot()

        def on_optimizer_step(self, args, state, control, **kwargs):
            if self._before is None:
                return
            before, self._before = self._before, None
            row = monitor.measure_taken(state.global_step, before)
            self._row = row
            if stop_on_nonfinite and row.status == "non-finite":
                control.should_training_stop = True
            return control

        def on_step_end(self, args, state, control, **kwargs):
            row, self._row = self._row, None
            if row is not None and self.trainer is not None:
                # Trainer.log's on_log clears should_log: keep the Trainer's own logging of this step
                should_log = control.should_log
                self.trainer.log(row.log_scalars())
                control.should_log = should_log
                return control

    return CurvatureCallback()


def add_trainer_curvature_callback(trainer: Any, monitor: CurvatureMonitor, *, stop_on_nonfinite: bool = False):
    """Add :func:`trainer_curvature_callback` to a ``transformers.Trainer``, logging its rows through the Trainer.

    Args:
        trainer: the ``transformers.Trainer`` to add it to, whose logs get the rows.
        monitor: the :class:`CurvatureMonitor` that measures the rows.
        stop_on_nonfinite: a non-finite row stops training (default off).

    Returns:
        (transformers.TrainerCallback): the callback added.
    """
    callback = trainer_curvature_callback(monitor, stop_on_nonfinite=stop_on_nonfinite, trainer=trainer)
    trainer.add_callback(callback)
    return callback


def lightning_curvature_callback(monitor: CurvatureMonitor, *, stop_on_nonfinite: bool = False):
    """A ``lightning.pytorch.Callback`` that measures ``monitor``'s rows during ``Trainer.fit``.

    Before each due optimizer step (``on_before_optimizer_step``: after the step's backward passes, before the
    optimizer moves anything) it snapshots W; at ``on_train_batch_end`` it measures the step taken, so Z is the
    step Lightning took (accumulation, clipping, precision and all), and the row's step is
    ``trainer.global_step`` before it. Rows land in ``monitor.rows`` and go to every logger of the Trainer
    (:meth:`MonitorRow.log_scalars`) at the row's step, beside the training loss of the same batch.

    Args:
        monitor: the :class:`CurvatureMonitor` that measures the rows (its schedule, batches and scopes).
        stop_on_nonfinite: a non-finite row stops training (default off: a measurement never ends a run).

    Returns:
        (lightning.pytorch.Callback): the callback, for ``Trainer(callbacks=[...])``.
    """
    try:
        from lightning.pytorch import Callback  # optional: only this callback needs Lightning
    except ImportError as e:
        raise CurvlabError("the Lightning callback needs lightning: pip install 'curvlab[lightning]'") from e

    class CurvatureLightningCallback(Callback):
        def __init__(self):
            self.monitor = monitor
            self._before: tuple[int, dict[str, Tensor]] | None = None

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            # (a closure optimizer evaluates its closure again: keep the first snapshot, of W itself)
            if self._before is None and monitor.due(trainer.global_step):
                self._before = (trainer.global_step, monitor.snapshot())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self._before is None or trainer.global_step == self._before[0]:
                return  # no step taken yet (gradient accumulation)
            (step, before), self._before = self._before, None
            row = monitor.measure_taken(step, before)
            # straight to the loggers: pl_module.log_dict would round to float32 and log a value again
            # at the next step; at the row's step, where Lightning logs the same batch's training loss
            for logger in trainer.loggers:
                logger.log_metrics(row.log_scalars(), step=row.step)
            if stop_on_nonfinite and row.status == "non-finite":
                trainer.should_stop = True

    return CurvatureLightningCallback()
