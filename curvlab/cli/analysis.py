"""The analysis commands: ``nds`` (one checkpoint), ``compare`` (two runs at matched loss), ``track`` (one run
along its trajectory) and ``spectrum`` (the Hessian spectrum at a checkpoint). Under torchrun every rank
computes and rank 0 prints."""

from __future__ import annotations

from pathlib import Path

import typer

from curvlab.analysis.checkpoint import checkpoint_analysis
from curvlab.analysis.direction_report import DirectionReport
from curvlab.analysis.estimate import checkpoint_estimate
from curvlab.analysis.spectrum import SpectrumRequest, checkpoint_spectrum
from curvlab.analysis.targets import AnalysisSettings
from curvlab.cli.errors import one_line_errors
from curvlab.cli.options import count, positive, refuse_beyond_memory
from curvlab.curvature.estimators import ESTIMATORS
from curvlab.engine.hvp import DEFAULT_METHOD
from curvlab.errors import CurvlabError
from curvlab.output.console import (
    comparison_text,
    directions_report_text,
    estimate_text,
    refusals,
    report_text,
    spectrum_text,
    track_messages,
    track_table,
    wrote,
)
from curvlab.output.files import write_spectrum
from curvlab.output.plots import track_figures
from curvlab.runs.foreign import Rebuild
from curvlab.runs.match import MatchCriteria
from curvlab.studies.compare import compare_runs
from curvlab.studies.track import track as track_trajectory
from curvlab.util.atomic import check_output
from curvlab.util.distributed import distributed_context

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
METHOD_HELP = "HVP method: rev_rev (double backward, fastest) or fwd_rev (jvp of grad, for ops without it)."
BLOCK_METHOD_HELP = "hvp (one HVP per block) or alpha (Hessian in alpha)."
DTYPE_HELP = "float32 or float64."
# What each matched level holds at the least while the runs are matched (its target, its reach, the line that
# says why it found no pair): --levels past the checkpoints all find none, each with its line
LEVEL_BYTES = 250


@one_line_errors
def nds(
    checkpoint: Path = typer.Argument(..., help=CHECKPOINT_HELP),
    blocks: str = typer.Option("layer", help=BLOCKS_HELP),
    batch: str = typer.Option("train", help=BATCH_HELP),
    batches: int = count(1, help=BATCHES_HELP),
    data: Path = typer.Option(None, help=DATA_HELP),
    out: Path = typer.Option(None, help="Write the report JSON here."),
    dtype: str = typer.Option("float32", help=DTYPE_HELP),
    block_method: str = typer.Option("hvp", help=BLOCK_METHOD_HELP),
    method: str = typer.Option(DEFAULT_METHOD, help=METHOD_HELP),
    device: str = typer.Option("cpu", help="Device for the analysis."),
    directions: str = typer.Option(None, help=DIRECTIONS_HELP),
    fsdp: bool = typer.Option(False, "--fsdp", help="CHECKPOINT is a sharded (DCP) directory: run sharded."),
    config: str = typer.Option(None, help=CONFIG_HELP),
    optimizer: str = typer.Option(None, help=OPTIMIZER_HELP),
    batch_size: int = count(
        None, help="Lightning and state-dict checkpoints: sequences in the next step's batch (curvlab's draw)."
    ),
    gauss_newton: bool = typer.Option(
        False, "--gauss-newton", help="Split the AdamW and Muon directions' NDS into Gauss–Newton part and residual."
    ),
    estimator: str = typer.Option(
        "exact", help=f"{' | '.join(ESTIMATORS)}: another than exact estimates Z's NDS alone, with its error and cost."
    ),
) -> None:
    """NDS, Taylor split and block interaction matrix of a checkpoint's next update.

    Z is the optimizer's next step, with dropout off as for G and H (see --data for its batch).
    With --fsdp, under torchrun, the model is sharded by FSDP2 over the ranks (curvlab.analysis.sharded).
    """

    if out:
        check_output(out)  # before the analysis, not after it
    settings = AnalysisSettings(
        blocks=blocks, batch=batch, batches=batches, dtype=dtype, block_method=block_method, method=method,
        gauss_newton=gauss_newton,
    )  # fmt: skip
    rebuild = Rebuild(config=config, optimizer=optimizer, batch_size=batch_size)
    if estimator != "exact":
        if directions or fsdp or gauss_newton:
            raise CurvlabError("--estimator estimates the real step's NDS alone: not with --directions, --fsdp or "
                               "--gauss-newton")  # fmt: skip
        report = checkpoint_estimate(checkpoint, estimator, settings, data=data, device=device, rebuild=rebuild)
        return _echo_and_save(estimate_text(report), report, out)
    with distributed_context() as (rank, _):
        report = checkpoint_analysis(
            checkpoint, settings, data=data, device=device, rebuild=rebuild, directions=directions, fsdp=fsdp
        )
    if rank != 0:
        return
    text = directions_report_text(report) if isinstance(report, DirectionReport) else report_text(report, checkpoint)
    _echo_and_save(text, report, out)


def _echo_and_save(text: str, report, out: Path | None) -> None:
    typer.echo(text)
    if out:
        report.save(out)
        typer.echo(f"wrote {out}")


@one_line_errors
def compare(
    run_a: Path = typer.Argument(..., help="First run directory."),
    run_b: Path = typer.Argument(..., help="Second run directory."),
    levels: int = count(MatchCriteria.levels, help="Matched validation-loss levels inside the range both runs reach."),
    tolerance: float = positive(MatchCriteria.tolerance, help="Largest relative validation-loss mismatch of a pair."),
    phase: str = typer.Option(
        MatchCriteria.phase,
        help="Which checkpoints may pair: stable (both in the schedule's stable phase: train with --schedule wsd), "
        "multiplier (equal schedule multipliers) or any (matched loss alone, whatever the learning rate).",
    ),
    window: int = count(
        MatchCriteria.window, low=0, help="Average each level over this many neighbouring checkpoints on each side."
    ),
    out: Path = typer.Option(Path("compare"), help="Output directory (compare.csv, compare.json, reports/)."),
    blocks: str = typer.Option("layer", help=BLOCKS_HELP),
    batch: str = typer.Option("train", help=BATCH_HELP),
    batches: int = count(1, help=BATCHES_HELP),
    dtype: str = typer.Option("float32", help=DTYPE_HELP),
    block_method: str = typer.Option("hvp", help=BLOCK_METHOD_HELP),
    method: str = typer.Option(DEFAULT_METHOD, help=METHOD_HELP),
    device: str = typer.Option("cpu", help="Device for the analysis."),
    quiet: bool = typer.Option(False, help="No progress bar."),
    fsdp: bool = typer.Option(
        False, "--fsdp", help="The runs' checkpoints are sharded (DCP, train --fsdp): analyse them sharded (torchrun)."
    ),
) -> None:
    """Compare two runs at matched validation loss: NDS, first-order gain, curvature penalty, update norm.

    With --fsdp, under torchrun on as many ranks as wrote the checkpoints, each is analysed sharded.
    """

    settings = AnalysisSettings(
        blocks=blocks, batch=batch, batches=batches, dtype=dtype, block_method=block_method, method=method
    )
    settings.validate()
    criteria = MatchCriteria(levels=levels, tolerance=tolerance, phase=phase, window=window)
    criteria.validate()
    refuse_beyond_memory(levels * LEVEL_BYTES, f"--levels {levels}")
    check_output(out, directory=True)
    with distributed_context() as (rank, _):
        result = compare_runs(
            run_a, run_b, out, criteria=criteria, settings=settings, device=device,
            progress=not quiet and rank == 0, fsdp=fsdp,
        )  # fmt: skip
    if rank != 0:
        return
    for line in refusals(result):
        typer.echo(line, err=True)
    typer.echo(comparison_text(result, out))


@one_line_errors
def track(
    run: Path = typer.Argument(..., help="A run directory."),
    every: int = count(1, help="Analyse every N-th checkpoint (or draw every N-th monitor row)."),
    out: Path = typer.Option(None, help="Output directory (default: RUN/track)."),
    blocks: str = typer.Option("layer", help=BLOCKS_HELP),
    batch: str = typer.Option("train", help=BATCH_HELP),
    batches: int = count(1, help=BATCHES_HELP),
    dtype: str = typer.Option("float32", help=DTYPE_HELP),
    spectrum: int = count(0, low=0, help="Also λ_max and the top-K eigenvalues at each checkpoint (K > 0)."),
    block_method: str = typer.Option("hvp", help=BLOCK_METHOD_HELP),
    method: str = typer.Option(DEFAULT_METHOD, help=METHOD_HELP),
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
    settings = AnalysisSettings(
        blocks=blocks, batch=batch, batches=batches, dtype=dtype, block_method=block_method, method=method,
        spectrum_top=spectrum,
    )  # fmt: skip
    with distributed_context() as (rank, _):
        tracked = track_trajectory(
            run, out, settings, source=source, every=every, device=device, progress=not quiet and rank == 0,
            fsdp=fsdp,
        )  # fmt: skip
    if rank != 0:
        return
    typer.echo(track_table(tracked, spectrum=bool(spectrum)))
    for line in track_messages(tracked):
        typer.echo(line, err=True)
    figures = track_figures(tracked, run, out, spectrum=bool(spectrum))
    typer.echo(wrote([out / "track.csv", out / "track.json", *figures]))


@one_line_errors
def spectrum(
    checkpoint: Path = typer.Argument(..., help=CHECKPOINT_HELP),
    top: int = count(5, low=0, help="Largest eigenvalues (Lanczos)."),
    bottom: int = count(1, low=0, help="Smallest eigenvalues (λ_min and up; 0: none)."),
    trace: bool = typer.Option(False, help="Trace by Hutchinson and Hutch++."),
    density: bool = typer.Option(False, help="Spectral density by stochastic Lanczos quadrature (and its figure)."),
    blocks: str = typer.Option(None, help="Also λ_max of each block of this grouping (layer, tensor, kind)."),
    preconditioned: bool = typer.Option(False, help="Adam's preconditioned sharpness (AdamW checkpoints)."),
    batch: str = typer.Option("train", help=BATCH_HELP),
    batches: int = count(1, help=BATCHES_HELP),
    data: Path = typer.Option(None, help="Data directory (default: the checkpoint's)."),
    max_iter: int = count(100, help="Lanczos iterations at most (HVPs)."),
    memory: float = positive(
        None, help="GB the stored Lanczos vectors may take (thick restart beyond); default: unbounded."
    ),
    method: str = typer.Option(DEFAULT_METHOD, help=METHOD_HELP),
    out: Path = typer.Option(None, help="Output directory for spectrum.json (and the density figure)."),
    dtype: str = typer.Option("float32", help=DTYPE_HELP),
    device: str = typer.Option("cpu", help="Device."),
) -> None:
    """The Hessian spectrum at a checkpoint: extreme eigenvalues, trace, density, block and preconditioned sharpness.

    Under torchrun the ranks share the batches (--batches N, N >= the ranks); rank 0 prints and writes.
    """

    settings = AnalysisSettings(batch=batch, batches=batches, dtype=dtype, method=method)
    settings.validate()
    request = SpectrumRequest(
        top=top, bottom=bottom, trace=trace, density=density, blocks=blocks, preconditioned=preconditioned,
        max_iter=max_iter, memory=None if memory is None else int(memory * 1e9),
    )  # fmt: skip
    request.validate()
    if memory is not None:  # a budget the device can't hold is no bound
        refuse_beyond_memory(request.memory, f"--memory {memory:g}", device)
    if out:
        check_output(out, directory=True)
    with distributed_context() as (rank, _):
        result = checkpoint_spectrum(checkpoint, request=request, settings=settings, data=data, device=device)
        written = write_spectrum(result, out) if out else []
    if rank != 0:
        return
    typer.echo(spectrum_text(result))
    if written:
        typer.echo(wrote(written))
