"""Writing a Zipf-PCFG data directory: train and validation shards, the grammar, and statistics.

Layout of ``out/``: ``train_000000.bin ...`` and ``val_000000.bin`` (headered shards), ``grammar.json``
and ``stats.json`` (the generation config, the vocabulary size, and per-split token statistics).
Everything is written into a temporary sibling directory, ``.<out.name>.<8 random>.curvlab-tmp``, that
is renamed into place at the end, so an interrupted generation leaves nothing that is read. A generation
holds the lock ``.<out.name>.lock`` beside ``out`` (:func:`generation_lock`) from its check of ``out`` to
the rename: a second process making the same directory waits for the first and then uses its dataset
(asking again for the same config is a no-op), and a temporary directory of ``out`` found while holding
the lock is a killed generation's, which is removed. :func:`build_data_directory` is that protocol alone,
which ``curvlab data text`` (:mod:`curvlab.data.text`) shares.
"""

from __future__ import annotations

import contextlib
import glob
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import filelock
import numpy as np
from tqdm.auto import tqdm

from curvlab.data.pcfg import count_stats, make_grammar
from curvlab.data.shards import data_vocab_size, find_shards, read_shard, read_stats_json, write_shard
from curvlab.errors import CurvlabError
from curvlab.util.atomic import TEMPORARY_SUFFIX, atomic_write_text, make_public, temporary_of, temporary_options
from curvlab.util.progress import refresh_interval

STATS_VERSION = 1


def parse_count(text: str | int) -> int:
    """``"20M"`` -> 20_000_000; also ``k``, ``G``, plain integers and floats like ``"1.5M"``."""
    if isinstance(text, int):
        return text
    t = str(text).strip().replace("_", "")
    scale = {"k": 10**3, "K": 10**3, "m": 10**6, "M": 10**6, "g": 10**9, "G": 10**9}.get(t[-1:], 1)
    try:
        value = float(t[:-1] if scale > 1 else t)
    except ValueError:
        raise CurvlabError(f"not a count: {text!r} (use e.g. 20M, 500k or 1000)") from None
    if value <= 0:
        raise CurvlabError(f"count must be positive, got {text!r}")
    return round(value * scale)


def generate_pcfg_dataset(
    out: str | Path,
    s: float = 1.0,
    tokens: int | str = "20M",
    val_tokens: int | str = "1M",
    val_s: float = 0.0,
    seed: int = 0,
    shard_tokens: int | str = "100M",
    grammar_options: dict | None = None,
    progress: bool = True,
) -> dict:
    """Generate a Zipf-PCFG data directory (see the module docstring) and return its stats.

    Args:
        s: Zipf exponent of the training tokens (>= 0).
        val_s: exponent of the validation tokens (the paper fixes validation at s = 0).
        seed: grammar seed; train and validation streams get their own seeds derived from it.
        grammar_options: keyword arguments of :func:`~curvlab.data.pcfg.make_grammar`.

    Raises:
        CurvlabError: s or val_s < 0, bad counts, or ``out`` holding a different dataset.
    """
    if s < 0 or val_s < 0:
        raise CurvlabError(f"the Zipf exponent must be >= 0, got s={s}, val_s={val_s}")
    out = Path(out)
    config = {
        "s": float(s),
        "tokens": parse_count(tokens),
        "val_tokens": parse_count(val_tokens),
        "val_s": float(val_s),
        "seed": int(seed),
        "shard_tokens": parse_count(shard_tokens),
        "grammar_options": dict(grammar_options or {}),
    }
    grammar = make_grammar(seed=seed, **config["grammar_options"])

    def build(tmp: Path) -> dict:
        split_stats = {}
        for split, n, exponent, stream_seed in [
            ("train", config["tokens"], s, seed * 1000 + 1),
            ("val", config["val_tokens"], val_s, seed * 1000 + 2),
        ]:
            counts = np.zeros(grammar.vocab_size, dtype=np.int64)
            pending, shard = np.empty(0, dtype=np.int64), 0
            desc = f"pcfg {split} (s={exponent:g})"
            every = refresh_interval()  # (a log, not a terminal: a redraw every 30 s)
            bar = tqdm(total=n, desc=desc, unit="tok", unit_scale=True, disable=not progress, mininterval=every)
            for chunk in grammar.stream(n, exponent, stream_seed):
                counts += np.bincount(chunk, minlength=grammar.vocab_size)
                pending = np.concatenate([pending, chunk])
                bar.update(chunk.size)
                while pending.size >= config["shard_tokens"]:
                    write_shard(tmp / f"{split}_{shard:06d}.bin", pending[: config["shard_tokens"]])
                    pending, shard = pending[config["shard_tokens"] :], shard + 1
            bar.close()
            if pending.size:
                write_shard(tmp / f"{split}_{shard:06d}.bin", pending)
            split_stats[split] = {"s": exponent, **count_stats(counts, grammar)}
        grammar.save(tmp / "grammar.json")
        return {"version": STATS_VERSION, "config": config, "vocab_size": grammar.vocab_size, **split_stats}

    return build_data_directory(out, config, build)


def build_data_directory(out: str | Path, config: dict, build: Callable[[Path], dict]) -> dict:
    """Make the data directory ``out`` of ``config`` whole, or find it made, and return its stats.

    ``build(tmp)`` writes the shards and other files into a fresh temporary sibling directory and returns
    the stats (which hold ``config``); they are written to ``tmp/stats.json`` and ``tmp`` is renamed to
    ``out``, under :func:`generation_lock` (the module docstring). A finished ``out`` of the same config is
    returned as it is, without ``build``.

    Raises:
        CurvlabError: ``out`` holding a dataset of another config, or other files.
    """
    out = Path(out)
    stats = _existing(out, config)
    if stats is not None:  # (read without the lock: a published dataset is whole)
        return stats
    out.parent.mkdir(parents=True, exist_ok=True)
    with generation_lock(out):  # a second generation of out waits here for the first, then finds its dataset
        stats = _existing(out, config)
        if stats is not None:
            return stats
        _remove_stale_generations(out)
        tmp = Path(tempfile.mkdtemp(**temporary_options(out)))
        try:
            stats = build(tmp)
            atomic_write_text(tmp / "stats.json", json.dumps(stats, indent=1))
            make_public(tmp)
            _publish(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return stats


def generation_lock(out: str | Path) -> filelock.FileLock:
    """The lock that a generation of ``out`` holds from its check of ``out`` to the rename:
    ``.<out.name>.lock`` beside ``out`` (an ``flock``, which the kernel drops when its process ends,
    however it ends). The file stays: removing a lock file races with a process about to take it."""
    out = Path(out)
    return filelock.FileLock(out.parent / f".{out.name}.lock")


def _existing(out: Path, config: dict) -> dict | None:
    """The stats of the dataset of ``config`` at ``out``; ``None`` when ``out`` is missing or empty.

    Raises:
        CurvlabError: ``out`` holds a dataset of another config, or other files.
    """
    existing = out / "stats.json"
    if existing.is_file():
        stats = read_stats_json(existing)
        if stats.get("config") == config:
            return stats
        raise CurvlabError(f"{out} already holds a dataset made with another config; choose another --out")
    if out.exists() and any(out.iterdir()):
        raise CurvlabError(f"{out} exists and is not empty; choose another --out")
    return None


def _remove_stale_generations(out: Path) -> None:
    """Remove the temporary directories of ``out`` (``.<out.name>.<8 random>.curvlab-tmp``) that
    generations killed mid-way (kill -9) left. Call it holding :func:`generation_lock`: every other
    generation of ``out`` is then a dead one."""
    for tmp in sorted(out.parent.glob(f".{glob.escape(out.name)}.*{TEMPORARY_SUFFIX}")):
        if temporary_of(tmp) == out.name and tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)


def _publish(tmp: Path, out: Path) -> None:
    """Rename the finished ``tmp`` to ``out`` (an empty folder there is replaced). Called holding
    :func:`generation_lock`, so no other generation of ``out`` renames meanwhile.

    Raises:
        CurvlabError: something other than a curvlab generation filled ``out`` meanwhile.
    """
    try:
        with contextlib.suppress(FileNotFoundError):
            out.rmdir()  # empty, checked under the lock
        tmp.rename(out)
    except OSError as e:  # ENOTEMPTY or EEXIST
        if not out.is_dir():
            raise
        raise CurvlabError(f"{out}: filled by another program while this one generated; choose another --out") from e


def read_stats(data_dir: str | Path) -> dict:
    """The ``stats.json`` of a Zipf-PCFG data directory."""
    path = Path(data_dir) / "stats.json"
    if not path.is_file():
        raise CurvlabError(f"{data_dir}: no stats.json (not a directory written by `curvlab pcfg generate`)")
    return read_stats_json(path)


def unigram_plateau_nats(data_dir: str | Path) -> float:
    r"""The validation loss, in nats, of a model that has learned only the *training* token frequencies:
    the cross-entropy :math:`-\sum_t p_\text{val}(t) \log p_\text{train}(t)` (docs/science.md section 3).

    The unigram plateau of a run depends on its training data: with validation fixed at s = 0 and
    training at s > 0, the frequencies learned are the skewed ones, and the plateau lies above the
    validation unigram entropy (by 0.6-0.8 nats at s = 1 on the quick grammar). ``p_train`` is
    add-one smoothed, so a token never seen in training costs a finite loss, as it would a model.
    """
    read_stats(data_dir)  # (a missing file named as such)
    vocab = data_vocab_size(data_dir)
    counts = {}
    for split in ("train", "val"):
        c = np.zeros(vocab, dtype=np.int64)
        for shard in find_shards(data_dir, split):
            c += np.bincount(np.asarray(read_shard(shard, vocab)), minlength=vocab)
        counts[split] = c
    p_val = counts["val"] / counts["val"].sum()
    p_train = (counts["train"] + 1) / (counts["train"].sum() + vocab)
    return float(-(p_val * np.log(p_train)).sum())
