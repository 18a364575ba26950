"""Token shards on disk and the batch loaders that read them.

Three formats, all read through ``numpy.memmap`` so that a shard is never loaded whole:

* headered shards of llm.c / modded-nanogpt (GPT-2 tokens): a header of 256 int32 (magic 20240520,
  version 1, token count, zeros), then the tokens as uint16.
* llm.c's Llama-3 shards: the same header with magic 20240801 and version 7, then the tokens as uint32,
  for vocabularies beyond 65,536 tokens.
* nanoGPT's raw ``train.bin`` / ``val.bin``: uint16 tokens and nothing else.

curvlab writes the first two (``train_000000.bin``, ...; :func:`write_shard` takes uint16 when every token
fits, else uint32). A data directory holds ``train*.bin`` and ``val*.bin`` files of any kind (files named
exactly ``train.bin``/``val.bin`` are read as raw nanoGPT files, every other ``.bin`` must carry a header),
so FineWeb shards prepared by modded-nanogpt, llm.c or nanoGPT can be used as they are. llm.c's eval files
(magic 20240522: HellaSwag-style examples, not a token stream) are refused by name. nanochat's parquet
shards hold text, not tokens: ``curvlab data text`` (:mod:`curvlab.data.text`) tokenizes them into shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from curvlab.errors import CurvlabError
from curvlab.util import schema
from curvlab.util.atomic import atomic_write_with

MAGIC = 20240520  # llm.c's GPT-2 shards: uint16 tokens
VERSION = 1
LLAMA3_MAGIC = 20240801  # llm.c's Llama-3 shards: uint32 tokens
LLAMA3_VERSION = 7
EVAL_MAGIC = 20240522  # llm.c's eval files (multiple-choice examples), which are no token stream
# magic -> (version, token dtype) of each headered format
FORMATS = {MAGIC: (VERSION, np.dtype(np.uint16)), LLAMA3_MAGIC: (LLAMA3_VERSION, np.dtype(np.uint32))}
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
RAW_NAMES = {"train.bin", "val.bin"}
MAX_SHARD_TOKENS = 2**31 - 1  # the header's count is an int32


def shard_dtype(vocab_size: int) -> np.dtype:
    """The token dtype of the shards of a vocabulary of ``vocab_size``: uint16 up to 65,536 tokens, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def write_shard(path: str | Path, tokens: np.ndarray, dtype: Any = None) -> None:
    """Write ``tokens`` as a headered shard, atomically.

    Args:
        path: the shard file.
        tokens: integers in [0, 2**32).
        dtype: ``uint16`` (magic 20240520, version 1) or ``uint32`` (llm.c's Llama-3 layout, magic 20240801,
            version 7); by default uint16 when every token is below 65,536, else uint32.

    Raises:
        CurvlabError: a token that the dtype can't hold, another dtype, or more tokens than the header counts.
    """
    tokens = np.asarray(tokens)
    low, high = (int(tokens.min()), int(tokens.max())) if tokens.size else (0, 0)
    dtype = np.dtype(dtype if dtype is not None else np.uint16 if high < 2**16 else np.uint32)
    magic = next((m for m, (_, d) in FORMATS.items() if d == dtype), None)
    if magic is None:
        raise CurvlabError(f"{path}: shards hold uint16 or uint32 tokens, not {dtype}")
    if low < 0 or high >= 2 ** (8 * dtype.itemsize):
        raise CurvlabError(f"{path}: tokens must lie in [0, {2 ** (8 * dtype.itemsize)}) to fit {dtype}")
    if tokens.size > MAX_SHARD_TOKENS:
        raise CurvlabError(f"{path}: {tokens.size} tokens, more than a shard header counts ({MAX_SHARD_TOKENS})")
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:3] = magic, FORMATS[magic][0], tokens.size

    def write(f):
        f.write(header.tobytes())
        f.write(tokens.astype(dtype).tobytes())

    atomic_write_with(path, write)


def read_shard(path: str | Path, vocab_size: int | None = None) -> np.ndarray:
    """The tokens of one shard (headered, or raw for ``train.bin``/``val.bin``) as a read-only memmap.

    Raises:
        CurvlabError: missing file, an llm.c eval file, wrong magic or version, a count that disagrees with
            the file size, or (when ``vocab_size`` is given) tokens beyond the vocabulary.
    """
    path = Path(path)
    if not path.is_file():
        raise CurvlabError(f"{path}: no such shard")
    size = path.stat().st_size
    if path.name in RAW_NAMES:
        if size % 2:
            raise CurvlabError(f"{path}: odd file size {size}, not a uint16 token file")
        tokens = np.memmap(path, dtype=np.uint16, mode="r")
    else:
        tokens = _read_headered(path, size)
    if vocab_size is not None and tokens.size and int(tokens.max()) >= vocab_size:
        raise CurvlabError(f"{path}: token {int(tokens.max())} is beyond the vocabulary of {vocab_size}")
    return tokens


def _read_headered(path: Path, size: int) -> np.ndarray:
    """The tokens of a headered shard of ``size`` bytes, its header checked."""
    if size < HEADER_BYTES:
        raise CurvlabError(f"{path}: {size} bytes, shorter than the {HEADER_BYTES}-byte shard header")
    header = np.fromfile(path, dtype=np.int32, count=HEADER_INTS)
    if header[0] == EVAL_MAGIC:
        raise CurvlabError(f"{path}: an llm.c eval file (magic {EVAL_MAGIC}), not a token shard")
    if header[0] not in FORMATS:
        expected = " or ".join(map(str, FORMATS))
        raise CurvlabError(f"{path}: wrong magic number {header[0]} (expected {expected}); not a token shard")
    version, dtype = FORMATS[int(header[0])]
    if header[1] != version:
        raise CurvlabError(f"{path}: unsupported shard version {header[1]} (expected {version} for magic {header[0]})")
    count = int(header[2])
    if count < 0 or size != HEADER_BYTES + dtype.itemsize * count:
        held = (size - HEADER_BYTES) / dtype.itemsize
        raise CurvlabError(f"{path}: header says {count} tokens but the file holds {held:g} {dtype} tokens")
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(count,))


def find_shards(data_dir: str | Path, split: str) -> list[Path]:
    """The ``split`` ("train" or "val") shard files of a data directory, sorted."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise CurvlabError(f"{data_dir}: no such data directory")
    files = sorted(p for p in data_dir.glob(f"*{split}*.bin") if p.is_file())
    if not files:
        raise CurvlabError(f"{data_dir}: no {split} shards (*{split}*.bin)")
    return files


def read_stats_json(path: Path) -> dict[str, Any]:
    """The JSON object in a data directory's ``stats.json`` at ``path``.

    Raises:
        CurvlabError: a corrupt file (not UTF-8 text, no JSON, no JSON object).
    """
    return schema.read_json_object(path, "data directory's stats")


def data_vocab_size(data_dir: str | Path) -> int | None:
    """The vocabulary recorded in a curvlab data directory's ``stats.json`` (None if absent).

    Raises:
        CurvlabError: a corrupt ``stats.json``, or one whose ``vocab_size`` is no positive integer.
    """
    path = Path(data_dir) / "stats.json"
    if not path.is_file():
        return None
    vocab = read_stats_json(path).get("vocab_size")
    if type(vocab) is not int or vocab < 1:
        raise CurvlabError(f"{path}: corrupt stats (vocab_size {vocab!r} is no positive integer)")
    return vocab


@dataclass
class TokenData:
    """The train and validation token streams of a data directory, as lists of memmapped shards."""

    train: list[np.ndarray]
    val: list[np.ndarray]

    @classmethod
    def open(cls, data_dir: str | Path, vocab_size: int | None = None) -> TokenData:
        return cls(
            [read_shard(p, vocab_size) for p in find_shards(data_dir, "train")],
            [read_shard(p, vocab_size) for p in find_shards(data_dir, "val")],
        )


class TrainBatches:
    """Random ``(inputs, targets)`` windows of length ``seq_len`` from the train shards.

    Each batch draws, from a seeded ``numpy`` generator, a shard per row (weighted by its number of
    windows) and an offset inside it. ``state_dict()`` / ``load_state_dict()`` save and restore the
    generator, so a resumed run reads exactly the batches it would have read. ``rank``/``world``
    select a disjoint slice of each global batch (rows ``rank::world``): every rank draws the same
    global batch, so the data don't depend on the number of processes. ``last_rows`` holds the
    ``(shard, offset)`` of every row of the last global batch drawn.
    """

    def __init__(
        self, shards: list[np.ndarray], batch_size: int, seq_len: int, seed: int = 0, rank: int = 0, world: int = 1
    ):
        self.shards = [s for s in shards if s.size > seq_len + 1]
        if not self.shards:
            raise CurvlabError(f"no train shard holds more than seq_len + 1 = {seq_len + 1} tokens")
        if batch_size % world:
            raise CurvlabError(f"batch size {batch_size} is not divisible by {world} processes")
        self.batch_size, self.seq_len, self.rank, self.world = batch_size, seq_len, rank, world
        windows = np.array([s.size - seq_len - 1 for s in self.shards], dtype=np.float64)
        self._weights = windows / windows.sum()
        self._rng = np.random.default_rng(seed)
        self.last_rows: list[tuple[int, int]] = []

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        shard_ids = self._rng.choice(len(self.shards), size=self.batch_size, p=self._weights)
        offsets = [int(self._rng.integers(0, self.shards[i].size - self.seq_len - 1)) for i in shard_ids]
        self.last_rows = [(int(i), o) for i, o in zip(shard_ids, offsets)]
        rows = [
            np.asarray(self.shards[i][o : o + self.seq_len + 1], dtype=np.int64) for i, o in zip(shard_ids, offsets)
        ]
        mine = np.stack(rows)[self.rank :: self.world]
        return torch.from_numpy(mine[:, :-1].copy()), torch.from_numpy(mine[:, 1:].copy())

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self._rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._rng.bit_generator.state = state["rng"]


def validation_batches(
    shards: list[np.ndarray], batch_size: int, seq_len: int, n_windows: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed, deterministic set of ``n_windows`` non-overlapping windows from the start of the val
    stream, cut into batches of at most ``batch_size`` rows."""
    rows = []
    for s in shards:
        for o in range(0, s.size - seq_len - 1, seq_len):
            if len(rows) == n_windows:
                break
            rows.append(np.asarray(s[o : o + seq_len + 1], dtype=np.int64))
    if not rows:
        raise CurvlabError(f"the validation shards hold no window of {seq_len + 1} tokens")
    data = torch.from_numpy(np.stack(rows))
    return [(data[i : i + batch_size, :-1], data[i : i + batch_size, 1:]) for i in range(0, len(rows), batch_size)]
