"""next_update on the optimizers users bring: each Z against the optimizer's own real next step.

Every test takes G and Z from ``next_update``, checks that the user's RNG, parameters and optimizer
state are as they were, then runs the real step (the user's loop: loss, backward, ``step()``) and
compares W - W_next with Z bit for bit.
"""

import copy
import math

import pytest
import torch

from curvlab import build_optimizer, make_loss_fn, next_update
from curvlab.errors import CurvlabError
from curvlab.models.gpt import GPT, get_config
from tests.reference import assert_same


def tiny_gpt(seed=0, dropout=0.0):
    torch.manual_seed(seed)
    return GPT(get_config("tiny", vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=dropout))


def batch_for(model, seed=0, batch=4):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, model.config.vocab_size, (batch, model.config.block_size + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def real_step(model, optimizers, loss_fn, batch, closure=False):
    """The user's loop: zero grads, loss, backward, then every optimizer's step (with a closure if asked)."""
    for o in optimizers:
        o.zero_grad(set_to_none=True)
    loss = loss_fn(dict(model.named_parameters()), batch)
    loss.backward()

    def again():
        for o in optimizers:
            o.zero_grad(set_to_none=True)
        value = loss_fn(dict(model.named_parameters()), batch)
        value.backward()
        return value

    for o in optimizers:
        o.step(again) if closure else o.step()


def state_of(optimizer, memo=None):
    """Everything of an optimizer a step can change: its whole ``__dict__`` (inner optimizers' too, as
    their state dicts), deep-copied over the same parameters, minus hooks."""
    memo = memo or {id(p): p for g in optimizer.param_groups for p in g["params"]}
    attrs = {}
    for k, v in vars(optimizer).items():
        if isinstance(v, torch.optim.Optimizer):
            attrs[k] = state_of(v, memo)
        elif isinstance(v, dict) and any(isinstance(o, torch.optim.Optimizer) for o in v.values()):
            attrs[k] = {name: state_of(o, memo) for name, o in v.items()}
        elif not k.startswith("_"):
            attrs[k] = copy.deepcopy(v, memo)
    return attrs


def check_next_update_is_the_real_step(model, optimizers, warmup=2, closure=False, steps=3):
    """``warmup`` real steps, then for ``steps`` steps: next_update changes nothing and equals the real step.
    Returns the largest |Z - real step| (0 when bit-exact)."""
    loss_fn = make_loss_fn(model)
    for s in range(warmup):
        real_step(model, optimizers, loss_fn, batch_for(model, seed=s), closure)
    worst = 0.0
    for s in range(steps):
        batch = batch_for(model, seed=10 + s)
        rng = torch.get_rng_state()
        W = {n: p.detach().clone() for n, p in model.named_parameters()}
        grads = {n: p.grad for n, p in model.named_parameters()}
        states = [state_of(o) for o in optimizers]
        target = optimizers if len(optimizers) > 1 else optimizers[0]
        G, Z = next_update(model, target, loss_fn, batch)
        assert torch.equal(torch.get_rng_state(), rng)  # the user's RNG is where it was
        for n, p in model.named_parameters():
            assert torch.equal(p, W[n]) and p.grad is grads[n], n
        for o, before in zip(optimizers, states):
            assert_same(state_of(o), before)
        real_step(model, optimizers, loss_fn, batch, closure)
        for n, p in model.named_parameters():
            real = W[n].double() - p.detach().double()
            assert Z[n].dtype == p.dtype
            worst = max(worst, float((Z[n] - real.to(p.dtype)).abs().max()))
            assert torch.equal(Z[n], real.to(p.dtype)), (s, n)
            if not closure:
                assert torch.equal(G[n], p.grad), (s, n)
    return worst


class SGLD(torch.optim.Optimizer):
    r"""Stochastic gradient Langevin dynamics: :math:`W \leftarrow W - \eta G + \sqrt{2\eta T}\,\xi`, ξ ~ N(0, I)."""

    def __init__(self, params, lr=1e-2, temperature=1e-4):
        super().__init__(params, {"lr": lr, "temperature": temperature})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            noise = math.sqrt(2 * group["lr"] * group["temperature"])
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"]).add_(torch.randn_like(p), alpha=noise)


class Lookahead(torch.optim.Optimizer):
    """Lookahead (Zhang et al. 2019): the inner optimizer steps the fast weights; every k steps the slow
    weights move alpha of the way to them and the fast weights restart there."""

    def __init__(self, inner, k=2, alpha=0.5):
        super().__init__([p for g in inner.param_groups for p in g["params"]], {})
        self.inner, self.k, self.alpha, self.counter = inner, k, alpha, 0
        self.param_groups = inner.param_groups

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].setdefault("slow", p.detach().clone())
        self.inner.step()
        self.counter += 1
        if self.counter % self.k == 0:
            for group in self.param_groups:
                for p in group["params"]:
                    slow = self.state[p]["slow"]
                    slow.add_(p - slow, alpha=self.alpha)
                    p.copy_(slow)


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimization (Foret et al. 2021), as davda54/sam: ascend to W + rho G/|G|, take the
    base optimizer's step there with the gradient the closure computes, from W."""

    def __init__(self, params, base, rho=0.05, **kwargs):
        super().__init__(params, {"rho": rho, **kwargs})
        self.base_optimizer = base(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is not None, "Sharpness Aware Minimization requires closure, but it was not provided"
        ps = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ps]))
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    e = p.grad * (group["rho"] / (norm + 1e-12))
                    p.add_(e)
                    self.state[p]["e_w"] = e
        with torch.enable_grad():
            closure()
        for p in ps:
            p.sub_(self.state[p]["e_w"])
        self.base_optimizer.step()


def test_an_optimizer_that_draws_random_numbers_gets_its_own_draws():
    model = tiny_gpt(dropout=0.1).train()  # dropout draws too: the step's noise comes after the masks
    assert check_next_update_is_the_real_step(model, [SGLD(model.parameters())]) == 0.0


def test_a_wrapper_optimizer_and_its_inner_optimizer_are_left_as_they_were():
    model = tiny_gpt()
    opt = Lookahead(torch.optim.AdamW(model.parameters(), lr=1e-2), k=2)
    # three steps from an odd counter: a plain step, a synchronizing one, a plain one
    assert check_next_update_is_the_real_step(model, [opt], warmup=1) == 0.0
    assert opt.counter == 4 and all(s["step"] == 4 for s in opt.inner.state.values())


def test_a_users_torch_muon_and_adamw_pair():
    model = tiny_gpt()
    matrices = [p for n, p in model.named_parameters() if p.dim() == 2 and "wte" not in n and "lm_head" not in n]
    ids = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in ids]
    muon = torch.optim.Muon(matrices, lr=0.02, adjust_lr_fn="original")
    adamw = torch.optim.AdamW(rest, lr=3e-3)
    assert check_next_update_is_the_real_step(model, [muon, adamw]) == 0.0
    check_next_update_is_the_real_step(model, (muon, adamw), warmup=0, steps=1)  # a tuple as well
    with pytest.raises(CurvlabError, match=r"no optimizer holds .*transformer\.wte\.weight"):
        next_update(model, muon, make_loss_fn(model), batch_for(model))
    with pytest.raises(CurvlabError, match="share a parameter"):
        next_update(model, [muon, torch.optim.SGD(model.parameters())], make_loss_fn(model), batch_for(model))


def test_combined_optimizer_children_keep_working_after_next_update():
    model = tiny_gpt()
    opt = build_optimizer("muon", model)
    assert check_next_update_is_the_real_step(model, [opt]) == 0.0
    for child in opt.optimizers.values():
        own = {id(p) for g in child.param_groups for p in g["params"]}
        assert {id(p) for p in child.state} == own
        assert len(child.state_dict()["state"]) == len(own)  # a child's own state dict works
    after = opt.state_dict()
    assert_same(after, build_after_the_same_steps())
    fresh = build_optimizer("muon", tiny_gpt())
    fresh.load_state_dict(after)  # and a combined state dict loads back into the children
    assert_same(fresh.state_dict(), after)
    assert all(len(c.state_dict()["state"]) == len(c.state) > 0 for c in fresh.optimizers.values())


def build_after_the_same_steps():
    """The state a Muon run has after the same five steps without any next_update in between."""
    model = tiny_gpt()
    opt = build_optimizer("muon", model)
    loss_fn = make_loss_fn(model)
    for s in (0, 1, 10, 11, 12):
        real_step(model, [opt], loss_fn, batch_for(model, seed=s))
    return opt.state_dict()


def test_closure_optimizers_lbfgs_and_sam():
    # dropout on: the closure's evaluations draw after the gradient's, as in backward() then step(closure)
    model = tiny_gpt(dropout=0.1).train()
    lbfgs = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3, history_size=4)
    assert check_next_update_is_the_real_step(model, [lbfgs], closure=True, steps=2) == 0.0
    model = tiny_gpt(dropout=0.1).train()
    sam = SAM(model.parameters(), torch.optim.SGD, rho=0.05, lr=0.1, momentum=0.9)
    assert check_next_update_is_the_real_step(model, [sam], closure=True) == 0.0


def test_g_and_z_come_in_the_parameters_dtype():
    model = tiny_gpt().double()
    loss_fn = make_loss_fn(model)
    opt = build_optimizer("adamw", model)
    assert check_next_update_is_the_real_step(model, [opt]) == 0.0
    G, Z = next_update(model, opt, loss_fn, batch_for(model))
    assert {t.dtype for t in [*G.values(), *Z.values()]} == {torch.float64}
    G32, Z32 = next_update(model, opt, loss_fn, batch_for(model), dtype=torch.float32)
    assert {t.dtype for t in [*G32.values(), *Z32.values()]} == {torch.float32}
    assert all(torch.equal(Z32[n], Z[n].float()) for n in Z)


def test_the_combined_state_reads_like_a_dict():
    model = tiny_gpt()
    opt = build_optimizer("muon", model)
    p = model.lm_head.weight
    assert p not in opt.state and opt.state.get(p) is None and len(opt.state) == 0  # nothing made by reading
    real_step(model, [opt], make_loss_fn(model), batch_for(model))
    assert p in opt.state and opt.state.get(p) is opt.optimizers["adamw"].state[p]
    assert len(opt.state) == len(list(model.parameters())) == len(dict(opt.state.items()))
    opt.state[p]["extra"] = 1  # writes reach the child holding p
    assert opt.optimizers["adamw"].state[p]["extra"] == 1


def test_a_closure_optimizer_after_another_in_a_list():
    model = tiny_gpt()
    matrices = [p for n, p in model.named_parameters() if p.dim() == 2 and "wte" not in n and "lm_head" not in n]
    rest = [p for p in model.parameters() if all(p is not q for q in matrices)]
    pair = [torch.optim.SGD(matrices, lr=0.1, momentum=0.9), SAM(rest, torch.optim.SGD, rho=0.05, lr=0.1)]
    # (deterministic model: the SGD's own evaluation of the closure in the real loop changes nothing)
    assert check_next_update_is_the_real_step(model, pair, closure=True) == 0.0
