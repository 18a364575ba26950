"""The micro reproduction's ``summary.json`` and ``levels.json`` as a committed fixture, to show that a
change of structure changes no number (issue 49, item 6; made again when a change of design moves numbers
on purpose, as issue 50's controls, factorial and Lanczos rule did): ``python -m tests.micro_fixture`` writes them
(gzipped, as made), with the machine they were made on, to ``tests/data/micro/``; the suite's micro run
(:func:`run_micro`, under the same conditions) is compared with them by :func:`normalized`.

Floats differ across CPUs and thread counts (a run elsewhere is a replicate, not a copy), so the run is
pinned to one torch thread and the fixture names its CPU, Python, torch and numpy."""

from __future__ import annotations

import gzip
import json
import platform
import re
import sys
import tempfile
from pathlib import Path

import numpy
import scipy
import torch

FIXTURE = Path(__file__).parent / "data" / "micro"
# what a rerun may change: the software's versions, when and how long it ran, the disk it left (the
# versions' text is in files), and the seal over them
VOLATILE = frozenset({"versions", "timing", "seconds", "invocations", "disk_bytes", "content_digest"})
# ... and the records' schema versions, which a migration bumps (what it migrates is compared, as read now)
VOLATILE |= {"schema_version"}


def machine() -> dict[str, str | int]:
    """What decides the micro run's floats besides curvlab: the CPU, the thread count and the software."""
    cpu = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if "model name" in line]
        cpu = names[0] if names else cpu
    software = {"python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__}
    software["scipy"] = scipy.__version__
    return {"cpu": cpu, "arch": platform.machine(), "threads": 1, **software}


def run_micro(out: Path):
    """The micro preset in ``out`` on one torch thread; returns its summary."""
    from curvlab.jobs.presets import PRESETS
    from curvlab.jobs.reproduce import Reproduction

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return Reproduction(PRESETS["micro"], out, progress=False).run()
    finally:
        torch.set_num_threads(threads)


def _strip(value, out: str):
    if isinstance(value, dict):
        return {k: _strip(v, out) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [_strip(v, out) for v in value]
    if isinstance(value, str) and value.startswith(out):
        # a place, not a number: the run's directory, and a cached report's name, whose key hashes the
        # settings' spelling (hvp_method became method) as well as the checkpoint
        return re.sub(r"-[0-9a-f]{10}-[0-9a-f]{8}\.json$", "-<key>.json", "<out>" + value[len(out) :])
    return value


def normalized(text: str, out: str | Path) -> str:
    """A ``summary.json`` or ``levels.json`` as the comparison reads it: without :data:`VOLATILE` keys,
    with ``out`` (the run's directory) and cache keys in paths replaced, records of an older schema read
    as this curvlab reads them (``hvp_method`` as ``method``, whatever the schema version), in canonical
    JSON."""
    data = json.loads(text.replace('"hvp_method":', '"method":'))
    return json.dumps(_strip(data, str(out)), sort_keys=True, indent=0)


def key_paths(value, prefix: str = "") -> set[str]:
    """Every key path in a JSON value, list members' merged (``levels[].a.mean.nds``): its structure,
    whatever the numbers and however many levels."""
    if isinstance(value, dict):
        return {f"{prefix}.{k}" for k in value} | {p for k, v in value.items() for p in key_paths(v, f"{prefix}.{k}")}
    if isinstance(value, list):
        return {p for v in value for p in key_paths(v, f"{prefix}[]")}
    return set()


def fixture_text(name: str) -> tuple[str, str]:
    """A fixture file's text and the directory its run wrote it in."""
    text = gzip.decompress((FIXTURE / f"{name}.gz").read_bytes()).decode()
    found = re.search(r'"(/[^"]*?)/runs/s', text)
    return text, found.group(1) if found else "<none>"


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "micro"
        run_micro(out)
        FIXTURE.mkdir(parents=True, exist_ok=True)
        for name, path in (("summary.json", out / "summary.json"), ("levels.json", out / "analysis" / "levels.json")):
            (FIXTURE / f"{name}.gz").write_bytes(gzip.compress(path.read_bytes(), mtime=0))
    (FIXTURE / "machine.json").write_text(json.dumps(machine(), indent=1) + "\n")
    print(f"wrote {FIXTURE}", file=sys.stderr)


if __name__ == "__main__":
    main()
