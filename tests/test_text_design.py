"""The paired design on natural text (issue 53): the corpus curvlab makes from the Python documentation, and a
design run end to end at micro size on a user's text made into a data directory by ``curvlab data text``."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

import numpy as np
import pytest

from curvlab.cli import app
from curvlab.data.corpus import python_docs_documents, write_corpus
from curvlab.data.dataset import unigram_plateau_nats
from curvlab.data.shards import write_shard
from curvlab.errors import CurvlabError
from curvlab.jobs.presets import PRESETS
from curvlab.jobs.reproduce import Reproduction, on_user_data
from curvlab.studies.records import LevelData
from tests.builders import assert_refused, runner

WORDS = [
    "the",
    "a",
    "model",
    "step",
    "loss",
    "curvature",
    "of",
    "in",
    "on",
    "with",
    "is",
    "was",
    "muon",
    "adam",
    "learns",
    "grows",
    "falls",
    "flat",
    "sharp",
]


def write_text(path, lines=3000, seed=0):
    """Sentences of a small English-like vocabulary, one a line, with a Zipf-like word choice."""
    rng = np.random.default_rng(seed)
    p = 1 / np.arange(1, len(WORDS) + 1)
    words = rng.choice(WORDS, size=(lines, 9), p=p / p.sum())
    path.write_text("".join(" ".join(row).capitalize() + ".\n" for row in words), encoding="utf-8")
    return path


def test_the_python_documentation_corpus_is_made_offline_and_deterministically(tmp_path):
    documents, topics, files = python_docs_documents()
    assert topics > 50 and files > 500
    assert len(documents) > 1000 and all("\n" not in d and d == " ".join(d.split()) for d in documents)
    # the Language Reference's topics come first (pydoc_data.topics), then the standard library's docstrings
    assert any("assignment statement" in d.lower() for d in documents[:200])
    first = write_corpus("python-docs", tmp_path / "a.txt")
    second = write_corpus("python-docs", tmp_path / "b.txt")
    assert first == second and first["documents"] == len(documents) and first["files"] == files
    assert first["sha256"] == hashlib.sha256((tmp_path / "a.txt").read_bytes()).hexdigest()
    assert "PSF" in first["licence"] and first["bytes"] > 10**6
    with pytest.raises(CurvlabError, match="unknown corpus 'gutenberg'"):
        write_corpus("gutenberg", tmp_path / "c.txt")


@pytest.mark.heavy
def test_the_paired_design_runs_end_to_end_on_a_users_text(tmp_path):
    data = tmp_path / "data"
    args = ["data", "text", str(write_text(tmp_path / "corpus.txt")), "--out", str(data), "--vocab-size", "300"]
    result = runner.invoke(app, [*args, "--val-fraction", "0.1"])
    assert result.exit_code == 0, result.output
    micro = PRESETS["micro"]
    preset = replace(micro, language=replace(micro.language, s_values=(0.0,)), finetune=None)
    job = Reproduction(preset, tmp_path / "out", progress=False, data=data)
    summary = job.run()
    assert job.preset.tuning.lr_source == "search" and job.preset.language.corpus.startswith("data stats sha256:")
    config = json.loads((tmp_path / "out" / "reproduce.json").read_text())
    assert config["data"] == str(data.resolve())
    assert summary.tuning.mode == "search" and "the full search runs here" not in " ".join(job.log)
    levels = LevelData.load(tmp_path / "out" / "analysis" / "levels.json")
    assert levels.comparisons and {r.s for r in levels.comparisons} == {0.0}
    # the runs trained on the user's shards, and the plateau is the text's own unigram cross-entropy
    run = json.loads((tmp_path / "out" / "runs" / "s0" / "muon" / "seed0" / "config.json").read_text())
    assert run["data"] == str(data.resolve())
    assert summary.primary and any("Natural text" in n for n in summary.notes)
    assert 0 < unigram_plateau_nats(data) < np.log(300)


def test_user_data_refusals(tmp_path):
    PRESETS["text"].validate()
    assert PRESETS["text"].extras == {"tokenizers": "text"} and PRESETS["text"].tuning.lr_source == "search"
    with pytest.raises(CurvlabError, match="sweeps s"):
        on_user_data(PRESETS["standard"], tmp_path)
    with pytest.raises(CurvlabError, match="no such data directory"):
        on_user_data(PRESETS["quick"], tmp_path / "missing")
    assert_refused(["reproduce", "--preset", "robustness", "--data", str(tmp_path)], "--data is for the one-design")
    assert_refused(["reproduce", "--preset", "standard", "--data", str(tmp_path)], "sweeps s")
    # a vocabulary the design's model has no embedding for: refused before anything is written
    big = tmp_path / "big"
    big.mkdir()
    for split in ("train", "val"):
        write_shard(big / f"{split}_000000.bin", np.arange(2000) % 2000)
    (big / "stats.json").write_text(json.dumps({"vocab_size": 2000}))
    with pytest.raises(
        CurvlabError, match=r"a vocabulary of 2000 tokens, more than the quick design's model has \(1088\)"
    ):
        Reproduction(PRESETS["quick"], tmp_path / "out", progress=False, data=big)
    assert not (tmp_path / "out").exists()
    assert_refused(["reproduce", "--preset", "text", "--data", str(big), "--out", str(tmp_path / "o")], "2000 tokens")
    (big / "stats.json").unlink()
    with pytest.raises(CurvlabError, match="no stats.json"):
        on_user_data(PRESETS["quick"], big)
