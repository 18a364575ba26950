"""The ``curvlab`` command line. Thin: every command parses options and calls the library.

Errors the library raises as ``ValueError`` (bad input: missing or corrupt files, mismatched
shapes, non-finite values) become one line on stderr and exit status 2.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import typer

import curvlab

app = typer.Typer(
    help="curvlab: exact curvature analysis of neural-network optimizers (NDS, Taylor split, block curvature).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
pcfg_app = typer.Typer(help="The Zipf-PCFG synthetic language: generate data, inspect it.", no_args_is_help=True)
app.add_typer(pcfg_app, name="pcfg")


def one_line_errors(fn):
    """Turn the library's ValueError (and missing files) into ``error: ...`` and exit status 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (ValueError, FileNotFoundError, NotADirectoryError) as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None

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
    import torch

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
    from curvlab.data.dataset import generate_pcfg_dataset

    stats = generate_pcfg_dataset(
        out, s, tokens, val_tokens, val_s, seed, shard_tokens, {"depth": depth, "width": width, "rule_s": rule_s}
    )
    _print_pcfg_stats(stats)
    typer.echo(f"wrote {out}")


@pcfg_app.command("stats")
@one_line_errors
def pcfg_stats(data_dir: Path = typer.Argument(..., help="A directory written by `curvlab pcfg generate`.")) -> None:
    """Print a Zipf-PCFG data directory's statistics."""
    from curvlab.data.dataset import read_stats

    _print_pcfg_stats(read_stats(data_dir))


def _print_pcfg_stats(stats: dict) -> None:
    rows = [
        (split, st["s"], st["tokens"], st["sentences"], st["entropy_bits"], st["zipf_exponent_mean"])
        for split, st in ((k, stats[k]) for k in ("train", "val"))
    ]
    typer.echo(f"vocabulary: {stats['vocab_size']} tokens (separator included); config: {json.dumps(stats['config'])}")
    print_table(rows, ("split", "s", "tokens", "sentences", "entropy (bits)", "fitted Zipf exponent"))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
