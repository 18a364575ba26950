"""From a checkpoint to a curvature report: the next update Z, its Taylor split and block matrix.

For one checkpoint (curvlab's, nanoGPT's ``ckpt.pt``, or a Hugging Face Trainer directory): rebuild
model, optimizer and data position; take the batch the run would train on next; compute the gradient
and the next update Z with :func:`~curvlab.steps.update.next_update` (the real step: schedule, momentum,
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

Report JSON (``REPORT_SCHEMA_VERSION`` = 4; a report of 3, whose settings name the method ``hvp_method``,
is read as one of 4)::

    schema_version, checkpoint, step, val_loss (null where the checkpoint has none), optimizer,
    settings{blocks, batch, batches, dtype, block_method, method, spectrum_top}, loss, nds,
    first_order, curvature_penalty, predicted, realized, update_norm, grad_norm, cosine,
    hidden{the same eight, over the hidden 2-D matrices, or null}, blocks{grouping, names, matrix,
    within, cross, nds (the total, = sum(matrix)), rho_within, first_order[], norm[], block_nds[] (each
    block's own NDS), asymmetry, members}, spectrum, next_batch{source, seed, micro_batches, rows},
    paired (or null), timing{seconds, hvp_seconds}, versions{python, curvlab, torch, numpy, scipy,
    transformers} (:mod:`curvlab.util.versions`; null in a report from before they were kept),
    digests{report (SHA-256 of the rest, checked on load), checkpoint (SHA-256 of the checkpoint's
    bytes, in a cache entry; else null)} (:meth:`CurvatureReport.save`)

``paired``: at a checkpoint whose run keeps a shadow state of the other arm (:mod:`curvlab.steps.shadow`),
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
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, ClassVar

import torch

from curvlab.analysis.controls import PointControls, exchangeable_twins, held_out_measures, stability_controls
from curvlab.analysis.directions import PAIRED, PairedDirections, measured_directions
from curvlab.analysis.factorial import FactorialPoint, measure_factorial, random_sv_seed
from curvlab.analysis.targets import (
    DTYPES,
    REPORT_SCHEMA_VERSION,
    AnalysisSettings,
    BatchDraw,
    Target,
    evaluation_batches,
    method_renamed,
    open_checkpoint,
)
from curvlab.curvature.groupings import hidden_matrices
from curvlab.curvature.scalars import (
    CheckpointScalars,
    embed_head_share,
    layer_blocks_split,
    taylor_error,
    taylor_holds,
)
from curvlab.curvature.scope import NAN_CURVATURE
from curvlab.curvature.spectral import EigenResult, TraceResult, hutchinson, lanczos, overlap_with
from curvlab.curvature.taylor import (
    BlockMatrix,
    TaylorSplit,
    block_matrix,
    taylor_split,
    taylor_split_and_block_matrix,
)
from curvlab.engine import params as param_dicts
from curvlab.engine.hvp import DEFAULT_METHOD
from curvlab.engine.loss import ModuleLoss, make_loss_fn
from curvlab.engine.operator import hessian_operator
from curvlab.errors import CurvlabError
from curvlab.runs.dcp import META as SHARDED_META
from curvlab.runs.foreign import Rebuild
from curvlab.steps.update import next_update
from curvlab.util import schema
from curvlab.util.atomic import atomic_write_text
from curvlab.util.digest import json_digest, path_digest
from curvlab.util.distributed import from_main, is_distributed, is_main, rank_and_world
from curvlab.util.safe_stop import check_stop
from curvlab.util.versions import SoftwareVersions


@dataclass(frozen=True)
class UpdateSpectrum:
    r"""λ_max and the top-k eigenvalues of H at a checkpoint, the share of :math:`\|Z\|^2` of its next
    update Z in their span, and the trace (the ``spectrum`` of a curvature report)."""

    top: EigenResult
    trace: TraceResult
    overlap_top_k: float
    nds: float
    dim: int

    @property
    def lambda_max(self) -> float:
        return float(self.top.eigenvalues[0])

    # by hand: the JSON is a summary of the eigen and trace results (no eigenvectors), read back with the
    # report's NDS
    def to_dict(self) -> dict[str, Any]:
        lam = self.lambda_max
        return {
            "lambda_max": lam,
            "top": self.top.eigenvalues.tolist(),
            "residuals": self.top.residuals.tolist(),
            "converged": self.top.converged,
            "num_hvps": self.top.num_matvecs + self.trace.num_matvecs,
            "overlap_top_k": self.overlap_top_k,
            "nds_over_lambda_max": self.nds / lam if lam else float("nan"),
            "trace": self.trace.trace,
            "trace_std_error": self.trace.std_error,
            "trace_per_parameter": self.trace.trace / self.dim,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], nds: float) -> UpdateSpectrum:
        """The spectrum of a saved report (``nds``: the report's NDS of Z). The JSON keeps no
        eigenvectors (the loaded ones are empty), nor how its ``num_hvps`` split between Lanczos and
        the trace (all are counted on Lanczos'), nor Hutchinson's sample count; the rest is exact, so
        :meth:`to_dict` gives the same JSON back."""
        top = torch.tensor(d["top"], dtype=torch.float64)
        per = d["trace_per_parameter"]
        dim = round(d["trace"] / per) if per and math.isfinite(per) else 1
        eigen = EigenResult(
            top,
            torch.zeros(0, len(top), dtype=torch.float64),
            torch.tensor(d["residuals"], dtype=torch.float64),
            d["num_hvps"],
            0,
            d["converged"],
            "lanczos",
            "largest",
        )
        trace = TraceResult(d["trace"], d["trace_std_error"], 0, "hutchinson", 0)
        return cls(eigen, trace, d["overlap_top_k"], nds, dim)


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
    versions: SoftwareVersions | None = None  # what it was made with (None: a report from before they were kept)
    controls: PointControls | None = None  # the controls beyond the paired directions, where asked for
    factorial: FactorialPoint | None = None  # the factorial of filters and maps, where asked for
    SCHEMA_VERSION: ClassVar[int] = REPORT_SCHEMA_VERSION
    MIGRATIONS: ClassVar[dict] = {3: method_renamed}  # 3 -> 4: settings.hvp_method is settings.method
    WHAT: ClassVar[str] = "report"

    # by hand: the Taylor split's keys sit at the top level (not under a key of their own), the block
    # grouping (a setting) inside "blocks", the two times under "timing", and the spectrum is read back
    # with the split's NDS
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": REPORT_SCHEMA_VERSION,
            "checkpoint": self.checkpoint,
            "step": self.step,
            # nanoGPT and Trainer checkpoints record no validation loss: null, not NaN (strict JSON)
            "val_loss": self.val_loss if math.isfinite(self.val_loss) else None,
            "optimizer": self.optimizer,
            "settings": asdict(self.settings),
            **self.split.to_dict(),  # (the eight quantities over all parameters, loss, hidden{..., names})
            "blocks": {"grouping": self.settings.blocks, **self.blocks.to_dict()},
            "spectrum": None if self.spectrum is None else self.spectrum.to_dict(),
            "next_batch": None if self.next_batch is None else self.next_batch.to_dict(),
            "paired": None if self.paired is None else self.paired.to_dict(),
            "timing": {"seconds": self.seconds, "hvp_seconds": self.hvp_seconds},
            "versions": None if self.versions is None else self.versions.to_dict(),
            "controls": None if self.controls is None else self.controls.to_dict(),
            "factorial": None if self.factorial is None else self.factorial.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CurvatureReport:
        """The report of :meth:`to_dict`'s JSON (see :meth:`UpdateSpectrum.from_dict
        <curvlab.analysis.report.UpdateSpectrum.from_dict>` for what a saved spectrum keeps).

        Raises:
            CurvlabError: another schema version (not one of :attr:`MIGRATIONS`).
        """
        d = schema.upgrade(d, cls)
        schema.check(d, cls)
        split = TaylorSplit.from_dict({f.name: d[f.name] for f in fields(TaylorSplit) if f.name in d})
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
            versions=None if d.get("versions") is None else SoftwareVersions.from_dict(d["versions"]),
            controls=None if d.get("controls") is None else PointControls.from_dict(d["controls"]),
            factorial=None if d.get("factorial") is None else FactorialPoint.from_dict(d["factorial"]),
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
            all=split.curvature(),
            hidden=NAN_CURVATURE if split.hidden is None else split.hidden.curvature(),
            within=self.blocks.within,
            cross=self.blocks.cross,
            rho_within=self.blocks.rho_within,
            within_layers=within_layers,
            nds_layers=nds_layers,
            embed_head_share=embed_head_share(self.blocks, self.settings.blocks, split.update_norm),
            taylor_error=taylor_error(split),
            taylor_ok=taylor_holds(split),
            paired={
                **({} if self.paired is None else self.paired.scalars()),
                **({} if self.controls is None else self.controls.scalars()),
                **({} if self.factorial is None else self.factorial.scalars()),
            },
        )

    def save(self, path: str | Path, checkpoint_digest: str | None = None) -> None:
        """Write the report's JSON to ``path`` (atomically) with its ``digests``: ``report``, the SHA-256
        of its own content (:func:`~curvlab.util.digest.json_digest` of the JSON without ``digests``),
        which :func:`load_report` checks, and ``checkpoint``, that of the checkpoint it was computed from
        (:func:`~curvlab.util.digest.path_digest`; a cache entry's, which :func:`cached_report`
        checks; null otherwise)."""
        d = json.loads(json.dumps(self.to_dict(), allow_nan=True))  # (the digest is of the JSON read back)
        d[DIGESTS] = {"report": json_digest(d), "checkpoint": checkpoint_digest}
        atomic_write_text(path, json.dumps(d, indent=1, allow_nan=True))


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
    method = settings.method
    if settings.block_method == "hvp":  # one point and one set of HVPs serve both
        split, blocks = taylor_split_and_block_matrix(
            loss_fn, params, D, Z, blocks=settings.blocks, method=method, dtype=dtype
        )
    else:
        split = taylor_split(loss_fn, params, D, Z, method=method, dtype=dtype)
        blocks = block_matrix(
            loss_fn,
            params,
            D,
            Z,
            blocks=settings.blocks,
            block_method=settings.block_method,
            method=method,
            dtype=dtype,
        )
    spectrum = None
    if settings.spectrum_top:
        spectrum = update_spectrum(loss_fn, params, D, Z, split.nds, settings.spectrum_top, dtype=dtype)
    paired, controls, factorial = None, None, None
    if settings.paired and target.shadow is not None:
        paired, controls = _paired_and_controls(target, settings, loss_fn, params, D, G, Z, dtype)
    if settings.factorial:
        factorial = _factorial(target, settings, loss_fn, params, D, G, Z, dtype)
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
        versions=SoftwareVersions.current(),
        controls=controls,
        factorial=factorial,
    )


def _paired_and_controls(target: Target, settings: AnalysisSettings, loss_fn, params, D, G, Z, dtype):
    """Both arms' directions at the point (:mod:`curvlab.analysis.directions`) and, as ``settings`` ask, the
    controls' (:mod:`curvlab.analysis.controls`): the twins' and momentum SGD's directions in the same
    batched call, the held-out H, lambda_max, the preconditioned sharpness and the injected directions."""
    model, optimizer, method = target.model, target.optimizer, settings.method
    names = (*PAIRED, "sgd") if settings.controls else PAIRED
    # the exchangeable twins (held-out control): judged under this point's H too, where they are the held-out
    # side (made from another batch), and under the held-out batch's, with the arms' own directions
    exchangeable = _exchangeable(target, settings, loss_fn) if settings.held_out else []
    twins = target.controls if settings.controls else None
    how = {"shadow": target.shadow, "controls": twins, "extra": exchangeable, "method": method, "dtype": dtype}
    how["gauss_newton"] = settings.gauss_newton
    # the controls' directions are read on the hidden matrices only: one batched HVP for all of them
    how["hidden_only"] = ("sgd", *(twins or {}), *(d.name for d in exchangeable))
    paired, directions = measured_directions(model, optimizer, loss_fn, params, D, G, Z, names=names, **how)
    hidden = paired.hidden_names
    if not (settings.held_out or settings.stability):
        return paired, None
    arms = [d for d in directions if d.name in PAIRED]
    controls = PointControls()
    if settings.stability:
        muon = next(d for d in arms if d.name == "muon")
        controls = stability_controls(
            loss_fn, model, optimizer, params, D, muon, G, settings.stability, method=method, dtype=dtype
        )
    if settings.held_out:
        held, cos = held_out_measures(
            loss_fn, params, target.val_batches[0], [*arms, *exchangeable], hidden, method=method, dtype=dtype
        )
        controls = replace(controls, held_out=held, held_out_cos=cos)
    return paired, controls


def _factorial(target: Target, settings: AnalysisSettings, loss_fn, params, D, G, Z, dtype) -> FactorialPoint:
    """The factorial's cells (:mod:`curvlab.analysis.factorial`), their random singular values seeded with the run's
    seed and the step (:func:`~curvlab.analysis.factorial.random_sv_seed`)."""
    if target.shadow is None:
        raise CurvlabError("the factorial needs the run's shadow of the other arm (train with shadow on)")
    held_out = target.val_batches[0] if settings.held_out and target.val_batches else None
    hidden = hidden_matrices(params, model=target.model)
    model, method = target.model, settings.method
    return measure_factorial(
        model,
        target.optimizer,
        loss_fn,
        params,
        D,
        held_out,
        G,
        Z,
        hidden,
        shadow=target.shadow,
        seed=random_sv_seed(target.seed, target.step),
        method=method,
        dtype=dtype,
    )


def _exchangeable(target: Target, settings: AnalysisSettings, loss_fn):
    """Both arms' exchangeable twins (:func:`curvlab.analysis.controls.exchangeable_twins`), their last gradient
    from the training batch after those the point reads (``settings.batches``)."""
    if not target.val_batches:
        raise CurvlabError("the held-out control needs a validation batch, and this checkpoint's data has none")
    if len(target.train_batches) <= settings.batches:
        raise CurvlabError("the held-out control needs one more training batch than the point reads; none was drawn")
    batch = target.train_batches[settings.batches]
    return exchangeable_twins(
        target.model, target.optimizer, loss_fn, batch, target.shadow, max_grad_norm=target.grad_clip
    )


def update_spectrum(
    loss_fn,
    params,
    batch,
    Z,
    nds: float,
    k: int,
    *,
    method: str = DEFAULT_METHOD,
    dtype: torch.dtype | None = None,
    trace_samples: int = 32,
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
    overlap = overlap_with(top.eigenvectors, param_dicts.flatten({n: Z[n] for n in params}))
    return UpdateSpectrum(top, trace, overlap, nds, op.dim)


def analyze_checkpoint(
    path: str | Path,
    settings: AnalysisSettings | None = None,
    data: str | Path | None = None,
    device: str = "cpu",
    rebuild: Rebuild | None = None,
) -> CurvatureReport:
    """Open a checkpoint (``rebuild``: what a Lightning or state-dict one doesn't record) and analyse its
    next step (see :func:`analyze`)."""
    settings = settings or AnalysisSettings()
    settings.validate()
    return analyze(open_checkpoint(path, data, device, settings.train_batches(), rebuild), settings, str(path))


DIGESTS = "digests"  # the key of a saved report's digests (CurvatureReport.save)


class StaleReport(UserWarning):
    """A cached report that can't be trusted (unreadable, truncated, edited, of another schema version,
    or made from other checkpoint bytes): it is recomputed, and this note says why."""


def load_report(path: str | Path) -> CurvatureReport:
    """A saved report, checked for its content digest (:meth:`CurvatureReport.save`) and its schema
    version; an unreadable, malformed or edited file, or one without its digest (nothing unsealed is
    trusted), is a one-line ``CurvlabError``."""
    path = Path(path)
    d = _report_json(path)
    recorded = _recorded_digest(d)
    if recorded is None:
        # another version (not an older one it upgrades) is named as such first, as schema.load does
        schema.check(schema.upgrade(d, CurvatureReport), CurvatureReport, path)
        raise CurvlabError(f"{path}: unsealed report (it {_NO_DIGEST}): not trusted")
    if json_digest(_content(d)) != recorded:
        raise CurvlabError(f"{path}: edited or corrupt report ({_EDITED}): not trusted")
    return _report_of(path, d)


def _report_json(path: Path) -> Any:
    return schema.read_json(path, "a report")


def _report_of(path: Path, d: Any) -> CurvatureReport:
    try:
        return CurvatureReport.from_dict(d)
    except CurvlabError as e:
        raise CurvlabError(f"{path}: {e}") from e
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise CurvlabError(f"{path}: malformed report ({type(e).__name__}: {e})") from e


_NO_DIGEST = "records no digests of its content (edited, or written by an older curvlab)"
_EDITED = "its content does not match its digest"


def _recorded_digest(d: Any) -> Any:
    """The content digest the saved report ``d`` records (:meth:`CurvatureReport.save`), or ``None``."""
    digests = d.get(DIGESTS) if isinstance(d, dict) else None
    return digests.get("report") if isinstance(digests, dict) else None


def _content(d: dict[str, Any]) -> dict[str, Any]:
    """What a saved report's content digest is of: all of it but its digests."""
    return {k: v for k, v in d.items() if k != DIGESTS}


def _distrust(d: Any, checkpoint_digest: str | None) -> str | None:
    """Why the cache entry ``d`` can't stand for the report of a checkpoint whose bytes have
    ``checkpoint_digest`` (``None``: it is gone), or ``None`` when it can."""
    if not isinstance(d, dict) or not schema.matches(d, CurvatureReport):
        version = d.get("schema_version") if isinstance(d, dict) else None
        return f"is of another schema version ({version}, this curvlab's is {REPORT_SCHEMA_VERSION})"
    recorded = _recorded_digest(d)
    if recorded is None:
        return _NO_DIGEST
    if json_digest(_content(d)) != recorded:
        return f"was edited or is corrupt ({_EDITED})"
    digests = d[DIGESTS]
    if not digests.get("checkpoint"):
        return "records no checkpoint digest (an older curvlab wrote it)"
    if digests["checkpoint"] != checkpoint_digest:
        return "was made from other checkpoint bytes than those there now"
    return None


def _cached(path: Path, checkpoint_digest: str | None) -> CurvatureReport | None:
    """The report cached at ``path``; ``None`` (a cache miss) without a file, and, with a
    :class:`StaleReport` note saying why, for one that can't be trusted: unreadable or truncated,
    edited (its content digest), of another schema version, or made from other bytes than the
    checkpoint's now (``checkpoint_digest``). A cache is derived data: never trusted, never fatal."""
    if not path.is_file():
        return None
    try:
        d = _report_json(path)
        why = _distrust(d, checkpoint_digest)
        if why is None:
            return _report_of(path, d)
    except CurvlabError as e:  # unreadable, truncated, malformed
        why = f"is unreadable ({str(e).removeprefix(f'{path}: ')})"
    warnings.warn(f"{path}: the cached report {why}: recomputed", StaleReport, stacklevel=3)
    return None


def report_cache_path(cache_dir: str | Path, checkpoint: str | Path, settings: AnalysisSettings) -> Path:
    """Where the report of ``checkpoint`` under ``settings`` is cached: the name hashes the settings
    and the checkpoint file's identity (path, size, modification time; of a sharded checkpoint
    directory, those of its ``curvlab.json``, which its writer puts last). The entry itself records
    the digest of the checkpoint's bytes, which :func:`cached_report` checks.

    A sharded analysis of a checkpoint gives the same report as the unsharded one (to rounding), so
    the key doesn't say which of the two made it."""
    checkpoint = Path(checkpoint).resolve()
    stamped = checkpoint / SHARDED_META if (checkpoint / SHARDED_META).is_file() else checkpoint
    stat = stamped.stat() if stamped.is_file() else None
    ident = f"{checkpoint}:{stat.st_size if stat else 0}:{stat.st_mtime_ns if stat else 0}"
    digest = hashlib.sha256(os.fsencode(ident)).hexdigest()[:8]  # (fsencode: a path's bytes, UTF-8 or not)
    return Path(cache_dir) / f"{checkpoint.parent.name}-{checkpoint.stem}-{settings.key()}-{digest}.json"


def cached_report(
    cache_dir: str | Path,
    checkpoint: str | Path,
    settings: AnalysisSettings,
    data=None,
    device="cpu",
    analyze_fn: Callable[..., CurvatureReport] | None = None,
) -> CurvatureReport:
    """The report of ``checkpoint`` under ``settings``: read from ``cache_dir`` when it was saved there
    before from these very checkpoint bytes, else computed by ``analyze_fn`` (default
    :func:`analyze_checkpoint`; the sharded analysis passes its own) and saved there (see
    :func:`report_cache_path`) with the digests of the checkpoint and of itself
    (:meth:`CurvatureReport.save`).

    An entry that can't be trusted (unreadable, truncated, edited, another schema version, made from
    other checkpoint bytes) is recomputed and replaced, with a :class:`StaleReport` note; a corrupt
    checkpoint is refused by the analysis (a one-line ``CurvlabError``). A report is a safe point for
    a stop that SIGINT or SIGTERM asked for (:func:`~curvlab.util.safe_stop.check_stop`).

    Under torch.distributed rank 0 decides whether the report is cached and hands the cached one to
    the others: every rank then analyses, or none does (a rank that saw rank 0's fresh file while
    another didn't would leave it alone in the analysis's collectives)."""
    analyze_fn = analyze_fn or analyze_checkpoint
    path = report_cache_path(cache_dir, checkpoint, settings)
    digest = path_digest(checkpoint) if is_main() else None  # (rank 0 alone reads and writes the cache)
    if is_distributed():
        cached = from_main(_cached(path, digest) if is_main() else None)
    else:
        cached = _cached(path, digest)
    report = cached
    if report is None:
        report = analyze_fn(Path(checkpoint).resolve(), settings, data, device)
        if is_main():  # under torch.distributed every rank computed it; one writes it
            report.save(path, digest)
    where = f"after the report of {checkpoint} (saved in {cache_dir}): run the same command again to continue"
    check_stop(where, rank_and_world()[1])
    return report
