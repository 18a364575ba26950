"""What a training step touches besides parameters, their ``.grad`` and the optimizer's state, saved and put
back: each module's buffers and the other attributes in its ``__dict__`` (the tensor the legacy
``spectral_norm`` and ``weight_norm`` hooks leave as ``weight``, a cache a forward fills), and the random
streams of torch, numpy and Python. :func:`left_as_found` wraps :func:`curvlab.steps.update.next_update`.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from curvlab.errors import CurvlabError

# a module's own tables, kept as the same dict objects: parameters are the caller's to put back, buffers are
# put back one by one, and a step adds or removes no submodule
_TABLES = ("_parameters", "_buffers", "_modules")


@dataclass(frozen=True)
class RandomStreams:
    """Every random stream a step can draw from, at one moment: torch's CPU generator, those of the
    parameters' devices (``device_type``, by index), numpy's global state and Python's ``random``."""

    cpu: Tensor
    device_type: str | None
    devices: dict[int, Tensor]
    numpy: tuple[Any, ...]
    python: tuple[Any, ...]

    @classmethod
    def capture(cls, tensors: Sequence[Tensor]) -> RandomStreams:
        """The streams now: the CPU's and those of each device ``tensors`` live on."""
        devices = {t.device for t in tensors if t.device.type not in ("cpu", "meta")}
        kinds = {d.type for d in devices}
        if len(kinds) > 1:
            raise CurvlabError(f"parameters on several device types ({sorted(kinds)}): can't fork their RNGs")
        kind = kinds.pop() if kinds else None
        module = getattr(torch, kind) if kind else None
        states = {} if module is None else {i: module.get_rng_state(i) for i in sorted({d.index or 0 for d in devices})}
        return cls(torch.get_rng_state(), kind, states, np.random.get_state(), random.getstate())

    def restore(self) -> None:
        """Every stream back where it was at :meth:`capture`."""
        torch.set_rng_state(self.cpu)
        if self.device_type is not None:
            module = getattr(torch, self.device_type)
            for i, state in self.devices.items():
                module.set_rng_state(state, i)
        np.random.set_state(self.numpy)
        random.setstate(self.python)


@dataclass(frozen=True)
class ModuleState:
    """One module at one moment: its ``__dict__`` but its tables (the attribute values, by reference), its
    buffers (the objects) and copies of their values."""

    module: nn.Module
    attributes: dict[str, Any]
    buffers: dict[str, Tensor | None]
    values: dict[str, Tensor]

    @classmethod
    def capture(cls, module: nn.Module) -> ModuleState:
        buffers = dict(module._buffers)
        values = {k: b.detach().clone() for k, b in buffers.items() if b is not None}
        return cls(module, {k: v for k, v in vars(module).items() if k not in _TABLES}, buffers, values)

    def restore(self) -> None:
        """The attributes that were there (those added since removed), the same buffer objects, and the
        values of those that changed since (by value: batch norm's kernel counts no version): a copy into
        an unchanged buffer would invalidate a graph the user holds that saved it."""
        m = self.module
        for k in [k for k in vars(m) if k not in _TABLES and k not in self.attributes]:
            del m.__dict__[k]
        m.__dict__.update(self.attributes)
        m._buffers.clear()
        m._buffers.update(self.buffers)
        with torch.no_grad():
            for k, value in self.values.items():
                b = self.buffers[k]
                if not torch.equal(b, value):
                    b.copy_(value)


@dataclass(frozen=True)
class SideState:
    """Everything but parameters, ``.grad`` and optimizer state that a step touches, at one moment: every
    module's :class:`ModuleState` and the :class:`RandomStreams`."""

    modules: list[ModuleState]
    streams: RandomStreams

    @classmethod
    def capture(cls, model: nn.Module, tensors: Sequence[Tensor]) -> SideState:
        """``model``'s state now, with the random streams of the CPU and of ``tensors``' devices."""
        return cls([ModuleState.capture(m) for m in model.modules()], RandomStreams.capture(tensors))

    def restore(self) -> None:
        for m in self.modules:
            m.restore()
        self.streams.restore()


@contextlib.contextmanager
def left_as_found(model: nn.Module, tensors: Sequence[Tensor]) -> Iterator[SideState]:
    """Run the body, then put back ``model``'s :class:`SideState` as it was on entry (which the body gets).
    Parameters, ``.grad`` and optimizer state are the caller's to put back."""
    state = SideState.capture(model, tensors)
    try:
        yield state
    finally:
        state.restore()
