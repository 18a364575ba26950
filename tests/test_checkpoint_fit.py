"""Checkpoints that don't fit are refused (issue 47): a Trainer checkpoint whose weights lack a layer, hold a
tensor the model has no place for, or one of another shape; a config.json of another architecture than the
weights; a masked-LM or sequence-classification checkpoint (curvlab analyses a causal LM's next-token loss);
a config that asks to run code of its own; an accelerate ``save_state`` directory and its weights file (told
apart, with what to pass instead, which then reads, its tied head absent from the file). Each is refused by
``curvlab nds`` in one ``error:`` line with status 2, before any optimizer check, writing nothing, and
transformers' own load report (a table of every tensor) isn't logged.

Every checkpoint is tiny and written here, from a real ``transformers.Trainer`` or ``accelerate.Accelerator``
where the format is theirs (nothing is downloaded)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from curvlab import next_update
from curvlab.analysis.report import load_report
from curvlab.analysis.targets import open_checkpoint
from curvlab.cli import app
from curvlab.engine.loss import make_loss_fn
from curvlab.runs.foreign import Rebuild
from tests.builders import assert_refused, hf_trainer, runner, tiny_gpt2, token_data
from tests.conftest import TRAINER_VOCAB


@pytest.fixture
def transformers_log():
    """The records transformers logs while the test runs, at its default verbosity (warnings: its load
    report is one), whatever verbosity other test modules left."""
    from transformers.utils import logging as hf_logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    library = logging.getLogger("transformers")
    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()
    library.addHandler(handler)
    yield records
    library.removeHandler(handler)
    hf_logging.set_verbosity(before)


def files(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def refused(checkpoint: Path, tmp_path: Path, *expected: str, args=()) -> str:
    """``curvlab nds checkpoint`` refused in one line holding ``expected``, no report written and nothing
    added to or changed in the checkpoint's directory."""
    folder = checkpoint if checkpoint.is_dir() else checkpoint.parent
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    out = tmp_path / "out" / "report.json"
    line = assert_refused(["nds", checkpoint, *args, "--out", out], *expected, out=out)
    assert not out.parent.exists() or not any(out.parent.iterdir())
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before
    return line


def with_weights(path: Path, out: Path, edit) -> Path:
    """A copy of the Trainer checkpoint at ``path`` whose ``model.safetensors`` holds ``edit(tensors)``."""
    shutil.copytree(path, out)
    save_file(edit(load_file(path / "model.safetensors")), out / "model.safetensors", metadata={"format": "pt"})
    return out


def without_layer(w):
    return {k: v for k, v in w.items() if not k.startswith("transformer.h.0.mlp.c_fc.")}


CASES = {
    "a layer missing": (
        without_layer,
        "2 of its tensors missing (transformer.h.0.mlp.c_fc.bias, transformer.h.0.mlp.c_fc.weight)",
    ),
    "a tensor it has no place for": (
        lambda w: {**w, "transformer.h.1.ln_1.weight": torch.ones(16)},
        "1 it has no place for (transformer.h.1.ln_1.weight)",
    ),
    "a tensor of another shape": (
        lambda w: {**w, "transformer.wpe.weight": torch.zeros(9, 16)},
        "1 of another shape (transformer.wpe.weight [9, 16] saved, [8, 16] in the model)",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_weights_that_dont_fill_the_model_are_refused_naming_the_tensors(
    trainer_checkpoint, tmp_path, transformers_log, case
):
    """transformers would start a missing or mis-shaped tensor at random and analyse the model anyway."""
    path, data = trainer_checkpoint
    edit, expected = CASES[case]
    bad = with_weights(path, tmp_path / "ckpt", edit)
    line = refused(
        bad,
        tmp_path,
        f"{bad}: the weights don't fill its config.json's GPT2LMHeadModel",
        expected,
        args=["--data", data],
    )
    assert "group" not in line
    assert not [r.getMessage()[:80] for r in transformers_log]  # (its load report: the table the line replaces)


def test_a_tied_head_is_known_by_the_models_structure(trainer_checkpoint, tmp_path):
    """The Trainer's safetensors keep the tied head under the embedding's name only (the model's structure
    says they are one tensor), which reads; without the embedding both are missing; the head saved apart
    with other values is a model trained untied, which transformers would untie (a parameter the run never
    had, and then an optimizer state that doesn't fit) and is refused by name instead."""
    path, data = trainer_checkpoint
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    r = runner.invoke(app, ["nds", str(path), "--data", str(data), "--out", str(tmp_path / "r.json")])
    assert r.exit_code == 0, r.output
    bad = with_weights(path, tmp_path / "ckpt", lambda w: {k: v for k, v in w.items() if "wte" not in k})
    refused(bad, tmp_path, "2 of its tensors missing (lm_head.weight, transformer.wte.weight)", args=["--data", data])
    apart = with_weights(path, tmp_path / "apart", lambda w: {**w, "lm_head.weight": w["transformer.wte.weight"] + 1})
    expected = "transformer.wte.weight and lm_head.weight are one tensor in GPT2LMHeadModel (tied by its config.json)"
    line = refused(apart, tmp_path, expected, "differ in the weights", args=["--data", data])
    assert "group" not in line


def test_a_config_of_another_architecture_is_refused_before_the_optimizer(trainer_checkpoint, tmp_path):
    path, data = trainer_checkpoint
    other = tmp_path / "ckpt"
    shutil.copytree(path, other)
    transformers.LlamaConfig(
        vocab_size=TRAINER_VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=8,
        architectures=["LlamaForCausalLM"],
    ).to_json_file(other / "config.json")
    line = refused(
        other,
        tmp_path,
        f"{other}/config.json names LlamaForCausalLM (llama), but none of its 12 parameters",
        "transformer.h.0.attn.c_attn.bias",
        "a config of another architecture than the weights'",
        args=["--data", data],
    )
    assert "group" not in line


def test_a_masked_lm_or_classification_checkpoint_is_refused_by_its_task(trainer_checkpoint, tmp_path):
    """Analysed, a BERT masked LM would be measured on a causal next-token loss it never trained on; so would a
    GPT-2 classifier (the same backbone as the causal LM: the task is the class's, not the model type's)."""
    path, data = trainer_checkpoint
    ids = torch.randint(1, TRAINER_VOCAB, (8, 8), generator=torch.Generator().manual_seed(0))
    config = transformers.BertConfig(
        vocab_size=TRAINER_VOCAB,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=8,
    )
    torch.manual_seed(0)
    mlm = hf_trainer(
        transformers.BertForMaskedLM(config),
        tmp_path / "bert",
        token_data(ids),
        max_steps=1,
        per_device_train_batch_size=4,
        save_steps=1,
    )
    mlm.train()
    bert = tmp_path / "bert" / "checkpoint-1"
    causal = "curvlab analyses causal-LM checkpoints"
    refused(
        bert, tmp_path, f"{bert}/config.json: BertForMaskedLM is a masked-LM model; {causal}", args=["--data", data]
    )
    classifier = tmp_path / "classifier"
    shutil.copytree(path, classifier)
    gpt2 = transformers.GPT2Config(vocab_size=TRAINER_VOCAB, n_positions=8, n_embd=16, n_layer=1, n_head=2)
    transformers.GPT2ForSequenceClassification(gpt2).save_pretrained(classifier)
    expected = "GPT2ForSequenceClassification is a sequence-classification model"
    refused(classifier, tmp_path, expected, causal, args=["--data", data])
    # a state dict read with the masked LM's config.json
    torch.save(mlm.model.state_dict(), tmp_path / "weights.pt")
    options = ["--data", data, "--config", bert, "--optimizer", "adamw", "--batch-size", "4"]
    refused(
        tmp_path / "weights.pt",
        tmp_path,
        f"--config {bert}/config.json: BertForMaskedLM is a masked-LM model",
        args=options,
    )


def test_a_config_naming_code_of_its_own_is_refused_and_runs_none(trainer_checkpoint, tmp_path):
    path, data = trainer_checkpoint
    bad = tmp_path / "ckpt"
    shutil.copytree(path, bad)
    config = {**transformers.GPT2Config(vocab_size=TRAINER_VOCAB).to_dict(), "model_type": "own-gpt"}
    config["auto_map"] = {"AutoConfig": "own.OwnConfig", "AutoModelForCausalLM": "own.OwnModel"}
    (bad / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "ran"
    (bad / "own.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    refused(
        bad,
        tmp_path,
        f"{bad}/config.json: names classes of its own (auto_map); curvlab runs no code",
        args=["--data", data],
    )
    assert not marker.exists()


@pytest.fixture
def accelerate_state(tmp_path):
    """What ``accelerate.Accelerator.save_state`` writes for a tiny GPT-2 (tied head) after one AdamW step on
    the CPU, and the model and optimizer as accelerate holds them (accelerate's process-wide state is reset
    after: the Trainer makes its own)."""
    import accelerate
    from accelerate.state import AcceleratorState, GradientState

    torch.manual_seed(0)
    accelerator = accelerate.Accelerator(cpu=True)
    model = tiny_gpt2(TRAINER_VOCAB, positions=8, n_embd=16, n_layer=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = torch.randint(1, TRAINER_VOCAB, (4, 8), generator=torch.Generator().manual_seed(0))
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    optimizer.step()
    optimizer.zero_grad()
    accelerator.save_state(tmp_path / "state")
    yield tmp_path / "state", model, optimizer.optimizer
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def test_an_accelerate_save_state_directory_is_told_apart_and_what_it_says_reads(
    trainer_checkpoint, accelerate_state, tmp_path
):
    """Not "not a Trainer checkpoint" nor "corrupt": the directory and its model.safetensors are named for
    what they are, and the file the message says to write (its safetensors lack the tied head) reads as the
    model and optimizer accelerate held, to the next step."""
    _, data = trainer_checkpoint
    state, model, optimizer = accelerate_state
    assert {"model.safetensors", "optimizer.bin"} <= set(files(state)) and not (state / "config.json").exists()
    assert "lm_head.weight" not in load_file(state / "model.safetensors")
    says = "--config, --optimizer and --batch-size"
    line = refused(state, tmp_path, f"{state}: an accelerate save_state directory", says, args=["--data", data])
    weights = state / "model.safetensors"
    refused(
        weights, tmp_path, f"{weights}: the weights of an accelerate save_state directory", says, args=["--data", data]
    )
    assert f"torch.save({{'model': safetensors.torch.load_file('{weights}'), 'optimizer': torch.load(" in line
    checkpoint = {"model": load_file(weights), "optimizer": torch.load(state / "optimizer.bin"), "step": 1}
    torch.save(checkpoint, tmp_path / "ckpt.pt")
    model.config.to_json_file(tmp_path / "config.json")
    target = open_checkpoint(tmp_path / "ckpt.pt", data, rebuild=Rebuild(str(tmp_path / "config.json"), "adamw", 4))
    held = model.state_dict()
    assert target.model.state_dict().keys() == held.keys()
    assert all(torch.equal(v, held[k]) for k, v in target.model.state_dict().items())
    assert target.model.lm_head.weight is target.model.transformer.wte.weight
    model.eval()
    batch = target.train_batches[0]
    _, z = next_update(target.model, target.optimizer, make_loss_fn(target.model), batch)
    _, z_held = next_update(model, optimizer, make_loss_fn(model), batch)
    assert z.keys() == z_held.keys() and all(torch.equal(z[k], z_held[k]) for k in z)
    out = tmp_path / "r.json"
    args = ["--data", data, "--config", tmp_path / "config.json", "--optimizer", "adamw", "--batch-size", 4]
    r = runner.invoke(app, [str(a) for a in ["nds", tmp_path / "ckpt.pt", *args, "--out", out]])
    assert r.exit_code == 0, r.output
    assert load_report(out).step == 1


def test_a_safetensors_file_alone_is_not_called_corrupt(trainer_checkpoint, tmp_path):
    path, data = trainer_checkpoint
    weights = path / "model.safetensors"
    refused(
        weights,
        tmp_path,
        f"{weights}: the weights of a Trainer checkpoint; pass its directory, {path}",
        args=["--data", data],
    )
    alone = tmp_path / "alone" / "model.safetensors"
    alone.parent.mkdir()
    shutil.copy(weights, alone)
    refused(alone, tmp_path, f"{alone}: a safetensors weights file alone", args=["--data", data])


def test_a_state_dicts_tied_tensor_may_be_saved_once_but_not_twice_differently(trainer_checkpoint, tmp_path):
    """``load_weights`` knows tied names by the model's structure: the head saved alone (or the embedding
    alone) fills both; the two saved with different values is a model trained untied, which a tied model
    would hold as one of them (torch's ``load_state_dict`` copies both into the one tensor, the last winning)."""
    _, data = trainer_checkpoint
    model = tiny_gpt2(TRAINER_VOCAB, positions=8, n_embd=16, n_layer=1)
    model.config.to_json_file(tmp_path / "config.json")
    weights = model.state_dict()
    options = ["--data", data, "--config", tmp_path / "config.json", "--optimizer", "adamw", "--batch-size", "4"]
    rebuild = Rebuild(str(tmp_path / "config.json"), "adamw", 4)
    pair = ("lm_head.weight", "transformer.wte.weight")
    for kept in pair:
        torch.save({k: v for k, v in weights.items() if k not in pair or k == kept}, tmp_path / "once.pt")
        target = open_checkpoint(tmp_path / "once.pt", data, rebuild=rebuild)
        assert all(torch.equal(v, weights[k]) for k, v in target.model.state_dict().items())
    untied = {**weights, "lm_head.weight": weights["lm_head.weight"] + 1}
    torch.save(untied, tmp_path / "untied.pt")
    expected = "transformer.wte.weight and lm_head.weight are one tensor in the --config model (tied) but differ"
    refused(tmp_path / "untied.pt", tmp_path, expected, args=options)
    neither = {k: v for k, v in weights.items() if k not in pair}
    torch.save({**neither, "transformer.wpe.weight": torch.zeros(9, 16)}, tmp_path / "neither.pt")
    refused(
        tmp_path / "neither.pt",
        tmp_path,
        "its weights don't fit the --config model (missing lm_head.weight, transformer.wte.weight; size mismatch: "
        "transformer.wpe.weight [9, 16] saved, [8, 16] in the model)",
        args=options,
    )
