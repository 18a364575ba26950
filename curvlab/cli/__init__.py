"""The ``curvlab`` command line. Thin: every command parses its options into a settings record, calls one
library function and prints the result through :mod:`curvlab.output.console`.

The commands live by group: :mod:`~curvlab.cli.training` (``train``), :mod:`~curvlab.cli.analysis` (``nds``,
``compare``, ``track``, ``spectrum``), :mod:`~curvlab.cli.jobs` (``quadratic``, ``reproduce``, ``finetune``
and the pages), :mod:`~curvlab.cli.pcfg` (``pcfg generate``, ``pcfg stats``) and :mod:`~curvlab.cli.data`
(``data text``); how each fails is
:mod:`~curvlab.cli.errors`, and how each option checks its value where it is parsed :mod:`~curvlab.cli.options`.
This module gathers them into :data:`app`, in the order ``--help`` lists them.
"""

from __future__ import annotations

import torch
import typer

import curvlab
from curvlab.cli import analysis, data, jobs, pcfg, training
from curvlab.cli.options import OneLineUsageErrors

app = typer.Typer(
    cls=OneLineUsageErrors,  # a bad option value is one line, as every other bad input
    help="curvlab: exact curvature analysis of neural-network optimizers (NDS, Taylor split, block curvature).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(pcfg.app, name="pcfg")
app.add_typer(data.app, name="data")


@app.command()
def version() -> None:
    """Print curvlab's version and the torch it runs on."""

    typer.echo(f"curvlab {curvlab.__version__} (torch {torch.__version__})")


app.command()(training.train)
for command in (analysis.nds, analysis.compare, analysis.track, analysis.spectrum, jobs.quadratic, jobs.reproduce,
                jobs.finetune):  # fmt: skip
    app.command()(command)
app.command("readme-results")(jobs.readme_results)
app.command("robustness-page")(jobs.robustness_page)
app.command("scaling-page")(jobs.scaling_page)
app.command("long-page")(jobs.long_page)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
