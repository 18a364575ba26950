"""One adaptation run: LoRA adapters (peft) on a pretrained curvlab GPT's transformer-layer matrices,
trained by the one training loop (:func:`curvlab.runs.train.train`), so an adaptation resumes bit for bit
as training does; with the curvature of each adapter step monitored on a held-out batch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from curvlab.curvature.groupings import hidden_matrices
from curvlab.data.shards import TokenData, TrainBatches, data_vocab_size, validation_batches
from curvlab.engine.loss import make_loss_fn
from curvlab.errors import CurvlabError
from curvlab.models.gpt import GPT, GPTConfig
from curvlab.optim.build import build_optimizer
from curvlab.optim.lora import adapter_blocks
from curvlab.runs.checkpoint import load_checkpoint, read_index
from curvlab.runs.config import TrainConfig, config_difference
from curvlab.runs.metrics import monitor_rows
from curvlab.runs.monitor import CurvatureMonitor, MonitorRow
from curvlab.runs.schedule import lr_multiplier, schedule_phase
from curvlab.runs.train import Run, pick_device, train_loop
from curvlab.util import schema
from curvlab.util.atomic import atomic_write_text
from curvlab.util.lock import check_not_owned, own_directory
from curvlab.util.paths import same_path

ADAPTER_FILE = "adapter.json"  # the LoRA settings of an adaptation run, beside its config.json


def adapter_targets(model: nn.Module) -> list[str]:
    """The names of the ``nn.Linear`` modules whose weight is a hidden matrix (the attention and MLP
    linears), found from the module structure (:func:`curvlab.models.roles.parameter_roles`)."""
    params = dict(model.named_parameters())
    hidden = set(hidden_matrices(params, model=model))
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and f"{n}.weight" in hidden]
    if not names:
        raise CurvlabError("the model has no hidden linear layers (attention or MLP) for LoRA to adapt")
    return names


def check_rank(model: nn.Module, rank: int, targets: list[str] | None = None) -> list[str]:
    """``targets`` (default :func:`adapter_targets`), after checking that rank r fits every one."""
    targets = adapter_targets(model) if targets is None else targets
    if rank < 1:
        raise CurvlabError(f"the LoRA rank must be >= 1, got {rank}")
    modules = dict(model.named_modules())
    for n in targets:
        d_out, d_in = modules[n].weight.shape
        if rank > min(d_out, d_in):
            raise CurvlabError(f"LoRA rank {rank} exceeds layer {n} ({d_out} x {d_in}); use r <= {min(d_out, d_in)}")
    return targets


def lora_model(base: nn.Module, rank: int, targets: list[str] | None = None) -> nn.Module:
    """``base`` wrapped by peft LoRA (rank r, alpha 2r, no dropout) on ``targets`` (default
    :func:`adapter_targets`); everything else is frozen."""
    from peft import LoraConfig, get_peft_model  # optional (the hf extra): only adapter runs need it

    targets = check_rank(base, rank, targets)
    return get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=targets))


def load_base(path: str | Path, device: str | torch.device = "cpu") -> tuple[GPT, dict[str, Any]]:
    """The GPT of a curvlab checkpoint, or of a finished run directory's last checkpoint (not one another
    process is training, nor one stopped before its last step), and the checkpoint's training config."""
    run, path = None, Path(path)
    if path.is_dir():
        check_not_owned(path, "it is still training; adapt it once it has finished")
        index = read_index(path)
        if not index:
            raise CurvlabError(f"{path}: not a training run (no checkpoints in index.json)")
        run, path = path, path / index[-1]["path"]
    if not path.is_file():
        raise CurvlabError(f"{path}: no such base run or checkpoint")
    ckpt = load_checkpoint(path, map_location=device)
    if "model_config" not in ckpt or "model" not in ckpt:
        raise CurvlabError(f"{path}: not a curvlab GPT checkpoint (no model_config)")
    config = ckpt.get("config") if isinstance(ckpt.get("config"), dict) else {}
    if run is not None and ckpt.get("step") != config.get("steps"):  # (a run stopped, or cut short by a crash)
        raise CurvlabError(
            f"{run}: has not finished training (its last checkpoint is step {ckpt.get('step')} of "
            f"{config.get('steps')}): finish it, or pass that checkpoint ({path}) to adapt it as it is"
        )
    model = GPT(GPTConfig(**ckpt["model_config"])).to(device)
    model.load_state_dict(ckpt["model"])
    return model, ckpt.get("config", {})


def check_vocab(data: str | Path, model: GPT) -> None:
    """Raises ``CurvlabError`` when the data's vocabulary (its ``stats.json``) exceeds the model's."""
    vocab = data_vocab_size(data)
    if vocab is not None and vocab > model.config.vocab_size:
        raise CurvlabError(
            f"{data}: the data's vocabulary ({vocab}) is larger than the base model's ({model.config.vocab_size})"
        )


def adapter_reference(base: str | Path, rank: int) -> dict[str, Any]:
    """What an adaptation run's frozen part is: the base checkpoint or run, and the LoRA settings
    (saved as ``adapter.json`` and in every checkpoint, beside the adapter weights)."""
    return {"base": str(base), "rank": rank, "alpha": 2 * rank}


def _adapter_difference(out: Path, reference: dict[str, Any]) -> list[str]:
    adapter = schema.read_json_object(out / ADAPTER_FILE, "settings of an adaptation run")
    if adapter.get("rank") != reference["rank"] or not same_path(adapter.get("base"), reference["base"]):
        return [f"adapter: {adapter} -> base {reference['base']!r}, rank {reference['rank']}"]
    return []


def _check_finished_run(out: Path, cfg: TrainConfig, base: Path, rank: int) -> None:
    """Refuse to reuse a finished run made with other settings (its directory does not name them)."""
    saved = schema.read_json_object(out / "config.json", "settings of a finished run")
    changed = config_difference(saved, json.loads(json.dumps(cfg.to_dict())))
    changed += _adapter_difference(out, adapter_reference(base, rank))
    if changed:
        raise CurvlabError(f"{out} holds a finished run with other settings ({'; '.join(changed)}): use a fresh --out")


def build_adapter_run(cfg: TrainConfig, base: str | Path, rank: int) -> Run:
    """The :class:`~curvlab.runs.train.Run` of an adaptation, at step 0: the base checkpoint's GPT wrapped
    by LoRA (:func:`lora_model`, A drawn from seed ``cfg.seed``; ``cfg.model`` is ignored), the optimizer
    ``cfg.optimizer`` of its adapters, the schedule and loaders of ``cfg``."""
    cfg.validate()
    device = pick_device(cfg.device)
    model, _ = load_base(base, device)
    check_vocab(cfg.data, model)
    torch.manual_seed(cfg.seed)  # peft draws A from the global generator
    model = lora_model(model, rank)
    optimizer = build_optimizer(cfg.optimizer, model, **cfg.optimizer_options)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg))
    data = TokenData.open(cfg.data)
    seq_len = cfg.seq_len or model.config.block_size
    loader = TrainBatches(data.train, cfg.batch_size, seq_len, seed=cfg.seed)
    val = validation_batches(data.val, cfg.batch_size, seq_len, cfg.val_windows)
    return Run(cfg, model, optimizer, scheduler, loader, val, device, base=adapter_reference(base, rank))


def adapt(cfg: TrainConfig, base: str | Path, rank: int, heldout_windows: int | None, progress: bool = True) -> float:
    """Fine-tune the base checkpoint with LoRA (:func:`build_adapter_run`) as ``cfg`` says, in
    :func:`curvlab.runs.train.train_loop`; an interrupted run resumes bit for bit, a finished one is not
    run again (a run in ``cfg.out`` with other settings is refused). Returns the final validation loss.

    With ``heldout_windows``, every checkpoint in the stable phase also gets a curvature row of the step
    taken from it (blocks :func:`~curvlab.optim.lora.adapter_blocks`, on the first ``heldout_windows``
    validation windows) in ``metrics.jsonl``.
    """
    with own_directory(cfg.out, "train"):  # (from the first read: a resume may delete and write before training)
        return _adapt(cfg, base, rank, heldout_windows, progress)


def _adapt(cfg: TrainConfig, base: str | Path, rank: int, heldout_windows: int | None, progress: bool) -> float:
    out = Path(cfg.out)
    index = read_index(out)
    if index and index[-1]["step"] == cfg.steps:
        _check_finished_run(out, cfg, base, rank)
        return float(index[-1]["val_loss"])
    reference = adapter_reference(base, rank)
    if index and "optimizer" not in load_checkpoint(out / index[-1]["path"]):
        # cut short before adapter runs could resume (no optimizer state): not resumed, nor written over
        raise CurvlabError(
            f"{out}: holds an adapter run cut short before adapter runs could resume (its checkpoints hold no "
            "optimizer state); remove it, or choose another --out"
        )
    if index:
        changed = _adapter_difference(out, reference)
        if changed:
            raise CurvlabError(f"{out} holds a run with other settings; refusing to resume ({'; '.join(changed)})")
    run = build_adapter_run(cfg, base, rank)
    monitor, due = None, None
    if heldout_windows:
        x, y = (torch.cat([b[i] for b in run.val_batches])[:heldout_windows].to(run.device) for i in (0, 1))
        blocks = adapter_blocks(run.model)
        monitor = CurvatureMonitor(
            run.model, run.optimizer, make_loss_fn(run.model), [(x, y)], every=cfg.ckpt_every, blocks=blocks, scope=None
        )

        def due(step: int) -> bool:  # the checkpoints of the stable phase, where runs are matched
            return monitor.due(step) and schedule_phase(step, cfg) == "stable"

    if not index:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / ADAPTER_FILE, json.dumps(reference))
    result = train_loop(
        run, progress=progress, curvature=monitor, measure_at=due, desc=f"adapt {cfg.optimizer}", leave=False
    )
    return result.val_loss


def curvature_rows(run: str | Path) -> dict[int, MonitorRow]:
    """Step -> the curvature row of the step taken from that checkpoint, from ``RUN/metrics.jsonl``."""
    return {r.step: r for r in monitor_rows(run)}
