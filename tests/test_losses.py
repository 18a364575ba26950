"""A criterion of every shape (issue 47): ``make_loss_fn(model, criterion=...)`` hands a criterion the
model's outputs unshifted unless the model is a causal LM or ``shift=True`` asks for the shift.

Every model is tiny and random-init from a config built here (nothing is downloaded). The references are
each model's own loss in float64 (Hugging Face's ``return_loss=True`` ``.loss`` for CLIP and SigLIP, its
``labels=`` ``.loss`` for a causal LM, the MSE written out for a regression model), and for the curvature a
dense float64 Hessian by plain double backward (``tests/reference.py``).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

from curvlab import evaluate_loss, hvp, make_loss_fn
from curvlab.engine import params as param_dicts
from curvlab.engine.loss import hf_task, token_cross_entropy
from curvlab.errors import CurvlabError
from tests.reference import dense_hessian

transformers.logging.set_verbosity_error()
# a few float64 epsilons: the criteria below and Hugging Face's loss take the same sums in other orders
EPS64 = 16 * torch.finfo(torch.float64).eps
TEXT = dict(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            max_position_embeddings=12)  # fmt: skip
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=8,
              patch_size=4, num_channels=3)  # fmt: skip
PAIRS = 4


def clip() -> nn.Module:
    torch.manual_seed(0)
    return transformers.CLIPModel(transformers.CLIPConfig(text_config=TEXT, vision_config=VISION, projection_dim=8))


def siglip() -> nn.Module:
    torch.manual_seed(0)
    return transformers.SiglipModel(transformers.SiglipConfig(text_config=TEXT, vision_config=VISION))


def clip_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """CLIP's symmetric cross-entropy over ``logits_per_text``: each text's image is its label, each
    image's text the inverse permutation's."""
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels.argsort())) / 2


def siglip_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """SigLIP's pairwise sigmoid loss: +1 for a text's own image, -1 for every other; summed over the
    images, averaged over the texts."""
    signs = 2 * F.one_hot(labels, logits.size(-1)).to(logits.dtype) - 1
    return -F.logsigmoid(signs * logits).sum(-1).mean()


DUAL_ENCODERS = {"clip": (clip, clip_loss), "siglip": (siglip, siglip_loss)}


def pairs_batch(seed: int) -> dict:
    """Texts and images, text i paired with image i (the order the models' own losses assume)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TEXT["vocab_size"], (PAIRS, 6), generator=g)
    pixels = torch.randn(PAIRS, 3, 8, 8, generator=g)
    return {"input_ids": ids, "pixel_values": pixels, "labels": torch.arange(PAIRS)}


def own_loss(model: nn.Module, batch: dict, **kw) -> float:
    """The model's own ``.loss`` on a float64 eval-mode copy (the labels passed as ``kw`` say)."""
    model = copy.deepcopy(model).double().eval()
    inputs = {k: v.double() if v.is_floating_point() else v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        return float(model(**inputs, **kw).loss)


def float64_params(model: nn.Module) -> dict:
    return {k: p.detach().double() for k, p in model.named_parameters()}


@pytest.mark.parametrize("name", DUAL_ENCODERS)
def test_contrastive_criterion_gives_the_models_own_loss(name):
    """CLIP and SigLIP have no loss_type and don't generate: their criterion gets ``logits_per_text``
    unshifted, and the loss is their own ``return_loss=True`` loss (as a ModelOutput or as a tuple)."""
    build, criterion = DUAL_ENCODERS[name]
    model, batch = build(), pairs_batch(1)
    assert hf_task(model) == "unknown"
    loss_fn = make_loss_fn(model, criterion=criterion)
    own = own_loss(model, batch, return_loss=True)
    assert evaluate_loss(loss_fn, float64_params(model), batch) == pytest.approx(own, rel=EPS64, abs=0)
    as_tuple = {**batch, "return_dict": False}  # (logits_per_image first: the transpose, the same loss)
    assert evaluate_loss(loss_fn, float64_params(model), as_tuple) == pytest.approx(own, rel=EPS64, abs=0)
    assert loss_fn.loss_terms(batch) == PAIRS  # both losses average over the pairs
    with pytest.raises(CurvlabError, match=f"doesn't know the loss of a {type(model).__name__}: pass criterion="):
        make_loss_fn(model)


# a vector of the first vision layer's attention and its norm: the curvature below the similarities
ATTENTION = ("vision_model.encoder.layers.0.self_attn.q_proj.bias", "vision_model.encoder.layers.0.layer_norm1.weight")


@pytest.mark.parametrize("name", DUAL_ENCODERS)
def test_contrastive_hvp_against_the_dense_hessian(name):
    """The exact HVP of the contrastive loss equals a dense float64 double-backward Hessian times v, on
    the logit scale (SigLIP's bias and its attention-pooling probe, CLIP's last text norm) and the first
    vision layer's attention and norm below them (a few vectors: the dense Hessian takes a backward a row)."""
    build, criterion = DUAL_ENCODERS[name]
    model, batch = build(), pairs_batch(2)
    names = {
        "clip": ["logit_scale", "text_model.final_layer_norm.weight", "text_model.final_layer_norm.bias", *ATTENTION],
        "siglip": ["logit_scale", "logit_bias", "vision_model.head.probe", *ATTENTION],
    }[name]
    params = {k: p for k, p in float64_params(model).items() if k in names}
    loss_fn = make_loss_fn(model, criterion=criterion)
    H = dense_hessian(loss_fn, params, batch)
    g = torch.Generator().manual_seed(3)
    v = {k: torch.randn(p.shape, generator=g, dtype=torch.float64) for k, p in params.items()}
    expected = H @ param_dicts.flatten(v)
    assert expected.abs().max() > 1e-3  # (the curvature isn't vanishing: the comparison means something)
    for method in ("rev_rev", "fwd_rev"):
        got = param_dicts.flatten(hvp(loss_fn, params, batch, v, method=method))
        assert float((got - expected).norm() / expected.norm()) < 1e-12, method


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=30, n_positions=16, n_embd=8, n_layer=1, n_head=2)
    return transformers.GPT2LMHeadModel(config)


def test_a_causal_lm_criterion_is_still_shifted():
    """GPT-2's LMHeadModel has no loss_type either but generates: a criterion gets the logits and labels
    shifted as its own ``.loss`` shifts them, and ``shift=False`` turns that off."""
    model = gpt2()
    ids = torch.randint(0, 30, (2, 7), generator=torch.Generator().manual_seed(4))
    ids[0, 3] = -100
    batch = {"input_ids": ids.clamp(min=0), "labels": ids}
    params = float64_params(model)
    assert hf_task(model) == "causal_lm"
    loss_fn = make_loss_fn(model, criterion=token_cross_entropy)
    loss = evaluate_loss(loss_fn, params, batch)
    # (its .loss casts the logits with .float(): float32 accuracy; the same loss written out in float64)
    assert loss == pytest.approx(own_loss(model, batch, labels=ids), rel=1e-6)
    with torch.no_grad():
        logits = copy.deepcopy(model).double().eval()(input_ids=batch["input_ids"]).logits
    shifted = float(F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), ignore_index=-100))
    assert loss == pytest.approx(shifted, rel=EPS64, abs=0)
    assert loss_fn.loss_terms(batch) == int((ids[:, 1:] != -100).sum())
    unshifted = make_loss_fn(model, criterion=token_cross_entropy, shift=False)
    expected = float(F.cross_entropy(logits.flatten(0, 1), ids.flatten(), ignore_index=-100))
    assert evaluate_loss(unshifted, params, batch) == pytest.approx(expected, rel=EPS64, abs=0)


class Regressor(transformers.PreTrainedModel):
    """A user's own Hugging Face model (no task in its name, so no loss_type): a per-position regression."""

    config_class = transformers.PretrainedConfig

    def __init__(self, config):
        super().__init__(config)
        self.net = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
        self.post_init()

    def forward(self, x):
        return self.net(x)


def plain_regressor() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


@pytest.mark.parametrize("build", [lambda: Regressor(transformers.PretrainedConfig()), plain_regressor],
                         ids=["pretrained_model", "plain_module"])  # fmt: skip
def test_a_regression_criterion_is_unshifted(build):
    """An MSE criterion compares each position's outputs with its own targets; ``shift=True`` asks for the
    causal shift on any model."""
    torch.manual_seed(0)
    model = build()
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(4, 6, 5, generator=g), torch.randn(4, 6, 3, generator=g)
    params = float64_params(model)
    with torch.no_grad():
        out = copy.deepcopy(model).double()(x.double())
    loss = evaluate_loss(make_loss_fn(model, criterion=F.mse_loss), params, (x, y))
    assert loss == pytest.approx(float(F.mse_loss(out, y.double())), rel=EPS64, abs=0)
    shifted = evaluate_loss(make_loss_fn(model, criterion=F.mse_loss, shift=True), params, (x, y))
    assert shifted == pytest.approx(float(F.mse_loss(out[:, :-1], y[:, 1:].double())), rel=EPS64, abs=0)


def test_shift_is_a_bool_or_none():
    with pytest.raises(CurvlabError, match="shift= is True, False or None"):
        make_loss_fn(plain_regressor(), criterion=F.mse_loss, shift="yes")
