"""curvlab on the clients users bring next (issue 22): stochastic layers (OPT's LayerDrop, ConvNext's
DropPath), activation checkpointing (directly and in a real ``transformers.Trainer`` run), T5 as a
sequence-to-sequence model, peft prompt tuning, the float64 precision warning on GPT-NeoX and Qwen2,
and the structural roles and groupings (IA3, patch embeddings, encoder-decoder layers, attention vs
MLP). Every model is tiny and random-init from a config (nothing is downloaded).

References are written here, independently of curvlab: the loss from the logits of an eval-mode
float64 copy of the model (``torch.func.functional_call``), the causal shift or T5's decoder inputs
written out, ``F.cross_entropy(ignore_index=-100)``; HVPs of it by plain double backward on the math
attention backend; or Hugging Face's own ``.loss``.
"""

from __future__ import annotations

import copy
import inspect
import math
import warnings

import peft
import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn
from torch.func import functional_call

from curvlab import (
    CurvatureMonitor,
    block_matrix,
    build_optimizer,
    evaluate_loss,
    exact_second_order,
    forward_quadratic_form,
    group_parameters,
    hidden_matrices,
    hvp,
    make_loss_fn,
    parameter_roles,
)
from curvlab.engine import params as param_dicts
from curvlab.engine.loss import token_cross_entropy
from curvlab.errors import CurvlabError
from curvlab.runs.monitor import trainer_curvature_callback
from tests.builders import hf_trainer
from tests.reference import double_backward

transformers.logging.set_verbosity_error()
VOCAB = 30


# --- the models -----------------------------------------------------------------------------------


def opt(**kw) -> nn.Module:
    config = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=8, num_hidden_layers=2, ffn_dim=16,
                                    num_attention_heads=2, max_position_embeddings=16, word_embed_proj_dim=8, **kw)  # fmt: skip
    return transformers.OPTForCausalLM(config)


def convnext() -> nn.Module:
    config = transformers.ConvNextConfig(num_channels=3, hidden_sizes=[4, 8], depths=[1, 1], num_stages=2,
                                         num_labels=3, drop_path_rate=0.5, patch_size=2)  # fmt: skip
    return transformers.ConvNextForImageClassification(config)


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=8, n_layer=2, n_head=2)
    return transformers.GPT2LMHeadModel(config)


def t5() -> nn.Module:
    config = transformers.T5Config(vocab_size=VOCAB, d_model=8, d_kv=4, d_ff=16, num_layers=2, num_decoder_layers=2,
                                   num_heads=2, decoder_start_token_id=0, pad_token_id=0)  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


def bart() -> nn.Module:
    config = transformers.BartConfig(vocab_size=VOCAB, d_model=8, encoder_layers=1, decoder_layers=1,
                                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=16,
                                     decoder_ffn_dim=16, max_position_embeddings=16, pad_token_id=1, bos_token_id=0,
                                     eos_token_id=2, decoder_start_token_id=2)  # fmt: skip
    return transformers.BartForConditionalGeneration(config)


def neox() -> nn.Module:
    config = transformers.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                                        intermediate_size=16, max_position_embeddings=16)  # fmt: skip
    return transformers.GPTNeoXForCausalLM(config)


def qwen2(attn: str) -> nn.Module:
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, intermediate_size=16, max_position_embeddings=16,
                                      attn_implementation=attn)  # fmt: skip
    return transformers.Qwen2ForCausalLM(config)


def distilbert() -> nn.Module:
    config = transformers.DistilBertConfig(vocab_size=VOCAB, dim=8, n_layers=2, n_heads=2, hidden_dim=16,
                                           max_position_embeddings=16, num_labels=3)  # fmt: skip
    return transformers.DistilBertForSequenceClassification(config)


def bert() -> nn.Module:
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=16, max_position_embeddings=16, num_labels=3)  # fmt: skip
    return transformers.BertForSequenceClassification(config)


def vit() -> nn.Module:
    config = transformers.ViTConfig(hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=16,
                                    image_size=8, patch_size=4, num_channels=3, num_labels=3)  # fmt: skip
    return transformers.ViTForImageClassification(config)


def token_batch(seed: int, rows: int = 2, length: int = 6) -> dict:
    """Causal-LM tokens with the second row padded; the first holds OPT's padding token 1 (its
    embedding's padding_idx)."""
    ids = torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))
    ids[0, 1] = 1
    mask = torch.ones_like(ids)
    mask[1, length - 2 :] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.where(mask.bool(), ids, -100)}


def seq2seq_batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (2, 5), generator=g)
    labels = torch.randint(1, VOCAB, (2, 4), generator=g)
    labels[1, 2:] = -100
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


# --- the independent reference --------------------------------------------------------------------


class ReferenceLoss:
    """The model's loss written out here, on an eval-mode float64 copy: ``"causal"`` (shifted),
    ``"seq2seq"`` (T5's decoder inputs: the labels shifted right behind the start token, -100 -> pad;
    unshifted), ``"classes"`` (one label per example); -100 ignored."""

    def __init__(self, model: nn.Module, kind: str, prefix: int = 0):
        self.model = copy.deepcopy(model).double().eval()
        self.kind, self.prefix = kind, prefix
        for m in self.model.modules():  # (padding_idx changes torch's gradient, not the function: the Hessian is L's)
            if isinstance(m, nn.Embedding):
                m.padding_idx = None

    def __call__(self, params, batch):
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        labels = batch["labels"]
        if self.kind == "seq2seq":
            config = self.model.config
            start = torch.full_like(labels[:, :1], config.decoder_start_token_id)
            shifted = torch.cat([start, labels[:, :-1]], dim=1)
            inputs["decoder_input_ids"] = shifted.masked_fill(shifted == -100, config.pad_token_id)
        logits = functional_call(self.model, params, (), inputs).logits
        if self.prefix:  # a prompt-tuning model's virtual tokens predict nothing but the first label
            labels = torch.cat([torch.full_like(labels[:, : self.prefix], -100), labels], dim=1)
        if self.kind == "causal":
            logits, labels = logits[:, :-1], labels[:, 1:]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def rel_error(a, b) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in b) / max(float(b[k].abs().max()) for k in b)


def direction(params, seed):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(t.shape, generator=g, dtype=torch.float64) for k, t in params.items()}


def float64_params(model):
    return {k: t.detach().double() for k, t in model.named_parameters() if t.requires_grad}


def training_flags(model):
    return [m.training for m in model.modules()]


# --- item 1: stochastic layers --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["opt_layerdrop", "convnext_droppath"])
def test_stochastic_layers_are_off_inside_the_exact_mode(name):
    """LayerDrop (OPT, ``torch.rand([]) < layerdrop``) and DropPath (ConvNext, ``torch.rand`` masks)
    fire in train mode; curvature on the train-mode model is deterministic and equals the eval-mode
    double-backward reference, and the model is left in train mode."""
    torch.manual_seed(0)
    if name == "opt_layerdrop":
        model, batch, kind = opt(layerdrop=0.5).double().train(), token_batch(1), "causal"
    else:
        model = convnext().double().train()
        x = torch.randn(3, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        batch, kind = {"pixel_values": x, "labels": torch.tensor([0, 2, 1])}, "classes"
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():  # the stochastic layers really are live in train mode
        outs = [model(**inputs).logits for _ in range(8)]
    assert any(not torch.equal(outs[0], o) for o in outs[1:])
    flags = training_flags(model)
    loss_fn, params = make_loss_fn(model), float64_params(model)
    v = direction(params, 2)
    loss, _, (hv,) = double_backward(ReferenceLoss(model, kind), params, batch, [v])
    for method in ("rev_rev", "fwd_rev"):
        first, second = hvp(loss_fn, params, batch, v, method=method), hvp(loss_fn, params, batch, v, method=method)
        assert all(torch.equal(first[k], second[k]) for k in first), method
        assert rel_error(first, hv) < 1e-12, method
    assert evaluate_loss(loss_fn, params, batch) == pytest.approx(loss, rel=1e-13)
    assert training_flags(model) == flags  # put back as it was

    def own(p, b):  # a loss function of the user's own over the module, on the train-mode model itself
        logits, labels = functional_call(model, p, (), inputs).logits, b["labels"]
        if kind == "causal":
            logits, labels = logits[:, :-1], labels[:, 1:]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)

    with exact_second_order(method="rev_rev", model=model):  # (exact_second_order(model=...) runs it as in eval mode)
        assert float(own(params, batch)) == pytest.approx(loss, rel=1e-13)
    assert training_flags(model) == flags


# --- item 7: activation checkpointing -------------------------------------------------------------


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_is_off_inside_the_exact_mode(reentrant):
    """With Hugging Face's gradient checkpointing on (both torch implementations) and the model in
    train mode, every path equals the eval-mode reference; checkpointing and train mode are back after."""
    torch.manual_seed(0)
    model = gpt2().double()
    model.gradient_checkpointing_enable({"use_reentrant": reentrant})
    model.train()
    batch = token_batch(3)
    loss_fn, params = make_loss_fn(model), float64_params(model)
    v = direction(params, 4)
    ref = ReferenceLoss(model, "causal")
    _, _, (hv,) = double_backward(ref, params, batch, [v])
    for method in ("rev_rev", "fwd_rev"):
        assert rel_error(hvp(loss_fn, params, batch, v, method=method), hv) < 1e-12, method
    _, zhz = forward_quadratic_form(loss_fn, params, batch, v)
    assert zhz == pytest.approx(param_dicts.dot(v, hv), rel=1e-10)
    assert model.training and model.is_activation_checkpointing


@pytest.mark.parametrize("reentrant", [False, True])
def test_torch_checkpoint_called_by_the_model_itself_runs_plainly_inside(reentrant):
    """A model calling ``torch.utils.checkpoint.checkpoint`` with no flag to turn off: every path, in
    float32 and float64, equals the reference without checkpointing (the recompute would have run on
    the module's own weights, outside the mode); outside the mode it checkpoints as before."""
    from torch.utils.checkpoint import checkpoint  # (bound here: the patch must reach it anyway)

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)

        def forward(self, x):
            return self.b(checkpoint(lambda y: torch.tanh(self.a(y)), x, use_reentrant=reentrant))

        def plain(self, p, x):
            return functional_call(self.b, {"weight": p["b.weight"], "bias": p["b.bias"]}, (torch.tanh(
                functional_call(self.a, {"weight": p["a.weight"], "bias": p["a.bias"]}, (x,))),))  # fmt: skip

    torch.manual_seed(0)
    model = Checkpointed()
    x, y = torch.randn(6, 4, requires_grad=reentrant), torch.randint(0, 3, (6,))
    params = float64_params(model)
    v = direction(params, 3)
    _, _, (hv,) = double_backward(
        lambda p, b: F.cross_entropy(model.plain(p, b[0].double()), b[1]), params, (x, y), [v]
    )
    loss_fn = make_loss_fn(model, criterion=F.cross_entropy)
    for dtype, tolerance in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        for method in ("rev_rev", "fwd_rev"):
            got = hvp(loss_fn, param_dicts.cast(params, dtype), (x, y), v, method=method)
            assert rel_error({k: t.double() for k, t in got.items()}, hv) < tolerance, (dtype, method)
    calls = []
    model.a.register_forward_hook(lambda *_: calls.append(1))
    hvp(loss_fn, params, (x, y), v)
    assert len(calls) == 1  # one forward, no recompute
    calls.clear()
    F.cross_entropy(model(x), y).backward()
    assert len(calls) == 2  # outside the mode torch checkpoints again: the forward and its recompute


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, rows: int, length: int, seed: int):
        self.ids = torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StepRecorder(transformers.TrainerCallback):
    """W before and after every optimizer step, independently of curvlab's monitor."""

    def __init__(self, model):
        self.model, self.steps, self._before = model, [], None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._before = {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def on_optimizer_step(self, args, state, control, **kwargs):
        after = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        self.steps.append((self._before, after))


def test_gradient_checkpointing_inside_a_real_trainer_run(tmp_path):
    """``Trainer(gradient_checkpointing=True)`` with ``trainer_curvature_callback`` measures every step (it
    used to die at the first), each row's NDS equal to the float64 double-backward NDS of the step
    the Trainer took, and training goes on with checkpointing on."""
    torch.manual_seed(0)
    model = gpt2().double()
    held = TokenDataset(2, 8, 1)
    held_batch = {"input_ids": held.ids, "labels": held.ids}
    monitor = CurvatureMonitor(model, None, make_loss_fn(model), held_batch, every=1)
    recorder = StepRecorder(model)
    trainer = hf_trainer(
        model, tmp_path, TokenDataset(16, 8, 0), [trainer_curvature_callback(monitor), recorder], max_steps=2,
        per_device_train_batch_size=4, learning_rate=1e-2, lr_scheduler_type="constant", gradient_checkpointing=True,
        save_strategy="no", seed=0,
    )  # fmt: skip
    trainer.train()
    assert model.is_activation_checkpointing
    assert [r.status for r in monitor.rows] == ["ok", "ok"] and len(recorder.steps) == 2
    ref = ReferenceLoss(model, "causal")
    for row, (before, after) in zip(monitor.rows, recorder.steps):
        z = {n: before[n] - after[n] for n in before}
        _, _, (hz,) = double_backward(ref, before, held_batch, [z])
        assert row.nds == pytest.approx(param_dicts.dot(z, hz) / param_dicts.dot(z, z), rel=1e-10)
    assert all(math.isfinite(e["loss"]) for e in trainer.state.log_history if "loss" in e)


# --- item 8: sequence to sequence -----------------------------------------------------------------


@pytest.fixture
def float64_t5_norm(monkeypatch):
    """T5LayerNorm without its float32 variance (which caps a float64 computation at float32 accuracy)."""
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    monkeypatch.setattr(T5LayerNorm, "forward", forward)


@pytest.mark.filterwarnings("error::UserWarning")  # (and no precision warning once the norm is float64)
@pytest.mark.parametrize("build", [t5, bart])
def test_encoder_decoders_are_sequence_to_sequence_models(float64_t5_norm, build):
    """The batch a Hugging Face user passes (input_ids, attention_mask, labels with -100): decoder
    inputs from the labels, unshifted token CE; Hugging Face's own .loss, and every path against
    the reference with the decoder inputs written out here. (BART's decoder inputs hold its padding
    token, where the -100s were: its embedding's padding_idx is in play.)"""
    torch.manual_seed(0)
    model = build().double().train()
    batch = seq2seq_batch(5)
    loss_fn, params = make_loss_fn(model), float64_params(model)
    with torch.no_grad():
        own = float(copy.deepcopy(model).eval()(**batch).loss)
    assert evaluate_loss(loss_fn, params, batch) == pytest.approx(own, rel=1e-13)
    assert loss_fn.loss_terms(batch) == int((batch["labels"] != -100).sum())
    assert evaluate_loss(make_loss_fn(model, criterion=token_cross_entropy), params, batch) == pytest.approx(own)
    v = direction(params, 6)
    ref = ReferenceLoss(model, "seq2seq")
    loss, _, (hv,) = double_backward(ref, params, batch, [v])
    assert loss == pytest.approx(own, rel=1e-13)
    for method in ("rev_rev", "fwd_rev"):
        assert rel_error(hvp(loss_fn, params, batch, v, method=method), hv) < 1e-12, method
    # decoder inputs the batch brings are used as they are
    given = {**batch, "decoder_input_ids": torch.ones_like(batch["labels"])}
    assert evaluate_loss(loss_fn, params, given) != pytest.approx(own, rel=1e-6)


# --- item 2: encoder-decoder layer blocks ---------------------------------------------------------


def test_encoder_and_decoder_layers_are_separate_blocks(float64_t5_norm):
    """T5's encoder.block.0 and decoder.block.0 are two blocks (with their final norms beside them);
    the block matrix over them against the reference's block HVPs."""
    torch.manual_seed(0)
    model = t5().double()
    names = [n for n, _ in model.named_parameters()]
    blocks = group_parameters(names, blocks="layer", model=model)
    assert list(blocks) == [
        "encoder.block.0", "encoder.block.1", "encoder.final_norm",
        "decoder.block.0", "decoder.block.1", "decoder.final_norm", "head",
    ]  # fmt: skip
    for block, members in blocks.items():
        stacks = {n.split(".")[0] for n in members}
        assert stacks == ({"shared"} if block == "head" else {block.split(".")[0]}), block
    # T5's relative position bias (an nn.Embedding inside layer 0's attention) is layer 0's
    assert "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight" in blocks["encoder.block.0"]
    batch = seq2seq_batch(7)
    params = float64_params(model)
    z = direction(params, 8)
    bm = block_matrix(make_loss_fn(model), params, batch, z, blocks="layer")
    members = list(bm.members.values())
    _, _, hvs = double_backward(
        ReferenceLoss(model, "seq2seq"), params, batch, [param_dicts.restrict(z, b) for b in members]
    )
    expected = torch.tensor(
        [[param_dicts.dot(z, hm, b) / param_dicts.dot(z, z) for hm in hvs] for b in members], dtype=torch.float64
    )
    got = torch.tensor(bm.matrix, dtype=torch.float64)
    assert float((got - expected).abs().max()) <= 1e-12 * float(expected.abs().max())


# --- item 9: peft prompt tuning -------------------------------------------------------------------


def test_prompt_tuning_gives_hugging_faces_own_loss():
    """Prompt tuning prepends virtual tokens: evaluate_loss is the peft model's own .loss (labels
    behind -100s for the virtual tokens, as peft does), and the prompt's curvature is exact."""
    torch.manual_seed(0)
    base = gpt2()
    model = peft.get_peft_model(base, peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))
    batch = token_batch(9)
    loss_fn = make_loss_fn(model)
    params = {k: t.detach() for k, t in model.named_parameters() if t.requires_grad}
    assert list(params) == ["prompt_encoder.default.embedding.weight"]
    model.eval()
    with torch.no_grad():
        own = float(model(**batch).loss)
    model.train()
    assert evaluate_loss(loss_fn, params, batch) == pytest.approx(own, rel=1e-6)  # (float32, both)
    # the first label is predicted from the last virtual token: every label counts
    assert loss_fn.loss_terms(batch) == int((batch["labels"] != -100).sum())
    p64 = {k: t.double() for k, t in params.items()}
    v = direction(p64, 10)
    _, _, (hv,) = double_backward(ReferenceLoss(model, "causal", prefix=3), p64, batch, [v])
    for method in ("rev_rev", "fwd_rev"):
        assert rel_error(hvp(loss_fn, p64, batch, v, method=method), hv) < 1e-12, method


def test_logits_longer_than_the_labels_are_a_one_line_error():
    class Prepends(nn.Module):  # adds a position the labels don't have, as an unknown prompt method would
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, 4)
            self.out = nn.Linear(4, VOCAB)

        def forward(self, ids):
            return self.out(self.emb(torch.cat([ids[:, :1], ids], dim=1)))

    model = Prepends()
    ids = torch.randint(0, VOCAB, (2, 5))
    with pytest.raises(CurvlabError, match=r"logits \(2, 6, 30\) don't match its labels \(2, 5\)"):
        evaluate_loss(make_loss_fn(model), float64_params(model), (ids, ids))


# --- item 6: the precision warning ----------------------------------------------------------------


def _line_of(module, text: str) -> int:
    """The line of ``module``'s source that holds ``text`` (the one place it occurs)."""
    hits = [i + 1 for i, line in enumerate(inspect.getsource(module).splitlines()) if text in line]
    assert len(hits) == 1, hits
    return hits[0]


def test_precision_warning_names_only_parameter_dependent_casts_and_every_site(monkeypatch):
    """GPT-NeoX casts its rotary inv_freq table to float32 (a constant): no warning, and float64-exact.
    Qwen2 with eager attention downcasts in its RMSNorm and its softmax: both places are named; with
    the RMSNorm computing in float64 and sdpa attention (its rotary still casts inv_freq), no warning."""
    from transformers.models.qwen2 import modeling_qwen2

    torch.manual_seed(0)
    batch = token_batch(11)
    model = neox().double()
    params = float64_params(model)
    v = direction(params, 12)
    _, _, (hv,) = double_backward(ReferenceLoss(model, "causal"), params, batch, [v])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        for method in ("rev_rev", "fwd_rev"):
            assert rel_error(hvp(make_loss_fn(model), params, batch, v, method=method), hv) < 1e-12

    model = qwen2("eager").double()
    params = float64_params(model)
    v = direction(params, 13)
    norm = _line_of(modeling_qwen2, "hidden_states = hidden_states.to(torch.float32)")
    softmax = _line_of(modeling_qwen2, "softmax(attn_weights, dim=-1, dtype=torch.float32)")
    for method in ("rev_rev", "fwd_rev"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hvp(make_loss_fn(model), params, batch, v, method=method)
        messages = [str(w.message) for w in caught if "lower precision" in str(w.message)]
        assert len(messages) == 1, messages
        assert f"modeling_qwen2.py:{norm} in forward" in messages[0]
        assert f"modeling_qwen2.py:{softmax} in eager_attention_forward" in messages[0]

    def float64_rms_norm(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    monkeypatch.setattr(modeling_qwen2.Qwen2RMSNorm, "forward", float64_rms_norm)
    model = qwen2("sdpa").double()
    params = float64_params(model)
    _, _, (hv,) = double_backward(ReferenceLoss(model, "causal"), params, batch, [v])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert rel_error(hvp(make_loss_fn(model), params, batch, v), hv) < 1e-12


def test_a_random_draw_left_inside_the_exact_mode_is_reported():
    class Noisy(nn.Module):  # draws noise whatever its mode: nothing curvlab can turn off
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            return self.lin(x + 0.1 * torch.randn_like(x))

    model = Noisy().double().eval()
    params = float64_params(model)
    batch = (torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,)))
    with pytest.warns(UserWarning, match=r"draws random numbers.*randn_like\(\) at test_clients\.py:\d+ in forward"):
        hvp(make_loss_fn(model, criterion=F.cross_entropy), params, batch, direction(params, 1))

    class DirectDropout(Noisy):  # torch.dropout called directly, always in training form: the identity inside
        def forward(self, x):
            return self.lin(torch.dropout(torch.tanh(x), 0.5, True))

    model = DirectDropout().double()
    params, v = float64_params(model), direction(float64_params(model), 2)

    def plain(p, b):
        return F.cross_entropy(functional_call(model.lin, {k[4:]: t for k, t in p.items()}, (torch.tanh(b[0]),)), b[1])

    _, _, (hv,) = double_backward(plain, params, batch, [v])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert rel_error(hvp(make_loss_fn(model, criterion=F.cross_entropy), params, batch, v), hv) < 1e-12


# --- item 14: roles and kinds by structure --------------------------------------------------------


def test_kind_grouping_finds_attention_and_mlp_by_structure():
    """Attention vs MLP by the sub-blocks' place in each layer, whatever the projections are called."""
    expected = {
        neox: {
            "gpt_neox.layers.0.attention.query_key_value.weight": "attn_qkv",
            "gpt_neox.layers.0.attention.dense.weight": "attn_o",
            "gpt_neox.layers.1.mlp.dense_h_to_4h.bias": "mlp_in",
            "gpt_neox.layers.1.mlp.dense_4h_to_h.weight": "mlp_out",
        },
        t5: {
            "encoder.block.0.layer.0.SelfAttention.q.weight": "attn_q",
            "encoder.block.0.layer.0.SelfAttention.o.weight": "attn_o",
            "decoder.block.1.layer.1.EncDecAttention.k.weight": "cross_attn_k",
            "decoder.block.1.layer.1.EncDecAttention.o.weight": "cross_attn_o",
            "decoder.block.1.layer.2.DenseReluDense.wi.weight": "mlp_in",
            "encoder.block.1.layer.1.DenseReluDense.wo.weight": "mlp_out",
            "encoder.block.0.layer.0.layer_norm.weight": "norm",
        },
        opt: {  # (OPT registers k, v, q, out)
            "model.decoder.layers.0.self_attn.q_proj.weight": "attn_q",
            "model.decoder.layers.0.self_attn.k_proj.bias": "attn_k",
            "model.decoder.layers.0.self_attn.out_proj.weight": "attn_o",
            "model.decoder.layers.0.fc1.weight": "mlp_in",
            "model.decoder.layers.0.fc2.bias": "mlp_out",
        },
        distilbert: {
            "distilbert.transformer.layer.0.attention.v_lin.weight": "attn_v",
            "distilbert.transformer.layer.0.attention.out_lin.weight": "attn_o",
            "distilbert.transformer.layer.1.ffn.lin1.weight": "mlp_in",
            "distilbert.transformer.layer.1.ffn.lin2.weight": "mlp_out",
            "pre_classifier.weight": "hidden",
        },
        vit: {
            "vit.layers.0.attention.k_proj.weight": "attn_k",
            "vit.layers.0.attention.o_proj.weight": "attn_o",
            "vit.layers.1.mlp.fc1.weight": "mlp_in",
            "vit.layers.1.mlp.fc2.bias": "mlp_out",
            "vit.embeddings.patch_embeddings.projection.weight": "embedding",
            "classifier.weight": "head",
        },
        bert: {  # (the MLP is two sibling modules, intermediate and output)
            "bert.encoder.layer.0.attention.self.value.weight": "attn_v",
            "bert.encoder.layer.0.attention.output.dense.weight": "attn_o",
            "bert.encoder.layer.0.intermediate.dense.weight": "mlp_in",
            "bert.encoder.layer.0.output.dense.bias": "mlp_out",
            "bert.pooler.dense.weight": "hidden",
        },
    }
    for build, kinds in expected.items():
        model = build()
        names = [n for n, _ in model.named_parameters()]
        got = {n: b for b, ns in group_parameters(names, blocks="kind", model=model).items() for n in ns}
        assert {n: got[n] for n in kinds} == kinds, build.__name__

    class Block(nn.Module):  # names that say nothing: a token mixer of four maps, then two maps
        def __init__(self, d):
            super().__init__()
            self.norm_a = nn.LayerNorm(d)
            self.mix = nn.ModuleDict({k: nn.Linear(d, d) for k in "abcd"})
            self.up = nn.Linear(d, 2 * d)
            self.down = nn.Linear(2 * d, d)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stack = nn.ModuleList([Block(4), Block(4)])
            self.readout = nn.Linear(4, 3)

    got = {
        n: b
        for b, ns in group_parameters([n for n, _ in Net().named_parameters()], blocks="kind", model=Net()).items()
        for n in ns
    }
    assert [got[f"stack.0.mix.{k}.weight"] for k in "abcd"] == ["attn_q", "attn_k", "attn_v", "attn_o"]
    assert got["stack.1.up.bias"] == "mlp_in" and got["stack.1.down.weight"] == "mlp_out"  # a run of single maps
    assert got["stack.1.norm_a.weight"] == "norm" and got["readout.weight"] == "head"


def test_roles_rules_and_their_overrides():
    """IA3's (n, 1) and (1, n) vectors are not Muon matrices; a ViT's patchify conv is an embedding; a
    ResNet-style overlapping stem stays hidden; each rule is reversed by an override."""
    torch.manual_seed(0)
    config = peft.IA3Config(task_type="CAUSAL_LM", target_modules=["c_attn", "mlp.c_proj"],
                            feedforward_modules=["mlp.c_proj"], fan_in_fan_out=True)  # fmt: skip
    model = peft.get_peft_model(gpt2(), config)
    roles = parameter_roles(model)
    vectors = [n for n in roles if "ia3_l" in n]
    shapes = {tuple(model.get_parameter(n).shape) for n in vectors}
    assert shapes == {(24, 1), (1, 32)}  # c_attn's out x 1, mlp.c_proj's 1 x in
    assert all(roles[n] == "other" for n in vectors)
    with pytest.raises(CurvlabError, match="no hidden weight matrices for Muon"):  # (IA3 trains only its vectors)
        build_optimizer("muon", model)
    overridden = parameter_roles(model, overrides={"*.ia3_l.*": "hidden"})
    assert all(overridden[n] == "hidden" for n in vectors)
    muon = build_optimizer("muon", model, muon_rule=lambda n, p: overridden[n] == "hidden").optimizers["muon"]
    trainable = dict(model.named_parameters())
    assert {id(p) for g in muon.param_groups for p in g["params"]} == {id(trainable[n]) for n in vectors}

    model = vit()
    roles = parameter_roles(model)
    assert roles["vit.embeddings.patch_embeddings.projection.weight"] == "embedding"
    assert roles["vit.embeddings.patch_embeddings.projection.bias"] == "embedding"
    params = {n: p.detach() for n, p in model.named_parameters()}
    hidden = hidden_matrices(params, model=model)
    assert "vit.embeddings.patch_embeddings.projection.weight" not in hidden and "classifier.weight" not in hidden
    assert "vit.layers.0.attention.q_proj.weight" in hidden
    assert (
        parameter_roles(model, overrides={"*.patch_embeddings.projection.weight": "hidden"})[
            "vit.embeddings.patch_embeddings.projection.weight"
        ]
        == "hidden"
    )

    stem = nn.Sequential(nn.Conv2d(3, 4, 7, stride=2, padding=3), nn.ReLU(), nn.Conv2d(4, 4, 4, stride=4))
    assert parameter_roles(stem)["0.weight"] == "hidden"  # the overlapping stem reads no patches
    linear_vector = parameter_roles(nn.Sequential(nn.Linear(1, 5), nn.Linear(5, 1), nn.Linear(1, 2)))
    assert linear_vector["0.weight"] == linear_vector["1.weight"] == "hidden"  # linear maps stay matrices
