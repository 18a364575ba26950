import numpy as np
import pytest
import torch

from curvlab.data.shards import (
    HEADER_BYTES,
    MAGIC,
    TokenData,
    TrainBatches,
    read_shard,
    validation_batches,
    write_shard,
)


def test_shard_round_trip_matches_the_llmc_layout(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 50_000, 1234)
    path = tmp_path / "train_000000.bin"
    write_shard(path, tokens)
    raw = path.read_bytes()
    header = np.frombuffer(raw[:HEADER_BYTES], dtype=np.int32)
    assert header[0] == MAGIC and header[1] == 1 and header[2] == 1234 and not header[3:].any()
    assert np.array_equal(np.frombuffer(raw[HEADER_BYTES:], dtype=np.uint16), tokens)
    back = read_shard(path)
    assert isinstance(back, np.memmap) and np.array_equal(back, tokens)


def test_reads_nanogpt_raw_bins(tmp_path):
    tokens = np.arange(300, dtype=np.uint16)
    tokens.tofile(tmp_path / "train.bin")
    tokens[:100].tofile(tmp_path / "val.bin")
    data = TokenData.open(tmp_path)
    assert np.array_equal(data.train[0], tokens) and np.array_equal(data.val[0], tokens[:100])


def test_corrupt_shards_are_named(tmp_path):
    path = tmp_path / "train_000000.bin"
    write_shard(path, np.arange(10))
    raw = bytearray(path.read_bytes())

    def corrupt(offset, value):
        bad = bytearray(raw)
        bad[offset : offset + 4] = np.int32(value).tobytes()
        p = tmp_path / f"bad_{offset}_{value}.bin"
        p.write_bytes(bytes(bad))
        return p

    with pytest.raises(ValueError, match="wrong magic number 7"):
        read_shard(corrupt(0, 7))
    with pytest.raises(ValueError, match="unsupported shard version 2"):
        read_shard(corrupt(4, 2))
    with pytest.raises(ValueError, match="header says 11 tokens but the file holds 10"):
        read_shard(corrupt(8, 11))
    with pytest.raises(ValueError, match="token 9 is beyond the vocabulary of 5"):
        read_shard(path, vocab_size=5)
    with pytest.raises(ValueError, match="no such shard"):
        read_shard(tmp_path / "missing.bin")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no train shards"):
        TokenData.open(tmp_path / "empty")
    with pytest.raises(ValueError, match="no such data directory"):
        TokenData.open(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="uint16"):
        write_shard(tmp_path / "x.bin", np.array([70_000]))
    assert not (tmp_path / "x.bin").exists()


def test_train_batches_resume_and_split_across_ranks(tmp_path):
    shards = [np.arange(1000) % 97, np.arange(500) % 89 + 100]
    loader = TrainBatches(shards, batch_size=4, seq_len=16, seed=3)
    x, y = loader.next()
    assert x.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    state = loader.state_dict()
    after = [loader.next() for _ in range(3)]
    again = TrainBatches(shards, batch_size=4, seq_len=16, seed=999)
    again.load_state_dict(state)
    for (a, b), (c, d) in zip(after, [again.next() for _ in range(3)]):
        assert torch.equal(a, c) and torch.equal(b, d)
    full = TrainBatches(shards, batch_size=4, seq_len=16, seed=5).next()[0]
    parts = [TrainBatches(shards, batch_size=4, seq_len=16, seed=5, rank=r, world=2).next()[0] for r in range(2)]
    assert torch.equal(full[0::2], parts[0]) and torch.equal(full[1::2], parts[1])


def test_validation_batches_are_fixed():
    shard = np.arange(1000) % 50
    a = validation_batches([shard], batch_size=3, seq_len=10, n_windows=7)
    b = validation_batches([shard], batch_size=3, seq_len=10, n_windows=7)
    assert [x.shape[0] for x, _ in a] == [3, 3, 1]
    assert all(torch.equal(x, u) and torch.equal(y, v) for (x, y), (u, v) in zip(a, b))
    assert torch.equal(a[0][0][1], torch.from_numpy(shard[10:20]).long())
