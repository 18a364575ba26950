import io
import json
from dataclasses import replace

import pytest
import torch
from typer.testing import CliRunner

from curvlab.cli import app
from curvlab.errors import CurvlabError
from curvlab.optim.muon import Muon
from curvlab.runs.checkpoint import load_checkpoint, read_index
from curvlab.runs.train import build_run, train
from curvlab.steps.shadow import ShadowSettings, ShadowState, build_shadow
from tests.builders import crash_training_after, shadow_config, train_losses
from tests.reference import assert_same


def last_checkpoint(out):
    return load_checkpoint(out / read_index(out)[-1]["path"])


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_shadow_changes_nothing_and_resumes_bit_for_bit(pcfg_data, tmp_path, monkeypatch, optimizer):
    plain = shadow_config(pcfg_data, tmp_path / "plain", optimizer=optimizer)
    train(plain, progress=False)
    shadowed = replace(plain, out=str(tmp_path / "shadow"), shadow=True)
    train(shadowed, progress=False)
    cut = replace(shadowed, out=str(tmp_path / "cut"))
    put_back = crash_training_after(monkeypatch, 6)
    with pytest.raises(KeyboardInterrupt):
        train(cut, progress=False)
    put_back()
    assert train(cut, progress=False).resumed_from == 4

    a, b, c = (last_checkpoint(tmp_path / name) for name in ("plain", "shadow", "cut"))
    assert "shadow" not in a
    assert_same((a["model"], a["optimizer"]), (b["model"], b["optimizer"]))  # the run is the run without it
    assert_same((b["model"], b["optimizer"], b["shadow"]), (c["model"], c["optimizer"], c["shadow"]))  # resumed
    assert train_losses(tmp_path / "plain") == train_losses(tmp_path / "shadow") == train_losses(tmp_path / "cut")

    shadow = b["shadow"]
    kind = {"adamw": "muon", "muon": "adamw"}[optimizer]
    assert shadow["settings"]["kind"] == kind
    assert shadow["settings"]["lr"] == {"muon": 0.02, "adamw": 0.0018}[kind]
    hidden = [n for n in b["model"] if ".h." in n and b["model"][n].dim() == 2]
    assert shadow["names"] == hidden and set(shadow["state"]) == set(hidden)
    if kind == "adamw":
        assert all(float(s["step"]) == 10 for s in shadow["state"].values())
        assert all(s["exp_avg_sq"].min() >= 0 and s["exp_avg"].abs().sum() > 0 for s in shadow["state"].values())
    else:
        assert all(s["momentum_buffer"].abs().sum() > 0 for s in shadow["state"].values())


def test_resuming_a_run_without_a_shadow_with_one_is_refused(pcfg_data, tmp_path):
    cfg = shadow_config(pcfg_data, tmp_path / "r", optimizer="adamw", steps=4)
    train(cfg, progress=False)
    with pytest.raises(CurvlabError, match="shadow: False -> True"):
        train(replace(cfg, steps=8, shadow=True), progress=False)


def test_an_old_config_without_the_shadow_fields_still_resumes(pcfg_data, tmp_path):
    cfg = shadow_config(pcfg_data, tmp_path / "r", optimizer="adamw", steps=4)
    train(cfg, progress=False)
    path = tmp_path / "r" / "config.json"
    saved = json.loads(path.read_text())
    del saved["shadow"], saved["shadow_options"]  # as written before the fields existed
    path.write_text(json.dumps(saved))
    assert train(cfg, progress=False).resumed_from == 4


def gradient_sequence(shapes, n, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [{k: torch.randn(s, generator=gen, dtype=dtype) for k, s in shapes.items()} for _ in range(n)]


SHAPES = {"wide": (6, 10), "tall": (10, 6)}


@pytest.mark.parametrize("polar", ["newton_schulz", "svd"])
def test_shadow_muon_is_a_real_muon(polar):
    """After the same gradients, the shadow's momentum is curvlab Muon's, bit for bit, and its step on the
    next gradient is Muon's W - W_next (weight decay and a schedule multiplier included)."""
    gen = torch.Generator().manual_seed(1)
    W = {k: torch.randn(s, generator=gen, dtype=torch.float64) for k, s in SHAPES.items()}
    params = {k: torch.nn.Parameter(w.clone()) for k, w in W.items()}
    real = Muon(list(params.values()), lr=0.02 * 0.5, weight_decay=0.1, polar=polar)
    settings = ShadowSettings.for_kind("muon", weight_decay=0.1, polar=polar)
    shadow = ShadowState(settings, SHAPES)
    *past, nxt = gradient_sequence(SHAPES, 4)
    for grads in past:
        for k, p in params.items():
            p.grad = grads[k].clone()
        real.step()
        shadow.update(grads)
    for k, p in params.items():
        assert torch.equal(shadow.state[k]["momentum_buffer"], real.state[p]["momentum_buffer"])
    here = {k: p.detach().clone() for k, p in params.items()}
    Z = shadow.direction(nxt, here, multiplier=0.5)
    for k, p in params.items():
        p.grad = nxt[k].clone()
    real.step()
    for k, p in params.items():
        torch.testing.assert_close(Z[k], here[k] - p.detach(), rtol=1e-9, atol=1e-14)
        assert Z[k].dtype == torch.float64
    for k, p in params.items():  # direction() leaves the shadow's own state as it was
        assert not torch.equal(shadow.state[k]["momentum_buffer"], real.state[p]["momentum_buffer"])


def test_shadow_adam_is_torch_adamw():
    """After the same gradients, the shadow's m, v and step are torch.optim.AdamW's, bit for bit, and its
    step on the next gradient is AdamW's W - W_next at the same lr."""
    gen = torch.Generator().manual_seed(2)
    W = {k: torch.randn(s, generator=gen, dtype=torch.float64) for k, s in SHAPES.items()}
    params = {k: torch.nn.Parameter(w.clone()) for k, w in W.items()}
    real = torch.optim.AdamW(list(params.values()), lr=0.0018 * 0.25, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    shadow = ShadowState(ShadowSettings.for_kind("adamw", weight_decay=0.01), SHAPES)
    *past, nxt = gradient_sequence(SHAPES, 5, seed=3)
    for grads in past:
        for k, p in params.items():
            p.grad = grads[k].clone()
        real.step()
        shadow.update(grads)
    for k, p in params.items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(shadow.state[k][key], real.state[p][key]), key
    here = {k: p.detach().clone() for k, p in params.items()}
    Z = shadow.direction(nxt, here, multiplier=0.25)
    for k, p in params.items():
        p.grad = nxt[k].clone()
    real.step()
    for k, p in params.items():
        torch.testing.assert_close(Z[k], here[k] - p.detach(), rtol=1e-9, atol=1e-15)


def test_shadow_payload_round_trip_and_bad_input():
    shadow = ShadowState(ShadowSettings.for_kind("adamw"), SHAPES)
    for grads in gradient_sequence(SHAPES, 2, dtype=torch.float32):
        shadow.update(grads)
    buffer = io.BytesIO()
    torch.save(shadow.state_dict(), buffer)
    buffer.seek(0)
    loaded = ShadowState.from_state_dict(torch.load(buffer, weights_only=True))
    assert loaded.settings == shadow.settings and loaded.shapes == shadow.shapes
    assert_same(loaded.state, shadow.state)
    other = ShadowState(ShadowSettings.for_kind("adamw", betas=(0.8, 0.9)), SHAPES)
    with pytest.raises(CurvlabError, match="settings"):
        other.load_state_dict(shadow.state_dict())
    with pytest.raises(CurvlabError, match="schema"):
        other.load_state_dict({**shadow.state_dict(), "schema_version": 99})
    with pytest.raises(CurvlabError, match="unknown shadow option"):
        ShadowSettings.for_kind("adamw", momentum=0.9)  # a Muon option
    with pytest.raises(CurvlabError, match="unknown shadow kind"):
        ShadowSettings.for_kind("lion")
    with pytest.raises(CurvlabError, match="polar"):
        ShadowSettings.for_kind("muon", polar="qr")


def test_build_shadow_refuses_an_optimizer_without_another_arm(pcfg_data, tmp_path):
    run = build_run(shadow_config(pcfg_data, tmp_path / "r", optimizer="adamw"))
    shadow = build_shadow("adamw", run.model)
    assert shadow.settings.kind == "muon" and all(".h." in n for n in shadow.names)
    with pytest.raises(CurvlabError, match="adamw and muon arms"):
        build_shadow("sgd", run.model)
    with pytest.raises(CurvlabError, match="adamw and muon arms"):
        build_run(shadow_config(pcfg_data, tmp_path / "s", optimizer="sgd", shadow=True))


def test_train_command_keeps_a_shadow_when_asked(pcfg_data, tmp_path):
    out = tmp_path / "run"
    args = ["train", "--data", str(pcfg_data), "--out", str(out), "--optimizer", "muon", "--steps", "2", "--quiet"]
    args += ["--model-opt", "n_layer=1", "--model-opt", "n_embd=16", "--model-opt", "block_size=16", "--shadow"]
    args += ["--batch-size", "4", "--ckpt-every", "2", "--warmup-steps", "1", "--val-windows", "4"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    ckpt = last_checkpoint(out)
    assert ckpt["config"]["shadow"] is True and ckpt["shadow"]["settings"]["kind"] == "adamw"
    assert all(float(s["step"]) == 2 for s in ckpt["shadow"]["state"].values())
