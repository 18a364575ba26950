"""curvlab's own error type: a user's mistake, told in one line.

Bad input (a missing or corrupt file, mismatched shapes, non-finite values, a detached loss, an
incompatible checkpoint, an unknown option) raises :class:`CurvlabError`. The command line prints
such an error as one line and exits with status 2; anything else is unexpected and keeps its
traceback. It subclasses ``ValueError`` so that code catching ``ValueError`` keeps working.
"""

from __future__ import annotations


class CurvlabError(ValueError):
    """Bad input from the user: the message names the problem (shapes and keys, never tensor contents)."""
