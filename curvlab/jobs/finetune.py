r"""Curvature of adapter steps: LoRA fine-tuning under sMuon, LoRA-Muon, per-factor Muon and AdamW,
compared at matched validation loss with the fairness machinery of the main comparison.

The job (``curvlab finetune``), each stage skipped when its output exists with the same settings:

1. data: the Zipf-PCFG at s = 0 (pretraining) and at s = 1 (adaptation; its validation split at s = 1
   too, since the adapted model is judged on the distribution it adapts to), one grammar;
2. base: ``tiny`` pretrained with AdamW at s = 0 by :func:`curvlab.runs.train.train` (or a given run or
   checkpoint, ``--base``);
3. tune: for every adapter optimizer, its learning rate on the same log2 grid shape, the same seeds
   and the same short horizon, extended at its edges (:func:`curvlab.studies.tuning.search_lr`);
4. adapt: every optimizer and seed, the same steps, batches and warmup-stable-decay schedule; peft
   LoRA (``LoraConfig``/``get_peft_model``) on every ``nn.Linear`` inside the transformer blocks
   (found from the module structure: :func:`curvlab.curvature.groupings.layer_stacks`), rank r, alpha 2r, trained
   by the loop of full-model runs (:func:`curvlab.runs.train.train_loop`: a cut run resumes bit for bit). At
   every checkpoint in the stable phase a :class:`curvlab.runs.monitor.CurvatureMonitor` measures the
   step taken, :math:`Z_k = W_k - W_{k+1}` over the adapter parameters, on a fixed held-out batch D:

   .. math::
       I_1 = \langle G_D, Z\rangle,\ I_2 = \tfrac12\langle Z, H_D[Z]\rangle,\
       \text{predicted} = I_1 - I_2,\ \text{realized} = L_D(W) - L_D(W - Z),\
       \mathrm{NDS} = \langle Z, H_D[Z]\rangle / \|Z\|^2,

   and the block matrix :math:`M_{lm} = \langle Z_l, H_{lm}[Z_m]\rangle / \|Z\|^2` with one block per
   adapted layer, its A and B together (:func:`curvlab.optim.lora.adapter_blocks`): within = tr M,
   cross = the rest;
5. compare: per seed, AdamW against each Muon variant at matched validation loss in the stable
   phase (:func:`curvlab.runs.match.match_runs`), each side averaged over a window of neighbouring
   checkpoints; every level is kept (no filter on NDS, ever);
6. ``finetune.json`` (:class:`FinetuneResult`): the per-level data and, derived from it alone
   (:func:`estimates`), each ratio of means with its seed-level interval
   (:mod:`curvlab.studies.statistics`) over seeds and levels (:func:`curvlab.studies.statistics.estimate`);
   ``tuning.json``; a figure; ``report.md``.

Ratios are AdamW over the Muon variant (sum over seeds and levels of AdamW's window means over the
variant's), the orientation of the paper's AdamW/Muon NDS ratio.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from curvlab.curvature.groupings import hidden_matrices
from curvlab.curvature.scalars import RATIO_KEYS, SCOPE_KEYS
from curvlab.data.dataset import generate_pcfg_dataset, read_stats
from curvlab.data.shards import TokenData, TrainBatches, data_vocab_size, validation_batches
from curvlab.engine.loss import make_loss_fn
from curvlab.errors import CurvlabError
from curvlab.jobs.job import Job
from curvlab.models.gpt import GPT, MICRO_OVERRIDES, GPTConfig, get_config
from curvlab.optim.build import build_optimizer
from curvlab.optim.lora import adapter_blocks
from curvlab.output import plots
from curvlab.output import text as report
from curvlab.runs.checkpoint import load_checkpoint, read_index
from curvlab.runs.match import MatchCriteria, match_runs
from curvlab.runs.monitor import CurvatureMonitor, MonitorRow
from curvlab.runs.train import (
    Run,
    TrainConfig,
    config_difference,
    lr_multiplier,
    pick_device,
    schedule_phase,
    train,
    train_loop,
)
from curvlab.studies import statistics as st
from curvlab.studies.track import monitor_rows
from curvlab.studies.tuning import TuningRecord, TuningSettings
from curvlab.util import schema
from curvlab.util.atomic import atomic_write_text

FINETUNE_SCHEMA_VERSION = 1
ADAPTER_ARMS = ("adamw", "smuon", "lora-muon", "per-factor-muon")
MUON_VARIANTS = ("smuon", "lora-muon", "per-factor-muon")  # each compared against AdamW
LEVEL_KEYS = (*SCOPE_KEYS, "within", "cross")  # what a level's window means average
ADAPTER_FILE = "adapter.json"  # the LoRA settings of an adaptation run, beside its config.json


# -- presets ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FinetunePreset:
    """Every setting of a fine-tuning comparison (``curvlab finetune --preset``)."""

    name: str
    model: str = "tiny"
    model_overrides: dict[str, Any] = field(default_factory=dict)
    grammar: dict[str, Any] = field(default_factory=dict)
    tokens: str = "1M"
    val_tokens: str = "50k"
    pretrain_steps: int = 300
    pretrain_lr: float = 0.004  # AdamW, the main comparison's tuned centre
    rank: int = 8
    steps: int = 120
    batch_size: int = 16
    warmup_steps: int = 10
    cooldown_frac: float = 0.2
    seeds: int = 3
    lr_centers: dict[str, float] = field(
        default_factory=lambda: {"adamw": 0.008, "smuon": 0.04, "lora-muon": 0.04, "per-factor-muon": 0.04}
    )
    grid_points: int = 5
    tune_seeds: int = 2
    tune_seed_base: int = 1000  # tuning seeds tune_seed_base, ... (disjoint from the measured ones)
    tune_steps: int = 60
    max_extensions: int = 2
    ckpt_every: int = 4
    val_windows: int = 32
    heldout_windows: int = 8  # the curvature's held-out batch D: the first windows of the validation split
    levels: int = 6
    tolerance: float = 0.01
    window: int = 1
    n_boot: int = 2000
    device: str = "cpu"

    @property
    def tuning_settings(self) -> TuningSettings:
        return TuningSettings.of(self, self.tune_steps)

    @property
    def matching(self) -> MatchCriteria:  # in the stable phase, as the main comparison
        return MatchCriteria(levels=self.levels, tolerance=self.tolerance, window=self.window)

    def validate(self) -> None:
        if self.seeds < 1:
            raise CurvlabError("a fine-tuning preset needs seeds >= 1")
        self.tuning_settings.validate(self.seeds)
        missing = sorted(set(ADAPTER_ARMS) - set(self.lr_centers))
        if missing:
            raise CurvlabError(f"lr_centers lacks {', '.join(missing)}")
        if self.rank < 1:
            raise CurvlabError(f"the LoRA rank must be >= 1, got {self.rank}")
        if self.heldout_windows > self.val_windows:
            raise CurvlabError(f"heldout_windows {self.heldout_windows} exceeds val_windows {self.val_windows}")


FINETUNE_PRESETS = {
    "micro": FinetunePreset(
        "micro",
        model_overrides=MICRO_OVERRIDES,
        grammar={"n_tokens": 300},
        tokens="60k",
        val_tokens="6k",
        pretrain_steps=20,
        rank=2,
        steps=24,
        batch_size=8,
        warmup_steps=2,
        seeds=2,
        grid_points=2,
        tune_seeds=1,
        tune_steps=4,
        max_extensions=1,
        ckpt_every=2,
        val_windows=8,
        heldout_windows=4,
        levels=2,
        tolerance=0.05,
        n_boot=200,
    ),
    # One thread, about seven minutes: the quick reproduction's 1024-token grammar, 3 seeds, a 4-point grid
    # of 30-step runs (the report says so; `standard` runs 5-point grids of longer runs).
    "quick": FinetunePreset(
        "quick",
        model_overrides={"vocab_size": 1088},
        grammar={"n_tokens": 1024},
        tokens="1M",
        val_tokens="40k",
        pretrain_steps=600,
        rank=4,
        steps=120,
        warmup_steps=8,
        seeds=3,
        grid_points=4,
        tune_seeds=2,
        tune_steps=30,
        max_extensions=2,
        ckpt_every=4,
        val_windows=16,
        heldout_windows=4,
        levels=6,
        tolerance=0.02,
    ),
    # The full design on the paper's 4412-token grammar: 3 seeds, 5-point grids with 2 seeds per point.
    "standard": FinetunePreset(
        "standard", model_overrides={"vocab_size": 4416}, tokens="2M", val_tokens="100k", pretrain_steps=1000, steps=200
    ),
}


# -- one adaptation run ------------------------------------------------------------------------------


def adapter_targets(model: nn.Module) -> list[str]:
    """The names of the ``nn.Linear`` modules whose weight is a hidden matrix (the attention and MLP
    linears; not the embeddings or the head), found from the module structure
    (:func:`curvlab.models.roles.parameter_roles`), never from parameter names.

    Raises:
        CurvlabError: the model has no such linear layer (nothing for LoRA to adapt).
    """
    params = dict(model.named_parameters())
    hidden = set(hidden_matrices(params, model))
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and f"{n}.weight" in hidden]
    if not names:
        raise CurvlabError("the model has no hidden linear layers (attention or MLP) for LoRA to adapt")
    return names


def check_rank(model: nn.Module, rank: int, targets: list[str] | None = None) -> list[str]:
    """``targets`` (default :func:`adapter_targets`), after checking that rank r fits every one.

    Raises:
        CurvlabError: r < 1, or r larger than a target layer's smaller side; no layer to adapt.
    """
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
    :func:`adapter_targets`); everything else is frozen.

    Raises:
        CurvlabError: no linear layer to adapt, or a rank larger than a layer's smaller side.
    """
    from peft import LoraConfig, get_peft_model

    targets = check_rank(base, rank, targets)
    return get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=targets))


def load_base(path: str | Path, device: str | torch.device = "cpu") -> tuple[GPT, dict[str, Any]]:
    """The GPT of a curvlab checkpoint, or of a run directory's last checkpoint, and the checkpoint's
    training config (``config``).

    Raises:
        CurvlabError: no such run or checkpoint, a corrupt one, or one without a GPT config.
    """
    path = Path(path)
    if path.is_dir():
        index = read_index(path)
        if not index:
            raise CurvlabError(f"{path}: not a training run (no checkpoints in index.json)")
        path = path / index[-1]["path"]
    if not path.is_file():
        raise CurvlabError(f"{path}: no such base run or checkpoint")
    ckpt = load_checkpoint(path, map_location=device)
    if "model_config" not in ckpt or "model" not in ckpt:
        raise CurvlabError(f"{path}: not a curvlab GPT checkpoint (no model_config)")
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
    try:
        adapter = json.loads((out / ADAPTER_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CurvlabError(f"{out}: an adaptation run without readable settings ({type(e).__name__})") from None
    if adapter.get("rank") != reference["rank"] or adapter.get("base") != reference["base"]:
        return [f"adapter: {adapter} -> base {reference['base']!r}, rank {reference['rank']}"]
    return []


def _check_finished_run(out: Path, cfg: TrainConfig, base: Path, rank: int) -> None:
    """Refuse to reuse a finished run made with other settings (its directory does not name them)."""
    try:
        saved = json.loads((out / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CurvlabError(f"{out}: a finished run without readable settings ({type(e).__name__})") from None
    changed = config_difference(saved, json.loads(json.dumps(cfg.to_dict())))
    changed += _adapter_difference(out, adapter_reference(base, rank))
    if changed:
        raise CurvlabError(f"{out} holds a finished run with other settings ({'; '.join(changed)}): use a fresh --out")


def build_adapter_run(cfg: TrainConfig, base: str | Path, rank: int) -> Run:
    """The :class:`~curvlab.runs.train.Run` of an adaptation, at step 0: the base checkpoint's GPT wrapped
    by LoRA (:func:`lora_model`, A drawn from seed ``cfg.seed``), the optimizer ``cfg.optimizer`` of
    its adapters (:func:`curvlab.optim.build.build_optimizer`), the schedule and loaders of ``cfg``
    (``cfg.model`` is ignored: the base's model is used).

    Raises:
        CurvlabError: a bad config, base, data or rank.
    """
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
    """Fine-tune the base checkpoint with LoRA (:func:`build_adapter_run`) as ``cfg`` says (optimizer,
    lr, steps, schedule, batches, seed), in the training loop of full-model runs
    (:func:`curvlab.runs.train.train_loop`); an interrupted run resumes from its last checkpoint, bit for bit.

    With ``heldout_windows``, every checkpoint in the stable phase also gets a curvature row of the
    step taken from it (:class:`~curvlab.runs.monitor.CurvatureMonitor`, blocks
    :func:`~curvlab.optim.lora.adapter_blocks`,
    on the first ``heldout_windows`` validation windows) in ``metrics.jsonl``. Checkpoints hold the
    adapter parameters, the base's reference (:func:`adapter_reference`) and the optimizer, schedule,
    loader and RNG states. A finished run is not run again. Returns the final validation loss.

    Raises:
        CurvlabError: a bad base, data or rank; a finished or interrupted run in ``cfg.out`` with other
            settings; :class:`~curvlab.runs.train.TrainingDiverged` on a non-finite training loss.
    """
    out = Path(cfg.out)
    index = read_index(out)
    if index and index[-1]["step"] == cfg.steps:
        _check_finished_run(out, cfg, base, rank)
        return float(index[-1]["val_loss"])
    reference = adapter_reference(base, rank)
    if index and "optimizer" not in load_checkpoint(out / index[-1]["path"]):
        # cut short before adapter runs could resume (no optimizer state): it starts over, as it did then
        (out / "index.json").unlink()
        index = []
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
            run.model, run.optimizer, make_loss_fn(run.model), [(x, y)], cfg.ckpt_every, blocks, subset=[]
        )

        def due(step: int) -> bool:  # the checkpoints of the stable phase, where runs are matched
            return monitor.due(step) and schedule_phase(step, cfg) == "stable"

    if not index:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / ADAPTER_FILE, json.dumps(reference))
    result = train_loop(run, progress, curvature=monitor, measure_at=due, desc=f"adapt {cfg.optimizer}", leave=False)
    return result.val_loss


def curvature_rows(run: str | Path) -> dict[int, MonitorRow]:
    """Step -> the curvature row of the step taken from that checkpoint, from ``RUN/metrics.jsonl``."""
    return {r.step: r for r in monitor_rows(run)}


# -- typed results ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AdapterLevel:
    """One matched validation-loss level of AdamW against a Muon variant, in one seed: each side's
    matched step, its window's steps and the window means of :data:`LEVEL_KEYS`."""

    seed: int
    target: float
    mismatch: float
    steps: dict[str, int]
    windows: dict[str, list[int]]
    values: dict[str, dict[str, float]]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AdapterLevel:
        return cls(d["seed"], d["target"], d["mismatch"], d["steps"], d["windows"], d["values"])


@dataclass(frozen=True)
class AdapterComparison:
    """AdamW against one Muon variant at matched loss, over every seed (``refused``: levels and seeds
    without a match, with the reason)."""

    variant: str
    levels: list[AdapterLevel]
    refused: list[str] = field(default_factory=list)

    def seeds(self) -> list[int]:
        return sorted({lv.seed for lv in self.levels})

    def rows(self, num: tuple[str, str], den: tuple[str, str]) -> list[np.ndarray]:
        """Per seed, the ``(levels, 2)`` array of (numerator, denominator) window means, each given as
        ``(arm, key)`` with arm ``"adamw"`` or ``"variant"``."""
        arm = {"adamw": "adamw", "variant": self.variant}
        return [
            np.array(
                [[lv.values[arm[num[0]]][num[1]], lv.values[arm[den[0]]][den[1]]] for lv in self.levels if lv.seed == s]
            )
            for s in self.seeds()
        ]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AdapterComparison:
        return cls(d["variant"], [AdapterLevel.from_dict(lv) for lv in d["levels"]], d["refused"])


@dataclass(frozen=True)
class FinetuneEntry:
    """One summary number: a ratio of sums over seeds and levels, its 95% seed-level interval (``None``
    with one seed), the numbers of seeds and levels, and the per-level values it comes from."""

    name: str  # e.g. "nds_ratio", "rho_within_adamw"
    variant: str  # the comparison, "adamw/<variant>"
    quantity: str
    value: float
    ci95: list[float] | None
    n_levels: int
    n_seeds: int
    per_level: list[dict[str, Any]]
    note: str = ""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FinetuneEntry:
        return cls(**d)


@dataclass
class FinetuneResult:
    """Everything ``curvlab finetune`` measured (``finetune.json``, ``FINETUNE_SCHEMA_VERSION``)."""

    SCHEMA_VERSION: ClassVar[int] = FINETUNE_SCHEMA_VERSION
    WHAT: ClassVar[str] = "fine-tuning results"

    preset: dict[str, Any]
    base: str
    chosen_lr: dict[str, float]
    comparisons: list[AdapterComparison]
    entries: list[FinetuneEntry]
    final_loss: dict[str, list[float]]  # arm -> final validation loss per seed
    notes: list[str]
    timing: dict[str, float] = field(default_factory=dict)

    def entry(self, name: str, variant: str) -> FinetuneEntry:
        found = [e for e in self.entries if e.name == name and e.variant == variant]
        if not found:
            raise CurvlabError(f"no entry {name!r} for adamw/{variant}")
        return found[0]

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": FINETUNE_SCHEMA_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FinetuneResult:
        schema.check(d, cls)
        return cls(
            d["preset"],
            d["base"],
            d["chosen_lr"],
            [AdapterComparison.from_dict(c) for c in d["comparisons"]],
            [FinetuneEntry.from_dict(e) for e in d["entries"]],
            d["final_loss"],
            d["notes"],
            d["timing"],
        )

    def save(self, path: str | Path) -> None:
        atomic_write_text(Path(path), json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> FinetuneResult:
        return schema.load(path, cls)


# (name, quantity, numerator (arm, key), denominator (arm, key)): every summary number is a ratio
ENTRY_SPECS = (
    *((f"{k}_ratio", f"{k} AdamW / variant", ("adamw", k), ("variant", k)) for k in RATIO_KEYS),
    ("rho_within_adamw", "within-layer share of NDS, AdamW", ("adamw", "within"), ("adamw", "nds")),
    ("rho_within_variant", "within-layer share of NDS, variant", ("variant", "within"), ("variant", "nds")),
    ("taylor_adamw", "predicted / realized decrease, AdamW", ("adamw", "predicted"), ("adamw", "realized")),
    ("taylor_variant", "predicted / realized decrease, variant", ("variant", "predicted"), ("variant", "realized")),
)


def estimates(comparisons: list[AdapterComparison], n_boot: int = st.N_BOOT) -> list[FinetuneEntry]:
    """Every summary entry, from the per-level data alone: for each comparison and each of
    :data:`ENTRY_SPECS`, the ratio of sums over seeds and levels of the window means, and the median
    of the per-level ratios (``_median``), each with its seed-level interval
    (:func:`curvlab.studies.statistics.ratio_estimates`). No level is dropped."""
    entries = []
    for c in comparisons:
        for name, quantity, num, den in ENTRY_SPECS:
            rows = c.rows(num, den)
            levels = sorted(c.levels, key=lambda lv: lv.seed)  # the order of the rows
            stacked = np.concatenate(rows) if rows else np.zeros((0, 2))
            per_level = [
                {"seed": lv.seed, "target": lv.target, "numerator": float(r[0]), "denominator": float(r[1])}
                for lv, r in zip(levels, stacked)
            ]
            if not rows:
                for suffix in ("", "_median"):
                    label = quantity + (" (median over levels)" if suffix else "")
                    entries.append(FinetuneEntry(name + suffix, c.variant, label, math.nan, None, 0, 0, [], "no level"))
                continue
            for suffix, est in st.ratio_estimates(rows, n_boot).items():
                label = quantity + (" (median over levels)" if suffix else "")
                note = "" if est.ci95 is not None else f"{est.n_seeds} seed(s): no interval"
                if est.denominator_spans_zero:
                    note = st.DENOMINATOR_NOTE
                ci = None if est.ci95 is None else list(est.ci95)
                entry = FinetuneEntry(
                    name + suffix, c.variant, label, est.value, ci, est.n_units, est.n_seeds, per_level, note
                )
                entries.append(entry)
    return entries


def _side_means(rows: dict[int, MonitorRow], steps: list[int]) -> dict[str, float]:
    """Window means of :data:`LEVEL_KEYS` over the curvature rows at ``steps`` (a row that is not
    ``ok``, non-finite or a zero step, counts as NaN and makes the mean NaN: nothing is dropped)."""

    window = [rows[s].scalars() if rows[s].ok else None for s in steps]
    return {k: float(np.mean([math.nan if r is None else r.value(k) for r in window])) for k in LEVEL_KEYS}


def compare_adapters(
    runs: dict[tuple[str, int], Path], seeds: list[int], preset: FinetunePreset
) -> list[AdapterComparison]:
    """Per seed, AdamW's run against each Muon variant's at matched validation loss in the stable
    phase, each side averaged over its window (:func:`curvlab.runs.match.match_runs`)."""
    comparisons, m = [], preset.matching
    for variant in MUON_VARIANTS:
        levels, refused = [], []
        for seed in seeds:
            a, b = runs[("adamw", seed)], runs[(variant, seed)]
            try:
                matched = match_runs(a, b, m.levels, m.tolerance, phase=m.phase, window_width=m.window)
            except CurvlabError as e:
                refused.append(f"seed {seed}: {e}")
                continue
            refused += [f"seed {seed}: {r}" for r in matched.refused]
            rows_a, rows_b = curvature_rows(a), curvature_rows(b)
            for pair in matched.pairs:
                wa, wb = [c.step for c in pair.window_a], [c.step for c in pair.window_b]
                levels.append(
                    AdapterLevel(
                        seed,
                        pair.target,
                        pair.mismatch,
                        {"adamw": pair.a.step, variant: pair.b.step},
                        {"adamw": wa, variant: wb},
                        {"adamw": _side_means(rows_a, wa), variant: _side_means(rows_b, wb)},
                    )
                )
        comparisons.append(AdapterComparison(variant, levels, refused))
    return comparisons


# -- the job ----------------------------------------------------------------------------------------


class Finetune(Job):
    """One fine-tuning comparison in one output directory (see the module docstring)."""

    TAG = "finetune"
    CONFIG_FILE = "finetune-config.json"
    WHAT = "a fine-tuning comparison"

    def __init__(
        self,
        preset: FinetunePreset,
        out: str | Path,
        base: str | Path | None = None,
        data: str | Path | None = None,
        progress: bool = True,
    ):
        preset.validate()
        super().__init__(out, progress)
        self.preset = preset
        self.base = Path(base) if base else None
        self.data_dir = Path(data) if data else None
        self._tuning_base: Path | None = None  # the base checkpoint or run the tuning runs adapt (tune())
        # a missing or incompatible base, or a rank that does not fit, fails now, not after the data
        model = (
            load_base(self.base)[0]
            if self.base is not None
            else GPT(get_config(preset.model, **preset.model_overrides))
        )
        check_rank(model, preset.rank)
        if self.data_dir is not None:
            check_vocab(self.data_dir, model)

    def config(self) -> dict[str, Any]:
        return {"preset": asdict(self.preset), "base": str(self.base), "data": str(self.data_dir)}

    def tuning_settings(self) -> TuningSettings:
        return self.preset.tuning_settings

    def prepare(self) -> tuple[Path, Path]:
        """(the s = 1 adaptation data, the base checkpoint or run): made here unless given."""
        p = self.preset
        if self.base is not None:
            if self.data_dir is not None:
                return self.data_dir, self.base
            _, config = load_base(self.base)
            source = Path(config.get("data", ""))
            stats = read_stats(source) if config.get("data") else None
            if stats is None or "grammar_options" not in stats.get("config", {}):
                raise CurvlabError(f"{self.base}: its training data is not a Zipf-PCFG directory; pass --data")
            grammar, seed = stats["config"]["grammar_options"], stats["config"]["seed"]
        else:
            grammar, seed = p.grammar, 0
        target = self.data_dir or self.out / "data" / "s1"
        if self.data_dir is None:
            generate_pcfg_dataset(
                target,
                1.0,
                p.tokens,
                p.val_tokens,
                val_s=1.0,
                seed=seed,
                grammar_options=grammar,
                progress=self.progress,
            )
        if self.base is not None:
            return target, self.base
        s0 = self.out / "data" / "s0"
        generate_pcfg_dataset(
            s0, 0.0, p.tokens, p.val_tokens, val_s=0.0, seed=seed, grammar_options=grammar, progress=self.progress
        )
        base = self.out / "base"
        cfg = TrainConfig(
            data=str(s0),
            out=str(base),
            model=p.model,
            model_overrides=dict(p.model_overrides),
            optimizer="adamw",
            optimizer_options={"lr": p.pretrain_lr},
            batch_size=p.batch_size,
            steps=p.pretrain_steps,
            warmup_steps=p.warmup_steps,
            schedule="wsd",
            cooldown_frac=p.cooldown_frac,
            eval_every=p.pretrain_steps,
            ckpt_every=p.pretrain_steps,
            val_windows=p.val_windows,
            device=p.device,
        )
        index = read_index(base)
        if not (index and index[-1]["step"] == p.pretrain_steps):
            train(cfg, progress=self.progress)
        self._say(f"base: {base} (AdamW, {p.pretrain_steps} steps at s = 0)")
        return target, base

    def _config(
        self, data: Path, out: Path, arm: str, lr: float, seed: int, steps: int, ckpt_every: int
    ) -> TrainConfig:
        p = self.preset
        return TrainConfig(
            data=str(data),
            out=str(out),
            model=p.model,
            optimizer=arm,
            optimizer_options={"lr": lr},
            batch_size=p.batch_size,
            steps=steps,
            warmup_steps=max(1, p.warmup_steps * steps // p.steps),
            schedule="wsd",
            cooldown_frac=p.cooldown_frac,
            seed=seed,
            eval_every=ckpt_every,
            ckpt_every=ckpt_every,
            val_windows=p.val_windows,
            device=p.device,
        )

    def _short_run(self, data: Path, run: Path, arm: str, options: dict[str, float], seed: int, steps: int) -> float:
        cfg = self._config(data, run, arm, options["lr"], seed, steps, steps)
        return adapt(cfg, self._tuning_base, self.preset.rank, None, progress=self.progress)

    def tune(self, data: Path, base: Path) -> TuningRecord:
        """Every arm's learning rate: the same grid shape, seeds, horizon and extension rule
        (:meth:`curvlab.jobs.job.Job._search`)."""
        saved = self.saved_tuning()
        if saved is not None:
            return saved
        self._tuning_base = base
        t = self.tuning_settings()
        seeds = t.seeds()
        searches = {f"{arm}.lr": self._search(data, arm, "lr", t.grid(arm), {}, t.max_extensions, seeds)
                    for arm in ADAPTER_ARMS}  # fmt: skip
        chosen = {arm: {"lr": searches[f"{arm}.lr"].chosen} for arm in ADAPTER_ARMS}
        return self.save_tuning(TuningRecord("search", 1.0, t.horizon_steps, seeds, searches, chosen))

    def adapt_all(self, data: Path, base: Path, chosen: dict[str, dict[str, float]]) -> dict[tuple[str, int], Path]:
        p = self.preset
        runs = {}
        for arm in ADAPTER_ARMS:
            for seed in range(p.seeds):
                run = self.out / "runs" / arm / f"seed{seed}"
                cfg = self._config(data, run, arm, chosen[arm]["lr"], seed, p.steps, p.ckpt_every)
                adapt(cfg, base, p.rank, p.heldout_windows, progress=self.progress)
                runs[(arm, seed)] = run
        self._say(f"adapted {len(runs)} runs")
        return runs

    def notes(self) -> list[str]:
        p = self.preset
        notes = [
            f"LoRA rank {p.rank} (alpha {2 * p.rank}) on every attention and MLP linear of `{p.model}`; "
            f"{p.steps} adaptation steps at s = 1, warmup-stable-decay, the same for every optimizer.",
            f"Learning rates tuned on a {p.grid_points}-point log2 grid (extended up to {p.max_extensions} times "
            f"at an edge), {p.tune_seeds} seed(s) per point, {p.tune_steps}-step runs.",
            f"Curvature of the step taken at each checkpoint of the stable phase ({p.ckpt_every} steps apart), over "
            f"the adapter parameters, on {p.heldout_windows} held-out validation windows at s = 1 (the main "
            "comparison measures on the step's training batches).",
            f"Matched levels: {p.levels} targets in the stable phase, tolerance {p.tolerance:.0%}, windows of up to "
            f"{2 * p.window + 1} checkpoints; no level is dropped.",
        ]
        if p.seeds < 3:
            notes.append(f"{p.seeds} seeds per optimizer (3 in the standard preset): the intervals are rough.")
        if p.grid_points < 5 or p.tune_seeds < 2:
            notes.append("Reduced tuning (the standard preset: 5-point grids, 2 seeds per point).")
        return notes

    def run(self) -> FinetuneResult:
        self.start()
        with self.clock("prepare"):
            data, base = self.prepare()
        with self.clock("tune"):
            tuning = self.tune(data, base)
        with self.clock("adapt"):
            runs = self.adapt_all(data, base, tuning.chosen)
        with self.clock("compare"):
            comparisons = compare_adapters(runs, list(range(self.preset.seeds)), self.preset)
            entries = estimates(comparisons, self.preset.n_boot)
        final = {
            arm: [float(read_index(runs[(arm, s)])[-1]["val_loss"]) for s in range(self.preset.seeds)]
            for arm in ADAPTER_ARMS
        }
        timing = self.timing()
        result = FinetuneResult(
            asdict(self.preset),
            str(base),
            {a: v["lr"] for a, v in tuning.chosen.items()},
            comparisons,
            entries,
            final,
            self.notes(),
            timing,
        )
        result.save(self.out / "finetune.json")
        plots.finetune_ratios(result, self.out / "figures" / "finetune_ratios")
        atomic_write_text(self.out / "report.md", "\n".join(report.finetune_section(result)) + "\n")
        self._say(f"done in {timing['total']:.0f} s: {self.out / 'finetune.json'}")
        return result


def with_preset(name: str, **overrides: Any) -> FinetunePreset:
    """A named preset with fields replaced.

    Raises:
        CurvlabError: an unknown preset name.
    """
    if name not in FINETUNE_PRESETS:
        raise CurvlabError(f"unknown fine-tuning preset {name!r}; choose one of {', '.join(FINETUNE_PRESETS)}")
    return replace(FINETUNE_PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})
