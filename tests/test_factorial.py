"""The factorial of step directions (curvlab.steps.factorial, curvlab.analysis.factorial): each filter and map
against an independent construction (torch's Adam, curvlab's Muon, a float64 SVD), in float64 on tiny problems."""

import copy

import pytest
import torch

from curvlab.analysis.factorial import factorial_directions
from curvlab.engine import params as param_dicts
from curvlab.engine.loss import make_loss_fn
from curvlab.errors import CurvlabError
from curvlab.optim.build import build_optimizer
from curvlab.optim.muon import Muon, muon_scale
from curvlab.steps.factorial import (
    ADAMW_CELL,
    CELLS,
    FILTERS,
    MAPS,
    MUON_CELL,
    RANDOM_SV_LAW,
    apply_map,
    cell_name,
    factorial_cells,
    filter_states,
    parse_cell,
)
from curvlab.steps.shadow import ShadowSettings, build_shadow
from curvlab.steps.update import next_update
from tests.reference import TinyTransformer, assert_same

SHAPES = {"wide": (6, 10), "tall": (10, 6)}
BETAS, EPS, MU = (0.9, 0.95), 1e-8, 0.95
# Newton–Schulz (5 steps, bf16) lands the singular values in about [0.7, 1.1], not at 1 (docs/science.md
# section 9): its msign is U Vᵀ only loosely; measured 0.15-0.23 relative error and cosine >= 0.975
NS_RELATIVE_ERROR, NS_COSINE = 0.3, 0.95


def _random(shapes, seed, n=1):
    gen = torch.Generator().manual_seed(seed)
    return [{k: torch.randn(s, generator=gen, dtype=torch.float64) for k, s in shapes.items()} for _ in range(n)]


def _trained(optimizer, past):
    """``{name: Parameter}`` and ``optimizer(params)`` stepped on the gradients ``past``."""
    params = {k: torch.nn.Parameter(w) for k, w in _random(SHAPES, 0)[0].items()}
    opt = optimizer(list(params.values()))
    for grads in past:
        for k, p in params.items():
            p.grad = grads[k].clone()
        opt.step()
    return params, opt


def _twin_step(params, opt, G):
    """(W_before - W_after) of a deep-copied twin of ``opt`` stepped on G, and the twin's state by name."""
    twin = copy.deepcopy({"params": params, "opt": opt})
    for k, p in twin["params"].items():
        p.grad = G[k].clone()
    twin["opt"].step()
    return (
        {k: params[k].detach() - p.detach() for k, p in twin["params"].items()},
        {k: twin["opt"].state[p] for k, p in twin["params"].items()},
    )


def _states(opt, params):
    assert all(p in opt.state for p in params.values())  # (the optimizer's own parameters)
    return {k: opt.state[p] for k, p in params.items()}


def _cells(states, cells, muon=None, seed=0, shapes=SHAPES):
    return factorial_cells(states, cells, shapes=shapes, muon=muon or ShadowSettings.for_kind("muon"), seed=seed)


def test_cell_names_and_unknown_names_refused_in_one_line():
    assert len(CELLS) == 10 and set(CELLS) == {(f, m) for f in FILTERS for m in MAPS}
    assert cell_name(*MUON_CELL) == "nesterov_msign" and cell_name(*ADAMW_CELL) == "ema_adam"
    assert all(parse_cell(cell_name(*c)) == c for c in CELLS) and parse_cell("ema_random_sv") == ("ema", "random_sv")
    for call, pattern in [
        (lambda: cell_name("adam", "msign"), "unknown filter 'adam'; choose one of ema, nesterov$"),
        (lambda: parse_cell("ema_svd"), "unknown map 'svd'; choose one of identity, adam, sign, msign, random_sv$"),
        (lambda: parse_cell("nesterov"), "unknown map ''"),
    ]:
        with pytest.raises(CurvlabError, match=pattern) as caught:
            call()
        assert "\n" not in str(caught.value)
    states = filter_states(_random(SHAPES, 1)[0], {}, {}, betas=BETAS, eps=EPS, momentum=MU, nesterov=True)
    with pytest.raises(CurvlabError, match="unknown map 'polar'"):
        _cells(states, [("ema", "polar")])


def test_msign_is_muons_scaled_polar_factor():
    """polar="svd": U Vᵀ of a float64 SVD times Muon's scale, a stack's expert by expert; Newton–Schulz: close."""
    shapes = {**SHAPES, "stack": (3, 4, 5)}
    F = _random(shapes, 2)[0]
    exact, approximate = ShadowSettings.for_kind("muon", polar="svd"), ShadowSettings.for_kind("muon")
    for k, f in F.items():
        U, _, Vh = torch.linalg.svd(f, full_matrices=False)  # (batched over a stack's experts)
        expected = U @ Vh * muon_scale(shapes[k], "original")
        got = apply_map("msign", f, denominator=None, shape=shapes[k], muon=exact)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)
        ns = apply_map("msign", f, denominator=None, shape=shapes[k], muon=approximate)
        assert float((ns - expected).norm() / expected.norm()) < NS_RELATIVE_ERROR
        assert float((ns * expected).sum() / (ns.norm() * expected.norm())) > NS_COSINE


def test_ema_adam_is_torch_adams_step_over_its_lr_and_nesterov_adam_the_hand_formula():
    lr, (*past, G) = 1e-2, _random(SHAPES, 3, n=4)
    params, adam = _trained(lambda p: torch.optim.Adam(p, lr=lr, betas=BETAS, eps=EPS, weight_decay=0), past)
    held, muon = _trained(lambda p: Muon(p, momentum=MU), past)  # (its own parameters, on the same gradients)
    states = filter_states(
        G, _states(adam, params), _states(muon, held), betas=BETAS, eps=EPS, momentum=MU, nesterov=True
    )
    cells = _cells(states, [("ema", "adam"), ("nesterov", "adam"), ("ema", "identity"), ("nesterov", "identity")])
    step, after = _twin_step(params, adam, G)
    t = len(past) + 1
    for k in SHAPES:
        torch.testing.assert_close(cells["ema_adam"][k], step[k] / lr, rtol=1e-12, atol=0)
        assert float(after[k]["step"]) == t
        torch.testing.assert_close(
            cells["ema_identity"][k], after[k]["exp_avg"] / (1 - BETAS[0] ** t), rtol=1e-14, atol=0
        )
        B = muon.state[held[k]]["momentum_buffer"]
        B1 = MU * B + (1 - MU) * G[k]
        v = BETAS[1] * adam.state[params[k]]["exp_avg_sq"] + (1 - BETAS[1]) * G[k] ** 2
        hand = ((1 - MU) * G[k] + MU * B1) / ((v / (1 - BETAS[1] ** t)).sqrt() + EPS)
        torch.testing.assert_close(cells["nesterov_adam"][k], hand, rtol=1e-13, atol=0)
        torch.testing.assert_close(cells["nesterov_identity"][k], (1 - MU) * G[k] + MU * B1, rtol=1e-14, atol=0)


@pytest.mark.parametrize("polar", ["svd", "newton_schulz"])
def test_nesterov_filter_is_what_a_real_muon_step_uses(polar):
    """nesterov x msign times the lr is a real curvlab Muon step (weight decay 0) of a twin: the same ops, so
    to rounding for either polar method; without Nesterov the filter is the momentum buffer itself."""
    lr, (*past, G) = 0.02, _random(SHAPES, 4, n=5)
    settings = ShadowSettings.for_kind("muon", polar=polar)
    params, muon = _trained(lambda p: Muon(p, lr=lr, momentum=MU, weight_decay=0, polar=polar), past)
    states = filter_states(G, {}, _states(muon, params), betas=BETAS, eps=EPS, momentum=MU, nesterov=True)
    cells = _cells(states, [MUON_CELL, ("nesterov", "sign")], muon=settings)
    step, after = _twin_step(params, muon, G)
    for k in SHAPES:
        torch.testing.assert_close(cells["nesterov_msign"][k] * lr, step[k], rtol=1e-10, atol=1e-15)
        assert torch.equal(cells["nesterov_sign"][k], torch.sign(states.nesterov[k]))
    plain = filter_states(G, {}, _states(muon, params), betas=BETAS, eps=EPS, momentum=MU, nesterov=False)
    for k in SHAPES:
        assert torch.equal(plain.nesterov[k], after[k]["momentum_buffer"])


def test_random_singular_values_are_the_documented_draws():
    assert RANDOM_SV_LAW == "uniform on (0, 1]"
    shapes = {"b": (4, 7), "a": (6, 3), "c": (2, 3, 4)}  # drawn in sorted order: a, b, then c's two experts
    G = _random(shapes, 5)[0]
    states = filter_states(G, {}, {}, betas=BETAS, eps=EPS, momentum=MU, nesterov=True)
    cells = [("ema", "random_sv"), ("nesterov", "random_sv"), ("ema", "sign")]
    got = _cells(states, cells, seed=7, shapes=shapes)
    gen = torch.Generator().manual_seed(7)
    for k in sorted(shapes):
        F = states.ema[k]
        for i, f in enumerate(F if F.dim() == 3 else [F]):
            U, _, Vh = torch.linalg.svd(f, full_matrices=False)
            s = 1 - torch.rand(min(f.shape), generator=gen, dtype=torch.float64)
            expected = U @ torch.diag(s) @ Vh
            piece = got["ema_random_sv"][k][i] if F.dim() == 3 else got["ema_random_sv"][k]
            torch.testing.assert_close(piece, expected, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(torch.linalg.svdvals(piece), s.sort(descending=True).values, rtol=1e-12, atol=0)
            nest = got["nesterov_random_sv"][k][i] if F.dim() == 3 else got["nesterov_random_sv"][k]
            torch.testing.assert_close(torch.linalg.svdvals(nest), torch.linalg.svdvals(piece), rtol=1e-12, atol=0)
        assert torch.equal(got["ema_sign"][k], torch.sign(F))
    again, other = _cells(states, cells, seed=7, shapes=shapes), _cells(states, cells, seed=8, shapes=shapes)
    assert_same(again, got)
    assert all(not torch.allclose(other["ema_random_sv"][k], got["ema_random_sv"][k]) for k in shapes)


def _run(optimizer, steps=3):
    """A TinyTransformer trained ``steps`` steps by ``optimizer`` with a shadow of the other arm, its next
    gradient and step, and a copy of everything the factorial must leave alone."""
    torch.manual_seed(0)
    model = TinyTransformer().double()
    batch = (torch.randint(0, 11, (3, 6)), torch.randint(0, 11, (3, 6)))
    loss_fn = make_loss_fn(model)
    opt = build_optimizer(optimizer, model)
    shadow = build_shadow(optimizer, model, **({"polar": "svd"} if optimizer == "adamw" else {}))
    for _ in range(steps):
        opt.zero_grad()
        loss_fn(dict(model.named_parameters()), batch).backward()
        shadow.update_from(model)
        opt.step()
    G, Z = next_update(model, opt, loss_fn, batch)
    kept = copy.deepcopy((opt.state_dict(), shadow.state_dict(), model.state_dict()))
    return model, opt, shadow, G, Z, kept


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_factorial_directions_from_a_run_and_its_shadow(optimizer):
    model, opt, shadow, G, Z, kept = _run(optimizer)
    dirs = factorial_directions(model, opt, G, Z, shadow, seed=3)
    assert [d.name for d in dirs] == [cell_name(*c) for c in CELLS] and all(d.scaling == "matched" for d in dirs)
    assert "seed 3" in dirs[-1].source and RANDOM_SV_LAW in dirs[-1].source
    assert_same((opt.state_dict(), shadow.state_dict(), model.state_dict()), kept)
    hidden = shadow.names
    norm = param_dicts.norm(Z, hidden)
    for d in dirs:
        assert param_dicts.norm(d.z, hidden) == pytest.approx(norm, rel=1e-12)
        assert all(torch.equal(d.z[n], Z[n]) for n in Z if n not in hidden) and d.z.keys() == Z.keys()
    own = {d.name: d for d in dirs}[cell_name(*(ADAMW_CELL if optimizer == "adamw" else MUON_CELL))]
    for n in hidden:  # the run's own cell is the real step (weight decay 0): same norm, so equal
        torch.testing.assert_close(own.z[n], Z[n], rtol=1e-9, atol=1e-12)
    # the other arm's cell, up to its lr, is the shadow's step (its state and settings: a shadow Muon by SVD)
    other = {d.name: d for d in dirs}[cell_name(*(MUON_CELL if optimizer == "adamw" else ADAMW_CELL))]
    W = {n: p.detach() for n, p in model.named_parameters() if n in hidden}
    step = shadow.direction({n: G[n] for n in hidden}, W)
    ratio = norm / param_dicts.norm(step)
    for n in hidden:
        torch.testing.assert_close(other.z[n], step[n] * ratio, rtol=1e-10, atol=1e-14)
    subset = factorial_directions(model, opt, G, Z, shadow, ["ema_sign"], seed=3)
    assert [d.name for d in subset] == ["ema_sign"]


def test_factorial_directions_refusals():
    model, opt, _, G, Z, _ = _run("adamw", steps=1)
    for other in (None, build_shadow("muon", model)):  # no shadow, or one of the run's own arm
        with pytest.raises(CurvlabError, match="needs a shadow muon state beside the run's adam") as caught:
            factorial_directions(model, opt, G, Z, other, seed=0)
        assert "\n" not in str(caught.value)
    fresh = build_optimizer("adamw", model)
    zero = {n: torch.zeros_like(g) for n, g in G.items()}
    with pytest.raises(CurvlabError, match="the ema_identity cell is zero on the hidden matrices"):
        factorial_directions(model, fresh, zero, Z, build_shadow("adamw", model), ["ema_identity"], seed=0)
