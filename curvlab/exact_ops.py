r"""A mode under which any PyTorch model can be differentiated twice, exactly, without side effects.

What breaks second derivatives of ordinary models on torch 2.13 (``shared/repro/layernorm_hessian.py``
and ``tests/test_exact_ops.py`` measure each case against double backward):

* flash and memory-efficient attention have neither forward-mode AD nor double backward, so
  ``scaled_dot_product_attention`` must run on the math backend (every method);
* dropout makes the loss random, so the "Hessian" would change between two HVPs (every method);
* batch and instance norms in training mode update their running statistics in place: curvature
  must never change the model, and under ``torch.func`` transforms the update even crashes (every
  method);
* the fused norm kernels have wrong second-order *forward-mode* formulas. Forward-over-forward
  (``jvp`` of ``jvp``, the quadratic forms) is wrong through ``layer_norm``, ``instance_norm`` and
  ``batch_norm`` with batch statistics, and ``jacrev`` of ``jacrev`` (``torch.func.hessian``) through
  their affine forms. Forward-over-reverse (``jvp`` of ``grad``) and double backward are right, and
  ``group_norm``, ``rms_norm`` and ``batch_norm`` with running statistics are right under all four.

So each method reroutes only what is wrong under it (:data:`REROUTES`): the HVP methods ``"rev_rev"``
and ``"fwd_rev"`` keep the fused kernels, while ``"fwd_fwd"`` (and ``None``: any transform, for users
who call ``torch.func.hessian`` themselves) route the three norms through composites of ``mean`` and
``rsqrt``, whose derivatives of every order and mode are exact.

With ``watch_dtype=torch.float64`` the mode also reports where the model computes in lower precision
inside (a ``.float()`` of the logits, an RMSNorm computing in float32): the result would carry float32
accuracy, whatever dtype the parameters have.
"""

from __future__ import annotations

import contextlib
import traceback
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.modules.batchnorm import _NormBase
from torch.overrides import TorchFunctionMode

from curvlab.errors import CurvlabError

MODES = ("rev_rev", "fwd_rev", "fwd_fwd")
# what each method needs rerouted beyond attention, dropout and running statistics
REROUTES = {"rev_rev": frozenset(), "fwd_rev": frozenset(), "fwd_fwd": frozenset({"norms"}), None: frozenset({"norms"})}

_DROPOUTS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout}
_PRECISION = {torch.float64: 3, torch.float32: 2, torch.float16: 1, torch.bfloat16: 1}


def composite_layer_norm(
    x: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    r"""Layer normalization :math:`(x - \mu)/\sqrt{\sigma^2 + \epsilon}\,w + b` from primitive ops.

    Same value as ``F.layer_norm`` (to rounding), with derivatives of every order and mode exact.
    """
    return _affine(_normalize(x, tuple(range(-len(normalized_shape), 0)), eps), weight, bias, x.dim(), 0)


def composite_batch_norm(
    x: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Tensor:
    r"""Batch normalization of ``(N, C, ...)`` from primitive ops, never updating running statistics.

    With batch statistics (``training`` or no running statistics), :math:`\mu, \sigma^2` are taken over
    every dimension but C (biased variance, as ``F.batch_norm`` normalizes); otherwise the running
    ones are used. Derivatives of every order and mode are exact.
    """
    if training or running_mean is None or running_var is None:
        y = _normalize(x, (0, *range(2, x.dim())), eps)
    else:
        shape = (1, -1) + (1,) * (x.dim() - 2)
        y = (x - running_mean.view(shape)) * torch.rsqrt(running_var.view(shape) + eps)
    return _affine(y, weight, bias, x.dim(), 1)


def composite_instance_norm(
    x: Tensor,
    running_mean: Tensor | None = None,
    running_var: Tensor | None = None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    use_input_stats: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Tensor:
    """Instance normalization of ``(N, C, ...)`` over the spatial dimensions, from primitive ops, never
    updating running statistics (see :func:`composite_batch_norm`)."""
    if use_input_stats or running_mean is None or running_var is None:
        y = _normalize(x, tuple(range(2, x.dim())), eps)
    else:
        shape = (1, -1) + (1,) * (x.dim() - 2)
        y = (x - running_mean.view(shape)) * torch.rsqrt(running_var.view(shape) + eps)
    return _affine(y, weight, bias, x.dim(), 1)


def _normalize(x: Tensor, dims: tuple[int, ...], eps: float) -> Tensor:
    centered = x - x.mean(dims, keepdim=True)
    return centered * torch.rsqrt(centered.pow(2).mean(dims, keepdim=True) + eps)


def _affine(y: Tensor, weight: Tensor | None, bias: Tensor | None, ndim: int, channel_dim: int) -> Tensor:
    """``y * weight + bias`` with the parameters broadcast along ``channel_dim`` (1: channels, 0: the
    trailing normalized shape, which broadcasts as is)."""
    shape = None if channel_dim == 0 else (-1,) + (1,) * (ndim - 2)
    if weight is not None:
        y = y * (weight if shape is None else weight.view(shape))
    if bias is not None:
        y = y + (bias if shape is None else bias.view(shape))
    return y


# F.batch_norm and F.instance_norm share one argument layout; their flag for batch statistics
# ("training", "use_input_stats") is called batch_stats here
_STATISTICS_NORM_ARGS = ("input", "running_mean", "running_var", "weight", "bias", "batch_stats", "momentum", "eps")
_STATISTICS_NORMS = {
    F.batch_norm: ("training", False, composite_batch_norm),
    F.instance_norm: ("use_input_stats", True, composite_instance_norm),
}


class _ExactSecondOrderMode(TorchFunctionMode):
    def __init__(self, composite_norms: bool, watch_dtype: torch.dtype | None, frozen: frozenset[int | None]):
        super().__init__()
        self.composite_norms = composite_norms
        self.watch_dtype = watch_dtype
        self.frozen = frozen
        self.downcast_at: str | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.frozen and args and _in_place(func) and _storage(args[0]) in self.frozen:
            return args[0]  # e.g. nn.BatchNorm's num_batches_tracked.add_(1): the model stays as it was
        if func in _DROPOUTS:
            return args[0] if args else kwargs["input"]
        if func is F.scaled_dot_product_attention:
            kwargs = {**kwargs, "dropout_p": 0.0}
            if len(args) > 4:  # dropout_p passed positionally
                args = (*args[:4], 0.0, *args[5:])
        elif func in _STATISTICS_NORMS:
            return self._statistics_norm(func, args, kwargs)
        elif func is F.layer_norm and self.composite_norms:
            return composite_layer_norm(*args, **kwargs)
        out = func(*args, **kwargs)
        if self.watch_dtype is not None and self.downcast_at is None:
            self._watch(func, args, kwargs, out)
        return out

    def _statistics_norm(self, func, args, kwargs) -> Tensor:
        """Batch or instance norm that never updates its running statistics (as a composite when the
        method needs one)."""
        flag, default, composite = _STATISTICS_NORMS[func]
        b = dict(zip(_STATISTICS_NORM_ARGS, args))
        b.update({("batch_stats" if k == flag else k): v for k, v in kwargs.items()})
        batch_stats = b.get("batch_stats", default) or b.get("running_mean") is None
        running = (None, None) if batch_stats else (b["running_mean"], b["running_var"])
        weight, bias, eps = b.get("weight"), b.get("bias"), b.get("eps", 1e-5)
        if self.composite_norms:
            return composite(b["input"], *running, weight, bias, batch_stats, eps=eps)
        return func(b["input"], *running, weight, bias, batch_stats, 0.0, eps)

    def _watch(self, func, args, kwargs, out) -> None:
        """Remember the first op that turns a ``watch_dtype`` input into a lower-precision float."""
        if not (isinstance(out, Tensor) and _PRECISION.get(out.dtype, 9) < _PRECISION[self.watch_dtype]):
            return
        inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
        if any(a.dtype == self.watch_dtype for a in inputs):
            name = getattr(func, "__name__", str(func))
            self.downcast_at = f"{name}() to {_dtype_name(out.dtype)} at {_caller()}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _storage(t: object) -> int | None:
    """The address of a plain tensor's storage (views and detached aliases share it); ``None`` otherwise."""
    try:
        return t.untyped_storage().data_ptr() if isinstance(t, Tensor) else None
    except (RuntimeError, NotImplementedError):  # a functorch wrapper has no storage of its own
        return None


def _in_place(func) -> bool:
    name = getattr(func, "__name__", "")
    return name.endswith("_") and not name.startswith("_")


def _caller() -> str:
    """``file:line in function`` of the innermost frame outside torch and curvlab: the model's code."""
    skip = (str(Path(torch.__file__).parent), str(Path(__file__).parent))
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(skip):
            return f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}"
    return "an unknown place"


def running_statistics(module: nn.Module | None) -> list[Tensor]:
    """The buffers of every batch and instance norm of ``module`` (running means and variances, and
    ``num_batches_tracked``, which ``nn.BatchNorm`` counts in its Python ``forward``)."""
    if module is None:
        return []
    return [b for m in module.modules() if isinstance(m, _NormBase) for b in m.buffers(recurse=False)]


@contextlib.contextmanager
def exact_second_order(
    method: str | None = None, watch_dtype: torch.dtype | None = None, keep: Sequence[Tensor] = ()
) -> Iterator[None]:
    """Context in which second derivatives of any model are exact, deterministic and side-effect free.

    Inside it, for every ``method``: attention runs on the math backend with dropout 0, all functional
    dropouts are the identity, batch and instance norms never update their running statistics, and
    in-place operations on the tensors in ``keep`` (pass :func:`running_statistics` of the model) are
    skipped.
    For ``method`` ``"fwd_fwd"`` or ``None`` (any transform, ``torch.func.hessian`` included),
    ``F.layer_norm``, ``F.batch_norm`` with batch statistics and ``F.instance_norm`` also run as
    composites (:func:`composite_layer_norm`, ...). Re-entrant.

    Args:
        method: ``"rev_rev"`` or ``"fwd_rev"`` (the HVP methods), ``"fwd_fwd"`` (quadratic forms), or
            ``None`` for every rerouting.
        watch_dtype: warn, naming the place, when the model turns a tensor of this dtype (e.g. float64)
            into a lower-precision float: its curvature then has that lower precision.
    """
    if method not in REROUTES:
        raise CurvlabError(f"unknown method {method!r} for the exact mode; choose one of {', '.join(MODES)}")
    watch = watch_dtype if watch_dtype in _PRECISION else None
    mode = _ExactSecondOrderMode("norms" in REROUTES[method], watch, frozenset(_storage(t) for t in keep))
    with sdpa_kernel(SDPBackend.MATH), mode:
        yield
    if mode.downcast_at is not None:
        warnings.warn(
            f"{_dtype_name(watch)} was requested, but the model computes in lower precision inside "
            f"({mode.downcast_at}): the curvature has that precision, not {_dtype_name(watch)}'s",
            stacklevel=3,
        )
