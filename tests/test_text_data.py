"""``curvlab data text``: a user's text (or nanochat's parquet shards) tokenized into a data directory that
``curvlab train --data`` reads, with its tokenizer, split rule and unigram statistics recorded."""

import hashlib
import json
import os
import signal
import subprocess
import sys

import numpy as np

# (the dev extra installs them: a suite without them fails here rather than skipping)
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tokenizers
from typer.testing import CliRunner

from curvlab.cli import app
from curvlab.data import text
from curvlab.data.shards import find_shards, read_shard
from curvlab.util.atomic import TEMPORARY_SUFFIX

runner = CliRunner()
WORDS = "the cat sat on a mat and dog ran over über naïve café 字 🙂 fence quickly, then; stopped.".split()  # noqa: SIM905 (the words, one line)


def corpus(n_lines, seed=0):
    """Lines of words (some not ASCII), each with its newline; some empty, one with a CRLF ending."""
    rng = np.random.default_rng(seed)
    lines = [" ".join(rng.choice(WORDS, rng.integers(0, 12))) + "\n" for _ in range(n_lines)]
    lines[3] = lines[3][:-1] + "\r\n"
    return lines


def make_text(tmp_path, n_lines=1200, name="corpus.txt"):
    lines = corpus(n_lines)
    text = "".join(lines) + "no newline at the end"  # (a last line without its newline is a document too)
    path = tmp_path / name
    path.write_bytes(text.encode("utf-8"))
    return path, [*lines, "no newline at the end"]


def data_text(*args):
    return runner.invoke(app, ["data", "text", *map(str, args)])


def stream(directory, split):
    return np.concatenate([np.asarray(read_shard(p)) for p in find_shards(directory, split)])


def validation_lines(n, fraction, seed=0):
    """The stated split rule, restated: k = min(N - 1, max(1, round(fraction N))) lines drawn by default_rng(seed)."""
    k = min(n - 1, max(1, round(fraction * n)))
    return set(np.random.default_rng(seed).choice(n, k, replace=False).tolist())


def test_trained_bpe_round_trips_and_the_shards_hold_the_encodings(tmp_path):
    path, lines = make_text(tmp_path)
    out = tmp_path / "data"
    r = data_text(path, "--out", out, "--vocab-size", 300, "--val-fraction", 0.05, "--shard-tokens", "2k")
    assert r.exit_code == 0, r.output
    stats = json.loads((out / "stats.json").read_text())
    tokenizer = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    text = path.read_bytes().decode("utf-8")  # (read_text would turn the CRLF into LF)
    assert text == "".join(lines) and tokenizer.decode(tokenizer.encode(text).ids) == text
    assert stats["tokenizer"]["sha256"] == hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()
    assert stats["vocab_size"] == tokenizer.get_vocab_size() <= 300 and tokenizer.token_to_id("<|endoftext|>") == 0
    # the shards: each split's lines encoded one by one, in order, by the stated rule
    val = validation_lines(len(lines), 0.05)
    for split, mine in (("train", lambda i: i not in val), ("val", lambda i: i in val)):
        docs = [line for i, line in enumerate(lines) if mine(i)]
        encodings = [tokenizer.encode(d, add_special_tokens=False).ids for d in docs]
        tokens = stream(out, split)
        assert stats[split]["tokens"] == tokens.size == sum(map(len, encodings))
        assert stats[split]["documents"] == len(docs)
        assert np.array_equal(tokens, np.concatenate(encodings)) and tokenizer.decode(tokens.tolist()) == "".join(docs)
    assert len(find_shards(out, "train")) == stats["train"]["shards"] > 1  # (2k tokens a shard)
    # the unigram entropy of the train tokens, in nats and bits, against numpy
    counts = np.bincount(stream(out, "train"))
    p = counts[counts > 0] / counts.sum()
    assert stats["train"]["entropy_nats"] == pytest.approx(-(p * np.log(p)).sum(), rel=1e-12)
    assert stats["train"]["entropy_bits"] == pytest.approx(-(p * np.log2(p)).sum(), rel=1e-12)
    # the inputs and the rule, recorded
    assert stats["inputs"] == [
        {"name": "corpus.txt", "size": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    ]
    assert "default_rng(0).choice(N, k, replace=False)" in stats["split"] and f"N = {len(lines)}" in stats["split"]
    assert "train" in r.output and f"wrote {out}" in r.output


@pytest.mark.heavy  # (starts a process)
def test_the_trained_tokenizer_is_deterministic_and_a_given_one_is_used_as_it_is(tmp_path):
    path, _ = make_text(tmp_path, n_lines=600)
    for name in ("a", "b"):
        assert data_text(path, "--out", tmp_path / name, "--vocab-size", 290).exit_code == 0
    digests = [json.loads((tmp_path / n / "stats.json").read_text())["tokenizer"]["sha256"] for n in ("a", "b")]
    assert digests[0] == digests[1]
    # a separate process (another hashing of its maps) trains the same tokenizer
    child = "from curvlab.data.text import text_to_shards; import sys; print(text_to_shards([sys.argv[1]], sys.argv[2], vocab_size=290, progress=False)['tokenizer']['sha256'])"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "123"}
    done = subprocess.run([sys.executable, "-c", child, path, tmp_path / "c"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == digests[0]
    # the tokenizer.json given: copied as it is, and the same shards
    r = data_text(path, "--out", tmp_path / "given", "--tokenizer", tmp_path / "a" / "tokenizer.json")
    assert r.exit_code == 0, r.output
    given = json.loads((tmp_path / "given" / "stats.json").read_text())
    assert given["tokenizer"]["sha256"] == digests[0] and not given["tokenizer"]["trained"]
    for split in ("train", "val"):
        assert np.array_equal(stream(tmp_path / "given", split), stream(tmp_path / "a", split))


def test_a_finished_directory_is_a_no_op_and_another_config_is_refused(tmp_path):
    path, _ = make_text(tmp_path, n_lines=300)
    out = tmp_path / "data"
    assert data_text(path, "--out", out, "--vocab-size", 280).exit_code == 0
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert data_text(path, "--out", out, "--vocab-size", 280).exit_code == 0
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    r = data_text(path, "--out", out, "--vocab-size", 281)
    assert r.exit_code == 2 and r.output.strip().splitlines()[-1].startswith("error: ")
    assert "already holds a dataset made with another config" in r.output
    r = data_text(path, "--out", out, "--vocab-size", 280, "--tokenizer", out / "tokenizer.json")
    assert r.exit_code == 2 and "one of them" in r.output


@pytest.mark.heavy  # (starts a process)
def test_a_killed_run_leaves_no_shard_and_running_it_again_finishes_the_job(tmp_path):
    path, _ = make_text(tmp_path, n_lines=600)
    out = tmp_path / "data"
    # a run killed (kill -9) right after its first shard was written
    child = (
        "import os, signal, sys\n"
        "import curvlab.data.text as text\n"
        "write = text.write_shard\n"
        "def write_then_die(path, tokens, dtype=None):\n"
        "    write(path, tokens, dtype=dtype)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "text.write_shard = write_then_die\n"
        "text.text_to_shards([sys.argv[1]], sys.argv[2], vocab_size=300, shard_tokens='1k', progress=False)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    killed = subprocess.run([sys.executable, "-c", child, path, out], env=env, capture_output=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not out.exists()
    left = list(tmp_path.glob(f".data.*{TEMPORARY_SUFFIX}"))
    assert len(left) == 1 and [p.name for p in left[0].glob("*.bin")] == ["train_000000.bin"]
    # the same command again: the killed run's directory removed, the job done whole
    r = data_text(path, "--out", out, "--vocab-size", 300, "--shard-tokens", "1k")
    assert r.exit_code == 0, r.output
    assert not list(tmp_path.glob(f".data.*{TEMPORARY_SUFFIX}"))
    assert data_text(path, "--out", tmp_path / "clean", "--vocab-size", 300, "--shard-tokens", "1k").exit_code == 0
    names = sorted(p.name for p in out.iterdir() if p.name != "stats.json")
    assert names == sorted(p.name for p in (tmp_path / "clean").iterdir() if p.name != "stats.json")
    assert all((out / n).read_bytes() == (tmp_path / "clean" / n).read_bytes() for n in names)


def test_binary_and_non_utf8_inputs_are_refused_by_name_and_offset(tmp_path):
    good, _ = make_text(tmp_path, n_lines=50)
    binary = tmp_path / "image.bin"
    binary.write_bytes(b"GIF89a\x01\x00\x00\x00")
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\u00e9 ol\u00e9\n".encode("utf-8") * 1000 + "caf\u00e9\n".encode("latin-1"))
    cut = tmp_path / "cut.txt"
    cut.write_bytes("abc 字".encode()[:-1])  # (a character cut short at the end of the file)
    for bad, what in [
        (binary, "a binary file (a NUL byte at byte offset 7), not UTF-8 text"),
        (latin, f"not UTF-8 text (byte 0xe9 at byte offset {len('café olé'.encode()) * 1000 + 1000 + 3})"),
        (cut, "not UTF-8 text (byte 0xe5 at byte offset 4)"),
    ]:
        r = data_text(good, bad, "--out", tmp_path / "out", "--vocab-size", 300)
        assert r.exit_code == 2, r.output
        assert r.output.strip().splitlines()[-1] == f"error: {bad}: {what}"  # (after a progress bar, if any)
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 1 << 20])
def test_the_first_bad_byte_is_found_across_chunks(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(text, "_CHUNK", chunk)  # (characters cut across the chunks read)
    path = tmp_path / "t.txt"
    for data in [
        "aé字🙂".encode() + b"\xff",
        "字字".encode()[:-1] + b"b",
        "é".encode() + b"\0",
        b"\xe5\x00",
        "🙂".encode()[:3],
    ]:
        path.write_bytes(data)
        try:
            data.decode("utf-8")
            first = len(data)
        except UnicodeDecodeError as e:
            first = e.start
        first = min(first, data.find(b"\0") % (len(data) + 1))  # (no NUL: find's -1 becomes len(data))
        with pytest.raises(ValueError, match=f"at byte offset {first}\\)"):
            text.scan_text(path)
    path.write_bytes("aé字🙂\r\nb\n\nc".encode())
    assert text.scan_text(path).documents == 4


def test_parquet_shards_the_last_by_name_is_validation(tmp_path):
    docs = {name: ["".join(corpus(5, seed=k)) for k in range(i * 20, i * 20 + 20)] for i, name in
            enumerate(["shard_00002.parquet", "shard_00000.parquet", "shard_00001.parquet"])}  # fmt: skip
    for name, texts in docs.items():
        pq.write_table(pa.table({"text": texts, "id": list(range(len(texts)))}), tmp_path / name)
    out = tmp_path / "data"
    r = data_text(*(tmp_path / n for n in docs), "--out", out, "--vocab-size", 300)
    assert r.exit_code == 0, r.output
    stats = json.loads((out / "stats.json").read_text())
    assert [i["name"] for i in stats["inputs"]] == ["shard_00000.parquet", "shard_00001.parquet", "shard_00002.parquet"]
    assert stats["split"].startswith("parquet: the last file by name (shard_00002.parquet) is validation")
    tokenizer = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    end = tokenizer.token_to_id("<|endoftext|>")
    assert stats["document_end"] == {"token": "<|endoftext|>", "id": end}

    def encoded(texts):  # each document, then <|endoftext|>
        return np.concatenate([[*tokenizer.encode(t, add_special_tokens=False).ids, end] for t in texts])

    train = docs["shard_00000.parquet"] + docs["shard_00001.parquet"]
    assert np.array_equal(stream(out, "train"), encoded(train)) and stats["train"]["documents"] == 40
    assert np.array_equal(stream(out, "val"), encoded(docs["shard_00002.parquet"]))
    # a fraction means nothing here; one file alone has no validation; no text column
    r = data_text(*(tmp_path / n for n in docs), "--out", tmp_path / "x", "--vocab-size", 300, "--val-fraction", 0.1)
    assert r.exit_code == 2 and "drop --val-fraction" in r.output
    r = data_text(tmp_path / "shard_00000.parquet", "--out", tmp_path / "x", "--vocab-size", 300)
    assert r.exit_code == 2 and "one parquet file" in r.output
    pq.write_table(pa.table({"content": ["a"]}), tmp_path / "other.parquet")
    r = data_text(
        tmp_path / "other.parquet", tmp_path / "shard_00000.parquet", "--out", tmp_path / "x", "--vocab-size", 300
    )
    assert r.exit_code == 2 and "other.parquet: no `text` column (its columns: content)" in r.output


def test_a_vocabulary_beyond_65536_goes_to_uint32_shards(tmp_path):
    vocab = {f"w{i}": i for i in range(70_000)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    ids = np.random.default_rng(0).integers(60_000, 70_000, (200, 6))
    (tmp_path / "t.txt").write_text("".join(" ".join(f"w{i}" for i in row) + "\n" for row in ids))
    out = tmp_path / "data"
    r = data_text(tmp_path / "t.txt", "--out", out, "--tokenizer", tmp_path / "tokenizer.json", "--val-fraction", 0.1)
    assert r.exit_code == 0, r.output
    assert json.loads((out / "stats.json").read_text())["vocab_size"] == 70_000
    val = validation_lines(200, 0.1)
    train = np.concatenate([row for i, row in enumerate(ids) if i not in val])
    assert read_shard(out / "train_000000.bin").dtype == np.uint32
    assert np.array_equal(stream(out, "train"), train) and train.max() >= 65_536


def test_missing_extras_are_named(tmp_path, monkeypatch):
    path, _ = make_text(tmp_path, n_lines=20)
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # (import tokenizers then raises ImportError)
    r = data_text(path, "--out", tmp_path / "out", "--vocab-size", 300)
    assert r.exit_code == 2 and r.output.strip() == r.output.strip().splitlines()[0]  # (one line: before any bar)
    assert "needs tokenizers, which is not installed: pip install -e '.[text]'" in r.output


@pytest.mark.heavy
def test_curvlab_train_reads_the_directory(tmp_path):
    path, _ = make_text(tmp_path, n_lines=800)
    data = tmp_path / "data"
    assert data_text(path, "--out", data, "--vocab-size", 300, "--val-fraction", 0.1).exit_code == 0
    args = ["train", "--data", str(data), "--out", str(tmp_path / "run"), "--optimizer", "adamw", "--steps", "2"]
    args += ["--quiet", "--batch-size", "4", "--warmup-steps", "1", "--val-windows", "4", "--ckpt-every", "2"]
    for opt in ("n_layer=1", "n_embd=16", "n_head=2", "block_size=16"):
        args += ["--model-opt", opt]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "trained adamw to step 2" in r.output and (tmp_path / "run" / "ckpt_000002.pt").is_file()
