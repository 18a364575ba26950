"""torch.distributed helpers: the process group under torchrun, sharing work out, reducing results.

Under ``torchrun``, :func:`distributed_context` initializes the process group (NCCL on GPUs, gloo on
CPUs) with a bounded timeout, so that a rank that dies makes the others fail instead of hang (with one
rank too: sharded tensors need a group). Outside torchrun everything here is a no-op.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")
DEFAULT_TIMEOUT_S = 120


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if is_distributed() else (0, 1)


def is_main() -> bool:
    return rank_and_world()[0] == 0


@contextlib.contextmanager
def distributed_context(timeout_s: float | None = None) -> Iterator[tuple[int, int]]:
    """``(rank, world)``; under torchrun (or ``WORLD_SIZE > 1``) the process group is set up and torn down here.
    Each rank takes ``cuda:LOCAL_RANK`` on CUDA machines; the timeout (``CURVLAB_DIST_TIMEOUT`` seconds,
    default 120) bounds how long a rank waits for one that failed."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if dist.is_initialized() or not (world > 1 or dist.is_torchelastic_launched()):
        yield rank_and_world()
        return
    timeout = timeout_s or float(os.environ.get("CURVLAB_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    try:
        watch_ranks()
        yield dist.get_rank(), dist.get_world_size()
        dist.barrier()  # on success, leave together: gloo aborts a rank whose peer tore down first
    finally:
        dist.destroy_process_group()


def my_share(items: Sequence[T]) -> list[T]:
    """This rank's share of ``items`` (every world-th, from its rank)."""
    rank, world = rank_and_world()
    return list(items[rank::world])


def _all_reduce(t: torch.Tensor) -> None:
    """In-place sum across ranks; NCCL only reduces CUDA tensors, so a CPU tensor takes a round trip."""
    if dist.get_backend() == "nccl" and t.device.type != "cuda":
        on_gpu = t.to(f"cuda:{torch.cuda.current_device()}")
        dist.all_reduce(on_gpu)
        t.copy_(on_gpu)
    else:
        dist.all_reduce(t)


def all_reduce_sum(values: dict[str, torch.Tensor] | torch.Tensor | float) -> Any:
    """Sum across ranks (in place for tensors); a float comes back as a float. No-op in one process."""
    if not is_distributed():
        return values
    if isinstance(values, (dict, torch.Tensor)):
        for t in values.values() if isinstance(values, dict) else [values]:
            _all_reduce(t)
        return values
    t = torch.tensor(float(values), dtype=torch.float64)
    _all_reduce(t)
    return float(t)


def device_for_rank(requested: str = "auto") -> str:
    """The device this rank should use: its own GPU under torchrun with CUDA, else ``requested``."""
    if is_distributed() and torch.cuda.is_available() and requested in ("auto", "cuda"):
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return requested


def from_main(obj: T) -> T:
    """Rank 0's ``obj`` on every rank (a picklable object; ``obj`` itself in one process)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    """Wait for every rank (no-op in one process)."""
    if is_distributed():
        dist.barrier()


# the roll-call group of the default process group: (default group, gloo group)
_ROLL_CALL: tuple[Any, Any] | None = None
_ROLL_CALL_TAG = 0x6C6C  # (point-to-point messages of the roll call, apart from everything else)


def _group_timeout() -> float:
    """The default process group's timeout, in seconds."""
    try:  # (no public accessor: the CPU backend's options hold it; NCCL-only groups have none)
        return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return float(os.environ.get("CURVLAB_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))


def watch_ranks() -> None:
    """Set up the roll call that :func:`unanswered_ranks` takes after a collective failed: a gloo group
    apart from the default group (whose state a failed collective leaves broken), with its timeout. Every
    rank calls it at the same point, once per process group."""
    global _ROLL_CALL
    if not is_distributed() or (_ROLL_CALL is not None and _ROLL_CALL[0] is dist.group.WORLD):
        return
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=_group_timeout()))
    _ROLL_CALL = (dist.group.WORLD, group)


def unanswered_ranks() -> list[int] | None:
    r"""After a collective failed on this rank: the ranks that died or stalled, by a roll call (``None``
    where :func:`watch_ranks` set none up).

    Each rank that gets here sends its number to every other and waits for theirs: a dead rank answers
    at once with a closed connection, a stalled one not in time. The wait is the group's timeout as it is
    now, and a quarter: a survivor hanging in the failed collective leaves it within one timeout and
    answers then, so every survivor names the same ranks (``monitored_barrier`` names them on rank 0 only).
    """
    if _ROLL_CALL is None or _ROLL_CALL[0] is not dist.group.WORLD:
        return None
    _, group = _ROLL_CALL
    timeout = _group_timeout()
    rank, world = rank_and_world()
    peers = [q for q in range(world) if q != rank]
    sends, recvs, missing = [], {}, set()
    for q in peers:  # (posting to a peer whose process is gone fails at once)
        try:
            sends.append(dist.isend(torch.tensor([rank]), q, group=group, tag=_ROLL_CALL_TAG))
            recvs[q] = (dist.irecv(buf := torch.tensor([-1]), q, group=group, tag=_ROLL_CALL_TAG), buf)
        except RuntimeError:
            missing.add(q)
    deadline = time.monotonic() + 1.25 * timeout
    for q, (work, buf) in recvs.items():
        try:
            work.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.01)))
            if int(buf) != q:
                missing.add(q)
        except RuntimeError:
            missing.add(q)
    for work in sends:  # (a send to a rank that didn't answer may fail too: it is counted already)
        with contextlib.suppress(RuntimeError):
            work.wait(datetime.timedelta(seconds=0.01))
    return sorted(missing)
