"""``curvlab train``: its options are the fields of :class:`~curvlab.runs.config.TrainConfig` (with their
help, :data:`~curvlab.runs.config.FIELD_HELP`, and their defaults), built from the dataclass rather than
written out again, plus the few that are not part of a run's config (the curvature monitor, TensorBoard,
FSDP, the progress bar)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import types
import typing
from pathlib import Path
from typing import Any

import typer

from curvlab.cli.errors import one_line_errors
from curvlab.cli.options import count, number, positive, refuse_beyond_memory
from curvlab.curvature.estimators import ESTIMATORS
from curvlab.errors import CurvlabError
from curvlab.output.console import trained_line
from curvlab.runs.config import FIELD_HELP, FIELD_RANGES, TrainConfig
from curvlab.runs.launch import launch
from curvlab.runs.monitor import MonitorSettings
from curvlab.util.atomic import check_output

# The dict fields' flags: KEY=VALUE pairs, repeatable (values read as JSON where they parse).
DICT_FLAGS = {"model_overrides": "--model-opt", "optimizer_options": "--opt"}
PATH_FIELDS = ("data", "out")  # str in the config (it is JSON), a path on the command line
NONE_DEFAULTS = {"seq_len": "the model's block size"}  # what a None default means, for --help
NO_CLIPPING = 0  # --grad-clip 0: no clipping, which None (the config's word for it) can't say on a command line


def _key_values(pairs: list[str] | None, flag: str) -> dict:
    """``["lr=0.01", "betas=[0.9,0.95]"]`` -> ``{"lr": 0.01, "betas": [0.9, 0.95]}`` (values parsed as JSON)."""
    out = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CurvlabError(f"{flag} expects KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _field_option(f: dataclasses.Field, hint: Any) -> inspect.Parameter:
    """The keyword parameter (a typer option) of a config field: its type on the command line, its flag,
    its help, its range (:data:`FIELD_RANGES`), and its config default shown (the option itself defaults to
    None, so that only the options given override a config file)."""
    if isinstance(hint, types.UnionType):  # `int | None`: the option is an int that may be left out
        hint = next(t for t in typing.get_args(hint) if t is not type(None))
    decls: tuple[str, ...] = ()
    if f.name in DICT_FLAGS:
        hint, decls, shown = list[str], (DICT_FLAGS[f.name],), False
    elif hint is bool:
        flag = f.name.replace("_", "-")
        decls, shown = (f"--{flag}/--no-{flag}",), flag if f.default else f"no-{flag}"
    else:
        shown = NONE_DEFAULTS[f.name] if f.default is None else str(f.default)
    if f.name in PATH_FIELDS:
        hint, shown = Path, False
    low, high = FIELD_RANGES.get(f.name, (None, None))
    make = number if hint is float else count if hint is int else typer.Option
    bounds = {"low": low, "high": high} if hint in (int, float) else {}
    option = make(None, *decls, help=FIELD_HELP[f.name], show_default=shown, **bounds)
    return inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=hint)


def with_config_options(command):
    """``command`` with one option per :class:`TrainConfig` field in :data:`FIELD_HELP`, in the dataclass's
    order, before its own; the command receives them as ``**fields`` (None where not given)."""
    hints = typing.get_type_hints(TrainConfig)
    fields = [_field_option(f, hints[f.name]) for f in dataclasses.fields(TrainConfig) if f.name in FIELD_HELP]
    own = [p for p in inspect.signature(command).parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    command.__signature__ = inspect.Signature([*fields, *own], return_annotation=None)
    return command


def config_overrides(fields: dict[str, Any], lr: float | None) -> dict[str, Any]:
    """The config fields given on the command line, as :meth:`TrainConfig.from_sources` takes them."""
    overrides = {k: v for k, v in fields.items() if v is not None and k not in DICT_FLAGS}
    overrides.update({k: str(overrides[k]) for k in PATH_FIELDS if k in overrides})
    if overrides.get("grad_clip") == NO_CLIPPING:
        overrides["grad_clip"] = None
    for name, flag in DICT_FLAGS.items():
        given = _key_values(fields[name], flag)
        if name == "optimizer_options" and lr is not None:
            given["lr"] = lr
        if given:
            overrides[name] = given
    return overrides


@with_config_options
@one_line_errors
def train(
    *,
    lr: float = positive(
        None,
        help="Peak learning rate (Muon's for muon; its AdamW side: --opt adam_lr=...).",
        show_default="the optimizer's",
    ),
    config: Path = typer.Option(None, help="A JSON file of these fields; options given here override it."),
    quiet: bool = typer.Option(False, help="No progress bar."),
    curvature_every: int = count(
        0,
        low=0,
        help="Every K steps, the NDS and Taylor split of the step taken, on held-out windows, into metrics.jsonl.",
    ),
    curvature_batches: int = count(1, help="Held-out batches of --curvature-windows validation windows."),
    curvature_windows: int = count(
        8, help="Windows per held-out batch. The defaults cost under 10% of training time at K = 50 on tiny."
    ),
    blocks: str = typer.Option(
        None, help="Also the within/cross split of this grouping: layer, tensor or kind (about 3x a row's cost)."
    ),
    curvature_stop: bool = typer.Option(False, help="Stop at a non-finite curvature row (else record it, go on)."),
    curvature_estimator: str = typer.Option(
        "exact",
        help=f"{' | '.join(ESTIMATORS)}: what computes each row's <Z, HZ>; another than exact records its stated "
        "error and leaves the hidden-matrix split out (not with --blocks).",
    ),
    tensorboard: Path = typer.Option(
        None,
        help="Also write TensorBoard scalars here: train/val loss, lr, and the curvature rows "
        "(needs the tensorboard package: the curvlab extra of that name).",
    ),
    fsdp: bool = typer.Option(False, "--fsdp", help="Shard parameters and optimizer state with FSDP2 (torchrun)."),
    **fields: Any,
) -> None:
    """Train a GPT with one optimizer, keeping checkpoints ready for curvature analysis.

    With --curvature-every K the run also records, every K steps, the curvature of the step it takes
    (NDS, Taylor split over all parameters and the hidden matrices, and with --blocks the within- and
    cross-layer NDS) on fixed validation windows: rows of kind "curvature" in metrics.jsonl, drawn by
    `curvlab track`. Training is the same, bit for bit, with or without it.
    """

    cfg = TrainConfig.from_sources(file=config, overrides=config_overrides(fields, lr))
    check_output(cfg.out, directory=True)
    if tensorboard is not None:
        check_output(tensorboard, directory=True)
    cfg.validate()  # (build_run does too; the estimate below needs a valid model first)
    world = int(os.environ.get("WORLD_SIZE", "1"))  # (torchrun's: each rank holds its share of the batch)
    refuse_beyond_memory(
        cfg.memory_estimate(world, sharded=fsdp),
        f"a step of batch_size {cfg.batch_size} on model {cfg.model}" + (f" over {world} ranks" if world > 1 else ""),
        cfg.device,
    )
    monitor = None
    if curvature_estimator != "exact" and not curvature_every:
        raise CurvlabError("--curvature-estimator chooses how the monitor measures: give --curvature-every N too")
    if curvature_every:
        monitor = MonitorSettings(
            every=curvature_every, batches=curvature_batches, windows=curvature_windows, blocks=blocks,
            stop_on_nonfinite=curvature_stop, estimator=curvature_estimator,
        )  # fmt: skip
        monitor.validate()  # (before the data is read and the model built)
    launched = launch(cfg, monitor=monitor, tensorboard=tensorboard, fsdp=fsdp, progress=not quiet)
    if launched.rank == 0:
        r = launched.result
        typer.echo(
            trained_line(cfg.optimizer, r.step, r.val_loss, r.tokens_per_second, r.out, r.resumed_from, launched.world)
        )
