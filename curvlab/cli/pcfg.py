"""``curvlab pcfg``: the Zipf-PCFG synthetic language (generate a data directory, print its statistics)."""

from __future__ import annotations

from pathlib import Path

import typer

from curvlab.cli.errors import one_line_errors
from curvlab.data.dataset import generate_pcfg_dataset, read_stats
from curvlab.output.console import pcfg_stats_text

app = typer.Typer(help="The Zipf-PCFG synthetic language: generate data, inspect it.", no_args_is_help=True)


@app.command("generate")
@one_line_errors
def generate(
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

    grammar = {"depth": depth, "width": width, "rule_s": rule_s}
    stats = generate_pcfg_dataset(
        out, s=s, tokens=tokens, val_tokens=val_tokens, val_s=val_s, seed=seed, shard_tokens=shard_tokens,
        grammar_options=grammar,
    )  # fmt: skip
    typer.echo(pcfg_stats_text(stats))
    typer.echo(f"wrote {out}")


@app.command("stats")
@one_line_errors
def stats(data_dir: Path = typer.Argument(..., help="A directory written by `curvlab pcfg generate`.")) -> None:
    """Print a Zipf-PCFG data directory's statistics."""

    typer.echo(pcfg_stats_text(read_stats(data_dir)))
