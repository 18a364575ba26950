"""A resumable job in one output directory: what ``curvlab reproduce`` and ``curvlab finetune`` share.

* :func:`guard_config`: the directory belongs to one configuration; a re-run with the same one
  continues it, any other is refused (results of two configurations are never mixed).
* :class:`StageClock`: wall and CPU seconds per stage, and the machine's load at the end of each.
* :func:`record_invocation`: every invocation's times in ``timing.json``; the job's times are their
  sums (a re-run that finds everything done must not report the job as taking seconds), under the
  conditions (load, threads) of the invocation that did the most work.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from curvlab.atomic import atomic_write_text
from curvlab.errors import CurvlabError

CONDITIONS = ("load", "threads", "cpus")


def guard_config(path: Path, config: dict[str, Any], what: str) -> None:
    """Write ``config`` to ``path`` on the first run; refuse a later run whose config differs.

    Raises:
        CurvlabError: the directory holds ``what`` of another configuration.
    """
    config = json.loads(json.dumps(config))  # as it reads back (tuples become lists)
    if path.is_file():
        if json.loads(path.read_text()) != config:
            raise CurvlabError(
                f"{path.parent} holds {what} of another configuration; refusing to mix them: choose a fresh --out"
            )
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(config, indent=1))


class StageClock:
    """Wall seconds per stage under ``name`` and this process's CPU seconds under ``name_cpu`` (on a
    shared machine wall time inflates with the load, CPU time much less), from construction on."""

    def __init__(self):
        self.timing: dict[str, float] = {}
        self.loads: list[float] = []  # the 1-minute load average at the end of each stage
        self._start, self._cpu = time.perf_counter(), time.process_time()

    @contextlib.contextmanager
    def __call__(self, name: str):
        start, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.timing[name] = self.timing.get(name, 0.0) + time.perf_counter() - start
            self.timing[f"{name}_cpu"] = self.timing.get(f"{name}_cpu", 0.0) + time.process_time() - cpu
            self.loads.append(os.getloadavg()[0])

    def invocation(self) -> dict[str, float]:
        """This invocation's times so far, with its total and conditions."""
        return {
            **self.timing,
            "total": time.perf_counter() - self._start,
            "total_cpu": time.process_time() - self._cpu,
            "load": float(np.mean(self.loads)) if self.loads else float(os.getloadavg()[0]),
            "threads": torch.get_num_threads(),
            "cpus": os.cpu_count(),
        }


def record_invocation(path: Path, invocation: dict[str, float]) -> dict[str, float]:
    """Append ``invocation`` to the list in ``path`` (``timing.json``) and return the job's times:
    every stage summed over the invocations, the conditions of the longest one, and their count."""
    invocations = json.loads(path.read_text()) if path.is_file() else []
    invocations.append(invocation)
    atomic_write_text(path, json.dumps(invocations, indent=1))
    keys = {k for i in invocations for k in i if k not in CONDITIONS}
    timing = {k: sum(i.get(k, 0.0) for i in invocations) for k in sorted(keys)}
    longest = max(invocations, key=lambda i: i["total"])
    timing.update({k: float(longest[k]) for k in CONDITIONS if k in longest})
    timing["invocations"] = len(invocations)
    return timing
