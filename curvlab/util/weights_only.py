"""How torch's weights-only unpickler says it refused a pickle.

``torch.load(..., weights_only=True)`` raises ``pickle.UnpicklingError`` both for a pickle that names a
global beyond tensors and plain data (refused: it could run code) and for bytes that are no pickle; only
the refusal names the global (``GLOBAL posix.system``), so every curvlab loader tells "refusing" from
"corrupt" here, naming the entry of a ``torch.save``'d dict that holds the global (:func:`entry_naming`).
"""

from __future__ import annotations

import pickle
import pickletools
import re
import zipfile
from pathlib import Path

from curvlab.errors import CurvlabError

# torch.load's message opens with this and, for a refused global, names it as ``GLOBAL module.name``
# (an unsupported one, or one of a blocked module)
_REFUSED_GLOBAL = re.compile(r"Weights only load failed.*?GLOBAL ([\w.]+)", re.DOTALL)
# what Lightning writes of a module's and a datamodule's save_hyperparameters() (whatever values the user gave)
_LIGHTNING_HPARAMS = ("hyper_parameters", "hparams_type", "datamodule_hyper_parameters", "datamodule_hparams_type")


def refused_global(error: BaseException) -> str | None:
    """The global (``module.name``) torch's weights-only unpickler refused in ``error``, or None when
    ``error`` is no such refusal (a corrupt file's, say)."""
    if not isinstance(error, pickle.UnpicklingError):
        return None
    found = _REFUSED_GLOBAL.search(str(error))
    return None if found is None else found.group(1)


def unpickling_error(
    error: pickle.UnpicklingError, where: str | Path, what: str, entry: str | None = None
) -> CurvlabError:
    """The one line for ``error``, raised by ``torch.load(..., weights_only=True)`` of ``what`` (``"the
    checkpoint"``) in ``where``: a refusal names the global and, given the ``entry`` of the saved dict that
    holds it (:func:`entry_naming`), what to do; anything else is a corrupt file."""
    refused = refused_global(error)
    if refused is None:
        return CurvlabError(f"{where}: corrupt or unreadable {what} (UnpicklingError)")
    refusal = "not only tensors and plain data; refusing to unpickle it (it could run code)"
    line = f"{where}: {what} names {refused}, {refusal}"
    if entry in _LIGHTNING_HPARAMS:
        return CurvlabError(
            f"{line}: it is in Lightning's {entry!r}, which curvlab doesn't read: give save_hyperparameters() "
            f"plain values (ignore= the others), or save the checkpoint again without {entry!r}"
        )
    if entry is not None:
        return CurvlabError(f"{line}: it is in {entry!r}; save that entry as tensors and plain data")
    return CurvlabError(line)


def entry_naming(path: str | Path, name: str) -> str | None:
    """The key of the dict ``torch.save`` wrote to ``path`` (a zip archive) whose value names the global
    ``name`` (``module.name``), or None: not such a file, a top level that is no dict, or no entry that
    names it. Nothing is unpickled: the pickle's opcodes are read (:func:`_walk`)."""
    try:
        with zipfile.ZipFile(path) as archive:
            pickled = next(n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1)
            return _walk(archive.read(pickled), name)[0]
    except (StopIteration, zipfile.BadZipFile, OSError, ValueError, KeyError, IndexError, EOFError):
        return None


def _walk(pickled: bytes, name: str) -> tuple[str | None, int]:
    """Read the opcodes of ``pickled`` for the first key of its top-level dict whose value names the global
    ``name``; returns that key (or None) and the stack entries the walk moved (pushed and popped).

    Each stack entry is its text (a string's) and whether it names ``name``, a constant size; an opcode's
    result names it if one of its operands does (its stack effect from pickletools' table), a memo lookup
    if what was memoized does. Every entry is pushed once and popped at most once, so the work is linear in
    the opcodes (a set of every global named, copied per opcode, took minutes for a megabyte). A malformed
    pickle raises ValueError, IndexError or KeyError.
    """
    stack: list[tuple[str | None, bool]] = []
    marks: list[int] = []
    memo: dict = {}
    moved = 0
    for op, arg, _ in pickletools.genops(pickled):
        if op.name == "MARK":
            marks.append(len(stack))
            continue
        if op.name == "POP" and marks and marks[-1] == len(stack):  # (protocol 0 pops a mark so)
            marks.pop()
            continue
        operands = _pop_operands(op, stack, marks)
        moved += len(operands)
        if op.name in ("SETITEM", "SETITEMS") and not stack:  # items of the top-level dict, below them
            items = operands[1:]
            found = next((key for key, value in zip(items[::2], items[1::2]) if value[1]), None)
            if found is not None:
                return found[0], moved
        if op.name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
            memo[len(memo) if arg is None else arg] = stack[-1]
        elif op.name in ("GET", "BINGET", "LONG_BINGET"):
            stack.append(memo[arg])
        else:
            text = arg if isinstance(arg, str) and not operands and op.name not in ("GLOBAL", "INST") else None
            names = any(named for _, named in operands) or _global_of(op.name, arg, operands) == name
            stack.extend((text, names) for _ in op.stack_after)
        moved += len(op.stack_after)
    return None, moved


def _pop_operands(op: pickletools.OpcodeInfo, stack: list, marks: list[int]) -> list:
    """Pop what ``op`` takes off ``stack`` (everything above the last mark too, where it takes a slice),
    bottom first; raise ValueError where it would reach below the last open mark."""
    before = op.stack_before
    bottom = len(stack)
    if pickletools.stackslice in before:
        if not marks:
            raise ValueError(f"{op.name} without a mark")
        bottom = marks.pop()
        before = before[: before.index(pickletools.markobject)]
    bottom -= len(before)
    if bottom < (marks[-1] if marks else 0):
        raise ValueError(f"pickle stack underflow at {op.name}")
    operands = stack[bottom:]
    del stack[bottom:]
    return operands


def _global_of(opcode: str, arg, operands: list) -> str | None:
    """The global (``module.name``) a GLOBAL, INST or STACK_GLOBAL opcode names, else None."""
    if opcode in ("GLOBAL", "INST"):
        return arg.replace(" ", ".")
    if opcode == "STACK_GLOBAL":
        return f"{operands[0][0]}.{operands[1][0]}"
    return None
