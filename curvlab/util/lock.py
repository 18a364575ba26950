"""One owner per output directory: ``train``, ``compare``, ``track``, ``reproduce`` and ``finetune`` hold
their ``--out`` for as long as they write there, and a second process is refused, by name.

:func:`own_directory` holds ``OUT/curvlab.lock``, a :class:`filelock.FileLock`: an ``flock`` that the
kernel drops when its process ends, however it ends, so the lock of a process killed with ``kill -9``
is free again and the next owner simply takes it. While it holds the lock the owner keeps
``OUT/curvlab.owner.json`` (:class:`Owner`: process id, host, command, start time), which is what a
refused process names, and what the next owner finds left behind by a killed one. The lock file itself
stays (removing a lock file races with a process about to lock it).

:func:`check_not_owned` is the readers' side: ``compare`` and ``track`` refuse a run whose directory a
live process (``curvlab train``) holds, since its checkpoint series is still being written.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import filelock

from curvlab.errors import CurvlabError
from curvlab.util.atomic import atomic_write_json
from curvlab.util.distributed import all_reduce_sum, rank_and_world

LOCK_FILE = "curvlab.lock"
OWNER_FILE = "curvlab.owner.json"


@dataclass(frozen=True)
class Owner:
    """Who holds (or, left behind by a killed process, held) an output directory."""

    pid: int
    host: str
    what: str  # the command: "train", "compare", ...
    started: str  # local time, ISO 8601 to the second

    def describe(self) -> str:
        return f"process {self.pid} on {self.host} (curvlab {self.what}, started {self.started})"

    @classmethod
    def me(cls, what: str) -> Owner:
        now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        return cls(os.getpid(), socket.gethostname(), what, now)


def read_owner(directory: str | Path) -> Owner | None:
    """The owner record in ``directory`` (``None`` when there is none, or it is unreadable: it only
    names a holder, it decides nothing)."""
    try:
        d = json.loads((Path(directory) / OWNER_FILE).read_text())
        return Owner(int(d["pid"]), str(d["host"]), str(d["what"]), str(d["started"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _lock(directory: Path) -> filelock.FileLock:
    # one instance per path in a process (``is_singleton``), so a thread that holds it may take it again;
    # another thread's hold is its own (``thread_local``), so it is refused like another process
    return filelock.FileLock(directory.resolve() / LOCK_FILE, is_singleton=True, thread_local=True)


def _in_use(directory: Path, then: str) -> CurvlabError:
    """The refusal of a directory a live process holds: its owner named (when its record is there yet)."""
    owner = read_owner(directory)
    return CurvlabError(f"{directory}: in use by {owner.describe() if owner else 'another process'}{then}")


@contextlib.contextmanager
def _hold(directory: Path, what: str) -> Iterator[Owner | None]:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock = _lock(directory)
        lock.acquire(timeout=0)
    except filelock.Timeout:
        raise _in_use(directory, "; wait for it to finish, or choose another --out") from None
    except OSError as e:
        raise CurvlabError(f"{directory}: can't take it as an output directory ({e.strerror or e})") from e
    try:
        previous = None
        if lock.lock_counter == 1:  # the outermost hold of this thread records itself; a nested one doesn't
            left = read_owner(directory)
            me = Owner.me(what)
            previous = left if left and (left.pid, left.host) != (me.pid, me.host) else None
            atomic_write_json(directory / OWNER_FILE, asdict(me))
        yield previous
    finally:
        if lock.lock_counter == 1:
            with contextlib.suppress(FileNotFoundError):
                (directory / OWNER_FILE).unlink()
        lock.release()


@contextlib.contextmanager
def own_directory(out: str | Path, what: str) -> Iterator[Owner | None]:
    """Hold the output directory ``out`` (made if missing) for the ``with`` block, as command ``what``.

    Yields the record a killed owner left behind (its lock was free, so this process took it over),
    else ``None``. The same thread may take a directory it holds again (nested jobs); another thread or
    process may not. Under torch.distributed, rank 0 holds it for every rank, and every rank learns
    whether it could (they enter and leave together).

    Raises:
        CurvlabError: a live process holds ``out``: ``"<out>: in use by process <pid> on <host> (curvlab
            <what>, started <time>) ..."``; or ``out`` can't be made or locked.
    """
    out = Path(out)
    rank, world = rank_and_world()
    if world == 1:
        with _hold(out, what) as previous:
            yield previous
        return
    with contextlib.ExitStack() as stack:
        failure, previous = None, None
        if rank == 0:
            try:
                previous = stack.enter_context(_hold(out, what))
            except BaseException as e:  # (any failure: the other ranks must hear of it, not wait for it)
                failure = e
        if all_reduce_sum(float(failure is not None)):
            if failure is not None:
                raise failure
            raise CurvlabError(f"{out}: rank 0 could not take it as the output directory")
        yield previous


def check_not_owned(directory: str | Path, why: str) -> None:
    """Refuse to read ``directory`` while a live process holds it (:func:`own_directory`); ``why`` says
    what that means for the reader. A directory nobody ever held, or whose holder is gone, passes; so
    does one this thread holds itself. Nothing is written (a read-only directory passes). Under
    torch.distributed rank 0 looks, for every rank (ranks looking at once would see each other).

    Raises:
        CurvlabError: ``"<directory>: in use by process <pid> on <host> (curvlab <what>, started
            <time>): <why>"``.
    """
    directory = Path(directory)
    rank, world = rank_and_world()
    refusal = _probe(directory, why) if rank == 0 else None
    if world > 1 and all_reduce_sum(float(refusal is not None)):
        raise refusal or CurvlabError(f"{directory}: in use by another process: {why}")
    if refusal is not None:
        raise refusal


def _probe(directory: Path, why: str) -> CurvlabError | None:
    """The refusal :func:`check_not_owned` raises, if a live process holds ``directory``."""
    if not (directory / LOCK_FILE).is_file():
        return None
    lock = _lock(directory)
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        return _in_use(directory, f": {why}")
    except OSError:
        return None  # can't even open its lock file: nobody can be writing there through curvlab
    lock.release()
    return None
