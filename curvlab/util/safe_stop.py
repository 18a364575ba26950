"""Stopping at a safe point: SIGINT (Ctrl-C) and SIGTERM, honoured where no file is half written.

Inside :func:`stop_at_safe_points` the first SIGINT or SIGTERM only records a request; the work goes on
to the next safe point (after a training step and its checkpoint; between a job's stages), where
:func:`check_stop` raises :class:`Stopped`. A second signal stops at once (``KeyboardInterrupt``; an atomic
write in progress removes its temporary). Outside the context, and in a thread other than the main one,
the signals keep their usual effect; a signal the process ignores (a background job's SIGINT) stays ignored.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

from curvlab.errors import CurvlabError
from curvlab.util.distributed import all_reduce_sum

SIGNALS = (signal.SIGINT, signal.SIGTERM)

_requested: list[int] = []  # the signals received while inside, first first
_depth = 0  # nested contexts (a job's around the training loops it runs) install the handlers once


class Stopped(CurvlabError):
    """A SIGINT or SIGTERM, honoured at a safe point: running the same command again resumes.
    ``exit_code``: 128 + the signal's number, as a shell reports a process the signal ended."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum


def _request(signum: int, frame) -> None:
    if _requested:  # a second signal: stop now
        raise KeyboardInterrupt
    _requested.append(signum)


@contextlib.contextmanager
def stop_at_safe_points() -> Iterator[None]:
    """While inside, SIGINT and SIGTERM request a stop at the next :func:`check_stop`; the previous handlers
    come back on leaving the outermost context."""
    global _depth
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    if _depth == 0:
        previous = {s: h for s in SIGNALS if (h := signal.getsignal(s)) is not signal.SIG_IGN}
        _requested.clear()
        for s in previous:
            signal.signal(s, _request)
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            for s, handler in previous.items():
                signal.signal(s, handler)
            _requested.clear()


def stop_requested(world: int = 1) -> int | None:
    """The signal whose stop is pending, or ``None``. With ``world`` > 1 (every rank calls it at the same
    point) the ranks agree: all stop if any received one (SIGTERM is named for a rank that didn't)."""
    mine = _requested[0] if _requested else None
    if world > 1:
        anyone = all_reduce_sum(0.0 if mine is None else 1.0) > 0
        return (mine or signal.SIGTERM) if anyone else None
    return mine


def check_stop(where: str, world: int = 1) -> None:
    """Raise :class:`Stopped` if a stop is pending (:func:`stop_requested`): ``where`` says what is done
    and how to continue, e.g. "after step 7; the last checkpoint is step 5: run it again to resume"."""
    signum = stop_requested(world)
    if signum is not None:
        raise Stopped(f"stopped by {signal.Signals(signum).name} {where}", signum)
