r"""Text to token shards: the data directory of ``curvlab data text FILES... --out DIR``.

Inputs are UTF-8 text files or nanochat's parquet shards, not both at once:

* a text file is read as bytes and refused, by name and byte offset, at its first byte that is not
  UTF-8 (a NUL byte counts as binary). Its documents are its lines, each with its own line ending (only
  ``\n`` ends a line), so the tokens of a split decode to its lines exactly as the file holds them.
* a parquet file (nanochat's FineWeb-Edu shards) holds a document a row, in its ``text`` column, read with
  ``pyarrow``. As nanochat does, the files are taken in the sorted order of their names and the last one is
  the validation split; ``--val-fraction`` is refused with them. A row has no line ending of its own, so the
  tokenizer's ``<|endoftext|>`` (when it has one) follows each parquet document.

The tokenizer is a Hugging Face ``tokenizer.json`` the user names (``--tokenizer``), or a byte-level BPE of
``--vocab-size`` tokens trained with Hugging Face ``tokenizers`` on the train documents (validation
excluded), offline, with ``<|endoftext|>`` as token 0. The training is deterministic: it sees the train
documents in input order, and tokenizers' BPE trainer breaks ties between pair counts by the pairs' ids,
which follow from the (sorted) byte alphabet and the merges made so far, so the same inputs give the same
``tokenizer.json``, digest for digest (tested), whatever the hashing of the process. The tokenizer is saved
as ``DIR/tokenizer.json``; documents are encoded without the tokenizer's own special tokens (BOS, CLS).

Text split rule: with N documents (lines over the text files, in the order given) and k = min(N - 1,
max(1, round(val_fraction * N))), the documents at the indices ``numpy.random.default_rng(seed).choice(N, k,
replace=False)`` are validation, the rest train, each split in input order. ``stats.json`` records it.

``DIR`` holds ``train_000000.bin ...`` and ``val_000000.bin ...`` (headered shards, uint16 up to 65,536
tokens of vocabulary, else llm.c's uint32 Llama-3 layout), ``tokenizer.json`` and ``stats.json``: the
config (the inputs' names, sizes and sha256 digests, the tokenizer, the split rule, the shard size), the
tokenizer's digest, ``vocab_size``, and per split its tokens, documents and unigram entropy (in bits, as
the Zipf-PCFG's ``stats.json`` has it, and in nats). The directory is made as the Zipf-PCFG's is
(:func:`~curvlab.data.dataset.build_data_directory`): whole in a temporary sibling directory renamed into
place, under a lock, so a killed run leaves no shard that is read and the same command run again does
the job again from the start (restartable, not resumed midway); on a finished directory of the same config
it is a no-op, and a different config is refused. Memory: a document (a line) at a time, and the shard
being filled in its own dtype (2 or 4 bytes a token); a file of one huge line is held whole.
"""

from __future__ import annotations

import codecs
import hashlib
import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from curvlab.data.dataset import build_data_directory, parse_count
from curvlab.data.shards import MAX_SHARD_TOKENS, shard_dtype, write_shard
from curvlab.errors import CurvlabError
from curvlab.util.atomic import atomic_write_text, atomic_write_with
from curvlab.util.digest import path_digest
from curvlab.util.progress import refresh_interval

TEXT_STATS_VERSION = 1
DOCUMENT_END = "<|endoftext|>"
DEFAULT_VAL_FRACTION = 0.01
INSTALL = "pip install -e '.[text]' (from a checkout; else pip install 'curvlab[text]')"
_CHUNK = 1 << 20  # bytes read at a time when checking a text file
_BATCH_CHARS = 1 << 20  # characters of documents encoded together (tokenizers encodes a batch in parallel)


def _bar_options() -> dict[str, float]:
    """tqdm's options of every bar: in a log, a redraw every 30 s (as the Zipf-PCFG's); no bar for a pass done
    within a second (a small input, or one refused at once, prints its result or its one-line error alone)."""
    return {"delay": 1.0, "mininterval": refresh_interval()}


def require(module: str, package: str) -> Any:
    """``module``, imported; one line naming the ``text`` extra when ``package`` is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise CurvlabError(f"curvlab data text needs {package}, which is not installed: {INSTALL}") from None


@dataclass(frozen=True)
class Source:
    """One input file, checked: its kind ("text" or "parquet"), bytes, sha256 and number of documents."""

    path: Path
    kind: str
    size: int
    sha256: str
    documents: int

    def record(self) -> dict[str, Any]:
        return {"name": self.path.name, "size": self.size, "sha256": self.sha256}


def scan_text(path: str | Path, bar: tqdm | None = None) -> Source:
    """Check that ``path`` is UTF-8 text, and count its lines and digest its bytes on the way.

    Raises:
        CurvlabError: a NUL byte (binary) or a byte that is not UTF-8, named with its byte offset.
    """
    path = Path(path)
    digest, decoder = hashlib.sha256(), codecs.getincrementaldecoder("utf-8")()
    offset, newlines, last = 0, 0, b""
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            nul = chunk.find(b"\0")
            _decode(path, decoder, chunk if nul < 0 else chunk[:nul], offset, final=nul >= 0)
            if nul >= 0:
                raise CurvlabError(f"{path}: a binary file (a NUL byte at byte offset {offset + nul}), not UTF-8 text")
            newlines, offset, last = newlines + chunk.count(b"\n"), offset + len(chunk), chunk[-1:]
            if bar is not None:
                bar.update(len(chunk))
    _decode(path, decoder, b"", offset, final=True)
    return Source(path, "text", offset, digest.hexdigest(), newlines + (last not in (b"", b"\n")))


def _decode(path: Path, decoder: codecs.IncrementalDecoder, data: bytes, offset: int, final: bool) -> None:
    """Feed ``data``, which starts at byte ``offset`` of ``path``, to ``decoder``; name its first bad byte."""
    pending = len(decoder.getstate()[0])  # bytes of a character begun in the previous chunk
    try:
        decoder.decode(data, final=final)
    except UnicodeDecodeError as e:
        bad = e.object[e.start]
        where = offset - pending + e.start
        raise CurvlabError(f"{path}: not UTF-8 text (byte 0x{bad:02x} at byte offset {where})") from None


def scan_parquet(path: str | Path) -> Source:
    """Check that ``path`` is a parquet file with a string column ``text``; count its rows.

    Raises:
        CurvlabError: not parquet, or no ``text`` column of strings.
    """
    path = Path(path)
    pa, pq = require("pyarrow", "pyarrow"), require("pyarrow.parquet", "pyarrow")
    try:
        parquet = pq.ParquetFile(path)
        schema, rows = parquet.schema_arrow, parquet.metadata.num_rows
    except (pa.ArrowException, OSError) as e:
        raise CurvlabError(f"{path}: not a readable parquet file ({str(e).splitlines()[0]})") from None
    if "text" not in schema.names:
        raise CurvlabError(f"{path}: no `text` column (its columns: {', '.join(schema.names)})")
    kind = schema.field("text").type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise CurvlabError(f"{path}: its `text` column holds {kind}, not strings")
    return Source(path, "parquet", path.stat().st_size, path_digest(path), rows)


def scan_inputs(files: list[str | Path], progress: bool = True) -> list[Source]:
    """The checked inputs: text files in the order given, or parquet files sorted by name.

    Raises:
        CurvlabError: no input, a missing one, text and parquet mixed, one parquet file alone, or a bad file.
    """
    paths = [Path(f) for f in files]
    if not paths:
        raise CurvlabError("no input files")
    for p in paths:
        if not p.is_file():
            raise CurvlabError(f"{p}: no such file")
    parquet = [p.suffix == ".parquet" for p in paths]
    if any(parquet) and not all(parquet):
        raise CurvlabError("inputs mix parquet and text files; give one kind")
    if all(parquet):
        if len(paths) < 2:
            raise CurvlabError(
                f"{paths[0]}: one parquet file; the last one (by name) is validation, so give two or more"
            )
        return [scan_parquet(p) for p in sorted(paths, key=lambda p: (p.name, str(p)))]
    total = sum(p.stat().st_size for p in paths)
    with tqdm(total=total, desc="check text", unit="B", unit_scale=True, disable=not progress,
              **_bar_options()) as bar:  # fmt: skip
        return [scan_text(p, bar) for p in paths]


def split_rule(sources: list[Source], val_fraction: float | None, seed: int) -> tuple[str, np.ndarray | None]:
    """The split rule in words, and for text inputs the sorted indices of the validation documents.

    Raises:
        CurvlabError: a fraction outside (0, 1), one given with parquet inputs, or too few documents.
    """
    if sources[0].kind == "parquet":
        if val_fraction is not None:
            raise CurvlabError("parquet inputs are split by file (the last by name is validation); drop --val-fraction")
        return f"parquet: the last file by name ({sources[-1].path.name}) is validation, the others train", None
    fraction = DEFAULT_VAL_FRACTION if val_fraction is None else float(val_fraction)
    if not 0 < fraction < 1:
        raise CurvlabError(f"the validation fraction must lie in (0, 1), got {fraction}")
    n = sum(s.documents for s in sources)
    if n < 2:
        raise CurvlabError(f"the inputs hold {n} line(s); a train and a validation split need two or more")
    k = min(n - 1, max(1, round(fraction * n)))
    val = np.sort(np.random.default_rng(seed).choice(n, k, replace=False))
    rule = (
        f"text: lines are documents; of N = {n}, the k = min(N - 1, max(1, round({fraction:g} * N))) = {k} at "
        f"numpy.random.default_rng({seed}).choice(N, k, replace=False) are validation, the rest train"
    )
    return rule, val


def documents(sources: list[Source], val: np.ndarray | None) -> Iterator[tuple[str, str, str]]:
    """``(split, kind, document)`` of every document of the inputs, in order, by :func:`split_rule`'s rule."""
    index, position = 0, 0
    for i, source in enumerate(sources):
        if source.kind == "parquet":
            split = "val" if i == len(sources) - 1 else "train"
            for doc in _parquet_rows(source.path):
                yield split, "parquet", doc
            continue
        with open(source.path, "rb") as f:
            for line in f:  # (binary lines end at b"\n" only, as scan_text counts them)
                is_val = position < len(val) and val[position] == index
                position += is_val
                index += 1
                yield ("val" if is_val else "train"), "text", line.decode("utf-8")


def _parquet_rows(path: Path) -> Iterator[str]:
    pq = require("pyarrow.parquet", "pyarrow")
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024, columns=["text"]):
        yield from (t for t in batch.column(0).to_pylist() if t is not None)  # (a null row: no document)


def load_tokenizer(path: str | Path) -> Any:
    """A Hugging Face ``tokenizers.Tokenizer`` from its ``tokenizer.json``.

    Raises:
        CurvlabError: no such file, or not a tokenizer.json.
    """
    tokenizers = require("tokenizers", "tokenizers")
    path = Path(path)
    if not path.is_file():
        raise CurvlabError(f"{path}: no such tokenizer file")
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # (tokenizers raises a bare Exception for a bad file)
        raise CurvlabError(f"{path}: not a Hugging Face tokenizer.json ({str(e).splitlines()[0]})") from None


def train_tokenizer(texts: Iterator[str], vocab_size: int, length: int | None = None) -> Any:
    """A byte-level BPE of ``vocab_size`` tokens (``<|endoftext|>`` first, then the 256 bytes) trained on
    ``texts`` (deterministic: the module docstring). Decoding an encoding gives the text back, byte for byte.

    Raises:
        CurvlabError: a vocabulary too small to hold the special token and the 256 bytes.
    """
    tokenizers = require("tokenizers", "tokenizers")
    if vocab_size < 257:
        raise CurvlabError(
            f"a byte-level BPE needs a vocabulary of at least 257 (<|endoftext|> and 256 bytes), got {vocab_size}"
        )
    byte_level = tokenizers.pre_tokenizers.ByteLevel
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = byte_level(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[DOCUMENT_END], initial_alphabet=byte_level.alphabet(),
        show_progress=False,
    )  # fmt: skip
    tokenizer.train_from_iterator(texts, trainer=trainer, length=length)
    return tokenizer


class _ShardWriter:
    """The shards of one split, written as they fill, and its token counts."""

    def __init__(self, directory: Path, split: str, shard_tokens: int, vocab_size: int):
        self.directory, self.split, self.shard_tokens = directory, split, shard_tokens
        self.dtype = shard_dtype(vocab_size)
        self.counts = np.zeros(vocab_size, dtype=np.int64)
        self.pending: list[np.ndarray] = []
        self.held, self.shards, self.documents = 0, 0, 0

    def add(self, documents: list[list[int]]) -> None:
        """Append the token ids of ``documents`` (a batch: counted at once, not a vocabulary-long count each)."""
        if not documents:
            return
        ids = np.fromiter((i for d in documents for i in d), dtype=np.int64)
        self.counts += np.bincount(ids, minlength=self.counts.size)
        self.pending.append(ids.astype(self.dtype))  # (held in the shard's dtype: 2 or 4 bytes a token, not 8)
        self.held += ids.size
        self.documents += len(documents)
        if self.held >= self.shard_tokens:
            self.flush(full_only=True)

    def flush(self, full_only: bool = False) -> None:
        tokens = np.concatenate(self.pending) if self.pending else np.empty(0, dtype=self.dtype)
        while tokens.size >= self.shard_tokens or (not full_only and tokens.size):
            self._write(tokens[: self.shard_tokens])
            tokens = tokens[self.shard_tokens :]
        self.pending, self.held = [tokens], tokens.size

    def _write(self, tokens: np.ndarray) -> None:
        write_shard(self.directory / f"{self.split}_{self.shards:06d}.bin", tokens, dtype=self.dtype)
        self.shards += 1

    def stats(self) -> dict[str, Any]:
        total = int(self.counts.sum())
        p = self.counts[self.counts > 0] / max(total, 1)
        nats = float(-(p * np.log(p)).sum())
        return {
            "tokens": total, "documents": self.documents, "shards": self.shards,
            "entropy_bits": float(nats / np.log(2)), "entropy_nats": nats,
        }  # fmt: skip


def encode_into_shards(
    tokenizer: Any, sources: list[Source], val: np.ndarray | None, out: Path, shard_tokens: int, progress: bool
) -> dict[str, dict[str, Any]]:
    """Encode every document into ``out``'s train and val shards; the stats of each split."""
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    writers = {split: _ShardWriter(out, split, shard_tokens, vocab) for split in ("train", "val")}
    end = tokenizer.token_to_id(DOCUMENT_END)
    total = sum(s.documents for s in sources)
    bar = tqdm(total=total, desc="tokenize", unit="doc", unit_scale=True, disable=not progress,
               **_bar_options())  # fmt: skip
    batch: list[tuple[str, str, str]] = []
    chars = 0

    def encode() -> None:
        encodings = tokenizer.encode_batch([doc for _, _, doc in batch], add_special_tokens=False)
        ids: dict[str, list[list[int]]] = {"train": [], "val": []}
        for (split, kind, _), encoding in zip(batch, encodings):
            ids[split].append(encoding.ids + ([end] if kind == "parquet" and end is not None else []))
        for split, docs in ids.items():
            writers[split].add(docs)
        bar.update(len(batch))
        batch.clear()

    for item in documents(sources, val):
        batch.append(item)
        chars += len(item[2])
        if chars >= _BATCH_CHARS:
            encode()
            chars = 0
    if batch:
        encode()
    bar.close()
    for writer in writers.values():
        writer.flush()
    for split, writer in writers.items():
        if not writer.shards:
            raise CurvlabError(f"the {split} split holds no tokens; give more text")
    return {split: writer.stats() for split, writer in writers.items()}


def text_to_shards(
    files: list[str | Path],
    out: str | Path,
    tokenizer: str | Path | None = None,
    vocab_size: int | None = None,
    val_fraction: float | None = None,
    seed: int = 0,
    shard_tokens: int | str = "100M",
    progress: bool = True,
) -> dict:
    """Tokenize text or parquet ``files`` into the data directory ``out`` (the module docstring); its stats.

    Args:
        files: UTF-8 text files (in this order), or parquet files with a ``text`` column (the last by name is
            validation).
        tokenizer: a Hugging Face ``tokenizer.json``; or, with ``vocab_size``, a byte-level BPE trained here.
        val_fraction: the share of the text lines that are validation (default 0.01; not with parquet).
        seed: the seed of the choice of validation lines.
        shard_tokens: tokens per shard file (``"100M"``, ``500k`` or an int).

    Returns:
        The stats written to ``out/stats.json``.

    Raises:
        CurvlabError: both or neither of ``tokenizer`` and ``vocab_size``, a bad input (named), a missing
            ``tokenizers``/``pyarrow``, or ``out`` holding another dataset.
    """
    if (tokenizer is None) == (vocab_size is None):
        raise CurvlabError(
            "name a tokenizer (--tokenizer tokenizer.json) or a vocabulary to train (--vocab-size), one of them"
        )
    require("tokenizers", "tokenizers")  # (before the inputs are read through)
    shard_tokens = min(parse_count(shard_tokens), MAX_SHARD_TOKENS)
    given = None if tokenizer is None else load_tokenizer(tokenizer)
    sources = scan_inputs(files, progress)
    rule, val = split_rule(sources, val_fraction, seed)
    fraction = None if val is None else DEFAULT_VAL_FRACTION if val_fraction is None else float(val_fraction)
    config = {
        "inputs": [s.record() for s in sources],
        "tokenizer": {"sha256": path_digest(tokenizer)}
        if given is not None
        else {"trained": {"vocab_size": int(vocab_size)}},
        "split": rule,
        "val_fraction": fraction,
        "seed": int(seed),
        "shard_tokens": shard_tokens,
    }

    def build(tmp: Path) -> dict:
        if given is None:
            use = _train_on(sources, val, vocab_size, progress)
            atomic_write_text(tmp / "tokenizer.json", use.to_str(pretty=True))
        else:  # (its very bytes: the digest recorded is the user's file's)
            use, data = given, Path(tokenizer).read_bytes()
            atomic_write_with(tmp / "tokenizer.json", lambda f: f.write(data))
        splits = encode_into_shards(use, sources, val, tmp, shard_tokens, progress)
        end = use.token_to_id(DOCUMENT_END)
        return {
            "version": TEXT_STATS_VERSION,
            "kind": "text",
            "config": config,
            "vocab_size": use.get_vocab_size(with_added_tokens=True),
            "tokenizer": {
                "file": "tokenizer.json",
                "sha256": path_digest(tmp / "tokenizer.json"),
                "trained": given is None,
                "tokenizers_version": require("tokenizers", "tokenizers").__version__,
            },
            "document_end": None if end is None or sources[0].kind == "text" else {"token": DOCUMENT_END, "id": end},
            "inputs": [s.record() for s in sources],
            "split": rule,
            # (not in the config: a rerun under another numpy is the same request; its streams are not promised
            # across versions, so the stats say which drew the split)
            "numpy_version": np.__version__,
            **splits,
        }

    return build_data_directory(out, config, build)


def _train_on(sources: list[Source], val: np.ndarray | None, vocab_size: int, progress: bool) -> Any:
    """The byte-level BPE of ``vocab_size`` tokens trained on the train documents of ``sources``."""
    n_val = len(val) if val is not None else sources[-1].documents
    length = sum(s.documents for s in sources) - n_val
    texts = (doc for split, _, doc in documents(sources, val) if split == "train")
    shown = tqdm(texts, total=length, desc="train BPE", unit="doc", unit_scale=True, disable=not progress,
                 **_bar_options())  # fmt: skip
    return train_tokenizer(shown, vocab_size, length)
