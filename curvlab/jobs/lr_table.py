"""The committed learning-rate table (``curvlab/jobs/lr_table.json``): per preset, the full search's chosen
learning rates, made by :func:`curvlab.jobs.reproduce.search_lr_table`, and the rule that says when a
preset's 3-point check finds that the optimum moved (:func:`optimum_moved`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from curvlab.errors import CurvlabError
from curvlab.studies.tuning import LrSearch
from curvlab.util import schema
from curvlab.util.codec import Record

LR_TABLE = Path(__file__).with_name("lr_table.json")
LR_TABLE_SCHEMA_VERSION = 1


def optimum_moved(check: LrSearch, table_lr: float, table_search: dict[str, Any] | None) -> bool:
    """Whether the check's grid says the table's learning rate is no longer the optimum: its best point
    is another lr and beats the table's by more than one standard error. The check may run on one
    seed, which has no standard error of its own, so the error is the table search's (two seeds per
    point), combined over the two points: sqrt(se_table² + se_best²). Without it (a point the table
    did not train), any other winner counts as a move."""
    if check.chosen == table_lr:
        return False
    if table_lr in check.ties:
        return False
    gap = check.mean(table_lr) - check.mean(check.chosen)
    full = LrSearch.from_dict(table_search) if table_search else None
    if full is None or table_lr not in full.grid or check.chosen not in full.grid:
        return True
    se = math.hypot(full.stderr(table_lr), full.stderr(check.chosen))
    return not gap <= se  # a NaN error (a diverged point) counts as a move


@dataclass(frozen=True)
class LrTable(Record):
    """The committed learning-rate table (:data:`LR_TABLE`): preset name -> the full search's entry
    (``fingerprint``, ``chosen``, ``seeds``, ``horizon_steps``, ``adam_side``, ``searches``)."""

    SCHEMA_VERSION: ClassVar[int] = LR_TABLE_SCHEMA_VERSION
    WHAT: ClassVar[str] = "learning-rate table"

    presets: dict[str, dict[str, Any]]


def read_lr_table(path: Path = LR_TABLE) -> dict[str, Any]:
    """The committed learning-rate table's entries by preset name (none when there is no table)."""
    return schema.load(path, LrTable).presets if path.is_file() else {}


def entry_or_centres(name: str | None, centres: dict[str, float]) -> dict[str, Any]:
    """The committed table's entry ``name``, or (``None``) one made of tuning ``centres``, Muon's AdamW side tied to
    AdamW's: what a design of settings or sizes starts its learning rates from.

    Raises:
        CurvlabError: the table has no entry ``name``.
    """
    if name is None:
        return {
            "chosen": {"adamw": {"lr": centres["adamw"]}, "muon": {"lr": centres["muon"], "adam_lr": centres["adamw"]}}
        }
    entry = read_lr_table().get(name)
    if entry is None:
        raise CurvlabError(f"the committed lr table has no entry {name!r}")
    return entry
