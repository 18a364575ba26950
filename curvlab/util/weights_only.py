"""How torch's weights-only unpickler says it refused a pickle.

``torch.load(..., weights_only=True)`` raises ``pickle.UnpicklingError`` both for a pickle that names a
class or function beyond tensors and plain data (refused, never called: it could run code) and for bytes
that are no pickle at all; only the refusal names the global it would not resolve (``GLOBAL
posix.system``). Every curvlab loader tells the two apart here, to say "refusing" or "corrupt".
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path

from curvlab.errors import CurvlabError

# torch.load's message opens with this and, for a refused global, names it as ``GLOBAL module.name``
# (an unsupported one, or one of a blocked module)
_REFUSED_GLOBAL = re.compile(r"Weights only load failed.*?GLOBAL ([\w.]+)", re.DOTALL)


def refused_global(error: BaseException) -> str | None:
    """The global (``module.name``) torch's weights-only unpickler refused in ``error``, or None when
    ``error`` is no such refusal (a corrupt file's, say)."""
    if not isinstance(error, pickle.UnpicklingError):
        return None
    found = _REFUSED_GLOBAL.search(str(error))
    return None if found is None else found.group(1)


def is_weights_only_refusal(error: BaseException) -> bool:
    """Whether ``error`` is torch's weights-only unpickler refusing a global (not a corrupt file)."""
    return refused_global(error) is not None


def unpickling_error(error: pickle.UnpicklingError, where: str | Path, what: str) -> CurvlabError:
    """The one line for ``error``, raised by ``torch.load(..., weights_only=True)`` of ``what`` (``"the
    checkpoint"``, ``"byte item 'lr'"``) in ``where``: a refusal names the global it would not resolve,
    anything else is a corrupt file."""
    refused = refused_global(error)
    if refused is None:
        return CurvlabError(f"{where}: corrupt or unreadable {what} (UnpicklingError)")
    return CurvlabError(
        f"{where}: {what} names {refused}, not only tensors and plain data; refusing to unpickle it (it could run code)"
    )
