"""The ``curvlab`` command line. Thin: every command parses options and calls the library.

Errors the library raises as ``CurvlabError`` (bad input: missing or corrupt files, mismatched
shapes, non-finite values, a failed write) become one line on stderr and exit status 2; a SIGINT or
SIGTERM that ``train``, ``reproduce`` or ``finetune`` honoured at a safe point
(:mod:`curvlab.util.safe_stop`) is one line too, with status 130 or 143.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path

import numpy as np
import torch
import typer

import curvlab
from curvlab.analysis.direction_report import checkpoint_directions
from curvlab.analysis.report import analyze_checkpoint
from curvlab.analysis.sharded import analyze_sharded_checkpoint
from curvlab.analysis.spectrum import SpectrumRequest, checkpoint_spectrum
from curvlab.analysis.targets import AnalysisSettings
from curvlab.curvature.scalars import RATIO_KEYS, SCOPE_KEYS
from curvlab.data.dataset import generate_pcfg_dataset, read_stats
from curvlab.engine.hvp import DEFAULT_METHOD
from curvlab.errors import CurvlabError
from curvlab.jobs.finetune import Finetune
from curvlab.jobs.presets import PRESETS, ROBUSTNESS_PRESETS, with_preset
from curvlab.jobs.reproduce import Reproduction
from curvlab.jobs.robustness import Robustness
from curvlab.output.files import write_quadratic, write_spectrum
from curvlab.output.plots import curvature_during_training, lambda_max_along_run
from curvlab.output.text import calibration_line, finetune_table, primary_table, publish_robustness, update_readme
from curvlab.runs.config import TrainConfig
from curvlab.runs.foreign import Rebuild
from curvlab.runs.match import MatchCriteria
from curvlab.runs.monitor import MonitorSettings
from curvlab.runs.sharded_train import train_sharded
from curvlab.runs.train import train as run_training
from curvlab.studies.compare import compare_runs
from curvlab.studies.quadratic import quadratic_study
from curvlab.studies.quadratic_model import TwoLevelSpec
from curvlab.studies.track import track_monitor, track_run, track_source
from curvlab.util.atomic import check_output
from curvlab.util.distributed import distributed_context

app = typer.Typer(
    help="curvlab: exact curvature analysis of neural-network optimizers (NDS, Taylor split, block curvature).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
pcfg_app = typer.Typer(help="The Zipf-PCFG synthetic language: generate data, inspect it.", no_args_is_help=True)
app.add_typer(pcfg_app, name="pcfg")


def one_line_errors(fn):
    """Turn the library's :class:`CurvlabError` (and missing or unwritable files) into ``error: ...`` and
    exit status 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (CurvlabError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError) as e:
            # torchrun's environment, not the process group: that is torn down before we get here
            world = int(os.environ.get("WORLD_SIZE", "1"))
            where = f"rank {os.environ.get('RANK', '0')}/{world}: " if world > 1 else ""
            typer.echo(f"error: {where}{e}".splitlines()[0], err=True)
            raise typer.Exit(getattr(e, "exit_code", 2)) from None  # (a stop by a signal: 128 + its number)

    return wrapper


def print_table(rows: list[tuple], header: tuple) -> None:
    """Print rows as an aligned plain-text table."""
    cells = [tuple(str(c) for c in header)] + [tuple(_fmt(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for k, r in enumerate(cells):
        typer.echo("  ".join(c.rjust(w) if k and i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if k == 0:
            typer.echo("  ".join("-" * w for w in widths))


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.6g}"
    return str(x)


@app.command()
def version() -> None:
    """Print curvlab's version and the torch it runs on."""

    typer.echo(f"curvlab {curvlab.__version__} (torch {torch.__version__})")


@pcfg_app.command("generate")
@one_line_errors
def pcfg_generate(
    out: Path = typer.Option(..., help="Output directory (created; must be new or hold the same dataset)."),
    s: float = typer.Option(1.0, help="Zipf exponent of the training tokens inside each class."),
    tokens: str = typer.Option("20M", help="Training tokens, e.g. 20M, 500k."),
    val_tokens: str = typer.Option("1M", help="Validation tokens."),
    val_s: float = typer.Option(0.0, help="Zipf exponent of the validation tokens (the paper: 0)."),
    seed: int = typer.Option(0, help="Grammar seed."),
    shard_tokens: str = typer.Option("100M", help="Tokens per shard file."),
    depth: int = typer.Option(7, help="Grammar levels (root included)."),
    width: int = typer.Option(3, help="Nonterminals per level."),
    rule_s: float = typer.Option(0.0, help="Rule probabilities proportional to rank^-rule_s."),
) -> None:
    """Write train/validation shards, grammar.json and stats.json for a Zipf-PCFG language."""

    stats = generate_pcfg_dataset(
        out, s, tokens, val_tokens, val_s, seed, shard_tokens, {"depth": depth, "width": width, "rule_s": rule_s}
    )
    _print_pcfg_stats(stats)
    typer.echo(f"wrote {out}")


@pcfg_app.command("stats")
@one_line_errors
def pcfg_stats(data_dir: Path = typer.Argument(..., help="A directory written by `curvlab pcfg generate`.")) -> None:
    """Print a Zipf-PCFG data directory's statistics."""

    _print_pcfg_stats(read_stats(data_dir))


def _print_pcfg_stats(stats: dict) -> None:
    rows = [
        (split, st["s"], st["tokens"], st["sentences"], st["entropy_bits"], st["zipf_exponent_mean"])
        for split, st in ((k, stats[k]) for k in ("train", "val"))
    ]
    typer.echo(f"vocabulary: {stats['vocab_size']} tokens (separator included); config: {json.dumps(stats['config'])}")
    print_table(rows, ("split", "s", "tokens", "sentences", "entropy (bits)", "fitted Zipf exponent"))


def _key_values(pairs: list[str] | None, what: str) -> dict:
    """``["lr=0.01", "betas=[0.9,0.95]"]`` -> ``{"lr": 0.01, "betas": [0.9, 0.95]}`` (values parsed as JSON)."""
    out = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CurvlabError(f"{what} expects KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _train_default(name: str) -> str:
    """The :class:`TrainConfig` default of field ``name``, for --help: train's options default to None (so
    that only those given override the config file), which typer would show instead."""
    default = next(f.default for f in dataclasses.fields(TrainConfig) if f.name == name)
    return (name if default else f"no-{name}") if isinstance(default, bool) else str(default)


@app.command()
@one_line_errors
def train(
    data: Path = typer.Option(None, help="Data directory with train*/val* shards."),
    out: Path = typer.Option(None, help="Run directory (checkpoints, metrics.jsonl); an existing one is resumed."),
    model: str = typer.Option(
        None, help="Model config: tiny, pcfg-9m, gpt2-124m.", show_default=_train_default("model")
    ),
    optimizer: str = typer.Option(None, help="muon, adamw, sgd or lion.", show_default=_train_default("optimizer")),
    lr: float = typer.Option(
        None,
        help="Peak learning rate (Muon's for muon; its AdamW side: --opt adam_lr=...).",
        show_default="the optimizer's",
    ),
    opt: list[str] = typer.Option(None, help="Optimizer option KEY=VALUE, repeatable (e.g. momentum=0.9)."),
    model_opt: list[str] = typer.Option(None, help="Model config override KEY=VALUE, repeatable (e.g. n_layer=2)."),
    steps: int = typer.Option(None, help="Optimizer steps.", show_default=_train_default("steps")),
    batch_size: int = typer.Option(None, help="Sequences per step.", show_default=_train_default("batch_size")),
    seq_len: int = typer.Option(None, help="Tokens per sequence.", show_default="the model's block size"),
    warmup_steps: int = typer.Option(None, help="Linear warmup steps.", show_default=_train_default("warmup_steps")),
    schedule: str = typer.Option(
        None,
        help="wsd (warmup-stable-decay, which compare pairs in), cosine or constant.",
        show_default=_train_default("schedule"),
    ),
    cooldown_frac: float = typer.Option(
        None, help="Decaying share of steps for wsd.", show_default=_train_default("cooldown_frac")
    ),
    min_lr_frac: float = typer.Option(
        None, help="Schedule floor as a fraction of the peak.", show_default=_train_default("min_lr_frac")
    ),
    grad_clip: float = typer.Option(
        None, help="Gradient-norm clip; 0 disables.", show_default=_train_default("grad_clip")
    ),
    seed: int = typer.Option(None, help="Seed of initialization and data order.", show_default=_train_default("seed")),
    eval_every: int = typer.Option(None, help="Validation every N steps.", show_default=_train_default("eval_every")),
    ckpt_every: int = typer.Option(None, help="Checkpoint every N steps.", show_default=_train_default("ckpt_every")),
    val_windows: int = typer.Option(None, help="Fixed validation windows.", show_default=_train_default("val_windows")),
    device: str = typer.Option(None, help="auto, cpu, cuda, cuda:1, ...", show_default=_train_default("device")),
    compile: bool = typer.Option(
        None, "--compile/--no-compile", help="torch.compile the model.", show_default=_train_default("compile")
    ),
    shadow: bool = typer.Option(
        None,
        "--shadow/--no-shadow",
        help="Keep a shadow state of the other arm (adamw <-> muon).",
        show_default=_train_default("shadow"),
    ),
    config: Path = typer.Option(None, help="A JSON file of these fields; options given here override it."),
    quiet: bool = typer.Option(False, help="No progress bar."),
    curvature_every: int = typer.Option(
        0, help="Every K steps, the NDS and Taylor split of the step taken, on held-out windows, into metrics.jsonl."
    ),
    curvature_batches: int = typer.Option(1, help="Held-out batches of --curvature-windows validation windows."),
    curvature_windows: int = typer.Option(
        8, help="Windows per held-out batch. The defaults cost under 10% of training time at K = 50 on tiny."
    ),
    blocks: str = typer.Option(
        None, help="Also the within/cross split of this grouping: layer, tensor or kind (about 3x a row's cost)."
    ),
    curvature_stop: bool = typer.Option(False, help="Stop at a non-finite curvature row (else record it, go on)."),
    tensorboard: Path = typer.Option(
        None,
        help="Also write TensorBoard scalars here: train/val loss, lr, and the curvature rows "
        "(needs the tensorboard package: the curvlab extra of that name).",
    ),
    fsdp: bool = typer.Option(False, "--fsdp", help="Shard parameters and optimizer state with FSDP2 (torchrun)."),
) -> None:
    """Train a GPT with one optimizer, keeping checkpoints ready for curvature analysis.

    With --curvature-every K the run also records, every K steps, the curvature of the step it takes
    (NDS, Taylor split over all parameters and the hidden matrices, and with --blocks the within- and
    cross-layer NDS) on fixed validation windows: rows of kind "curvature" in metrics.jsonl, drawn by
    `curvlab track`. Training is the same, bit for bit, with or without it.
    """

    given = {
        "data": None if data is None else str(data),
        "out": None if out is None else str(out),
        "model": model,
        "optimizer": optimizer,
        "steps": steps,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "warmup_steps": warmup_steps,
        "schedule": schedule,
        "cooldown_frac": cooldown_frac,
        "min_lr_frac": min_lr_frac,
        "grad_clip": grad_clip,
        "seed": seed,
        "eval_every": eval_every,
        "ckpt_every": ckpt_every,
        "val_windows": val_windows,
        "device": device,
        "compile": compile,
        "shadow": shadow,
    }
    overrides = {k: v for k, v in given.items() if v is not None}
    if grad_clip == 0:  # 0 means "no clipping", which None can't say on a command line
        overrides["grad_clip"] = None
    options = {**_key_values(opt, "--opt"), **({} if lr is None else {"lr": lr})}
    if options:
        overrides["optimizer_options"] = options
    if model_opt:
        overrides["model_overrides"] = _key_values(model_opt, "--model-opt")
    cfg = TrainConfig.from_sources(config, overrides)
    check_output(cfg.out, directory=True)
    if tensorboard is not None:
        check_output(tensorboard, directory=True)
    monitor = None
    if curvature_every:
        monitor = MonitorSettings(curvature_every, curvature_batches, curvature_windows, blocks, curvature_stop)
    if fsdp and (monitor is not None or tensorboard is not None or cfg.shadow):
        raise CurvlabError("--curvature-every, --tensorboard and --shadow are not available with --fsdp yet")
    with distributed_context() as (rank, world):
        if fsdp:
            result = train_sharded(cfg, progress=not quiet)
        else:
            result = run_training(
                cfg, progress=not quiet, rank=rank, world=world, monitor=monitor, tensorboard=tensorboard
            )
    if rank == 0:
        resumed = f" (resumed from step {result.resumed_from})" if result.resumed_from else ""
        ranks = f" on {world} ranks" if world > 1 else ""
        typer.echo(
            f"trained {cfg.optimizer} to step {result.step}{resumed}{ranks}: val loss {result.val_loss:.4f}, "
            f"{result.tokens_per_second:.0f} tokens/s per rank; checkpoints in {result.out}"
        )


def _settings(blocks: str, batch: str, batches: int, dtype: str, block_method: str, hvp_method: str):

    settings = AnalysisSettings(
        blocks=blocks, batch=batch, batches=batches, dtype=dtype, block_method=block_method, hvp_method=hvp_method
    )
    settings.validate()
    return settings


BLOCKS_HELP = "Block grouping: layer, tensor or kind."
DATA_HELP = (
    "Data directory (default: the one a curvlab checkpoint was trained on, whose loader gives the next batch). "
    "nanoGPT and Trainer checkpoints don't save their sampler: their next batch is curvlab's own draw from "
    "DATA, seeded with the checkpoint's step; the report's next_batch records the seed and each row's offset."
)
CHECKPOINT_HELP = (
    "A curvlab checkpoint, a nanoGPT ckpt.pt, a Hugging Face Trainer checkpoint directory, a Lightning .ckpt or a "
    "torch.save'd state dict (all but curvlab's with --data; the last two with --config, --optimizer, --batch-size)."
)
CONFIG_HELP = (
    "Lightning and state-dict checkpoints: the model, a curvlab config name (tiny, pcfg-9m, gpt2-124m), a JSON "
    "file of GPTConfig fields, or a Hugging Face config.json (or its directory)."
)
OPTIMIZER_HELP = (
    "Lightning and state-dict checkpoints: the torch.optim class that wrote the optimizer state (adamw, sgd, ...), "
    "rebuilt with the saved hyperparameters; without a saved state, its fresh first step. Z is unclipped."
)
BATCH_HELP = "Evaluate G, H and the decrease on the next step's batch (train) or on validation windows (val)."
BATCHES_HELP = "Batches accumulated: train: the step's batch and the N-1 after it; val: the first N."
DIRECTIONS_HELP = (
    "Compare directions at the checkpoint instead (comma-separated: adamw, muon, sgd, sign): each one's NDS, "
    "cos(G,Z) and q = cos²/NDS at the same W, batch and H; they differ on the hidden matrices only. From an "
    "Adam state, muon is msign of Adam's first moment (an approximation) unless the run kept a shadow Muon; "
    "from a Muon state, adamw needs a shadow Adam. --out writes this record's JSON."
)
HVP_METHOD_HELP = "HVP method: rev_rev (double backward, fastest) or fwd_rev (jvp of grad, for ops without it)."


@app.command()
@one_line_errors
def nds(
    checkpoint: Path = typer.Argument(..., help=CHECKPOINT_HELP),
    blocks: str = typer.Option("layer", help=BLOCKS_HELP),
    batch: str = typer.Option("train", help=BATCH_HELP),
    batches: int = typer.Option(1, help=BATCHES_HELP),
    data: Path = typer.Option(None, help=DATA_HELP),
    out: Path = typer.Option(None, help="Write the report JSON here."),
    dtype: str = typer.Option("float32", help="float32 or float64."),
    block_method: str = typer.Option("hvp", help="hvp (one HVP per block) or alpha (Hessian in alpha)."),
    hvp_method: str = typer.Option("rev_rev", help=HVP_METHOD_HELP),
    device: str = typer.Option("cpu", help="Device for the analysis."),
    directions: str = typer.Option(None, help=DIRECTIONS_HELP),
    fsdp: bool = typer.Option(False, "--fsdp", help="CHECKPOINT is a sharded (DCP) directory: run sharded."),
    config: str = typer.Option(None, help=CONFIG_HELP),
    optimizer: str = typer.Option(None, help=OPTIMIZER_HELP),
    batch_size: int = typer.Option(
        None, help="Lightning and state-dict checkpoints: sequences in the next step's batch (curvlab's draw)."
    ),
) -> None:
    """NDS, Taylor split and block interaction matrix of a checkpoint's next update.

    Z is the optimizer's next step, with dropout off as for G and H (see --data for its batch).
    With --fsdp, under torchrun, the model is sharded by FSDP2 over the ranks (curvlab.analysis.sharded).
    """

    if out:
        check_output(out)  # before the analysis, not after it
    settings = _settings(blocks, batch, batches, dtype, block_method, hvp_method)
    rebuild = Rebuild(config, optimizer, batch_size)
    if fsdp and rebuild.given():
        raise CurvlabError("--config, --optimizer and --batch-size are for Lightning and state-dict checkpoints")
    if directions is not None:
        if fsdp:
            raise CurvlabError("--directions is not available with --fsdp yet")
        with distributed_context() as (rank, _):
            compared = checkpoint_directions(checkpoint, directions, settings, data, device, rebuild)
        if rank == 0:
            typer.echo(compared.text())
            if out:
                compared.save(out)
                typer.echo(f"wrote {out}")
        return
    with distributed_context() as (rank, _):
        if fsdp:
            report = analyze_sharded_checkpoint(checkpoint, settings, data, device)
        else:
            report = analyze_checkpoint(checkpoint, settings, data, device, rebuild)
    if rank != 0:
        return
    d = report.to_dict()
    val = "none recorded" if d["val_loss"] is None else f"{d['val_loss']:.4f}"
    typer.echo(f"{checkpoint}: step {d['step']}, optimizer {d['optimizer']}, val loss {val}")
    keys = ("nds", *(k for k in SCOPE_KEYS if k != "nds"))
    hidden = d["hidden"] or {}
    print_table([(k, d[k], hidden.get(k, "")) for k in keys], ("quantity", "all parameters", "hidden matrices"))
    b = d["blocks"]
    split = f"within {b['within']:.6g}, cross {b['cross']:.6g}, rho_within {b['rho_within']:.3f}"
    typer.echo(f"\nblocks ({b['grouping']}): {split}")
    rows = [
        (
            name,
            b["norm"][i],
            b["first_order"][i],
            b["matrix"][i][i],
            b["block_nds"][i] if b["block_nds"][i] is not None else "-",
        )
        for i, name in enumerate(b["names"])
    ]
    print_table(rows, ("block", "||Z_l||", "<G_l,Z_l>", "M[l,l]", "own NDS"))
    t = d["timing"]
    typer.echo(f"\n{t['seconds']:.2f} s, {t['hvp_seconds'] / t['seconds']:.0%} in Hessian-vector products")
    if out:
        report.save(out)
        typer.echo(f"wrote {out}")


@app.command()
@one_line_errors
def compare(
    run_a: Path = typer.Argument(..., help="First run directory."),
    run_b: Path = typer.Argument(..., help="Second run directory."),
    levels: int = typer.Option(
        MatchCriteria.levels, help="Matched validation-loss levels inside the range both runs reach."
    ),
    tolerance: float = typer.Option(
        MatchCriteria.tolerance, help="Largest relative validation-loss mismatch of a pair."
    ),
    phase: str = typer.Option(
        MatchCriteria.phase,
        help="Which checkpoints may pair: stable (both in the schedule's stable phase: train with --schedule wsd), "
        "multiplier (equal schedule multipliers) or any (matched loss alone, whatever the learning rate).",
    ),
    window: int = typer.Option(
        MatchCriteria.window, help="Average each level over this many neighbouring checkpoints on each side."
    ),
    out: Path = typer.Option(Path("compare"), help="Output directory (compare.csv, compare.json, reports/)."),
    blocks: str = typer.Option("layer", help=BLOCKS_HELP),
    batch: str = typer.Option("train", help=BATCH_HELP),
    batches: int = typer.Option(1, help=BATCHES_HELP),
    dtype: str = typer.Option("float32", help="float32 or float64."),
    hvp_method: str = typer.Option("rev_rev", help=HVP_METHOD_HELP),
    device: str = typer.Option("cpu", help="Device for the analysis."),
    quiet: bool = typer.Option(False, help="No progress bar."),
    fsdp: bool = typer.Option(
        False, "--fsdp", help="The runs' checkpoints are sharded (DCP, train --fsdp): analyse them sharded (torchrun)."
    ),
) -> None:
    """Compare two runs at matched validation loss: NDS, first-order gain, curvature penalty, update norm.

    With --fsdp, under torchrun on as many ranks as wrote the checkpoints, each is analysed sharded.
    """

    settings = _settings(blocks, batch, batches, dtype, "hvp", hvp_method)
    criteria = MatchCriteria(levels=levels, tolerance=tolerance, phase=phase, window=window)
    criteria.validate()
    check_output(out, directory=True)
    with distributed_context() as (rank, _):
        result = compare_runs(
            run_a, run_b, out, criteria, settings, device=device, progress=not quiet and rank == 0, fsdp=fsdp
        )
    if rank != 0:
        return
    for message in result.refused:
        typer.echo(f"refused {message}", err=True)
    rows = [(r["target"], r["step_a"], r["step_b"], *(r[f"ratio_{k}"] for k in RATIO_KEYS)) for r in result.rows]
    typer.echo(f"ratios {result.ratio_label} at matched validation loss:")
    print_table(rows, ("val loss", "step A", "step B", *RATIO_KEYS))
    typer.echo("mean: " + ", ".join(f"{k} {v:.3f}" for k, v in result.mean_ratios.items()))
    typer.echo(f"wrote {out / 'compare.csv'} and {out / 'compare.json'}")


@app.command()
@one_line_errors
def track(
    run: Path = typer.Argument(..., help="A run directory."),
    every: int = typer.Option(1, help="Analyse every N-th checkpoint (or draw every N-th monitor row)."),
    out: Path = typer.Option(None, help="Output directory (default: RUN/track)."),
    blocks: str = typer.Option("layer", help=BLOCKS_HELP),
    batch: str = typer.Option("train", help=BATCH_HELP),
    batches: int = typer.Option(1, help=BATCHES_HELP),
    dtype: str = typer.Option("float32", help="float32 or float64."),
    spectrum: int = typer.Option(0, help="Also λ_max and the top-K eigenvalues at each checkpoint (K > 0)."),
    hvp_method: str = typer.Option("rev_rev", help=HVP_METHOD_HELP),
    device: str = typer.Option("cpu", help="Device for the analysis."),
    quiet: bool = typer.Option(False, help="No progress bar."),
    source: str = typer.Option(
        "auto",
        help="monitor: draw the rows `train --curvature-every` recorded (no checkpoint needed, nothing "
        "recomputed); checkpoints: analyse the checkpoints; auto: monitor rows when the run has any.",
    ),
    fsdp: bool = typer.Option(
        False, "--fsdp", help="The run's checkpoints are sharded (DCP, train --fsdp): analyse them sharded (torchrun)."
    ),
) -> None:
    """Curvature along a run's trajectory: NDS, within- and cross-layer NDS, rho_within (and λ_max).

    With --fsdp, under torchrun on as many ranks as wrote the checkpoints, each is analysed sharded.
    """

    out = out or run / "track"
    check_output(out, directory=True)
    if fsdp and spectrum:
        raise CurvlabError(
            "--spectrum is not available with --fsdp yet "
            "(from Python: curvlab.curvature.sharded_spectral.sharded_lanczos)"
        )
    if track_source(run, source) == "monitor":
        _track_monitor(run, out, every)
        return
    settings = AnalysisSettings(blocks, batch, batches, dtype, "hvp", hvp_method, spectrum_top=spectrum)
    with distributed_context() as (rank, _):
        rows = track_run(run, out, settings, every=every, device=device, progress=not quiet and rank == 0, fsdp=fsdp)
    if rank != 0:
        return
    keys = ("step", "val_loss", "nds", "within", "cross", "rho_within", "update_norm")
    keys += ("lambda_max", "overlap_top_k") if spectrum else ()
    print_table([tuple(r.to_dict().get(k) for k in keys) for r in rows], keys)
    written = [out / "track.csv", out / "track.json"]
    if spectrum:
        written += lambda_max_along_run({rows[0].optimizer: rows}, out / "lambda_max_vs_nds")
    typer.echo("wrote " + ", ".join(map(str, written)))


def _track_monitor(run: Path, out: Path, every: int) -> None:

    rows = track_monitor(run, out, every)
    keys = ("step", "val_loss", "status", "nds", "hidden_nds", "predicted", "realized", "within", "cross", "rho_within")
    print_table([tuple(r.to_dict().get(k, "-") for k in keys) for r in rows], keys)
    for r in rows:
        if r.message:
            typer.echo(f"step {r.step}: {r.message}", err=True)
    name = rows[0].optimizer or run.name
    written = [out / "track.csv", out / "track.json"]
    written += curvature_during_training({name: rows}, out / "curvature_during_training")
    typer.echo("wrote " + ", ".join(map(str, written)))


@app.command()
@one_line_errors
def spectrum(
    checkpoint: Path = typer.Argument(..., help=CHECKPOINT_HELP),
    top: int = typer.Option(5, help="Largest eigenvalues (Lanczos)."),
    bottom: int = typer.Option(0, help="Smallest eigenvalues."),
    trace: bool = typer.Option(False, help="Trace by Hutchinson and Hutch++."),
    density: bool = typer.Option(False, help="Spectral density by stochastic Lanczos quadrature (and its figure)."),
    blocks: str = typer.Option(None, help="Also λ_max of each block of this grouping (layer, tensor, kind)."),
    preconditioned: bool = typer.Option(False, help="Adam's preconditioned sharpness (AdamW checkpoints)."),
    batch: str = typer.Option("train", help=BATCH_HELP),
    batches: int = typer.Option(1, help=BATCHES_HELP),
    data: Path = typer.Option(None, help="Data directory (default: the checkpoint's)."),
    max_iter: int = typer.Option(100, help="Lanczos iterations at most (HVPs)."),
    memory: float = typer.Option(
        None, help="GB the stored Lanczos vectors may take (thick restart beyond); default: unbounded."
    ),
    method: str = typer.Option(DEFAULT_METHOD, "--hvp-method", help=HVP_METHOD_HELP),
    out: Path = typer.Option(None, help="Output directory for spectrum.json (and the density figure)."),
    dtype: str = typer.Option("float32", help="float32 or float64."),
    device: str = typer.Option("cpu", help="Device."),
) -> None:
    """The Hessian spectrum at a checkpoint: extreme eigenvalues, trace, density, block and preconditioned sharpness.

    Under torchrun the ranks share the batches (--batches N, N >= the ranks); rank 0 prints and writes.
    """

    settings = AnalysisSettings(batch=batch, batches=batches, dtype=dtype, hvp_method=method)
    settings.validate()
    request = SpectrumRequest(
        top=top,
        bottom=bottom,
        trace=trace,
        density=density,
        blocks=blocks,
        preconditioned=preconditioned,
        max_iter=max_iter,
        memory=None if memory is None else int(memory * 1e9),
    )
    request.validate()
    if out:
        check_output(out, directory=True)
    with distributed_context() as (rank, _):
        result = checkpoint_spectrum(checkpoint, request, settings, data=data, device=device)
        written = write_spectrum(result, out) if out else []
    if rank != 0:
        return
    rows = []
    for key, r in (("top", result.top), ("bottom", result.bottom)):
        if r is not None:
            rows += [(key, f"{v:.6g}", f"{res:.2g}", r.converged) for v, res in zip(r.eigenvalues, r.residuals)]
    for name, r in (result.blocks or {}).items():
        rows.append((f"λ_max {name}", f"{r.eigenvalues[0]:.6g}", f"{r.residuals[0]:.2g}", r.converged))
    if result.preconditioned is not None:
        p, r = result.preconditioned, result.preconditioned.eigen
        rows.append(("P^-1/2 H P^-1/2", f"{r.eigenvalues[0]:.6g}", f"{r.residuals[0]:.2g}", r.converged))
        rows.append((f"(2+2β1)/((1-β1)lr), β1={p.beta1:g}", f"{p.edge_of_stability:.6g}", "", ""))
    print_table(rows, ("what", "eigenvalue", "residual", "converged"))
    for name, t in result.traces().items():
        typer.echo(f"trace ({name}): {t.trace:.6g} ± {t.std_error:.2g} ({t.num_matvecs} HVPs)")
    if written:
        typer.echo("wrote " + ", ".join(map(str, written)))


@app.command()
@one_line_errors
def quadratic(
    out: Path = typer.Option(Path("results/quadratic"), help="Output directory (quadratic.json and figures)."),
    steps: int = typer.Option(30, help="Line-search steps of the worked example."),
    d: int = typer.Option(128, help="Matrix size d1 = d2 of the worked example."),
    q: int = typer.Option(88, help="Paired modes."),
    m: int = typer.Option(8, help="High-curvature modes."),
    w_high: float = typer.Option(100.0, "--w-high", help="w_H."),
    w_low: float = typer.Option(1.0, "--w-low", help="w_L."),
    sigma_high: float = typer.Option(3.0, "--sigma-high", help="σ_H."),
    sigma_low: float = typer.Option(1.0, "--sigma-low", help="σ_L."),
    sweep_steps: int = typer.Option(20, help="Steps T of the phase sweep."),
    outside_theorem: bool = typer.Option(False, help="Allow an example that breaks the theorem's assumptions."),
) -> None:
    """The stylized Kronecker quadratic model: the worked example and the phase sweep, with figures."""

    check_output(out, directory=True)
    spec = TwoLevelSpec(d, d, q, m, w_high, w_low, sigma_high, sigma_low)
    study = quadratic_study(spec, steps=steps, sweep_steps=sweep_steps, outside_theorem=outside_theorem)
    paths = write_quadratic(study, out)
    closed = study.closed_forms
    rows = [
        (name, traj.loss[-1] - closed.optimal_loss, float(np.mean(traj.nds)), traj.lr or "line search")
        for name, traj in study.trajectories.items()
    ]
    print_table(rows, ("method", "final gap", "mean NDS", "step size"))
    typer.echo(
        f"closed forms: Muon NDS {closed.muon_nds:.6g}, Muon Γ² {closed.muon_contraction:.6f}, "
        f"GD two-step {closed.gd_two_step_contraction:.6f}; theorem condition holds: {closed.theorem_condition}"
    )
    typer.echo("wrote " + ", ".join(map(str, paths)))


@app.command()
@one_line_errors
def reproduce(
    preset: str = typer.Option(
        "quick",
        help="micro (seconds), quick (CPU, ~11 min: AdamW and Muon, 6 seeds, s = 0), standard (CPU, ~75 min: "
        "8 seeds, 4412 tokens, the Zipf sweep, the control arm), paper (GPU) or robustness (CPU: the paired "
        "ratio at 9 settings of quick's design, 3 seeds each).",
    ),
    out: Path = typer.Option(None, help="Output directory; a re-run continues it.", show_default="results/<preset>"),
    fineweb: Path = typer.Option(None, help="FineWeb shards for the paper preset (train*/val*.bin)."),
    quiet: bool = typer.Option(False, help="No progress bars."),
) -> None:
    """The whole reproduction: data, tuning, training, paired directions and matched-loss analysis, A/A
    calibration, quadratic model, figures, report.md; prints the primary family."""

    if preset not in PRESETS and preset not in ROBUSTNESS_PRESETS:
        raise CurvlabError(f"unknown preset {preset!r}; choose one of {', '.join([*PRESETS, *ROBUSTNESS_PRESETS])}")
    out = out or Path("results") / preset
    check_output(out, directory=True)
    if preset in ROBUSTNESS_PRESETS:
        if fineweb is not None:
            raise CurvlabError("--fineweb is the paper preset's; the robustness design trains on its own grammar")
        result = Robustness(ROBUSTNESS_PRESETS[preset], out, progress=not quiet).run()
        for x in result.settings:
            ci = "" if x.ci95 is None else f" [{x.ci95[0]:.3g}, {x.ci95[1]:.3g}]"
            value = "not measured" if x.paired_ratio is None else f"{x.paired_ratio:.3g}{ci}"
            typer.echo(f"{x.label}: paired ratio {value}, {x.verdict}; controls passed: {x.controls_passed}")
        typer.echo(f"finished in {result.seconds:.0f} s; report: {out / 'report.md'}")
        return
    summary = Reproduction(PRESETS[preset], out, fineweb, progress=not quiet).run()
    for line in primary_table(summary.primary):
        typer.echo(line)
    typer.echo(calibration_line(summary.calibration))
    typer.echo(f"finished in {summary.seconds:.0f} s; report: {out / 'report.md'}")


@app.command()
@one_line_errors
def finetune(
    preset: str = typer.Option(
        "quick",
        help="micro (seconds), quick (one thread, ~7 min: 3 seeds, 4-point grids), standard (5-point grids x 2 seeds).",
    ),
    out: Path = typer.Option(
        None, help="Output directory (default: results/finetune-<preset>); a re-run continues it."
    ),
    base: Path = typer.Option(
        None, help="Reuse a pretrained run directory (its last checkpoint) or checkpoint instead of pretraining."
    ),
    data: Path = typer.Option(None, help="The s = 1 adaptation data (default: generated with the base's grammar)."),
    rank: int = typer.Option(None, help="LoRA rank, alpha = 2 rank (default: the preset's; quick 4, standard 8)."),
    seeds: int = typer.Option(None, help="Seeds per optimizer (default: the preset's, 3)."),
    quiet: bool = typer.Option(False, help="No progress bars."),
) -> None:
    """LoRA fine-tuning at s = 1 of a model pretrained at s = 0, under sMuon, LoRA-Muon, per-factor Muon and
    AdamW (each lr tuned alike): NDS and Taylor split of the adapter steps at matched validation loss."""

    if rank is not None and rank < 1:
        raise CurvlabError(f"--rank must be >= 1, got {rank}")
    chosen = with_preset(preset, rank=rank, seeds=seeds)
    out = out or Path("results") / f"finetune-{preset}"
    check_output(out, directory=True)
    result = Finetune(chosen, out, base, data, progress=not quiet).run()
    for line in finetune_table(result):
        typer.echo(line)
    typer.echo(f"finished in {result.timing['total']:.0f} s; results: {out / 'finetune.json'}")


@app.command("readme-results")
@one_line_errors
def readme_results(
    results: Path = typer.Argument(..., help="A reproduction's output directory (with summary.json)."),
    readme: Path = typer.Option(Path("README.md"), help="The README whose results section is rewritten."),
    figures: Path = typer.Option(Path("docs/results"), help="Where the figures the README shows are copied."),
    note: str = typer.Option("", help="A sentence to add after the timing line (e.g. how the machine was shared)."),
    page: Path = typer.Option(Path("docs/results.md"), help="The whole results page (rewritten)."),
    rerun: Path | None = typer.Option(None, help="A rerun's output directory: add the rerun-agreement table."),
) -> None:
    """Regenerate the README's results section (the primary family) and the whole results page (caveats,
    descriptive quantities, figures) from a reproduction's summary.json."""

    update_readme(results, readme, figures, note, page, rerun)
    typer.echo(f"rewrote the results section of {readme} and {page}; figures in {figures}")


@app.command("robustness-page")
@one_line_errors
def robustness_page(
    results: Path = typer.Argument(..., help="A robustness design's output directory (with summary.json)."),
    docs: Path = typer.Option(
        Path("docs/results/robustness"), help="Where summary.json, levels.json and the figure are copied."
    ),
    page: Path = typer.Option(Path("docs/results-robustness.md"), help="The page (rewritten)."),
    reference: Path | None = typer.Option(
        Path("docs/results/quick/summary.json"), help="A reproduction's summary.json, quoted beside the settings."
    ),
) -> None:
    """Publish a robustness design: its summary.json, levels.json and figure into DOCS, and its page."""

    publish_robustness(results, docs, page, reference)
    typer.echo(f"wrote {page}; summary, levels and figure in {docs}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
