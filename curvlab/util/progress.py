r"""Progress of long loops: a tqdm bar on a terminal, a plain line every so often anywhere else.

A bar written to a log file, a pipe or a CI console is hundreds of kilobytes of ``\r`` fragments, so
there :func:`progress` prints one plain line every :func:`line_interval` seconds and one at the end::

    train muon: 120/600 (20%), 35 s, loss=3.210, val=3.300, tok_s=1234
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import IO, Any

from tqdm.auto import tqdm

DEFAULT_INTERVAL = 30.0  # seconds between plain lines
INTERVAL_ENV = "CURVLAB_PROGRESS_INTERVAL"


def line_interval() -> float:
    """Seconds between plain progress lines: ``CURVLAB_PROGRESS_INTERVAL`` if set, else 30."""
    value = os.environ.get(INTERVAL_ENV)
    try:
        return DEFAULT_INTERVAL if value is None else max(0.0, float(value))
    except ValueError:
        return DEFAULT_INTERVAL


def progress(
    iterable: Iterable,
    desc: str,
    disable: bool = False,
    total: int | None = None,
    stream: IO[str] | None = None,
    leave: bool = True,
) -> Any:
    """``iterable`` with progress shown on ``stream`` (default stderr): a tqdm bar on a terminal
    (``leave=False``: erased when done), else :class:`LineProgress`; both take ``set_postfix`` and ``close``."""
    stream = sys.stderr if stream is None else stream
    if disable or _is_terminal(stream):
        return tqdm(iterable, desc=desc, total=total, disable=disable, file=stream, leave=leave)
    return LineProgress(iterable, desc, total, line_interval(), stream)


def refresh_interval(stream: IO[str] | None = None) -> float:
    """``mininterval`` for a tqdm bar driven by ``update()``: 0.1 s on a terminal, else :func:`line_interval`."""
    return 0.1 if _is_terminal(sys.stderr if stream is None else stream) else line_interval()


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or odd stream
        return False


class LineProgress:
    """Iterates ``iterable``, printing ``desc: done/total (pct), elapsed, postfix`` to ``stream`` when
    ``interval`` seconds have passed since the last line, and once after the last item."""

    def __init__(self, iterable: Iterable, desc: str, total: int | None, interval: float, stream: IO[str]):
        self.iterable, self.desc, self.interval, self.stream = iterable, desc, interval, stream
        self.total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)
        self.postfix: dict[str, Any] = {}
        self.done = 0
        self._start = self._last = time.monotonic()
        self._closed = False

    def set_postfix(self, **values: Any) -> None:
        self.postfix = values

    def __iter__(self) -> Iterator:
        for item in self.iterable:
            yield item
            self.done += 1
            now = time.monotonic()
            if now - self._last >= self.interval:
                self._line(now)
        self.close()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._line(time.monotonic())

    def _line(self, now: float) -> None:
        self._last = now
        count = f"{self.done}/{self.total} ({self.done / self.total:.0%})" if self.total else f"{self.done}"
        extra = "".join(f", {k}={v}" for k, v in self.postfix.items())
        self.stream.write(f"{self.desc}: {count}, {now - self._start:.0f} s{extra}\n")
        self.stream.flush()
