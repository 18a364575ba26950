"""The ``curvlab`` command line. Thin: every command parses options and calls the library."""

from __future__ import annotations

import typer

import curvlab

app = typer.Typer(
    help="curvlab: exact curvature analysis of neural-network optimizers (NDS, Taylor split, block curvature).",
    no_args_is_help=True,
    add_completion=False,
)


@app.command()
def version() -> None:
    """Print curvlab's version and the torch it runs on."""
    import torch

    typer.echo(f"curvlab {curvlab.__version__} (torch {torch.__version__})")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
