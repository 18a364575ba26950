"""A generation of a small Zipf-PCFG data folder in another process, stopped after its first shard (it
holds the folder's generation lock there): to be killed (kill -9) or let go on (SIGUSR1); and a
generation in this process that checks it waits for that one."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import filelock
import pytest

from curvlab.data import dataset

HANG_GUARD_S = 120  # a bound on every wait here, against a hang; it measures nothing

_CHILD = """
import json, signal, sys
from pathlib import Path
import curvlab.data.dataset as dataset
write, written = dataset.write_shard, []
def stop_after_the_first(path, tokens):  # then say so, and wait for SIGUSR1 (or a kill -9)
    write(path, tokens)
    written.append(path)
    if len(written) == 1:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})  # (one sent from now on is kept pending)
        Path(sys.argv[2]).touch()
        if signal.sigtimedwait({signal.SIGUSR1}, float(sys.argv[4])) is None:
            sys.exit("never let go on")
dataset.write_shard = stop_after_the_first
dataset.generate_pcfg_dataset(sys.argv[1], **json.loads(sys.argv[3]))
"""


@contextlib.contextmanager
def generating(out: Path, ready: Path, **config) -> Iterator[subprocess.Popen]:
    """A process generating ``out`` with ``config`` (keyword arguments of ``generate_pcfg_dataset``),
    from when it has written its first shard; killed at the end if it is still running."""
    args = [out, ready, json.dumps({**config, "progress": False}), HANG_GUARD_S]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-c", _CHILD, *map(str, args)], env=env)
    try:
        wait_for(ready, process)
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def wait_for(path: Path, process: subprocess.Popen) -> None:
    """Until ``path`` exists (the child reached its hook)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not path.exists():
        assert process.poll() is None, "the child ended before its hook"
        assert time.monotonic() < deadline, f"no {path} after {HANG_GUARD_S} s"
        time.sleep(0.05)


def wait_for_it(monkeypatch: pytest.MonkeyPatch, live: subprocess.Popen, busy: Path) -> list:
    """Make the next generation in this process check that ``live`` holds the generation lock (its
    directory ``busy`` in place), let ``live`` go on, and wait for it; returns the list of the shards
    that this process writes (none, when it takes the other's dataset)."""
    real, shards = dataset.generation_lock, []

    def held_by_the_live_one(out):
        lock = real(out)
        with pytest.raises(filelock.Timeout):
            lock.acquire(timeout=0)
        assert busy.is_dir()  # untouched
        live.send_signal(signal.SIGUSR1)  # it finishes while this one waits for the lock
        lock.timeout = HANG_GUARD_S
        return lock

    monkeypatch.setattr(dataset, "generation_lock", held_by_the_live_one)
    monkeypatch.setattr(dataset, "write_shard", lambda path, tokens: shards.append(path))
    return shards
