import errno
import json
import math
from dataclasses import replace

import pytest
import torch

from curvlab.engine.loss import make_loss_fn
from curvlab.errors import CurvlabError
from curvlab.models.gpt import CONFIGS, GPT
from curvlab.runs.checkpoint import load_checkpoint, read_index
from curvlab.runs.config import TrainConfig
from curvlab.runs.train import TrainingDiverged, build_run, restore, train
from curvlab.steps.update import next_update
from tests.builders import SMALL_MODEL, crash_training_after, small_config
from tests.reference import assert_same


def config(data, out, **kw):
    return small_config(data, out, **{"warmup_steps": 2, "eval_every": 4, "ckpt_every": 4, **kw})


def final_state(out):
    ckpt = load_checkpoint(out / read_index(out)[-1]["path"])
    return ckpt["model"], ckpt["optimizer"]


def test_parameter_counts_of_named_configs():
    counts = {name: GPT(cfg).num_parameters() for name, cfg in CONFIGS.items() if name != "gpt2-124m"}
    assert counts == {"tiny": 1_019_600, "pcfg-9m": 8_593_056}
    cfg = CONFIGS["gpt2-124m"]  # counted without building it: 12 blocks of 12 d² + 4 d (norms), tied embeddings
    d = cfg.n_embd
    expected = cfg.vocab_size * d + cfg.block_size * d + cfg.n_layer * (12 * d * d + 2 * d) + d
    with torch.device("meta"):
        assert GPT(cfg).num_parameters() == expected == 124_373_760


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_loss_falls_on_pcfg_data(pcfg_data, tmp_path, optimizer):
    cfg = config(pcfg_data, tmp_path / optimizer, optimizer=optimizer, steps=40, ckpt_every=40, eval_every=40)
    result = train(cfg, progress=False)
    losses = [
        json.loads(line)["train_loss"] for line in (tmp_path / optimizer / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5
    assert result.step == 40 and math.isfinite(result.val_loss)
    assert [e["step"] for e in read_index(tmp_path / optimizer)] == [0, 40]


def test_resume_equals_uninterrupted_run(pcfg_data, tmp_path, monkeypatch):
    cfg = config(pcfg_data, tmp_path / "whole")
    train(cfg, progress=False)
    interrupted = replace(cfg, out=str(tmp_path / "cut"))
    restore_loader = crash_training_after(monkeypatch, 6)
    with pytest.raises(KeyboardInterrupt):
        train(interrupted, progress=False)
    restore_loader()
    assert [e["step"] for e in read_index(tmp_path / "cut")] == [0, 4]
    result = train(interrupted, progress=False)
    assert result.resumed_from == 4 and result.step == 12
    assert_same(final_state(tmp_path / "cut"), final_state(tmp_path / "whole"))
    whole = (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()
    cut = (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["train_loss"] for x in cut] == [json.loads(x)["train_loss"] for x in whole]


def test_checkpoint_reproduces_the_next_step(pcfg_data, tmp_path):
    cfg = config(pcfg_data, tmp_path / "r", optimizer="muon", steps=6, ckpt_every=1, eval_every=1)
    train(cfg, progress=False)
    for step in (0, 3):
        run = build_run(cfg)
        restore(run, load_checkpoint(tmp_path / "r" / f"ckpt_{step:06d}.pt"))
        batch = run.loader.next()
        _, Z = next_update(run.model, run.optimizer, make_loss_fn(run.model), batch, max_grad_norm=cfg.grad_clip)
        after = load_checkpoint(tmp_path / "r" / f"ckpt_{step + 1:06d}.pt")["model"]
        for name, p in run.model.named_parameters():
            assert torch.equal(Z[name], (p.detach().double() - after[name].double()).float()), (step, name)


def test_crash_during_checkpoint_write_keeps_the_last_good_one(pcfg_data, tmp_path, monkeypatch):
    cfg = config(pcfg_data, tmp_path / "k", steps=8)
    out = tmp_path / "k"
    real_save = torch.save
    calls = {"n": 0}

    def dying_save(obj, f, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # the step-4 checkpoint: write half, then die
            f.write(b"PK\x03\x04 half a zip file")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(CurvlabError, match=r"ckpt_000004.pt: write failed \(No space left on device\)"):  # one line
        train(cfg, progress=False)
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []  # no temporary files left
    assert [e["step"] for e in read_index(out)] == [0]
    assert load_checkpoint(out / "ckpt_000000.pt")["step"] == 0
    monkeypatch.setattr(torch, "save", real_save)
    assert train(cfg, progress=False).step == 8


def test_bad_inputs(pcfg_data, tmp_path):
    with pytest.raises(ValueError, match="no such data directory"):
        train(config(tmp_path / "nodata", tmp_path / "o1"), progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no train shards"):
        train(config(tmp_path / "empty", tmp_path / "o2"), progress=False)
    with pytest.raises(ValueError, match=r"vocabulary \(4413\) is larger than the model's \(100\)"):
        train(config(pcfg_data, tmp_path / "o3", model_overrides={**SMALL_MODEL, "vocab_size": 100}), progress=False)
    cfg = config(pcfg_data, tmp_path / "o4", steps=4)
    train(cfg, progress=False)
    with pytest.raises(ValueError, match=r"another config.*batch_size: 8 -> 4"):
        train(replace(cfg, batch_size=4), progress=False)
    (tmp_path / "o4" / "ckpt_000004.pt").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="ckpt_000004.pt: corrupt"):
        train(replace(cfg, steps=4), progress=False)
    with pytest.raises(ValueError, match="unknown schedule"):
        train(config(pcfg_data, tmp_path / "o5", schedule="step"), progress=False)


def test_non_finite_loss_stops_and_keeps_last_checkpoint(pcfg_data, tmp_path):
    cfg = config(pcfg_data, tmp_path / "nan", optimizer="sgd", optimizer_options={"lr": 1e6}, grad_clip=None, steps=30)
    with pytest.raises(TrainingDiverged, match="non-finite training loss at step"):
        train(cfg, progress=False)
    last = read_index(tmp_path / "nan")[-1]
    ckpt = load_checkpoint(tmp_path / "nan" / last["path"])
    assert all(torch.isfinite(t).all() for t in ckpt["model"].values())


def test_config_sources_default_then_file_then_overrides(tmp_path):
    defaults = TrainConfig(data="d", out="o")  # the dataclass's own defaults, the reference
    path = tmp_path / "cfg.json"
    path.write_text(
        json.dumps(
            {"data": "d", "out": "o", "steps": 70, "batch_size": 3, "optimizer_options": {"lr": 0.1, "momentum": 0.9}}
        )
    )
    cfg = TrainConfig.from_sources(path, {"batch_size": 5, "optimizer_options": {"lr": 0.2}, "grad_clip": None})
    assert cfg.steps == 70  # the file over the default
    assert cfg.batch_size == 5  # the override over the file
    assert cfg.optimizer_options == {"lr": 0.2, "momentum": 0.9}  # dict fields merge key by key
    assert cfg.grad_clip is None and defaults.grad_clip == 1.0  # an explicit None overrides
    assert cfg.warmup_steps == defaults.warmup_steps and cfg.schedule == defaults.schedule
    assert TrainConfig.from_sources(None, {"data": "d", "out": "o"}) == defaults
    assert TrainConfig.from_sources(path, {}).batch_size == 3


def test_config_sources_refuse_unknown_fields_and_bad_types(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"data": "d", "out": "o", "stepz": 7, "lr": 1.0}))
    with pytest.raises(ValueError, match=r"cfg.json: unknown training config field\(s\): lr, stepz"):
        TrainConfig.from_sources(path, {})
    with pytest.raises(ValueError, match="overrides: unknown training config field"):
        TrainConfig.from_sources(None, {"data": "d", "out": "o", "batch": 4})
    for field_name, value in (("steps", "10"), ("steps", 2.5), ("compile", 1), ("grad_clip", True), ("model", 3)):
        with pytest.raises(ValueError, match=f"{field_name} must be"):
            TrainConfig.from_sources(None, {"data": "d", "out": "o", field_name: value})
    assert TrainConfig.from_sources(None, {"data": "d", "out": "o", "grad_clip": 2}).grad_clip == 2  # an int is a float
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="a JSON object expected, found list"):
        TrainConfig.from_sources(path, {})
    path.write_text("{")
    with pytest.raises(ValueError, match="corrupt JSON"):
        TrainConfig.from_sources(path, {})
    with pytest.raises(ValueError, match="no such config file"):
        TrainConfig.from_sources(tmp_path / "missing.json", {})
    with pytest.raises(ValueError, match="--out is required"):
        TrainConfig.from_sources(None, {"data": "d"})
