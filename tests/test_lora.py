"""Adapter optimizers (sMuon, LoRA-Muon, per-factor Muon) against dense float64 references and hand cases."""

import copy
import math

import numpy as np
import pytest
import scipy.linalg
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer
from torch import nn

from curvlab import block_matrix, build_optimizer, make_loss_fn, msign, next_update
from curvlab.errors import CurvlabError
from curvlab.models.gpt import GPT, get_config
from curvlab.optim.lora import AdaptedLayer, LoraMuon, PerFactorMuon, SMuon, adapter_blocks, lora_layers
from curvlab.optim.muon import Muon, muon_scale
from curvlab.optim.polar import NEWTON_SCHULZ_COEFFICIENTS, POLAR_EXPRESS_NORMALIZATION, polar_express_coefficients
from tests.builders import batch_for, snapshot, train_step
from tests.reference import assert_same

F64 = torch.float64
BF16_EDGE = 5 * 2**-8


def peft_gpt(r=4, targets=("c_q", "c_v", "c_fc", "c_proj"), seed=0, dtype=torch.float32, **lora):
    torch.manual_seed(seed)
    model = GPT(get_config("tiny", vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)).to(dtype)
    return get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets), **lora))


def randomize_factors(model, seed=1):
    """Random nonzero A and B everywhere (peft starts from B = 0, or A = 0 for embeddings)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_layers(model):
            for p in (layer.A, layer.B):
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def nonzero_svd(X):
    """U, Vᵀ of X's float64 SVD, singular values below numpy's matrix_rank tolerance dropped."""
    U, S, Vh = torch.linalg.svd(X.double(), full_matrices=False)
    keep = S.max() * max(X.shape) * torch.finfo(F64).eps < S
    return U[:, keep], Vh[keep]


def projector(F):
    """Orthogonal projector onto col(F)."""
    U, _ = nonzero_svd(F)
    return U @ U.T


def tangent_projection(A, B):
    """X -> P_B X + (I - P_B) X P_A, dense float64."""
    Pb, Pa = projector(B), projector(A.T)
    return lambda X: Pb @ X + (torch.eye(len(Pb), dtype=F64) - Pb) @ X @ Pa


def svd_msign(X):
    U, Vh = nonzero_svd(X)
    return U @ Vh


def set_gradients(A, B, G, s):
    """The factor gradients a loss with dL/dW = G gives (W = W0 + s B A)."""
    A.grad = s * B.detach().T @ G
    B.grad = s * G @ A.detach().T


def first_order_change(A0, B0, A1, B1, s):
    return s * ((B1 - B0) @ A0 + B0 @ (A1 - A0))


def map_gradients(model, loss):
    """Per LoRA module: (A, B, s, G = dL/dW of the map W = W0 + s B A), from the base weight's own
    gradient (W0 enters W additively), turned into the map's orientation. Sets the factors' .grad."""
    from transformers.pytorch_utils import Conv1D

    modules = [m for m in model.modules() if isinstance(m, LoraLayer)]
    bases = [m.get_base_layer() for m in modules]
    for b in bases:
        b.weight.requires_grad_(True)
    model.zero_grad(set_to_none=True)
    loss().backward()
    grads = [b.weight.grad for b in bases]
    for b in bases:
        b.weight.requires_grad_(False)
        b.weight.grad = None
    out = []
    for m, base, g in zip(modules, bases, grads):
        if "default" in m.lora_A:
            A, B = m.lora_A["default"].weight, m.lora_B["default"].weight
        else:
            A, B = m.lora_embedding_A["default"], m.lora_embedding_B["default"]
        G = g.T if isinstance(base, (nn.Embedding, Conv1D)) else g.reshape(g.shape[0], -1)
        out.append((A, B, m.scaling["default"], G))
    return out


# --- the convention: peft's factor gradients are s Bᵀ G and s G Aᵀ -----------------------------------------


def _gpt2_lora():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2)
    model = get_peft_model(
        GPT2LMHeadModel(cfg).double(), LoraConfig(r=3, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True)
    )
    idx = torch.randint(0, 32, (2, 8))
    return model, lambda: model(input_ids=idx, labels=idx).loss


def _conv_lora():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 6, 3), nn.Flatten(), nn.Linear(6 * 4 * 4, 5)).double()
    model = get_peft_model(net, LoraConfig(r=2, target_modules=["0"]))
    x = torch.randn(4, 3, 6, 6, dtype=F64)
    return model, lambda: model(x).square().mean()


def _gpt_with_embedding_lora():
    model = peft_gpt(targets=("wte", "c_q", "c_fc"), dtype=F64)
    batch = batch_for(model.base_model.model)
    return model, lambda: make_loss_fn(model)(dict(model.named_parameters()), batch)


@pytest.mark.parametrize("make", [_gpt_with_embedding_lora, _gpt2_lora, _conv_lora])
def test_peft_factor_gradients_are_the_map_gradient_through_the_factors(make):
    model, loss = make()
    randomize_factors(model)
    found = lora_layers(model)
    cases = map_gradients(model, loss)
    assert len(found) == len(cases)
    for layer, (A, B, s, G) in zip(found, cases):
        A2, B2 = A.reshape(A.shape[0], -1), B.reshape(B.shape[0], -1)
        assert layer.shape == tuple(G.shape) and layer.scaling == s
        assert torch.allclose(A.grad.reshape(A2.shape), s * B2.T @ G, rtol=1e-10, atol=1e-14)
        assert torch.allclose(B.grad.reshape(B2.shape), s * G @ A2.T, rtol=1e-10, atol=1e-14)


# --- sMuon's first-order change against the dense SVD reference ---------------------------------------------


CASES = {  # (d_out, d_in, r, how the factors look)
    "random": (12, 20, 3, "random"),
    "tall": (40, 30, 5, "random"),
    "2r > d_out": (12, 20, 7, "random"),
    "B = 0 (peft's start)": (16, 24, 4, "B=0"),
    "A = 0 (peft's embedding start)": (16, 24, 4, "A=0"),
    "rank-deficient B": (16, 24, 4, "rank2"),
}


def make_case(m, n, r, kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    A, B, G = (torch.randn(shape, generator=g, dtype=F64) for shape in [(r, n), (m, r), (m, n)])
    if kind == "B=0":
        B.zero_()
    elif kind == "A=0":
        A.zero_()
    elif kind == "rank2":
        B = B[:, :2] @ torch.randn(2, r, generator=g, dtype=F64)
    return A, B, G


@pytest.mark.parametrize("case", CASES)
def test_smuon_first_order_change_is_the_projected_polar_factor_of_H(case):
    m, n, r, kind = CASES[case]
    A0, B0, G = make_case(m, n, r, kind)
    s, lr = 1.7, 0.01
    A, B = nn.Parameter(A0.clone()), nn.Parameter(B0.clone())
    opt = SMuon([AdaptedLayer("l", A, B, s)], lr=lr, momentum=0.0, polar="svd")
    set_gradients(A, B, G, s)
    opt.step()
    c = muon_scale(torch.Size([m, n]), "original")
    D = first_order_change(A0, B0, A.detach(), B.detach(), s) / (-lr * c)
    proj = tangent_projection(A0, B0)
    reference = proj(svd_msign(proj(G)))
    assert (D - reference).norm() <= 1e-8 * reference.norm()
    if kind == "random":  # the reference is not the projection of msign(G): the test tells them apart
        of_G = proj(svd_msign(G))
        assert float((of_G * reference).sum() / (of_G.norm() * reference.norm())) < 0.97
    if kind == "B=0":  # the documented first step: A doesn't move, B = -(lr c / s) msign(G P_A) A⁺
        assert torch.equal(A.detach(), A0)
    if kind == "A=0":
        assert torch.equal(B.detach(), B0)


@pytest.mark.parametrize(("kappa", "bound"), [(1.0, 1e-6), (1e3, 1e-4)])
def test_smuon_in_float32_stays_close_to_the_float64_reference(kappa, bound):
    """float32 factors, exact polar factor: the error grows with B's condition number (measured 1.4e-7 and
    6.7e-6; the bounds leave a factor of about 7-15 for other BLAS builds)."""
    from curvlab.optim.lora import smuon_direction

    A, B, G = make_case(64, 96, 8, "random", seed=1)
    U, _, Vh = torch.linalg.svd(B, full_matrices=False)
    B = U @ torch.diag(torch.logspace(0, -math.log10(kappa), 8, dtype=F64)) @ Vh
    proj = tangent_projection(A, B)
    reference = proj(svd_msign(proj(G)))
    dA, dB = smuon_direction(A.float(), B.float(), (B.T @ G).float(), (G @ A.T).float(), 1.0, polar="svd")
    D = dB.double() @ A + B @ dA.double()
    assert (D - reference).norm() <= bound * reference.norm()


def _scalar_polynomial_images(S, method, eps=1e-7):
    """The singular values that 5 steps of the method make of H's singular values S (float64 scalars),
    after msign's normalization: by ||H||_F, or by 1.02 ||H||_F + eps for Polar Express."""
    if method == "newton_schulz":
        x, schedule = S / S.norm(), [NEWTON_SCHULZ_COEFFICIENTS] * 5
    else:
        x, schedule = S / (POLAR_EXPRESS_NORMALIZATION * S.norm() + eps), polar_express_coefficients(5)
    for a, b, c in schedule:
        x = a * x + b * x**3 + c * x**5
    return x


@pytest.mark.parametrize(("method", "band"), [("newton_schulz", (0.68, 1.14)), ("polar_express", (0.85, 1.15))])
def test_smuon_with_newton_schulz_keeps_H_singular_vectors_and_lands_in_the_band(method, band):
    m, n, r = 40, 64, 6
    A, B, G = make_case(m, n, r, "random", seed=3)
    s = 0.5
    proj = tangent_projection(A, B)
    H = proj(G)
    U, S, Vh = torch.linalg.svd(H, full_matrices=False)
    U, S, Vh = U[:, : 2 * r], S[: 2 * r], Vh[: 2 * r]
    expected = _scalar_polynomial_images(S, method)
    assert band[0] <= expected.min() and expected.max() <= band[1]  # docs/science.md section 9's bands
    # float64 iteration: the low-rank route is Newton–Schulz on H itself
    from curvlab.optim.lora import smuon_direction

    dA, dB = smuon_direction(A, B, s * B.T @ G, s * G @ A.T, s, polar=method, dtype=F64)
    D = s * (dB @ A + B @ dA)
    dense = proj(msign(H, polar=method, dtype=F64))
    assert (D - dense).norm() <= 1e-10 * dense.norm()
    assert (dense - proj(U @ torch.diag(expected) @ Vh)).norm() <= 1e-10 * dense.norm()
    # bf16 iteration, as the optimizer runs it: D = proj_T(U diag(f) Vᵀ) up to bf16 noise, with f in the band.
    # bf16 rounding moves each f off its float64 image (by up to 0.2) and the band's edges by about 0.01
    # (over 20 seeds: [0.674, 1.141] and [0.858, 1.144]); BF16_EDGE allows for that, 5 bf16 ulps at 1.
    A32, B32 = nn.Parameter(A.float()), nn.Parameter(B.float())
    opt = SMuon([AdaptedLayer("l", A32, B32, s)], lr=1.0, momentum=0.0, polar=method)
    set_gradients(A32, B32, G.float(), s)
    opt.step()
    c = muon_scale(torch.Size([m, n]), "original")
    D = first_order_change(A, B, A32.detach().double(), B32.detach().double(), s) / -c
    basis = torch.stack([proj(torch.outer(U[:, i], Vh[i])).flatten() for i in range(2 * r)], dim=1)
    f = torch.linalg.lstsq(basis, D.flatten()[:, None]).solution.flatten()
    residual = (basis @ f - D.flatten()).norm() / D.norm()
    assert residual < 0.05
    assert band[0] - BF16_EDGE <= f.min() and f.max() <= band[1] + BF16_EDGE


# --- momentum transport and split weight decay, by hand -----------------------------------------------------


@pytest.mark.parametrize("weight_decay", [0.0, 0.5])
@pytest.mark.parametrize("name", ["smuon", "lora-muon", "per-factor-muon"])
def test_hand_case_step_decay_and_momentum(name, weight_decay):
    """2x2 layer, r = 1, B = e1, A = e1ᵀ, s = 2, G = [[0, 1], [1, 0]] (H = G, msign(H) = G, c = 1).

    sMuon: δA = B⁺Ω/s = [0, 1]/s, δB = (I - P_B)ΩA⁺/s = [0, 1]ᵀ/s; κ = sqrt(1 - λη):
    A' = [κ, -η/(sκ)], B' = A'ᵀ. The momentum matrix M = (1-μ)G is carried to the new factors:
    buffers s B'ᵀM = s(1-μ)[-η/(sκ), κ] and s M A'ᵀ, its transpose.
    LoRA-Muon: R_A = R_B = 1, each factor gets half: A' = [κ, -η/(2sκ)], B' = A'ᵀ; buffers (1-μ)g.
    Per-factor Muon: c(1x2) = 1, c(2x1) = √2: A' = [κ, -η/κ], B' = [κ, -√2η/κ]ᵀ; buffers (1-μ)g.
    """
    lr, mu, s = 0.1, 0.9, 2.0
    A, B = nn.Parameter(torch.tensor([[1.0, 0.0]], dtype=F64)), nn.Parameter(torch.tensor([[1.0], [0.0]], dtype=F64))
    G = torch.tensor([[0.0, 1.0], [1.0, 0.0]], dtype=F64)
    cls = {"smuon": SMuon, "lora-muon": LoraMuon, "per-factor-muon": PerFactorMuon}[name]
    opt = cls([AdaptedLayer("l", A, B, s)], lr=lr, momentum=mu, nesterov=False, weight_decay=weight_decay, polar="svd")
    set_gradients(A, B, G, s)
    gA, gB = A.grad.clone(), B.grad.clone()
    opt.step()
    k = math.sqrt(1 - lr * weight_decay)
    step_a, step_b = {"smuon": (1 / s, 1 / s), "lora-muon": (0.5 / s, 0.5 / s), "per-factor-muon": (1, math.sqrt(2))}[
        name
    ]
    assert torch.allclose(A.detach(), torch.tensor([[k, -lr * step_a / k]], dtype=F64), atol=1e-15)
    assert torch.allclose(B.detach(), torch.tensor([[k], [-lr * step_b / k]], dtype=F64), atol=1e-15)
    if name == "smuon":
        carried = s * (1 - mu) * torch.tensor([[-lr / (s * k), k]], dtype=F64)
        buf_a, buf_b = carried, carried.T
    else:
        buf_a, buf_b = (1 - mu) * gA, (1 - mu) * gB
    assert torch.allclose(opt.state[A]["momentum_buffer"], buf_a, atol=1e-15)
    assert torch.allclose(opt.state[B]["momentum_buffer"], buf_b, atol=1e-15)


def test_smuon_momentum_is_the_ema_of_gradients_projected_on_each_new_tangent_space():
    """Two Nesterov steps against dense float64: M1 = (1-μ) proj_T0(G1); step 2 orthogonalizes
    H2 = proj_T1((1-μ) G2 + μ (μ M1 + (1-μ) G2))."""
    m, n, r, s, lr, mu = 14, 18, 3, 1.3, 0.05, 0.8
    A0, B0, G1 = make_case(m, n, r, "random", seed=5)
    G2 = torch.randn(m, n, generator=torch.Generator().manual_seed(6), dtype=F64)
    A, B = nn.Parameter(A0.clone()), nn.Parameter(B0.clone())
    opt = SMuon([AdaptedLayer("l", A, B, s)], lr=lr, momentum=mu, nesterov=True, polar="svd")
    set_gradients(A, B, G1, s)
    opt.step()
    A1, B1 = A.detach().clone(), B.detach().clone()
    set_gradients(A, B, G2, s)
    opt.step()
    M1 = (1 - mu) * tangent_projection(A0, B0)(G1)
    proj1 = tangent_projection(A1, B1)
    reference = proj1(svd_msign(proj1((1 - mu) * G2 + mu * (mu * M1 + (1 - mu) * G2))))
    c = muon_scale(torch.Size([m, n]), "original")
    D = first_order_change(A1, B1, A.detach(), B.detach(), s) / (-lr * c)
    assert (D - reference).norm() <= 1e-8 * reference.norm()


# --- LoRA-Muon and per-factor Muon against independent implementations --------------------------------------


@pytest.mark.parametrize("kind", ["random", "B=0"])
def test_lora_muon_is_cesista_et_al_in_their_own_convention(kind):
    """Their W + A_c B_cᵀ with A_c = sB, B_c = Aᵀ: ΔA_c = -(η/2) msign(g_{A_c} R_{B_c}) R_{B_c} and its twin,
    with R = (FᵀF)^{-1/2} from scipy; peft's ΔB = ΔA_c / s and ΔA = ΔB_cᵀ. From B = 0 (R_{A_c} undefined
    there) our pseudo-inverse gives ΔB_c = 0: A stays, B takes its half of the budget."""
    m, n, r, s, lr = 10, 14, 3, 2.5, 0.03
    A0, B0, G = make_case(m, n, r, kind, seed=2)
    A, B = nn.Parameter(A0.clone()), nn.Parameter(B0.clone())
    opt = LoraMuon([AdaptedLayer("l", A, B, s)], lr=lr, momentum=0.0, polar="svd")
    set_gradients(A, B, G, s)
    opt.step()
    Ac, Bc = (s * B0).numpy(), A0.T.numpy()
    gAc, gBc = G.numpy() @ Bc, G.numpy().T @ Ac

    def inv_sqrt(S):
        return np.real(scipy.linalg.inv(scipy.linalg.sqrtm(S)))

    def polar(X):
        U, _, Vh = np.linalg.svd(X, full_matrices=False)
        return U @ Vh

    RB = inv_sqrt(Bc.T @ Bc)
    c = muon_scale(torch.Size([m, n]), "original")
    dAc = -(lr * c / 2) * polar(gAc @ RB) @ RB
    if kind == "B=0":
        dBc = np.zeros_like(Bc)
    else:
        RA = inv_sqrt(Ac.T @ Ac)
        dBc = -(lr * c / 2) * polar(gBc @ RA) @ RA
    assert np.allclose(B.detach().numpy(), B0.numpy() + dAc / s, atol=1e-12)
    assert np.allclose(A.detach().numpy(), A0.numpy() + dBc.T, atol=1e-12)


def test_per_factor_muon_is_curvlab_muon_on_each_factor():
    torch.manual_seed(0)
    A0, B0 = torch.randn(3, 20, dtype=F64), torch.randn(12, 3, dtype=F64)
    ours = [nn.Parameter(A0.clone()), nn.Parameter(B0.clone())]
    theirs = [nn.Parameter(A0.clone()), nn.Parameter(B0.clone())]
    a = PerFactorMuon([AdaptedLayer("l", *ours, 2.0)], lr=0.02, polar="svd")
    b = Muon(theirs, lr=0.02, polar="svd")
    for step in range(3):
        G = torch.randn(12, 20, generator=torch.Generator().manual_seed(step), dtype=F64)
        set_gradients(*ours, G, 2.0)
        for p, q in zip(ours, theirs):
            q.grad = p.grad.clone()
        a.step()
        b.step()
        for p, q in zip(ours, theirs):
            assert torch.allclose(p, q, rtol=0, atol=1e-14)


# --- on peft models: curvlab's GPT wrapped by peft --------------------------------------------------------------


@pytest.mark.parametrize("start", ["peft init (B = 0, embedding A = 0)", "random factors"])
def test_smuon_on_peft_gpt_matches_the_dense_reference_per_layer(start):
    model = peft_gpt(targets=("wte", "c_q", "c_fc", "c_proj"), dtype=F64)
    if start == "random factors":
        randomize_factors(model)
    loss_fn, batch = make_loss_fn(model), batch_for(model.base_model.model)
    lr = 0.01
    opt = build_optimizer("smuon", model, lr=lr, momentum=0.0, polar="svd")
    cases = map_gradients(model, lambda: loss_fn(dict(model.named_parameters()), batch))
    before = [(A.detach().clone(), B.detach().clone()) for A, B, _, _ in cases]
    opt.step()
    for (A0, B0), (A, B, s, G) in zip(before, cases):
        c = muon_scale(torch.Size(G.shape), "original")
        D = first_order_change(A0, B0, A.detach(), B.detach(), s) / (-lr * c)
        proj = tangent_projection(A0, B0)
        reference = proj(svd_msign(proj(G)))
        assert (D - reference).norm() <= 1e-8 * reference.norm()


@pytest.mark.parametrize("name", ["smuon", "lora-muon", "per-factor-muon", "adamw"])
def test_next_update_is_the_real_step_and_state_round_trips(name):
    model = peft_gpt(modules_to_save=["lm_head"])  # lm_head's trainable copy goes to the AdamW side
    loss_fn = make_loss_fn(model)
    opt = build_optimizer(name, model, weight_decay=0.1)
    for s in range(2):  # momentum and a nonzero B first
        train_step(model, opt, loss_fn, batch_for(model.base_model.model, seed=s))
    clone = copy.deepcopy(model)
    twin = build_optimizer(name, clone, weight_decay=0.1)
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    batch = batch_for(model.base_model.model, seed=7)
    params_before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    state_before = snapshot(opt)
    _, Z = next_update(model, opt, loss_fn, batch)
    assert_same(opt.state_dict(), state_before)
    train_step(model, opt, loss_fn, batch)
    train_step(clone, twin, make_loss_fn(clone), batch)
    assert Z.keys() == params_before.keys()
    for (n, p), (_, q) in zip(model.named_parameters(), clone.named_parameters()):
        if n in Z:
            real = (params_before[n].double() - p.detach().double()).float()
            assert torch.equal(Z[n], real), n
            assert Z[n].abs().max() > 0, n
        assert torch.equal(p, q), n
    assert_same(opt.state_dict(), twin.state_dict())


def test_adapter_optimizers_reach_the_factors_only():
    model = peft_gpt(modules_to_save=["lm_head"])
    opt = build_optimizer("smuon", model)
    layers = lora_layers(model)
    factors = [p for layer in layers for p in (layer.A, layer.B)]
    smuon, adamw = opt.optimizers["smuon"], opt.optimizers["adamw"]
    assert [p for g in smuon.param_groups for p in g["params"]] == factors
    assert [p for g in adamw.param_groups for p in g["params"]] == [model.base_model.model.lm_head.weight]
    assert [g["scaling"] for g in smuon.param_groups] == [2.0] * len(layers)
    assert all(
        not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n and "modules_to_save" not in n
    )


def test_adapter_blocks_group_each_layers_factors_for_block_matrix():
    model = peft_gpt(r=2, targets=("c_q", "c_fc"))
    randomize_factors(model)
    loss_fn = make_loss_fn(model)
    blocks = adapter_blocks(model)
    assert list(blocks) == [f"transformer.h.{i}.{k}" for i in range(2) for k in ("attn.c_q", "mlp.c_fc")]
    for layer, members in blocks.items():
        assert members == [
            f"base_model.model.{layer}.lora_A.default.weight",
            f"base_model.model.{layer}.lora_B.default.weight",
        ]
    opt = build_optimizer("smuon", model, polar="svd")
    G, Z = next_update(model, opt, loss_fn, batch_for(model.base_model.model), dtype=F64)
    params = {n: p.detach().double() for n, p in model.named_parameters() if p.requires_grad}
    M = block_matrix(loss_fn, params, batch_for(model.base_model.model), Z, blocks=blocks)
    assert M.names == tuple(blocks)
    for i, members in enumerate(blocks.values()):  # a block is its layer's A and B together
        first = sum(float((G[n].double() * Z[n]).sum()) for n in members)
        assert M.first_order[i] == pytest.approx(first, rel=1e-5)


# --- bad input ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["smuon", "lora-muon", "per-factor-muon"])
def test_bad_input_is_a_clear_error(name):
    torch.manual_seed(0)
    plain = GPT(get_config("tiny", vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16))
    with pytest.raises(CurvlabError, match="no trainable LoRA layers"):
        build_optimizer(name, plain)
    with pytest.raises(CurvlabError, match=r"rank 20 exceeds the layer's smaller side \(d_out x d_in = 16 x 16\)"):
        build_optimizer(name, peft_gpt(r=20))
    with pytest.raises(CurvlabError, match="unknown option"):
        build_optimizer(name, peft_gpt(), betas=(0.9, 0.99))
    with pytest.raises(CurvlabError, match="muon_rule"):
        build_optimizer(name, peft_gpt(), muon_rule=lambda n, p: True)
    model = peft_gpt()
    opt = build_optimizer(name, model, lr=0.5, weight_decay=2.0)
    loss_fn = make_loss_fn(model)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(CurvlabError, match="split decay needs < 1"):
        train_step(model, opt, loss_fn, batch_for(model.base_model.model))
    assert_same(model.state_dict(), before)  # checked before anything moved


def test_the_adapter_optimizers_adamw_side_has_the_full_models_defaults():
    """One AdamW-side default: an adapter optimizer's AdamW side (here lm_head's trainable copy) and Muon's
    on a full model both run at plain AdamW's default lr and betas."""
    adapter_side = build_optimizer("smuon", peft_gpt(modules_to_save=["lm_head"])).optimizers["adamw"].param_groups[0]
    full = GPT(get_config("tiny", vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16))
    muon_side = build_optimizer("muon", full).optimizers["adamw"].param_groups[0]
    adamw = build_optimizer("adamw", full).param_groups[0]
    for key in ("lr", "betas", "eps", "weight_decay"):
        assert adapter_side[key] == muon_side[key] == adamw[key], key
