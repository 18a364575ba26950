r"""The loss-function convention: ``loss_fn(params, batch) -> scalar``, and batches to accumulate over.

Every curvature function takes a pure function of a parameter dict, exactly like ``torch.func``.
:func:`make_loss_fn` builds one from any ``nn.Module``, Hugging Face models included:

* a batch is a tuple ``(inputs, targets)`` (the model is called as ``model(inputs)``) or a dict of
  keyword inputs with the targets under ``"labels"`` (``model(**inputs)``, e.g. ``input_ids`` and
  ``attention_mask``; the labels are *not* passed to the model);
* the model may return the logits, an object with ``.logits`` (Hugging Face's outputs), a dict with
  a ``"logits"`` key, or a tuple whose first element is the logits;
* the loss is computed here from the logits, in the working dtype, never taken from the model:
  Hugging Face's ``.loss`` casts the logits with ``.float()`` (float32 accuracy);
* its semantics are the model's own: for a causal LM (a ``loss_type`` of ``ForCausalLM``, or unset on
  a model that generates, as GPT-2's ``LMHeadModel``) the logits at position t predict the label at
  t + 1; sequence classification is cross-entropy, MSE (one label) or BCE (multi-label), as Hugging
  Face decides; any other model compares position by position. Labels equal to ``ignore_index``
  (-100) are left out, and the loss is the mean over the rest;
* a ``criterion(logits, targets)`` is given them unshifted unless the model is a causal LM or
  ``shift=True``: a regression, a contrastive (CLIP, SigLIP) or a CTC loss sees the model's own
  outputs. A dual encoder's logits are its ``logits_per_text`` (texts x images);
* an encoder-decoder (``config.is_encoder_decoder``: T5, BART, Whisper, ...) gets
  ``decoder_input_ids`` from the labels as the model itself makes them, and the loss is the unshifted
  token cross-entropy of the decoder's logits against the labels: Hugging Face's ``.loss``;
* a peft prompt-tuning model prepends its virtual tokens to the inputs: the labels get as many -100
  in front, as peft does;
* the model runs as in eval mode inside curvlab's exact mode (:func:`~curvlab.engine.exact.eval_forward`),
  as it is in its own mode elsewhere.

Several batches are passed as a ``list`` (or a :class:`Batches`, to give weights explicitly); the
loss they stand for is the mean over *all* their loss terms, so each batch is weighted by the number
of terms its loss really averages (after the causal shift and the ignored labels):

.. math::  L = \sum_j \frac{n_j}{\sum_i n_i} L_j, \qquad n_j = \text{loss terms in batch } j.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from curvlab.engine.exact import eval_forward
from curvlab.errors import CurvlabError

LossFn = Callable[[Mapping[str, Tensor], Any], Tensor]
IGNORE_INDEX = -100
_INTEGER = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)

# Hugging Face's loss_type -> how curvlab computes the same loss (an unset one: see hf_task)
_CAUSAL, _TOKENS, _SEQUENCE, _SEQ2SEQ = "causal_lm", "tokens", "sequence_classification", "seq2seq"
_HF_TASKS = {
    "ForCausalLM": _CAUSAL,
    "ForConditionalGeneration": _CAUSAL,  # (as Hugging Face's loss mapping has it; an encoder-decoder is seq2seq)
    "ForMaskedLM": _TOKENS,
    "ForTokenClassification": _TOKENS,
    "ForSequenceClassification": _SEQUENCE,
    "ForImageClassification": _SEQUENCE,
    "ForAudioClassification": _SEQUENCE,
    "ForVideoClassification": _SEQUENCE,
}


def token_cross_entropy(logits: Tensor, targets: Tensor, *, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Mean cross-entropy over all positions of ``(..., classes)`` logits; targets equal to
    ``ignore_index`` are left out. Half-precision logits are upcast to float32.

    Args:
        logits: unnormalized scores, shape ``(..., classes)``.
        targets: class indices, shape ``(...)`` (the logits' shape without the last dimension).
        ignore_index: the target value left out (default -100, as torch and Hugging Face).

    Returns:
        The mean cross-entropy in nats, a scalar tensor in the logits' dtype (float32 for half precision).
    """
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=ignore_index)


# Where an output keeps its logits, in order: a dual encoder (CLIP, SigLIP, ALIGN, CLAP) has no
# ``logits`` but the similarities of its texts to its images (or audio), which its own loss is computed from
_LOGITS_FIELDS = ("logits", "logits_per_text")


def logits_of(output: Any) -> Tensor:
    """The logits in a model's output: a tensor, ``.logits`` or ``["logits"]``, a dual encoder's
    ``.logits_per_text`` or ``["logits_per_text"]``, or a tuple's first element."""
    if isinstance(output, Tensor):
        return output
    for field in _LOGITS_FIELDS:
        if isinstance(getattr(output, field, None), Tensor):
            return getattr(output, field)
        if isinstance(output, Mapping) and isinstance(output.get(field), Tensor):
            return output[field]
    if isinstance(output, Mapping):
        raise CurvlabError(
            f"the model returned a dict without 'logits' or 'logits_per_text' (keys: {', '.join(map(str, output))})"
        )
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
        return output[0]
    raise CurvlabError(f"can't find logits in the model's output of type {type(output).__name__}")


def shifted_right(labels: Tensor, model: nn.Module) -> Tensor:
    """The decoder inputs an encoder-decoder without ``prepare_decoder_input_ids_from_labels`` (Whisper)
    makes from its labels, as Hugging Face's ``shift_tokens_right``: one position right behind
    ``decoder_start_token_id``, ignored labels as ``pad_token_id``.

    Raises:
        CurvlabError: a config without ``decoder_start_token_id`` or ``pad_token_id``.
    """
    config = getattr(model, "config", None)
    start, pad = getattr(config, "decoder_start_token_id", None), getattr(config, "pad_token_id", None)
    if start is None or pad is None:
        raise CurvlabError(
            f"the encoder-decoder {type(model).__name__} has no decoder_start_token_id and pad_token_id to make "
            "decoder inputs from labels: pass decoder_input_ids in the batch"
        )
    shifted = labels.new_full(labels.shape, start)
    shifted[..., 1:] = labels[..., :-1]
    return shifted.masked_fill(shifted == IGNORE_INDEX, pad)


# the names transformers' mixture-of-experts models give the weight of ``aux_loss`` in their own loss
_AUX_LOSS_COEFS = ("router_aux_loss_coef", "aux_loss_coef")


def router_losses(output: Any) -> dict[str, Tensor]:
    """The router losses a mixture-of-experts model returns beside its logits: every tensor field named
    ``*aux_loss`` or ``*z_loss`` (empty when ``output_router_logits`` is off)."""
    if not isinstance(output, Mapping):
        return {}
    return {k: v for k, v in output.items() if isinstance(v, Tensor) and k.endswith(("aux_loss", "z_loss"))}


def base_model(model: nn.Module) -> nn.Module:
    """The model under a peft wrapper (the model itself otherwise)."""
    return model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model


def hf_task(model: nn.Module) -> str | None:
    """How a Hugging Face model's own loss is computed: ``"causal_lm"``, ``"tokens"`` (masked LM, token
    classification), ``"sequence_classification"``, ``"seq2seq"``, ``"unknown"``, or ``None`` for a model
    that isn't a Hugging Face model (a peft wrapper is looked through).

    Args:
        model: the module, or a peft wrapper of it.
    """
    base = base_model(model)
    if not hasattr(base, "loss_type") or not hasattr(base, "config"):
        return None
    if base.loss_type is None:
        # Hugging Face derives loss_type from the class name, so it is unset on GPT-2's LMHeadModel but also
        # on dual encoders and headless models, whose logits aren't next-token ones: only a model that
        # generates computes the causal-LM loss it falls back to
        task = _CAUSAL if _generates(base) else "unknown"
    else:
        task = _HF_TASKS.get(base.loss_type, "unknown")
    if task in (_CAUSAL, "unknown") and getattr(base.config, "is_encoder_decoder", False):
        return _SEQ2SEQ
    return task


def _generates(model: nn.Module) -> bool:
    """Whether a Hugging Face model generates with ``.generate()`` (it derives from ``GenerationMixin``)."""
    can_generate = getattr(model, "can_generate", None)
    return bool(can_generate()) if callable(can_generate) else False


# peft's prompt-learning methods that prepend virtual tokens to the inputs (prefix tuning extends the
# attention's keys and values instead: its logits are as long as the inputs)
_PREPENDING = ("PROMPT_TUNING", "P_TUNING", "MULTITASK_PROMPT_TUNING")


def virtual_tokens(model: nn.Module) -> int:
    """How many positions a peft prompt-tuning model prepends to its inputs (0 for any other model)."""
    config = getattr(model, "active_peft_config", None)
    if config is None or not getattr(config, "is_prompt_learning", False):
        return 0
    kind = getattr(config.peft_type, "value", config.peft_type)
    return int(config.num_virtual_tokens) if kind in _PREPENDING else 0


class ModuleLoss:
    r"""``loss_fn(params, batch)``: the loss of ``model`` with ``params`` substituted, on ``batch``.

    Runs ``model`` through :func:`torch.func.functional_call`; names not in ``params`` keep the module's own
    tensors. Every floating tensor the model reads that isn't in ``params`` (frozen parameters, buffers,
    floating inputs) is cast to the parameters' dtype.

    Attributes:
        model: the module.
        criterion: ``criterion(logits, targets) -> scalar``, or ``None`` for the model's own semantics
            (see the module docstring), computed in the working dtype.
        ignore_index: the label value left out of the loss and of the term count.
        shift: whether position t's logits predict label t + 1, with or without a criterion (``None`` at
            construction: a causal LM; any other model's logits and labels are compared as they come).
        tie_weights: passed to ``functional_call``: a parameter given for one of several tied names
            stands for all of them.
        task: how the model's own loss is computed (:func:`hf_task`; ``None`` for a plain module).
        virtual_tokens: positions a peft prompt-tuning model prepends (their labels are -100).
        router_loss: whether a mixture-of-experts model's load-balancing loss is added as its own
            ``outputs.loss`` adds it (``router_aux_loss_coef * aux_loss``); one curvlab can't weigh as the
            model does (a z-loss, an ``aux_loss`` without coefficient) is refused, never left out silently.
            Over micro-batches each one's router term is weighted by its share of the loss terms (the
            Trainer, given ``num_items_in_batch``, adds each at full weight: k times curvlab's for k).
    """

    def __init__(
        self,
        model: nn.Module,
        criterion: Callable[[Tensor, Tensor], Tensor] | None = None,
        ignore_index: int = IGNORE_INDEX,
        shift: bool | None = None,
        tie_weights: bool = True,
        label_key: str = "labels",
        router_loss: bool = True,
    ):
        self.model = model
        self.router_loss = router_loss
        self.criterion = criterion
        self.ignore_index = ignore_index
        if shift is not None and not isinstance(shift, bool):
            raise CurvlabError(f"shift= is True, False or None (the model decides), got {shift!r}")
        task = hf_task(model)
        if task == "unknown" and criterion is None:
            raise CurvlabError(f"curvlab doesn't know the loss of a {type(model).__name__}: pass criterion=")
        self.task = task
        self.shift = (task == _CAUSAL) if shift is None else shift
        self.tie_weights = tie_weights
        self.label_key = label_key
        # (token tasks only: a sequence classifier's logits don't grow with the prompt)
        self.virtual_tokens = virtual_tokens(model) if task in (_CAUSAL, _TOKENS) else 0

    def split(self, batch: Any) -> tuple[tuple, dict[str, Any], Any]:
        """``(args, kwargs, targets)`` of a tuple ``(inputs, targets)`` or a dict batch."""
        if isinstance(batch, Mapping):
            if self.label_key not in batch:
                raise CurvlabError(
                    f"the dict batch has no {self.label_key!r} (keys: {', '.join(map(str, batch))}); "
                    "curvlab computes the loss from the labels"
                )
            kwargs = {k: v for k, v in batch.items() if k != self.label_key}
            return (), self._decoder_inputs(kwargs, batch[self.label_key]), batch[self.label_key]
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            return (batch[0],), self._decoder_inputs({}, batch[1]), batch[1]
        raise CurvlabError(
            f"a batch is (inputs, targets) or a dict with {self.label_key!r}, got {type(batch).__name__}"
            + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
        )

    def _decoder_inputs(self, kwargs: dict[str, Any], labels: Any) -> dict[str, Any]:
        """An encoder-decoder's keyword inputs with ``decoder_input_ids`` made from the labels, as the
        model makes them when given labels (unless the batch brings its own decoder inputs)."""
        if self.task != _SEQ2SEQ or "decoder_input_ids" in kwargs or "decoder_inputs_embeds" in kwargs:
            return kwargs
        if not isinstance(labels, Tensor):
            raise CurvlabError(f"a sequence-to-sequence batch's labels must be a tensor, got {type(labels).__name__}")
        base = base_model(self.model)
        make = getattr(base, "prepare_decoder_input_ids_from_labels", None)
        if callable(make):
            return {**kwargs, "decoder_input_ids": make(labels=labels)}
        return {**kwargs, "decoder_input_ids": shifted_right(labels, base)}

    def _prompted(self, targets: Any) -> Any:
        """Token labels with ``ignore_index`` in front for a prompt-tuning model's virtual tokens, as peft does."""
        if not (self.virtual_tokens and isinstance(targets, Tensor) and targets.dim() >= 2):
            return targets
        prefix = targets.new_full((*targets.shape[:-1], self.virtual_tokens), self.ignore_index)
        return torch.cat([prefix, targets], dim=-1)

    def targets(self, targets: Tensor) -> Tensor:
        """The targets the loss compares with: behind the virtual tokens of a prompt-tuning model, and
        shifted one position left for a causal LM (or ``shift=True``): along the last axis of token labels,
        the one before it of floating targets (shaped like the logits).

        Args:
            targets: the batch's targets.
        """
        targets = self._prompted(targets)
        if not self.shift:
            return targets
        if not isinstance(targets, Tensor):
            raise CurvlabError(f"the causal shift needs tensor targets, got {type(targets).__name__}: pass shift=False")
        return targets[..., 1:, :] if targets.is_floating_point() and targets.dim() >= 2 else targets[..., 1:]

    def loss_terms(self, batch: Any) -> int:
        """The number of terms the loss of ``batch`` averages: integer targets after the causal shift that
        aren't ``ignore_index``, or every entry of float targets."""
        _, _, targets = self.split(batch)
        return _count(self.targets(targets) if isinstance(targets, Tensor) else targets, self.ignore_index)

    def loss_from_logits(self, logits: Tensor, targets: Any) -> Tensor:
        """The loss given the model's logits and the batch's targets (the model's own semantics)."""
        targets = self.targets(targets)
        if self.shift:
            logits = logits[..., :-1, :]
        if self.criterion is not None:
            return self.criterion(logits, targets)
        if self.task == _SEQUENCE:
            return self._sequence_loss(logits, targets)
        positions = logits.numel() // max(logits.size(-1), 1) if logits.dim() >= 1 else None
        if isinstance(targets, Tensor) and positions is not None and positions != targets.numel():
            raise CurvlabError(
                f"the model's logits {tuple(logits.shape)} don't match its labels {tuple(targets.shape)} position "
                "for position (the model adds or drops positions curvlab doesn't know of): pass criterion="
            )
        return token_cross_entropy(logits, targets, ignore_index=self.ignore_index)

    def _sequence_loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        """Hugging Face's sequence-classification loss, chosen as it chooses (without mutating the config)."""
        config = base_model(self.model).config
        num_labels = config.num_labels
        problem = config.problem_type
        if problem is None:
            if num_labels == 1:
                problem = "regression"
            elif labels.dtype in (torch.int64, torch.int32):
                problem = "single_label_classification"
            else:
                problem = "multi_label_classification"
        if problem == "regression":
            labels = labels.to(logits.dtype)
            if num_labels == 1:
                return F.mse_loss(logits.squeeze(), labels.squeeze())
            return F.mse_loss(logits, labels)
        if problem == "single_label_classification":
            return token_cross_entropy(
                logits.reshape(-1, num_labels), labels.reshape(-1), ignore_index=self.ignore_index
            )
        return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))

    def __call__(self, params: Mapping[str, Tensor], batch: Any) -> Tensor:
        output, targets = self.forward(params, batch)
        loss = self.loss_from_logits(logits_of(output), targets)
        router = self._router_loss(output) if self.router_loss else 0.0
        return loss if isinstance(router, float) else loss + router  # (none: no + 0.0 in the graph)

    def forward(self, params: Mapping[str, Tensor], batch: Any) -> tuple[Any, Any]:
        """The model's output on ``batch`` with ``params`` substituted, and the batch's targets (as they come:
        :meth:`targets` shifts them).

        Args:
            params: the parameter dict.
            batch: one batch, ``(inputs, targets)`` or a dict with the labels.
        """
        args, kwargs, targets = self.split(batch)
        # (the dtype's is_floating_point, not the tensor's: in the exact mode each tensor method calls into Python)
        dtype = next((d for d in (p.dtype for p in params.values()) if d.is_floating_point), None)
        tensors = {**self._module_tensors(params, dtype), **params}
        if dtype is not None:
            args = tuple(_cast(a, dtype) for a in args)
            kwargs = {k: _cast(v, dtype) for k, v in kwargs.items()}
        with eval_forward(self.model):  # (inside the exact mode only: no LayerDrop, DropPath, checkpointing)
            output = functional_call(self.model, tensors, args, kwargs, tie_weights=self.tie_weights, strict=False)
        return output, targets

    def _router_loss(self, output: Any) -> Tensor | float:
        """The router losses weighted as the model's own ``outputs.loss`` weighs them (0 without any)."""
        found = router_losses(output)
        if not found:
            return 0.0
        base = base_model(self.model)
        name = type(base).__name__
        # (the model's own attribute, else its config's or its text config's, as Qwen3-VL-MoE reads it; named
        # aux_loss_coef in JetMoe)
        config = getattr(base, "config", None)
        holders = (base, config, getattr(config, "text_config", None))
        coefs = [getattr(x, k) for x in holders for k in _AUX_LOSS_COEFS if getattr(x, k, None) is not None]
        coef = coefs[0] if coefs else None
        unknown = sorted(k for k in found if k != "aux_loss" or coef is None)
        if unknown:
            raise CurvlabError(
                f"{name} returns router loss(es) {', '.join(unknown)} that curvlab can't weigh as its own loss "
                "does: pass router_loss=False to leave them out (the language model's loss alone)"
            )
        return coef * found["aux_loss"]

    def _module_tensors(self, params: Mapping[str, Tensor], dtype: torch.dtype | None) -> dict[str, Tensor]:
        """Buffers and the parameters not in ``params``, floating ones cast to ``dtype`` (untied, every
        name of a shared tensor, so that a tied name not in ``params`` keeps the module's value)."""
        out = {}
        every = not self.tie_weights
        tensors = [
            *self.model.named_buffers(remove_duplicate=not every),
            *self.model.named_parameters(remove_duplicate=not every),
        ]
        for name, t in tensors:
            if name in params:
                continue
            if t.requires_grad:  # (under torch.func, detaching a buffer would wrap it: the exact mode must see it)
                t = t.detach()
            if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                t = t.to(dtype)
            out[name] = t
        return out


def _cast(x: Any, dtype: torch.dtype) -> Any:
    own = x.dtype if isinstance(x, Tensor) else None
    return x.to(dtype) if own is not None and own.is_floating_point and own != dtype else x


def make_loss_fn(
    model: nn.Module,
    *,
    criterion: Callable[[Tensor, Tensor], Tensor] | None = None,
    ignore_index: int = IGNORE_INDEX,
    shift: bool | None = None,
    tie_weights: bool = True,
    router_loss: bool = True,
) -> ModuleLoss:
    """Build ``loss_fn(params, batch)``: ``criterion(logits, targets)`` of ``model`` on ``batch``, plus a
    mixture-of-experts model's router loss as its own ``outputs.loss`` adds it.

    Args:
        model: any ``nn.Module``, including Hugging Face and peft models.
        criterion: ``criterion(logits, targets) -> scalar``; default the model's own loss (see the module
            docstring). It gets the logits (a dual encoder's ``logits_per_text``) and the targets
            unshifted unless ``shift`` is on.
        ignore_index: the label value left out (default -100, as torch and Hugging Face).
        shift: whether the logits at t predict the target at t + 1 (:meth:`ModuleLoss.targets`), with or
            without a criterion. Default ``None``: on for a Hugging Face causal LM, off for any other model.
        tie_weights: ``torch.func.functional_call``'s ``tie_weights``.
        router_loss: add the load-balancing loss a mixture-of-experts model computes, as its own loss
            does; ``False``: the language model's loss alone (:class:`ModuleLoss`).

    Returns:
        The :class:`ModuleLoss`, ``loss_fn(params, batch) -> scalar`` (``loss_fn.model`` is ``model``).
    """
    return ModuleLoss(
        model, criterion, ignore_index=ignore_index, shift=shift, tie_weights=tie_weights, router_loss=router_loss
    )


def _count(targets: Any, ignore_index: int) -> int:
    if not isinstance(targets, Tensor):
        return 1
    if targets.dtype in _INTEGER:
        return int((targets != ignore_index).sum())
    return targets.numel()


def count_loss_terms(batch: Any, ignore_index: int = IGNORE_INDEX) -> int:
    """Loss terms of a batch without knowing its loss function (no causal shift): the targets of
    ``(inputs, targets)`` or a dict's ``"labels"``, integer ones not equal to ``ignore_index``, else every entry."""
    if isinstance(batch, Mapping):
        return _count(batch.get("labels"), ignore_index)
    targets = batch[-1] if isinstance(batch, (tuple, list)) else batch
    return _count(targets, ignore_index)


@dataclass(frozen=True)
class Batches:
    """Several batches with explicit weights (pass them when the loss is not a mean over targets).

    Args:
        batches: the batches, each as ``loss_fn(params, batch)`` takes it.
        weights: one weight per batch, in any units (normalized to sum to one); default
            ``None``: each batch's number of loss terms, so the accumulated loss is the mean over all of
            them, as one large batch would give.
    """

    batches: Sequence[Any]
    weights: Sequence[float] | None = None


def weighted_batches(batch: Any, loss_fn: Any = None) -> list[tuple[Any, float]]:
    """Split ``batch`` into ``(batch_j, w_j)`` pairs with ``sum(w_j) == 1``.

    A ``list`` or :class:`Batches` is several batches; anything else is one. Each batch's weight is its
    number of loss terms (``loss_fn.loss_terms`` where the loss function has it, else
    :func:`count_loss_terms`); a batch with none is left out.
    """
    count = getattr(loss_fn, "loss_terms", None) or count_loss_terms
    if isinstance(batch, Batches):
        batches = list(batch.batches)
        weights = list(batch.weights) if batch.weights is not None else [count(b) for b in batches]
    elif isinstance(batch, list):
        batches, weights = batch, [count(b) for b in batch]
    else:
        return [(batch, 1.0)]
    if not batches:
        raise CurvlabError("no batches given: an empty list of batches has no loss")
    if len(weights) != len(batches):
        raise CurvlabError(f"{len(batches)} batches but {len(weights)} weights")
    total = float(sum(weights))
    if not total > 0:
        raise CurvlabError(f"the batches hold no loss terms (weights sum to {total})")
    # a batch without loss terms (every label ignored) weighs 0: its mean loss is 0/0, and it adds nothing
    return [(b, float(w) / total) for b, w in zip(batches, weights) if w > 0]
