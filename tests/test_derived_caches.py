"""A cache of a pure computation (the quadratic model's study in a reproduction) is derived data: an
edited or truncated one is recomputed with a note, never trusted and never fatal."""

import json

import pytest

from curvlab.jobs import side_studies
from curvlab.jobs.presets import PRESETS
from curvlab.jobs.reproduce import Reproduction
from curvlab.theory.quadratic import quadratic_study


@pytest.mark.parametrize("damage", ["edited", "truncated"])
def test_an_edited_or_truncated_quadratic_study_is_recomputed_with_a_note(tmp_path, damage):
    job = Reproduction(PRESETS["micro"], tmp_path / "out", progress=False)
    reference = quadratic_study(**PRESETS["micro"].quadratic)  # computed here, independently of the cache
    assert side_studies.quadratic(job, PRESETS["micro"]) == reference
    path = tmp_path / "out" / "quadratic" / "quadratic.json"
    d = json.loads(path.read_text())
    if damage == "edited":  # another valid JSON: a plausible number, that only the seal can tell
        d["example"]["closed_forms"]["muon_nds"] *= 10
        path.write_text(json.dumps(d))
    else:
        path.write_text(path.read_text()[: len(path.read_text()) // 2])
    again = Reproduction(PRESETS["micro"], tmp_path / "out", progress=False)
    assert side_studies.quadratic(again, PRESETS["micro"]) == reference
    assert any(str(path) in line and "recomputed" in line for line in again.log), again.log
    assert json.loads(path.read_text())["example"]["closed_forms"]["muon_nds"] == pytest.approx(
        reference.closed_forms.muon_nds, rel=1e-15
    )
