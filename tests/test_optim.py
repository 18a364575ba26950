import copy

import pytest
import torch
from torch import nn

from curvlab import build_optimizer, make_loss_fn, msign, next_update
from curvlab.errors import CurvlabError
from curvlab.models.gpt import GPT, MICRO_OVERRIDES, get_config
from curvlab.optim.build import check_optimizer_options
from curvlab.optim.combined import CombinedOptimizer
from curvlab.optim.muon import Muon, muon_scale
from curvlab.steps.shadow import own_settings
from tests.builders import batch_for, snapshot, train_step
from tests.reference import assert_same


def tiny_gpt(seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = get_config("tiny", vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, **overrides)
    return GPT(cfg)


def test_default_muon_steps_equal_torch_muon():
    torch.manual_seed(0)
    w = [torch.randn(24, 40), torch.randn(40, 24)]
    ours = [p.clone().requires_grad_() for p in w]
    theirs = [p.clone().requires_grad_() for p in w]
    a = Muon(ours, lr=0.02, weight_decay=0.1)
    b = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1)
    for step in range(4):
        g = [torch.randn(p.shape, generator=torch.Generator().manual_seed(step * 10 + i)) for i, p in enumerate(w)]
        for p, q, gi in zip(ours, theirs, g):
            p.grad, q.grad = gi.clone(), gi.clone()
        a.step()
        b.step()
        for p, q in zip(ours, theirs):
            assert torch.equal(p, q)
    sa, sb = a.state_dict(), b.state_dict()
    assert_same(sa["state"], sb["state"])


def test_momentum_buffer_is_never_normalized_in_place():
    """torch.optim.Muon normalizes the buffer in place for bf16 params without Nesterov; ours must not."""
    p = torch.randn(16, 32).bfloat16().requires_grad_()
    opt = Muon([p], lr=0.01, nesterov=False, momentum=0.9)
    g = torch.randn(16, 32).bfloat16()
    p.grad = g.clone()
    opt.step()
    expected = torch.zeros_like(g).lerp_(g, 1 - 0.9)
    assert torch.equal(opt.state[p]["momentum_buffer"], expected)


@pytest.mark.parametrize("scale", ["original", "moonlight", "spectral"])
@pytest.mark.parametrize("polar", ["svd", "polar_express"])
def test_muon_options_follow_their_formula(scale, polar):
    torch.manual_seed(1)
    W = torch.randn(12, 30)
    p = W.clone().requires_grad_()
    g = torch.randn(12, 30)
    opt = Muon([p], lr=0.05, weight_decay=0.1, momentum=0.9, nesterov=True, scale=scale, polar=polar)
    p.grad = g.clone()
    opt.step()
    buf = 0.1 * g
    update = g.lerp(buf, 0.9)
    ratio = {"original": max(1, 12 / 30) ** 0.5, "moonlight": 0.2 * 30**0.5, "spectral": (12 / 30) ** 0.5}[scale]
    expected = W * (1 - 0.05 * 0.1) - 0.05 * ratio * msign(update, polar=polar)
    assert torch.allclose(p.detach(), expected, atol=1e-6)
    assert muon_scale(torch.Size([12, 30]), scale) == pytest.approx(ratio)


def test_build_optimizer_splits_parameters():
    model = tiny_gpt()
    opt = build_optimizer("muon", model)
    assert isinstance(opt, CombinedOptimizer)
    muon_ids = {id(p) for g in opt.optimizers["muon"].param_groups for p in g["params"]}
    names = {id(p): n for n, p in model.named_parameters()}
    muon_names = sorted(names[i] for i in muon_ids)
    assert all(n.startswith("transformer.h.") and n.endswith("weight") for n in muon_names)
    assert len(muon_names) == 2 * 6  # q, k, v, o, fc, proj per layer
    assert all(p.dim() == 2 for g in opt.optimizers["muon"].param_groups for p in g["params"])
    adam = opt.optimizers["adamw"].param_groups[0]
    assert adam["lr"] == 0.0018 and adam["betas"] == (0.9, 0.95)  # AdamW's own defaults: the side is tied
    assert len(opt.param_groups) == 2
    tied = tiny_gpt(tie_embeddings=True)
    tied_opt = build_optimizer("muon", tied)
    muon_params = [p for g in tied_opt.optimizers["muon"].param_groups for p in g["params"]]
    assert all(p is not tied.transformer.wte.weight for p in muon_params)


def test_bad_optimizer_requests():
    model = tiny_gpt()
    with pytest.raises(ValueError, match="unknown optimizer 'adam'"):
        build_optimizer("adam", model)
    with pytest.raises(ValueError, match=r"unknown option.*beta1"):
        build_optimizer("adamw", model, beta1=0.9)
    with pytest.raises(ValueError, match="unknown Muon scale"):
        build_optimizer("muon", model, scale="huge")
    with pytest.raises(ValueError, match="no hidden weight matrices"):
        build_optimizer("muon", nn.Sequential(nn.LayerNorm(4)))
    with pytest.raises(ValueError, match="not matrices"):
        build_optimizer("muon", model, muon_rule=lambda n, p: True)


def test_scheduler_drives_the_combined_optimizer():
    model = tiny_gpt()
    opt = build_optimizer("muon", model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    # half the AdamW side's default 0.0018 (AdamW's own)
    assert opt.optimizers["muon"].param_groups[0]["lr"] == pytest.approx(0.01)
    assert opt.optimizers["adamw"].param_groups[0]["lr"] == pytest.approx(0.0009)
    assert sched.get_last_lr() == pytest.approx([0.01, 0.0009])


class SignSGD(torch.optim.Optimizer):
    """A user's own optimizer, with a step counter in its state."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["k"] = state.get("k", 0) + 1
                p.add_(torch.sign(p.grad), alpha=-group["lr"] / state["k"])


def make_optimizer(name, model):
    return SignSGD(model.parameters()) if name == "user" else build_optimizer(name, model)


@pytest.mark.parametrize("name", ["muon", "adamw", "sgd", "lion", "user"])
def test_next_update_is_the_real_step_and_changes_nothing(name):
    model = tiny_gpt()
    loss_fn = make_loss_fn(model)
    opt = make_optimizer(name, model)
    for s in range(2):  # build up momentum and counters first
        train_step(model, opt, loss_fn, batch_for(model, seed=s))
    batch = batch_for(model, seed=7)
    params_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads_before = {n: p.grad for n, p in model.named_parameters()}
    state_before = snapshot(opt)
    G, Z = next_update(model, opt, loss_fn, batch)
    for n, p in model.named_parameters():
        assert torch.equal(p, params_before[n])
        assert p.grad is grads_before[n]
    assert_same(opt.state_dict(), state_before)
    assert all(z.dtype == torch.float32 for z in Z.values())
    train_step(model, opt, loss_fn, batch)
    for n, p in model.named_parameters():
        real = (params_before[n].double() - p.detach().double()).float()
        assert torch.equal(Z[n], real), n
        assert torch.equal(G[n], p.grad)


def test_next_update_lr_scale_and_float64():
    model = tiny_gpt()
    loss_fn = make_loss_fn(model)
    opt = build_optimizer("muon", model, weight_decay=0.1)
    train_step(model, opt, loss_fn, batch_for(model))
    batch = batch_for(model, seed=3)
    _, Z = next_update(model, opt, loss_fn, batch, dtype=torch.float64)
    _, Zh = next_update(model, opt, loss_fn, batch, lr_scale=0.5, dtype=torch.float64)
    assert Z["transformer.h.0.attn.c_q.weight"].dtype == torch.float64
    # Z is a difference of float32 parameters W and W - Z, each rounded to within an ulp of its size
    ulp = torch.finfo(torch.float32).eps
    for n, p in model.named_parameters():
        bound = 2 * ulp * (p.detach().double().abs() + Z[n].abs())
        assert ((Zh[n] - 0.5 * Z[n]).abs() <= bound).all(), n


def test_next_update_bad_inputs():
    model = tiny_gpt()
    opt = build_optimizer("adamw", model)
    loss_fn = make_loss_fn(model)

    def nan_loss(params, batch):
        return loss_fn(params, batch) * float("nan")

    with pytest.raises(ValueError, match="not finite"):
        next_update(model, opt, nan_loss, batch_for(model))

    class Uncopyable:
        def __deepcopy__(self, memo):
            raise TypeError("no copies")

    opt.state[model.lm_head.weight]["handle"] = Uncopyable()
    with pytest.raises(ValueError, match="can't be copied"):
        next_update(model, opt, loss_fn, batch_for(model))


@pytest.mark.parametrize("name", ["muon", "adamw"])
def test_hybrid_trains_and_state_dict_round_trip_continues_identically(name):
    model = tiny_gpt()
    loss_fn = make_loss_fn(model)
    opt = build_optimizer(name, model)
    batch = batch_for(model, batch=8)
    losses = [train_step(model, opt, loss_fn, batch) for _ in range(15)]
    assert losses[-1] < 0.9 * losses[0]
    clone = copy.deepcopy(model)
    opt2 = build_optimizer(name, clone)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    for s in range(3):
        b = batch_for(model, seed=100 + s)
        train_step(model, opt, loss_fn, b)
        train_step(clone, opt2, make_loss_fn(clone), b)
    for (n, p), (_, q) in zip(model.named_parameters(), clone.named_parameters()):
        assert torch.equal(p, q), n


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)  # kernel 16 x 1 x 3 x 3: out 16 x in*k*k 9
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 4, 1)
        self.fc = nn.Linear(4, 6)  # (6 classes: conv2's 4 x 16 gradient has full rank)

    def forward(self, x):
        return self.fc(self.conv2(torch.relu(self.bn1(self.conv1(x)))).mean((2, 3)))


def test_muon_orthogonalizes_conv_kernels_flattened():
    """Muon takes a CNN's convolution kernels (role hidden) as the out x (in * k * k) matrices they
    flatten to: conv1's step is lr * sqrt(16 / 9) * msign(G reshaped to 16 x 9); the head (fc), the
    BatchNorm and the biases go to AdamW."""
    from curvlab import parameter_roles

    torch.manual_seed(0)
    model = SmallCNN()
    roles = parameter_roles(model)
    assert roles["fc.weight"] == roles["fc.bias"] == "head" and roles["bn1.weight"] == "norm"
    assert roles["conv1.weight"] == roles["conv2.weight"] == "hidden" and roles["conv1.bias"] == "bias"
    opt = build_optimizer("muon", model, polar="svd", lr=0.02)
    in_muon = {id(p) for g in opt.optimizers["muon"].param_groups for p in g["params"]}
    assert in_muon == {id(model.conv1.weight), id(model.conv2.weight)}
    batch = (torch.randn(8, 1, 5, 5), torch.randint(0, 6, (8,)))
    G, Z = next_update(
        model, opt, make_loss_fn(model, criterion=nn.functional.cross_entropy), batch, dtype=torch.float64
    )
    for name, scale in (("conv1.weight", (16 / 9) ** 0.5), ("conv2.weight", 1.0)):
        g = G[name].reshape(G[name].shape[0], -1)
        expected = (0.02 * scale * msign(g, polar="svd")).reshape(G[name].shape)
        assert torch.allclose(Z[name], expected, rtol=1e-4, atol=1e-8), name
    with pytest.raises(ValueError, match="matrices"):
        Muon([model.conv1.bias])


@pytest.mark.parametrize("polar", ["svd", "newton_schulz"])
def test_muon_steps_a_stack_of_matrices_one_matrix_at_a_time(polar):
    """A ``stacked`` group (an MoE's fused experts, experts x out x in) steps like the same matrices given as
    separate parameters: each its own momentum, polar factor and shape scale (a tall, a wide one here, stored
    transposed in the second group, as GPT-OSS's experts are)."""
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 6, 2), (2, 3, 5)]  # 3 tall 6 x 2 experts; 2 experts stored (in, out) = 3 x 5: 5 x 3, tall
    W = [torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True) for s in shapes]
    parts = [torch.nn.Parameter(w.detach()[e].clone()) for w in W for e in range(w.shape[0])]
    options = {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.1, "polar": polar, "polar_dtype": torch.float64}
    stacked = Muon([{"params": [W[0]], "stacked": True}, {"params": [W[1]], "stacked": True, "transposed": True}],
                   **options)  # fmt: skip
    apart = Muon([{"params": parts[:3]}, {"params": parts[3:], "transposed": True}], **options)
    for _ in range(3):
        grads = [torch.randn(w.shape, generator=g, dtype=torch.float64) for w in W]
        for w, gr in zip(W, grads):
            w.grad = gr
        for p, piece in zip(parts, [gr[e] for gr in grads for e in range(gr.shape[0])]):
            p.grad = piece.clone()
        stacked.step()
        apart.step()
        torch.testing.assert_close(W[0].detach(), torch.stack([p.detach() for p in parts[:3]]), rtol=0, atol=1e-15)
        torch.testing.assert_close(W[1].detach(), torch.stack([p.detach() for p in parts[3:]]), rtol=0, atol=1e-15)
    assert muon_scale((6, 2), "original") != muon_scale((2, 6), "original")  # (the scale reads each shape)
    with pytest.raises(CurvlabError, match="stacked Muon group takes 3-D"):
        Muon([{"params": [torch.nn.Parameter(torch.zeros(3, 4))], "stacked": True}])


def test_next_update_accumulates_micro_batches_by_their_loss_terms():
    """A list of micro-batches is one step with gradient accumulation: G = sum_j (n_j / N) grad L_j,
    as a loop of (loss_j * n_j / N).backward() gives it, with 3 and 5 rows here."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    loss_fn = make_loss_fn(model, criterion=nn.functional.cross_entropy)
    micro = [(torch.randn(n, 4, dtype=torch.float64), torch.randint(0, 3, (n,))) for n in (3, 5)]
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    G, Z = next_update(model, opt, loss_fn, micro, dtype=torch.float64)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.1)
    for x, y in micro:
        (nn.functional.cross_entropy(ref(x), y) * len(y) / 8).backward()
    ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(Z[name], p.detach() - q.detach(), rtol=1e-12, atol=1e-15), name
        assert torch.allclose(G[name], q.grad, rtol=1e-12, atol=1e-15), name


def test_adamw_hidden_lr_steps_as_two_adamws_hidden_matrices_apart():
    """AdamW with ``hidden_lr`` steps a GPT exactly as two torch AdamWs on the same gradients: one on the
    hidden matrices (2-D weights inside the blocks, named here independently of the roles) at hidden_lr, one on
    everything else at lr; group 0 is the rest at lr (the lr training logs), and the twin reads the hidden
    matrices' group."""
    torch.manual_seed(0)
    model = GPT(get_config("tiny", **MICRO_OVERRIDES))
    ref = copy.deepcopy(model)
    options = {"lr": 3e-3, "betas": (0.8, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    opt = build_optimizer("adamw", model, hidden_lr=7e-4, **options)
    assert [g["lr"] for g in opt.param_groups] == [3e-3, 7e-4] and len(opt.param_groups) == 2
    hidden = [n for n, p in ref.named_parameters() if n.startswith("transformer.h.") and p.dim() == 2]
    assert len(hidden) == 2 * 6  # q, k, v, o, fc, proj per layer
    table = dict(ref.named_parameters())
    hidden_ids = {id(table[n]) for n in hidden}
    assert {id(p) for p in opt.param_groups[1]["params"]} == {id(dict(model.named_parameters())[n]) for n in hidden}
    theirs = [
        torch.optim.AdamW([p for p in ref.parameters() if id(p) not in hidden_ids], **options),
        torch.optim.AdamW([table[n] for n in hidden], **{**options, "lr": 7e-4}),
    ]
    loss_fn = make_loss_fn(model)
    for step in range(3):
        train_step(model, opt, loss_fn, batch_for(model, seed=step))
        for p, q in zip(model.parameters(), ref.parameters()):
            q.grad = p.grad.clone()
        for o in theirs:
            o.step()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p, q), (step, n)
    twin = own_settings(opt, model)
    assert twin.kind == "adamw" and twin.lr == 7e-4 and twin.weight_decay == 0.1
    one = build_optimizer("adamw", model, **options)  # without hidden_lr: one group, as before
    assert len(one.param_groups) == 1 and one.param_groups[0]["lr"] == 3e-3
    assert own_settings(one, model).lr == 3e-3


def test_bad_hidden_lr_requests():
    with pytest.raises(CurvlabError, match="no hidden weight matrices"):
        build_optimizer("adamw", nn.Sequential(nn.LayerNorm(4)), hidden_lr=1e-3)
    model = tiny_gpt()
    for bad in (0, -1e-3, float("nan"), float("inf"), True, "1e-3"):
        with pytest.raises(CurvlabError, match="hidden_lr must be"):
            check_optimizer_options({"hidden_lr": bad})
        with pytest.raises(CurvlabError, match="hidden_lr must be"):
            build_optimizer("adamw", model, hidden_lr=bad)
    check_optimizer_options({"hidden_lr": 1e-3})
    with pytest.raises(CurvlabError, match="unknown option.*hidden_lr"):
        build_optimizer("muon", model, hidden_lr=1e-3)  # (Muon's hidden matrices have Muon's own lr)
    with pytest.raises(CurvlabError, match="not matrices"):
        build_optimizer("adamw", model, hidden_lr=1e-3, muon_rule=lambda n, p: True)
