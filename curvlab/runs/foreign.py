"""Checkpoints of other training code, whose model and optimizer curvlab rebuilds from what the user
names: a Lightning ``.ckpt`` and a ``torch.save``'d state dict.

========== =================================================================================
lightning  a dict with ``state_dict`` (the LightningModule's: the model's weights under the
           attribute that holds it, ``model.`` say), ``optimizer_states`` (one state dict per
           optimizer), ``global_step``, and ``pytorch-lightning_version``
state-dict ``torch.save(model.state_dict())``, or ``torch.save({"model": ..., "optimizer": ...,
           "step": ...})`` (``state_dict`` / ``model_state_dict`` and ``optimizer_state_dict``
           are read too)
========== =================================================================================

Neither records the model's class or the optimizer's, so the user names them (:class:`Rebuild`): the
model (:func:`build_model`), whose weights are found under whatever prefix the saving module gave them
(:func:`load_weights`), and a ``torch.optim`` class (:func:`rebuild_optimizer`), built in the grouping
of the parameters the saved state fits: only the groups' sizes and the moments' shapes are saved, so a
grouping is taken only when no other that orders the parameters differently fits too. In Python,
:func:`curvlab.runs.checkpoint.restore_lightning` builds a LightningModule's own optimizers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from curvlab.errors import CurvlabError
from curvlab.models.gpt import CONFIGS, GPT, GPTConfig, get_config
from curvlab.optim.model_optimizer import named_trainable
from curvlab.runs.hf import causal_lm_class, quiet_transformers, trainer_groups
from curvlab.runs.weights import fill_ties, tie_groups

FOREIGN_FORMATS = ("lightning", "state-dict")
# what LR schedulers write into an optimizer's groups beside its own hyperparameters
_SCHEDULER_KEYS = frozenset({"initial_lr", "base_lr", "max_lr", "min_lr", "base_momentum", "max_momentum"})
_MODEL_KEYS = ("model", "model_state_dict", "state_dict")
_OPTIMIZER_KEYS = ("optimizer", "optimizer_state_dict")


@dataclass(frozen=True)
class Rebuild:
    """What a Lightning or state-dict checkpoint doesn't record, named by the user: the model's ``config``
    (:func:`build_model`), the ``optimizer``'s class (in any case) and the ``batch_size`` of the next step."""

    config: str | None = None
    optimizer: str | None = None
    batch_size: int | None = None

    def given(self) -> bool:
        return any(v is not None for v in (self.config, self.optimizer, self.batch_size))


@dataclass(frozen=True)
class ForeignCheckpoint:
    """A Lightning or state-dict checkpoint, read: the ``weights`` as saved (under the saving module's prefix),
    the ``optimizer_state`` (or ``None``) and the ``step`` (Lightning's ``global_step``, a dict's, else 0)."""

    format: str
    weights: dict[str, Tensor]
    optimizer_state: dict[str, Any] | None
    step: int


def _is_weights(d: Any) -> bool:
    return isinstance(d, dict) and bool(d) and all(isinstance(k, str) and torch.is_tensor(v) for k, v in d.items())


def _is_optimizer_state(d: Any) -> bool:
    return isinstance(d, dict) and isinstance(d.get("state"), dict) and isinstance(d.get("param_groups"), list)


def foreign_checkpoint(raw: Any, path: Path) -> ForeignCheckpoint | None:
    """``raw`` (a loaded file) as a :class:`ForeignCheckpoint`, or ``None`` if it is neither format; a
    Lightning checkpoint of several optimizers, or an optimizer entry that is no state dict, is refused."""
    if not isinstance(raw, dict):
        return None
    if _is_weights(raw.get("state_dict")) and ("pytorch-lightning_version" in raw or "optimizer_states" in raw):
        states = raw.get("optimizer_states") or []
        if len(states) > 1:
            raise CurvlabError(
                f"{path}: a Lightning checkpoint of {len(states)} optimizers; curvlab analyses one optimizer's step "
                "(in Python: curvlab.restore_lightning(module, path) gives them all)"
            )
        if states and not _is_optimizer_state(states[0]):
            raise CurvlabError(f"{path}: its optimizer_states[0] is not an optimizer's state dict")
        optimizer = states[0] if states else None
        return ForeignCheckpoint("lightning", raw["state_dict"], optimizer, _step(raw, "global_step"))
    if _is_weights(raw):
        return ForeignCheckpoint("state-dict", raw, None, 0)
    weights = next((raw[k] for k in _MODEL_KEYS if _is_weights(raw.get(k))), None)
    if weights is None:
        return None
    optimizer = next((raw[k] for k in _OPTIMIZER_KEYS if k in raw), None)
    if optimizer is not None and not _is_optimizer_state(optimizer):
        raise CurvlabError(f"{path}: its optimizer entry is not an optimizer's state dict")
    return ForeignCheckpoint("state-dict", weights, optimizer, _step(raw, "step"))


def _step(raw: dict, key: str) -> int:
    value = raw.get(key, 0)
    return int(value) if isinstance(value, int) and value >= 0 else 0


def build_model(config: str | Path) -> nn.Module:
    """The model ``config`` names, with fresh weights, in eval mode: a curvlab config name, a JSON file of
    GPTConfig fields, or a Hugging Face ``config.json`` (or its directory; a causal LM, nothing downloaded)."""
    if str(config) in CONFIGS:
        return GPT(get_config(str(config))).eval()
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    try:
        fields_of = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        names = ", ".join(CONFIGS)
        raise CurvlabError(f"--config {config}: not a curvlab config ({names}) nor a readable JSON file") from e
    if not isinstance(fields_of, dict):
        raise CurvlabError(f"--config {path}: not a JSON object of config fields")
    if "model_type" in fields_of:
        with quiet_transformers():  # (its warnings about the config would precede the one line of a refusal)
            return _hugging_face_model(fields_of, path)
    known = {f.name for f in fields(GPTConfig)}
    unknown = sorted(set(fields_of) - known)
    if unknown:
        raise CurvlabError(
            f"--config {path}: {unknown[:3]} are not GPTConfig fields ({', '.join(sorted(known))}); a Hugging Face "
            "config.json names its model_type"
        )
    return GPT(GPTConfig(**fields_of)).eval()


def _hugging_face_model(config: dict[str, Any], path: Path) -> nn.Module:
    import transformers  # optional (the hf extra): only Hugging Face configs need it

    config = dict(config)
    try:
        hf_config = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    except (ValueError, TypeError, KeyError) as e:
        raise CurvlabError(f"--config {path}: not a config this transformers builds ({e})") from e
    # (the class it names, if a causal LM: the batches are next-token windows; else the auto class's)
    named = getattr(hf_config, "architectures", None)
    cls = causal_lm_class(hf_config, f"--config {path}") if named else transformers.AutoModelForCausalLM
    auto = cls is transformers.AutoModelForCausalLM
    try:  # (no code a config names of its own is run: trust_remote_code=False)
        return (cls.from_config(hf_config, trust_remote_code=False) if auto else cls(hf_config)).eval()
    except (ValueError, TypeError) as e:
        raise CurvlabError(f"--config {path}: {cls.__name__} can't be built from it ({e})") from e


def load_weights(model: nn.Module, weights: Mapping[str, Tensor], path: Path) -> None:
    """Load ``weights`` into ``model``, in their own floating dtype, from under the prefix that makes them
    fill its state dict exactly (``model.`` for a LightningModule's ``self.model``, torch.compile's
    ``_orig_mod.``, none); a tied key (:func:`curvlab.runs.weights.tie_groups`) may be saved under any of
    its names. Where no prefix fits, the nearest one's missing, unexpected and mis-shaped tensors are named."""
    groups = tie_groups(model)
    prefixes = sorted(_prefixes(weights, groups), key=len)

    def under(prefix: str) -> dict[str, Tensor]:
        return {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}

    def fills(inner: Mapping[str, Tensor]) -> bool:
        return set(inner) <= set(groups) and all(any(g in inner for g in group) for group in groups.values())

    prefix = next((p for p in prefixes if fills(under(p))), prefixes[0] if prefixes else "")
    what = "the --config model" + (f" under prefix {prefix!r}" if prefix else "")
    inner = fill_ties(model, under(prefix), path, what)
    dtype = next((v.dtype for v in inner.values() if v.is_floating_point()), None)
    if dtype is not None:
        model.to(dtype)  # (load_state_dict would cast a float64 checkpoint into float32 weights)
    model.load_state_dict(inner, strict=True)  # (keys and shapes checked above: a failure here is unexpected)


def _prefixes(weights: Mapping[str, Tensor], groups: Mapping[str, tuple[str, ...]]) -> set[str]:
    """The prefixes under which one tensor of the model (its first key, sorted, under any of its tied names)
    appears among the saved keys."""
    if not groups:
        return {""}
    anchors = groups[min(groups)]
    return {k[: len(k) - len(a)] for k in weights for a in anchors if k == a or k.endswith("." + a)}


def optimizer_class(name: str | None) -> type[torch.optim.Optimizer]:
    """The ``torch.optim`` class called ``name``, in any case."""
    classes = {
        n.lower(): c
        for n, c in vars(torch.optim).items()
        if isinstance(c, type) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer
    }
    names = ", ".join(sorted(classes))
    if name is None:
        raise CurvlabError(
            f"the checkpoint doesn't record its optimizer's class; pass --optimizer (a torch.optim class: {names})"
        )
    if name.lower() not in classes:
        raise CurvlabError(f"unknown --optimizer {name!r}; choose a torch.optim class: {names}")
    return classes[name.lower()]


def groupings(model: nn.Module) -> dict[str, list[list[nn.Parameter]]]:
    """The ways curvlab tries to split the model's trainable parameters into an optimizer's groups: one group;
    the matrices, then the rest (nanoGPT's and most scripts' decay split); a Hugging Face model's Trainer's."""
    named = named_trainable(model)
    out = {
        "one group": [[p for _, p in named]],
        "matrices, then the rest": [[p for _, p in named if p.dim() >= 2], [p for _, p in named if p.dim() < 2]],
    }
    if type(model).__module__.startswith("transformers."):
        out["the Trainer's"] = trainer_groups(model)
    return out


def _fits(saved: dict[str, Any], groups: list[list[nn.Parameter]]) -> bool:
    """Whether the saved groups have these sizes and every saved state tensor its parameter's shape."""
    if [len(g.get("params", [])) for g in saved["param_groups"]] != [len(g) for g in groups]:
        return False
    for ids, params in zip((g["params"] for g in saved["param_groups"]), groups):
        for index, p in zip(ids, params):
            entry = saved["state"].get(index)
            values = entry.values() if isinstance(entry, dict) else ()
            tensors = [v for v in values if torch.is_tensor(v) and v.dim() > 0]
            if any(tuple(v.shape) != tuple(p.shape) for v in tensors):
                return False
    return True


def rebuild_optimizer(
    model: nn.Module, name: str | None, saved: dict[str, Any] | None, path: Path
) -> tuple[torch.optim.Optimizer, str]:
    """The ``torch.optim`` class ``name`` on ``model``'s trainable parameters, with the ``saved`` state
    (hyperparameters included) in the one grouping (:func:`groupings`) it fits; fresh, with the class's
    defaults, where nothing was saved. Returns the optimizer and its label for reports.

    Saved groups that both lack some of the class's hyperparameters and have others it doesn't take are
    another optimizer's state (either alone may be a torch version's additions, or a user's key): refused.
    """
    cls = optimizer_class(name)
    label = f"torch.optim.{cls.__name__}"
    if saved is None:
        return _built(cls, [{"params": [p for _, p in named_trainable(model)]}], label), f"{label}, fresh state"
    defaults = set(_built(cls, [{"params": [nn.Parameter(torch.zeros(2, 2))]}], label).defaults)
    for group in saved["param_groups"]:
        extra, missing = sorted(set(group) - defaults - _SCHEDULER_KEYS - {"params"}), sorted(defaults - set(group))
        if extra and missing:
            raise CurvlabError(
                f"{path}: the saved optimizer's hyperparameters {extra[:4]} aren't {label}'s, and it lacks {label}'s "
                f"{missing[:4]}: another optimizer's state (pass its class with --optimizer)"
            )
    fitting = {how: groups for how, groups in groupings(model).items() if _fits(saved, groups)}
    orders = {tuple(id(p) for g in groups for p in g) for groups in fitting.values()}
    sizes = [len(g.get("params", [])) for g in saved["param_groups"]]
    if len(orders) != 1:
        tried = "; ".join(f"{how} {[len(g) for g in groups]}" for how, groups in groupings(model).items())
        problem = "fit groupings that order the parameters differently" if orders else "fit no grouping curvlab knows"
        raise CurvlabError(
            f"{path}: the saved optimizer's groups of {sizes} parameters {problem} ({tried}); rebuild it in Python "
            "(for a LightningModule: curvlab.restore_lightning)"
        )
    optimizer = _built(cls, [{"params": g} for g in next(iter(fitting.values()))], label)
    try:
        optimizer.load_state_dict(saved)  # (the saved hyperparameters replace the class's defaults)
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise CurvlabError(f"{path}: the saved optimizer state doesn't load into {label} ({e})") from e
    return optimizer, label


def _built(cls: type[torch.optim.Optimizer], groups: list[dict[str, Any]], label: str) -> torch.optim.Optimizer:
    try:
        return cls(groups)
    except (ValueError, TypeError, RuntimeError) as e:
        raise CurvlabError(f"{label} can't be built on the model's parameters ({e})") from e


def configured_optimizers(configured: Any) -> list[torch.optim.Optimizer]:
    """The optimizers in what a LightningModule's ``configure_optimizers`` returns: one optimizer, a list
    or tuple of them, a ``([optimizers], [schedulers])`` pair, a dict with ``"optimizer"``, or a list of
    such dicts."""
    if isinstance(configured, torch.optim.Optimizer):
        return [configured]
    if isinstance(configured, Mapping) and "optimizer" in configured:
        return configured_optimizers(configured["optimizer"])
    if isinstance(configured, (list, tuple)):
        if len(configured) == 2 and all(isinstance(c, (list, tuple)) for c in configured):
            return configured_optimizers(list(configured[0]))  # (optimizers, schedulers)
        return [o for c in configured for o in configured_optimizers(c)]
    raise CurvlabError(f"configure_optimizers returned a {type(configured).__name__}, not optimizers")
