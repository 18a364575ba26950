"""``curvlab data``: a user's own text made into a data directory that ``curvlab train --data`` reads."""

from __future__ import annotations

from pathlib import Path

import typer

from curvlab.cli.errors import one_line_errors
from curvlab.cli.options import count, number, seed_option, token_count
from curvlab.data.text import text_to_shards
from curvlab.output.console import text_stats_text

app = typer.Typer(help="Your own data: tokenize text into train/validation shards.", no_args_is_help=True)


@app.command("text")
@one_line_errors
def text(
    files: list[Path] = typer.Argument(
        ..., help="UTF-8 text files (lines are documents), or nanochat parquet shards (`text` column)."
    ),
    out: Path = typer.Option(..., help="Output directory (created; must be new or hold the same dataset)."),
    tokenizer: Path | None = typer.Option(None, help="A Hugging Face tokenizer.json to encode with."),
    vocab_size: int | None = count(
        None, low=257, help="Or: train a byte-level BPE of this many tokens on the train text (offline, deterministic)."
    ),
    val_fraction: float | None = number(
        None,
        low=0.0,
        high=1.0,
        help="Share of the text lines held out for validation, chosen by --seed (default "
        "0.01). Parquet inputs: the last file by name is validation instead.",
    ),
    seed: int = seed_option(0, help="Seed of the choice of validation lines."),
    shard_tokens: str = typer.Option("100M", help="Tokens per shard file.", callback=token_count),
) -> None:
    """Tokenize text into train/val shards, tokenizer.json and stats.json (a killed run starts over when run again)."""

    stats = text_to_shards(
        files, out, tokenizer=tokenizer, vocab_size=vocab_size, val_fraction=val_fraction, seed=seed,
        shard_tokens=shard_tokens,
    )  # fmt: skip
    typer.echo(text_stats_text(stats))
    typer.echo(f"wrote {out}")
