"""Phase-matched pairing on synthetic runs: an index of validation losses and a config with a known
schedule (no checkpoint files are needed to match)."""

import json

import numpy as np
import pytest

from curvlab.runs.config import TrainConfig
from curvlab.runs.match import MatchCriteria, match_runs, plateau_ceiling, run_checkpoints
from curvlab.runs.schedule import lr_multiplier


def make_run(path, losses, schedule="wsd", steps=100, warmup=10, lr=0.01, every=2):
    """A run directory whose checkpoints (every ``every`` steps) have validation loss ``losses(step)``."""
    path.mkdir(parents=True)
    cfg = TrainConfig(data="nowhere", out=str(path), optimizer="adamw", optimizer_options={"lr": lr}, steps=steps,
                      warmup_steps=warmup, schedule=schedule, cooldown_frac=0.2)  # fmt: skip
    (path / "config.json").write_text(json.dumps(cfg.to_dict()))
    index = [{"step": k, "val_loss": float(losses(k)), "path": f"ckpt_{k:06d}.pt"} for k in range(0, steps + 1, every)]
    (path / "index.json").write_text(json.dumps(index))
    return path, cfg


def fast(k):
    return 3.0 + 4.0 * np.exp(-k / 40)


def slow(k):
    return 3.0 + 4.0 * np.exp(-k / 100)


def test_checkpoints_carry_their_schedule(tmp_path):
    run, cfg = make_run(tmp_path / "a", fast)
    cks = run_checkpoints(run)
    for c in cks:
        assert c.multiplier == lr_multiplier(c.step, cfg) and c.lr == pytest.approx(0.01 * c.multiplier)
    assert {c.phase for c in cks if c.step < 10} == {"warmup"}
    assert {c.phase for c in cks if 10 <= c.step < 80} == {"stable"}
    assert {c.phase for c in cks if c.step >= 80} == {"decay"}


def test_stable_phase_pairs_only_stable_checkpoints_within_tolerance(tmp_path):
    a, _ = make_run(tmp_path / "fast", fast)
    b, _ = make_run(tmp_path / "slow", slow)
    m = match_runs(b, a, levels=6, tolerance=0.01, phase="stable", window_width=1)
    assert len(m.pairs) >= 3 and m.phase == "stable"  # windows may not overlap: the slow run's 20 steps hold 3
    for p in m.pairs:
        assert p.a.multiplier == 1.0 and p.b.multiplier == 1.0
        assert 10 <= p.a.step < 80 and 10 <= p.b.step < 80
        assert p.mismatch <= 0.01
        assert p.target == pytest.approx((p.a.val_loss + p.b.val_loss) / 2)
        assert all(c.phase == "stable" for c in p.window_a + p.window_b)
        assert [c.step for c in p.window_b] == [p.b.step - 2, p.b.step, p.b.step + 2] or p.b.step in (10, 78)
    for side in ("a", "b"):  # no checkpoint is the centre of two levels
        assert len({getattr(p, side).step for p in m.pairs}) == len(m.pairs)
    # "any" pairs the slow run's decay-phase checkpoints with the fast run's stable ones: the confound
    anywhere = match_runs(b, a, levels=6, tolerance=0.01, phase="any")
    assert any(p.a.multiplier < 1.0 for p in anywhere.pairs)


def test_windows_share_no_checkpoint(tmp_path):
    # many levels on a short stable phase crowd the windows: none may hold a checkpoint of another's
    a, _ = make_run(tmp_path / "fast", fast)
    b, _ = make_run(tmp_path / "slow", slow)
    for width in (1, 2):
        m = match_runs(b, a, levels=12, tolerance=0.02, phase="stable", window_width=width)
        assert len(m.pairs) >= 3
        for side in ("window_a", "window_b"):
            steps = [c.step for p in m.pairs for c in getattr(p, side)]
            assert len(steps) == len(set(steps)), (width, side, sorted(steps))
        # the crowding is real: centres alone (width 0) would have packed more levels in
        assert len(m.pairs) < len(match_runs(b, a, levels=12, tolerance=0.02, phase="stable").pairs)


def test_equal_multiplier_pairs(tmp_path):
    a, _ = make_run(tmp_path / "fast", fast)
    b, _ = make_run(tmp_path / "slow", slow)
    m = match_runs(b, a, levels=12, tolerance=0.02, phase="multiplier")
    assert m.pairs
    for p in m.pairs:
        assert abs(p.a.multiplier - p.b.multiplier) <= 0.02 * max(p.a.multiplier, p.b.multiplier)


def test_plateau_levels_are_flagged_and_not_targeted(tmp_path):
    a, _ = make_run(tmp_path / "fast", fast)
    b, _ = make_run(tmp_path / "slow", slow)
    ceiling = plateau_ceiling(6.0)  # losses >= 5.7 are on the plateau
    assert ceiling == pytest.approx(5.7)
    m = match_runs(b, a, levels=6, tolerance=0.01, phase="stable", plateau_ceiling=ceiling)
    assert m.pairs and all(p.target < ceiling and not p.on_plateau for p in m.pairs)
    explicit = match_runs(b, a, levels=[5.9, 5.0], tolerance=0.01, phase="stable", plateau_ceiling=ceiling)
    assert [p.on_plateau for p in explicit.pairs] == [True, False]


def test_a_run_without_a_stable_phase_is_refused(tmp_path):
    a, _ = make_run(tmp_path / "fast", fast)
    b, _ = make_run(tmp_path / "cosine", slow, schedule="cosine")
    with pytest.raises(ValueError, match="never reaches a stable phase"):
        match_runs(b, a, phase="stable")
    assert match_runs(b, a, levels=4, tolerance=0.01, phase="any").pairs  # the old behaviour, on request


def test_runs_with_no_overlap_in_the_stable_phase_are_refused(tmp_path):
    a, _ = make_run(tmp_path / "fast", fast)
    b, _ = make_run(tmp_path / "stuck", lambda k: 9.0 - 0.001 * k)  # never comes near the other's losses
    with pytest.raises(ValueError, match="never overlap in the stable phase"):
        match_runs(b, a, phase="stable")


def test_a_range_wholly_on_the_plateau_gives_no_level_and_says_why(tmp_path):
    a, _ = make_run(tmp_path / "fast", fast)
    b, _ = make_run(tmp_path / "slow", slow)
    m = match_runs(b, a, levels=4, phase="stable", plateau_ceiling=3.0)
    assert m.pairs == [] and "unigram plateau" in m.refused[0]


def test_unknown_phase_and_missing_schedule(tmp_path):
    a, _ = make_run(tmp_path / "fast", fast)
    with pytest.raises(ValueError, match="unknown phase"):
        match_runs(a, a, phase="late")
    (a / "config.json").unlink()
    with pytest.raises(ValueError, match="schedule is unknown"):
        match_runs(a, a, phase="stable")
    assert match_runs(a, a, levels=3, phase="any").pairs


def test_a_sparse_run_does_not_lend_one_checkpoint_to_several_levels(tmp_path):
    a, _ = make_run(tmp_path / "fast", fast, every=20)  # few checkpoints where a dense run has many
    b, _ = make_run(tmp_path / "slow", slow, every=2)
    m = match_runs(b, a, levels=8, tolerance=0.05, phase="stable")
    steps = [p.b.step for p in m.pairs]
    assert steps and len(set(steps)) == len(steps)
    assert len(m.refused) == 8 - len(m.pairs)


def test_runs_trained_with_the_defaults_match_under_the_default_criteria(tmp_path):
    """`curvlab train`'s defaults (wsd, checkpoints every ckpt_every steps) give `curvlab compare`'s
    defaults (MatchCriteria: stable phase, 8 levels) what they need: stable checkpoints enough for a
    level each, and pairs. The runs are synthetic (index and config as `train` writes them), the faster
    one reaching the slower one's losses at 3/4 of its steps."""
    defaults, criteria = TrainConfig(data="nowhere", out="x"), MatchCriteria()
    runs = {}
    for name, scale in (("muon", 120), ("adamw", 160)):
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps({**defaults.to_dict(), "out": str(path), "optimizer": name}))
        steps = range(0, defaults.steps + 1, defaults.ckpt_every)
        index = [{"step": k, "val_loss": 3.0 + 4.0 * np.exp(-k / scale), "path": f"ckpt_{k:06d}.pt"} for k in steps]
        (path / "index.json").write_text(json.dumps(index))
        stable = [c for c in run_checkpoints(path) if c.phase == "stable"]
        assert len(stable) >= criteria.levels  # windows share no checkpoint: each level needs its own
        runs[name] = path
    m = match_runs(
        runs["adamw"],
        runs["muon"],
        criteria.levels,
        criteria.tolerance,
        phase=criteria.phase,
        window_width=criteria.window,
    )
    assert m.pairs and all(p.a.phase == p.b.phase == "stable" for p in m.pairs)
    assert {(p.a.step, p.b.step) for p in m.pairs} >= {(200, 150), (400, 300)}  # the exact matches
