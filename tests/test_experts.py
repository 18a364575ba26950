"""Mixture-of-experts models (issue 47): the router loss's weight under each name transformers gives it, and
Muon's polar factor taken per expert for experts stacked in one parameter, 3-D (experts x out x in) or
2-D by rows as DBRX stores them, against independent references (the model's own outputs, numpy's SVD per
expert)."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

from curvlab import build_optimizer, make_loss_fn
from curvlab.curvature.groupings import group_parameters
from curvlab.models.roles import matrix_shapes, parameter_roles, stack_sizes, stacked_matrices
from curvlab.optim.muon import Muon
from curvlab.optim.polar import msign
from tests.test_hf import VOCAB, causal_batch

transformers.logging.set_verbosity_error()


def jetmoe() -> nn.Module:
    torch.manual_seed(5)
    config = transformers.JetMoeConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_key_value_heads=2, kv_channels=8,
        intermediate_size=24, max_position_embeddings=32, num_local_experts=4, num_experts_per_tok=2,
        output_router_logits=True, aux_loss_coef=0.5,
    )  # fmt: skip
    return transformers.JetMoeForCausalLM(config).eval().double()


def test_jetmoe_weighs_its_router_loss_by_aux_loss_coef():
    model = jetmoe()
    assert not hasattr(model.config, "router_aux_loss_coef")  # JetMoe's own name: aux_loss_coef
    batch = causal_batch(6)
    params = {k: t.detach() for k, t in model.named_parameters()}
    own = model(**batch)
    assert float(0.5 * own.aux_loss.detach()) > 1e-3  # large enough to be missed
    loss = float(make_loss_fn(model)(params, batch))
    # float64 from the model's own outputs: its cross-entropy on the shifted logits plus 0.5 x its aux_loss
    logits, labels = own.logits[:, :-1].detach(), batch["labels"][:, 1:]
    ce = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
    assert loss == pytest.approx(float(ce + 0.5 * own.aux_loss.detach()), rel=1e-13)
    # and its own .loss, which Hugging Face computes on float32 logits
    assert loss == pytest.approx(float(own.loss.detach()), rel=1e-6)
    alone = float(make_loss_fn(model, router_loss=False)(params, batch))
    assert alone == pytest.approx(float(ce), rel=1e-13) and abs(alone - loss) > 1e-3


class TextConfigMoE(nn.Module):
    """A vision-language MoE's layout (Qwen3-VL-MoE's): the coefficient on its text config only."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(text_config=SimpleNamespace(router_aux_loss_coef=0.3))
        self.linear = nn.Linear(4, 3)

    def forward(self, x):
        logits = self.linear(x)
        return {"logits": logits, "aux_loss": logits.exp().mean()}


def test_a_coefficient_on_the_text_config():
    torch.manual_seed(0)
    model = TextConfigMoE()
    x, y = torch.randn(2, 4), torch.randn(2, 3)
    params = dict(model.named_parameters())
    out = model(x)
    expected = F.mse_loss(out["logits"], y) + 0.3 * out["aux_loss"]
    loss = make_loss_fn(model, criterion=F.mse_loss)(params, (x, y))
    assert float(loss.detach()) == pytest.approx(float(expected.detach()))


# -- Muon: one polar factor per expert ----------------------------------------------------------------------


def svd_polar(G: torch.Tensor) -> torch.Tensor:
    """U V^T of each matrix of a float64 stack, by numpy (the partial isometry of the nonzero singular values)."""
    U, S, Vh = np.linalg.svd(G.numpy(), full_matrices=False)
    keep = S.max(axis=-1, keepdims=True) * max(G.shape[-2:]) * np.finfo(float).eps < S
    return torch.from_numpy((U * keep[..., None, :]) @ Vh)


class RowStackedExperts(nn.Module):
    """DBRX's layout: a module that declares its number of experts and holds their matrices stacked by rows,
    (experts * out) x in, next to a 3-D stack (experts x out x in)."""

    def __init__(self, experts=3, out=5, inputs=4):
        super().__init__()
        self.num_experts = experts
        self.rows = nn.Parameter(torch.randn(experts * out, inputs, dtype=torch.float64))
        self.stack = nn.Parameter(torch.randn(experts, out, inputs, dtype=torch.float64))


@pytest.mark.parametrize("polar", ["svd", "newton_schulz"])
def test_muon_orthogonalizes_each_expert_of_a_stack(polar):
    torch.manual_seed(1)
    experts = RowStackedExperts()
    assert stack_sizes(experts) == {"rows": 3, "stack": 3}
    muon = Muon(
        [{"params": [experts.rows], "stacked": 3}, {"params": [experts.stack], "stacked": True}],
        lr=0.1,
        momentum=0.0,
        polar=polar,
        polar_dtype=torch.float64,
    )  # (no momentum: the update is G itself)
    grads = {n: torch.randn_like(p) for n, p in experts.named_parameters()}
    before = {n: p.detach().clone() for n, p in experts.named_parameters()}
    for n, p in experts.named_parameters():
        p.grad = grads[n].clone()
    muon.step()
    scale = math.sqrt(5 / 4)  # each expert's (out, in) = (5, 4): max(1, out/in)^(1/2)
    for n, p in experts.named_parameters():
        G = grads[n].reshape(3, 5, 4)  # one matrix per expert
        if polar == "svd":
            reference = svd_polar(G)
        else:  # curvlab's msign, one expert at a time
            reference = torch.stack([msign(g, polar=polar, dtype=torch.float64) for g in G])
        expected = before[n] - 0.1 * scale * reference.reshape(p.shape)
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-12)


def dbrx() -> nn.Module:
    torch.manual_seed(2)
    config = transformers.DbrxConfig(
        vocab_size=VOCAB, d_model=16, n_heads=2, n_layers=2, max_seq_len=32,
        attn_config={"kv_n_heads": 1, "rope_theta": 10000.0, "clip_qkv": 8.0},  # (a None clip fails in 5.x)
        ffn_config={"ffn_hidden_size": 16, "moe_num_experts": 4, "moe_top_k": 2},
    )  # fmt: skip
    return transformers.DbrxForCausalLM(config).double()


def test_dbrx_experts_are_stacks_muon_orthogonalizes_one_by_one():
    """DBRX holds each layer's experts as three (experts * ffn) x hidden matrices that its experts module
    views as experts x ffn x hidden: stacks by structure (its router's experts x hidden is not), each expert
    orthogonalized on its own, the first two the MLP's input and the last its output."""
    model = dbrx()
    names = [n for n, _ in model.named_parameters()]
    stacks = [n for n in names if n.endswith(("mlp.w1", "mlp.v1", "mlp.w2"))]
    assert len(stacks) == 6 and stacked_matrices(model) == set(stacks)
    assert {matrix_shapes(model)[n] for n in stacks} == {(4, 16, 16)}
    roles = parameter_roles(model)
    assert {roles[n] for n in stacks} == {"hidden"}
    kinds = group_parameters(names, blocks="kind", model=model)
    assert {n for n in stacks if n.endswith("w2")} <= set(kinds["mlp_out"])
    assert {n for n in stacks if not n.endswith("w2")} <= set(kinds["mlp_in"])

    opt = build_optimizer("muon", model, lr=0.1, polar="svd")
    muon = opt.optimizers["muon"]
    assert [g["stacked"] for g in muon.param_groups] == [False, 4]
    table = dict(model.named_parameters())
    before = {n: table[n].detach().clone() for n in stacks}
    model(**causal_batch(6)).loss.backward()
    grads = {n: table[n].grad.clone() for n in stacks}
    assert all(g.abs().max() > 0 for g in grads.values())
    opt.step()
    for n in stacks:  # the first step's momentum is a multiple of G: W_e - lr * s(16, 16) * msign(G_e), s = 1
        polar = svd_polar(grads[n].reshape(4, 16, 16)).reshape(64, 16)
        torch.testing.assert_close(table[n].detach(), before[n] - 0.1 * polar, rtol=0, atol=1e-12)
