"""A design is data: the frozen records a reproduction is made of, grouped by concept, and the one
function that derives a run's :class:`~curvlab.runs.config.TrainConfig` from them (:func:`train_config`).

* :class:`Language` (the Zipf-PCFG and its splits), :class:`Network` (the model), :class:`Training` (the
  schedule and checkpoints), :class:`Tuning` (where learning rates come from), :class:`Measurement` (the
  matched levels, trajectories, controls and stability context), :class:`Inference` (the judged claims and
  the A/A calibration) and :class:`FinewebRun` (the paper's own data), gathered by :class:`Preset` with the
  arms and seeds it compares;
* :class:`RobustnessSetting` and :class:`RobustnessPreset`: a design made of a base :class:`Preset` changed
  one way at a time; :class:`ScalingRung` and :class:`ScalingPreset`: a ladder of model sizes;
* :class:`FinetunePreset`: the fine-tuning comparison's settings.

A preset is also read and written *flat* (:meth:`Preset.flat`, :meth:`Preset.changed`), every field under
the name it had when presets were one record: saved job configurations keep that form, so a directory an
earlier curvlab made continues, and ``changed(steps=40)`` reaches a field without naming its record.
The named presets are :mod:`curvlab.jobs.presets`'.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, ClassVar

from curvlab.data.corpus import CORPORA
from curvlab.errors import CurvlabError
from curvlab.models.gpt import get_config
from curvlab.runs.config import TrainConfig
from curvlab.runs.match import PLATEAU_FRACTION, MatchCriteria
from curvlab.studies.adapters import ADAPTER_ARMS
from curvlab.studies.paper import REFERENCE_TRAINING, judged_claims
from curvlab.studies.tuning import TuningSettings

# 6 matched levels in the stable phase at a 1% tolerance, each averaged over a window of the matched
# checkpoint and one neighbour on each side (both jobs); and each job's tuning defaults
STABLE_MATCHING = MatchCriteria(levels=6, tolerance=0.01, phase="stable", window=1)
REPRODUCE_TUNING = TuningSettings({"adamw": 0.004, "muon": 0.02})  # at the compared horizon
FINETUNE_TUNING = TuningSettings(
    {"adamw": 0.008, "smuon": 0.04, "lora-muon": 0.04, "per-factor-muon": 0.04}, horizon_steps=60, max_extensions=2
)
PAPER_LR = {arm: REFERENCE_TRAINING[arm]["lr"] for arm in ("muon", "adamw")}
CONTROL_ARM = "muon-moonlight"
# The optional packages a LoRA fine-tuning needs (module -> the curvlab extra that installs it): its
# adapters are peft's. A job that runs one names them missing before it starts
FINETUNE_EXTRAS = {"peft": "hf"}
# What a tuned learning rate depends on (flat names): a table entry made under other values is not used
TUNING_DEPENDS_ON = ("model", "model_overrides", "grammar", "tokens", "val_tokens", "batch_size", "warmup_steps")
TUNING_DEPENDS_ON += ("schedule", "cooldown_frac", "val_windows", "adam_side")


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise CurvlabError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")


@dataclass(frozen=True)
class Arm:
    """One optimizer as compared: a ``build_optimizer`` name and the options that set it apart."""

    name: str
    optimizer: str
    options: dict[str, Any] = field(default_factory=dict)


ARMS = {
    "adamw": Arm("adamw", "adamw"),
    "muon": Arm("muon", "muon"),
    # the step-size control: RMS-matched scaling 0.2 sqrt(max(rows, cols)) (docs/science.md section 10, width)
    CONTROL_ARM: Arm(CONTROL_ARM, "muon", {"scale": "moonlight"}),
}


class _Part:
    """A preset's record: its fields flat under their own names, but those ``FLAT`` renames."""

    FLAT: ClassVar[dict[str, str]] = {}

    def flat(self) -> dict[str, Any]:
        return {self.FLAT.get(f.name, f.name): getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Language(_Part):
    """The data: the Zipf-PCFG's training exponents (validation at s = 0), the grammar (``make_grammar``
    options and draw; the token streams' seeds derive from the draw) and the splits' sizes; or, with
    ``corpus``, natural text instead of the grammar: a corpus curvlab makes (:data:`curvlab.data.corpus.CORPORA`)
    tokenized by a byte-level BPE of ``corpus_vocab`` tokens trained on it, a ``corpus_val_fraction`` of its
    documents for validation (chosen with ``grammar_seed``), or a user's data directory (``--data``: named
    by the digest of its stats). A corpus has no s: its one language is labelled s = 0."""

    s_values: tuple[float, ...] = (0.0, 0.5, 1.0)
    grammar: dict[str, Any] = field(default_factory=dict)
    grammar_seed: int = 0
    tokens: str = "2M"
    val_tokens: str = "100k"
    val_windows: int = 64
    corpus: str | None = None
    corpus_vocab: int = 1024
    corpus_val_fraction: float = 0.05


@dataclass(frozen=True)
class Network(_Part):
    """The model: a :data:`curvlab.models.gpt.CONFIGS` name and the fields it changes."""

    model: str = "tiny"
    model_overrides: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Training(_Part):
    """Every run's schedule and checkpoints: at the first s every ``ckpt_every`` steps (matched levels at a
    1% tolerance need dense checkpoints), at the others every ``sweep_ckpt_every`` (trajectories only)."""

    steps: int = 200
    batch_size: int = 16
    warmup_steps: int = 10
    schedule: str = "wsd"
    cooldown_frac: float = 0.2
    ckpt_every: int = 2
    sweep_ckpt_every: int = 10
    device: str = "auto"

    def stable_end(self) -> int:
        """The last step of the stable phase (the schedule's end without a cooldown)."""
        return self.steps - int(self.cooldown_frac * self.steps) if self.schedule == "wsd" else self.steps


@dataclass(frozen=True)
class Tuning(_Part):
    """Where the learning rates come from, at the first s on seeds disjoint from the measured ones: the
    committed table, checked on a ``check_points`` grid with the check seeds (``lr_source="table"``), or
    the full search of ``rule`` here (``"search"``). The hybrids' Adam side is tied to AdamW's lr, or
    tuned on its own grid (``adam_side``)."""

    FLAT: ClassVar[dict[str, str]] = {"rule": "tuning"}
    SOURCES: ClassVar[tuple[str, ...]] = ("table", "search")
    ADAM_SIDES: ClassVar[tuple[str, ...]] = ("tied", "tuned")

    rule: TuningSettings = REPRODUCE_TUNING
    adam_side: str = "tied"
    lr_source: str = "table"
    check_points: int = 3
    check_seeds: int = 1
    check_seed_base: int = 2000

    def check_seed_list(self) -> list[int]:
        return [self.check_seed_base + i for i in range(self.check_seeds)]


@dataclass(frozen=True)
class Measurement(_Part):
    """What is measured, and where: the matched levels (``matching``; levels within ``plateau_fraction``
    of the unigram entropy are flagged) on ``analysis_batches`` batches, the trajectories every
    ``track_interval`` steps, the controls (every run keeps its twins, docs/science.md section 14) and,
    every ``stability_interval`` steps, the stability context in at most ``stability_iterations`` Lanczos
    iterations. ``keep``: which checkpoints stay once a seed's analyses are saved ("last", "windows" or
    "all", to analyse again with other settings). ``factorial``: the factorial of filters and maps at every
    point the controls read (:mod:`curvlab.analysis.factorial`; the mechanism design). ``track_points``:
    "all" tracked checkpoints, or only those a claim or control reads ("read": inside the stable phase and
    off the unigram plateau; the trajectory figures then show those alone). ``gauss_newton``: both arms' NDS
    split into its Gauss–Newton part and the residual wherever the paired directions are measured
    (:mod:`curvlab.curvature.gauss_newton`)."""

    KEEP: ClassVar[tuple[str, ...]] = ("last", "windows", "all")
    TRACK_POINTS: ClassVar[tuple[str, ...]] = ("all", "read")

    matching: MatchCriteria = STABLE_MATCHING
    plateau_fraction: float = PLATEAU_FRACTION
    analysis_batches: int = 4
    track_interval: int = 20
    track_batches: int = 2
    controls: bool = True
    stability_iterations: int = 40  # at most, per eigenproblem: it stops at LANCZOS_TOL (about 10 at quick's points)
    stability_interval: int = 60
    keep: str = "last"
    factorial: bool = False
    track_points: str = "all"
    gauss_newton: bool = False


@dataclass(frozen=True)
class Inference(_Part):
    """What is judged: the primary claims (:data:`curvlab.studies.paper.PRIMARY` names; ``None``: all six;
    the others are shown, descriptive, docs/science.md section 12), and the A/A calibration: ``aa_pairs``
    "neighbouring" ((0, 1), (1, 2), ...: a smoke test) or "disjoint" ((0, 1), (2, 3), ...: independent),
    on ``aa_analysis_batches`` evaluation batches (``None``: the measurement's)."""

    PAIRS: ClassVar[tuple[str, ...]] = ("neighbouring", "disjoint")

    primary: tuple[str, ...] | None = None
    calibration: bool = True
    aa_pairs: str = "neighbouring"
    aa_analysis_batches: int | None = None


@dataclass(frozen=True)
class FinewebRun(_Part):
    """gpt2-124m on the user's FineWeb shards at the paper's learning rates (docs/science.md section 4)."""

    FLAT: ClassVar[dict[str, str]] = {f: f"fineweb_{f}" for f in ("model", "model_overrides", "steps")}
    FLAT |= {f: f"fineweb_{f}" for f in ("batch_size", "lr", "ckpt_every")}

    model: str = "gpt2-124m"
    model_overrides: dict[str, Any] = field(default_factory=dict)
    steps: int = REFERENCE_TRAINING["steps"]
    batch_size: int = 512  # x 1024 tokens = 524k tokens per step
    lr: dict[str, float] = field(default_factory=lambda: dict(PAPER_LR))
    ckpt_every: int = 250  # a gpt2-124m checkpoint with AdamW state is ~1.5 GB


PARTS = ("language", "network", "training", "tuning", "measurement", "inference")


@dataclass(frozen=True)
class Preset:
    """One reproduction's design: its records, the arms it compares (``arms`` at the first s,
    ``sweep_arms`` at every s) on measurement seeds ``0 .. seeds - 1``, the quadratic model's options, a
    ``curvlab finetune`` preset run on the first seed's AdamW model (or ``None``), and the FineWeb run
    (or ``None``)."""

    name: str
    language: Language = Language()
    network: Network = Network()
    training: Training = Training()
    tuning: Tuning = Tuning()
    measurement: Measurement = Measurement()
    inference: Inference = Inference()
    seeds: int = 5
    arms: tuple[str, ...] = ("adamw", "muon", CONTROL_ARM)
    sweep_arms: tuple[str, ...] = ("adamw", "muon")
    quadratic: dict[str, Any] = field(default_factory=dict)
    finetune: str | None = None
    fineweb: FinewebRun | None = None

    # -- flat names ---------------------------------------------------------------------------

    def flat(self) -> dict[str, Any]:
        """Every field under its flat name, as plain JSON values (the saved form of a job's config)."""
        flat: dict[str, Any] = {"name": self.name}
        for part in PARTS:
            flat |= getattr(self, part).flat()
        flat |= {k: getattr(self, k) for k in ("seeds", "arms", "sweep_arms", "quadratic", "finetune")}
        flat |= {"fineweb": self.fineweb is not None, **(self.fineweb or FinewebRun()).flat()}
        return json.loads(json.dumps(flat, default=asdict))

    def changed(self, **changes: Any) -> Preset:
        """This preset with fields replaced by their flat names (``changed(steps=40, keep="all")``).

        Raises:
            CurvlabError: a name that is no field of a preset.
        """
        records: dict[str, dict[str, Any]] = {part: {} for part in (*PARTS, "fineweb")}
        top = {}
        for key, value in changes.items():
            part = _PART_OF.get(key)
            if part is None and key not in {f.name for f in fields(Preset)} - set(PARTS):
                raise CurvlabError(f"a preset has no field {key!r}")
            (records[part] if part else top)[_FIELD_OF.get(key, key)] = value
        if "fineweb" in top and not isinstance(top["fineweb"], FinewebRun):  # flat, a flag: the run, or none
            top["fineweb"] = (self.fineweb or FinewebRun()) if top["fineweb"] else None
        run, fineweb = top.get("fineweb", self.fineweb), records.pop("fineweb")
        if run is not None:
            top["fineweb"] = replace(run, **fineweb)
        elif replace(FinewebRun(), **fineweb) != FinewebRun():  # (a flat round trip passes the defaults)
            raise CurvlabError(f"{', '.join(_FLAT_OF[k] for k in fineweb)} set a FineWeb run: pass fineweb=True too")
        parts = {p: replace(getattr(self, p), **v) for p, v in records.items() if v}
        return replace(self, **parts, **top)

    # -- derived values -----------------------------------------------------------------------

    @property
    def tuning_settings(self) -> TuningSettings:
        """The tuning rule with its horizon set (the compared one, the training steps, unless it names another)."""
        return self.tuning.rule.at(self.training.steps)

    @property
    def extras(self) -> dict[str, str]:
        """The optional packages this design needs (module -> curvlab extra): a fine-tuning's, if it runs one,
        and the tokenizer of a corpus it makes."""
        text = {"tokenizers": "text"} if self.language.corpus in CORPORA else {}
        return (dict(FINETUNE_EXTRAS) if self.finetune else {}) | text

    @property
    def aa_batches(self) -> int:
        """The A/A comparisons' evaluation batches per checkpoint."""
        extra = self.inference.aa_analysis_batches
        return self.measurement.analysis_batches if extra is None else extra

    def aa_seed_pairs(self) -> list[tuple[int, int]]:
        """The A/A comparisons' seed pairs, each (earlier, later), in the order they are run."""
        if not self.inference.calibration:
            return []
        step = 1 if self.inference.aa_pairs == "neighbouring" else 2
        return [(k - 1, k) for k in range(1, self.seeds, step)]

    def arms_at(self, s: float) -> tuple[str, ...]:
        """The arms trained at ``s``: all at the first s, the sweep's at the others."""
        return self.arms if s == self.language.s_values[0] else self.sweep_arms

    def tuning_fingerprint(self) -> dict[str, Any]:
        """What a tuned learning rate depends on: a table entry made under other values is not used."""
        flat = self.flat()
        fingerprint = {k: flat[k] for k in TUNING_DEPENDS_ON}
        fingerprint |= {"horizon_steps": self.tuning_settings.horizon_steps, "s": self.language.s_values[0]}
        if self.language.grammar_seed:  # only another draw's: the committed entries predate the field
            fingerprint["grammar_seed"] = self.language.grammar_seed
        if self.language.corpus is not None:  # (text: no table entry of the grammar's applies)
            fingerprint |= {k: getattr(self.language, k) for k in ("corpus", "corpus_vocab", "corpus_val_fraction")}
        return fingerprint

    def validate(self) -> None:
        """Raises ``CurvlabError`` for a design that can't run as it says (each message names the field)."""
        t, m, tr = self.tuning, self.measurement, self.training
        _one_of("lr_source", t.lr_source, Tuning.SOURCES)
        _one_of("adam_side", t.adam_side, Tuning.ADAM_SIDES)
        _one_of("aa_pairs", self.inference.aa_pairs, Inference.PAIRS)
        _one_of("keep", m.keep, Measurement.KEEP)
        _one_of("track_points", m.track_points, Measurement.TRACK_POINTS)
        if self.seeds < 1:
            raise CurvlabError("a preset needs seeds >= 1")
        self.tuning_settings.validate(self.seeds)
        if set(t.check_seed_list()) & set(range(self.seeds)):
            raise CurvlabError(
                f"check seeds {t.check_seed_list()} overlap the measurement seeds 0..{self.seeds - 1}: "
                "raise check_seed_base"
            )
        if m.analysis_batches < 1 or self.aa_batches < 1:
            raise CurvlabError(
                f"analysis_batches {m.analysis_batches} and aa_analysis_batches {self.aa_batches} must be >= 1"
            )
        if m.stability_iterations < 1:
            raise CurvlabError(f"stability_iterations must be >= 1, got {m.stability_iterations}")
        if m.stability_interval < 1 or m.stability_interval % m.track_interval:
            raise CurvlabError(
                f"stability_interval {m.stability_interval} must be a positive multiple of track_interval "
                f"{m.track_interval}"
            )
        if self.language.corpus is not None and len(self.language.s_values) != 1:
            raise CurvlabError(
                f"a corpus has no Zipf exponent: s_values must be one value, got {self.language.s_values}"
            )
        if sorted(set(self.arms) - set(ARMS)) or "adamw" not in self.arms or "muon" not in self.arms:
            raise CurvlabError(f"arms must include adamw and muon, from {', '.join(ARMS)}; got {self.arms}")
        if not set(self.sweep_arms) <= set(self.arms):
            raise CurvlabError(f"sweep_arms {self.sweep_arms} must be among arms {self.arms}")
        for name, every in (("ckpt_every", tr.ckpt_every), ("sweep_ckpt_every", tr.sweep_ckpt_every)):
            if m.track_interval % every:
                raise CurvlabError(f"track_interval {m.track_interval} is not a multiple of {name} {every}")
        judged_claims(self.inference.primary)


_RECORDS = {part: type(getattr(Preset(""), part)) for part in PARTS} | {"fineweb": FinewebRun}
_PART_OF = {flat: part for part, record in _RECORDS.items() for flat in record().flat()}
_FIELD_OF = {flat: name for record in _RECORDS.values() for name, flat in record.FLAT.items()}
_FLAT_OF = {name: flat for flat, name in _FIELD_OF.items() if flat.startswith("fineweb_")}


def train_config(preset: Preset, data: str, out: str, arm: str, seed: int, **changes: Any) -> TrainConfig:
    """The :class:`~curvlab.runs.config.TrainConfig` of one of ``preset``'s runs: ``arm`` (an :data:`ARMS`
    name) on ``data`` into ``out`` at ``seed``, checkpointed and evaluated every ``ckpt_every`` steps.

    Args:
        preset: the design whose network and training records the run takes.
        data: the run's data directory.
        out: the run's directory.
        arm: the compared optimizer; its options come first, ``changes["optimizer_options"]`` on top.
        seed: the run's seed.
        **changes: ``TrainConfig`` fields that differ from the design's (a tuning run's steps, a
            FineWeb run's model, the shadow and twins).

    Returns:
        The run's validated-on-construction config.
    """
    net, tr = preset.network, preset.training
    options = {**ARMS[arm].options, **changes.pop("optimizer_options", {})}
    base = asdict(net) | {k: getattr(tr, k) for k in ("batch_size", "steps", "warmup_steps", "schedule", "device")}
    base |= {"cooldown_frac": tr.cooldown_frac, "eval_every": tr.ckpt_every, "ckpt_every": tr.ckpt_every}
    base |= {"val_windows": preset.language.val_windows, "optimizer": ARMS[arm].optimizer}
    return TrainConfig(data=str(data), out=str(out), seed=seed, optimizer_options=options, **(base | changes))


# -- a design of settings -------------------------------------------------------------------------


def _check_fresh_seeds(design: str, part: str, base: Preset, seeds: int, seed_list: list[int]) -> None:
    """A design of settings or sizes: a valid base, 3 seeds or more per ``part``, none that the base measures,
    tunes or checks with."""
    base.validate()
    if seeds < 3:
        raise CurvlabError(f"a {design} design needs seeds >= 3 per {part}, got {seeds}")
    taken = set(range(base.seeds)) | set(base.tuning_settings.seeds()) | set(base.tuning.check_seed_list())
    if overlap := sorted(taken & set(seed_list)):
        raise CurvlabError(f"{design} seeds {overlap} are measured, tuned or checked by the base: raise seed_base")


@dataclass(frozen=True)
class RobustnessSetting:
    """One setting a reviewer would change, as what it changes in the base design: an arm's lr as a factor
    of the committed table's, the training s, the grammar's draw (``make_grammar``'s seed) or the width
    (``n_embd``, at the same depth and heads). Both arms' learning rates otherwise stay the table's: a
    changed grammar, s or width is not re-tuned, for either arm alike."""

    name: str
    label: str
    lr_factors: dict[str, float] = field(default_factory=dict)  # {"adamw": 0.25}: the others' stay x1
    s: float | None = None
    grammar_seed: int | None = None
    width_factor: int = 1

    def preset(self, base: Preset) -> Preset:
        """``base`` changed as this setting says (no A/A: the settings compare the paired ratio only)."""
        model = dict(base.network.model_overrides)
        if self.width_factor != 1:
            model["n_embd"] = get_config(base.network.model, **model).n_embd * self.width_factor
        language = base.language
        return base.changed(
            name=f"{base.name}-{self.name}",
            model_overrides=model,
            grammar_seed=language.grammar_seed if self.grammar_seed is None else self.grammar_seed,
            s_values=language.s_values if self.s is None else (self.s,),
            calibration=False,
        )


class _OnFreshSeeds:
    """What a design of variations of a ``base`` preset (robustness, scaling) shares: its ``seeds`` measurement
    seeds from ``seed_base``, and its base's optional packages."""

    def seed_list(self) -> list[int]:
        return [self.seed_base + i for i in range(self.seeds)]

    @property
    def extras(self) -> dict[str, str]:
        """The optional packages this design needs (module -> curvlab extra): its base's."""
        return self.base.extras


@dataclass(frozen=True)
class RobustnessPreset(_OnFreshSeeds):
    """A design of settings: the paired direction ratio, with its controls, at each of ``settings``, each a
    :class:`Preset` made from ``base`` and run on measurement seeds ``seed_base`` .. (disjoint from the
    base's measured seeds, its tuning seeds and its table check's). The learning rates are the committed
    table's entry for ``lr_table`` (``None``: the base's tuning centres), times each setting's factors."""

    name: str
    base: Preset
    settings: tuple[RobustnessSetting, ...]
    lr_table: str | None = "quick"
    seeds: int = 3
    seed_base: int = 100

    def validate(self) -> None:
        """Raises ``CurvlabError`` for too few seeds, settings without distinct names, seeds the base uses,
        or a setting that makes an invalid preset."""
        base = self.base
        _check_fresh_seeds("robustness", "setting", base, self.seeds, self.seed_list())
        names = [x.name for x in self.settings]
        if not names or len(set(names)) != len(names):
            raise CurvlabError(f"a robustness design needs settings with distinct names, got {names}")
        for x in self.settings:
            if unknown := sorted(set(x.lr_factors) - {"adamw", "muon"}):
                raise CurvlabError(f"setting {x.name}: lr factors for adamw and muon only, got {unknown}")
            x.preset(base).validate()


@dataclass(frozen=True)
class ScalingRung:
    """One model size of a ladder: the base's network at width ``n_embd`` (``n_head`` heads), at the base's
    depth unless ``n_layer`` says, or another named config (``model``: ``"pcfg-9m"``, the paper's Zipf model,
    with the base's vocabulary)."""

    name: str
    n_embd: int
    n_head: int = 4
    n_layer: int | None = None
    model: str | None = None

    def preset(self, base: Preset) -> Preset:
        """``base`` at this size (no A/A: a rung estimates the ratios, the fits across rungs are judged)."""
        block = get_config(base.network.model, **base.network.model_overrides).block_size  # the same tokens a run
        model = {**base.network.model_overrides, "n_embd": self.n_embd, "n_head": self.n_head, "block_size": block}
        if self.n_layer is not None:
            model["n_layer"] = self.n_layer
        return base.changed(
            name=f"{base.name}-{self.name}",
            model=self.model or base.network.model,
            model_overrides=model,
            calibration=False,
        )


@dataclass(frozen=True)
class ScalingPreset(_OnFreshSeeds):
    """A ladder of model sizes (:class:`ScalingRung`) on ``base``'s language and schedule, each measured on
    ``seeds`` fresh seeds from ``seed_base`` at learning rates transferred from the committed table's entry
    ``lr_table`` (tuned at width ``base_width``; ``None``: the base's tuning centres) by
    :func:`curvlab.studies.scaling.transferred_lrs`, the rule checked at each rung on the base's check seeds."""

    name: str
    base: Preset
    rungs: tuple[ScalingRung, ...]
    lr_table: str | None = "standard"
    base_width: int = 80
    seeds: int = 3
    seed_base: int = 100

    def validate(self) -> None:
        """Raises ``CurvlabError`` for too few seeds or rungs, rungs without distinct names or sizes, seeds the
        base uses, a ``base_width`` that is not the base's width (with a table entry), or a rung that makes an
        invalid preset."""
        base = self.base
        _check_fresh_seeds("scaling", "rung", base, self.seeds, self.seed_list())
        names = [x.name for x in self.rungs]
        if len(names) < 3 or len(set(names)) != len(names):
            raise CurvlabError(f"a scaling design needs 3 rungs or more with distinct names, got {names}")
        sizes = [(x.model, x.n_embd, x.n_head, x.n_layer) for x in self.rungs]
        if len(set(sizes)) != len(sizes):
            raise CurvlabError(f"a scaling design needs rungs of distinct sizes, got {sizes}")
        width = get_config(base.network.model, **base.network.model_overrides).n_embd
        if self.lr_table is not None and width != self.base_width:
            raise CurvlabError(
                f"base_width {self.base_width} is not the base model's width {width}, where its lrs were tuned"
            )
        for x in self.rungs:
            preset = x.preset(base)
            preset.validate()
            config = get_config(preset.network.model, **preset.network.model_overrides)
            if config.n_embd % config.n_head:
                raise CurvlabError(f"rung {x.name}: n_embd {config.n_embd} is not a multiple of n_head {config.n_head}")


# -- curvlab finetune ------------------------------------------------------------------------------


@dataclass(frozen=True)
class FinetunePreset:
    """Every setting of a fine-tuning comparison (``curvlab finetune --preset``): pretraining at s = 0
    (``pretrain_steps`` of AdamW at ``pretrain_lr``, the main comparison's tuned centre), then LoRA of
    ``rank`` adapting to s = 1 under every adapter optimizer, each lr tuned alike (``tuning``), compared
    at matched loss (``matching``) with the curvature on a held-out batch (the validation split's first
    ``heldout_windows`` windows)."""

    name: str
    model: str = "tiny"
    model_overrides: dict[str, Any] = field(default_factory=dict)
    grammar: dict[str, Any] = field(default_factory=dict)
    tokens: str = "1M"
    val_tokens: str = "50k"
    pretrain_steps: int = 300
    pretrain_lr: float = 0.004
    rank: int = 8
    steps: int = 120
    batch_size: int = 16
    warmup_steps: int = 10
    cooldown_frac: float = 0.2
    seeds: int = 3
    tuning: TuningSettings = FINETUNE_TUNING
    ckpt_every: int = 4
    val_windows: int = 32
    heldout_windows: int = 8
    matching: MatchCriteria = STABLE_MATCHING
    device: str = "cpu"

    @property
    def tuning_settings(self) -> TuningSettings:
        """:attr:`tuning` with its horizon set (the compared one, ``steps``, unless it names another)."""
        return self.tuning.at(self.steps)

    @property
    def extras(self) -> dict[str, str]:
        """The optional packages a fine-tuning needs (module -> curvlab extra)."""
        return dict(FINETUNE_EXTRAS)

    def validate(self) -> None:
        """Raises ``CurvlabError`` for no seeds, a missing lr centre, a rank below 1 or too large a held-out batch."""
        if self.seeds < 1:
            raise CurvlabError("a fine-tuning preset needs seeds >= 1")
        self.tuning_settings.validate(self.seeds)
        missing = sorted(set(ADAPTER_ARMS) - set(self.tuning.lr_centers))
        if missing:
            raise CurvlabError(f"lr_centers lacks {', '.join(missing)}")
        if self.rank < 1:
            raise CurvlabError(f"the LoRA rank must be >= 1, got {self.rank}")
        if self.heldout_windows > self.val_windows:
            raise CurvlabError(f"heldout_windows {self.heldout_windows} exceeds val_windows {self.val_windows}")
