"""The monitor on the clients users bring: its hidden scope on a Hugging Face ViT, its rows in the
Hugging Face Trainer's logs and in a Lightning run, and TensorBoard scalars from ``curvlab train``."""

import csv
import json
from pathlib import Path

import pytest
import torch

from curvlab.curvature.scalars import SCOPE_KEYS
from curvlab.curvature.taylor import taylor_split
from curvlab.engine.loss import make_loss_fn
from curvlab.runs.monitor import (
    CurvatureMonitor,
    add_trainer_curvature_callback,
    lightning_curvature_callback,
    trainer_curvature_callback,
)
from tests.builders import hf_trainer, tiny_gpt2, token_data


def tiny_vit():
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    config = ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, num_labels=3,
    )  # fmt: skip
    return ViTForImageClassification(config).eval()


def test_the_monitors_hidden_scope_is_taylor_splits_on_a_vit():
    model = tiny_vit()
    g = torch.Generator().manual_seed(0)
    batch = {"pixel_values": torch.randn(4, 3, 8, 8, generator=g), "labels": torch.tensor([0, 1, 2, 0])}
    loss_fn = make_loss_fn(model)
    params = {n: p.detach() for n, p in model.named_parameters()}
    z = {n: 1e-2 * torch.randn(p.shape, generator=g) for n, p in params.items()}
    monitor = CurvatureMonitor(model, None, loss_fn, batch)
    row = monitor.measure(0, params, z)
    ref = taylor_split(loss_fn, params, batch, z)
    assert row.hidden_names == ref.hidden_names and "classifier.weight" not in row.hidden_names
    for k in SCOPE_KEYS:
        assert getattr(row.hidden, k) == pytest.approx(getattr(ref.hidden, k), rel=1e-6), k


def tensorboard_scalars(folder):
    """``{tag: [(step, value), ...]}`` of every TensorBoard event file under ``folder``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(Path(folder).rglob("events.out.tfevents*"))
    assert files, f"no event files under {folder}"
    out = {}
    for f in files:
        events = EventAccumulator(str(f))
        events.Reload()
        for tag in events.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in events.Scalars(tag))
    return out


def hf_run(out, every, report_to=(), attach=True):
    """Four steps of a real ``transformers.Trainer`` on a tiny GPT-2 (dropout on); with ``every``, the
    curvature callback measures every ``every`` steps, attached to the Trainer (or not)."""
    torch.manual_seed(0)
    model = tiny_gpt2()
    g = torch.Generator().manual_seed(0)
    data = token_data(torch.randint(0, 64, (16, 16), generator=g))
    ids = torch.randint(0, 64, (4, 16), generator=g)
    trainer = hf_trainer(
        model, out, data, max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1,
        save_strategy="no", report_to=list(report_to),
    )  # fmt: skip
    monitor = None
    if every:
        monitor = CurvatureMonitor(model, None, make_loss_fn(model), {"input_ids": ids, "labels": ids}, every=every)
        if attach:
            add_trainer_curvature_callback(trainer, monitor)
        else:
            trainer.add_callback(trainer_curvature_callback(monitor))
    trainer.train()
    return trainer, monitor


def test_trainer_callback_rows_reach_the_trainers_logs_and_tensorboard(tmp_path):
    plain, _ = hf_run(tmp_path / "plain", 0)
    trainer, monitor = hf_run(tmp_path / "watched", 2, report_to=["tensorboard"])
    losses = [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]
    assert losses == [(h["step"], h["loss"]) for h in plain.state.log_history if "loss" in h]
    assert [r.step for r in monitor.rows] == [0, 2] and all(r.ok for r in monitor.rows)
    logged = [h for h in trainer.state.log_history if "curvature/nds" in h]
    assert [h["step"] for h in logged] == [1, 3]  # the Trainer's global_step after the measured step
    for h, row in zip(logged, monitor.rows):
        assert {k: h[k] for k in row.log_scalars()} == row.log_scalars()
    board = tensorboard_scalars(tmp_path / "watched")
    for key in ("nds", "hidden_nds", "first_order", "realized"):
        expected = [(h["step"], h[f"curvature/{key}"]) for h in logged]
        got = board[f"train/curvature/{key}"]
        assert [s for s, _ in got] == [s for s, _ in expected]
        assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-6)  # (stored as float32)
    with pytest.warns(UserWarning, match="don't reach report_to"):
        hf_run(tmp_path / "unattached", 2, report_to=["tensorboard"], attach=False)


def test_train_command_writes_tensorboard_scalars(pcfg_data, tmp_path):
    from typer.testing import CliRunner

    from curvlab.cli import app

    run, board = tmp_path / "run", tmp_path / "board"
    args = ["train", "--data", pcfg_data, "--out", run, "--optimizer", "muon", "--steps", "4", "--quiet"]
    args += ["--model-opt", "n_layer=1", "--model-opt", "n_embd=16", "--model-opt", "n_head=2"]
    args += ["--model-opt", "block_size=16", "--batch-size", "4", "--warmup-steps", "1", "--val-windows", "8"]
    args += ["--eval-every", "2", "--curvature-every", "2", "--curvature-windows", "4", "--tensorboard", board]
    r = CliRunner().invoke(app, [str(a) for a in args])
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    curvature = [r for r in rows if r.get("kind") == "curvature"]
    training = [r for r in rows if "kind" not in r]
    scalars = tensorboard_scalars(board)
    assert [s for s, _ in scalars["curvature/nds"]] == [r["step"] for r in curvature] == [0, 2]
    assert [v for _, v in scalars["curvature/nds"]] == pytest.approx([r["nds"] for r in curvature], rel=1e-6)
    hidden = [r["hidden"]["nds"] for r in curvature]
    assert [v for _, v in scalars["curvature/hidden_nds"]] == pytest.approx(hidden, rel=1e-6)
    assert [s for s, _ in scalars["train/loss"]] == [r["step"] for r in training] == [1, 2, 3, 4]
    assert [v for _, v in scalars["train/loss"]] == pytest.approx([r["train_loss"] for r in training], rel=1e-6)
    assert [s for s, _ in scalars["val/loss"]] == [2, 4]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def lightning_run(root, every):
    """Four steps of a real ``lightning.Trainer.fit`` (SGD with momentum, gradient clipping) on a tiny
    MLP, recording W before and after every step; with ``every``, the curvature callback measures."""
    import lightning
    from lightning.pytorch.loggers import CSVLogger

    class Module(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Net()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)

    class Recorder(lightning.Callback):
        def __init__(self):
            self.weights = []

        def on_train_start(self, trainer, pl_module):
            self.weights.append({n: p.detach().clone() for n, p in pl_module.net.named_parameters()})

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.weights.append({n: p.detach().clone() for n, p in pl_module.net.named_parameters()})

    lightning.seed_everything(0, verbose=False)
    module = Module()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    held = (torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g))
    loss_fn = make_loss_fn(module.net, criterion=torch.nn.functional.cross_entropy)
    recorder, monitor = Recorder(), None
    callbacks = [recorder]
    if every:
        monitor = CurvatureMonitor(module.net, None, loss_fn, held, every=every)
        callbacks.insert(0, lightning_curvature_callback(monitor))
    trainer = lightning.Trainer(
        max_steps=4, accelerator="cpu", logger=CSVLogger(str(root)), callbacks=callbacks, log_every_n_steps=1,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=0.5,
    )  # fmt: skip
    trainer.fit(module, loader)
    return trainer, recorder.weights, monitor, loss_fn, held


def test_lightning_callback_measures_the_steps_lightning_takes(tmp_path):
    _, weights, _, _, _ = lightning_run(tmp_path / "plain", 0)
    trainer, weights_m, monitor, loss_fn, held = lightning_run(tmp_path / "watched", 2)
    assert len(weights) == 5
    for a, b in zip(weights, weights_m):  # the callback changes nothing in training
        assert all(torch.equal(a[n], b[n]) for n in a)
    assert [r.step for r in monitor.rows] == [0, 2] and all(r.ok for r in monitor.rows)
    for row in monitor.rows:
        W, after = weights[row.step], weights[row.step + 1]
        ref = taylor_split(loss_fn, W, held, {n: W[n] - after[n] for n in W})
        for k in SCOPE_KEYS:
            assert getattr(row.split, k) == pytest.approx(getattr(ref, k), rel=1e-6), (row.step, k)
    trainer.logger.save()
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        logged = [r for r in csv.DictReader(f) if r.get("curvature/nds")]
    assert [int(r["step"]) for r in logged] == [0, 2]
    for r, row in zip(logged, monitor.rows):
        assert {k: float(r[k]) for k in row.log_scalars()} == row.log_scalars()  # (CSV keeps Python's float repr)


def test_the_step_a_users_optimizer_pair_would_take_is_the_step_it_takes():
    from curvlab.models.gpt import GPT, get_config

    torch.manual_seed(0)
    model = GPT(get_config("tiny", vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16))
    matrices = [p for n, p in model.named_parameters() if p.dim() == 2 and "wte" not in n and "lm_head" not in n]
    rest = [p for p in model.parameters() if all(p is not q for q in matrices)]
    optimizers = [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=3e-3)]
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 32, (6, 9), generator=g)
    step_batch, held = (idx[:4, :-1], idx[:4, 1:]), (idx[4:, :-1], idx[4:, 1:])
    loss_fn = make_loss_fn(model)
    monitor = CurvatureMonitor(model, optimizers, loss_fn, held, every=1)
    would = monitor.measure_next(0, step_batch)
    before = monitor.snapshot()
    loss_fn(dict(model.named_parameters()), step_batch).backward()
    for o in optimizers:
        o.step()
    took = monitor.measure_taken(0, before)
    assert would.ok and would.split == took.split and would.hidden == took.hidden


def test_without_the_optional_packages_one_line_says_which(pcfg_data, tmp_path, monkeypatch):
    import sys

    from typer.testing import CliRunner

    from curvlab.cli import app
    from curvlab.errors import CurvlabError

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard weren't installed
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    run = tmp_path / "run"
    args = ["train", "--data", str(pcfg_data), "--out", str(run), "--steps", "1", "--warmup-steps", "0"]
    args += ["--tensorboard", str(tmp_path / "tb")]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2 and r.output.strip().splitlines() == [
        "error: --tensorboard needs the tensorboard package: pip install 'curvlab[tensorboard]'"
    ]
    assert not run.exists() and not (tmp_path / "tb").exists()
    with pytest.raises(CurvlabError, match=r"pip install 'curvlab\[lightning\]'"):
        net = Net()
        batch = (torch.randn(2, 6), torch.tensor([0, 1]))
        lightning_curvature_callback(
            CurvatureMonitor(net, None, make_loss_fn(net, criterion=torch.nn.functional.cross_entropy), batch)
        )
