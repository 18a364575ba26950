"""next_update on the optimizers users bring: each Z against the optimizer's own real next step.

Every test takes G and Z from ``next_update``, checks that the user's RNG, parameters and optimizer
state are as they were, then runs the real step (the user's loop: loss, backward, ``step()``) and
compares W - W_next with Z bit for bit.
"""

import copy
import math
import random

import numpy as np
import pytest
import pytorch_optimizer
import torch

from curvlab import build_optimizer, make_loss_fn, next_update
from curvlab.errors import CurvlabError
from curvlab.models.gpt import GPT, get_config
from tests.builders import batch_for
from tests.reference import assert_same


def tiny_gpt(seed=0, dropout=0.0):
    torch.manual_seed(seed)
    return GPT(get_config("tiny", vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=dropout))


def real_step(model, optimizers, loss_fn, batch, closure=False, backward=True, create_graph=False):
    """The user's loop: zero grads, loss, backward, then every optimizer's step (with a closure if asked).
    ``backward=False``: L-BFGS's documented loop, ``step(closure)`` alone (its first call computes G);
    ``create_graph``: a Hessian-reading optimizer's, ``backward(create_graph=True)``. Returns the gradients
    ``backward()`` left, by name, as they were before any step (heavyball's optimizers write to ``.grad``)."""
    for o in optimizers:
        o.zero_grad(set_to_none=True)
    if backward:
        loss = loss_fn(dict(model.named_parameters()), batch)
        loss.backward(create_graph=create_graph)
    grads = {n: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}

    def again():  # (AliG calls it under no_grad: a user's closure enables grad itself)
        for o in optimizers:
            o.zero_grad(set_to_none=True)
        with torch.enable_grad():
            value = loss_fn(dict(model.named_parameters()), batch)
            value.backward()
        return value

    for o in optimizers:
        o.step(again) if closure else o.step()
    return grads


def views_of_parameters(params, roots):
    """Every tensor in ``roots`` (through dicts, lists and tuples) that lies in a parameter's memory: heavyball's
    SOAP keeps its parameters' views, which a deep copy can't take (made without autograd, of a leaf)."""
    storages = {p.untyped_storage().data_ptr() for p in params}
    found, stack = [], list(roots)
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            found += [x] if x.untyped_storage().data_ptr() in storages else []
        elif isinstance(x, dict):
            stack += [*x.keys(), *x.values()]
        elif isinstance(x, (list, tuple)):
            stack += list(x)
    return found


def state_of(optimizer, memo=None):
    """Everything of an optimizer a step can change: its whole ``__dict__`` (inner optimizers' too, as
    their state dicts), deep-copied over the same parameters (and the same views of them), minus hooks."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    memo = memo or {id(t): t for t in [*params, *views_of_parameters(params, vars(optimizer).values())]}
    attrs = {}
    for k, v in vars(optimizer).items():
        if isinstance(v, torch.optim.Optimizer):
            attrs[k] = state_of(v, memo)
        elif isinstance(v, dict) and any(isinstance(o, torch.optim.Optimizer) for o in v.values()):
            attrs[k] = {name: state_of(o, memo) for name, o in v.items()}
        elif not k.startswith("_"):
            attrs[k] = copy.deepcopy(v, memo)
    return attrs


def module_tensors(model):
    """Every buffer (name: (object, value)) and every plain tensor a module keeps in its ``__dict__``."""
    buffers = {n: (b, b.clone()) for n, b in model.named_buffers()}
    attrs = {(m, k): v for m, mod in model.named_modules() for k, v in vars(mod).items() if isinstance(v, torch.Tensor)}
    return buffers, attrs


def assert_untouched(model, buffers, attrs):
    now_buffers, now_attrs = module_tensors(model)
    assert now_buffers.keys() == buffers.keys() and now_attrs.keys() == attrs.keys()
    for n, (b, value) in buffers.items():
        assert now_buffers[n][0] is b and torch.equal(b, value), n
    assert all(now_attrs[k] is v for k, v in attrs.items())


def random_streams():
    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def assert_same_streams(before):
    torch_state, numpy_state, python_state = before
    assert torch.equal(torch.get_rng_state(), torch_state)
    now = np.random.get_state()
    assert now[0] == numpy_state[0] and np.array_equal(now[1], numpy_state[1]) and now[2:] == numpy_state[2:]
    assert random.getstate() == python_state


def check_next_update_is_the_real_step(
    model, optimizers, warmup=2, closure=False, steps=3, backward=True, create_graph=False, loss_fn=None, batches=None
):
    """``warmup`` real steps, then for ``steps`` steps: next_update changes nothing (parameters, ``.grad``,
    optimizer state, buffers and hooks' tensors, torch's, numpy's and Python's random streams) and equals the
    real step. ``batches(seed)`` makes a batch (default the tiny GPT's). Returns the largest |Z - real step|
    (0 when bit-exact)."""
    loss_fn = loss_fn or make_loss_fn(model)
    batches = batches or (lambda seed: batch_for(model, seed=seed))
    loop = {"closure": closure, "backward": backward, "create_graph": create_graph}
    for s in range(warmup):
        real_step(model, optimizers, loss_fn, batches(s), **loop)
    worst = 0.0
    for s in range(steps):
        batch = batches(10 + s)
        streams = random_streams()
        W = {n: p.detach().clone() for n, p in model.named_parameters()}
        grads = {n: p.grad for n, p in model.named_parameters()}
        states = [state_of(o) for o in optimizers]
        state_dicts = [copy.deepcopy(o.state_dict()) for o in optimizers]
        buffers, attrs = module_tensors(model)
        target = optimizers if len(optimizers) > 1 else optimizers[0]
        G, Z = next_update(model, target, loss_fn, batch)
        assert_same_streams(streams)  # the user's random streams are where they were
        for n, p in model.named_parameters():
            assert torch.equal(p, W[n]) and p.grad is grads[n], n
        for o, before, state_dict in zip(optimizers, states, state_dicts):
            assert_same(state_of(o), before)
            assert_same(o.state_dict(), state_dict)
        assert_untouched(model, buffers, attrs)
        real_grads = real_step(model, optimizers, loss_fn, batch, **loop)
        for n, p in model.named_parameters():
            real = W[n].double() - p.detach().double()
            assert Z[n].dtype == p.dtype
            worst = max(worst, float((Z[n] - real.to(p.dtype)).abs().max()))
            assert torch.equal(Z[n], real.to(p.dtype)), (s, n)
            if not closure:
                assert torch.equal(G[n], real_grads[n]), (s, n)
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
    # dropout on: the closure's evaluations away from W draw after the gradient's, each loop as documented:
    # L-BFGS's step(closure) alone (the closure's first call, at W, is G), SAM's backward() then step(closure)
    model = tiny_gpt(dropout=0.1).train()
    lbfgs = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3, history_size=4)
    assert check_next_update_is_the_real_step(model, [lbfgs], closure=True, steps=2, backward=False) == 0.0
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


# -- no trace: unused parameters, buffers, hooks' tensors, every random stream (issue 32) -------------------


class WithUnused(torch.nn.Module):
    """A network with a head it never calls: its parameters get no gradient, so ``backward()`` leaves their
    ``.grad`` None and every optimizer skips them (AdamW's decay and any momentum included)."""

    def __init__(self, norm=None):
        super().__init__()
        self.body = torch.nn.Linear(5, 8)
        self.norm = norm or torch.nn.Identity()
        self.head = torch.nn.Linear(8, 3)
        self.unused = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.norm(self.body(x))))


def regression_batch(seed, batch=6):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 5, generator=g, dtype=torch.float64), torch.randn(
        batch, 3, generator=g, dtype=torch.float64
    )


def regression(model):
    return make_loss_fn(model, criterion=torch.nn.functional.mse_loss)


@pytest.mark.parametrize(
    "build",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
        lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.01),
    ],
    ids=["adamw", "sgd-momentum"],
)
def test_a_parameter_with_no_gradient_is_not_moved(build):
    torch.manual_seed(0)
    model = WithUnused().double()
    opt = build(model.parameters())
    loss_fn = regression(model)
    check_next_update_is_the_real_step(model, [opt], loss_fn=loss_fn, batches=regression_batch)
    G, Z = next_update(model, opt, loss_fn, regression_batch(3))
    for n in ("unused.weight", "unused.bias"):
        assert model.get_parameter(n).grad is None and model.get_parameter(n) not in opt.state
        assert torch.equal(Z[n], torch.zeros_like(Z[n])) and torch.equal(G[n], torch.zeros_like(G[n]))
    assert all(Z[n].abs().max() > 0 for n in ("body.weight", "head.weight"))


def test_unused_parameters_under_accumulation_and_clipping():
    torch.manual_seed(1)
    model = WithUnused().double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    loss_fn = regression(model)
    micro = [regression_batch(5, batch=2), regression_batch(6, batch=4)]
    _, Z = next_update(model, opt, loss_fn, micro, max_grad_norm=0.05)
    assert torch.equal(Z["unused.weight"], torch.zeros_like(Z["unused.weight"]))
    # against a twin stepped for real: the loss terms' weights, clipping, then AdamW with unused.* at None
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.1)
    twin_loss = regression(twin)
    for b in micro:
        (twin_loss(dict(twin.named_parameters()), b) * len(b[0]) / 6).backward()
    torch.nn.utils.clip_grad_norm_(list(twin.parameters()), 0.05)
    assert twin.unused.weight.grad is None
    W = {n: p.detach().clone() for n, p in twin.named_parameters()}
    twin_opt.step()
    for n, p in twin.named_parameters():
        torch.testing.assert_close(Z[n], W[n] - p.detach(), rtol=1e-12, atol=1e-15)


def test_batch_norm_in_train_mode_leaves_its_running_statistics():
    torch.manual_seed(2)
    model = WithUnused(norm=torch.nn.BatchNorm1d(8)).double().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = {n: b.clone() for n, b in model.named_buffers()}
    assert check_next_update_is_the_real_step(model, [opt], warmup=0, steps=1, loss_fn=regression(model),
                                              batches=regression_batch) == 0.0  # fmt: skip
    # the real step moved them (so the check above could fail), and next_update alone does not
    assert not torch.equal(model.norm.running_var, before["norm.running_var"])
    assert int(model.norm.num_batches_tracked) == 1
    buffers, attrs = module_tensors(model)
    next_update(model, opt, regression(model), regression_batch(4))
    assert_untouched(model, buffers, attrs)


def test_spectral_norm_keeps_its_power_iteration_vectors():
    """Both spectral norms: the parametrization's ``_u``/``_v`` buffers, and the legacy hook's ``weight_u``,
    ``weight_v`` and the ``weight`` tensor it leaves on the module. The curvature after next_update is of
    the same function: the buffers are bit for bit, so an HVP is too."""
    from curvlab import hvp

    torch.manual_seed(3)
    model = WithUnused().double().train()
    torch.nn.utils.parametrizations.spectral_norm(model.body)
    torch.nn.utils.spectral_norm(model.head)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_fn = regression(model)
    assert check_next_update_is_the_real_step(model, [opt], loss_fn=loss_fn, batches=regression_batch) == 0.0
    batch = regression_batch(7)
    params = {n: p.detach() for n, p in model.named_parameters()}
    v = {n: torch.randn_like(p) for n, p in params.items()}
    model.eval()  # (no power iteration in the HVP itself)
    first = hvp(loss_fn, params, batch, v)
    model.train()
    next_update(model, opt, loss_fn, batch)
    model.eval()
    assert_same(hvp(loss_fn, params, batch, v), first)


class NumpyNoiseSGD(torch.optim.Optimizer):
    """SGD with noise drawn from numpy's global stream, and a step length chosen by Python's ``random``:
    its real step after next_update takes the very draws next_update's copy took."""

    def __init__(self, params, lr=1e-2, sigma=1e-3):
        super().__init__(params, {"lr": lr, "sigma": sigma})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            scale = random.choice([0.5, 1.0, 2.0])
            for p in group["params"]:
                if p.grad is not None:
                    noise = torch.from_numpy(np.random.standard_normal(tuple(p.shape))).to(p)
                    p.add_(p.grad, alpha=-group["lr"] * scale).add_(noise, alpha=group["sigma"])


def test_an_optimizer_drawing_from_numpy_and_python():
    model = tiny_gpt()
    assert check_next_update_is_the_real_step(model, [NumpyNoiseSGD(model.parameters())]) == 0.0


class PolyakSGD(torch.optim.Optimizer):
    """Polyak's step length: lr = (L - f*) / |G|², from the loss its closure returns (without a closure,
    the default lr)."""

    def __init__(self, params, lr=1e-3, f_star=0.0):
        super().__init__(params, {"lr": lr, "f_star": f_star})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm2 = sum(float(g.pow(2).sum()) for g in grads)
        for group in self.param_groups:
            lr = group["lr"] if loss is None else (float(loss) - group["f_star"]) / (norm2 + 1e-12)
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-0.1 * lr)
        return loss


def test_an_optimizer_that_reads_its_closures_loss():
    model = tiny_gpt()
    opt = PolyakSGD(model.parameters())
    # the user's loop gives it a closure; step() alone would take the default lr, 3000x shorter here
    assert check_next_update_is_the_real_step(model, [opt], closure=True, backward=False) == 0.0


def math_attention():
    return torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH])


class HutchinsonNewton(torch.optim.Optimizer):
    """A Hessian-reading optimizer (as AdaHessian): W -= lr G / (|z ⊙ Hz| + eps), z Rademacher from torch's
    stream, Hz by differentiating ``.grad``, which needs ``backward(create_graph=True)``."""

    def __init__(self, params, lr=1e-2, eps=1e-2):
        super().__init__(params, {"lr": lr, "eps": eps})

    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        zs = [torch.randint_like(p, 2) * 2 - 1 for p in params]
        hz = torch.autograd.grad([p.grad for p in params], params, grad_outputs=zs)
        with torch.no_grad():
            for group in self.param_groups:
                for p, z, h in zip(params, zs, hz):
                    p.sub_(group["lr"] * p.grad / ((z * h).abs() + group["eps"]))


def test_a_hessian_reading_optimizer_gets_the_gradients_graph():
    model = tiny_gpt(dropout=0.1).double().train()  # dropout: the graph's G comes from G's own draws
    opt = HutchinsonNewton(model.parameters())
    with math_attention():  # flash attention has no double backward, for the user's loop as for curvlab
        assert check_next_update_is_the_real_step(model, [opt], create_graph=True) == 0.0


class Refusing(torch.optim.SGD):
    def step(self, closure=None):
        raise RuntimeError("this optimizer only steps on Tuesdays\n(a second line)")


def test_a_step_no_way_can_take_is_refused_by_name():
    model = tiny_gpt(dropout=0.1).train()
    streams, (buffers, attrs) = random_streams(), module_tensors(model)
    with pytest.raises(
        CurvlabError, match=r"^Refusing\.step can't be taken .*closure: RuntimeError: this optimizer"
    ) as e:
        next_update(model, Refusing(model.parameters(), lr=0.1), make_loss_fn(model), batch_for(model))
    assert "\n" not in str(e.value) and isinstance(e.value.__cause__, RuntimeError)
    assert all(p.grad is None for p in model.parameters())
    assert_same_streams(streams)
    assert_untouched(model, buffers, attrs)


class MovesThenAsks(torch.optim.SGD):
    """A step whose signature can't tell (``*args, **kwargs``) that moves the parameters and draws from every
    stream before it finds it has no closure: the try with one must start as if the first never ran."""

    def step(self, *args, **kwargs):
        closure = args[0] if args else kwargs.get("closure")
        with torch.no_grad():
            for p in self.param_groups[0]["params"]:
                p.add_(torch.randn_like(p), alpha=1e-3)
        np.random.standard_normal(3), random.random()
        if closure is None:
            raise ValueError("no closure")
        with torch.no_grad():
            for p in self.param_groups[0]["params"]:
                p.sub_(p.grad, alpha=1e-3)
        return super().step()


def test_a_failed_try_changes_nothing_for_the_next():
    model = tiny_gpt(dropout=0.1).train()
    opt = MovesThenAsks(model.parameters(), lr=0.1, momentum=0.9)
    assert check_next_update_is_the_real_step(model, [opt], closure=True) == 0.0


def test_each_optimizer_of_a_list_draws_after_the_one_before():
    model = tiny_gpt(dropout=0.1).train()
    matrices = [p for n, p in model.named_parameters() if p.dim() == 2]
    ids = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in ids]
    pair = [NumpyNoiseSGD(matrices), SGLD(rest)]  # numpy and Python draws, then torch's, after the masks
    assert check_next_update_is_the_real_step(model, pair) == 0.0


class KwargsStep(torch.optim.SGD):
    """A wrapper whose ``step(*args, **kwargs)`` signature can't tell whether it takes a closure."""

    def step(self, *args, **kwargs):
        return super().step(*args, **kwargs)


def test_a_signature_that_cannot_tell():
    model = tiny_gpt()
    assert check_next_update_is_the_real_step(model, [KwargsStep(model.parameters(), lr=0.1, momentum=0.9)]) == 0.0


# -- the real optimizers of pytorch_optimizer, each in its user's own loop ----------------------------------


@pytest.mark.parametrize(
    ("build", "loop"),
    [
        (lambda ps: pytorch_optimizer.AdaHessian(ps, lr=1e-2), {"create_graph": True}),
        (lambda ps: pytorch_optimizer.SophiaH(ps, lr=1e-2, update_period=1), {"create_graph": True}),
        (lambda ps: pytorch_optimizer.AliG(ps, max_lr=1e-1), {"closure": True, "backward": False}),
        (lambda ps: pytorch_optimizer.SAM(ps, torch.optim.SGD, rho=0.05, lr=0.1), {"closure": True}),
        (lambda ps: pytorch_optimizer.Kron(ps, lr=1e-3, preconditioner_update_probability=1.0), {}),
    ],
    ids=["AdaHessian", "SophiaH", "AliG", "SAM", "Kron"],
)
def test_pytorch_optimizers_real_steps(build, loop):
    model = tiny_gpt().double()
    with math_attention():
        assert check_next_update_is_the_real_step(model, [build(model.parameters())], **loop) == 0.0
