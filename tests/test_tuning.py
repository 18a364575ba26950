import dataclasses
import json
import math

import numpy as np
import pytest

from curvlab.jobs.presets import PRESETS
from curvlab.studies.tuning import LrSearch, log2_grid, search_lr
from curvlab.util import schema


def bowl(best: float, noise: float = 0.0):
    """A fake final loss, quadratic in log2(lr) with its minimum at ``best``; ``noise`` per seed."""
    calls = []

    def objective(lr, seed):
        calls.append((lr, seed))
        return 3.0 + 0.1 * (math.log2(lr) - math.log2(best)) ** 2 + noise * (seed - 0.5)

    return objective, calls


def test_log2_grid():
    assert log2_grid(0.004, 5) == [0.001, 0.002, 0.004, 0.008, 0.016]
    assert log2_grid(0.02, 2) == [0.01, 0.02]
    with pytest.raises(ValueError, match="log2 grid"):
        log2_grid(0.0, 5)


def test_an_interior_optimum_needs_no_extension():
    objective, calls = bowl(0.004)
    result = search_lr(objective, log2_grid(0.004, 5), seeds=[0, 1])
    assert result.chosen == 0.004 and result.extended == [] and not result.at_edge
    assert len(calls) == 10 and sorted({s for _, s in calls}) == [0, 1]


@pytest.mark.parametrize(
    "best, expected_extension", [(0.05, [0.032, 0.064, 0.128]), (0.0003, [0.0005, 0.00025, 0.000125])]
)
def test_the_grid_grows_while_the_best_point_sits_at_an_edge(best, expected_extension):
    objective, _ = bowl(best)
    result = search_lr(objective, log2_grid(0.004, 5), seeds=[0, 1], max_extensions=4)
    assert result.extended == expected_extension
    assert result.chosen == pytest.approx(expected_extension[-2], rel=1e-6)  # one past it came back worse
    assert not result.at_edge
    assert len(result.grid) == 8 and all(len(v) == 2 for v in result.grid.values())


def test_the_extension_budget_is_respected_and_an_edge_winner_is_flagged():
    objective, _ = bowl(10.0)
    result = search_lr(objective, log2_grid(0.004, 5), seeds=[0], max_extensions=2)
    assert result.extended == [0.032, 0.064] and result.chosen == 0.064 and result.at_edge


def test_a_diverged_point_scores_infinity_and_ends_an_upward_extension():
    def objective(lr, seed):
        return math.inf if lr > 0.01 else 3.0 - lr  # better and better up to where it blows up

    result = search_lr(objective, log2_grid(0.004, 5), seeds=[0, 1])
    assert result.chosen == 0.008 and result.extended == []
    assert result.grid[0.016] == [math.inf, math.inf] and not math.isfinite(result.mean(0.016))


def test_ties_are_the_points_within_one_combined_standard_error():
    objective, _ = bowl(0.004, noise=0.2)  # seeds differ by 0.2: se 0.1 per point, 0.14 combined
    result = search_lr(objective, log2_grid(0.004, 5), seeds=[0, 1])
    assert result.stderr(0.004) == pytest.approx(0.1)
    assert result.ties == [0.002, 0.008]  # 0.1 above the best; 0.001 and 0.016 are 0.4 above
    d = result.to_dict()
    assert d["chosen"] == 0.004 and d["grid"]["0.004"] == pytest.approx([2.9, 3.1])
    again = LrSearch.from_dict(d)
    assert again.grid == result.grid and again.ties == result.ties


def test_bad_grids_are_refused():
    objective, _ = bowl(0.004)
    with pytest.raises(ValueError, match="factors of 2"):
        search_lr(objective, [0.001, 0.003, 0.009], seeds=[0])
    with pytest.raises(ValueError, match="at least 2 grid points"):
        search_lr(objective, [0.001], seeds=[0])
    assert np.isnan(search_lr(objective, [0.001, 0.002], seeds=[0]).stderr(0.001))


def _table_tuning(tmp_path, monkeypatch, best, searches=None):
    """The micro preset's tuning stage in table mode, on a fake objective with its optimum at ``best``
    (arm -> lr): what the check trains, and what it concludes."""
    import dataclasses

    import curvlab.jobs.reproduce as reproduce
    import curvlab.jobs.tune as tune

    chosen = {"adamw": {"lr": 0.004}, "muon": {"lr": 0.02, "adam_lr": 0.004}}
    micro = PRESETS["micro"]
    preset = micro.changed(lr_source="table", tuning=dataclasses.replace(micro.tuning.rule, tune_seeds=1))
    entry = {"chosen": chosen, "seeds": [1000, 1001], "searches": searches or {}}
    table = {"micro": {**entry, "fingerprint": preset.tuning_fingerprint()}}
    monkeypatch.setattr(tune, "read_lr_table", lambda: table)
    calls = []

    def fake_loss(self, data, arm, options, seed):
        calls.append((arm, options["lr"], seed))
        return 3.0 + 0.1 * (math.log2(options["lr"]) - math.log2(best[arm])) ** 2

    monkeypatch.setattr(reproduce.Reproduction, "_tuning_loss", fake_loss)
    return tune.tune(reproduce.Reproduction(preset, tmp_path, progress=False), preset, tmp_path / "data"), calls


def test_table_learning_rates_are_checked_on_three_points_with_tuning_seeds(tmp_path, monkeypatch):
    tuning, calls = _table_tuning(tmp_path / "a", monkeypatch, {"adamw": 0.004, "muon": 0.02})
    assert tuning.mode == "table" and tuning.moved == {"adamw": False, "muon": False}
    assert tuning.chosen["adamw"] == {"lr": 0.004} and tuning.chosen["muon"]["lr"] == 0.02
    assert sorted(lr for arm, lr, _ in calls if arm == "adamw") == [0.002, 0.004, 0.008]
    assert sorted(lr for arm, lr, _ in calls if arm == "muon") == [0.01, 0.02, 0.04]
    assert {seed for *_, seed in calls} == {2000}  # neither a measurement seed nor one of the table's
    # an optimum that moved is said, and the pre-registered value is still the one used
    tuning, _ = _table_tuning(tmp_path / "b", monkeypatch, {"adamw": 0.016, "muon": 0.02})
    assert tuning.moved == {"adamw": True, "muon": False} and tuning.chosen["adamw"] == {"lr": 0.004}


def test_a_winner_within_the_table_searchs_standard_error_is_no_move(tmp_path, monkeypatch):
    # with its optimum at 0.016, the fake bowl puts the check's best, 0.008, ahead of the table's 0.004 by
    # 0.1 * (2² - 1²) = 0.3 nats; the table's own search had standard errors of 0.5 at both points: no move
    noisy = LrSearch("adamw.lr", {0.004: [2.5, 3.5], 0.008: [2.5, 3.5]}, 0.004, [0.004, 0.008]).to_dict()
    tuning, _ = _table_tuning(tmp_path / "c", monkeypatch, {"adamw": 0.016, "muon": 0.02}, {"adamw.lr": noisy})
    assert tuning.moved["adamw"] is False
    sure = LrSearch("adamw.lr", {0.004: [3.0, 3.0001], 0.008: [3.0, 3.0001]}, 0.004, [0.004, 0.008]).to_dict()
    tuning, _ = _table_tuning(tmp_path / "d", monkeypatch, {"adamw": 0.016, "muon": 0.02}, {"adamw.lr": sure})
    assert tuning.moved["adamw"] is True


def test_a_table_entry_made_under_other_settings_is_not_used(tmp_path, monkeypatch):
    import dataclasses

    import curvlab.jobs.reproduce as reproduce
    import curvlab.jobs.tune as tune

    micro = PRESETS["micro"]
    preset = micro.changed(lr_source="table", tuning=dataclasses.replace(micro.tuning.rule, tune_seeds=1))
    other = preset.changed(batch_size=preset.training.batch_size * 2).tuning_fingerprint()  # other batches
    entry = {"chosen": {"adamw": {"lr": 0.004}, "muon": {"lr": 0.02, "adam_lr": 0.004}}, "seeds": [1000, 1001]}
    monkeypatch.setattr(tune, "read_lr_table", lambda: {"micro": {**entry, "fingerprint": other}})
    monkeypatch.setattr(reproduce.Reproduction, "_tuning_loss", lambda self, data, arm, options, seed: 3.0)
    tuning = tune.tune(reproduce.Reproduction(preset, tmp_path, progress=False), preset, tmp_path / "data")
    assert tuning.mode == "search" and "other settings" in tuning.fallback
    assert tuning.seeds == preset.tuning_settings.seeds()


def test_a_corrupt_table_is_a_one_line_error(tmp_path):
    from curvlab.jobs.lr_table import read_lr_table

    bad = tmp_path / "lr_table.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="corrupt JSON"):
        read_lr_table(bad)
    bad.write_text(json.dumps(schema.sealed({"schema_version": 1})))
    with pytest.raises(ValueError, match="not a learning-rate table"):
        read_lr_table(bad)


def test_a_design_that_only_adds_measurements_runs_at_its_bases_tabled_learning_rates():
    """The committed table is keyed by preset; a design without its own entry takes one made under the same
    tuning fingerprint (mechanism is quick plus the factorial: quick's rates, not a search of its own),
    and a design with other tuning settings still finds none."""
    from curvlab.jobs.lr_table import read_lr_table
    from curvlab.jobs.presets import PRESETS
    from curvlab.jobs.tune import _table_entry

    quick, mechanism = PRESETS["quick"], PRESETS["mechanism"]
    assert "mechanism" not in read_lr_table()
    assert mechanism.tuning_fingerprint() == quick.tuning_fingerprint()
    assert _table_entry(mechanism) == read_lr_table()["quick"] == _table_entry(quick)
    assert _table_entry(dataclasses.replace(quick.changed(batch_size=8), name="other")) is None
