"""The engine's checks of what goes in and what comes out: directions against the parameters, the loss
(a finite scalar that depends on them) and the Hessian-vector products (finite). Each check of finiteness
takes one synchronization for all its tensors, and looks at them one by one only when it fails.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from curvlab.engine import params as param_dicts
from curvlab.engine.dtensors import all_finite, check_layout
from curvlab.errors import CurvlabError


def scalar(value: Any) -> Tensor:
    """``value``, checked to be the 0-d tensor a loss function must return."""
    if not isinstance(value, Tensor) or value.dim() != 0:
        shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise CurvlabError(f"loss_fn must return a scalar tensor, got {shape}")
    return value


def finite_loss(loss: Tensor) -> float:
    """The loss as a float, checked to be finite (one synchronization: ``item``, then a check of the value)."""
    value = loss.item()
    if not math.isfinite(value):
        raise CurvlabError(f"the loss is not finite ({value}) at these parameters and batch")
    return value


def detached_error() -> CurvlabError:
    return CurvlabError(
        "the loss does not depend on the parameters: it has no autograd graph to them (was it detached, "
        "e.g. by .item() or .detach(), or computed with weights that are not in params?)"
    )


def check_finite_hvp(hv: Mapping[str, Tensor], direction: Mapping[str, Tensor] | None = None) -> None:
    """Raise unless the Hessian-vector product ``hv`` is finite; with its ``direction``, that too, in the same
    one synchronization (a direction that is not finite is named first: it is the cause)."""
    if direction is not None and all_finite([*direction.values(), *hv.values()]):
        return
    bad = param_dicts.non_finite(direction) if direction is not None else []
    if bad:
        raise CurvlabError(f"directions[{bad[0]!r}] holds non-finite values (NaN or inf)")
    bad = param_dicts.non_finite(hv)
    if bad:
        raise CurvlabError(f"the Hessian-vector product is not finite (NaN or inf) in {param_dicts.names_text(bad)}")


def check_full(params: Mapping[str, Tensor], vs: Mapping[str, Tensor]) -> None:
    """Stacked directions over exactly ``params``' names (the shortcuts take no partial directions)."""
    missing = [n for n in params if n not in vs]
    if missing:
        raise CurvlabError(f"directions do not match the parameters: missing {param_dicts.names_text(missing)}")


def check_directions(
    params: Mapping[str, Tensor], vs: Mapping[str, Tensor], *, stacked: bool = True, finite: bool = True
) -> tuple[list[str], int | None]:
    """The names and the number K of directions over some of ``params``' names, checked against them
    (``stacked``: ``(K, *param.shape)``, one K > 0 for all; K ``None`` otherwise) and (``finite``) finite."""
    unknown = [n for n in vs if n not in params]
    if unknown:
        raise CurvlabError(f"directions name unknown parameters: {param_dicts.names_text(unknown)}")
    if not vs:
        raise CurvlabError("the directions name no parameter")
    k = _stack_size(next(iter(vs.values()))) if stacked else None
    lead = () if k is None else (k,)
    for n, t in vs.items():
        p, where = params[n], f"directions[{n!r}]"
        if tuple(t.shape) != (*lead, *p.shape):
            want = tuple(p.shape) if k is None else f"({k}, *{tuple(p.shape)})"
            raise CurvlabError(f"{where} has shape {tuple(t.shape)}, expected {want}")
        check_layout(p, t, where, stacked=stacked)
        param_dicts.check_device(p, t, where)
    bad = param_dicts.non_finite(vs) if finite else []
    if bad:
        raise CurvlabError(f"directions[{bad[0]!r}] holds non-finite values (NaN or inf)")
    return list(vs), k


def _stack_size(first: Tensor) -> int:
    if first.dim() == 0:
        raise CurvlabError("directions must be stacked along a leading dimension K")
    if first.shape[0] == 0:
        raise CurvlabError("no directions given (K = 0)")
    return first.shape[0]
