"""The bookkeeping ``curvlab reproduce`` and ``curvlab finetune`` share: config guard and invocation times."""

import dataclasses
import json
import math

import pytest

from curvlab.errors import CurvlabError
from curvlab.jobs import job as job_module
from curvlab.jobs.job import CONFIG_VERSION, DIVERGED, Job, StageClock, guard_config, record_invocation
from curvlab.jobs.presets import PRESETS
from curvlab.jobs.reproduce import Reproduction
from curvlab.runs.checkpoint import add_to_index, read_index
from curvlab.runs.train import TrainingDiverged
from curvlab.studies.tuning import TuningRecord, TuningSettings


def test_a_directory_keeps_one_configuration(tmp_path):
    path = tmp_path / "job" / "config.json"
    guard_config(path, {"steps": 10, "arms": ("a", "b")}, "a job")
    guard_config(path, {"steps": 10, "arms": ["a", "b"]}, "a job")  # the same, as it reads back
    with pytest.raises(CurvlabError, match="holds a job of another configuration"):
        guard_config(path, {"steps": 11, "arms": ["a", "b"]}, "a job")
    assert json.loads(path.read_text()) == {"steps": 10, "arms": ["a", "b"], "config_version": CONFIG_VERSION}


def test_a_directory_whose_config_holds_a_removed_field_continues(tmp_path):
    """A reproduction's directory from before ``n_boot`` went (it changed no result) continues with the
    same preset, and is still refused under another one; its config file is left as it was."""
    path = tmp_path / Reproduction.CONFIG_FILE
    config = Reproduction(PRESETS["micro"], tmp_path).config()
    old = json.loads(
        json.dumps({**config, "preset": {**config["preset"], "n_boot": 200}, "config_version": CONFIG_VERSION})
    )
    path.write_text(json.dumps(old))
    guard_config(path, config, "a reproduction")
    assert json.loads(path.read_text()) == old
    other = Reproduction(PRESETS["micro"].changed(steps=PRESETS["micro"].training.steps + 1), tmp_path).config()
    with pytest.raises(CurvlabError, match="holds a reproduction of another configuration"):
        guard_config(path, other, "a reproduction")


def test_a_directory_an_older_curvlab_wrote_is_refused_as_such(tmp_path):
    """A config without ``config_version`` (version 1: flat tuning and matching fields) names the version
    change, not "another configuration", and the file is left as it was."""
    path = tmp_path / "job" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"steps": 10, "compare_levels": 6}))
    with pytest.raises(
        CurvlabError,
        match=f"written by another curvlab version \\(config version 1, this one writes {CONFIG_VERSION}\\)",
    ):
        guard_config(path, {"steps": 10}, "a job")
    assert json.loads(path.read_text()) == {"steps": 10, "compare_levels": 6}


def test_a_resumed_job_reports_the_time_of_all_its_invocations(tmp_path):
    """A re-run that finds everything done adds its seconds to the earlier invocations' instead of
    reporting the whole job as taking seconds; the conditions are the longest invocation's."""
    path = tmp_path / "timing.json"
    first = record_invocation(path, {"adapt": 300.0, "total": 320.0, "load": 1.9, "threads": 2, "cpus": 2})
    assert first == {"adapt": 300.0, "total": 320.0, "load": 1.9, "threads": 2.0, "cpus": 2.0, "invocations": 1}
    again = record_invocation(path, {"adapt": 0.5, "summary": 1.0, "total": 2.0, "load": 0.2, "threads": 1, "cpus": 2})
    assert again == {
        "adapt": 300.5, "summary": 1.0, "total": 322.0, "load": 1.9, "threads": 2.0, "cpus": 2.0, "invocations": 2,
    }  # fmt: skip
    assert len(json.loads(path.read_text())["invocations"]) == 2


class _Clocks:
    """Stand-ins for ``time.perf_counter`` and ``time.process_time`` that move only when told: wall and
    CPU seconds that the test sets, not the machine's."""

    def __init__(self):
        self.wall, self.cpu = 100.0, 10.0

    def perf_counter(self):
        return self.wall

    def process_time(self):
        return self.cpu

    def spend(self, wall, cpu):
        self.wall += wall
        self.cpu += cpu


def test_stage_clock_adds_up_a_stage_entered_twice(monkeypatch):
    """Each stage's wall and CPU seconds are the sums over its entries, outside time is only in the
    total, and each stage's end records the load."""
    clocks = _Clocks()
    monkeypatch.setattr(job_module, "time", clocks)
    clock = StageClock()
    clocks.spend(1.0, 0.25)  # before any stage
    for wall, cpu in ((2.0, 1.5), (3.0, 0.5)):
        with clock("tune"):
            clocks.spend(wall, cpu)
    with clock("train"):
        clocks.spend(7.0, 6.0)
    t = clock.invocation()
    assert (t["tune"], t["tune_cpu"], t["train"], t["train_cpu"]) == (5.0, 2.0, 7.0, 6.0)
    assert (t["total"], t["total_cpu"]) == (13.0, 8.25)
    assert len(clock.loads) == 3


class _BowlJob(Job):
    """A job whose short runs are a fake: lr -> (log2 lr - log2 0.01)², diverging above 0.05."""

    TAG, CONFIG_FILE, WHAT = "bowl", "bowl.json", "a bowl"

    def __init__(self, out):
        super().__init__(out, progress=False)
        self.trained = []

    def config(self):
        return {"bowl": 1}

    def tuning_settings(self):
        return TuningSettings({"sgd": 0.01}, 3, 1, 1000, horizon_steps=5, max_extensions=2)

    def _short_run(self, data, run, arm, options, seed, steps):
        self.trained.append(options["lr"])
        run.mkdir(parents=True, exist_ok=True)
        if options["lr"] > 0.05:
            (run / "ckpt_000002.pt").write_bytes(b"x")  # the last good checkpoint a diverged run leaves
            raise TrainingDiverged("non-finite training loss at step 3")
        (run / "ckpt_000005.pt").write_bytes(b"x")
        loss = 3.0 + (math.log2(options["lr"]) - math.log2(0.01)) ** 2
        add_to_index(run, steps, loss, "ckpt_000005.pt")
        return loss


def test_a_diverged_tuning_run_scores_inf_is_recorded_and_is_not_trained_again(tmp_path):
    job = _BowlJob(tmp_path)
    assert job._tuning_loss(tmp_path / "data", "sgd", {"lr": 0.08}, 1000) == math.inf
    run = tmp_path / "runs" / "tune" / "sgd" / "lr0.08-seed1000"
    assert "step 3" in json.loads((run / DIVERGED).read_text())["error"] and not list(run.glob("ckpt_*.pt"))
    assert job._tuning_loss(tmp_path / "data", "sgd", {"lr": 0.08}, 1000) == math.inf
    assert job.trained == [0.08]  # the re-run read the record instead of training again


def test_a_finished_tuning_run_is_read_back_without_its_checkpoints(tmp_path):
    job = _BowlJob(tmp_path)
    first = job._tuning_loss(tmp_path / "data", "sgd", {"lr": 0.02}, 1000)
    run = tmp_path / "runs" / "tune" / "sgd" / "lr0.02-seed1000"
    assert first == 4.0 and not list(run.glob("ckpt_*.pt")) and read_index(run)[-1]["val_loss"] == 4.0
    assert _BowlJob(tmp_path)._tuning_loss(tmp_path / "data", "sgd", {"lr": 0.02}, 1000) == 4.0
    assert job.trained == [0.02]


def test_the_job_search_finds_the_bowls_minimum_and_saves_a_typed_record(tmp_path):
    job = _BowlJob(tmp_path)
    t = job.tuning_settings()
    search = job._search(tmp_path / "data", "sgd", "lr", [0.04, 0.08], {}, t.max_extensions, t.seeds())
    assert search.chosen == 0.01 and search.grid[0.08] == [math.inf] and search.extended == [0.02, 0.01]
    record = TuningRecord("search", 0.0, t.horizon_steps, t.seeds(), {"sgd.lr": search}, {"sgd": {"lr": 0.01}})
    job.save_tuning(record)
    assert json.loads(job.tuning_path.read_text())["searches"]["sgd.lr"]["grid"]["0.08"] == [None]  # strict JSON
    assert _BowlJob(tmp_path).saved_tuning() == record  # +inf comes back from null


def test_a_job_guards_its_directory_and_sums_its_invocations(tmp_path):
    job = _BowlJob(tmp_path)
    job.start()
    assert json.loads((tmp_path / "bowl.json").read_text()) == {"bowl": 1, "config_version": CONFIG_VERSION}
    with job.clock("tune"):
        pass
    assert job.timing()["invocations"] == 1
    other = _BowlJob(tmp_path)
    other.config = lambda: {"bowl": 2}
    with pytest.raises(CurvlabError, match="holds a bowl of another configuration"):
        other.start()
    job.start()
    assert job.timing()["invocations"] == 2


def test_tuning_seeds_are_disjoint_from_the_measured_ones_in_both_jobs():
    from curvlab.jobs.presets import FINETUNE_PRESETS, PRESETS

    for preset in (*PRESETS.values(), *FINETUNE_PRESETS.values()):
        assert not set(preset.tuning_settings.seeds()) & set(range(preset.seeds)), preset.name
    with pytest.raises(CurvlabError, match="overlap the measurement seeds"):
        TuningSettings({"adamw": 0.01}, 3, 2, 1, horizon_steps=5, max_extensions=0).validate(measured=3)


def test_the_a_a_comparisons_read_their_own_number_of_batches(tmp_path, monkeypatch):
    """``aa_analysis_batches`` sets the A/A comparisons' evaluation batches (standard: 1 against the claims'
    2), and only theirs; unset, the A/A reads as many as the claims; 0 is refused. An A/A comparison
    measures no shadow (its claims read each run's own step), the others do."""

    import curvlab.jobs.measure as measure
    import curvlab.jobs.reproduce as reproduce
    from curvlab.jobs.presets import PRESETS

    seen, shadowed = {}, {}

    def compare_runs(a, b, out, criteria, settings, **kw):
        seen[out.name] = settings.batches
        shadowed[out.name] = settings.paired

    monkeypatch.setattr(measure, "compare_runs", compare_runs)
    preset = PRESETS["micro"].changed(analysis_batches=3, aa_analysis_batches=1)
    job = reproduce.Reproduction(preset, tmp_path / "out", progress=False)
    for name in ("adamw/muon", "adamw/sgd", "adamw/adamw", "muon/muon"):
        measure.compare(job, preset, name, 1, (tmp_path / "a", tmp_path / "b"), 0.0, name.replace("/", "-"))
    assert seen == {"adamw-muon": 3, "adamw-sgd": 3, "adamw-adamw": 1, "muon-muon": 1}
    assert shadowed == {"adamw-muon": True, "adamw-sgd": True, "adamw-adamw": False, "muon-muon": False}
    assert PRESETS["standard"].aa_batches == 1 and PRESETS["standard"].measurement.analysis_batches == 2
    assert preset.changed(aa_analysis_batches=None).aa_batches == 3
    with pytest.raises(CurvlabError, match="aa_analysis_batches 0 must be >= 1"):
        preset.changed(aa_analysis_batches=0).validate()


def test_directories_made_before_presets_became_records_continue(tmp_path):
    """Presets became records grouped by concept (issue 49); a job's saved config keeps the flat form, so
    a directory an earlier curvlab made continues. The fixture holds the configs the code before the
    change wrote (``tests/data/micro/configs_v2.json``, made at 03a10c4) for micro, quick, standard and the
    robustness design; each is accepted by the guard as this curvlab's once issue 50's design changes are
    made to it (and refused before), and one changed field is not."""
    from curvlab.jobs.presets import ROBUSTNESS_PRESETS
    from curvlab.jobs.robustness import Robustness
    from tests.micro_fixture import FIXTURE

    before = json.loads((FIXTURE / "configs_v2.json").read_text())
    jobs = {n: Reproduction(PRESETS[n], tmp_path / n, progress=False) for n in ("micro", "quick", "standard")}
    jobs["robustness"] = Robustness(ROBUSTNESS_PRESETS["robustness"], tmp_path / "robustness", progress=False)
    assert set(jobs) == set(before)

    def since_issue_50(config):
        """The design changes of issue 50: the stability context's Lanczos budget went from 20 to 40
        iterations, and quick's design (robustness's base) judges direction efficiency too, tracks only the
        checkpoints a claim or control reads, and matches single checkpoints."""
        text = json.dumps(config).replace('"stability_iterations": 20', '"stability_iterations": 40')
        judged = '"primary": ["paired_direction_ratio", "alignment_ratio"]'
        now = '"primary": ["paired_direction_ratio", "direction_efficiency_ratio", "alignment_ratio"]'
        if judged in text:  # quick's design (and robustness's base)
            text = text.replace('"track_interval": 20', '"track_interval": 20, "track_points": "read"')
            text = text.replace('"window": 1', '"window": 0')
        return json.loads(text.replace(judged, now))

    for name, job in jobs.items():
        path = tmp_path / name / job.CONFIG_FILE
        path.parent.mkdir()
        path.write_text(json.dumps({**before[name], "config_version": CONFIG_VERSION}))
        with pytest.raises(CurvlabError, match="of another configuration"):
            job._check_config()  # a directory measured in the design before issue 50 is not continued
        now = since_issue_50(before[name])
        assert now != before[name]
        path.write_text(json.dumps({**now, "config_version": CONFIG_VERSION}))
        job._check_config()  # but for those, the same configuration (factorial, added since, off): no error
        assert json.loads(path.read_text())["preset"] == now["preset"]  # left as it was
    # an added field counts at its old value only
    for change in ({"check_points": 5}, {"factorial": True}, {"track_points": "all"}):
        changed = Reproduction(PRESETS["quick"].changed(**change), tmp_path / "quick", progress=False)
        with pytest.raises(CurvlabError, match="of another configuration"):
            changed._check_config()


def test_a_preset_changes_by_flat_names_and_the_fineweb_run_only_when_asked(tmp_path):
    """``changed`` routes flat names to their records (a flat round trip keeps every value), ``fineweb``
    is a flag or the run itself, and a FineWeb setting on a design without the run is refused rather than
    turning it on (a review found both: ``quick.changed(fineweb_steps=10)`` had started a FineWeb run)."""
    from curvlab.studies.design import FinewebRun

    quick, paper = PRESETS["quick"], PRESETS["paper"]
    for preset in (quick, paper):
        again = preset.changed(**preset.flat())
        assert again.flat() == preset.flat() and again.fineweb == preset.fineweb
    assert quick.changed(steps=40, keep="all").training.steps == 40
    assert quick.changed(keep="all").measurement.keep == "all"
    assert quick.changed(fineweb=FinewebRun(steps=10)).fineweb == FinewebRun(steps=10)
    assert quick.changed(fineweb=True, fineweb_steps=10).fineweb.steps == 10
    assert paper.changed(fineweb_steps=10).fineweb.steps == 10 and paper.changed(fineweb=False).fineweb is None
    for bad in ({"fineweb_steps": 10}, {"fineweb": False, "fineweb_steps": 10}):
        with pytest.raises(CurvlabError, match="fineweb_steps set a FineWeb run: pass fineweb=True too"):
            quick.changed(**bad)
    with pytest.raises(CurvlabError, match="a preset has no field 'step'"):
        quick.changed(step=40)


def test_a_summary_saved_by_itself_is_strict_json(tmp_path):
    """``summary.json`` is read by other programs: ``Summary.save`` writes NaN as null, as the job does,
    and the file loads back."""
    from pathlib import Path

    from curvlab.studies.summary import Summary

    root = Path(__file__).parent.parent
    summary = Summary.load(root / "docs" / "results" / "quick" / "summary.json")
    summary.seconds = float("nan")
    summary.save(tmp_path / "summary.json")
    text = (tmp_path / "summary.json").read_text()
    assert "NaN" not in text and json.loads(text)["seconds"] is None
    assert Summary.load(tmp_path / "summary.json").preset == "quick"


def test_the_read_checkpoints_are_those_a_trajectory_mean_reads():
    """``track_points="read"`` picks, before any analysis, exactly the tracked checkpoints that
    ``TrackRecord.after_warmup`` (what every trajectory aggregate, the paired claim and the controls read)
    would keep of the full trajectory: in the stable phase, off the plateau (a loss at the ceiling is on it),
    after warmup; a run that never leaves the plateau reads none."""
    from curvlab.curvature.scalars import CheckpointScalars
    from curvlab.jobs.measure import read_steps
    from curvlab.runs.match import Checkpoint
    from curvlab.studies.records import TrackRecord

    plateau, warmup = 6.0, 10
    phases = {k: "warmup" if k < warmup else "stable" if k <= 160 else "decay" for k in range(0, 201, 2)}
    losses = {k: 6.8 - 0.01 * k for k in phases}  # off the plateau from step 82; at the ceiling exactly at 80
    losses[120] = 6.1  # a tracked checkpoint back on the plateau mid-phase
    checkpoints = [Checkpoint(step=k, val_loss=losses[k], path=f"ckpt_{k}.pt", phase=p) for k, p in phases.items()]
    steps = list(range(4, 201, 4))
    rows = [
        CheckpointScalars.from_dict(
            {
                "step": c.step,
                "val_loss": c.val_loss,
                "taylor_ok": True,
                "phase": c.phase,
                "on_plateau": c.val_loss >= plateau,
            }
        )
        for c in checkpoints
        if c.step in steps
    ]
    expected = [r.step for r in TrackRecord("adamw", 0.0, 0, 200, warmup, rows).after_warmup()]
    got = read_steps(checkpoints, steps, plateau, warmup)
    assert got == expected and got[0] == 84 and 120 not in got and got[-1] == 160
    early = [dataclasses.replace(c, val_loss=1.0, phase="stable") for c in checkpoints if c.step <= 8]
    assert read_steps(early, [4, 8], plateau, warmup) == []  # (before the warmup's end: not read)
    on = [dataclasses.replace(c, val_loss=7.0) for c in checkpoints]
    assert read_steps(on, steps, plateau, warmup) == []
