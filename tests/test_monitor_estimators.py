"""The training monitor with a cheap estimator of <Z, HZ> (issue 52): its NDS within its own stated error of
the exact monitor's at the same steps, the rest of the split exact, the row's estimator and error through JSON,
and ``curvlab train --curvature-estimator``."""

import functools
import json
import math

import pytest
import torch
from typer.testing import CliRunner

from curvlab.cli import app
from curvlab.curvature.estimators import ESTIMATORS
from curvlab.curvature.taylor import taylor_split
from curvlab.engine.loss import make_loss_fn, token_cross_entropy
from curvlab.errors import CurvlabError
from curvlab.models.gpt import GPT, get_config
from curvlab.optim.build import build_optimizer
from curvlab.runs.metrics import monitor_rows
from curvlab.runs.monitor import CurvatureMonitor, MonitorRow, MonitorSettings
from tests.builders import SMALL_MODEL

DROPOUT_MODEL = {**SMALL_MODEL, "dropout": 0.1}  # (the monitor measures with dropout off, estimators too)
CHEAP = ("finite_difference", "quadratic_fit", "forward")
EXACT_TOO = ("first_order", "realized", "update_norm", "grad_norm", "cosine")  # not the estimator's


def watched_loop(dtype: torch.dtype = torch.float64, steps: int = 5, every: int = 2):
    """A plain Muon loop on a small GPT with one monitor per estimator, each measuring the same steps taken."""
    torch.manual_seed(0)
    model = GPT(get_config("tiny", **DROPOUT_MODEL, vocab_size=50)).to(dtype)
    optimizer = build_optimizer("muon", model, lr=0.05)
    tokens = torch.randint(0, 50, (16, SMALL_MODEL["block_size"] + 1))
    D = [(tokens[10:13, :-1], tokens[10:13, 1:]), (tokens[13:16, :-1], tokens[13:16, 1:])]
    monitors = {
        name: CurvatureMonitor(model, optimizer, make_loss_fn(model), D, every=every, estimator=name)
        for name in ESTIMATORS
    }
    for step in range(steps):
        before = monitors["exact"].snapshot() if monitors["exact"].due(step) else None
        token_cross_entropy(model(tokens[2 * step : 2 * step + 2, :-1]), tokens[2 * step : 2 * step + 2, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if before is not None:
            for monitor in monitors.values():
                monitor.measure_taken(step, before)
    return {name: monitor.rows for name, monitor in monitors.items()}


@pytest.fixture(scope="module")
def rows64():
    return watched_loop()


@pytest.mark.parametrize("estimator", CHEAP)
def test_a_cheap_monitors_nds_is_within_its_stated_error_of_the_exact_monitors(rows64, estimator):
    exact, cheap = rows64["exact"], rows64[estimator]
    assert [r.step for r in cheap] == [r.step for r in exact] == [0, 2, 4]
    for e, c in zip(exact, cheap, strict=True):
        assert e.ok and c.ok and c.estimator == estimator and e.estimator == "exact" and e.error is None
        # finite_difference and quadratic_fit state their error; forward is exact up to rounding (float64)
        bound = 1e-9 * abs(e.nds) if c.error is None else c.error
        assert abs(c.nds - e.nds) <= bound, (c.step, c.nds, e.nds, c.error)
        assert c.split.curvature_penalty == pytest.approx(0.5 * c.nds * c.split.update_norm**2, rel=1e-12)
        assert c.split.predicted == pytest.approx(c.split.first_order - c.split.curvature_penalty, rel=1e-12)
        for key in EXACT_TOO:  # from one gradient and two losses: the exact monitor's, to rounding
            assert getattr(c.split, key) == pytest.approx(getattr(e.split, key), rel=1e-10), key
        assert c.loss == pytest.approx(e.loss, rel=1e-12)
        # what it can't measure is left out, and the row says so
        assert e.hidden is not None and c.hidden is None and c.hidden_names == () and c.unmeasured == ("hidden",)
        assert "curvature/hidden_nds" not in c.log_scalars() and math.isnan(c.scalars().hidden.nds)
    errors = [r.error for r in rows64["finite_difference"]]
    assert all(0 < e < 1e-6 for e in errors), errors  # (float64: small, and stated)


def test_finite_differences_in_float32_within_their_stated_error():
    rows = watched_loop(torch.float32, steps=3)
    for e, c in zip(rows["exact"], rows["finite_difference"], strict=True):
        assert c.ok and abs(c.nds - e.nds) <= c.error, (c.step, c.nds, e.nds, c.error)
        assert c.log_scalars()["curvature/nds_error"] == c.error


def test_rows_round_trip_through_json_and_old_rows_read_as_exact(rows64):
    for name in ESTIMATORS:
        for row in rows64[name]:
            line = json.loads(json.dumps(row.to_dict()))
            assert line["estimator"] == name and MonitorRow.from_dict(line) == row
    old = rows64["exact"][0].to_dict()
    for key in ("estimator", "error", "unmeasured"):
        del old[key]
    assert MonitorRow.from_dict(old) == rows64["exact"][0]


def test_a_cheap_row_fails_the_taylor_check_and_says_why(rows64):
    """`curvlab track` reads rows through scalars(): an estimated ⟨Z, HZ⟩ makes no exact Taylor check."""
    exact = [row.scalars() for row in rows64["exact"]]
    assert any(s.taylor_ok for s in exact) and not any(s.message for s in exact)
    for s in (row.scalars() for row in rows64["finite_difference"]):
        assert s.taylor_ok is False and s.message.startswith("NDS estimated by finite_difference (stated error")


def test_unknown_estimators_and_blocks_by_an_estimator_are_refused_in_one_line():
    model = GPT(get_config("tiny", **SMALL_MODEL, vocab_size=50))
    D = (torch.zeros(2, 32, dtype=torch.long), torch.zeros(2, 32, dtype=torch.long))
    known = "choose one of exact, finite_difference, quadratic_fit, forward"
    with pytest.raises(CurvlabError, match=f"^unknown curvature estimator 'hessian'; {known}$"):
        CurvatureMonitor(model, None, make_loss_fn(model), D, estimator="hessian")
    with pytest.raises(CurvlabError, match=f"^unknown curvature estimator 'hessian'; {known}$"):
        MonitorSettings(every=5, estimator="hessian").validate()
    blocks = "^the block split needs the exact estimator \\(HVPs\\), not 'forward'$"
    with pytest.raises(CurvlabError, match=blocks):
        CurvatureMonitor(model, None, make_loss_fn(model), D, blocks="layer", estimator="forward")
    with pytest.raises(CurvlabError, match=blocks):
        MonitorSettings(every=5, blocks="layer", estimator="forward").validate()


def test_train_command_takes_a_curvature_estimator(pcfg_data, tmp_path):
    out = tmp_path / "cli"
    args = ["train", "--data", str(pcfg_data), "--out", str(out), "--steps", "3", "--batch-size", "4", "--quiet"]
    args += ["--warmup-steps", "1", "--val-windows", "4", "--curvature-every", "2", "--curvature-windows", "4"]
    args += [f"--model-opt={k}={v}" for k, v in SMALL_MODEL.items()]
    r = CliRunner().invoke(app, [*args, "--curvature-estimator", "finite_difference"])
    assert r.exit_code == 0, r.output
    rows = monitor_rows(out)
    assert [r.step for r in rows] == [0, 2]
    assert all(r.ok and r.estimator == "finite_difference" and r.error > 0 and r.hidden is None for r in rows)
    for extra, message in (([], "unknown curvature estimator 'hvp'"), (["--blocks", "layer"], "needs the exact")):
        args[args.index("--out") + 1] = str(tmp_path / "refused")
        r = CliRunner().invoke(app, [*args, "--curvature-estimator", "hvp" if not extra else "forward", *extra])
        assert r.exit_code == 2 and message in r.output and r.output.strip().count("\n") == 0, r.output
        assert not (tmp_path / "refused").exists()  # refused before the run starts


def test_the_lightning_callback_takes_a_monitor_by_an_estimator(tmp_path, monkeypatch):
    """The callbacks take the monitor object, its estimator with it: Lightning's real steps, by finite
    differences, within the stated error of their exact split, the error logged beside the NDS."""
    from tests import test_monitor_clients as clients

    cheap = functools.partial(CurvatureMonitor, estimator="finite_difference")
    monkeypatch.setattr(clients, "CurvatureMonitor", cheap)
    _, weights, monitor, loss_fn, held = clients.lightning_run(tmp_path, 2)
    assert [r.step for r in monitor.rows] == [0, 2]
    for row in monitor.rows:
        W, after = weights[row.step], weights[row.step + 1]
        ref = taylor_split(loss_fn, W, held, {n: W[n] - after[n] for n in W})
        assert row.ok and row.estimator == "finite_difference" and abs(row.nds - ref.nds) <= row.error
        assert row.split.first_order == pytest.approx(ref.first_order, rel=1e-5)
        assert row.log_scalars()["curvature/nds_error"] == row.error


@pytest.mark.parametrize("estimator", CHEAP)
def test_a_cheap_monitors_non_finite_step_says_so(estimator):
    """Where the held-out loss overflows, an estimator's row names the loss, as the exact row does: never a number."""
    torch.manual_seed(0)
    model = GPT(get_config("tiny", **SMALL_MODEL, vocab_size=40))
    D = (torch.randint(0, 40, (2, 32)), torch.randint(0, 40, (2, 32)))
    rows = []
    for name in ("exact", estimator):
        monitor = CurvatureMonitor(model, None, make_loss_fn(model), D, estimator=name)
        W = monitor.snapshot()
        rows.append(monitor.measure(3, W, {n: torch.full_like(p, 1e30) for n, p in W.items()}))
    exact, cheap = rows
    assert exact.status == cheap.status == "non-finite" and exact.message.startswith("the held-out loss L(W - Z")
    # (its losses are taken in forward-mode's exact mode, whose composite LayerNorm overflows at W - Z itself)
    assert cheap.message == "the held-out loss L(W - Z) is nan", cheap.message
    assert math.isnan(cheap.nds) and cheap.estimator == estimator
    assert MonitorRow.from_dict(json.loads(json.dumps(cheap.to_dict()))).message == cheap.message
