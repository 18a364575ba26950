"""One owner per output directory: ``train``, ``compare``, ``track``, ``reproduce`` and ``finetune`` hold
their ``--out`` for as long as they write there, and a second process is refused, by name.

:func:`own_directory` holds ``OUT/curvlab.lock``, an ``flock`` (:class:`filelock.FileLock`) the kernel
drops when its process ends, however it ends, and keeps ``OUT/curvlab.owner.json`` (:class:`Owner`), which
a refused process names. The lock file stays (removing one races with a process about to lock it); one
that is a link or no plain file is refused before filelock opens it (with ``O_TRUNC``, following links).

A lock file removed by hand frees the directory for a second process, which replaces the owner record;
the first checks the record before every step's writes (:func:`check_still_owner`) and stops in one line.
:func:`check_not_owned` is the readers' side (``compare``, ``track``).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import stat
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
    """The owner record in ``directory`` (``None`` if missing or unreadable: it decides nothing)."""
    try:
        d = json.loads((Path(directory) / OWNER_FILE).read_text())
        return Owner(int(d["pid"]), str(d["host"]), str(d["what"]), str(d["started"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


# the owner record this process wrote in each directory it holds (the outermost hold's), by resolved path
_records: dict[Path, Owner] = {}


def check_still_owner(directory: str | Path, then: str, world: int = 1) -> None:
    """Raise ``CurvlabError`` unless the owner record in ``directory``, which this process holds, is still the
    one it wrote (a process that took the directory over replaces it); ``then`` says what that means. With
    ``world`` > 1 (every rank calls it at the same point) rank 0 looks and every rank learns."""
    directory = Path(directory)
    rank, _ = rank_and_world()
    lost = None
    if rank == 0:
        mine, now = _records.get(directory.resolve()), read_owner(directory)
        if mine is not None and now != mine:
            lost = f"its owner record names {now.describe()}" if now else "its owner record is gone"
    if world > 1 and all_reduce_sum(float(lost is not None)):
        lost = lost or "its owner record is another's"
    if lost is not None:
        raise CurvlabError(
            f"{directory}: no longer held by this process: {lost} (its lock file was removed or replaced while "
            f"this one held it); {then}"
        )


def _check_lock_file(directory: Path) -> None:
    """Refuse a lock file that is not a plain file of its own, before filelock opens it: a symbolic link,
    no regular file, or a hard link to a file with content (a lock file is empty)."""
    path = directory / LOCK_FILE
    try:
        status = os.lstat(path)
    except FileNotFoundError:
        return  # (filelock makes it)
    if stat.S_ISLNK(status.st_mode):
        kind = "a symbolic link"
    elif not stat.S_ISREG(status.st_mode):
        kind = "not a regular file"
    elif status.st_nlink > 1 and status.st_size > 0:
        kind = "a hard link to a file with content"
    else:
        return
    raise CurvlabError(f"{path}: is {kind}, where curvlab keeps its lock file: refused (remove it, if it is yours)")


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
        _check_lock_file(directory)
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
            _records[directory.resolve()] = me
        yield previous
    finally:
        if lock.lock_counter == 1:
            mine = _records.pop(directory.resolve(), None)
            if mine is not None and read_owner(directory) == mine:  # (not the record of one that took it over)
                with contextlib.suppress(FileNotFoundError):
                    (directory / OWNER_FILE).unlink()
        lock.release()


@contextlib.contextmanager
def own_directory(out: str | Path, what: str) -> Iterator[Owner | None]:
    """Hold the output directory ``out`` (made if missing) for the ``with`` block, as command ``what``;
    yields the record a killed owner left behind, else ``None``. The same thread may take a directory it
    holds again (nested jobs); another thread or process is refused, its owner named. Under
    torch.distributed rank 0 holds it for every rank, and every rank learns whether it could."""
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
    """Refuse to read ``directory`` while another live process or thread holds it (:func:`own_directory`);
    ``why`` says what that means for the reader. Nothing is written. Under torch.distributed rank 0 looks,
    for every rank (ranks looking at once would see each other)."""
    directory = Path(directory)
    rank, world = rank_and_world()
    refusal = _probe(directory, why) if rank == 0 else None
    if world > 1 and all_reduce_sum(float(refusal is not None)):
        raise refusal or CurvlabError(f"{directory}: in use by another process: {why}")
    if refusal is not None:
        raise refusal


def _probe(directory: Path, why: str) -> CurvlabError | None:
    """The refusal :func:`check_not_owned` raises, if any."""
    try:
        _check_lock_file(directory)
    except CurvlabError as e:
        return e
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
