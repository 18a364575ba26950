"""curvlab on the models researchers bring: Hugging Face GPT-2 (tied head, Conv1D, dropout), BERT with a
padding mask, Llama (RMSNorm, rotary, grouped-query attention) and a peft LoRA model, all tiny and
random-init from config objects (nothing is downloaded).

References are written here, independently of curvlab: the loss from the model's logits through
``torch.func.functional_call`` on an eval-mode float64 copy (dropout off), shifted for causal LMs, with
``F.cross_entropy(ignore_index=-100)``; HVPs of it by plain double backward (a row combination of the
dense Hessian, without forming its ~7k x 7k entries); the dense Hessian itself for the LoRA adapters.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import peft
import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn
from torch.func import functional_call
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2ForSequenceClassification,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from curvlab import (
    block_matrix,
    build_optimizer,
    evaluate_loss,
    forward_quadratic_form,
    group_parameters,
    hvp,
    make_loss_fn,
    next_update,
    parameter_roles,
    taylor_split,
    trainable_parameters,
)
from curvlab.curvature.groupings import hidden_matrices
from curvlab.engine import params as param_dicts
from curvlab.engine.loss import count_loss_terms, weighted_batches
from curvlab.errors import CurvlabError
from curvlab.models.roles import matrix_shapes
from curvlab.optim.polar import msign
from tests.builders import hf_trainer, write_token_shards
from tests.reference import dense_hessian, double_backward

transformers.logging.set_verbosity_error()
VOCAB = 50


def gpt2_config(**kw) -> GPT2Config:
    # (GPT-2's default dropout, 0.1, stays on: curvature must switch it off itself)
    return GPT2Config(vocab_size=VOCAB, n_positions=8, n_embd=16, n_layer=2, n_head=2, bos_token_id=0,
                      eos_token_id=0, pad_token_id=0, **kw)  # fmt: skip


def bert() -> nn.Module:
    config = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=8, num_labels=3)  # fmt: skip
    return BertForSequenceClassification(config)


def llama() -> nn.Module:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8)  # fmt: skip
    return LlamaForCausalLM(config)


def lora(model: nn.Module) -> nn.Module:
    """LoRA on GPT-2's fused attention (a Conv1D, so fan_in_fan_out), with dropout; B made nonzero."""
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.1)
    model = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    return model


def perturb_norms(model: nn.Module) -> None:
    """Non-trivial norm weights and biases (the affine case is where bugs hide)."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, role in parameter_roles(model).items():
            p = model.get_parameter(name)
            if role == "norm" and p.requires_grad:
                p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def float64_rms_norm(self, hidden_states):
    """LlamaRMSNorm without its float32 upcast (which caps a float64 computation at float32 accuracy)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def causal_batch(seed=0, rows=2, length=6, padded=((1, 4),)) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    for row, start in padded:  # right padding: masked out and ignored in the loss
        mask[row, start:] = 0
    labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def classification_batch(seed=0) -> dict:
    batch = causal_batch(seed, rows=3, padded=((1, 4), (2, 3)))
    batch["labels"] = torch.tensor([0, 2, 1])
    return batch


class ReferenceLoss:
    """The model's own loss written out here: float64, eval mode, shift for a causal LM, -100 ignored."""

    def __init__(self, model: nn.Module, causal: bool):
        self.model = copy.deepcopy(model).double().eval()
        self.causal = causal

    def __call__(self, params, batch):
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        logits, labels = functional_call(self.model, params, (), inputs).logits, batch["labels"]
        if self.causal:
            logits, labels = logits[..., :-1, :], labels[..., 1:]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def rel_error(a, b) -> float:
    """max |a - b| / max |b| over all tensors of two dicts."""
    return max(float((a[k] - b[k]).abs().max()) for k in b) / max(float(b[k].abs().max()) for k in b)


def direction(params, seed):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(t.shape, generator=g, dtype=torch.float64) for k, t in params.items()}


MODELS = ("gpt2", "bert", "llama", "lora")


@pytest.fixture(scope="module")
def problems():
    """name -> (model in train mode, float64 unless LoRA, whose frozen base stays float32; batch; causal)."""
    torch.manual_seed(0)
    out = {}
    for name in MODELS:
        if name == "gpt2":
            model, batch, causal = GPT2LMHeadModel(gpt2_config()).double(), causal_batch(1), True
        elif name == "bert":
            model, batch, causal = bert().double(), classification_batch(2), False
        elif name == "llama":
            model, batch, causal = llama().double(), causal_batch(3), True
        else:
            model, batch, causal = lora(GPT2LMHeadModel(gpt2_config())), causal_batch(4), True
        perturb_norms(model)
        out[name] = (model.train(), batch, causal)
    return out


@pytest.fixture
def exact_rms_norm(monkeypatch):
    monkeypatch.setattr(LlamaRMSNorm, "forward", float64_rms_norm)


@pytest.mark.parametrize("name", MODELS)
def test_curvature_matches_double_backward(problems, name, exact_rms_norm):
    """hvp (both methods), forward_quadratic_form, taylor_split and block_matrix against the independent
    float64 reference; measured errors are ~1e-16 relative on every model."""
    model, batch, causal = problems[name]
    loss_fn = make_loss_fn(model)
    ref = ReferenceLoss(model, causal)
    # adapter-only for LoRA (frozen float32 base, float64 adapters); every parameter otherwise
    params = {k: t.double() for k, t in trainable_parameters(model).items()}
    v = direction(params, 1)
    loss, g, (hv,) = double_backward(ref, params, batch, [v])
    assert evaluate_loss(loss_fn, params, batch) == pytest.approx(loss, rel=1e-13)  # (dropout off inside)
    for method in ("fwd_rev", "rev_rev"):
        assert rel_error(hvp(loss_fn, params, batch, v, method=method), hv) < 1e-12, method
    gz, zhz = forward_quadratic_form(loss_fn, params, batch, v)
    assert gz == pytest.approx(param_dicts.dot(g, v), rel=1e-12) and zhz == pytest.approx(
        param_dicts.dot(v, hv), rel=1e-12
    )

    hidden = [n for n, r in parameter_roles(model).items() if r == "hidden" and n in params]
    v_hidden = param_dicts.restrict(v, hidden)
    _, _, (hv_hidden,) = double_backward(ref, params, batch, [v_hidden])
    split = taylor_split(loss_fn, params, batch, v)
    assert list(split.hidden_names) == hidden
    assert split.nds == pytest.approx(param_dicts.dot(v, hv) / param_dicts.dot(v, v), rel=1e-12)
    assert split.first_order == pytest.approx(param_dicts.dot(g, v), rel=1e-12)
    assert split.realized == pytest.approx(loss - float(ref(param_dicts.add(params, v, -1.0), batch)), rel=1e-12)
    assert split.hidden.nds == pytest.approx(
        param_dicts.dot(v_hidden, hv_hidden) / param_dicts.dot(v_hidden, v_hidden), rel=1e-12
    )

    bm = block_matrix(loss_fn, params, batch, v, blocks="layer")
    members = list(bm.members.values())
    _, _, hv_blocks = double_backward(ref, params, batch, [param_dicts.restrict(v, b) for b in members])
    expected = [[param_dicts.dot(v, hm, b) / param_dicts.dot(v, v) for hm in hv_blocks] for b in members]
    np.testing.assert_allclose(bm.matrix, expected, rtol=1e-10, atol=1e-13 * np.abs(expected).max())


def test_lora_adapter_curvature_against_the_dense_hessian(problems):
    """Adapter-only curvature (docs/science.md section 8): params are the trainable adapters, Z the next
    step of the adapters' own optimizer; the dense float64 Hessian over the 256 adapter entries."""
    model, batch, _ = problems["lora"]
    adapters = trainable_parameters(model)
    assert adapters and all("lora_" in n for n in adapters)
    assert all(t.dtype == torch.float32 for t in adapters.values())  # the frozen base stays float32 too
    # (frozen parameters get no gradient: AdamW skips them)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    loss_fn = make_loss_fn(model)
    G, Z = next_update(model, opt, loss_fn, batch, dtype=torch.float64)
    assert G.keys() == Z.keys() == adapters.keys()
    params = {k: t.double() for k, t in adapters.items()}
    H = dense_hessian(ReferenceLoss(model, causal=True), params, batch)
    z = param_dicts.flatten(Z)
    split = taylor_split(loss_fn, params, batch, Z)
    assert split.nds == pytest.approx(float(z @ H @ z / (z @ z)), rel=1e-10)
    hv = hvp(loss_fn, params, batch, Z, method="rev_rev")
    np.testing.assert_allclose(param_dicts.flatten(hv), H @ z, rtol=1e-10, atol=1e-12 * float((H @ z).abs().max()))
    # Adam's first step on a fresh optimizer is lr G / (|G| + eps): Z really is that step
    g = param_dicts.flatten(G)
    np.testing.assert_allclose(param_dicts.flatten(Z), 1e-2 * g / (g.abs() + 1e-8), rtol=1e-5)


def test_float64_through_frozen_float32_weights_equals_the_float64_model(problems):
    model, batch, _ = problems["lora"]
    params = {k: t.double() for k, t in trainable_parameters(model).items()}
    v = direction(params, 2)
    mixed = hvp(make_loss_fn(model), params, batch, v)  # base float32, cast exactly to float64 inside
    double = hvp(make_loss_fn(copy.deepcopy(model).double()), params, batch, v)
    assert all(t.dtype == torch.float64 for t in mixed.values())
    assert rel_error(mixed, double) < 1e-14


def test_loss_follows_each_models_own_loss(problems):
    """In float32, curvlab's loss from the logits equals the model's own ``.loss`` (causal shift,
    ignored labels, classification); in float64 it stays float64 (HF's .loss casts to float32)."""
    for name in MODELS:
        model, batch, _ = problems[name]
        model32 = copy.deepcopy(model).float().eval()
        params = {k: t.detach() for k, t in model32.named_parameters()}
        loss = make_loss_fn(model32)(params, batch)
        assert float(loss.detach()) == pytest.approx(float(model32(**batch).loss.detach()), rel=1e-6), name
        assert make_loss_fn(model)({k: t.double() for k, t in params.items()}, batch).dtype == torch.float64
    # a tuple batch (inputs, targets) on a causal LM is shifted the same way
    model, batch, _ = problems["gpt2"]
    loss_fn = make_loss_fn(model.eval())
    params = {k: t.detach() for k, t in model.named_parameters()}
    plain = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
    assert float(loss_fn(params, (batch["input_ids"], batch["labels"]))) == float(loss_fn(params, plain))
    model.train()


def test_tie_weights_passes_through(problems):
    """GPT-2's head is tied to wte: a new wte moves the head too (tie_weights=True, the default), or
    leaves the head as the module has it (tie_weights=False)."""
    model, batch, _ = problems["gpt2"]
    model = copy.deepcopy(model).eval()
    params = {k: t.detach().clone() for k, t in model.named_parameters()}
    assert "lm_head.weight" not in params  # (named_parameters lists a tied tensor once)
    shift = 0.1 * direction({"w": params["transformer.wte.weight"]}, 5)["w"]
    params["transformer.wte.weight"] += shift
    tied = make_loss_fn(model)(params, batch)
    untied = make_loss_fn(model, tie_weights=False)(params, batch)
    with torch.no_grad():
        head_before = model.lm_head.weight.clone()
        model.transformer.wte.weight += shift  # the same tensor as lm_head.weight
        assert float(tied) == pytest.approx(float(ReferenceLoss(model, causal=True)({}, batch)), rel=1e-13)
        model.transformer.wte.weight -= shift
        model.lm_head = nn.Linear(16, VOCAB, bias=False, dtype=torch.float64)  # untie: old head, new wte
        model.lm_head.weight.copy_(head_before)
        model.transformer.wte.weight += shift
        assert float(untied) == pytest.approx(float(ReferenceLoss(model, causal=True)({}, batch)), rel=1e-13)
    assert float(tied) != pytest.approx(float(untied), rel=1e-6)


def test_batch_weights_count_the_terms_the_loss_averages(problems):
    """A list of batches equals their concatenation: weights are the loss terms after the shift and
    the ignored labels (4 : 16 here, where counting the labels before the shift gives 4 : 20)."""
    model, _, _ = problems["gpt2"]
    loss_fn = make_loss_fn(model)
    params = param_dicts.cast(dict(model.named_parameters()), torch.float64)
    whole = causal_batch(5, rows=5, length=6, padded=((0, 5), (1, 2)))
    parts = [{k: t[:1] for k, t in whole.items()}, {k: t[1:] for k, t in whole.items()}]
    parts[0]["labels"][0, :1] = -100  # ignored from the start too
    whole["labels"][0, :1] = -100
    assert [count_loss_terms(b) for b in parts] == [4, 2 + 3 * 6]  # labels that aren't -100
    assert [loss_fn.loss_terms(b) for b in parts] == [4, 1 + 3 * 5]  # ... of them, predicted after the shift
    assert [w for _, w in weighted_batches(parts, loss_fn)] == pytest.approx([4 / 20, 16 / 20])
    v = direction(params, 3)
    reference = hvp(loss_fn, params, whole, v)
    assert rel_error(hvp(loss_fn, params, parts, v), reference) < 1e-12
    tuples = [(b["input_ids"], b["labels"]) for b in parts]  # tuples weigh the same
    assert rel_error(hvp(loss_fn, params, tuples, v, method="rev_rev"), reference) < 1e-12
    # classification: one term per labelled sequence
    model, batch, _ = problems["bert"]
    loss_fn = make_loss_fn(model)
    params = param_dicts.cast(dict(model.named_parameters()), torch.float64)
    parts = [{k: t[:1] for k, t in batch.items()}, {k: t[1:] for k, t in batch.items()}]
    assert [loss_fn.loss_terms(b) for b in parts] == [1, 2]
    v = direction(params, 4)
    assert rel_error(hvp(loss_fn, params, parts, v), hvp(loss_fn, params, batch, v)) < 1e-12


def test_roles_from_structure(problems):
    gpt2_roles = parameter_roles(problems["gpt2"][0])
    assert gpt2_roles["transformer.wte.weight"] == gpt2_roles["lm_head.weight"] == "head"  # tied
    assert gpt2_roles["transformer.wpe.weight"] == "embedding"
    assert gpt2_roles["transformer.h.0.attn.c_attn.weight"] == "hidden"
    assert gpt2_roles["transformer.h.0.attn.c_attn.bias"] == "bias"
    assert gpt2_roles["transformer.ln_f.weight"] == gpt2_roles["transformer.h.1.ln_2.bias"] == "norm"

    bert_model = problems["bert"][0]
    roles = parameter_roles(bert_model)
    assert roles["bert.encoder.layer.0.attention.output.dense.weight"] == "hidden"
    assert roles["classifier.weight"] == roles["classifier.bias"] == "head"
    assert roles["bert.embeddings.token_type_embeddings.weight"] == "embedding"
    assert roles["bert.embeddings.LayerNorm.weight"] == "norm"
    layer = group_parameters([n for n, _ in bert_model.named_parameters()], blocks="layer", model=bert_model)
    assert list(layer) == ["embedding", "layer0", "layer1", "pooler", "head"]
    assert "bert.embeddings.LayerNorm.weight" in layer["embedding"]
    kind = {n: b for b, ns in group_parameters(roles, blocks="kind", model=bert_model).items() for n in ns}
    assert kind["bert.encoder.layer.0.attention.output.dense.weight"] == "attn_o"
    assert kind["bert.encoder.layer.0.output.dense.weight"] == "mlp_out"
    assert kind["classifier.weight"] == "head"

    llama_model = problems["llama"][0]
    roles = parameter_roles(llama_model)
    assert roles["lm_head.weight"] == "head" and roles["model.embed_tokens.weight"] == "embedding"
    assert roles["model.norm.weight"] == roles["model.layers.0.input_layernorm.weight"] == "norm"
    layer = group_parameters([n for n, _ in llama_model.named_parameters()], blocks="layer", model=llama_model)
    assert list(layer) == ["embedding", "layer0", "layer1", "final_norm", "head"]  # no block named "model"
    assert layer["final_norm"] == ["model.norm.weight"]

    score = parameter_roles(GPT2ForSequenceClassification(gpt2_config(num_labels=3)))
    assert score["score.weight"] == "head" and score["transformer.wte.weight"] == "embedding"

    lora_roles = parameter_roles(problems["lora"][0])
    adapters = [n for n in lora_roles if "lora_" in n]
    assert adapters and all(lora_roles[n] == "hidden" for n in adapters)
    assert lora_roles["base_model.model.lm_head.weight"] == "head"

    with pytest.raises(ValueError, match="matches no parameter"):
        parameter_roles(bert_model, overrides={"nothing.*": "head"})
    assert parameter_roles(bert_model, overrides={"bert.pooler.*": "other"})["bert.pooler.dense.weight"] == "other"


def test_muon_takes_the_hidden_matrices_and_reads_conv1d_transposed():
    """Muon's split by role; its shape scale by the mathematical (out, in) shape: GPT-2's c_fc stores
    (16, 64) but maps 16 -> 64, so its 'original' scale is sqrt(64/16) = 2 (1 if read as stored);
    c_attn maps 16 -> 48: sqrt(3); mlp.c_proj stores (64, 16), maps 64 -> 16: 1 (2 if read as stored)."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_config()).eval()
    perturb_norms(model)  # (LayerNorm biases: inputs not centred, so the gradients have full rank)
    opt = build_optimizer("muon", model, polar="svd", lr=0.02)
    roles = parameter_roles(model)
    in_muon = {id(p) for g in opt.optimizers["muon"].param_groups for p in g["params"]}
    assert {n for n, p in model.named_parameters() if id(p) in in_muon} == {
        n for n, r in roles.items() if r == "hidden"
    }
    batch = causal_batch(6, rows=4, length=8, padded=())  # 28 predicted tokens: full-rank 16 x 64 gradients
    G, Z = next_update(model, opt, make_loss_fn(model), batch, dtype=torch.float64)
    for name, scale in (("transformer.h.0.mlp.c_fc.weight", 2.0), ("transformer.h.0.attn.c_attn.weight", 3**0.5)):
        expected = 0.02 * scale * msign(G[name], polar="svd")
        np.testing.assert_allclose(Z[name].numpy(), expected.numpy(), rtol=1e-4, atol=1e-7)
    # mlp.c_proj's gradient has rank 15 (the next LayerNorm centres it), so compare singular values
    singular = torch.linalg.svdvals(Z["transformer.h.0.mlp.c_proj.weight"])
    np.testing.assert_allclose(singular[:15].numpy(), 0.02, rtol=1e-6)


def test_next_update_leaves_the_rng_and_handles_frozen_parameters(problems):
    model, batch, _ = problems["lora"]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    loss_fn = make_loss_fn(model)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    _, z1 = next_update(model, opt, loss_fn, batch)  # train mode: LoRA and GPT-2 dropout are live
    assert torch.equal(torch.get_rng_state(), state)
    _, z2 = next_update(model, opt, loss_fn, batch)
    assert all(torch.equal(z1[k], z2[k]) for k in z1)  # the same masks, from the same untouched state
    model.eval()
    _, z_eval = next_update(model, opt, loss_fn, batch)
    model.train()
    assert any(not torch.equal(z1[k], z_eval[k]) for k in z1)  # dropout really ran in train mode


# --- Hugging Face Trainer checkpoints ---------------------------------------------------------------


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, rows: int, length: int, seed: int):
        self.ids = torch.randint(1, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory):
    """A real Trainer run: tiny GPT-2, 2 steps of 2 accumulated micro-batches, AdamW, clipping, CPU."""
    out = tmp_path_factory.mktemp("trainer")
    torch.manual_seed(0)
    trainer = hf_trainer(
        GPT2LMHeadModel(gpt2_config()), out, TokenDataset(32, 8, 0), max_steps=2, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, learning_rate=1e-3, lr_scheduler_type="constant", weight_decay=0.1,
        max_grad_norm=1.0, save_steps=2, logging_steps=1, seed=0,
    )  # fmt: skip
    trainer.train()
    return trainer, out / "checkpoint-2", write_token_shards(out / "data", VOCAB)


def test_trainer_checkpoint_is_read_as_the_trainer_left_it(trainer_run):
    from curvlab.runs.checkpoint import read_checkpoint
    from curvlab.runs.hf import trainer_optimizer

    trainer, path, _ = trainer_run
    read = read_checkpoint(path)
    assert read.format == "hf-trainer"
    ckpt = read.payload
    assert (ckpt.step, ckpt.accumulation_steps, ckpt.batch_size, ckpt.max_grad_norm) == (2, 2, 4, 1.0)
    opt = trainer_optimizer(ckpt)
    live = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # (accelerate wraps it)
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    ours = dict(ckpt.model.named_parameters())
    for p, state in live.state.items():
        mine = opt.state[ours[names[id(p)]]]
        assert all(torch.equal(state[k], mine[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in live.param_groups]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    # the next step from the checkpoint is the next step of the live trainer, bit for bit
    batches = [causal_batch(s, rows=4, length=8, padded=()) for s in (8, 9)]
    model = trainer.model.eval()
    _, z_live = next_update(model, live, make_loss_fn(model), batches, max_grad_norm=1.0)
    _, z_read = next_update(ckpt.model, opt, make_loss_fn(ckpt.model), batches, max_grad_norm=1.0)
    assert z_live.keys() == z_read.keys() and all(torch.equal(z_live[k], z_read[k]) for k in z_live)


def test_nds_command_on_a_trainer_checkpoint(trainer_run, tmp_path):
    from typer.testing import CliRunner

    from curvlab.analysis.report import load_report
    from curvlab.cli import app

    runner = CliRunner()
    _, path, data = trainer_run
    r = runner.invoke(app, ["nds", str(path), "--data", str(data), "--out", str(tmp_path / "r.json")])
    assert r.exit_code == 0, r.output
    report = load_report(tmp_path / "r.json")
    assert report.optimizer == "adamw" and report.step == 2 and math.isfinite(report.split.nds)
    assert report.blocks.names == ("embedding", "layer0", "layer1", "final_norm", "head")
    draw = report.next_batch
    assert draw.source == "seeded draw" and draw.seed == 2 and draw.micro_batches == 2
    assert len(draw.rows) == 2 * 4
    r = runner.invoke(app, ["nds", str(path)])
    assert r.exit_code == 2 and "pass --data" in r.output
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in path.iterdir():
        if f.name != "optimizer.pt":
            (broken / f.name).write_bytes(f.read_bytes())
    r = runner.invoke(app, ["nds", str(broken), "--data", str(data)])
    assert r.exit_code == 2 and "no optimizer.pt" in r.output and len(r.output.strip().splitlines()) == 1
    (broken / "optimizer.pt").write_bytes((path / "optimizer.pt").read_bytes())
    torch.save({"args": Path("elsewhere")}, broken / "training_args.bin")  # a pickle naming a foreign class
    r = runner.invoke(app, ["nds", str(broken), "--data", str(data)])
    assert r.exit_code == 2 and "refusing to unpickle" in r.output


# -- a mixture of experts as it trains: the router's load-balancing loss is part of its loss (issue 32) -------


def mixtral(**kw) -> nn.Module:
    torch.manual_seed(5)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
        output_router_logits=True,
        router_aux_loss_coef=0.5,
        experts_implementation="eager",
        **kw,
    )  # fmt: skip  (eager experts: the grouped-matmul kernel has no float64)
    return transformers.MixtralForCausalLM(config).eval()


def test_a_mixture_of_experts_loss_includes_its_router_loss(monkeypatch):
    from transformers.models.mixtral.modeling_mixtral import MixtralRMSNorm

    model = mixtral()
    batch = causal_batch(6)
    params = {k: t.detach() for k, t in model.named_parameters()}
    own = model(**batch)
    assert own.aux_loss is not None and float(0.5 * own.aux_loss) > 1e-3  # large enough to be missed
    # float32, as the model's own .loss: equal to it, and the language model's loss alone is not
    assert float(make_loss_fn(model)(params, batch)) == pytest.approx(float(own.loss), rel=1e-6)
    alone = float(make_loss_fn(model, router_loss=False)(params, batch))
    assert alone == pytest.approx(float(own.loss - 0.5 * own.aux_loss), rel=1e-6)
    assert abs(alone - float(own.loss)) > 1e-3
    # float64: gradient and HVP against double backward of the model's loss written from its outputs
    monkeypatch.setattr(MixtralRMSNorm, "forward", float64_rms_norm)
    model = model.double()
    params = {k: t.detach() for k, t in model.named_parameters()}

    def reference(leaves, b):
        out = functional_call(model, leaves, (), {k: v for k, v in b.items() if k != "labels"})
        logits, labels = out.logits[:, :-1], b["labels"][:, 1:]
        ce = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
        return ce + model.config.router_aux_loss_coef * out.aux_loss

    v = direction(params, 7)
    loss, g_ref, (hv_ref,) = double_backward(reference, params, batch, [v])
    loss_fn = make_loss_fn(model)
    assert float(loss_fn(params, batch)) == pytest.approx(loss, rel=1e-13)
    hv = hvp(loss_fn, params, batch, v)
    assert rel_error(hv, hv_ref) < 1e-10
    router = [k for k in params if k.endswith("gate.weight")]
    assert router and all(g_ref[k].abs().max() > 0 for k in router)  # the router learns from its own loss


def test_fused_experts_are_hidden_matrices_one_per_expert():
    """Mixtral's experts are two 3-D stacks per layer (experts x out x in): role hidden, Muon's, each expert
    orthogonalized and scaled as its own matrix (against a float64 SVD per expert), in the hidden subset and
    in the MLP's kinds; an override takes them back."""
    model = mixtral().double()
    names = [n for n, _ in model.named_parameters()]
    stacks = [n for n in names if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(stacks) == 4
    roles = parameter_roles(model)
    assert {roles[n] for n in stacks} == {"hidden"}
    shapes = matrix_shapes(model)
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == (4, 48, 16)
    assert shapes["model.layers.0.mlp.experts.down_proj"] == (4, 16, 24)
    params = trainable_parameters(model)
    assert set(stacks) <= set(hidden_matrices(params, model=model))
    kinds = group_parameters(names, blocks="kind", model=model)
    assert {n for n in stacks if "gate_up" in n} <= set(kinds["mlp_in"])
    assert {n for n in stacks if "down" in n} <= set(kinds["mlp_out"])

    opt = build_optimizer("muon", model, lr=0.1, polar="svd")
    muon = opt.optimizers["muon"]
    in_muon = {id(p) for g in muon.param_groups for p in g["params"]}
    table = dict(model.named_parameters())
    assert in_muon == {id(table[n]) for n in names if roles[n] == "hidden"}
    assert [g["stacked"] for g in muon.param_groups] == [False, True]
    before = {n: table[n].detach().clone() for n in stacks}
    model(**causal_batch(6)).loss.backward()
    grads = {n: table[n].grad.clone() for n in stacks}
    opt.step()
    for n in stacks:  # the first step's momentum is a multiple of G: W_e - lr * s(out, in) * msign(G_e)
        U, S, Vh = np.linalg.svd(grads[n].numpy(), full_matrices=False)
        keep = S.max(axis=-1, keepdims=True) * max(grads[n].shape[1:]) * np.finfo(float).eps < S
        polar = torch.from_numpy((U * keep[:, None, :]) @ Vh)
        scale = math.sqrt(max(1, grads[n].shape[1] / grads[n].shape[2]))
        torch.testing.assert_close(table[n].detach(), before[n] - 0.1 * scale * polar, rtol=0, atol=1e-12)

    overridden = parameter_roles(model, overrides={"*.experts.*": "other"})
    opt = build_optimizer("muon", model, muon_rule=lambda n, p: overridden[n] == "hidden")
    assert not {id(table[n]) for n in stacks} & {
        id(p) for g in opt.optimizers["muon"].param_groups for p in g["params"]
    }


class ZLossModel(nn.Module):
    """A module whose output carries a router z-loss: curvlab can't know its weight in the model's loss."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x):
        logits = self.linear(x)
        return {"logits": logits, "router_z_loss": logits.pow(2).mean()}


def test_a_router_loss_curvlab_cannot_weigh_is_refused():
    model = ZLossModel()
    batch = (torch.randn(2, 4), torch.randn(2, 3))
    params = dict(model.named_parameters())
    with pytest.raises(CurvlabError, match=r"ZLossModel returns router loss\(es\) router_z_loss .*router_loss=False"):
        make_loss_fn(model, criterion=F.mse_loss)(params, batch)
    plain = make_loss_fn(model, criterion=F.mse_loss, router_loss=False)(params, batch)
    assert float(plain) == pytest.approx(float(F.mse_loss(model(batch[0])["logits"], batch[1])))


def test_whisper_gets_its_decoder_inputs_as_its_forward_makes_them():
    """Whisper has no prepare_decoder_input_ids_from_labels: curvlab shifts the labels right as its own
    forward does, so the loss is the model's, and the HVP is double backward's."""
    torch.manual_seed(8)
    config = transformers.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=8, encoder_layers=1, decoder_layers=1, d_model=16, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_source_positions=6,
        max_target_positions=8, pad_token_id=0, decoder_start_token_id=1, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = transformers.WhisperForConditionalGeneration(config).eval()
    g = torch.Generator().manual_seed(9)
    labels = torch.randint(3, VOCAB, (2, 5), generator=g)
    labels[1, 3:] = -100
    batch = {"input_features": torch.randn(2, 8, 12, generator=g), "labels": labels}
    params = {k: t.detach() for k, t in model.named_parameters()}
    assert float(make_loss_fn(model)(params, batch)) == pytest.approx(float(model(**batch).loss), rel=1e-6)
    model = model.double()
    params = {k: t.detach() for k, t in model.named_parameters()}
    batch = {**batch, "input_features": batch["input_features"].double()}

    def reference(leaves, b):
        out = functional_call(model, leaves, (), {**b})  # the model makes its decoder inputs itself
        return F.cross_entropy(out.logits.reshape(-1, VOCAB), b["labels"].reshape(-1), ignore_index=-100)

    v = direction(params, 10)
    loss, _, (hv_ref,) = double_backward(reference, params, batch, [v])
    loss_fn = make_loss_fn(model)
    assert float(loss_fn(params, batch)) == pytest.approx(loss, rel=1e-13)
    assert rel_error(hvp(loss_fn, params, batch, v), hv_ref) < 1e-10


def test_shifted_right_is_hugging_faces_shift_and_refuses_without_its_ids():
    from transformers.models.bart.modeling_bart import shift_tokens_right

    from curvlab.engine.loss import shifted_right

    labels = torch.tensor([[5, 6, 7, -100], [8, -100, -100, -100]])
    model = nn.Module()
    model.config = transformers.PretrainedConfig(pad_token_id=0, decoder_start_token_id=2)
    assert torch.equal(shifted_right(labels, model), shift_tokens_right(labels, 0, 2))
    model.config = transformers.PretrainedConfig(pad_token_id=0)
    with pytest.raises(CurvlabError, match="no decoder_start_token_id and pad_token_id .*pass decoder_input_ids"):
        shifted_right(labels, model)
