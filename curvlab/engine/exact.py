r"""A mode under which any PyTorch model can be differentiated twice, exactly, without side effects.

What breaks second derivatives of ordinary models on torch 2.13 (docs/science.md section 1; the tests
in ``tests/test_exact_ops.py`` measure each case against double backward):

* flash and memory-efficient attention have neither forward-mode AD nor double backward, so
  ``scaled_dot_product_attention`` must run on the math backend (every method);
* dropout makes the loss random, so the "Hessian" would change between two HVPs (every method);
* ``F.embedding``'s ``padding_idx`` zeroes part of the padding row's gradient without changing the
  function, which makes the gradient's derivative asymmetric, so the HVP methods disagree on a batch
  holding the padding token (every method: the mode drops it, see :func:`_without_padding_idx`);
* batch and instance norms in training mode update their running statistics in place: curvature
  must never change the model, and under ``torch.func`` transforms the update even crashes (every
  method);
* the fused norm kernels have wrong second-order *forward-mode* formulas. Forward-over-forward
  (``jvp`` of ``jvp``, the quadratic forms) is wrong through ``layer_norm``, ``instance_norm`` and
  ``batch_norm`` with batch statistics, and ``jacrev`` of ``jacrev`` (``torch.func.hessian``) through
  their affine forms. Forward-over-reverse (``jvp`` of ``grad``) and double backward are right, and
  ``group_norm``, ``rms_norm`` and ``batch_norm`` with running statistics are right under all four.

So each method reroutes what is wrong under it (:data:`REROUTES`): the HVP methods ``"rev_rev"``
and ``"fwd_rev"`` keep the fused kernels, while ``"fwd_fwd"`` (and ``None``: any transform, for users
who call ``torch.func.hessian`` themselves) route the three norms through composites of ``mean`` and
``rsqrt``, whose derivatives of every order and mode are exact. One rerouting is for speed, not
exactness: under ``"rev_rev"``, ``F.cross_entropy`` over class indices takes its second backward in
closed form (:mod:`curvlab.engine._cross_entropy`: the same loss and gradient bit for bit, the same
Hessian to rounding, in a few passes over the logits where autograd's generic formulas take about ten).

Stochastic layers and activation checkpointing are the model's, not the functional ops': LayerDrop
(``torch.rand([]) < layerdrop``: OPT, BART, Whisper), DropPath / stochastic depth (``torch.rand``
masks: ConvNext, Swin, BEiT), router jitter and SpecAugment masking all draw random numbers when
their module is in training mode, and Hugging Face's ``GradientCheckpointingLayer`` recomputes its
forward during the backward pass, outside :func:`torch.func.functional_call` (with the module's own,
e.g. float32, weights) and outside this mode. So the curvature of a model is that of its eval mode:
while the model runs inside the mode (:func:`eval_forward`, which :class:`~curvlab.engine.loss.ModuleLoss`
enters by itself), every module but batch and instance norms has ``training=False`` and every
``gradient_checkpointing``/``grad_checkpointing`` flag (Hugging Face's, timm's) is off; batch norms
keep their batch statistics (and never update running ones). Both are put back as they were when
the forward returns, so a training run goes on as before. A random draw that still happens inside
the mode is reported (a warning naming the place): that curvature would differ from call to call.

With ``watch_dtype=torch.float64`` the mode also reports where the model computes in lower precision
inside (a ``.float()`` of the logits, an RMSNorm computing in float32): the result would carry float32
accuracy, whatever dtype the parameters have. Only casts of tensors that depend on the parameters
count (a rotary ``inv_freq`` table computed in float32 is a constant of the function, not a loss of
its precision), and every distinct place is named.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.modules.batchnorm import _NormBase
from torch.overrides import TorchFunctionMode

from curvlab.engine._cross_entropy import closed_form_cross_entropy
from curvlab.errors import CurvlabError

# what each method needs rerouted beyond attention, dropout and running statistics: the HVP methods
# (curvlab.engine.hvp.METHODS), forward-over-forward ("fwd_fwd") and None (any transform)
# ("cross_entropy": a second backward in closed form, for speed only, where nothing but autograd runs)
REROUTES = {
    "rev_rev": frozenset({"cross_entropy"}),
    "fwd_rev": frozenset(),
    "fwd_fwd": frozenset({"norms"}),
    None: frozenset({"norms"}),
}

_DROPOUTS = {
    F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
    torch.dropout, torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout,  # (called directly)
}  # fmt: skip
_PRECISION = {torch.float64: 3, torch.float32: 2, torch.float16: 1, torch.bfloat16: 1}
# the ops that draw from a random stream (dropout's are made the identity before they get here)
_RANDOM = {
    torch.rand, torch.randn, torch.randint, torch.randperm, torch.rand_like, torch.randn_like, torch.randint_like,
    torch.bernoulli, torch.multinomial, torch.normal, torch.poisson, torch.Tensor.uniform_, torch.Tensor.normal_,
    torch.Tensor.bernoulli_, torch.Tensor.random_, torch.Tensor.exponential_, torch.Tensor.geometric_,
    torch.Tensor.cauchy_, torch.Tensor.log_normal_, torch.Tensor.bernoulli,
}  # fmt: skip
# the flags that turn activation checkpointing on in a module (Hugging Face's, timm's)
CHECKPOINT_FLAGS = ("gradient_checkpointing", "grad_checkpointing")
_SITES_SHOWN = 4
_TORCH_DIR = str(Path(torch.__file__).parent)
_ACTIVE = threading.local()  # the exact modes entered in this thread, innermost last


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
    def __init__(self, reroutes: frozenset[str], watch_dtype: torch.dtype | None, frozen: frozenset[int | None]):
        super().__init__()
        self.composite_norms = "norms" in reroutes
        self.closed_form_cross_entropy = "cross_entropy" in reroutes
        self.watch_dtype = watch_dtype
        self.frozen = frozen
        self.downcasts: dict[str, None] = {}  # every distinct place, in order (a dict as an ordered set)
        self.random_draws: dict[str, None] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.frozen and args and _in_place(func) and _storage(args[0]) in self.frozen:
            return args[0]  # e.g. nn.BatchNorm's num_batches_tracked.add_(1): the model stays as it was
        if func in _DROPOUTS:
            return args[0] if args else kwargs["input"]
        if func is Tensor.requires_grad_ and args and _model_marks_wrapped(args[0]):
            # Hugging Face's enable_input_require_grads hook (for reentrant checkpointing, off in here) does this
            # to the embeddings' output; under a torch.func transform it is refused, and it changes no derivative
            return args[0]
        if func in _RANDOM:
            self._note_random(func)
        if func is F.scaled_dot_product_attention:
            kwargs = {**kwargs, "dropout_p": 0.0}
            if len(args) > 4:  # dropout_p passed positionally
                args = (*args[:4], 0.0, *args[5:])
        elif func in _STATISTICS_NORMS:
            return self._statistics_norm(func, args, kwargs)
        elif func is F.layer_norm and self.composite_norms:
            return composite_layer_norm(*args, **kwargs)
        elif func is F.embedding:
            args, kwargs = _without_padding_idx(args, kwargs)
        elif func is F.cross_entropy and self.closed_form_cross_entropy:
            func = closed_form_cross_entropy
        out = func(*args, **kwargs)
        if self.watch_dtype is not None:
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
        """Remember every place that turns a ``watch_dtype`` tensor depending on the parameters into a
        lower-precision float (a cast of a constant, such as a rotary table, changes no derivative)."""
        if not (isinstance(out, Tensor) and _PRECISION.get(out.dtype, 9) < _PRECISION[self.watch_dtype]):
            return
        inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
        if any(a.dtype == self.watch_dtype and _depends_on_parameters(a) for a in inputs):
            name = getattr(func, "__name__", str(func))
            self.downcasts.setdefault(f"{name}() to {_dtype_name(out.dtype)} at {_caller()}")

    def _note_random(self, func) -> None:
        """Remember where the model draws random numbers (curvlab's own draws, such as probe vectors,
        are not the model's)."""
        site = _caller(include_curvlab=True)
        if not site.startswith(_CURVLAB_SITE):
            self.random_draws.setdefault(f"{getattr(func, '__name__', str(func))}() at {site}")


_EMBEDDING_ARGS = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")


def _without_padding_idx(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    r"""``F.embedding``'s arguments without ``padding_idx``: the same values, and the derivatives of the function.

    ``padding_idx`` changes no value: it only zeroes the padding row's part of the gradient, while
    the row's value still reaches the loss (and a tied head trains it). The derivative of that
    gradient, :math:`J = M H` (M zeroes the padding row's lookup part), is not symmetric: double
    backward (:math:`J^\top v`) and forward-over-reverse (:math:`J v`) disagree whenever the batch
    holds the padding token (by 100% on a tiny OPT). Without it, every method gives the Hessian H of
    the loss, and G its gradient; they differ from torch's ``.grad`` only in the padding row.
    """
    b = dict(zip(_EMBEDDING_ARGS, args), **kwargs)
    if b.get("padding_idx") is None:
        return args, kwargs
    b["padding_idx"] = None
    return (), b


def _model_marks_wrapped(t: Tensor) -> bool:
    """Whether a ``requires_grad_`` call on ``t`` is the model's (not torch's own, as ``torch.func.grad``
    marks its inputs) on a tensor wrapped by a ``torch.func`` transform."""
    if not torch._C._functorch.is_functorch_wrapped_tensor(t):
        return False
    frame = sys._getframe(2)  # (1 is __torch_function__; 2 called requires_grad_)
    return not frame.f_code.co_filename.startswith(_TORCH_DIR)


def _depends_on_parameters(t: Tensor) -> bool:
    """Whether ``t`` carries derivatives: it requires grad (double backward) or is wrapped by a
    ``torch.func`` transform (``jvp``, ``grad``, ``vmap``: the forward-mode and vmapped paths)."""
    return t.requires_grad or torch._C._functorch.is_functorch_wrapped_tensor(t)


def _sites(places: dict[str, None]) -> str:
    shown = list(places)[:_SITES_SHOWN]
    more = len(places) - len(shown)
    return "; ".join(shown) + (f"; and {more} more" if more else "")


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


_CURVLAB_SITE = "curvlab/"


def _caller(include_curvlab: bool = False) -> str:
    """``file:line in function`` of the innermost frame outside torch and curvlab: the model's code.
    With ``include_curvlab``, only this module's frames are passed over, and a frame in the rest of
    curvlab is named ``curvlab/file:line`` (curvlab's own call, not the model's)."""
    package = str(Path(__file__).parents[1])  # the curvlab package, above engine/
    skip = (_TORCH_DIR, __file__ if include_curvlab else package)
    frame = sys._getframe(1)  # (frames, not traceback.extract_stack: no source lines are read)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(skip):
            if filename.startswith(package):
                return f"{_CURVLAB_SITE}{Path(filename).name}:{frame.f_lineno}"
            return f"{Path(filename).name}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "an unknown place"


def running_statistics(module: nn.Module | None) -> list[Tensor]:
    """The buffers of every batch and instance norm of ``module`` (running means and variances, and
    ``num_batches_tracked``, which ``nn.BatchNorm`` counts in its Python ``forward``)."""
    if module is None:
        return []
    return [b for m in module.modules() if isinstance(m, _NormBase) for b in m.buffers(recurse=False)]


def in_exact_mode() -> bool:
    """Whether this thread is inside :func:`exact_second_order`."""
    return bool(getattr(_ACTIVE, "modes", None))


@contextlib.contextmanager
def eval_forward(model: nn.Module | None) -> Iterator[None]:
    """Inside :func:`exact_second_order` (a no-op outside it): run ``model`` as in eval mode.

    Every module but batch and instance norms gets ``training=False`` (LayerDrop, DropPath, router
    jitter, dropout modules and Hugging Face's training-only paths off), and every
    ``gradient_checkpointing``/``grad_checkpointing`` flag that is on is turned off (its recompute
    would run outside the mode, on the module's own weights); batch and instance norms stay as they
    are (batch statistics in training mode; the mode never lets them update running statistics).
    Everything is put back on exit. :class:`~curvlab.engine.loss.ModuleLoss` wraps its forward in this.
    """
    if model is None or not in_exact_mode():
        yield
        return
    training, flags = [], []
    for m in model.modules():
        if m.training and not isinstance(m, _NormBase):
            training.append(m)
        flags.extend((m, f) for f in CHECKPOINT_FLAGS if getattr(m, f, None) is True)
    try:
        for m in training:
            m.training = False  # (the attribute, not .eval(): .eval() would reach the batch norms too)
        for m, f in flags:
            setattr(m, f, False)
        yield
    finally:
        for m in training:
            m.training = True
        for m, f in flags:
            setattr(m, f, True)


class _NoCheckpoint:
    """Stands in for ``torch.utils.checkpoint.CheckpointFunction``: runs the function, keeps its graph."""

    @staticmethod
    def apply(function, preserve_rng_state, *args):
        return function(*args)


def _no_checkpoint_generator(*args, **kwargs):
    """Stands in for torch's non-reentrant checkpoint context: nothing before the forward, nothing after."""
    yield


@contextlib.contextmanager
def _torch_checkpoint_off() -> Iterator[None]:
    """``torch.utils.checkpoint.checkpoint`` (and ``checkpoint_sequential``) called by a model that no
    flag controls run their function plainly: a recompute would run during the backward pass, outside
    ``functional_call`` (on the module's own weights) and outside this mode, and ``torch.func``
    refuses checkpointing's saved-tensor hooks. The curvature is the same without checkpointing.
    (Patched where ``checkpoint`` looks them up, so every way of importing it is covered; process-wide
    while the outermost exact mode lasts.)"""
    names = ("CheckpointFunction", "_checkpoint_without_reentrant_generator")
    stand_ins = (_NoCheckpoint, _no_checkpoint_generator)
    saved = {n: getattr(torch_checkpoint, n) for n in names if hasattr(torch_checkpoint, n)}
    try:
        for name, stand_in in zip(names, stand_ins):
            if name in saved:
                setattr(torch_checkpoint, name, stand_in)
        yield
    finally:
        for name, original in saved.items():
            setattr(torch_checkpoint, name, original)


@contextlib.contextmanager
def exact_second_order(
    *,
    method: str | None = None,
    watch_dtype: torch.dtype | None = None,
    keep: Sequence[Tensor] = (),
    model: nn.Module | None = None,
) -> Iterator[None]:
    """Context in which second derivatives of any model are exact, deterministic and side-effect free.

    Inside it, for every ``method``: attention runs on the math backend with dropout 0, all functional
    dropouts are the identity, batch and instance norms never update their running statistics, and
    in-place operations on the tensors in ``keep`` (pass :func:`running_statistics` of the model) are
    skipped. A model's forward runs as in eval mode (see :func:`eval_forward`: no LayerDrop, DropPath
    or activation checkpointing; :class:`~curvlab.engine.loss.ModuleLoss` does this by itself, pass ``model``
    for a loss function of your own over a module), and ``torch.utils.checkpoint`` called regardless
    of any flag runs its function plainly (:func:`_torch_checkpoint_off`). A random draw by the model
    that is still left is reported with a warning naming the place.
    For ``method`` ``"fwd_fwd"`` or ``None`` (any transform, ``torch.func.hessian`` included),
    ``F.layer_norm``, ``F.batch_norm`` with batch statistics and ``F.instance_norm`` also run as
    composites (:func:`composite_layer_norm`, ...); for ``"rev_rev"``, ``F.cross_entropy`` takes its
    second backward in closed form (:mod:`curvlab.engine._cross_entropy`, for speed). Re-entrant.

    Args:
        method: ``"rev_rev"`` or ``"fwd_rev"`` (the HVP methods), ``"fwd_fwd"`` (quadratic forms), or
            ``None`` for every rerouting that makes a derivative exact under any transform.
        watch_dtype: warn, naming every place, when the model turns a tensor of this dtype (e.g.
            float64) that depends on the parameters into a lower-precision float: its curvature then
            has that lower precision.
        keep: tensors never modified in place inside the mode.
        model: a module to run as in eval mode for the whole context (and whose running statistics
            are kept, with ``keep``).
    """
    if method not in REROUTES:
        known = ", ".join(m for m in REROUTES if m is not None)
        raise CurvlabError(f"unknown method {method!r} for the exact mode; choose one of {known}")
    watch = watch_dtype if watch_dtype in _PRECISION else None
    frozen = frozenset(_storage(t) for t in [*keep, *running_statistics(model)])
    mode = _ExactSecondOrderMode(REROUTES[method], watch, frozen)
    modes = _ACTIVE.__dict__.setdefault("modes", [])
    checkpoint_off = contextlib.nullcontext() if modes else _torch_checkpoint_off()
    with sdpa_kernel(SDPBackend.MATH), mode, checkpoint_off:
        modes.append(mode)
        try:
            with eval_forward(model):
                yield
        finally:
            modes.pop()
    if mode.downcasts:
        warnings.warn(
            f"{_dtype_name(watch)} was requested, but the model computes in lower precision inside "
            f"({_sites(mode.downcasts)}): the curvature has that precision, not {_dtype_name(watch)}'s",
            stacklevel=3,
        )
    if mode.random_draws:
        warnings.warn(
            f"the model draws random numbers inside the exact mode ({_sites(mode.random_draws)}), even "
            "with its modules in eval mode: its curvature changes from call to call",
            stacklevel=3,
        )
