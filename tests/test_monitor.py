import json
import math
import shutil
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from torch.func import functional_call

from curvlab.curvature.groupings import group_parameters
from curvlab.curvature.scalars import SCOPE_KEYS
from curvlab.curvature.taylor import block_matrix, taylor_split
from curvlab.data.shards import TokenData, validation_batches
from curvlab.engine import params as param_dicts
from curvlab.engine.loss import ModuleLoss, make_loss_fn, token_cross_entropy, weighted_batches
from curvlab.errors import CurvlabError
from curvlab.models.gpt import GPT, GPTConfig, get_config
from curvlab.optim.build import build_optimizer
from curvlab.runs.checkpoint import load_checkpoint, read_index
from curvlab.runs.monitor import CurvatureMonitor, MonitorRow, MonitorSettings, NonFiniteCurvature
from curvlab.runs.train import train
from tests.builders import SMALL_MODEL, crash_training_after, hf_trainer, small_config, tiny_gpt2, token_data
from tests.reference import assert_same

DROPOUT_MODEL = {**SMALL_MODEL, "dropout": 0.1}  # dropout draws random numbers: a monitor that did would show
EVERY, BATCHES, WINDOWS = 2, 2, 4


def config(data, out, **kw):
    return small_config(
        data, out, **{"model_overrides": DROPOUT_MODEL, "steps": 6, "warmup_steps": 2, "ckpt_every": 1, **kw}
    )


SETTINGS = MonitorSettings(every=EVERY, batches=BATCHES, windows=WINDOWS, blocks="layer")


@pytest.fixture(scope="module")
def runs(pcfg_data, tmp_path_factory):
    """The same Muon run trained without and with the monitor (checkpoints at every step)."""
    root = tmp_path_factory.mktemp("monitor")
    train(config(pcfg_data, root / "plain"), progress=False)
    train(config(pcfg_data, root / "watched"), progress=False, monitor=SETTINGS)
    return root / "plain", root / "watched"


def lines(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def curvature_rows(run):
    return [MonitorRow.from_dict(r) for r in lines(run) if r.get("kind") == "curvature"]


def training_rows(run):
    return [r for r in lines(run) if "kind" not in r]


def without_out(config):
    return {k: v for k, v in config.items() if k != "out"}


def assert_same_run(a, b):
    """Same losses, same index, same checkpoints (every tensor, bit for bit), same config (but the
    output directory)."""
    assert training_rows(a) == training_rows(b)
    assert read_index(a) == read_index(b)
    assert without_out(json.loads((a / "config.json").read_text())) == without_out(
        json.loads((b / "config.json").read_text())
    )
    for entry in read_index(a):
        ckpt_a, ckpt_b = load_checkpoint(a / entry["path"]), load_checkpoint(b / entry["path"])
        ckpt_a["config"], ckpt_b["config"] = without_out(ckpt_a["config"]), without_out(ckpt_b["config"])
        assert_same(ckpt_a, ckpt_b)


def test_training_is_bit_identical_with_and_without_the_monitor(runs):
    plain, watched = runs
    assert_same_run(plain, watched)
    rows = curvature_rows(watched)
    assert [r.step for r in rows] == [0, 2, 4] and all(r.ok for r in rows)
    assert rows[0].heldout_tokens == BATCHES * WINDOWS * SMALL_MODEL["block_size"]


def checkpoint_step(run, step):
    """W_k and Z_k = W_k - W_{k+1} from two checkpoints, and the model they belong to."""
    now, nxt = (load_checkpoint(run / f"ckpt_{k:06d}.pt") for k in (step, step + 1))
    model = GPT(GPTConfig(**now["model_config"]))
    names = [n for n, _ in model.named_parameters()]
    W = {n: now["model"][n] for n in names}
    Z = {n: (now["model"][n].double() - nxt["model"][n].double()).float() for n in names}
    return model, W, Z


def heldout(data):
    """The monitor's held-out set, built independently: the first 8 validation windows in batches of 4."""
    return validation_batches(TokenData.open(data).val, WINDOWS, SMALL_MODEL["block_size"], BATCHES * WINDOWS)


def test_rows_equal_the_analysis_of_the_checkpoints(runs, pcfg_data):
    """Each row against the curvature of Z_k = W_k - W_{k+1} read from the checkpoints, with the
    block matrix by the other exact method (the Hessian in alpha)."""
    _, watched = runs
    D = heldout(pcfg_data)
    for row in curvature_rows(watched):
        model, W, Z = checkpoint_step(watched, row.step)
        loss_fn = make_loss_fn(model)
        ref = taylor_split(loss_fn, W, D, Z)
        bm = block_matrix(loss_fn, W, D, Z, blocks="layer", block_method="alpha")
        got = {**row.split.to_dict(), "loss": row.loss}
        want = {**{k: getattr(ref, k) for k in SCOPE_KEYS}, "loss": ref.loss}
        for k in got:
            assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-7 * abs(want["first_order"])), (row.step, k)
        for k in SCOPE_KEYS:
            assert getattr(row.hidden, k) == pytest.approx(getattr(ref.hidden, k), rel=1e-5, abs=1e-9), (row.step, k)
        assert row.hidden_names == ref.hidden_names
        assert row.blocks.names == bm.names
        scale = abs(bm.matrix).max()
        for k in ("within", "cross", "nds"):
            assert getattr(row.blocks, k) == pytest.approx(getattr(bm, k), abs=1e-4 * scale), (row.step, k)
        assert row.blocks.nds == pytest.approx(row.nds, abs=1e-5 * scale)


def finite_differences(loss, W, z, h):
    r"""(<G,z>, <z,Hz>) of t -> L(W - t z) by central differences at h and h/2, Richardson-extrapolated
    (error O(h^4)), in float64. At h = 0.02 along a real step they agree with the exact values to ~1e-8."""

    def f(t):
        return loss(param_dicts.add(W, z, -t))

    def slope_curvature(h):
        fp, f0, fm = f(h), f(0.0), f(-h)
        return -(fp - fm) / (2 * h), (fp - 2 * f0 + fm) / h**2

    (s1, c1), (s2, c2) = slope_curvature(h), slope_curvature(h / 2)
    return (4 * s2 - s1) / 3, (4 * c2 - c1) / 3


def test_row_against_float64_finite_differences():
    """A hand-written loop with the monitor in float64: I1, <Z,HZ>, the realized decrease, the hidden
    scope and the within/cross split against finite differences of the plain forward loss."""
    torch.manual_seed(0)
    model = GPT(get_config("tiny", **DROPOUT_MODEL, vocab_size=50)).double()
    optimizer = build_optimizer("muon", model, lr=0.05)
    tokens = torch.randint(0, 50, (12, 33))
    train_batches = [(tokens[i : i + 2, :-1], tokens[i : i + 2, 1:]) for i in (0, 2, 4)]
    D = [(tokens[6:9, :-1], tokens[6:9, 1:]), (tokens[9:12, :-1], tokens[9:12, 1:])]
    monitor = CurvatureMonitor(model, optimizer, make_loss_fn(model), D, every=2, blocks="layer")
    for step, (x, y) in enumerate(train_batches):
        before = monitor.snapshot() if monitor.due(step) else None
        token_cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if before is not None:
            monitor.measure_taken(step, before)
            W = before
            Z = {n: before[n] - p.detach() for n, p in model.named_parameters()}
    row = monitor.rows[-1]
    assert [r.step for r in monitor.rows] == [0, 2] and row.ok

    model.eval()  # the plain forward (fused LayerNorm, no dropout): independent of the curvature code

    def loss(params):
        with torch.no_grad():
            return sum(
                w * float(token_cross_entropy(functional_call(model, params, (b[0],)), b[1]))
                for b, w in weighted_batches(D)
            )

    zz = param_dicts.dot(Z, Z)
    gz, zhz = finite_differences(loss, W, Z, 0.02)
    assert row.split.first_order == pytest.approx(gz, rel=1e-6)
    assert row.split.curvature_penalty == pytest.approx(zhz / 2, rel=1e-6)
    assert row.nds == pytest.approx(zhz / zz, rel=1e-6)
    assert row.split.realized == pytest.approx(loss(W) - loss(param_dicts.add(W, Z, -1.0)), rel=1e-9)
    assert row.loss == pytest.approx(loss(W), rel=1e-12)
    assert row.split.update_norm == pytest.approx(zz**0.5, rel=1e-12)
    hidden = {n: Z[n] if n in row.hidden_names else torch.zeros_like(Z[n]) for n in Z}
    gz_s, zhz_s = finite_differences(loss, W, hidden, 0.02)
    assert row.hidden.first_order == pytest.approx(gz_s, rel=1e-6)
    assert row.hidden.nds == pytest.approx(zhz_s / param_dicts.dot(hidden, hidden), rel=1e-6)
    within = 0.0
    for members in group_parameters(W, blocks="layer").values():
        z_l = {n: Z[n] if n in members else torch.zeros_like(Z[n]) for n in Z}
        within += finite_differences(loss, W, z_l, 0.02)[1] / zz
    assert row.blocks.within == pytest.approx(within, rel=1e-6)
    assert row.blocks.cross == pytest.approx(zhz / zz - within, rel=1e-6)
    assert row.blocks.rho_within == pytest.approx(within / (zhz / zz), rel=1e-6)


def hand_loop(monitor_every: int | None, steps: int = 5):
    """A plain loop on a small GPT with dropout; with a monitor, every due step is measured twice:
    before it (the step the optimizer would take on the batch) and after (the step taken)."""
    torch.manual_seed(1)
    model = GPT(get_config("tiny", **DROPOUT_MODEL, vocab_size=60))
    optimizer = build_optimizer("adamw", model, lr=0.01)
    g = torch.Generator().manual_seed(2)
    D = (torch.randint(0, 60, (4, 32), generator=g), torch.randint(0, 60, (4, 32), generator=g))
    monitor = None
    if monitor_every:
        monitor = CurvatureMonitor(model, optimizer, make_loss_fn(model), D, every=monitor_every, max_grad_norm=0.5)
    losses, pairs = [], []
    for step in range(steps):
        x, y = (torch.randint(0, 60, (4, 32), generator=g) for _ in range(2))
        would = monitor.measure_next(step, (x, y)) if monitor and monitor.due(step) else None
        before = monitor.snapshot() if would is not None else None
        loss = token_cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if before is not None:
            pairs.append((would, monitor.measure_taken(step, before)))
    return losses, model.state_dict(), optimizer.state_dict(), pairs


def test_the_step_it_would_take_is_the_step_taken_and_changes_nothing():
    losses, weights, state, _ = hand_loop(None)
    losses_m, weights_m, state_m, pairs = hand_loop(2)
    assert losses_m == losses
    assert_same((weights_m, state_m), (weights, state))
    assert [(a.step, b.step) for a, b in pairs] == [(0, 0), (2, 2), (4, 4)]
    for would, taken in pairs:  # same Z (dropout masks, clipping and all), so the same row
        assert would.ok and replace(would, seconds=0.0) == replace(taken, seconds=0.0)


def poisoned_loss_factory(poison):
    def factory(model):
        return ModuleLoss(model, lambda logits, y: token_cross_entropy(logits, y) * poison[0])

    return factory


def poison_second_snapshot(monkeypatch):
    """The monitor's held-out loss becomes inf for the second measured step only."""
    poison, calls = [1.0], []
    real_snapshot = CurvatureMonitor.snapshot

    def snapshot(self):
        calls.append(1)
        poison[0] = math.inf if len(calls) == 2 else 1.0
        return real_snapshot(self)

    monkeypatch.setattr("curvlab.runs.monitor.make_loss_fn", poisoned_loss_factory(poison))
    monkeypatch.setattr(CurvatureMonitor, "snapshot", snapshot)


def test_non_finite_curvature_is_recorded_and_training_goes_on(runs, pcfg_data, tmp_path, monkeypatch):
    plain, _ = runs
    poison_second_snapshot(monkeypatch)
    train(config(pcfg_data, tmp_path / "nan"), progress=False, monitor=replace(SETTINGS, blocks=None))
    assert_same_run(plain, tmp_path / "nan")
    rows = curvature_rows(tmp_path / "nan")
    assert [(r.step, r.status) for r in rows] == [(0, "ok"), (2, "non-finite"), (4, "ok")]
    assert rows[1].message == "the held-out loss L(W) is inf"
    assert math.isnan(rows[1].nds) and rows[1].blocks is None


def test_non_finite_curvature_stops_training_when_asked(pcfg_data, tmp_path, monkeypatch):
    poison_second_snapshot(monkeypatch)
    with pytest.raises(NonFiniteCurvature, match="non-finite curvature at step 2 .*L\\(W\\) is inf"):
        stop = replace(SETTINGS, blocks=None, stop_on_nonfinite=True)
        train(config(pcfg_data, tmp_path / "stop", steps=4), progress=False, monitor=stop)
    assert [r.status for r in curvature_rows(tmp_path / "stop")] == ["ok", "non-finite"]
    assert read_index(tmp_path / "stop")[-1]["step"] == 2  # the step after the bad row was not saved


def test_bad_steps_give_rows_that_say_so():
    torch.manual_seed(0)
    model = GPT(get_config("tiny", **SMALL_MODEL, vocab_size=40))
    D = (torch.randint(0, 40, (2, 32)), torch.randint(0, 40, (2, 32)))
    monitor = CurvatureMonitor(model, None, make_loss_fn(model), D)
    W = monitor.snapshot()
    Z = {n: torch.full_like(p, 1e-3) for n, p in W.items()}
    Z["lm_head.weight"][0, 0] = math.nan
    row = monitor.measure(7, W, Z)
    assert (row.status, row.message) == ("non-finite", "the step Z holds NaN or inf (in lm_head.weight)")
    row = monitor.measure(8, W, param_dicts.zeros_like(W))
    assert row.status == "undefined" and "zero" in row.message
    assert [r.step for r in monitor.rows] == [7, 8]
    assert MonitorRow.from_dict(json.loads(json.dumps(row.to_dict()))).message == row.message
    with pytest.raises(ValueError, match="unknown block grouping"):
        CurvatureMonitor(model, None, make_loss_fn(model), D, blocks="layers")
    with pytest.raises(ValueError, match="needs the optimizer"):
        monitor.measure_next(0, D)
    with pytest.raises(ValueError, match="not a curvature row"):
        MonitorRow.from_dict({"step": 1, "train_loss": 2.0})
    with pytest.raises(CurvlabError, match="^curvature row schema 2 is not 1$"):
        MonitorRow.from_dict({**row.to_dict(), "schema_version": 2})


def test_resumed_monitored_run_equals_an_uninterrupted_one(runs, pcfg_data, tmp_path, monkeypatch):
    """Crash after step 5: the row of step 4 (written after step 5) is past the last checkpoint, 4,
    and must be measured again on resume, not kept twice."""
    _, watched = runs
    cfg = config(pcfg_data, tmp_path / "cut", ckpt_every=2)
    restore_loader = crash_training_after(monkeypatch, 5)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, progress=False, monitor=SETTINGS)
    restore_loader()
    assert [r.step for r in curvature_rows(tmp_path / "cut")] == [0, 2, 4]
    assert train(cfg, progress=False, monitor=SETTINGS).resumed_from == 4

    def losses(run):
        return [r["train_loss"] for r in training_rows(run)]

    def without_time(rows):
        return [replace(r, seconds=0.0) for r in rows]

    assert losses(tmp_path / "cut") == losses(watched)
    assert without_time(curvature_rows(tmp_path / "cut")) == without_time(curvature_rows(watched))


def test_track_draws_the_rows_without_checkpoints(runs, tmp_path):
    from typer.testing import CliRunner

    from curvlab.cli import app

    _, watched = runs
    run = tmp_path / "rows-only"
    run.mkdir()
    for name in ("metrics.jsonl", "config.json"):
        shutil.copy(watched / name, run / name)
    r = CliRunner().invoke(app, ["track", str(run), "--quiet"])
    assert r.exit_code == 0, r.output
    track = json.loads((run / "track" / "track.json").read_text())
    assert track["source"] == "monitor"
    rows = curvature_rows(watched)
    assert [t["step"] for t in track["rows"]] == [0, 2, 4]
    for t, row in zip(track["rows"], rows):
        assert (t["nds"], t["hidden_nds"], t["within"], t["rho_within"]) == (
            row.nds,
            row.hidden.nds,
            row.blocks.within,
            row.blocks.rho_within,
        )
    val = {r["step"]: r["val_loss"] for r in training_rows(watched) if "val_loss" in r}
    assert [t["val_loss"] for t in track["rows"][1:]] == [val[2], val[4]]
    assert math.isnan(track["rows"][0]["val_loss"])  # step 0's validation loss lives in the (absent) index
    assert (run / "track" / "curvature_during_training.png").stat().st_size > 0
    assert (run / "track" / "track.csv").read_text().count("\n") == 4
    r = CliRunner().invoke(app, ["track", str(run), "--source", "checkpoints"])
    assert r.exit_code == 2 and "no checkpoints (index.json is missing or empty)" in r.output


def test_train_command_records_curvature(pcfg_data, tmp_path):
    from typer.testing import CliRunner

    from curvlab.cli import app

    out = tmp_path / "cli"
    args = ["train", "--data", str(pcfg_data), "--out", str(out), "--steps", "4", "--batch-size", "4", "--quiet"]
    args += ["--warmup-steps", "1"]
    args += [f"--model-opt={k}={v}" for k, v in SMALL_MODEL.items()]
    args += ["--val-windows", "8", "--curvature-every", "3", "--curvature-batches", "2", "--curvature-windows", "4"]
    args += ["--blocks", "kind"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    rows = curvature_rows(out)
    assert [r.step for r in rows] == [0, 3] and rows[0].blocks.grouping == "kind"
    assert rows[0].heldout_tokens == 2 * 4 * SMALL_MODEL["block_size"]
    args[args.index(str(out))] = str(tmp_path / "too-many")
    r = CliRunner().invoke(app, [*args, "--curvature-batches", "3"])
    assert r.exit_code == 2 and "need 12 validation windows; the run has 8" in r.output


def test_import_curvlab_does_not_import_transformers():
    code = "import sys, curvlab, curvlab.runs.monitor, curvlab.runs.train; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def run_trainer(out, every):
    """Four steps of a real ``transformers.Trainer`` on a tiny GPT-2 (dropout on, built from a config),
    recording W after every step; with ``every``, the curvature callback measures every ``every`` steps."""
    from transformers import TrainerCallback

    from curvlab.runs.monitor import trainer_curvature_callback

    class Recorder(TrainerCallback):
        def __init__(self):
            self.weights = []

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.weights.append({n: p.detach().clone() for n, p in model.named_parameters()})

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.weights.append({n: p.detach().clone() for n, p in model.named_parameters()})

    torch.manual_seed(0)
    model = tiny_gpt2(resid_pdrop=0.1, embd_pdrop=0.1)
    g = torch.Generator().manual_seed(0)
    data = token_data(torch.randint(0, 64, (16, 16), generator=g))
    ids = torch.randint(0, 64, (4, 16), generator=g)
    recorder, monitor = Recorder(), None
    callbacks = [recorder]
    if every:
        monitor = CurvatureMonitor(model, None, make_loss_fn(model), {"input_ids": ids, "labels": ids}, every=every)
        callbacks.append(trainer_curvature_callback(monitor))
    trainer = hf_trainer(
        model, out, data, callbacks, max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1,
        save_strategy="no",
    )  # fmt: skip
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, recorder.weights, monitor, make_loss_fn(model), {"input_ids": ids, "labels": ids}


def test_trainer_callback_measures_the_steps_the_trainer_takes(tmp_path):
    losses, weights, _, _, _ = run_trainer(tmp_path / "plain", None)
    losses_m, weights_m, monitor, loss_fn, D = run_trainer(tmp_path / "watched", 2)
    assert len(losses) == 4 and losses_m == losses
    assert_same(weights_m, weights)  # the callback changes nothing in training
    assert [r.step for r in monitor.rows] == [0, 2] and all(r.ok for r in monitor.rows)
    for row in monitor.rows:
        W, after = weights[row.step], weights[row.step + 1]
        ref = taylor_split(loss_fn, W, D, {n: (W[n].double() - after[n].double()).float() for n in W})
        for k in SCOPE_KEYS:
            assert getattr(row.split, k) == pytest.approx(getattr(ref, k), rel=1e-6), (row.step, k)
            assert getattr(row.hidden, k) == pytest.approx(getattr(ref.hidden, k), rel=1e-6), (row.step, k)
