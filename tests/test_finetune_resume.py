"""An adaptation run (peft LoRA) goes through the training loop of full-model runs, so it resumes bit
for bit: N steps straight against N/2, a crash, and N/2 resumed, compared exactly (adapter weights,
optimizer, schedule, loader and RNG states, metrics and curvature rows)."""

import json
from dataclasses import replace

import pytest
import torch

from curvlab.data.shards import TrainBatches
from curvlab.errors import CurvlabError
from curvlab.models.gpt import GPT, get_config
from curvlab.runs.adapt import adapt
from curvlab.runs.checkpoint import load_checkpoint, read_index, save_checkpoint
from curvlab.runs.config import TrainConfig
from tests.builders import SMALL_MODEL, crash_training_after
from tests.reference import assert_same

STEPS = 8


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    torch.manual_seed(0)
    cfg = get_config("tiny", **SMALL_MODEL)
    path = tmp_path_factory.mktemp("base") / "base.pt"
    save_checkpoint(path, {"model_config": cfg.to_dict(), "model": GPT(cfg).state_dict(), "config": {}})
    return path


def config(data, out):
    # wsd over 8 steps: stable from step 1 to 5, so the monitor measures the steps taken from 2 and 4
    return TrainConfig(
        data=str(data),
        out=str(out),
        optimizer="smuon",
        optimizer_options={"lr": 0.02},
        batch_size=4,
        seq_len=16,
        steps=STEPS,
        warmup_steps=1,
        schedule="wsd",
        cooldown_frac=0.25,
        eval_every=2,
        ckpt_every=2,
        val_windows=4,
        device="cpu",
    )


def metrics(run):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in ("seconds", "row_digest")} for r in rows]  # (timing, its digest)


def test_adaptation_resumes_bit_for_bit(pcfg_data, base, tmp_path, monkeypatch):
    whole = config(pcfg_data, tmp_path / "whole")
    final = adapt(whole, base, 2, heldout_windows=2, progress=False)

    cut = replace(whole, out=str(tmp_path / "cut"))
    put_back = crash_training_after(monkeypatch, STEPS // 2)
    with pytest.raises(KeyboardInterrupt):
        adapt(cut, base, 2, heldout_windows=2, progress=False)
    put_back()
    assert [e["step"] for e in read_index(tmp_path / "cut")] == [0, 2, 4]
    with pytest.raises(CurvlabError, match="other settings; refusing to resume.*rank 3"):
        adapt(cut, base, 3, heldout_windows=2, progress=False)

    served = {"n": 0}
    real_next = TrainBatches.next

    def counting_next(self):
        served["n"] += 1
        return real_next(self)

    monkeypatch.setattr(TrainBatches, "next", counting_next)
    assert adapt(cut, base, 2, heldout_windows=2, progress=False) == final
    assert served["n"] == STEPS // 2  # resumed from step 4, not started over

    index = read_index(tmp_path / "whole")
    assert index == read_index(tmp_path / "cut") and [e["step"] for e in index] == [0, 2, 4, 6, 8]
    for entry in index:
        a = load_checkpoint(tmp_path / "whole" / entry["path"])
        b = load_checkpoint(tmp_path / "cut" / entry["path"])
        assert "model" not in a and a["base"] == {"base": str(base), "rank": 2, "alpha": 4}
        assert all(".lora_" in n for n in a["adapter"]) and a["adapter"]
        for key in ("step", "base", "adapter", "optimizer", "scheduler", "data", "rng", "val_loss"):
            assert_same(a[key], b[key])
        assert a["config"] == {**b["config"], "out": str(tmp_path / "whole")}
    assert load_checkpoint(tmp_path / "whole" / index[-1]["path"])["optimizer"]["state"]  # SMuon's momenta

    rows = metrics(tmp_path / "whole")
    assert [r["step"] for r in rows if r.get("kind") == "curvature"] == [2, 4]
    assert [r["step"] for r in rows if r.get("kind") != "curvature"] == list(range(1, STEPS + 1))
    assert_same(metrics(tmp_path / "cut"), rows)
