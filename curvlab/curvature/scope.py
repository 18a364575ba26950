r"""A direction's curvature over a scope of parameters: the record every curvature result is made of.

A *scope* is a set S of parameter names; a direction Z taken over S is :math:`Z_S` (Z on S, 0 elsewhere).
Two scopes are named (:data:`SCOPES`): ``"all"`` (every parameter) and ``"hidden"`` (the hidden 2-D
matrices, Muon's, by role: :func:`~curvlab.curvature.groupings.hidden_matrices`); a function's ``scope``
option also takes the names of a scope of the caller's own.

:class:`DirectionCurvature` holds, for one direction at one point W (gradient G, Hessian H, on a batch):

.. math::
    I_1 = \langle G_S, Z_S\rangle,\quad I_2 = \tfrac12\langle Z_S, H Z_S\rangle,\quad
    \mathrm{NDS} = \frac{\langle Z_S, H Z_S\rangle}{\|Z_S\|^2},\quad
    \cos = \frac{I_1}{\|G_S\|\,\|Z_S\|},\quad q = \frac{\cos^2}{\mathrm{NDS}},

the predicted decrease :math:`I_1 - I_2` and, where the loss was evaluated at :math:`W - Z_S`, the
realized one :math:`L(W) - L(W - Z_S)`. :class:`ScopeCurvature` is the same with the scope's parameter
names.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

from torch import Tensor, nn

from curvlab.curvature.groupings import hidden_matrices
from curvlab.engine import params as param_dicts
from curvlab.errors import CurvlabError
from curvlab.util.codec import Record

SCOPES = ("all", "hidden")
"""The named scopes (``scope=``): ``"all"`` parameters, or the ``"hidden"`` matrices (by role); a list of
parameter names is a scope too."""


@dataclass(frozen=True)
class DirectionCurvature(Record):
    r"""The curvature of one direction Z over one scope S at one point (see the module docstring).

    Attributes:
        first_order: :math:`I_1 = \langle G_S, Z_S\rangle`.
        curvature_penalty: :math:`I_2 = \tfrac12\langle Z_S, H[Z_S]\rangle`.
        predicted: :math:`I_1 - I_2`.
        realized: :math:`L(W) - L(W - Z_S)` (NaN where the loss was not evaluated there).
        nds: :math:`\langle Z_S, H[Z_S]\rangle / \|Z_S\|^2`.
        update_norm: :math:`\|Z_S\|_F`.
        grad_norm: :math:`\|G_S\|_F`.
        cosine: :math:`I_1 / (\|G_S\|\,\|Z_S\|)` (NaN where :math:`G_S = 0`).
    """

    first_order: float
    curvature_penalty: float
    predicted: float
    realized: float
    nds: float
    update_norm: float
    grad_norm: float
    cosine: float

    @property
    def q(self) -> float:
        r""":math:`\cos^2 / \mathrm{NDS}`, free of Z's length: along Z the best one-step decrease of the
        quadratic model is :math:`\tfrac{q}{2}\|G_S\|^2` (NDS <= 0 gives q <= 0; NaN where NDS = 0)."""
        return self.cosine**2 / self.nds if self.nds != 0 else math.nan

    @classmethod
    def of(cls, gz: float, zhz: float, zz: float, gg: float, realized: float = math.nan) -> DirectionCurvature:
        r"""The record from :math:`\langle G_S, Z_S\rangle`, :math:`\langle Z_S, H Z_S\rangle`,
        :math:`\|Z_S\|^2`, :math:`\|G_S\|^2` and the realized decrease (if the loss was evaluated).

        Raises:
            CurvlabError: Z is zero on the scope (its NDS is undefined).
        """
        if zz <= 0:
            raise CurvlabError("a direction is zero on its scope: its NDS is undefined")
        znorm, gnorm = zz**0.5, gg**0.5
        return cls(
            first_order=gz,
            curvature_penalty=0.5 * zhz,
            predicted=gz - 0.5 * zhz,
            realized=realized,
            nds=zhz / zz,
            update_norm=znorm,
            grad_norm=gnorm,
            cosine=gz / (gnorm * znorm) if gnorm > 0 else math.nan,
        )

    def curvature(self) -> DirectionCurvature:
        """The eight quantities alone, as a plain :class:`DirectionCurvature`."""
        return DirectionCurvature(**{k: getattr(self, k) for k in CURVATURE_KEYS})


@dataclass(frozen=True)
class ScopeCurvature(DirectionCurvature):
    """A :class:`DirectionCurvature` with the parameter names of its scope (JSON: the eight and ``names``)."""

    names: tuple[str, ...] = ()


CURVATURE_KEYS = tuple(f.name for f in fields(DirectionCurvature))
"""A :class:`DirectionCurvature`'s keys, in order (a report's and a monitor row's top level holds them)."""
NAN_CURVATURE = DirectionCurvature(**{k: math.nan for k in CURVATURE_KEYS})


def scope_names(
    scope: str | Sequence[str] | None, params: Mapping[str, Tensor], model: nn.Module | None = None
) -> list[str]:
    """The parameter names of ``scope``: ``"all"``, ``"hidden"`` (by role when ``model`` is given, else
    by name and shape), the names themselves, or ``None`` (no scope: ``[]``).

    Raises:
        CurvlabError: an unknown scope name, or names that are not parameters.
    """
    if scope is None:
        return []
    if isinstance(scope, str):
        if scope not in SCOPES:
            raise CurvlabError(f"unknown scope {scope!r}; choose one of {', '.join(SCOPES)}, or parameter names")
        return list(params) if scope == "all" else hidden_matrices(params, model=model)
    names = list(scope)
    unknown = [n for n in names if n not in params]
    if unknown:
        raise CurvlabError(f"the scope names unknown parameters: {param_dicts.names_text(unknown)}")
    return names
