"""The table issue 32 closes with: for each client class its tests cover, curvlab's largest error in float64
against an independent reference. Run from the repository root:

    PYTHONPATH=. OMP_NUM_THREADS=1 python experiments/client_errors.py > table.md

Z: ``next_update``'s step against a twin (a copy of the model and optimizer taken before ``next_update``
runs) stepped for real after it, in the user's own loop: ``max|Z - (W - W_next)| / max|W - W_next|``; a
side effect (a buffer, a random stream) would show. Loss and HVP: against the loss written out from the
model's outputs on its own parameters and differentiated twice by ``torch.autograd.grad``, for one random
direction. The models, optimizers and checkpoints are the tests' (tiny, random, float64, nothing
downloaded). An error of 0 is bit for bit.
"""

import contextlib
import copy
import json
import shutil
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import pytorch_optimizer as po
import torch
import torch.nn.functional as F
import transformers
from torch.func import functional_call
from transformers.models.mixtral.modeling_mixtral import MixtralRMSNorm

from curvlab import hvp, make_loss_fn, next_update, restore_lightning
from curvlab.analysis.targets import open_checkpoint
from curvlab.runs.checkpoint import read_checkpoint
from curvlab.runs.foreign import Rebuild
from tests.conftest import trainer_checkpoint
from tests.reference import double_backward
from tests.test_clients import direction, rel_error
from tests.test_foreign_checkpoints import GPT_FIELDS, TrainedLitGPT, tiny_gpt2, token_data, trained_by_lightning
from tests.test_hf import VOCAB, causal_batch, float64_rms_norm, mixtral
from tests.test_hostile_files import bin_sharded_copy, sharded_copy
from tests.test_next_update_clients import (
    PolyakSGD,
    WithUnused,
    batch_for,
    math_attention,
    real_step,
    regression,
    regression_batch,
    tiny_gpt,
)

transformers.logging.set_verbosity_error()
ROWS = []


def row(client, compared, error, note=""):
    ROWS.append((client, compared, f"{error:.1e}" if isinstance(error, float) else error, note))


def deep_copy(model, opt):
    """A copy of the pair, the optimizer's whole ``__dict__`` over the copy's parameters (``copy.deepcopy`` of
    an optimizer keeps only its defaults, state and groups: SophiaH's ``update_period`` would be lost), but
    for the ``step`` an LR scheduler puts there, which steps the optimizer it was made for."""
    memo = {}
    twin_model, twin_opt = copy.deepcopy(model, memo), copy.copy(opt)
    twin_opt.__dict__ = copy.deepcopy({k: v for k, v in vars(opt).items() if k != "step"}, memo)
    return twin_model, twin_opt


def z_error(model, opt, batch, loss=make_loss_fn, twin=None, twin_loss=None, warmup=(), **loop):
    """``warmup`` real steps, then Z from ``next_update(model, opt, loss(model))`` against the real step of a
    copy of ``twin`` (default the pair itself), taken after it, in the loop ``loop`` asks for
    (tests/test_next_update_clients.py's ``real_step``) with the loss ``twin_loss(copy)`` (default ``loss``)."""
    for b in warmup:
        real_step(model, [opt], loss(model), b, **loop)
    twin_model, twin_opt = deep_copy(*(twin or (model, opt)))
    _, Z = next_update(model, opt, loss(model), batch)
    before = {n: p.detach().clone() for n, p in twin_model.named_parameters()}
    real_step(twin_model, [twin_opt], (twin_loss or loss)(twin_model), batch, **loop)
    after = dict(twin_model.named_parameters())
    return rel_error(Z, {n: before[n] - after[n].detach() for n in Z})  # (Z: the trainable parameters)


def curvature_rows(client, model, reference, batch, note="", loss=make_loss_fn):
    """Loss and HVP of ``loss(model)`` against double backward of ``reference(params, batch)``, on
    the parameters the loss uses (WithUnused's ``unused`` head is in no graph, so its HVP is no question)."""
    params = {n: p.detach() for n, p in model.named_parameters() if not n.startswith("unused.")}
    v = direction(params, 1)
    loss_ref, _, (hv_ref,) = double_backward(reference, params, batch, [v])
    loss_fn = loss(model)
    row(client, "loss vs the model's loss written out", abs(float(loss_fn(params, batch)) - loss_ref) / abs(loss_ref))
    row(client, "HVP vs double backward", rel_error(hvp(loss_fn, params, batch, v), hv_ref), note)


def regression_reference(model):
    return lambda leaves, b: F.mse_loss(functional_call(model, leaves, (b[0],)), b[1])


def weights_error(model, held):
    theirs = held.state_dict()
    return rel_error(model.state_dict(), {k: v for k, v in theirs.items() if v.is_floating_point()})


# -- models: an unused module, BatchNorm, spectral norm, a mixture of experts, Whisper ----------------------

WARM = [regression_batch(s) for s in range(2)]  # (two real steps first: the optimizers' state is not fresh)
for name, build in [
    ("AdamW", lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)),
    ("SGD-momentum", lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.01)),
]:
    torch.manual_seed(0)
    model = WithUnused().double()
    opt = build(model.parameters())
    err = z_error(model, opt, regression_batch(3), loss=regression, warmup=WARM)
    _, Z = next_update(model, opt, regression(model), regression_batch(3))
    moved = float(Z["unused.weight"].abs().max())
    row(f"unused module, {name}", "Z vs twin stepped for real", err, f"unused.weight's Z {moved:g}, .grad None")
curvature_rows("unused module", model, regression_reference(model), regression_batch(4), loss=regression)

torch.manual_seed(2)
model = WithUnused(norm=torch.nn.BatchNorm1d(8)).double().train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
err = z_error(model, opt, regression_batch(3), loss=regression, warmup=WARM)
stats = {n: b.clone() for n, b in model.named_buffers()}
next_update(model, opt, regression(model), regression_batch(4))
kept = all(torch.equal(b, stats[n]) for n, b in model.named_buffers())
row("BatchNorm (train mode)", "Z vs twin stepped for real", err, f"running statistics kept by next_update: {kept}")
reference = regression_reference(copy.deepcopy(model))  # (the copy's running statistics move, not the model's)
curvature_rows("BatchNorm (train mode)", model, reference, regression_batch(5), "batch statistics", regression)


def spectral_norm_model():
    torch.manual_seed(3)
    model = WithUnused().double().train()
    torch.nn.utils.parametrizations.spectral_norm(model.body)
    torch.nn.utils.spectral_norm(model.head)  # (both kinds: the parametrization and the legacy hook)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


model, opt = spectral_norm_model()
for b in WARM:
    real_step(model, [opt], regression(model), b)
with torch.random.fork_rng():  # (the legacy hook's module.weight, a non-leaf after a forward, has no deepcopy)
    twin = spectral_norm_model()
twin[0].load_state_dict(model.state_dict())  # (weights and the power iteration's vectors)
twin[1].load_state_dict(opt.state_dict())
err = z_error(model, opt, regression_batch(3), loss=regression, twin=twin)
row("spectral norm (train mode)", "Z vs twin stepped for real", err, "power iteration in each forward")
model.eval()  # (no power iteration: one function to differentiate)
curvature_rows("spectral norm (eval mode)", model, regression_reference(model), regression_batch(5), loss=regression)


def written_out(model):
    """The loss of a Hugging Face language model written out from its outputs, in its own dtype: the
    cross-entropy of its logits (shifted for a causal LM; an encoder-decoder makes its decoder inputs itself),
    plus the router's auxiliary loss as its config weighs it (the model's own ``.loss`` takes the
    cross-entropy of float32 logits: Hugging Face's loss functions cast them)."""

    def loss(leaves, b):
        inputs = b if model.config.is_encoder_decoder else {k: v for k, v in b.items() if k != "labels"}
        out = functional_call(model, leaves, (), dict(inputs))
        logits, labels = out.logits, b["labels"]
        if not model.config.is_encoder_decoder:  # (the causal shift)
            logits, labels = logits[:, :-1], labels[:, 1:]
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return ce if getattr(out, "aux_loss", None) is None else ce + model.config.router_aux_loss_coef * out.aux_loss

    return loss


def hugging_face_rows(client, model, batch, note=""):
    """The loss against the model's own ``.loss``, then the loss and HVP against double backward."""
    own = float(model(**batch).loss.detach())
    params = {n: p.detach() for n, p in model.named_parameters()}
    error = abs(float(make_loss_fn(model)(params, batch)) - own) / abs(own)
    row(client, "loss vs the model's own .loss", error, "its .loss: cross-entropy of float32 logits" if error else "")
    curvature_rows(client, model, written_out(model), batch, note)


MixtralRMSNorm.forward = float64_rms_norm  # (its float32 upcast would cap float64 at float32's accuracy)
model = mixtral().double()
note = "the router's softmax and aux loss are float32 inside: curvlab warns; both sides share them"
hugging_face_rows("Mixtral MoE, router aux loss on", model, causal_batch(6), note)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
err = z_error(model, opt, causal_batch(9), twin_loss=written_out, warmup=[causal_batch(7), causal_batch(8)])
row("Mixtral MoE, router aux loss on", "Z vs twin stepped for real", err, "AdamW, 2 warm steps")


def whisper(layerdrop=0.0):
    torch.manual_seed(8)
    # tests/test_hf.py's, two layers each, with LayerDrop for the training step
    config = transformers.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=8, encoder_layers=2, decoder_layers=2, d_model=16, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_source_positions=6,
        max_target_positions=8, pad_token_id=0, decoder_start_token_id=1, bos_token_id=1, eos_token_id=2,
        encoder_layerdrop=layerdrop, decoder_layerdrop=layerdrop,
    )  # fmt: skip
    return transformers.WhisperForConditionalGeneration(config).double()


def speech_batch(seed):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(3, VOCAB, (2, 5), generator=g)
    labels[1, 3:] = -100
    return {"input_features": torch.randn(2, 8, 12, generator=g, dtype=torch.float64), "labels": labels}


hugging_face_rows("Whisper", whisper().eval(), speech_batch(9))
model = whisper(layerdrop=0.5).train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
own = lambda m: lambda params, b: m(**b).loss  # noqa: E731  (the user's loop: model(**batch).loss)
err = z_error(model, opt, speech_batch(3), twin_loss=own, warmup=[speech_batch(1), speech_batch(2)])
row("Whisper, LayerDrop 0.5 (train mode)", "Z vs twin stepped for real", err, "AdamW, 2 warm steps; its own .loss")

# -- optimizers: reading the closure's loss, the Hessian, drawing from numpy ------------------------------

model = tiny_gpt().double()
err = z_error(model, PolyakSGD(model.parameters()), batch_for(model, 10), closure=True, backward=False)
row("closure-reading optimizer (Polyak step)", "Z vs twin stepped for real", err, "step(closure) alone")
with math_attention():  # (flash attention has no double backward)
    for name, build in [("SophiaH", lambda ps: po.SophiaH(ps, lr=1e-2, update_period=1)),
                        ("AdaHessian", lambda ps: po.AdaHessian(ps, lr=1e-2))]:  # fmt: skip
        model = tiny_gpt().double()
        opt = build(model.parameters())
        err = z_error(model, opt, batch_for(model, 10), create_graph=True, warmup=[batch_for(model, s) for s in (0, 1)])
        row(f"Hessian-reading optimizer ({name})", "Z vs twin stepped for real", err, "backward(create_graph=True)")
    model = tiny_gpt().double()
    opt = po.Kron(model.parameters(), lr=1e-3, preconditioner_update_probability=1.0)
    err = z_error(model, opt, batch_for(model, 10), warmup=[batch_for(model, s) for s in (0, 1)])
    stream = np.random.get_state()[1].copy()
    next_update(model, opt, make_loss_fn(model), batch_for(model, 11))
    kept = bool(np.array_equal(np.random.get_state()[1], stream))
    row("numpy-drawing optimizer (Kron)", "Z vs twin stepped for real", err, f"numpy's stream kept: {kept}")

# -- checkpoints: each against the model and optimizer held whole --------------------------------------------

tmp = Path(tempfile.mkdtemp(prefix="client_errors_"))
(tmp / "gpt.json").write_text(json.dumps(GPT_FIELDS))
data = token_data(tmp)
lit, opt, path = trained_by_lightning(tmp)
target = open_checkpoint(path, data, rebuild=Rebuild(str(tmp / "gpt.json"), "adamw", 4))
note = f"weights vs held whole {weights_error(target.model, lit.model):.1e}"
err = z_error(target.model, target.optimizer, target.train_batches[0], twin=(lit.model, opt))
row("Lightning .ckpt (real Trainer, 64-true), curvlab nds", "Z vs the held pair stepped for real", err, note)
fresh = TrainedLitGPT(seed=1).double()
(restored,) = restore_lightning(fresh, path)
err = z_error(fresh.model, restored, target.train_batches[0], twin=(lit.model, opt))
row("Lightning .ckpt, restore_lightning", "Z vs the held pair stepped for real", err, "its configure_optimizers")

model = tiny_gpt2()
torch.save(model.state_dict(), tmp / "weights.pt")
model.config.to_json_file(tmp / "config.json")
target = open_checkpoint(tmp / "weights.pt", data, rebuild=Rebuild(str(tmp), "adamw", 2))
note = f"weights vs held whole {weights_error(target.model, model):.1e}; fresh AdamW"
fresh_adamw = (model, torch.optim.AdamW(model.parameters()))
err = z_error(target.model, target.optimizer, target.train_batches[0], twin=fresh_adamw, twin_loss=written_out)
row("state dict + --config (GPT-2 config.json)", "Z vs the held pair stepped for real", err, note)

factory = types.SimpleNamespace(mktemp=lambda name: Path(tempfile.mkdtemp(prefix=name, dir=tmp)))
with contextlib.redirect_stdout(sys.stderr):  # (the Trainer prints its metrics)
    path, data = trainer_checkpoint.__wrapped__(factory)  # (tests/conftest.py's real Trainer run)
whole = tmp / "whole"
shutil.copytree(path, whole)
read_checkpoint(path).payload.model.double().save_pretrained(whole)  # float64 weights, AdamW's state widened
held = open_checkpoint(whole, data)
for name, sharded in [("sharded safetensors", sharded_copy(whole, tmp / "st")),
                      ("sharded .bin", bin_sharded_copy(whole, tmp / "bin", held.model))]:  # fmt: skip
    target = open_checkpoint(sharded, data)
    note = f"{len(list(sharded.glob('*-of-*')))} shards; weights vs whole {weights_error(target.model, held.model):.1e}"
    pair = (held.model, held.optimizer)
    err = z_error(target.model, target.optimizer, target.train_batches[0], twin=pair, twin_loss=written_out)
    row(f"Trainer checkpoint, {name}", "Z vs the whole pair stepped for real", err, note)
shutil.rmtree(tmp)

print("| client | what is compared | largest relative error | note |")
print("| --- | --- | --- | --- |")
for r in ROWS:
    print("| " + " | ".join(r) + " |")
