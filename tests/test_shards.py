import numpy as np
import pytest
import torch

from curvlab.data.shards import (
    EVAL_MAGIC,
    HEADER_BYTES,
    LLAMA3_MAGIC,
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
        write_shard(tmp_path / "x.bin", np.array([70_000]), dtype=np.uint16)
    with pytest.raises(ValueError, match="uint32"):
        write_shard(tmp_path / "x.bin", np.array([-1]), dtype=np.uint32)
    with pytest.raises(ValueError, match="uint16 or uint32 tokens, not int64"):
        write_shard(tmp_path / "x.bin", np.array([1]), dtype=np.int64)
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


def hand_written(path, magic, version, tokens, dtype, count=None):
    """A headered shard written with plain numpy, per llm.c's own writer (dev/data/data_common.py): 256 int32
    (magic, version, token count, zeros), then the tokens."""
    header = np.zeros(256, dtype=np.int32)
    header[:3] = magic, version, len(tokens) if count is None else count
    path.write_bytes(header.tobytes() + np.asarray(tokens, dtype=dtype).tobytes())
    return path


def test_reads_hand_written_uint16_shards(tmp_path):
    tokens = np.random.default_rng(1).integers(0, 2**16, 777)
    back = read_shard(hand_written(tmp_path / "train_000000.bin", 20240520, 1, tokens, "<u2"), vocab_size=2**16)
    assert back.dtype == np.uint16 and np.array_equal(back, tokens)


def test_llama3_shards_round_trip_beyond_65536(tmp_path):
    tokens = np.random.default_rng(2).integers(0, 128_256, 1000)
    tokens[:3] = 65_535, 65_536, 128_255  # (either side of uint16's end)
    hand = read_shard(hand_written(tmp_path / "train_000000.bin", 20240801, 7, tokens, "<u4"), vocab_size=128_256)
    assert hand.dtype == np.uint32 and np.array_equal(hand, tokens)
    with pytest.raises(ValueError, match="token 128255 is beyond the vocabulary of 128000"):
        read_shard(tmp_path / "train_000000.bin", vocab_size=128_000)
    # curvlab's writer: uint32 in llm.c's Llama-3 layout when a token needs it, byte for byte the hand-written file
    write_shard(tmp_path / "mine.bin", tokens)
    assert (tmp_path / "mine.bin").read_bytes() == (tmp_path / "train_000000.bin").read_bytes()
    assert LLAMA3_MAGIC == 20240801
    # uint16 when every token fits, or uint32 when asked
    write_shard(tmp_path / "small.bin", tokens % 2**16)
    assert read_shard(tmp_path / "small.bin").dtype == np.uint16
    write_shard(tmp_path / "wide.bin", tokens % 2**16, dtype=np.uint32)
    wide = read_shard(tmp_path / "wide.bin")
    assert wide.dtype == np.uint32 and np.array_equal(wide, tokens % 2**16)
    x, _ = validation_batches([hand], batch_size=2, seq_len=4, n_windows=2)[0]  # (cast to int64, whatever the dtype)
    assert x.dtype == torch.int64 and x[0, 1].item() == 65_536 and x[0, 2].item() == 128_255


def test_llama3_shards_checked_as_the_others(tmp_path):
    tokens = np.arange(70_000, 70_010)
    with pytest.raises(ValueError, match="unsupported shard version 1 \\(expected 7 for magic 20240801\\)"):
        read_shard(hand_written(tmp_path / "a.bin", 20240801, 1, tokens, "<u4"))
    with pytest.raises(ValueError, match="header says 11 tokens but the file holds 10 uint32 tokens"):
        read_shard(hand_written(tmp_path / "b.bin", 20240801, 7, tokens, "<u4", count=11))
    # uint16 tokens under a uint32 header: the size gives it away
    with pytest.raises(ValueError, match="header says 10 tokens but the file holds 5 uint32 tokens"):
        read_shard(hand_written(tmp_path / "c.bin", 20240801, 7, tokens - 70_000, "<u2"))


def test_llmc_eval_files_are_refused_by_name(tmp_path):
    # llm.c's write_evalfile: magic 20240522, version 1, the number of examples, the longest example's
    # length, then uint16 records of the examples
    header = np.zeros(256, dtype=np.int32)
    header[:4] = 20240522, 1, 2, 10
    path = tmp_path / "hellaswag_val.bin"
    path.write_bytes(header.tobytes() + np.arange(20, dtype=np.uint16).tobytes())
    with pytest.raises(ValueError, match=r"an llm.c eval file \(magic 20240522\), not a token shard") as e:
        read_shard(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value) and EVAL_MAGIC == 20240522


def test_reads_a_hand_written_raw_nanogpt_train_bin(tmp_path):
    # nanoGPT's prepare.py: np.memmap(filename, dtype=np.uint16, mode="w+") filled with the tokens, no header
    tokens = np.random.default_rng(3).integers(0, 50_257, 999)
    memmap = np.memmap(tmp_path / "train.bin", dtype=np.uint16, mode="w+", shape=(tokens.size,))
    memmap[:] = tokens
    memmap.flush()
    del memmap
    back = read_shard(tmp_path / "train.bin", vocab_size=50_257)
    assert isinstance(back, np.memmap) and back.dtype == np.uint16 and np.array_equal(back, tokens)
