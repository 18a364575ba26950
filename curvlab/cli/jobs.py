"""The whole studies and what publishes them: ``quadratic`` (the stylized model), ``reproduce`` (the
reproduction, the robustness design or a scaling ladder), ``finetune`` (LoRA), ``readme-results``,
``robustness-page``, ``scaling-page`` and ``long-page``."""

from __future__ import annotations

from pathlib import Path

import typer

from curvlab.cli.errors import one_line_errors
from curvlab.cli.options import count, positive, refuse_beyond_memory, require_extras
from curvlab.errors import CurvlabError
from curvlab.jobs.finetune import Finetune
from curvlab.jobs.long import Long
from curvlab.jobs.presets import LONG_PRESETS, PRESETS, ROBUSTNESS_PRESETS, SCALING_PRESETS, with_preset
from curvlab.jobs.reproduce import Reproduction, on_user_data
from curvlab.jobs.robustness import Robustness
from curvlab.jobs.scaling import Scaling
from curvlab.output.console import (
    finetune_text,
    long_text,
    quadratic_text,
    reproduction_text,
    robustness_text,
    scaling_text,
    wrote,
)
from curvlab.output.files import write_quadratic
from curvlab.output.long_page import publish_long
from curvlab.output.robustness_page import publish_robustness
from curvlab.output.scaling_page import publish_scaling
from curvlab.output.text import update_readme
from curvlab.theory.quadratic import quadratic_study
from curvlab.theory.quadratic_model import TwoLevelSpec
from curvlab.util.atomic import check_output

# What the quadratic study holds at the least per entry of a d x d matrix: about 50 float64 matrices of that
# size live at once (456 bytes an entry measured at d = 256 to 768, whatever the steps)
QUADRATIC_BYTES_PER_ENTRY = 400


@one_line_errors
def quadratic(
    out: Path = typer.Option(Path("results/quadratic"), help="Output directory (quadratic.json and figures)."),
    steps: int = count(30, help="Line-search steps of the worked example."),
    d: int = count(128, help="Matrix size d1 = d2 of the worked example."),
    q: int = count(88, help="Paired modes."),
    m: int = count(8, help="High-curvature modes."),
    w_high: float = positive(100.0, "--w-high", help="w_H."),
    w_low: float = positive(1.0, "--w-low", help="w_L."),
    sigma_high: float = positive(3.0, "--sigma-high", help="σ_H."),
    sigma_low: float = positive(1.0, "--sigma-low", help="σ_L."),
    sweep_steps: int = count(20, help="Steps T of the phase sweep."),
    outside_theorem: bool = typer.Option(False, help="Allow an example that breaks the theorem's assumptions."),
) -> None:
    """The stylized Kronecker quadratic model: the worked example and the phase sweep, with figures."""

    spec = TwoLevelSpec(d1=d, d2=d, q=q, m=m, w_H=w_high, w_L=w_low, sigma_H=sigma_high, sigma_L=sigma_low)
    refuse_beyond_memory(QUADRATIC_BYTES_PER_ENTRY * d * d, f"--d {d}")
    check_output(out, directory=True)
    study = quadratic_study(spec, steps=steps, sweep_steps=sweep_steps, outside_theorem=outside_theorem)
    paths = write_quadratic(study, out)
    typer.echo(quadratic_text(study))
    typer.echo(wrote(paths))


@one_line_errors
def reproduce(
    preset: str = typer.Option(
        "quick",
        help="micro (seconds), quick (CPU, ~10 min: AdamW and Muon, 6 seeds, s = 0), standard (CPU, ~75 min: "
        "8 seeds, 4412 tokens, the Zipf sweep, the control arm), mechanism (CPU: quick's design with the "
        "factorial of filters and maps at every point), paper (GPU), robustness (CPU: the paired ratio at 9 "
        "settings of quick's design, 3 seeds each), scaling (CPU, ~2 h: the ratios at 6 model sizes, 0.2M-3.2M "
        "non-embedding, and their power laws), scaling-gpu (7 sizes, to the paper's 9M Zipf model), long (CPU: "
        "1500 steps at s = 0 and 1, 6 seeds, the paper's observations 3 and 4 by third of training) or text (CPU: "
        "quick's design on the text of the Python documentation).",
    ),
    out: Path = typer.Option(None, help="Output directory; a re-run continues it.", show_default="results/<preset>"),
    fineweb: Path = typer.Option(None, help="FineWeb shards for the paper preset (train*/val*.bin)."),
    data: Path = typer.Option(
        None, help="Your data directory (curvlab data text) in place of the grammar: a one-s design, tuned afresh."
    ),
    quiet: bool = typer.Option(False, help="No progress bars."),
) -> None:
    """The whole reproduction: data, tuning, training, paired directions and matched-loss analysis, A/A
    calibration, quadratic model, figures, report.md; prints the primary family."""

    designs = {**PRESETS, **ROBUSTNESS_PRESETS, **SCALING_PRESETS, **LONG_PRESETS}
    if preset not in designs:
        raise CurvlabError(f"unknown preset {preset!r}; choose one of {', '.join(designs)}")
    design = designs[preset]
    if preset not in PRESETS and data is not None:
        raise CurvlabError(f"--data is for the one-design presets ({', '.join(PRESETS)}), not the {preset} design yet")
    if data is not None:  # (checked now, and a corpus it replaces needs no tokenizer)
        design = on_user_data(design, data)
    require_extras(design.extras, f"reproduce --preset {preset}")
    out = out or Path("results") / preset
    check_output(out, directory=True)
    if preset not in PRESETS and fineweb is not None:
        raise CurvlabError(f"--fineweb is the paper preset's; the {preset} design trains on its own grammar")
    if preset in ROBUSTNESS_PRESETS:
        typer.echo(robustness_text(Robustness(design, out, progress=not quiet).run(), out))
        return
    if preset in SCALING_PRESETS:
        typer.echo(scaling_text(Scaling(design, out, progress=not quiet).run(), out))
        return
    if preset in LONG_PRESETS:
        typer.echo(long_text(Long(design, out, progress=not quiet).run(), out))
        return
    job = Reproduction(design, out, fineweb=fineweb, progress=not quiet, data=data)
    typer.echo(reproduction_text(job.run(), out))


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
    rank: int = count(None, help="LoRA rank, alpha = 2 rank (default: the preset's; quick 4, standard 8)."),
    seeds: int = count(None, help="Seeds per optimizer (default: the preset's, 3)."),
    quiet: bool = typer.Option(False, help="No progress bars."),
) -> None:
    """LoRA fine-tuning at s = 1 of a model pretrained at s = 0, under sMuon, LoRA-Muon, per-factor Muon and
    AdamW (each lr tuned alike): NDS and Taylor split of the adapter steps at matched validation loss."""

    chosen = with_preset(preset, rank=rank, seeds=seeds)
    require_extras(chosen.extras, "finetune")
    out = out or Path("results") / f"finetune-{preset}"
    check_output(out, directory=True)
    result = Finetune(chosen, out, base=base, data=data, progress=not quiet).run()
    typer.echo(finetune_text(result, out))


@one_line_errors
def readme_results(
    results: Path = typer.Argument(..., help="A reproduction's output directory (with summary.json)."),
    readme: Path = typer.Option(Path("README.md"), help="The README whose results section is rewritten."),
    figures: Path = typer.Option(Path("docs/results"), help="Where the figures the README shows are copied."),
    note: str = typer.Option("", help="A sentence to add after the timing line (e.g. how the machine was shared)."),
    page: Path | None = typer.Option(
        None, help="The whole results page (rewritten). [default: docs/results.md; with --page-only, required]"
    ),
    rerun: Path | None = typer.Option(None, help="A rerun's output directory: add the rerun-agreement table."),
    page_only: bool = typer.Option(
        False, help="Write the page alone, leaving the README (a design it has no section for: mechanism)."
    ),
) -> None:
    """Regenerate the README's results section (the primary family) and the whole results page (caveats,
    descriptive quantities, figures) from a reproduction's summary.json; with --page-only, the page alone."""
    if page_only and page is None:  # (the default page is quick's: a page-only design must name its own)
        raise CurvlabError("--page-only needs --page, the design's own page (e.g. docs/results-mechanism.md)")
    page = page or Path("docs/results.md")
    update_readme(results, readme=None if page_only else readme, figures=figures, note=note, page=page, rerun=rerun)
    which = f"{page}" if page_only else f"the results section of {readme} and {page}"
    typer.echo(f"rewrote {which}; figures in {figures}")


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

    publish_robustness(results, docs=docs, page=page, reference=reference)
    typer.echo(f"wrote {page}; summary, levels and figure in {docs}")


@one_line_errors
def scaling_page(
    results: Path = typer.Argument(..., help="A scaling design's output directory (with summary.json)."),
    docs: Path = typer.Option(
        Path("docs/results/scaling"), help="Where summary.json, levels.json and the figure are copied."
    ),
    page: Path = typer.Option(..., help="The page to write (rewritten), e.g. the docs' results-scaling page."),
) -> None:
    """Publish a scaling design: its summary.json, levels.json and figure into DOCS, and its page."""
    publish_scaling(results, docs=docs, page=page)
    typer.echo(f"wrote {page} and {docs}")


@one_line_errors
def long_page(
    results: Path = typer.Argument(..., help="A long design's output directory (with summary.json)."),
    docs: Path = typer.Option(Path("docs/results/long"), help="Where summary.json, levels.json and the figure go."),
    page: Path = typer.Option(..., help="The page to write (rewritten), e.g. the docs' results-long page."),
) -> None:
    """Publish a long design: its summary.json, levels.json and figure into DOCS, and its page."""
    publish_long(results, docs=docs, page=page)
    typer.echo(f"wrote {page} and {docs}")
