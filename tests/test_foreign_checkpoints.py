"""Checkpoints of other training code (:mod:`curvlab.runs.foreign`): a Lightning ``.ckpt`` (as Lightning's
format is written, and as a real ``lightning.Trainer`` writes it) and a ``torch.save``'d state dict, each
checked against the same model and optimizer held whole in memory: the weights and optimizer state bit for
bit, and the next step against the real optimizer's."""

import copy
import json
import math
import re

import lightning
import numpy as np
import pytest
import torch
import transformers
from typer.testing import CliRunner

from curvlab import next_update, restore_lightning
from curvlab.analysis.report import load_report
from curvlab.analysis.targets import open_checkpoint
from curvlab.cli import app
from curvlab.curvature.taylor import taylor_split
from curvlab.data.shards import write_shard
from curvlab.engine.loss import make_loss_fn
from curvlab.errors import CurvlabError
from curvlab.models.gpt import GPT, GPTConfig
from curvlab.optim.model_optimizer import trainable_parameters
from curvlab.runs.foreign import Rebuild
from tests.builders import nanogpt_checkpoint

runner = CliRunner()
VOCAB = 64
GPT_FIELDS = {"vocab_size": VOCAB, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 16, "bias": True}


def token_data(tmp_path):
    data = tmp_path / "data"
    rng = np.random.default_rng(0)
    write_shard(data / "train_000000.bin", rng.integers(0, VOCAB, 5000))
    write_shard(data / "val_000000.bin", rng.integers(0, VOCAB, 2000))
    return data


class LitGPT(torch.nn.Module):
    """A LightningModule as users write one, without Lightning (its checkpoint format is written here by
    hand; :class:`TrainedLitGPT` is trained and saved by the real ``lightning.Trainer``): the model under
    ``self.model``, AdamW's decay split and a scheduler from ``configure_optimizers``."""

    def __init__(self, seed=0, optimizers=1):
        super().__init__()
        torch.manual_seed(seed)
        self.model = GPT(GPTConfig(**GPT_FIELDS))
        self.optimizers = optimizers

    def configure_optimizers(self):
        adamw, schedule = decayed_adamw(self.model, lr=1e-2)
        if self.optimizers == 1:
            return {"optimizer": adamw, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
        sgd = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        return [adamw, sgd], [schedule]


def decayed_adamw(model, lr):
    """AdamW with the matrices decayed and the rest not, and a per-step schedule: a LightningModule's usual
    ``configure_optimizers``."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    adamw = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))
    return adamw, torch.optim.lr_scheduler.LambdaLR(adamw, lambda step: 1.0 / (1 + step))


def batch(seed):
    ids = torch.randint(0, VOCAB, (4, 17), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:]


def train_steps(model, optimizer, steps, schedule=None):
    for k in range(steps):
        train_step(model, optimizer, batch(k))
        if schedule is not None:
            schedule.step()


def train_step(model, optimizer, b):
    optimizer.zero_grad()
    make_loss_fn(model)(dict(model.named_parameters()), b).backward()
    optimizer.step()


def lightning_checkpoint(tmp_path, optimizers=1):
    """A LitGPT trained 2 steps, written as Lightning writes a checkpoint; returns the module, its optimizers
    and the path."""
    lit = LitGPT(optimizers=optimizers)
    configured = lit.configure_optimizers()
    opts = [configured["optimizer"]] if optimizers == 1 else configured[0]
    schedule = configured["lr_scheduler"]["scheduler"] if optimizers == 1 else configured[1][0]
    for opt in opts:
        train_steps(lit.model, opt, 2, schedule if opt is opts[0] else None)
    ckpt = {
        "epoch": 0,
        "global_step": 2,
        "pytorch-lightning_version": "2.5.1",
        "state_dict": lit.state_dict(),
        "loops": {"fit_loop": {"epoch_progress": {"total": {"completed": 0}}}},
        "callbacks": {},
        "optimizer_states": [o.state_dict() for o in opts],
        "lr_schedulers": [schedule.state_dict()],
        "hparams_name": "kwargs",
        "hyper_parameters": {"lr": 1e-2},
    }
    torch.save(ckpt, tmp_path / "last.ckpt")
    return lit, opts, tmp_path / "last.ckpt"


def assert_same_optimizer_state(ours, theirs):
    a, b = ours.state_dict(), theirs.state_dict()
    assert [{k: v for k, v in g.items() if k != "params"} for g in a["param_groups"]] == [
        {k: v for k, v in g.items() if k != "params"} for g in b["param_groups"]
    ]
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        assert a["state"][i].keys() == b["state"][i].keys()
        assert all(torch.equal(a["state"][i][k], b["state"][i][k]) for k in a["state"][i])


def assert_next_step_is_the_real_one(model, optimizer, reference_model, reference_optimizer, next_batch):
    """Z from the rebuilt pair equals Z from the pair held whole, bit for bit, and W - W_next of a copy's
    real step."""
    loss_fn = make_loss_fn(model)
    _, Z = next_update(model, optimizer, loss_fn, next_batch)
    _, Z_ref = next_update(reference_model, reference_optimizer, make_loss_fn(reference_model), next_batch)
    assert Z.keys() == Z_ref.keys() and all(torch.equal(Z[n], Z_ref[n]) for n in Z)
    stepped, stepped_opt = copy.deepcopy((reference_model, reference_optimizer))
    before = {n: p.detach().clone() for n, p in stepped.named_parameters()}
    train_step(stepped, stepped_opt, next_batch)
    for n, p in stepped.named_parameters():
        atol = float(torch.finfo(p.dtype).eps * 4 * (1 + before[n].abs().max()))  # (W - W_next rounds in W's dtype)
        torch.testing.assert_close(before[n] - p.detach(), Z[n], rtol=0, atol=atol)
    return Z


def test_a_lightning_checkpoint_is_the_module_and_optimizer_held_whole(tmp_path):
    lit, (opt,), path = lightning_checkpoint(tmp_path)
    (tmp_path / "gpt.json").write_text(json.dumps(GPT_FIELDS))
    target = open_checkpoint(path, token_data(tmp_path), rebuild=Rebuild(str(tmp_path / "gpt.json"), "AdamW", 4))
    assert target.step == 2 and target.optimizer_name == "torch.optim.AdamW" and target.grad_clip is None
    theirs = lit.model.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in target.model.state_dict().items())
    assert_same_optimizer_state(target.optimizer, opt)
    assert [g["lr"] for g in target.optimizer.param_groups] == [1e-2 * (1 / 3)] * 2  # (the scheduler's, saved)
    Z = assert_next_step_is_the_real_one(target.model, target.optimizer, lit.model, opt, target.train_batches[0])
    assert target.draw.source == "seeded draw" and target.draw.seed == 2
    assert_the_command_line_reads_the_same_step(tmp_path, path, lit.model, target.train_batches[0], Z, "float32")


def assert_the_command_line_reads_the_same_step(tmp_path, path, model, next_batch, Z, dtype):
    """``curvlab nds`` of the GPT checkpoint at ``path`` (with gpt.json, AdamW and 4 sequences named) reports
    step 2 and the NDS of ``Z`` on ``next_batch`` for ``model``: the same Z, so the same NDS on the same batch
    (to the rounding of ``dtype``, the analysis's)."""
    out = tmp_path / "r.json"
    args = ["nds", str(path), "--data", str(tmp_path / "data"), "--config", str(tmp_path / "gpt.json")]
    r = runner.invoke(app, [*args, "--optimizer", "adamw", "--batch-size", "4", "--dtype", dtype, "--out", str(out)])
    assert r.exit_code == 0, r.output
    report = load_report(out)
    expected = taylor_split(make_loss_fn(model), trainable_parameters(model), next_batch, Z)
    assert report.step == 2 and report.optimizer == "torch.optim.AdamW"
    assert math.isclose(report.split.nds, expected.nds, rel_tol={"float32": 1e-5, "float64": 1e-12}[dtype])


def test_what_a_lightning_checkpoint_does_not_record_is_asked_for_in_one_line(tmp_path):
    _, _, path = lightning_checkpoint(tmp_path)
    (tmp_path / "gpt.json").write_text(json.dumps(GPT_FIELDS))
    data = token_data(tmp_path)
    base = ["nds", str(path), "--data", str(data)]
    good = {"--config": str(tmp_path / "gpt.json"), "--optimizer": "adamw", "--batch-size": "4"}
    cases = {
        "--config": "pass --config",
        "--optimizer": "pass --optimizer",
        "--batch-size": "pass --batch-size",
    }
    for left_out, message in cases.items():
        extra = [x for k, v in good.items() if k != left_out for x in (k, v)]
        r = runner.invoke(app, [*base, *extra, "--out", str(tmp_path / "r.json")])
        assert r.exit_code == 2 and message in r.output and len(r.output.strip().splitlines()) == 1, r.output
        assert not (tmp_path / "r.json").exists()
    wrong = {
        ("--config", "tiny"): "don't fit the --config model",
        ("--optimizer", "sgd"): "aren't torch.optim.SGD's, and it lacks torch.optim.SGD's ['dampening'",
        ("--optimizer", "adamx"): "unknown --optimizer 'adamx'",
    }
    for (option, value), message in wrong.items():
        extra = [x for k, v in {**good, option: value}.items() for x in (k, v)]
        r = runner.invoke(app, [*base, *extra])
        assert r.exit_code == 2 and message in r.output and len(r.output.strip().splitlines()) == 1, r.output
    # a checkpoint that records its model takes none of them
    nanogpt_checkpoint(tmp_path)
    r = runner.invoke(app, ["nds", str(tmp_path / "ckpt.pt"), "--data", str(data), "--optimizer", "adamw"])
    assert r.exit_code == 2 and "are for Lightning and state-dict checkpoints" in r.output


def test_a_saved_optimizer_state_no_grouping_fits_is_refused(tmp_path):
    _, _, path = lightning_checkpoint(tmp_path)
    (tmp_path / "gpt.json").write_text(json.dumps(GPT_FIELDS))
    rebuild = Rebuild(str(tmp_path / "gpt.json"), "adamw", 4)
    ckpt = torch.load(path, weights_only=True)
    state = ckpt["optimizer_states"][0]
    first, second = state["param_groups"]
    split = [{**first, "params": first["params"][:3]}, {**first, "params": first["params"][3:]}, second]
    torch.save({**ckpt, "optimizer_states": [{**state, "param_groups": split}]}, tmp_path / "split.ckpt")
    with pytest.raises(CurvlabError, match=r"groups of \[3, \d+, \d+\] parameters fit no grouping"):
        open_checkpoint(tmp_path / "split.ckpt", token_data(tmp_path), rebuild=rebuild)
    # the right sizes, the moments of two parameters of different shapes swapped: the shapes tell
    moved = dict(state["state"])
    moved[0], moved[2] = moved[2], moved[0]
    torch.save({**ckpt, "optimizer_states": [{**state, "state": moved}]}, tmp_path / "moved.ckpt")
    with pytest.raises(CurvlabError, match="fit no grouping"):
        open_checkpoint(tmp_path / "moved.ckpt", tmp_path / "data", rebuild=rebuild)


def test_restore_lightning_builds_the_modules_own_optimizers(tmp_path):
    lit, opts, path = lightning_checkpoint(tmp_path, optimizers=2)
    fresh = LitGPT(seed=1, optimizers=2)
    assert not torch.equal(fresh.model.transformer.wte.weight, lit.model.transformer.wte.weight)
    restored = restore_lightning(fresh, path)
    assert len(restored) == 2 and all(torch.equal(v, lit.state_dict()[k]) for k, v in fresh.state_dict().items())
    for ours, theirs in zip(restored, opts):
        assert_same_optimizer_state(ours, theirs)
    assert_next_step_is_the_real_one(fresh.model, restored[0], lit.model, opts[0], batch(7))
    # the command line analyses one optimizer's step, and says where the others are
    with pytest.raises(CurvlabError, match="of 2 optimizers.*restore_lightning"):
        open_checkpoint(path, token_data(tmp_path), rebuild=Rebuild("tiny", "adamw", 4))
    with pytest.raises(CurvlabError, match="2 optimizer states saved, 1 configured"):
        restore_lightning(LitGPT(), path)


class TrainedLitGPT(lightning.LightningModule):
    """The same model as a real LightningModule, trained by a real ``lightning.Trainer``: its
    hyperparameters saved (Lightning writes them into the checkpoint), the loss of each batch it is handed."""

    def __init__(self, seed=0, lr=1e-2, data=None):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        self.model = GPT(GPTConfig(**GPT_FIELDS))

    def training_step(self, b, batch_idx):
        return make_loss_fn(self.model)(dict(self.model.named_parameters()), b)

    def configure_optimizers(self):
        adamw, schedule = decayed_adamw(self.model, lr=self.hparams.lr)
        return {"optimizer": adamw, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def trained_by_lightning(tmp_path, **hparams):
    """A TrainedLitGPT trained 2 steps in float64 by ``lightning.Trainer`` on the CPU and saved by
    ``trainer.save_checkpoint``; returns the module and its optimizer as the Trainer holds them, and the path."""
    ids = torch.randint(0, VOCAB, (8, 17), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(list(zip(ids[:, :-1], ids[:, 1:])), batch_size=4)
    lit = TrainedLitGPT(**hparams)
    trainer = lightning.Trainer(
        accelerator="cpu", max_steps=2, precision="64-true", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(lit, loader)
    trainer.save_checkpoint(tmp_path / "trained.ckpt")
    (optimizer,) = trainer.optimizers
    return lit, optimizer, tmp_path / "trained.ckpt"


def test_a_real_lightning_trainers_checkpoint_is_the_module_and_optimizer_held_whole(tmp_path):
    lit, opt, path = trained_by_lightning(tmp_path)
    assert lit.global_step == 2 and {p.dtype for p in lit.parameters()} == {torch.float64}
    assert torch.load(path, weights_only=True)["hyper_parameters"] == {"seed": 0, "lr": 1e-2, "data": None}
    (tmp_path / "gpt.json").write_text(json.dumps(GPT_FIELDS))
    data = token_data(tmp_path)
    # what curvlab nds reads: the weights in their float64, the optimizer state, the next step
    target = open_checkpoint(path, data, rebuild=Rebuild(str(tmp_path / "gpt.json"), "adamw", 4))
    assert target.step == 2 and target.optimizer_name == "torch.optim.AdamW"
    theirs = lit.model.state_dict()
    assert target.model.state_dict().keys() == theirs.keys()
    assert all(v.dtype == theirs[k].dtype and torch.equal(v, theirs[k]) for k, v in target.model.state_dict().items())
    assert_same_optimizer_state(target.optimizer, opt)
    assert [g["lr"] for g in target.optimizer.param_groups] == [1e-2 * (1 / 3)] * 2  # (the scheduler's, saved)
    Z = assert_next_step_is_the_real_one(target.model, target.optimizer, lit.model, opt, target.train_batches[0])
    assert_the_command_line_reads_the_same_step(tmp_path, path, lit.model, target.train_batches[0], Z, "float64")
    # restore_lightning: a fresh module (other weights) gets the saved ones and its own configure_optimizers',
    # in the dtype Lightning trained it in (float32 would round them)
    rounded = r"weights are torch\.float64 \(model\.[\w.]+\), the module's torch\.float32: convert the module first"
    with pytest.raises(CurvlabError, match=rounded):
        restore_lightning(TrainedLitGPT(seed=1), path)
    fresh = TrainedLitGPT(seed=1).double()
    assert not torch.equal(fresh.model.transformer.wte.weight, lit.model.transformer.wte.weight)
    (restored,) = restore_lightning(fresh, path)
    assert all(torch.equal(v, lit.state_dict()[k]) for k, v in fresh.state_dict().items())
    assert_same_optimizer_state(restored, opt)
    assert_next_step_is_the_real_one(fresh.model, restored, lit.model, opt, batch(7))


def test_hyperparameters_beyond_plain_data_are_refused_saying_what_to_do(tmp_path):
    """Lightning saves save_hyperparameters()'s values as given, and a ``Path`` among them is a class, which
    curvlab won't unpickle: one line says where it is and what to do, and the file saved again without
    them, as it says, reads."""
    lit, opt, path = trained_by_lightning(tmp_path, data=tmp_path / "data")
    (tmp_path / "gpt.json").write_text(json.dumps(GPT_FIELDS))
    data = token_data(tmp_path)
    expected = (
        r"names pathlib\.\w*Path, not only tensors and plain data; refusing to unpickle it \(it could run code\): "
        r"it is in Lightning's 'hyper_parameters', which curvlab doesn't read: give save_hyperparameters\(\) plain "
        r"values \(ignore= the others\), or save the checkpoint again without 'hyper_parameters'$"
    )
    with pytest.raises(CurvlabError, match=expected):
        restore_lightning(TrainedLitGPT().double(), path)
    args = ["nds", str(path), "--data", str(data), "--config", str(tmp_path / "gpt.json"), "--optimizer", "adamw"]
    r = runner.invoke(app, [*args, "--batch-size", "4"])
    assert r.exit_code == 2 and re.search(expected, r.output.strip()) and len(r.output.strip().splitlines()) == 1
    saved = torch.load(path, weights_only=False)  # (this test's own file)
    del saved["hyper_parameters"]
    torch.save(saved, tmp_path / "plain.ckpt")
    fresh = TrainedLitGPT(seed=1).double()
    (restored,) = restore_lightning(fresh, tmp_path / "plain.ckpt")
    assert all(torch.equal(v, lit.state_dict()[k]) for k, v in fresh.state_dict().items())
    assert_same_optimizer_state(restored, opt)


def tiny_gpt2(dtype=torch.float64):
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=9, n_embd=16, n_layer=1, n_head=2)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).to(dtype).eval()


def test_a_saved_state_dict_with_a_hugging_face_config(tmp_path):
    """``torch.save(model.state_dict())`` of a float64 GPT-2, read with its config.json: the weights in
    float64, and Z the first step of a fresh AdamW, as a fresh AdamW on the model held whole takes it."""
    model = tiny_gpt2()
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    model.config.to_json_file(tmp_path / "config.json")
    data = token_data(tmp_path)
    target = open_checkpoint(tmp_path / "weights.pt", data, rebuild=Rebuild(str(tmp_path), "adamw", 2))
    assert isinstance(target.model, transformers.GPT2LMHeadModel)
    assert all(v.dtype == torch.float64 for v in target.model.state_dict().values() if v.is_floating_point())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in target.model.state_dict().items())
    assert target.optimizer_name == "torch.optim.AdamW, fresh state" and target.step == 0
    assert target.train_batches[0]["input_ids"].shape == (2, 9)  # (the context's windows, as the Trainer path's)
    fresh = torch.optim.AdamW(model.parameters())
    assert_next_step_is_the_real_one(target.model, target.optimizer, model, fresh, target.train_batches[0])


def test_a_saved_model_and_optimizer_dict(tmp_path):
    """``torch.save({"model": ..., "optimizer": ..., "step": ...})`` with SGD's momentum, under torch.compile's
    prefix, read with a curvlab GPTConfig JSON."""
    model = GPT(GPTConfig(**GPT_FIELDS))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    train_steps(model, opt, 3)
    weights = {f"_orig_mod.{k}": v for k, v in model.state_dict().items()}
    torch.save({"model": weights, "optimizer": opt.state_dict(), "step": 3}, tmp_path / "ckpt.pt")
    (tmp_path / "gpt.json").write_text(json.dumps(GPT_FIELDS))
    rebuild = Rebuild(str(tmp_path / "gpt.json"), "sgd", 4)
    target = open_checkpoint(tmp_path / "ckpt.pt", token_data(tmp_path), rebuild=rebuild)
    assert target.step == 3 and target.optimizer.param_groups[0]["nesterov"] is True
    assert_same_optimizer_state(target.optimizer, opt)
    assert_next_step_is_the_real_one(target.model, target.optimizer, model, opt, target.train_batches[0])
    # a config whose fields curvlab's GPT doesn't take, and one of another width
    (tmp_path / "odd.json").write_text(json.dumps({**GPT_FIELDS, "hidden": 3}))
    with pytest.raises(CurvlabError, match=r"\['hidden'\] are not GPTConfig fields"):
        open_checkpoint(tmp_path / "ckpt.pt", tmp_path / "data", rebuild=Rebuild(str(tmp_path / "odd.json"), "sgd", 4))
    (tmp_path / "wide.json").write_text(json.dumps({**GPT_FIELDS, "n_embd": 32}))
    with pytest.raises(CurvlabError, match="size mismatch"):
        open_checkpoint(tmp_path / "ckpt.pt", tmp_path / "data", rebuild=Rebuild(str(tmp_path / "wide.json"), "sgd", 4))
