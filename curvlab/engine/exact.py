r"""A mode under which any PyTorch model can be differentiated twice, exactly, without side effects.

What breaks second derivatives of ordinary models on torch 2.13 (docs/science.md section 1; the tests
in ``tests/test_exact_ops.py`` measure each case against double backward, and the op sweep,
``tests/op_sweep.py``, every op with a derivative formula of its own against central differences of
torch's gradient, by each method, over its options: docs/op-sweep.md has its table):

* flash and memory-efficient attention have neither forward-mode AD nor double backward, so
  ``scaled_dot_product_attention`` must run on the math backend (every method);
* dropout makes the loss random, so the "Hessian" would change between two HVPs (every method);
* ``F.embedding``'s ``padding_idx`` and ``scale_grad_by_freq`` change its gradient without changing
  the function, which makes the gradient's derivative asymmetric, so the HVP methods disagree on a
  batch holding the padding token (every method: the mode drops them, see
  :func:`_embedding_function_only`; ``max_norm``, which renormalizes the weight in place, is refused);
* batch and instance norms in training mode update their running statistics in place: curvature
  must never change the model, and under ``torch.func`` transforms the update even crashes (every
  method);
* the fused norm kernels have wrong second-order *forward-mode* formulas: forward-over-forward (``jvp``
  of ``jvp``, the quadratic forms) through ``layer_norm``, ``instance_norm`` and ``batch_norm`` with
  batch statistics, and ``jacrev`` of ``jacrev`` (``torch.func.hessian``) through their affine forms.

So each method reroutes what is wrong under it (:data:`REROUTES`): the HVP methods keep the fused
kernels, while ``"fwd_fwd"`` (and ``None``: any transform, for users who call ``torch.func.hessian``
themselves) route the three norms through composites of ``mean`` and ``rsqrt``. One rerouting is for
speed, not exactness: under ``"rev_rev"``, ``F.cross_entropy`` over class indices takes its second
backward in closed form (:mod:`curvlab.engine._cross_entropy`, in a few passes over the logits where
autograd's generic formulas take about ten). Beyond the norms, each fused op whose second derivative
torch gets wrong or lacks is routed to a composite of the same value (:mod:`curvlab.engine.composites`)
under the methods where it fails (:data:`_ROUTES`); the ops with no second derivative that no composite
replaces are refused by name with the way out (:data:`_REFUSED`).

Stochastic layers (LayerDrop, DropPath, router jitter, SpecAugment) draw random numbers when their
module is in training mode, and Hugging Face's ``GradientCheckpointingLayer`` recomputes its forward
during the backward pass, outside :func:`torch.func.functional_call` and outside this mode. So the
curvature of a model is that of its eval mode: while the model runs inside the mode
(:func:`eval_forward`), every module but batch and instance norms has ``training=False`` and every
activation-checkpointing flag is off, all put back when the forward returns. A random draw that still
happens inside the mode is reported (a warning naming the place).

With ``watch_dtype=torch.float64`` the mode also reports where the model computes in lower precision
inside (a ``.float()`` of the logits, an RMSNorm computing in float32): the result would carry float32
accuracy. Only casts of tensors that depend on the parameters count (a rotary table computed in float32
is a constant of the function), and every distinct place is named.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _NormBase
from torch.overrides import TorchFunctionMode

from curvlab.engine._attention import math_attention
from curvlab.engine._cross_entropy import closed_form_cross_entropy
from curvlab.engine.composites import (
    composite_batch_norm,
    composite_binary_cross_entropy_with_logits,
    composite_cdist,
    composite_det,
    composite_embedding_bag,
    composite_glu,
    composite_hardsigmoid,
    composite_householder_product,
    composite_huber_loss,
    composite_instance_norm,
    composite_layer_norm,
    composite_logdet,
    composite_mse_loss,
    composite_multi_margin_loss,
    composite_multilabel_margin_loss,
    composite_pdist,
    composite_rrelu,
    composite_slogdet,
    composite_soft_margin_loss,
    composite_solve,
    composite_solve_ex,
    composite_weight_norm,
)
from curvlab.errors import CurvlabError

_ALL = ("rev_rev", "fwd_rev", "fwd_fwd", None)
_FORWARD = ("fwd_rev", "fwd_fwd", None)
_FWD_FWD = ("fwd_fwd", None)
_LINALG = {
    torch.linalg.solve: composite_solve,
    torch.linalg.solve_ex: composite_solve_ex,
    **dict.fromkeys((torch.linalg.det, torch.det, Tensor.det), composite_det),
    **dict.fromkeys((torch.linalg.slogdet, torch.slogdet, Tensor.slogdet), composite_slogdet),
    **dict.fromkeys((torch.logdet, Tensor.logdet), composite_logdet),
    **dict.fromkeys((torch.linalg.householder_product, torch.orgqr, Tensor.orgqr), composite_householder_product),
}
_MARGIN = {F.multi_margin_loss: composite_multi_margin_loss, F.multilabel_margin_loss: composite_multilabel_margin_loss}
_POINTWISE = {
    F.mse_loss: composite_mse_loss,
    F.huber_loss: composite_huber_loss,
    F.soft_margin_loss: composite_soft_margin_loss,
}
# each rerouting: the methods (curvlab.engine.hvp.METHODS, forward-over-forward "fwd_fwd", and None for any
# transform) under which torch's own derivative is wrong or missing, as tests/op_sweep.py measures it
# against central differences of torch's gradient, and the torch functions it replaces by composites
# ("norms" and "cross_entropy" are handled in the mode itself: running statistics, and a closed form that
# is for speed only, where nothing but autograd runs)
_ROUTES: dict[str, tuple[tuple, dict]] = {
    "norms": (_FWD_FWD, {}),
    "cross_entropy": (("rev_rev",), {}),
    "weight_norm": (_ALL, {torch._weight_norm: composite_weight_norm}),  # wrong g-v term; no forward mode
    "embedding_bag": (_ALL, {F.embedding_bag: composite_embedding_bag}),  # no second derivative
    "hardsigmoid": (_ALL, {F.hardsigmoid: composite_hardsigmoid}),  # no second derivative
    "margin_losses": (_ALL, _MARGIN),  # no second derivative
    "distances": (_ALL, {torch.cdist: composite_cdist, F.pdist: composite_pdist}),  # no second derivative
    "pointwise_losses": (_FORWARD, _POINTWISE),  # no forward mode of their backward
    "rrelu": (_FORWARD, {F.rrelu: composite_rrelu}),  # no batching rule (vmap) for its kernel
    "glu": (_FWD_FWD, {F.glu: composite_glu}),  # no forward-over-forward, as logit_loss
    "logit_loss": (_FWD_FWD, {F.binary_cross_entropy_with_logits: composite_binary_cross_entropy_with_logits}),
    "linalg": (_FWD_FWD, _LINALG),  # wrong forward-over-forward
}
# what each method needs rerouted beyond attention, dropout, running statistics and embeddings' gradient options
REROUTES = {m: frozenset(name for name, (methods, _) in _ROUTES.items() if m in methods) for m in _ALL}
_CTC_WAY = (
    "use another loss, or finite differences of gradients (curvlab.engine.finite_difference.finite_difference_hvp)"
)
# the ops with no second derivative in torch and no composite here: (methods, why, the way out)
_REFUSED = {
    F.ctc_loss: (_ALL, "its backward has no derivative in torch", _CTC_WAY),
    F.grid_sample: (_FORWARD, "torch has no forward-mode derivative for it", "use method='rev_rev'"),
}

_F_DROPOUTS = "dropout dropout1d dropout2d dropout3d alpha_dropout feature_alpha_dropout"
_TORCH_DROPOUTS = "dropout alpha_dropout feature_dropout feature_alpha_dropout"  # (called directly)
_DROPOUTS = {getattr(F, n) for n in _F_DROPOUTS.split()} | {getattr(torch, n) for n in _TORCH_DROPOUTS.split()}
_PRECISION = {torch.float64: 3, torch.float32: 2, torch.float16: 1, torch.bfloat16: 1}
# the ops that draw from a random stream (dropout's are made the identity before they get here)
_RANDOM_TORCH = "rand randn randint randperm rand_like randn_like randint_like bernoulli multinomial normal poisson"
_RANDOM_TENSOR = "uniform_ normal_ bernoulli_ random_ exponential_ geometric_ cauchy_ log_normal_ bernoulli"
_RANDOM = {getattr(torch, n) for n in _RANDOM_TORCH.split()} | {getattr(Tensor, n) for n in _RANDOM_TENSOR.split()}
# the flags that turn activation checkpointing on in a module (Hugging Face's, timm's)
CHECKPOINT_FLAGS = ("gradient_checkpointing", "grad_checkpointing")
_SITES_SHOWN = 4
_TORCH_DIR = str(Path(torch.__file__).parent)
_ACTIVE = threading.local()  # the exact modes entered in this thread, innermost last


# F.batch_norm and F.instance_norm share one argument layout; their flag for batch statistics
# ("training", "use_input_stats") is called batch_stats here
_STATISTICS_NORM_ARGS = ("input", "running_mean", "running_var", "weight", "bias", "batch_stats", "momentum", "eps")
_STATISTICS_NORMS = {
    F.batch_norm: ("training", False, composite_batch_norm),
    F.instance_norm: ("use_input_stats", True, composite_instance_norm),
}
# (the positional layout of their arguments)
_EMBEDDING_ARGS = {f: tuple(inspect.signature(f).parameters) for f in (F.embedding, F.embedding_bag)}
# the ops the mode looks at (every other op runs as it is, watched for precision)
_SPECIAL = {Tensor.requires_grad_, F.scaled_dot_product_attention, F.layer_norm, F.group_norm, F.cross_entropy}
_SPECIAL |= {*_DROPOUTS, *_RANDOM, *_STATISTICS_NORMS, *_EMBEDDING_ARGS}


def _tables(method: str | None) -> tuple[dict, dict, frozenset]:
    """A method's rerouted ops {func: composite}, refused ops {func: (why, way)} and every op the mode looks
    at: made once (:data:`_TABLES`), as a mode is entered at every curvature call."""
    routes = {f: composite for name in REROUTES[method] for f, composite in _ROUTES[name][1].items()}
    refused = {f: (why, way) for f, (methods, why, way) in _REFUSED.items() if method in methods}
    return routes, refused, frozenset(_SPECIAL | routes.keys() | refused.keys())


_TABLES = {m: _tables(m) for m in REROUTES}


class _ExactSecondOrderMode(TorchFunctionMode):
    def __init__(self, method: str | None, watch_dtype: torch.dtype | None, frozen: frozenset[int | None]):
        super().__init__()
        reroutes = REROUTES[method]
        self.composite_norms = "norms" in reroutes
        self.closed_form_cross_entropy = "cross_entropy" in reroutes
        self.routes, self.refused, self.special = _TABLES[method]  # (shared, read only)
        self.watch_dtype = watch_dtype
        self.frozen = frozen
        self.downcasts: dict[str, None] = {}  # every distinct place, in order (a dict as an ordered set)
        self.random_draws: dict[str, None] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.special or (self.frozen and args and _in_place(func)):
            return self._handle(func, args, kwargs)
        out = func(*args, **kwargs)  # (most ops: nothing to do but watch)
        if self.watch_dtype is not None:
            self._watch(func, args, kwargs, out)
        return out

    def _handle(self, func, args, kwargs):
        """An op the mode changes, refuses or watches for; or an in-place op on a frozen tensor."""
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
        elif func is F.layer_norm:
            return self._layer_norm(args, kwargs)
        elif func is F.group_norm:
            return _group_norm(args, kwargs)
        elif func is F.embedding or func is F.embedding_bag:
            args, kwargs = _embedding_function_only(func, args, kwargs)
        if func in self.routes and kwargs.get("out") is None:  # (out= has no derivative: torch's own runs)
            func = self.routes[func]
        elif func in self.refused and _differentiated(args, kwargs):
            why, way = self.refused[func]
            raise CurvlabError(f"{func.__name__} can't be differentiated twice exactly: {why}; {way}")
        if func is F.cross_entropy and self.closed_form_cross_entropy:
            func = closed_form_cross_entropy
        out = func(*args, **kwargs)
        if self.watch_dtype is not None:
            self._watch(func, args, kwargs, out)
        return out

    def _layer_norm(self, args, kwargs) -> Tensor:
        """Layer norm as a composite where the method needs one; with a bias and no weight, the norm
        without it plus the bias (torch's double backward of that form is wrong, or fails)."""
        b = dict(zip(("input", "normalized_shape", "weight", "bias", "eps"), args), **kwargs)
        if self.composite_norms:
            return composite_layer_norm(
                b["input"], b["normalized_shape"], b.get("weight"), b.get("bias"), b.get("eps", 1e-5)
            )
        if b.get("weight") is None and b.get("bias") is not None:
            return F.layer_norm(b["input"], b["normalized_shape"], None, None, b.get("eps", 1e-5)) + b["bias"]
        return F.layer_norm(*args, **kwargs)

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
        if weight is None and bias is not None:  # (torch's double backward of that form is wrong, or fails)
            shape = (1, -1) + (1,) * (b["input"].dim() - 2)
            return func(b["input"], *running, None, None, batch_stats, 0.0, eps) + bias.view(shape)
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


def _group_norm(args: tuple, kwargs: dict) -> Tensor:
    """Group norm; with a bias and no weight, the norm without it plus the bias (torch's own first
    derivative of that form fails)."""
    b = dict(zip(("input", "num_groups", "weight", "bias", "eps"), args), **kwargs)
    if b.get("weight") is None and b.get("bias") is not None:
        shape = (1, -1) + (1,) * (b["input"].dim() - 2)
        return F.group_norm(b["input"], b["num_groups"], None, None, b.get("eps", 1e-5)) + b["bias"].view(shape)
    return F.group_norm(*args, **kwargs)


def _embedding_function_only(func, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    r"""An embedding's arguments without those that change its gradient and not its value.

    ``F.embedding``'s ``padding_idx`` only zeroes the padding row's part of the gradient, while the row's
    value still reaches the loss. The derivative of that gradient, :math:`J = M H` (M zeroes the padding
    row's lookup part), is not symmetric: double backward (:math:`J^\top v`) and forward-over-reverse
    (:math:`J v`) disagree whenever the batch holds the padding token. ``scale_grad_by_freq`` is the same
    asymmetry. Without them every method gives the Hessian H of the loss. (``F.embedding_bag``'s
    ``padding_idx`` leaves entries out of their bags, a change of value, and stays.)

    Raises:
        CurvlabError: ``max_norm``, which renormalizes the weight's rows in place during the forward:
            curvature would change the parameters it is taken at.
    """
    b = dict(zip(_EMBEDDING_ARGS[func], args), **kwargs)
    if b.get("max_norm") is not None:
        raise CurvlabError(
            f"{func.__name__} with max_norm renormalizes the weight's rows in place during the forward, so "
            "curvature would change the parameters it is taken at; renormalize once beforehand and pass max_norm=None"
        )
    gradient_only = ("padding_idx", "scale_grad_by_freq") if func is F.embedding else ("scale_grad_by_freq",)
    if all(b.get(k) is None or b.get(k) is False for k in gradient_only):
        return args, kwargs
    return (), {**b, **{k: (None if k == "padding_idx" else False) for k in gradient_only}}


def _differentiated(args: tuple, kwargs: dict) -> bool:
    """Whether a call forms a derivative (a loss value under ``no_grad`` is still allowed)."""
    return any(_carries_derivative(a) for a in (*args, *kwargs.values()) if isinstance(a, Tensor))


def _carries_derivative(t: Tensor) -> bool:
    """Whether ``t`` is differentiated: wrapped by a ``torch.func`` grad or jvp level (forward mode needs no
    grad mode; a ``vmap`` level alone is no derivative), or requiring grad while grad mode is on."""
    while torch._C._functorch.is_batchedtensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    if torch._C._functorch.is_functorch_wrapped_tensor(t):
        return True
    return t.requires_grad and torch.is_grad_enabled()


def _model_marks_wrapped(t: Tensor) -> bool:
    """Whether a ``requires_grad_`` call on ``t`` is the model's (not torch's own, as ``torch.func.grad``
    marks its inputs) on a tensor wrapped by a ``torch.func`` transform."""
    if not torch._C._functorch.is_functorch_wrapped_tensor(t):
        return False
    frame = sys._getframe(1)
    while frame.f_code.co_filename == __file__:  # (the mode's own frames: then the one that called requires_grad_)
        frame = frame.f_back
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

    Every module but batch and instance norms (which keep their batch statistics) gets ``training=False``,
    and every :data:`CHECKPOINT_FLAGS` flag that is on is turned off (its recompute would run outside the
    mode, on the module's own weights); all put back on exit.
    """
    if model is None or not in_exact_mode():
        yield
        return
    training, flags = [], []
    for m in model.modules():
        if m.training and not isinstance(m, _NormBase):
            training.append(m)
        for f in CHECKPOINT_FLAGS:
            if _flag_on(m, f):
                flags.append((m, f))
    try:
        for m in training:
            _set_training(m, False)  # (the attribute, not .eval(): .eval() would reach the batch norms too)
        for m, f in flags:
            setattr(m, f, False)
        yield
    finally:
        for m in training:
            _set_training(m, True)
        for m, f in flags:
            setattr(m, f, True)


def _flag_on(m: nn.Module, flag: str) -> bool:
    """``getattr(m, flag, None) is True``, without nn.Module's __getattr__, which raises (slowly, at every module
    of every forward) for a name a module lacks: the class's attribute where the class has the name, else the
    instance's own."""
    return (getattr(m, flag, None) if hasattr(type(m), flag) else m.__dict__.get(flag)) is True


def _set_training(m: nn.Module, mode: bool) -> None:
    """``m.training = mode`` without nn.Module's __setattr__ search of the module's tables (at every module of
    every forward), unless the class sets attributes its own way."""
    if type(m).__setattr__ is nn.Module.__setattr__:
        object.__setattr__(m, "training", mode)
    else:
        m.training = mode


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
    """``torch.utils.checkpoint.checkpoint`` called by a model that no flag controls runs its function
    plainly: a recompute would run outside ``functional_call`` and this mode, and ``torch.func`` refuses
    checkpointing's saved-tensor hooks. (Patched where ``checkpoint`` looks them up, process-wide while the
    outermost exact mode lasts.)"""
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
    in-place operations on the tensors in ``keep`` are skipped. A model's forward runs as in eval mode
    (:func:`eval_forward`; :class:`~curvlab.engine.loss.ModuleLoss` does this by itself, pass ``model``
    for a loss function of your own over a module), and ``torch.utils.checkpoint`` runs its function
    plainly. Each method's reroutings are the module docstring's. Re-entrant.

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
    mode = _ExactSecondOrderMode(method, watch, frozen)
    modes = _ACTIVE.__dict__.setdefault("modes", [])
    checkpoint_off = contextlib.nullcontext() if modes else _torch_checkpoint_off()
    with math_attention(), mode, checkpoint_off:
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
