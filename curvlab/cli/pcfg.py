"""``curvlab pcfg``: the Zipf-PCFG synthetic language (generate a data directory, print its statistics)."""

from __future__ import annotations

from pathlib import Path

import typer

from curvlab.cli.errors import one_line_errors
from curvlab.cli.options import count, number, refuse_beyond_disk, refuse_beyond_memory, seed_option, token_count
from curvlab.data.dataset import generate_pcfg_dataset, read_stats
from curvlab.data.pcfg import generation_footprint
from curvlab.output.console import pcfg_stats_text

app = typer.Typer(help="The Zipf-PCFG synthetic language: generate data, inspect it.", no_args_is_help=True)


@app.command("generate")
@one_line_errors
def generate(
    out: Path = typer.Option(..., help="Output directory (created; must be new or hold the same dataset)."),
    s: float = number(1.0, low=0.0, help="Zipf exponent of the training tokens inside each class."),
    # (the counts arrive parsed, as ints, from their callback)
    tokens: str = typer.Option("20M", help="Training tokens, e.g. 20M, 500k.", callback=token_count),
    val_tokens: str = typer.Option("1M", help="Validation tokens.", callback=token_count),
    val_s: float = number(0.0, low=0.0, help="Zipf exponent of the validation tokens (the paper: 0)."),
    seed: int = seed_option(0, help="Grammar seed."),
    shard_tokens: str = typer.Option("100M", help="Tokens per shard file.", callback=token_count),
    depth: int = count(7, help="Grammar levels (root included)."),
    width: int = count(3, help="Nonterminals per level."),
    rule_s: float = number(0.0, low=0.0, help="Rule probabilities proportional to rank^-rule_s."),
) -> None:
    """Write train/validation shards, grammar.json and stats.json for a Zipf-PCFG language."""

    memory, disk = generation_footprint(tokens, val_tokens, shard_tokens, depth=depth, width=width)
    what = f"a language of --tokens {tokens:g} and --val-tokens {val_tokens:g} (--depth {depth}, --width {width})"
    refuse_beyond_memory(memory, what)
    refuse_beyond_disk(disk, what, out)
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
