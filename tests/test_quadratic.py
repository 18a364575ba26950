import itertools
import math

import numpy as np
import pytest
import torch

from curvlab import hvp, taylor_split
from curvlab.studies.quadratic import (
    KroneckerQuadratic,
    TwoLevelSpec,
    best_fixed_lr,
    gd_contraction,
    gd_initial_share,
    muon_contraction,
    muon_nds,
    optimal_loss,
    phase_sweep,
    power_law,
    run_fixed_lr,
    run_line_search,
    scalar_two_level,
    theorem_condition,
    two_level,
)

EXAMPLE = TwoLevelSpec(d1=96, d2=96, q=88, m=8, w_H=100.0, w_L=1.0, sigma_H=3.0, sigma_L=1.0)


def test_factored_hvp_equals_dense_kronecker_hessian_and_curvlab_hvp():
    p = two_level(TwoLevelSpec(d1=7, d2=5, q=5, m=2, w_H=9.0, w_L=1.0))
    Y = torch.randn(7, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    dense = p.dense_hessian()
    assert torch.allclose(p.hvp(Y).reshape(-1), dense @ Y.reshape(-1), atol=1e-12)
    assert torch.allclose(hvp(p.loss_fn, {"Y": Y}, None, {"Y": Y})["Y"], p.hvp(Y), atol=1e-12)
    split = taylor_split(p.loss_fn, {"Y": torch.zeros(7, 5, dtype=torch.float64)}, None, {"Y": Y})
    assert split.nds == pytest.approx(float((Y * p.hvp(Y)).sum() / (Y * Y).sum()), rel=1e-12)
    assert split.realized == pytest.approx(split.predicted, rel=1e-12)  # exact for a quadratic
    eig = torch.linalg.eigvalsh(dense)
    assert eig.min() > 0  # positive definite: every mode has positive curvature


def test_muon_closed_forms_on_the_worked_example():
    p = two_level(EXAMPLE)
    traj = run_line_search(p, "muon", 8)
    assert muon_nds(EXAMPLE) == pytest.approx(10.0)
    assert traj.nds == pytest.approx([10.0] * 8, rel=1e-10)
    gap = np.array(traj.loss) - optimal_loss(EXAMPLE)
    assert muon_contraction(EXAMPLE) == pytest.approx(0.669421, abs=5e-7)
    assert gap[2:] / gap[1:-1] == pytest.approx([muon_contraction(EXAMPLE)] * 7, rel=1e-8)


def test_gd_closed_forms_on_the_worked_example():
    p = two_level(EXAMPLE)
    traj = run_line_search(p, "gd", 8)
    assert traj.nds[0] == pytest.approx(47.895, abs=5e-4) and traj.nds[1] == pytest.approx(53.105, abs=5e-4)
    assert traj.nds[::2] == pytest.approx([traj.nds[0]] * 4) and traj.nds[1::2] == pytest.approx([traj.nds[1]] * 4)
    P0 = gd_initial_share(EXAMPLE)
    two_step = gd_contraction(EXAMPLE, P0) * gd_contraction(EXAMPLE, 1 - P0)
    assert two_step == pytest.approx(0.922913, abs=5e-7)
    gap = np.array(traj.loss) - optimal_loss(EXAMPLE)
    assert gap[2::2] / gap[:-2:2] == pytest.approx([two_step] * 4, rel=1e-8)
    d = EXAMPLE.w_H - EXAMPLE.w_L  # every single step: Kantorovich's ratio, symmetric in P <-> 1 - P
    one_step = d * d * P0 * (1 - P0) / ((EXAMPLE.w_L + d * P0) * (EXAMPLE.w_H - d * P0))
    assert gap[1:] / gap[:-1] == pytest.approx([one_step] * 8, rel=1e-8)
    assert one_step**2 == pytest.approx(two_step, rel=1e-12)
    # GD's direction is R, so its NDS is P w_H + (1 - P) w_L with P the residual's high-curvature
    # energy share: P alternates P -> 1 - P
    shares = [(x - EXAMPLE.w_L) / (EXAMPLE.w_H - EXAMPLE.w_L) for x in traj.nds]
    assert shares[0] == pytest.approx(P0, rel=1e-10)
    assert all(b == pytest.approx(1 - a, rel=1e-9) for a, b in itertools.pairwise(shares))
    assert scalar_shares(EXAMPLE, 6) == pytest.approx(shares[:6], rel=1e-9)


def scalar_shares(spec, steps):
    """The high-curvature energy share of GD's residual, from the scalar model's coefficients."""
    n = np.array([spec.m, spec.q - spec.m])
    w = np.array([spec.w_H, spec.w_L])
    s = np.array([spec.sigma_H, spec.sigma_L])
    y, shares = np.zeros(2), []
    for _ in range(steps):
        r = s - w * y
        shares.append(n[0] * r[0] ** 2 / (n * r * r).sum())
        y = y + (n * r * r).sum() / (n * w * r * r).sum() * r
    return shares


@pytest.mark.parametrize("method", ["gd", "muon"])
def test_matrix_realization_equals_the_scalar_model(method):
    spec = TwoLevelSpec(d1=40, d2=48, q=30, m=6, w_H=20.0, w_L=0.5, sigma_H=2.0, sigma_L=1.0, seed=3)
    matrix = run_line_search(two_level(spec), method, 10)
    scalar = scalar_two_level(spec, method, 10)
    assert matrix.loss == pytest.approx(scalar.loss, rel=1e-10, abs=1e-12)
    assert matrix.nds == pytest.approx(scalar.nds, rel=1e-10)


def test_theorem_part_one_time_averaged_nds():
    rng = np.random.default_rng(2)
    specs = [EXAMPLE]
    while len(specs) < 40:  # random aligned settings (σ_H >= σ_L), the theorem's assumption
        q = int(rng.integers(10, 200))
        m = int(rng.integers(1, (q - 1) // 2 + 1))
        specs.append(TwoLevelSpec(d1=q, d2=q, q=q, m=m, w_H=float(10 ** rng.uniform(0.1, 3)), w_L=1.0,
                                  sigma_H=float(rng.uniform(1, 5)), sigma_L=1.0))  # fmt: skip
    for spec in specs:
        muon = scalar_two_level(spec, "muon", 40).nds
        gd = scalar_two_level(spec, "gd", 40).nds
        k = min(len(muon), len(gd))  # a run may end early at the exact optimum
        assert np.all(np.cumsum(muon[:k]) < np.cumsum(gd[:k])), spec  # every T: Muon's mean NDS is lower


def test_gd_nds_averages_to_the_midpoint_over_even_T():
    gd_nds = scalar_two_level(EXAMPLE, "gd", 40).nds
    # the two alternating NDS values average to (w_H + w_L) / 2 over any even number of steps
    assert np.mean(gd_nds[:2]) == pytest.approx((EXAMPLE.w_H + EXAMPLE.w_L) / 2, rel=1e-10)
    assert np.mean(gd_nds) == pytest.approx((EXAMPLE.w_H + EXAMPLE.w_L) / 2, rel=1e-10)


def test_theorem_part_two_on_a_random_sweep():
    rng = np.random.default_rng(0)
    checked = 0
    while checked < 60:
        q = int(rng.integers(20, 200))
        m = int(rng.integers(1, q // 2))
        ratio = float(rng.uniform(0.1, 5.0))  # ratios < 1 are drawn too: the condition must exclude them
        rho = float(10 ** rng.uniform(0, 3))
        spec = TwoLevelSpec(d1=q, d2=q, q=q, m=m, w_H=rho, w_L=1.0, sigma_H=ratio, sigma_L=1.0)
        if not theorem_condition(spec) or spec.rho <= 1:
            continue
        checked += 1
        best = optimal_loss(spec)
        muon = np.array(scalar_two_level(spec, "muon", 30).loss) - best
        gd = np.array(scalar_two_level(spec, "gd", 30).loss) - best
        k = min(len(muon), len(gd))
        assert np.all(muon[1:k] <= gd[1:k] * (1 + 1e-9) + 1e-12), spec


def test_the_condition_needs_the_alignment_assumption():
    unaligned = TwoLevelSpec(d1=90, d2=90, q=90, m=38, w_H=154.5, w_L=1.0, sigma_H=0.26, sigma_L=1.0)
    inv = 1 / unaligned.alpha
    assert unaligned.rho + 1 > inv > 1 + unaligned.sigma_H / unaligned.sigma_L  # the bare inequalities hold
    assert not theorem_condition(unaligned)
    best = optimal_loss(unaligned)
    assert scalar_two_level(unaligned, "muon", 1).loss[1] - best > scalar_two_level(unaligned, "gd", 1).loss[1] - best


def test_theorem_part_two_on_the_matrix_model():
    spec = TwoLevelSpec(d1=64, d2=64, q=50, m=5, w_H=30.0, w_L=1.0, sigma_H=2.0, sigma_L=1.0, seed=1)
    assert theorem_condition(spec)
    p = two_level(spec)
    muon, gd = run_line_search(p, "muon", 15), run_line_search(p, "gd", 15)
    assert all(a < b for a, b in zip(muon.loss[1:], gd.loss[1:]))


def test_phase_sweep_agrees_with_the_condition_where_it_holds():
    sweep = phase_sweep(rhos=[2, 10, 100, 1000], alphas=[0.05, 0.1, 0.3, 0.45], ratios=[0.5, 1.0, 3.0], steps=20)
    cond = np.array(sweep["condition"])
    always = np.array(sweep["muon_below_every_step"])
    assert cond.any() and not cond.all()
    assert np.all(always[cond])  # sufficient: wherever it holds, Muon is below GD at every step
    assert np.array(sweep["muon_wins"]).shape == (3, 4, 4)


def test_newton_schulz_polar_express_adam_and_sign_run():
    spec = TwoLevelSpec(d1=32, d2=32, q=20, m=4, w_H=20.0, w_L=1.0, sigma_H=2.0, sigma_L=1.0)
    p = two_level(spec)
    for polar in ("newton_schulz", "polar_express"):
        traj = run_line_search(p, "muon", 6, polar=polar)
        assert traj.loss[-1] < traj.loss[0] and traj.method == f"muon-{polar}"
    grid = [1e-3, 3e-3, 1e-2, 3e-2, 1e-1]
    for method in ("gd", "muon", "adam", "sign"):
        traj = best_fixed_lr(p, method, grid, 30)
        assert traj.loss[-1] < traj.loss[0] and traj.lr in grid and len(traj.nds) == 30
    diverged = run_fixed_lr(p, "gd", 10.0, 30, momentum=0.0)
    assert diverged.loss[-1] == math.inf or diverged.loss[-1] > diverged.loss[0]


def test_power_law_alignment_knob():
    flat = power_law(d1=40, d2=40, q=30, alignment=0.0, seed=0)
    aligned = power_law(d1=40, d2=40, q=30, alignment=1.0, seed=0)

    def gradient_nds(p):
        return float((p.G * p.hvp(p.G)).sum() / (p.G * p.G).sum())

    assert gradient_nds(aligned) > 2 * gradient_nds(flat)


def test_bad_specs_name_the_failing_assumption():
    with pytest.raises(ValueError, match="α = m/q < 1/2"):
        two_level(TwoLevelSpec(q=10, m=6))
    with pytest.raises(ValueError, match="w_H > w_L"):
        two_level(TwoLevelSpec(w_H=1.0, w_L=2.0))
    with pytest.raises(ValueError, match="q=200 > min"):
        two_level(TwoLevelSpec(q=200, m=8))
    with pytest.raises(ValueError, match="positive"):
        two_level(TwoLevelSpec(w_L=-1.0))
    two_level(TwoLevelSpec(q=10, m=6, d1=16, d2=16), outside_theorem=True)  # allowed on purpose
    with pytest.raises(ValueError, match="unknown method"):
        run_line_search(two_level(TwoLevelSpec()), "adam", 3)
    assert isinstance(two_level(TwoLevelSpec(d1=12, d2=12, q=10, m=2)), KroneckerQuadratic)
