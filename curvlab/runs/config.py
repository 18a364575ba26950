"""A training run's settings (:class:`TrainConfig`): defaults, a config file merged with flags
(:meth:`TrainConfig.from_sources`), validation, and which changes a resumed run may take
(:data:`RESUMABLE_CHANGES`, :func:`config_difference`).
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from curvlab.errors import CurvlabError
from curvlab.models.gpt import CONFIGS, get_config
from curvlab.optim.build import check_optimizer_options, is_finite_number
from curvlab.optim.model_optimizer import LORA_OPTIMIZERS, OPTIMIZERS
from curvlab.util.codec import Record
from curvlab.util.paths import same_path
from curvlab.util.schema import read_json_object

SCHEDULES = ("cosine", "wsd", "constant")
# The largest count (steps, batch size, ...) any option takes: far past any run, far below where a C integer
# on the way (numpy's, torch's, range()'s) would overflow
MAX_COUNT = 2**31 - 1
SEED_MAX = 2**32 - 1  # numpy's and torch's seeds both take [0, 2**32)
# The numeric fields' ranges [low, high] (None: unbounded), which `curvlab train --help` shows and validate()
# checks in a config file. grad_clip 0 is the command line's "no clipping" (None in the config)
FIELD_RANGES: dict[str, tuple[float, float | None]] = {
    "batch_size": (1, MAX_COUNT), "seq_len": (1, MAX_COUNT), "steps": (1, MAX_COUNT), "warmup_steps": (0, MAX_COUNT),
    "cooldown_frac": (0.0, 1.0), "min_lr_frac": (0.0, 1.0), "grad_clip": (0.0, None), "seed": (0, SEED_MAX),
    "eval_every": (1, MAX_COUNT), "ckpt_every": (1, MAX_COUNT), "val_windows": (1, MAX_COUNT),
}  # fmt: skip
# The ranges of the model fields --model-opt may set (and n_head must divide n_embd, dropout stay below 1)
MODEL_RANGES: dict[str, tuple[float, float]] = {
    "vocab_size": (1, MAX_COUNT), "block_size": (1, MAX_COUNT), "n_layer": (1, MAX_COUNT), "n_head": (1, MAX_COUNT),
    "n_embd": (1, MAX_COUNT), "dropout": (0.0, 1.0),
}  # fmt: skip
# Fields that may change between a run and its resumption: they don't change the math of a step.
RESUMABLE_CHANGES = {"out", "device", "compile", "eval_every", "ckpt_every"}


@dataclass(frozen=True)
class TrainConfig(Record):
    """Everything that defines a training run. ``curvlab train`` takes each field of :data:`FIELD_HELP` as an
    option of the same name (the dicts as ``--model-opt`` and ``--opt KEY=VALUE``); the rest are set in a
    config file."""

    WHAT: ClassVar[str] = "training config"

    data: str
    out: str
    model: str = "tiny"
    model_overrides: dict[str, Any] = field(default_factory=dict)
    optimizer: str = "muon"
    optimizer_options: dict[str, Any] = field(default_factory=dict)
    batch_size: int = 16
    seq_len: int | None = None  # default: the model's block size
    steps: int = 600
    warmup_steps: int = 20
    schedule: str = "wsd"  # has a stable phase, which `curvlab compare` pairs in by default; cosine has none
    cooldown_frac: float = 0.2  # the final share of steps that decays, for "wsd"
    min_lr_frac: float = 0.1  # the schedule's floor, as a fraction of the peak lr
    grad_clip: float | None = 1.0
    seed: int = 0
    eval_every: int = 50
    ckpt_every: int = 50
    val_windows: int = 64
    device: str = "auto"
    compile: bool = False
    # A shadow state of the other arm on the hidden matrices (curvlab.steps.shadow): updated, never applied.
    shadow: bool = False
    shadow_options: dict[str, Any] = field(default_factory=dict)
    # The control shadows of the run's own arm (curvlab.steps.shadow.build_controls): its twin and its
    # hyperparameter twin, updated like the shadow, never applied (docs/science.md section 14).
    controls: bool = False

    @classmethod
    def from_sources(cls, file: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> TrainConfig:
        """The config of ``curvlab train``: the dataclass defaults, then the JSON object in ``file``, then
        ``overrides`` (the command line's options), each over the one before; the dict fields
        (:data:`MERGED_FIELDS`) merge key by key. Unknown fields and values of the wrong type are refused."""
        merged: dict[str, Any] = {}
        for where, source in ((str(file), _read_config_file(file) if file else {}), ("overrides", overrides or {})):
            _check_fields(source, where)
            for key, value in source.items():
                merged[key] = {**merged[key], **value} if key in MERGED_FIELDS and key in merged else value
        for required in ("data", "out"):
            if not merged.get(required):
                raise CurvlabError(f"--{required} is required (or give {required} in the config file)")
        return cls(**merged)  # its user validates it (the CLI once out is known writable, build_run again)

    def validate(self) -> None:
        """Raise CurvlabError naming the first field, or option key, that is out of its range: the numbers of
        :data:`FIELD_RANGES`, the names, the model's overrides and the optimizer's options, key by key."""
        if self.schedule not in SCHEDULES:
            raise CurvlabError(f"unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        for name, (low, high) in FIELD_RANGES.items():
            if getattr(self, name) is not None and not _within(getattr(self, name), low, high):
                raise CurvlabError(f"{name} must lie in {_span(low, high)}, got {getattr(self, name)!r}")
        if self.grad_clip == 0:
            raise CurvlabError("grad_clip must be > 0, or null for no clipping")
        if not 0 <= self.warmup_steps < self.steps:
            raise CurvlabError(f"warmup_steps must lie in [0, steps), got {self.warmup_steps}")
        _check_model(self.model, self.model_overrides)
        if self.optimizer not in OPTIMIZERS + LORA_OPTIMIZERS:
            raise CurvlabError(
                f"unknown optimizer {self.optimizer!r}; choose one of {', '.join(OPTIMIZERS + LORA_OPTIMIZERS)}"
            )
        check_optimizer_options(self.optimizer_options, "optimizer_options (--opt)")
        check_optimizer_options(self.shadow_options, "shadow_options")

    def memory_estimate(self, world: int = 1, sharded: bool = False) -> int:
        """The bytes a training step takes at the least on one of ``world`` ranks, for refusing a batch no
        machine could hold (after :meth:`validate`): the parameters with their gradients and two optimizer
        states (float32; a rank's share when ``sharded``), the activations each layer keeps (16 n_embd a
        token) and the logits with their gradient (2 vocab_size a token) of the rank's rows, at 2 bytes a
        value (bfloat16 under CUDA's autocast); attention scores and workspace come on top."""
        m = get_config(self.model, **self.model_overrides)
        tokens = -(-self.batch_size // world) * (self.seq_len or m.block_size)  # (each rank takes rows rank::world)
        embeddings = m.vocab_size * m.n_embd * (1 if m.tie_embeddings else 2) + m.block_size * m.n_embd
        parameters = embeddings + 12 * m.n_layer * m.n_embd**2  # (attention 4 n_embd², MLP 8 n_embd² a layer)
        held = -(-parameters // world) if sharded else parameters
        return 4 * 4 * held + 2 * tokens * (16 * m.n_layer * m.n_embd + 2 * m.vocab_size)


MERGED_FIELDS = ("optimizer_options", "model_overrides", "shadow_options")

# What each field means, as ``curvlab train --help`` shows it beside the field's default: the CLI builds its
# options from these fields and this table, so a field and its option can't drift apart.
FIELD_HELP = {
    "data": "Data directory with train*/val* shards.",
    "out": "Run directory (checkpoints, metrics.jsonl); an existing one is resumed.",
    "model": "Model config: tiny, pcfg-9m, gpt2-124m.",
    "model_overrides": "Model config override KEY=VALUE, repeatable (e.g. n_layer=2).",
    "optimizer": "muon, adamw, sgd or lion.",
    "optimizer_options": "Optimizer option KEY=VALUE, repeatable (e.g. momentum=0.9).",
    "batch_size": "Sequences per step.",
    "seq_len": "Tokens per sequence.",
    "steps": "Optimizer steps.",
    "warmup_steps": "Linear warmup steps.",
    "schedule": "wsd (warmup-stable-decay, which compare pairs in), cosine or constant.",
    "cooldown_frac": "Decaying share of steps for wsd.",
    "min_lr_frac": "Schedule floor as a fraction of the peak.",
    "grad_clip": "Gradient-norm clip; 0 disables.",
    "seed": "Seed of initialization and data order.",
    "eval_every": "Validation every N steps.",
    "ckpt_every": "Checkpoint every N steps.",
    "val_windows": "Fixed validation windows.",
    "device": "auto, cpu, cuda, cuda:1, ...",
    "compile": "torch.compile the model.",
    "shadow": "Keep a shadow state of the other arm (adamw <-> muon).",
}


def _read_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise CurvlabError(f"{path}: no such config file")
    return read_json_object(path, "training config")  # (corrupt bytes, huge numbers, deep nesting: one line)


def _check_fields(d: Mapping[str, Any], where: str) -> None:
    """Every key of ``d`` is a :class:`TrainConfig` field and its value has the field's type (an int
    passes for a float; a bool passes for nothing but a bool)."""
    hints = {f.name: typing.get_type_hints(TrainConfig)[f.name] for f in fields(TrainConfig)}  # (not WHAT)
    unknown = sorted(set(d) - set(hints))
    if unknown:
        raise CurvlabError(f"{where}: unknown training config field(s): {', '.join(unknown)}")
    for key, value in d.items():
        allowed = typing.get_args(hints[key]) if isinstance(hints[key], types.UnionType) else (hints[key],)
        if not any(_has_type(value, t) for t in allowed):
            expected = " or ".join("null" if t is type(None) else getattr(t, "__name__", str(t)) for t in allowed)
            raise CurvlabError(f"{where}: {key} must be {expected}, got {value!r}")


def _has_type(value: Any, t: Any) -> bool:
    t = typing.get_origin(t) or t
    if t is type(None) or t is bool:
        return type(value) is t
    if t is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if t is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, t)


def _within(value: float, low: float, high: float | None) -> bool:
    return is_finite_number(value) and low <= value and (high is None or value <= high)


def _span(low: float, high: float | None) -> str:
    return f">= {low}" if high is None else f"[{low}, {high}]"


def _check_model(model: str, overrides: Mapping[str, Any]) -> None:
    """``model`` is a known config and each override a field of it, of its type and in its range."""
    if model not in CONFIGS:
        raise CurvlabError(f"unknown model config {model!r}; choose one of {', '.join(CONFIGS)}")
    where = "model_overrides (--model-opt)"
    defaults = CONFIGS[model].to_dict()
    for key, value in overrides.items():
        if key not in defaults:
            raise CurvlabError(f"{where}: unknown key {key!r}; choose from {', '.join(defaults)}")
        kind = type(defaults[key])
        if not _has_type(value, kind):
            raise CurvlabError(f"{where}: {key} must be {kind.__name__}, got {value!r}")
        if key in MODEL_RANGES and not _within(value, *MODEL_RANGES[key]):
            raise CurvlabError(f"{where}: {key} must lie in {_span(*MODEL_RANGES[key])}, got {value!r}")
    merged = get_config(model, **overrides)
    if merged.dropout == 1:
        raise CurvlabError(f"{where}: dropout must be < 1 (1 drops everything), got {merged.dropout}")
    if merged.n_embd % merged.n_head:
        raise CurvlabError(f"{where}: n_head {merged.n_head} must divide n_embd {merged.n_embd}")


def config_difference(saved: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Fields whose values differ (ignoring those a resume may change; ``data`` is the directory it names,
    however it was spelled: relative, absolute, through a link)."""
    keys = sorted((set(saved) | set(new)) - RESUMABLE_CHANGES)
    saved = {**_config_defaults(), **saved}  # a field added since the run was saved has its default there
    return [f"{k}: {saved.get(k)!r} -> {new.get(k)!r}" for k in keys if not _same(k, saved.get(k), new.get(k))]


def _same(key: str, saved: Any, new: Any) -> bool:
    return same_path(saved, new) if key == "data" else saved == new


def _config_defaults() -> dict[str, Any]:
    out = {f.name: f.default for f in fields(TrainConfig) if f.default is not MISSING}
    out |= {f.name: f.default_factory() for f in fields(TrainConfig) if f.default_factory is not MISSING}
    return json.loads(json.dumps(out))
