"""The bookkeeping ``curvlab reproduce`` and ``curvlab finetune`` share: config guard and invocation times."""

import json

import pytest

from curvlab.errors import CurvlabError
from curvlab.jobs import StageClock, guard_config, record_invocation


def test_a_directory_keeps_one_configuration(tmp_path):
    path = tmp_path / "job" / "config.json"
    guard_config(path, {"steps": 10, "arms": ("a", "b")}, "a job")
    guard_config(path, {"steps": 10, "arms": ["a", "b"]}, "a job")  # the same, as it reads back
    with pytest.raises(CurvlabError, match="holds a job of another configuration"):
        guard_config(path, {"steps": 11, "arms": ["a", "b"]}, "a job")
    assert json.loads(path.read_text()) == {"steps": 10, "arms": ["a", "b"]}


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
    assert len(json.loads(path.read_text())) == 2


def test_stage_clock_adds_up_a_stage_entered_twice():
    clock = StageClock()
    for _ in range(2):
        with clock("tune"):
            sum(range(10000))
    t = clock.invocation()
    assert 0 < t["tune"] <= t["total"] and t["tune_cpu"] > 0 and len(clock.loads) == 2
