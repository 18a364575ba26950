import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz

from curvlab import msign
from curvlab.optim.polar import NEWTON_SCHULZ_COEFFICIENTS, optimal_odd_quintic, polar_express_coefficients

# Published 5-step Polar Express coefficients (modded-nanogpt, Dion): l = 1e-3, safety 2e-2, cushion 0.02.
PUBLISHED = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]


def gaussian(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def reference_polar(X):
    """U Vᵀ from the eigendecomposition of XᵀX (independent of torch.linalg.svd): X (XᵀX)^-1/2."""
    X = X.double()
    evals, evecs = torch.linalg.eigh(X.mT @ X)
    return X @ evecs @ torch.diag_embed(evals.rsqrt()) @ evecs.mT


def singular_values(X):
    return torch.linalg.svdvals(X.double())


@pytest.mark.parametrize("shape", [(16, 40), (40, 16), (3, 12, 20)])
def test_svd_is_the_polar_factor(shape):
    X = gaussian(*shape)
    O = msign(X, polar="svd")
    assert O.dtype == torch.float32 and O.shape == X.shape
    wide = O if shape[-2] <= shape[-1] else O.mT
    eye = torch.eye(wide.shape[-2], dtype=torch.float64)
    assert torch.allclose(wide.double() @ wide.double().mT, eye.expand_as(wide @ wide.mT), atol=1e-6)
    ref = reference_polar(X if shape[-2] >= shape[-1] else X.mT)
    ref = ref if shape[-2] >= shape[-1] else ref.mT
    assert torch.allclose(O.double(), ref, atol=1e-5)


@pytest.mark.parametrize("shape", [(32, 96), (96, 32), (64, 64)])
def test_newton_schulz_equals_torch_muon(shape):
    X = gaussian(*shape)
    ours = msign(X, polar="newton_schulz")
    theirs = _zeropower_via_newtonschulz(X, NEWTON_SCHULZ_COEFFICIENTS, 5, 1e-7)
    assert torch.equal(ours, theirs.float())  # bit for bit, not only "a few 1e-3"


def test_singular_values_after_five_steps():
    X = gaussian(256, 768)
    ns = singular_values(msign(X, polar="newton_schulz"))
    pe = singular_values(msign(X, polar="polar_express"))
    assert ns.min() >= 0.65 and ns.max() <= 1.2
    assert pe.min() >= 0.84 and pe.max() <= 1.15
    exact = msign(X, polar="svd").double()
    err_ns = (msign(X, polar="newton_schulz").double() - exact).norm() / exact.norm()
    err_pe = (msign(X, polar="polar_express").double() - exact).norm() / exact.norm()
    assert err_pe < err_ns  # Polar Express lands closer in the same number of steps


def test_bf16_and_float64_runs_of_the_same_polynomial_agree():
    X = gaussian(64, 192)
    for method in ("newton_schulz", "polar_express"):
        lo = msign(X, polar=method, dtype=torch.bfloat16).double()
        hi = msign(X.double(), polar=method, dtype=torch.float64)
        assert (lo - hi).norm() / hi.norm() < 0.03


def test_convergent_iterations_are_exact():
    X = gaussian(48, 80, dtype=torch.float64)
    exact = reference_polar(X.mT).mT
    # the classic cubic Newton–Schulz converges to U Vᵀ; so does Polar Express given more steps
    cubic = msign(X, polar="newton_schulz", coefficients=(1.5, -0.5, 0.0), steps=60, dtype=torch.float64)
    pe = msign(X, polar="polar_express", steps=12, dtype=torch.float64)
    for O in (cubic, pe):
        assert (O - exact).norm() / exact.norm() < 1e-2


def test_polar_express_coefficients_match_the_published_ones():
    ours = polar_express_coefficients(5)
    for got, want in zip(ours, PUBLISHED):
        assert got == pytest.approx(want, rel=1e-12)
    assert len(polar_express_coefficients(7)) == 7


def test_optimal_quintic_equioscillates():
    lo, hi = 0.1, 1.0
    a, b, c = optimal_odd_quintic(lo, hi)
    xs = torch.linspace(lo, hi, 20001, dtype=torch.float64)
    err = 1 - (a * xs + b * xs**3 + c * xs**5)
    assert float(err[0]) == pytest.approx(float(err.max()), rel=1e-9)
    assert float(err[-1]) == pytest.approx(float(err.min()), rel=1e-9)
    assert float(err.max()) == pytest.approx(-float(err.min()), rel=1e-6)


def test_msign_never_modifies_its_input():
    for dtype in (torch.bfloat16, torch.float32):
        X = gaussian(8, 24).to(dtype)
        before = X.clone()
        for method in ("svd", "newton_schulz", "polar_express"):
            msign(X, polar=method, dtype=dtype)
            assert torch.equal(X, before)


def test_bad_input():
    with pytest.raises(ValueError, match="unknown polar method"):
        msign(gaussian(3, 3), polar="qr")
    with pytest.raises(ValueError, match="matrix"):
        msign(gaussian(3))
    with pytest.raises(ValueError, match="empty"):
        msign(torch.zeros(0, 3))
