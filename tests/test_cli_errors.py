"""Bad input on the command line: each case exits with status 2, says what is wrong in one line, and
leaves no file behind; a bad --out is refused before anything is computed."""

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

import curvlab.analysis.checkpoint
from curvlab.cli import app
from tests.builders import assert_refused, runner


def broken_copy(checkpoint: Path, tmp_path: Path, name: str, content: bytes) -> Path:
    """A copy of the checkpoint directory with file ``name`` replaced by ``content``."""
    copy = tmp_path / "ckpt"
    shutil.copytree(checkpoint, copy)
    (copy / name).write_bytes(content)
    return copy


LFS = b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"ab" * 32 + b"\nsize 123456\n"


def test_a_truncated_or_lfs_pointer_weights_file(trainer_checkpoint, tmp_path):
    path, data = trainer_checkpoint
    weights = (path / "model.safetensors").read_bytes()
    out = tmp_path / "report.json"
    cut = broken_copy(path, tmp_path / "cut", "model.safetensors", weights[: len(weights) // 2])
    assert_refused(["nds", cut, "--data", data, "--out", out], "model.safetensors", "truncated", out=out)
    header = broken_copy(path, tmp_path / "header", "model.safetensors", weights[:20])  # inside the header
    assert_refused(["nds", header, "--data", data, "--out", out], "model.safetensors", "cut short", out=out)
    lfs = broken_copy(path, tmp_path / "lfs", "model.safetensors", LFS)
    assert_refused(["nds", lfs, "--data", data, "--out", out], "Git LFS pointer", "git lfs pull", out=out)


def test_an_optimizer_file_of_text_or_random_bytes(trainer_checkpoint, tmp_path):
    path, data = trainer_checkpoint
    out = tmp_path / "report.json"
    text = broken_copy(path, tmp_path / "text", "optimizer.pt", b"this is not an optimizer\n")
    assert_refused(["nds", text, "--data", data, "--out", out], "optimizer.pt", "optimizer state", out=out)
    lfs = broken_copy(path, tmp_path / "lfs", "optimizer.pt", LFS)
    assert_refused(["nds", lfs, "--data", data, "--out", out], "optimizer.pt", "Git LFS pointer", out=out)
    rng = np.random.default_rng(0)
    # random bytes, and random bytes behind a pickle opcode (what reached IndexError before)
    contents = [rng.bytes(int(n)) for n in rng.integers(1, 3000, 12)]
    contents += [
        bytes([0x80, int(k)]) + rng.bytes(int(n)) for k, n in zip(rng.integers(0, 6, 12), rng.integers(2, 300, 12))
    ]
    whole = (path / "optimizer.pt").read_bytes()
    contents.append(whole[: len(whole) // 2])  # a torch.save file cut short
    for i, content in enumerate(contents):
        bad = broken_copy(path, tmp_path / f"random{i}", "optimizer.pt", content)
        assert_refused(["nds", bad, "--data", data, "--out", out], "optimizer.pt", out=out)


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory this process can't create files in: a chmod 0555 one, or, for root (whom permission
    bits don't bind), /sys, a read-only file system in containers."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        for candidate in (folder, Path("/sys")):
            try:
                fd, probe = tempfile.mkstemp(dir=candidate)
            except OSError:
                yield candidate
                return
            os.close(fd)
            os.unlink(probe)
        raise AssertionError("no read-only directory to test with")
    finally:
        folder.chmod(0o755)


def test_a_bad_out_is_refused_before_computing(trainer_checkpoint, tmp_path, read_only_dir, monkeypatch):
    path, data = trainer_checkpoint
    calls = []
    monkeypatch.setattr(curvlab.analysis.checkpoint, "analyze_checkpoint", lambda *a, **k: calls.append(a))  # nds's
    out = read_only_dir / "report.json"
    assert_refused(["nds", path, "--data", data, "--out", out], str(read_only_dir), "can't write", out=out)
    existing = tmp_path / "a-directory"
    existing.mkdir()
    assert_refused(["nds", path, "--data", data, "--out", existing], "is an existing directory", out=existing)
    assert calls == []  # refused before the analysis ran
    a_file = tmp_path / "a-file"
    a_file.write_text("keep me")
    for command in (["compare", tmp_path, tmp_path, "--out", a_file], ["track", tmp_path, "--out", a_file]):
        assert_refused(command, "is not a directory")
    assert a_file.read_text() == "keep me"
    assert_refused(["compare", tmp_path, tmp_path, "--out", read_only_dir / "cmp"], "can't write")
    data_arg = ["--data", data, "--steps", "1", "--quiet"]
    assert_refused(["train", "--out", read_only_dir / "run", *data_arg], "can't write")


def test_a_trainer_report_is_strict_json(trainer_checkpoint, tmp_path):
    import json

    path, data = trainer_checkpoint
    out = tmp_path / "report.json"
    r = runner.invoke(app, ["nds", str(path), "--data", str(data), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "val loss none recorded" in r.output  # a Trainer checkpoint records no validation loss

    def refuse(constant):
        raise AssertionError(f"{constant} is not JSON")

    report = json.loads(out.read_text(), parse_constant=refuse)
    assert report["val_loss"] is None and report["step"] == 2
