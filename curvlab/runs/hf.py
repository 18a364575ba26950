"""Hugging Face integration: ``transformers.Trainer`` checkpoints, read for curvature analysis.

transformers is imported only when a function here runs (``pip install curvlab[hf]``). Models from
transformers and peft need nothing from this module to be analysed: :func:`~curvlab.engine.loss.make_loss_fn`
takes them as they are (dict batches, ``.logits`` outputs, the causal shift, ignored labels).

A Trainer checkpoint directory (``checkpoint-N/``) holds what the next step needs:

=================== ======================================================================
config.json         the model's config; ``architectures`` names the model class
model.safetensors   the weights (``pytorch_model.bin`` in older checkpoints; above the shard size,
                    ``model-00001-of-0000N.safetensors`` ... with ``model.safetensors.index.json``, or
                    ``pytorch_model-00001-of-0000N.bin`` ... with ``pytorch_model.bin.index.json``)
optimizer.pt        the optimizer's state dict: AdamW's moments and step counts, and the
                    param groups (decayed, then not decayed) with the next step's learning rate
scheduler.pt        the LR scheduler's state (its ``_last_lr`` is checked against the groups')
trainer_state.json  ``global_step``, the log
training_args.bin   ``TrainingArguments``: batch size, gradient accumulation, clipping, optimizer
=================== ======================================================================

Every pickle is unpickled with ``weights_only=True`` (``training_args.bin`` allowing only the
transformers and accelerate classes it names), so one that names anything else is refused, never run.
:func:`curvlab.runs.checkpoint.read_checkpoint` reads the files, with every checkpoint's errors; this
module supplies what only transformers knows. ``config.json`` is read with ``trust_remote_code=False`` and
must name a causal LM (:func:`causal_lm_class`), whose tensors the weights must fill exactly
(:func:`curvlab.runs.weights.check_loading_info`: transformers would start a missing one at random),
checked against the safetensors headers before the model is built (:func:`check_fits_weights`).
"""

from __future__ import annotations

import copy
import importlib
import json
import math
import pickle
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from curvlab.errors import CurvlabError
from curvlab.models.size import check_model_size
from curvlab.runs.weights import check_floating, check_loading_info
from curvlab.util.weights_only import unpickling_error

TRAINER_FILES = ("config.json", "optimizer.pt", "trainer_state.json", "training_args.bin")
WEIGHTS = ("model.safetensors", "pytorch_model.bin")
SHARD_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")  # sharded weights, by name
ADAMW = ("adamw_torch", "adamw_torch_fused", "adamw_hf")  # Trainer's names for torch.optim.AdamW
_ALLOWED_MODULES = ("transformers.", "accelerate.")
# what accelerate's save_state writes beside the model's weights (a Trainer directory has optimizer.pt, rng_state.pth)
ACCELERATE_FILES = ("optimizer.bin", "scheduler.bin", "random_states_0.pkl")
# transformers' auto classes' tables, by the task their models train on (a causal LM may be in others too)
CAUSAL_LM = "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"
TASKS = {
    "MODEL_FOR_MASKED_LM_MAPPING_NAMES": "a masked-LM model",
    "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES": "a sequence-classification model",
    "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES": "a token-classification model",
    "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES": "a question-answering model",
    "MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES": "a multiple-choice model",
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES": "a sequence-to-sequence model",
    "MODEL_FOR_PRETRAINING_MAPPING_NAMES": "a pretraining model (its own pretraining objective)",
    "MODEL_FOR_NEXT_SENTENCE_PREDICTION_MAPPING_NAMES": "a next-sentence-prediction model",
    "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES": "an image-classification model",
}


@dataclass
class TrainerCheckpoint:
    """A Trainer checkpoint directory, read: the ``model`` in eval mode (see
    :func:`curvlab.analysis.report.analyze`), ``optimizer.pt``'s and ``scheduler.pt``'s state dicts (the
    latter ``None`` without one), ``global_step`` and the ``TrainingArguments``."""

    model: nn.Module
    optimizer_state: dict[str, Any]
    scheduler_state: dict[str, Any] | None
    step: int
    args: Any

    @property
    def batch_size(self) -> int:
        return int(self.args.per_device_train_batch_size)

    @property
    def accumulation_steps(self) -> int:
        return int(self.args.gradient_accumulation_steps)

    @property
    def max_grad_norm(self) -> float | None:
        norm = self.args.max_grad_norm
        return float(norm) if norm else None

    @property
    def context(self) -> int:
        return context_length(self.model.config)


def context_length(config: Any) -> int:
    """A Hugging Face model config's context length (positions it has embeddings or rotary tables for)."""
    for key in ("n_positions", "max_position_embeddings", "n_ctx"):
        if isinstance(getattr(config, key, None), int):
            return int(getattr(config, key))
    raise CurvlabError(f"the model config ({type(config).__name__}) names no context length")


def check_trainer_directory(path: Path) -> None:
    """Raise ``CurvlabError`` unless ``path`` holds the files of a Trainer checkpoint."""
    if is_accelerate_state(path):
        raise accelerate_state_error(path)
    missing = [f for f in TRAINER_FILES if not (path / f).is_file()]
    if not any((path / w).is_file() for w in WEIGHTS + SHARD_INDEXES):
        missing.append(" or ".join(WEIGHTS + SHARD_INDEXES))
    if missing:
        raise CurvlabError(f"{path}: not a Hugging Face Trainer checkpoint (no {', '.join(missing)})")


def is_accelerate_state(path: Path) -> bool:
    """Whether directory ``path`` is what accelerate's ``Accelerator.save_state`` writes, not a Trainer
    checkpoint (which has ``trainer_state.json``)."""
    if (path / "trainer_state.json").is_file():
        return False
    return any((path / f).is_file() for f in ACCELERATE_FILES) or any(path.glob("random_states_*.pkl"))


def accelerate_state_error(path: Path, weights: Path | None = None) -> CurvlabError:
    """The one-line error for an accelerate ``save_state`` directory ``path`` (or its ``weights`` file), saying
    how to write a state-dict checkpoint from its files."""
    name = next((w for w in WEIGHTS if (path / w).is_file()), WEIGHTS[0])
    load = "safetensors.torch.load_file" if name.endswith(".safetensors") else "torch.load"
    what = f"{weights}: the weights of" if weights else f"{path}:"
    return CurvlabError(
        f"{what} an accelerate save_state directory, which records neither the model's config, the optimizer's "
        "class nor the batch size: write its weights and optimizer state to one file, torch.save({'model': "
        f"{load}('{path / name}'), 'optimizer': torch.load('{path / 'optimizer.bin'}'), 'step': N}}, 'ckpt.pt'), "
        "and pass that with --config, --optimizer and --batch-size"
    )


def is_safetensors(path: Path) -> bool:
    """Whether the file ``path`` opens as a safetensors file does: an 8-byte header length, then its JSON."""
    with open(path, "rb") as f:
        head = f.read(9)
    return len(head) == 9 and head[8:] == b"{" and int.from_bytes(head[:8], "little") + 8 <= path.stat().st_size


def weights_file_error(path: Path) -> CurvlabError:
    """The one-line error for a checkpoint path that is a safetensors weights file (no optimizer state),
    saying what to pass: the directory it belongs to, or a state dict."""
    folder = path.parent
    if is_accelerate_state(folder):
        return accelerate_state_error(folder, path)
    if (folder / "trainer_state.json").is_file():
        return CurvlabError(f"{path}: the weights of a Trainer checkpoint; pass its directory, {folder}")
    return CurvlabError(
        f"{path}: a safetensors weights file alone; pass the checkpoint directory it belongs to (a Trainer's "
        "checkpoint-N), or save it as a state dict, torch.save(safetensors.torch.load_file(FILE), 'weights.pt'), "
        "with --config, --optimizer and --batch-size"
    )


def weight_files(path: Path) -> list[Path]:
    """The files holding a checkpoint directory's weights: ``model.safetensors`` (or ``pytorch_model.bin``),
    else every shard its index's ``weight_map`` names, each a plain file name inside ``path`` that is there.
    """
    # transformers' own order: safetensors, then their index, then the pickled weights and theirs
    found = [path / n for n in (WEIGHTS[0], SHARD_INDEXES[0], WEIGHTS[1], SHARD_INDEXES[1]) if (path / n).is_file()]
    if not found:
        raise CurvlabError(f"{path}: no weights ({', '.join(WEIGHTS + SHARD_INDEXES)})")
    if found[0].name in WEIGHTS:
        return found[:1]
    index = found[0]
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CurvlabError(f"{index}: not a readable shard index ({type(e).__name__})") from e
    for shard in shards:
        if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):
            raise CurvlabError(f"{index}: names shard {shard!r}, not a file of this directory")
        if not (path / shard).is_file():
            raise CurvlabError(f"{index}: names shard {shard}, which is missing")
    if not shards:
        raise CurvlabError(f"{index}: names no shard")
    return [path / shard for shard in shards]


def training_args_classes(path: Path) -> list[type]:
    """The classes ``training_args.bin`` names, to allow while unpickling it with ``weights_only=True``:
    transformers' and accelerate's only."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception as e:  # not a torch zip file at all
        raise CurvlabError(f"{path}: corrupt or unreadable training arguments ({type(e).__name__})") from e
    foreign = [n for n in names if not n.startswith(_ALLOWED_MODULES)]
    if foreign:
        raise CurvlabError(f"{path}: holds {foreign[:3]}, not only TrainingArguments; refusing to unpickle it")
    classes = []
    for name in names:
        module, _, attr = name.rpartition(".")
        try:
            classes.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError) as e:
            raise CurvlabError(f"{path}: names {name}, which this transformers doesn't have") from e
    return classes


def check_training_args(args: Any, path: Path) -> Any:
    if not hasattr(args, "gradient_accumulation_steps"):
        raise CurvlabError(f"{path}: holds a {type(args).__name__}, not TrainingArguments")
    return args


def global_step(path: Path) -> int:
    """``global_step`` from the directory's ``trainer_state.json`` (0 where it has none); a file that isn't a
    JSON object, or a ``global_step`` that isn't an integer >= 0, is a ``CurvlabError``."""
    file = path / "trainer_state.json"
    try:
        state = json.loads(file.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise CurvlabError(f"{file}: unreadable ({type(e).__name__})") from e
    if not isinstance(state, dict):
        found = "null" if state is None else f"a {type(state).__name__}"
        raise CurvlabError(f"{file}: not the Trainer's state (a JSON object) but {found}")
    step = state.get("global_step", 0)
    if type(step) is not int or step < 0:
        raise CurvlabError(f"{file}: its global_step {step!r:.40} is not a step count (an integer >= 0)")
    return step


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' warnings and progress bars off, then as they were (they would bury a refusal's line)."""
    from transformers.utils import logging  # optional (the hf extra)

    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


def causal_lm_class(config: Any, where: str) -> type:
    """The transformers class ``config.architectures`` names (``where``: its file), if transformers registers
    it as a causal LM. The command line analyses the next-token loss on windows of its data, which a model
    of another task never trained on: it is refused, its task named, and so are architectures that aren't
    a list of classes this transformers has."""
    import transformers  # optional (the hf extra)
    from transformers.models.auto import modeling_auto

    architectures = getattr(config, "architectures", None) or []
    if not isinstance(architectures, list):  # (a JSON object, or a string: its first letter was the class)
        raise CurvlabError(f"{where}: its architectures {architectures!r:.80} is not a list of class names")
    name = architectures[0] if architectures else None
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise CurvlabError(f"{where}: model class {architectures[:1]!r:.80} isn't in this transformers")

    def registered(table: str) -> bool:
        classes = getattr(modeling_auto, table, {}).values()
        return any(cls.__name__ in ((c,) if isinstance(c, str) else c) for c in classes)

    if registered(CAUSAL_LM):
        return cls
    task = next((t for table, t in TASKS.items() if registered(table)), "no causal LM transformers registers")
    raise CurvlabError(
        f"{where}: {cls.__name__} is {task}; curvlab analyses causal-LM checkpoints (the next-token loss on "
        "windows of --data, which this model never trained on); in Python, make_loss_fn takes it with batches "
        "of its own task"
    )


def read_config(path: Path) -> Any:
    """The transformers config of checkpoint directory ``path``'s ``config.json``, nothing downloaded and no
    code of its own run (a config whose ``auto_map`` names its own classes is refused)."""
    import transformers  # optional (the hf extra)

    try:
        return transformers.AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        try:
            own_code = "auto_map" in json.loads((path / "config.json").read_text())
        except (OSError, ValueError, TypeError):
            own_code = False
        if own_code:
            raise CurvlabError(f"{path}/config.json: names classes of its own (auto_map); curvlab runs no code "
                               "a checkpoint brings") from e  # fmt: skip
        raise CurvlabError(f"{path}/config.json: unreadable ({type(e).__name__})") from e


def load_model(path: Path, saved: Mapping[str, tuple[str, tuple[int, ...]]] | None = None) -> nn.Module:
    """The model of a checkpoint directory, by the causal-LM class its ``config.json`` names
    (:func:`causal_lm_class`), in eval mode, with every tensor from the checkpoint's weights (nothing
    downloaded, no checkpoint's own code run, a ``pytorch_model.bin`` unpickled with ``weights_only=True``).
    ``saved``, the safetensors weights' dtypes and shapes by key (:func:`curvlab.runs.checkpoint.check_safetensors`),
    is checked against the model before it is built (:func:`check_fits_weights`) and after
    (:func:`curvlab.runs.weights.check_floating`, :func:`curvlab.runs.weights.check_loading_info`).
    """
    with quiet_transformers():
        config = read_config(path)
        cls = causal_lm_class(config, f"{path}/config.json")
        if saved:
            check_fits_weights(cls, config, saved, path)
        try:
            model, info = cls.from_pretrained(
                path, config=config, local_files_only=True, trust_remote_code=False, output_loading_info=True,
                ignore_mismatched_sizes=True,  # (listed in info, then refused by name below, not raised as a table)
            )  # fmt: skip
        except pickle.UnpicklingError as e:  # from torch's weights_only unpickler, which transformers passes on
            raise unpickling_error(e, path, "a weights file (pytorch_model*.bin)") from None
        except (OSError, ValueError, RuntimeError) as e:
            raise CurvlabError(f"{path}: the weights don't load into {cls.__name__} ({type(e).__name__})") from e
    check_loading_info(model, info, path)
    check_floating(model, {key: dtype for key, (dtype, _) in (saved or {}).items()}, path)
    return model.eval()


def check_fits_weights(cls: type, config: Any, saved: Mapping[str, tuple[str, tuple[int, ...]]], path: Path) -> None:
    """Raise ``CurvlabError`` if the ``cls`` model ``config`` describes is far larger than the ``saved``
    tensors (:func:`curvlab.models.size.check_model_size`), before it is built: transformers allocates what
    the weights don't fill before :func:`check_loading_info` can name it, so ``n_embd=60000`` beside
    kilobytes of weights would take hundreds of gigabytes first. The count is taken on the meta device, after
    a check of the layers against the tensors (that build takes time per layer)."""
    where = f"{path}/config.json: describes"
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layers, int) and layers > len(saved):
        raise CurvlabError(
            f"{where} {layers} layers, but the weights hold {len(saved)} tensors: not the weights' model"
        )
    with torch.device("meta"):  # (on a copy: building a model settles fields of its config, as loading will)
        need = sum(p.numel() for p in cls(copy.deepcopy(config)).parameters())
    check_model_size(need, sum(math.prod(shape) for _, shape in saved.values()), f"{where} a {cls.__name__} of")


def trainer_optimizer(ckpt: TrainerCheckpoint) -> torch.optim.Optimizer:
    """The Trainer's AdamW, rebuilt on ``ckpt.model`` (:func:`trainer_groups`) with its saved state, once the
    saved groups' sizes and the moments' shapes fit."""
    optim = str(getattr(ckpt.args.optim, "value", ckpt.args.optim))
    if optim not in ADAMW:
        raise CurvlabError(f"the Trainer ran optimizer {optim!r}; curvlab rebuilds {', '.join(ADAMW)}")
    groups = trainer_groups(ckpt.model)
    saved = ckpt.optimizer_state
    sizes = [len(g["params"]) for g in saved.get("param_groups", [])]
    if sizes != [len(g) for g in groups]:
        raise CurvlabError(
            f"optimizer.pt has groups of {sizes} parameters; the model gives {[len(g) for g in groups]} "
            "(decayed, not decayed): a different model or a custom optimizer"
        )
    flat = [p for g in groups for p in g]
    for index, entry in saved.get("state", {}).items():
        moment = entry.get("exp_avg")
        if moment is None or tuple(moment.shape) != tuple(flat[index].shape):
            shape = None if moment is None else tuple(moment.shape)
            raise CurvlabError(f"optimizer.pt: state {index} has exp_avg {shape}, parameter {tuple(flat[index].shape)}")
    optimizer = torch.optim.AdamW([{"params": g} for g in groups])
    optimizer.load_state_dict(saved)
    if ckpt.scheduler_state is not None:
        last = [float(x) for x in ckpt.scheduler_state.get("_last_lr", [])]
        lrs = [float(g["lr"]) for g in optimizer.param_groups]
        if last and last != lrs:
            raise CurvlabError(f"optimizer.pt's learning rates {lrs} and scheduler.pt's {last} differ")
    return optimizer


def trainer_groups(model: nn.Module) -> list[list[nn.Parameter]]:
    """The groups ``Trainer.create_optimizer`` builds: the trainable parameters
    ``Trainer.get_decay_parameter_names`` chooses (weight-decayed), then the others."""
    from transformers import Trainer  # optional (the hf extra)

    decay = set(Trainer.get_decay_parameter_names(None, model))  # (uses nothing of the Trainer instance)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [[p for n, p in named if n in decay], [p for n, p in named if n not in decay]]


def token_batch(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """A causal-LM batch in Hugging Face's form from curvlab's ``(inputs, targets)`` windows: ``input_ids`` =
    ``labels`` = the whole window (the model's loss shifts the labels itself)."""
    window = torch.cat([x, y[:, -1:]], dim=1)
    return {"input_ids": window, "labels": window}
