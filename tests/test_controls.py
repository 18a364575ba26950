"""The controls (docs/science.md section 14): the twins kept in training and measured at a checkpoint, the
held-out H, the injected sharp directions and the edge-of-stability context, and their aggregation."""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from curvlab.analysis.controls import EXCHANGEABLE, INJECTED_RATIOS, heldout_key, injected_key
from curvlab.analysis.directions import counterfactual_directions
from curvlab.analysis.report import analyze
from curvlab.analysis.targets import AnalysisSettings, open_checkpoint
from curvlab.engine import params as param_dicts
from curvlab.engine.forward import forward_quadratic_form
from curvlab.engine.loss import make_loss_fn
from curvlab.errors import CurvlabError
from curvlab.optim.adam import adam_edge_of_stability
from curvlab.runs.checkpoint import load_checkpoint, read_index
from curvlab.runs.train import train
from curvlab.steps.shadow import ShadowState
from curvlab.steps.update import next_update
from curvlab.studies.controls import CONTROL_NAMES, TWIN_TOLERANCE, controls, stability, twin_control
from tests.builders import crash_training_after, shadow_config, train_losses
from tests.reference import assert_same
from tests.synthetic import level_data, record

STEPS = 6


@pytest.fixture(scope="module", params=["adamw", "muon"])
def controlled_run(request, pcfg_data, tmp_path_factory):
    """A run of each arm with its shadow and its twins, a checkpoint every step."""
    out = tmp_path_factory.mktemp(f"controls-{request.param}")
    cfg = shadow_config(pcfg_data, out / "run", optimizer=request.param, steps=STEPS, eval_every=1, ckpt_every=1,
                 shadow=True, controls=True)  # fmt: skip
    train(cfg, progress=False)
    return request.param, out / "run", cfg


def _checkpoint(run, step):
    return run / next(e["path"] for e in read_index(run) if e["step"] == step)


def test_twins_change_nothing_and_are_kept_in_every_checkpoint(controlled_run, tmp_path):
    optimizer, run, cfg = controlled_run
    plain = replace(cfg, out=str(tmp_path / "plain"), controls=False)
    train(plain, progress=False)
    assert train_losses(tmp_path / "plain") == train_losses(run)  # the run is the run without them
    target = open_checkpoint(_checkpoint(run, STEPS))
    assert set(target.controls) == {"twin", "hp_twin"}
    twin, hp = target.controls["twin"].settings, target.controls["hp_twin"].settings
    assert twin.kind == hp.kind == optimizer and twin.lr == cfg.optimizer_options.get("lr", twin.lr)
    if optimizer == "muon":
        assert (twin.momentum, hp.momentum) == (0.95, 0.94)
    else:
        assert (twin.betas, hp.betas) == ((0.9, 0.95), (0.9, 0.951))


def _directions(target, twins):
    model = target.model
    model.eval()
    loss_fn = make_loss_fn(model)
    G, Z = next_update(model, target.optimizer, loss_fn, target.train_batches[0], max_grad_norm=target.grad_clip)
    own = "adamw" if optimizer_of(target) == "adam" else "muon"
    _, _, dirs = counterfactual_directions(model, target.optimizer, G, Z, [own], shadow=target.shadow, controls=twins)
    return {d.name: d for d in dirs}, own


def optimizer_of(target):
    return "adam" if target.optimizer_name == "adamw" else "muon"


@pytest.mark.heavy
def test_the_twins_step_is_the_real_step_and_a_lagged_twin_is_not(controlled_run):
    """The twin's step equals the real next step on the hidden matrices to float32 rounding, so its NDS
    ratio is 1 within TWIN_TOLERANCE at every checkpoint; a twin one step late (the state of the checkpoint
    before) is off by far more, and the control fails on it."""
    optimizer, run, _ = controlled_run
    reports, lagged_reports = [], []
    for step in range(2, STEPS + 1):
        target = open_checkpoint(_checkpoint(run, step))
        dirs, own = _directions(target, target.controls)
        hidden = target.shadow.names
        real, twin = dirs[own].z, dirs["twin"].z
        scale = param_dicts.norm(real, hidden)
        assert (
            param_dicts.norm(param_dicts.add({n: real[n] for n in hidden}, {n: twin[n] for n in hidden}, alpha=-1.0))
            <= 1e-5 * scale
        )
        settings = AnalysisSettings(controls=True)
        reports.append(analyze(target, settings))
        before = open_checkpoint(_checkpoint(run, step - 1)).controls["twin"]
        late = ShadowState(before.settings, before.shapes)
        late.load_state_dict(before.state_dict())
        target = open_checkpoint(_checkpoint(run, step))
        lagged_reports.append(analyze(replace(target, controls={**target.controls, "twin": late}), settings))
    for r in reports:
        hidden = r.paired
        ratio = hidden.get(own).hidden.nds / hidden.get("twin").hidden.nds
        assert abs(ratio - 1) <= TWIN_TOLERANCE and {"sgd", "hp_twin"} <= set(hidden.names)
    worst = max(abs(r.paired.get(own).hidden.nds / r.paired.get("twin").hidden.nds - 1) for r in lagged_reports)
    assert worst > 10 * TWIN_TOLERANCE

    def data(rs):
        scalars = [{k: v for k, v in r.scalars().to_dict().items() if isinstance(v, float)} for r in rs]
        return level_data([record("adamw/muon", seed, scalars, scalars) for seed in range(3)], s_values=(0.0,))

    good, bad = twin_control(data(reports), optimizer), twin_control(data(lagged_reports), optimizer)
    assert good.passed is True and good.detail["max_abs_deviation"] <= TWIN_TOLERANCE
    assert bad.passed is False and bad.detail["max_abs_deviation"] > 10 * TWIN_TOLERANCE


def test_held_out_injected_and_stability_at_a_checkpoint(controlled_run):
    """At one checkpoint: the held-out NDS is each direction's quadratic form under the validation batch's H;
    each injected direction's measured ratio is its known one; lambda_max bounds every direction's NDS;
    the arm's preconditioned sharpness and threshold come with the current lr."""
    optimizer, run, _ = controlled_run
    settings = AnalysisSettings(dtype="float64", controls=True, stability=60, held_out=True)
    target = open_checkpoint(_checkpoint(run, STEPS), batches=settings.train_batches())
    r = analyze(target, settings)
    c = r.controls
    model = target.model
    loss_fn = make_loss_fn(model)
    params = {n: p.detach() for n, p in model.named_parameters()}
    hidden = r.paired.hidden_names
    val = target.val_batches[0]
    for batch, suffix in ((target.train_batches[0], ""), (target.train_batches[1], EXCHANGEABLE)):
        G, Z = next_update(model, target.optimizer, loss_fn, batch, max_grad_norm=target.grad_clip)
        _, _, dirs = counterfactual_directions(model, target.optimizer, G, Z, ["adamw", "muon"], shadow=target.shadow)
        Gv = torch.func.grad(lambda p: loss_fn(p, val))(param_dicts.cast(params, torch.float64))
        for d in dirs:
            zh = {n: d.z[n] if n in hidden else torch.zeros_like(params[n]) for n in params}
            zh = param_dicts.cast(zh, torch.float64)
            _, zhz = forward_quadratic_form(loss_fn, params, val, zh, dtype=torch.float64)
            name = d.name + suffix
            assert c.held_out[name] == pytest.approx(zhz / param_dicts.dot(zh, zh), rel=1e-8)
            cos = param_dicts.dot(Gv, zh, hidden) / (param_dicts.norm(Gv, hidden) * param_dicts.norm(zh))
            assert c.held_out_cos[name] == pytest.approx(cos, rel=1e-8)
            assert r.scalars().paired[heldout_key(name)] == c.held_out[name]
            if suffix:  # the other way: the twin, made from another batch, under the step's own batch's H
                _, zhz0 = forward_quadratic_form(loss_fn, params, target.train_batches[0], zh, dtype=torch.float64)
                assert r.paired.get(name).hidden.nds == pytest.approx(zhz0 / param_dicts.dot(zh, zh), rel=1e-8)
    assert set(c.held_out) == {"adamw", "muon", "adamw_exchangeable", "muon_exchangeable"}
    for ratio in INJECTED_RATIOS:
        key = f"{ratio:g}"
        if key in c.injected:  # reachable at this point
            assert c.closed_form[key] == pytest.approx(ratio, rel=1e-9)
            assert c.injected[key] == pytest.approx(ratio, rel=1e-8)
            assert r.scalars().paired[injected_key(ratio)] == c.injected[key]
    slack = c.lambda_residual + 1e-4 * abs(c.lambda_max)
    for d in r.paired.directions:  # (a control's direction is measured on the hidden matrices alone)
        assert (d.all.nds if d.name in ("adamw", "muon") else d.hidden.nds) <= c.lambda_max + slack
    assert c.preconditioned_sharpness > 0 and c.lr > 0 and math.isfinite(c.edge_of_stability)
    if optimizer == "adamw":
        assert c.edge_of_stability == pytest.approx(adam_edge_of_stability(c.lr, 0.9))


# -- aggregation, on synthetic points with known answers -------------------------------------------


def _point(rng, own, injected=True, twin=1.0, sgd=20.0, hp=1.01, heldout=1.0, exchangeable=1.0):
    nds = {"adamw": 6.0, "muon": 1.0}
    x = {f"paired_nds_{a}_hidden": v * np.exp(rng.normal(0, 0.1)) for a, v in nds.items()}
    x |= {f"paired_nds_{a}_all": x[f"paired_nds_{a}_hidden"] for a in nds}
    x["paired_nds_twin_hidden"] = x[f"paired_nds_{own}_hidden"] / twin
    x["paired_nds_hp_twin_hidden"] = x[f"paired_nds_{own}_hidden"] / (hp * np.exp(rng.normal(0, 0.002)))
    x["paired_nds_sgd_hidden"] = sgd * x["paired_nds_muon_hidden"]
    x |= {heldout_key(a): x[f"paired_nds_{a}_hidden"] / heldout for a in nds}
    # an exchangeable twin: the same NDS up to its own batch's noise, times the given bias
    x |= {heldout_key(a + EXCHANGEABLE): x[heldout_key(a)] * exchangeable * np.exp(rng.normal(0, 0.02)) for a in nds}
    x |= {heldout_key(a, "cos"): 0.3 for a in nds} | {heldout_key(a + EXCHANGEABLE, "cos"): 0.3 for a in nds}
    # ... and under the own batch's H, where only the own direction is coupled to it (here: not at all)
    x |= {
        f"paired_nds_{a}{EXCHANGEABLE}_hidden": x[f"paired_nds_{a}_hidden"] * np.exp(rng.normal(0, 0.02)) for a in nds
    }
    x |= {"paired_cos_hp_twin_hidden": 0.3, f"paired_cos_{own}_hidden": 0.3 * hp}
    if injected:
        x |= {injected_key(r): r * (1 + rng.normal(0, 1e-7)) for r in INJECTED_RATIOS}
    x |= {"control_lambda_max": 50.0, "control_preconditioned_sharpness": 30.0, "control_edge_of_stability": 38 / 0.004,
          "control_two_over_lr": 2 / 0.004}  # fmt: skip
    return x


def _synthetic(seed=0, seeds=5, **kw):
    rng = np.random.default_rng(seed)
    records = [
        record("adamw/muon", s, [_point(rng, "adamw", **kw) for _ in range(4)], [_point(rng, "muon", **kw) for _ in range(4)])
        for s in range(seeds)
    ]  # fmt: skip
    return level_data(records, s_values=(0.0,))


def test_every_control_passes_on_points_with_the_null_and_the_known_answers():
    entries = controls(_synthetic())
    assert [e.name for e in entries if e.arm == "adamw"] == list(CONTROL_NAMES)
    assert [e.name for e in entries if e.arm == "muon"] == list(CONTROL_NAMES)
    judged = [e for e in entries if not e.descriptive]
    assert all(e.passed is True for e in judged), [(e.name, e.arm, e.value, e.ci95) for e in judged if not e.passed]
    hp = [e for e in entries if e.descriptive]
    assert {e.name for e in hp} == {"hyperparameter_twin"} and all(e.passed is None for e in hp)
    assert [e.detail["cos_ratio"] for e in hp] == [pytest.approx(1.01), pytest.approx(1.01)]  # the nudge's alignment
    held = next(e for e in entries if e.name == "held_out_batch" and e.arm == "adamw/muon")
    assert held.value == pytest.approx(6.0, rel=0.1) and held.n_seeds == 5 and held.n_points == 40
    for e in entries:
        if e.name == "exchangeable_twin" or (e.name == "held_out_batch" and e.arm != "adamw/muon"):
            assert e.band == [0.9, pytest.approx(1 / 0.9)] and e.p_equivalence < 0.05
            assert e.n_points == (40 if e.arm == "coupling" else 20)  # every analysed point of its arm
    sgd = next(e for e in entries if e.name == "sgd_direction" and e.arm == "muon")
    assert sgd.value == pytest.approx(20.0, rel=1e-9)
    for e in (e for e in entries if e.name.startswith("injected")):
        assert e.detail["recovered"] and e.detail["detected"]
    context = {(e.arm, e.quantity): e for e in stability(_synthetic())}
    assert context[("adamw", "sharpness_over_edge")].value == pytest.approx(30 / (38 / 0.004))
    assert context[("muon", "nds_muon_over_lambda_max")].value == pytest.approx(1 / 50, rel=0.1)


@pytest.mark.parametrize(
    "change, failing",
    [
        ({"twin": 1.01}, "twin_shadow"),
        ({"exchangeable": 1.3}, "exchangeable_twin"),  # a twin that differs (a lag, a bug)
        ({"exchangeable": 1.15}, "exchangeable_twin"),  # just outside the band
        ({"heldout": 1.5}, "held_out_batch"),
        ({"sgd": 0.5}, "sgd_direction"),
    ],
)
def test_a_control_fails_when_its_answer_is_off(change, failing):
    entries = controls(_synthetic(**change))
    failed = {e.name for e in entries if e.passed is False}
    assert failing in failed
    assert failed <= {failing, "held_out_batch"}  # (a held-out shift moves the per-arm entries only)
    assert all(e.passed is None for e in entries if e.name == "hyperparameter_twin")  # descriptive: never fails


def test_controls_without_their_scalars_are_not_measured_never_passed():
    bare = [{"paired_nds_adamw_hidden": 2.0, "paired_nds_muon_hidden": 1.0} for _ in range(3)]
    data = level_data([record("adamw/muon", s, bare, bare) for s in range(3)], s_values=(0.0,))
    entries = controls(data)
    assert all(e.passed is None and e.value is None for e in entries)
    assert all(e.value is None for e in stability(data))


def test_twins_resume_bit_for_bit_and_a_run_without_them_is_refused(controlled_run, tmp_path, monkeypatch):
    _, run, cfg = controlled_run
    cut = replace(cfg, out=str(tmp_path / "cut"))
    put_back = crash_training_after(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        train(cut, progress=False)
    put_back()
    assert train(cut, progress=False).resumed_from == 3
    whole, resumed = (load_checkpoint(_checkpoint(Path(d), STEPS)) for d in (run, tmp_path / "cut"))
    assert_same(whole["controls"], resumed["controls"])
    plain = replace(cfg, out=str(tmp_path / "plain"), controls=False)
    put_back = crash_training_after(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        train(plain, progress=False)
    put_back()
    with pytest.raises(CurvlabError, match="control"):
        train(replace(plain, controls=True), progress=False)


def test_a_tracked_checkpoint_that_is_also_a_window_member_keeps_the_trajectorys_controls():
    """The window member's scalars stand; the controls only the trajectory analysis took join them."""
    from curvlab.studies.records import analysed_points
    from tests.synthetic import track

    member = {"paired_nds_adamw_hidden": 2.0, "paired_nds_muon_hidden": 1.0}
    data = level_data([record("adamw/muon", 0, [member], [member])], s_values=(0.0,))
    t = track("adamw", 0.0, 0, np.array([1.0]))  # one row at step 10: the AdamW window member's step
    row = replace(t.rows[0], optimizer="adamw", paired={"paired_nds_adamw_hidden": 9.0, "control_lambda_max": 5.0})
    data.tracks.append(replace(t, rows=[row]))
    points = analysed_points(data.comparisons[0], data)
    merged = points[("adamw", 10)]
    assert merged.paired["paired_nds_adamw_hidden"] == 2.0 and merged.paired["control_lambda_max"] == 5.0


def test_an_exchangeable_twin_on_the_own_batch_is_the_own_direction_exactly(controlled_run):
    """With its batch the own batch, the twin is the own step, bit for bit (so its ratio is exactly 1), and
    nothing of the optimizer, the shadow or the model changes; on the next batch it differs."""
    from curvlab.analysis.controls import exchangeable_twins

    _, run, _ = controlled_run
    target = open_checkpoint(_checkpoint(run, STEPS - 1), batches=2)
    model = target.model
    model.eval()
    loss_fn = make_loss_fn(model)
    before = ({n: p.detach().clone() for n, p in model.named_parameters()}, copy.deepcopy(target.shadow.state_dict()))
    state = [v.clone() for s in target.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    G, Z = next_update(model, target.optimizer, loss_fn, target.train_batches[0], max_grad_norm=target.grad_clip)
    _, _, own = counterfactual_directions(model, target.optimizer, G, Z, ["adamw", "muon"], shadow=target.shadow)
    clip = {"max_grad_norm": target.grad_clip}
    same = exchangeable_twins(model, target.optimizer, loss_fn, target.train_batches[0], target.shadow, **clip)
    other = exchangeable_twins(model, target.optimizer, loss_fn, target.train_batches[1], target.shadow, **clip)
    assert [d.name for d in same] == ["adamw_exchangeable", "muon_exchangeable"]
    for a, b, c in zip(own, same, other):
        assert all(torch.equal(a.z[n], b.z[n]) for n in a.z)
        assert any(not torch.equal(a.z[n], c.z[n]) for n in target.shadow.names)
    assert_same(before[0], {n: p.detach() for n, p in model.named_parameters()})
    assert_same(before[1], target.shadow.state_dict())
    after = [v for s in target.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    assert len(state) == len(after) and all(torch.equal(a, b) for a, b in zip(state, after))
