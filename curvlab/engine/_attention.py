"""Attention on the math backend within a block, as ``sdpa_kernel(SDPBackend.MATH)`` sets it, for less.

The exact mode enters this at every curvature call; ``sdpa_kernel`` looks each backend's switch up by name
on entry and exit, which costs more than the rest of the mode's entry (docs/benchmarks.md): here, once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

# (read, set, whether it is the math backend) for each backend sdpa_kernel switches, by the names it uses;
# none where this torch names them otherwise, and then sdpa_kernel itself
try:
    _SWITCHES = tuple(
        (getattr(torch._C, f"_get_{name}_sdp_enabled"), getattr(torch._C, f"_set_sdp_use_{name}"), name == "math")
        for name in torch.nn.attention._backend_names
    )
except AttributeError:
    _SWITCHES = ()


@contextlib.contextmanager
def math_attention() -> Iterator[None]:
    """``sdpa_kernel(SDPBackend.MATH)``: the math backend alone within the block, every backend as it was after."""
    if not _SWITCHES:
        with sdpa_kernel(SDPBackend.MATH):
            yield
        return
    before = [read() for read, _, _ in _SWITCHES]
    try:
        for _, switch, is_math in _SWITCHES:
            switch(is_math)
        yield
    finally:
        for (_, switch, _), on in zip(_SWITCHES, before):
            switch(on)
