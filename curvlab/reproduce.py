"""The main job: reproduce the paper's curvature analysis end to end, from data to report.

Stages, each skipped when its output already exists with the same settings (so an interrupted run,
started again, continues from what is done):

1. data: Zipf-PCFG at each s (training at s, validation at s = 0);
2. tuning: at s = 0, each optimizer trains once per learning rate of its grid; the best final
   validation loss wins, and the grid and the choice are recorded (``tuning.json``);
3. training: each optimizer at its chosen learning rate on the other values of s;
4. analysis: Muon vs AdamW at matched validation loss on s = 0 (``compare``), and every run along its
   trajectory (``track``), from which the trajectory-averaged NDS per s (``zipf.json``);
5. the quadratic model; 6. figures; 7. ``report.md`` with our numbers beside the paper's.

Presets: ``micro`` (the test suite's, well under a minute), ``quick`` (the CPU default, under ten
minutes on two cores) and ``paper`` (a GPU: ``pcfg-9m`` on the s sweep, and ``gpt2-124m`` on FineWeb
shards the user provides).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from curvlab.analysis import AnalysisSettings
from curvlab.atomic import atomic_write_text
from curvlab.checkpoint import read_index
from curvlab.data.dataset import generate_pcfg_dataset
from curvlab.errors import CurvlabError
from curvlab.studies import compare_runs, pair_reports, track_run, within_layer_gap
from curvlab.train import TrainConfig, train

OPTIMIZERS = ("muon", "adamw")
# SCIENCE.md section 4: the paper's 124M FineWeb numbers, and its Zipf-PCFG sweep.
PAPER = {
    "nds_ratio": 1.76,
    "normalized_nds": {"muon": {0.0: 1.00, 1.0: 1.25}, "adamw": {0.0: 1.63, 1.0: 2.38}},
    "gap": {0.0: 0.63, 1.0: 1.13},
    "rho_within": {"muon": (0.14, 0.44), "adamw": (0.27, 0.34)},
}


@dataclass(frozen=True)
class Preset:
    name: str
    model: str = "tiny"
    model_overrides: dict[str, Any] = field(default_factory=dict)
    s_values: tuple[float, ...] = (0.0, 0.5, 1.0)
    grammar: dict[str, Any] = field(default_factory=dict)  # make_grammar options (e.g. a smaller vocabulary)
    tokens: str = "2M"
    val_tokens: str = "100k"
    steps: int = 200
    batch_size: int = 16
    warmup_steps: int = 10
    ckpt_every: int = 20
    val_windows: int = 32
    lr_grid: dict[str, tuple[float, ...]] = field(
        default_factory=lambda: {"muon": (0.02, 0.04), "adamw": (0.002, 0.004)}
    )
    compare_levels: int = 6
    tolerance: float = 0.03
    analysis_batches: int = 2  # G, H and ΔD on the step's batch and the next (a loss spike in one small
    # batch can dominate the curvature; the step Z is always the real one)
    track_every: int = 2
    quadratic: dict[str, Any] = field(default_factory=dict)
    fineweb: bool = False  # the paper preset also trains gpt2-124m on FineWeb shards
    fineweb_model: str = "gpt2-124m"
    fineweb_model_overrides: dict[str, Any] = field(default_factory=dict)
    fineweb_steps: int = 5100  # SCIENCE.md section 4: the modded-nanogpt comparison
    fineweb_batch_size: int = 512  # x 1024 tokens = 524k tokens per step
    fineweb_lr: dict[str, float] = field(default_factory=lambda: {"muon": 0.02, "adamw": 0.0018})
    device: str = "auto"


PRESETS = {
    "micro": Preset(
        "micro",
        model_overrides={"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32, "vocab_size": 320},
        grammar={"n_tokens": 300},
        tokens="100k",
        val_tokens="10k",
        steps=24,
        batch_size=8,
        warmup_steps=2,
        ckpt_every=4,
        val_windows=8,
        lr_grid={"muon": (0.02,), "adamw": (0.003, 0.006)},
        compare_levels=3,
        tolerance=0.05,
        analysis_batches=1,
        track_every=2,
        quadratic={
            "steps": 8,
            "fixed_lr_steps": 10,
            "sweep_steps": 8,
            "rhos": (2.0, 20.0, 200.0),
            "alphas": (0.1, 0.3),
            "ratios": (1.0, 2.0),
        },
        device="cpu",
    ),
    # A 1024-token version of the grammar: with the paper's 4412 tokens, 70% of `tiny` is embedding and
    # head, and two CPUs for a few minutes don't get it past unigram statistics, where NDS is tiny and
    # changes sign. The paper preset keeps 4412 tokens.
    "quick": Preset(
        "quick",
        model_overrides={"vocab_size": 1088},
        grammar={"n_tokens": 1024},
        steps=300,
        ckpt_every=20,
        compare_levels=6,
        track_every=3,
        device="cpu",
    ),
    "paper": Preset(
        "paper",
        model="pcfg-9m",
        tokens="200M",
        val_tokens="5M",
        steps=5000,
        batch_size=64,
        warmup_steps=100,
        ckpt_every=250,
        val_windows=256,
        lr_grid={"muon": (0.01, 0.02, 0.04), "adamw": (0.0009, 0.0018, 0.0036)},
        compare_levels=10,
        tolerance=0.01,
        track_every=1,
        fineweb=True,
    ),
}


def _s_name(s: float) -> str:
    return f"s{s:g}"


class Reproduction:
    """One reproduction in one output directory (see the module docstring)."""

    def __init__(self, preset: Preset, out: str | Path, fineweb: str | Path | None = None, progress: bool = True):
        self.preset, self.out, self.progress = preset, Path(out), progress
        self.fineweb = Path(fineweb) if fineweb else None
        if preset.fineweb:
            if self.fineweb is None:
                raise CurvlabError("the paper preset trains gpt2-124m on FineWeb: pass --fineweb DIR with its shards")
            from curvlab.data.shards import find_shards

            for split in ("train", "val"):  # fail now, not after hours of training
                find_shards(self.fineweb, split)
        self.log: list[str] = []

    # -- bookkeeping ------------------------------------------------------------------------

    def _check_config(self) -> None:
        path = self.out / "reproduce.json"
        config = {"preset": asdict(self.preset), "fineweb": str(self.fineweb) if self.fineweb else None}
        config = json.loads(json.dumps(config))
        if path.is_file():
            saved = json.loads(path.read_text())
            if saved != config:
                raise CurvlabError(
                    f"{self.out} holds the results of another configuration (preset "
                    f"{saved['preset']['name']!r}); refusing to mix them: choose a fresh --out"
                )
        else:
            self.out.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps(config, indent=1))

    def _say(self, message: str) -> None:
        self.log.append(message)
        if self.progress:
            print(f"[reproduce] {message}", flush=True)

    def _train_config(self, data: Path, out: Path, optimizer: str, lr: float, **overrides) -> TrainConfig:
        p = self.preset
        options = {"lr": lr} if optimizer == "adamw" else {"lr": lr, "adam_lr": 0.0036}
        fields = dict(
            data=str(data), out=str(out), model=p.model, model_overrides=dict(p.model_overrides),
            optimizer=optimizer, optimizer_options=options, batch_size=p.batch_size, steps=p.steps,
            warmup_steps=p.warmup_steps, eval_every=p.ckpt_every, ckpt_every=p.ckpt_every,
            val_windows=p.val_windows, device=p.device,
        )  # fmt: skip
        fields.update(overrides)
        return TrainConfig(**fields)

    # -- stages -----------------------------------------------------------------------------

    def data(self) -> dict[float, Path]:
        p = self.preset
        dirs = {}
        for s in p.s_values:
            d = self.out / "data" / _s_name(s)
            generate_pcfg_dataset(
                d, s=s, tokens=p.tokens, val_tokens=p.val_tokens, val_s=0.0, grammar_options=p.grammar,
                progress=self.progress,
            )  # fmt: skip
            dirs[s] = d
        self._say(f"data ready: s = {', '.join(f'{s:g}' for s in p.s_values)}")
        return dirs

    def tune(self, data: Path) -> dict[str, Any]:
        """The learning-rate grid at s = 0 (the first s); the winning runs are kept as that s's runs."""
        path = self.out / "tuning.json"
        grid = {k: list(v) for k, v in self.preset.lr_grid.items()}
        if path.is_file() and json.loads(path.read_text())["grid"] == grid:
            return json.loads(path.read_text())
        s0 = self.preset.s_values[0]
        results: dict[str, dict[str, float]] = {}
        for optimizer in OPTIMIZERS:
            results[optimizer] = {}
            for lr in grid[optimizer]:
                run = self.out / "runs" / f"tune-{optimizer}-lr{lr:g}"
                result = train(self._train_config(data, run, optimizer, lr), progress=self.progress)
                results[optimizer][f"{lr:g}"] = result.val_loss
                self._say(f"tuning {optimizer} lr {lr:g}: final validation loss {result.val_loss:.4f}")
        chosen = {opt: float(min(res, key=res.get)) for opt, res in results.items()}
        for optimizer, lr in chosen.items():  # keep the winners as the s0 runs, drop the others' checkpoints
            target = self.out / "runs" / _s_name(s0) / optimizer
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copytree(self.out / "runs" / f"tune-{optimizer}-lr{lr:g}", target)
                _retarget(target)
        for optimizer in OPTIMIZERS:
            for lr in grid[optimizer]:
                for ckpt in (self.out / "runs" / f"tune-{optimizer}-lr{lr:g}").glob("ckpt_*.pt"):
                    ckpt.unlink()
        tuning = {"grid": grid, "final_val_loss": results, "chosen": chosen, "tuned_on_s": s0}
        atomic_write_text(path, json.dumps(tuning, indent=1))
        return tuning

    def train_all(self, data: dict[float, Path], chosen: dict[str, float]) -> dict[float, dict[str, Path]]:
        runs: dict[float, dict[str, Path]] = {}
        for s, d in data.items():
            runs[s] = {}
            for optimizer in OPTIMIZERS:
                run = self.out / "runs" / _s_name(s) / optimizer
                train(self._train_config(d, run, optimizer, chosen[optimizer]), progress=self.progress)
                runs[s][optimizer] = run
            self._say(f"trained Muon and AdamW at s = {s:g}")
        return runs

    def analyse(self, runs: dict[float, dict[str, Path]]) -> dict[str, Any]:
        p = self.preset
        settings = AnalysisSettings(blocks="layer", batch="train", batches=p.analysis_batches)
        s0 = p.s_values[0]
        analysis = self.out / "analysis"
        compare = compare_runs(
            runs[s0]["muon"], runs[s0]["adamw"], analysis / "compare", p.compare_levels, p.tolerance, settings,
            progress=self.progress,
        )  # fmt: skip
        self._say(
            f"compared at {len(compare.rows)} matched levels (mean AdamW/Muon NDS {compare.mean_ratios['nds']:.3f})"
        )
        tracks = {}
        for s, pair in runs.items():
            for optimizer, run in pair.items():
                tracks[(s, optimizer)] = track_run(
                    run, analysis / f"track-{_s_name(s)}-{optimizer}", p.track_every, settings, progress=self.progress
                )
        self._say(f"tracked {len(tracks)} runs")
        valid = {key: [r for r in rows if r["taylor_ok"]] for key, rows in tracks.items()}
        excluded = sum(len(rows) - len(valid[key]) for key, rows in tracks.items())
        base = float(np.mean([r["nds"] for r in valid[(s0, "muon")]]))
        mean_nds = {o: [float(np.mean([r["nds"] for r in valid[(s, o)]])) for s in p.s_values] for o in OPTIMIZERS}
        zipf = {"s": list(p.s_values), "mean_nds": mean_nds, "excluded_checkpoints": excluded}
        zipf["normalized"] = {o: [x / base for x in zipf["mean_nds"][o]] for o in OPTIMIZERS}
        zipf["gap"] = [a - m for a, m in zip(zipf["normalized"]["adamw"], zipf["normalized"]["muon"])]
        atomic_write_text(analysis / "zipf.json", json.dumps(zipf, indent=1))
        return {"compare": compare.to_dict(), "tracks": tracks, "zipf": zipf}

    def fineweb_comparison(self) -> dict[str, Any] | None:
        """Muon vs AdamW at the paper's learning rates on the user's FineWeb shards, compared at
        matched validation loss (the paper's figures 1 and 2 on its own data)."""
        if self.fineweb is None:
            return None
        p = self.preset
        runs = {}
        for optimizer in OPTIMIZERS:
            run = self.out / "runs" / "fineweb" / optimizer
            cfg = self._train_config(self.fineweb, run, optimizer, p.fineweb_lr[optimizer])
            cfg = replace(
                cfg, model=p.fineweb_model, model_overrides=dict(p.fineweb_model_overrides), steps=p.fineweb_steps,
                batch_size=p.fineweb_batch_size, optimizer_options={"lr": p.fineweb_lr[optimizer]},
            )  # fmt: skip
            train(cfg, progress=self.progress)
            runs[optimizer] = run
        settings = AnalysisSettings(blocks="layer", batch="train", batches=p.analysis_batches)
        compare = compare_runs(
            runs["muon"], runs["adamw"], self.out / "analysis" / "compare-fineweb", p.compare_levels, p.tolerance,
            settings, progress=self.progress,
        )  # fmt: skip
        self._say(f"FineWeb: compared at {len(compare.rows)} matched levels")
        return compare.to_dict()

    def quadratic(self) -> dict[str, Any]:
        from curvlab.quadratic import quadratic_study

        path = self.out / "quadratic" / "quadratic.json"
        if path.is_file():
            return json.loads(path.read_text())
        result = quadratic_study(**self.preset.quadratic)
        atomic_write_text(path, json.dumps(result))
        self._say("quadratic model done")
        return result

    def figures(self, results: dict[str, Any], quadratic: dict[str, Any]) -> dict[str, list[str]]:
        from curvlab import plots

        fig = self.out / "figures"
        compare = results["compare"]
        s0 = self.preset.s_values[0]
        written = {
            "taylor_split": plots.taylor_split_vs_loss(compare, fig / "fig1_taylor_split"),
            "nds_norm": plots.nds_and_norm_vs_loss(compare, fig / "fig2_nds_update_norm"),
            "zipf": plots.zipf_nds(results["zipf"], fig / "fig3_zipf_nds"),
            "layers": plots.layer_split_over_training(
                {o: results["tracks"][(s0, o)] for o in OPTIMIZERS}, fig / "fig4_within_cross"
            ),
            "quadratic": plots.quadratic_trajectories(quadratic, fig / "fig7_quadratic_trajectories")
            + plots.quadratic_phase(quadratic, fig / "fig7_quadratic_phase"),
        }
        middle = compare["pairs"][len(compare["pairs"]) // 2]
        written["heatmap"] = plots.block_heatmaps(pair_reports(middle), fig / "block_matrix_heatmap")
        names, gap = within_layer_gap(compare)
        written["within_gap"] = plots.within_gap_by_layer(names, gap, fig / "within_gap_by_layer")
        return {k: [str(p.relative_to(self.out)) for p in v] for k, v in written.items()}

    # -- the whole job ----------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        start = time.perf_counter()
        self._check_config()
        data = self.data()
        tuning = self.tune(data[self.preset.s_values[0]])
        runs = self.train_all(data, tuning["chosen"])
        results = self.analyse(runs)
        fineweb = self.fineweb_comparison()
        quadratic = self.quadratic()
        figures = self.figures(results, quadratic)
        summary = summarize(results, tuning, runs, quadratic)
        if fineweb is not None:
            from curvlab import plots

            fig = self.out / "figures"
            paths = plots.taylor_split_vs_loss(fineweb, fig / "fineweb_taylor_split")
            paths += plots.nds_and_norm_vs_loss(fineweb, fig / "fineweb_nds_update_norm")
            figures["fineweb"] = [str(p.relative_to(self.out)) for p in paths]
            summary["fineweb"] = {k: fineweb[k] for k in ("ratio_of_means", "median_ratios", "mean_ratios")}
        summary["figures"] = figures
        seconds = time.perf_counter() - start
        timing_path = self.out / "timing.json"
        runs_so_far = json.loads(timing_path.read_text()) if timing_path.is_file() else []
        runs_so_far.append(seconds)
        atomic_write_text(timing_path, json.dumps(runs_so_far))
        summary["seconds"] = sum(runs_so_far)  # over every invocation, when a run was interrupted and resumed
        summary["invocations"] = len(runs_so_far)
        summary["preset"] = self.preset.name
        atomic_write_text(self.out / "summary.json", json.dumps(summary, indent=1))
        atomic_write_text(self.out / "report.md", render_report(summary))
        self._say(f"done in {summary['seconds']:.0f} s: {self.out / 'report.md'}")
        return summary


def _retarget(run: Path) -> None:
    """A copied run directory's config names its new place (so resuming it there works)."""
    config = json.loads((run / "config.json").read_text())
    config["out"] = str(run)
    atomic_write_text(run / "config.json", json.dumps(config, indent=1))


def _thirds(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """rho_within over the first and the last third of a trajectory, as sum(within) / sum(NDS) over the
    checkpoints where the Taylor expansion holds: a ratio of sums, because a single checkpoint's NDS
    can sit near zero early in training."""
    rows = [r for r in rows if r["taylor_ok"]]
    k = max(1, len(rows) // 3)

    def rho(part):
        return sum(r["within"] for r in part) / sum(r["nds"] for r in part)

    return rho(rows[:k]), rho(rows[-k:])


def summarize(results: dict[str, Any], tuning: dict[str, Any], runs, quadratic: dict[str, Any]) -> dict[str, Any]:
    """The numbers the report puts beside the paper's (all read from the saved results)."""
    compare, zipf, tracks = results["compare"], results["zipf"], results["tracks"]
    s0 = zipf["s"][0]
    rho = {o: _thirds(tracks[(s0, o)]) for o in OPTIMIZERS}
    final_val = {f"{s:g}": {o: read_index(r)[-1]["val_loss"] for o, r in pair.items()} for s, pair in runs.items()}
    closed = quadratic["example"]["closed_forms"]
    return {
        "mean_ratios": compare["mean_ratios"],
        "median_ratios": compare["median_ratios"],
        "ratio_of_means": compare["ratio_of_means"],
        "matched_levels": len(compare["pairs"]),
        "levels_in_ratios": sum(1 for row in compare["pairs"] if row["taylor_ok_a"] and row["taylor_ok_b"]),
        "refused_levels": len(compare["refused"]),
        "zipf": zipf,
        "rho_within": {o: {"early": v[0], "late": v[1]} for o, v in rho.items()},
        "tuning": tuning,
        "final_val_loss": final_val,
        "quadratic": {k: closed[k] for k in ("muon_nds", "muon_contraction", "gd_two_step_contraction")},
    }


def _fineweb_lines(summary: dict[str, Any]) -> list[str]:
    if "fineweb" not in summary:
        return []
    rom = summary["fineweb"]["ratio_of_means"]
    return [
        "## FineWeb (the paper's own setting)",
        "",
        f"AdamW/Muon at matched validation loss (ratio of means): NDS {rom['nds']:.2f} (paper 1.76), "
        f"first-order gain {rom['first_order']:.2f}, curvature penalty {rom['curvature_penalty']:.2f}, "
        f"update norm {rom['update_norm']:.2f}.",
        "",
    ]


def _arrow(a: float, b: float, fmt: str = ".2f") -> str:
    return f"{a:{fmt}} → {b:{fmt}}"


def render_report(summary: dict[str, Any]) -> str:
    """``report.md``: figures and a table of our numbers beside the paper's."""
    z, r, rho, q = summary["zipf"], summary["mean_ratios"], summary["rho_within"], summary["quadratic"]
    med, rom = summary["median_ratios"], summary["ratio_of_means"]
    first, last = z["s"][0], z["s"][-1]
    paper = PAPER["normalized_nds"]
    rows = [
        *(
            (
                f"AdamW/Muon {label} at matched loss: ratio of means (median, mean of per-level ratios)",
                f"{rom[k]:.2f} ({med[k]:.2f}, {r[k]:.2f})",
                paper_value,
            )
            for k, label, paper_value in [
                ("nds", "NDS", "1.76"),
                ("first_order", "first-order gain", "≈ 1"),
                ("curvature_penalty", "curvature penalty", "> 1"),
                ("update_norm", "update-norm", "≈ 1"),
            ]
        ),
        (
            f"normalized NDS, Muon, s = {first:g} → {last:g}",
            _arrow(z["normalized"]["muon"][0], z["normalized"]["muon"][-1]),
            _arrow(paper["muon"][0.0], paper["muon"][1.0]),
        ),
        (
            f"normalized NDS, AdamW, s = {first:g} → {last:g}",
            _arrow(z["normalized"]["adamw"][0], z["normalized"]["adamw"][-1]),
            _arrow(paper["adamw"][0.0], paper["adamw"][1.0]),
        ),
        (f"gap AdamW − Muon, s = {first:g} → {last:g}", _arrow(z["gap"][0], z["gap"][-1]), "0.63 → 1.13"),
        (
            "rho_within Muon, first → last third of training",
            _arrow(rho["muon"]["early"], rho["muon"]["late"], ".0%"),
            "14% → 44%",
        ),
        (
            "rho_within AdamW, first → last third of training",
            _arrow(rho["adamw"]["early"], rho["adamw"]["late"], ".0%"),
            "27% → 34%",
        ),
        (
            "quadratic model: Muon NDS, Γ², GD two-step ratio",
            f"{q['muon_nds']:.3g}, {q['muon_contraction']:.6f}, {q['gd_two_step_contraction']:.6f}",
            "10.0, 0.669421, 0.922913",
        ),
    ]
    lines = [
        f"# curvlab reproduction ({summary['preset']} preset)",
        "",
        f"Finished in {summary['seconds']:.0f} s ({summary['invocations']} invocation(s) of `curvlab reproduce`). "
        "Tiny models on a synthetic language are not the paper's "
        "124M model on FineWeb: the table says where the qualitative picture holds here and where it doesn't.",
        "",
        f"Aggregates leave out the steps where the second-order expansion fails (predicted and realized "
        f"decrease more than 50% apart, e.g. the batch of a loss spike): {summary['levels_in_ratios']} of "
        f"{summary['matched_levels']} matched levels enter the ratios, and {summary['zipf']['excluded_checkpoints']} "
        "trajectory checkpoints are left out of the trajectory averages.",
        "",
        "## Numbers beside the paper's",
        "",
        "| quantity | curvlab | paper |",
        "|---|---:|---:|",
        *(f"| {a} | {b} | {c} |" for a, b, c in rows),
        "",
        *_fineweb_lines(summary),
        "## Learning rates",
        "",
        f"Tuned at s = {summary['tuning']['tuned_on_s']:g}; the best final validation loss wins.",
        "",
        "| optimizer | grid (final validation loss) | chosen |",
        "|---|---|---:|",
    ]
    for o in OPTIMIZERS:
        grid = ", ".join(f"{lr}: {v:.4f}" for lr, v in summary["tuning"]["final_val_loss"][o].items())
        lines.append(f"| {o} | {grid} | {summary['tuning']['chosen'][o]:g} |")
    lines += ["", "Final validation loss per run (validation at s = 0):", ""]
    for s, vals in summary["final_val_loss"].items():
        lines.append(f"- s = {s}: " + ", ".join(f"{o} {v:.4f}" for o, v in vals.items()))
    lines += ["", "## Figures", ""]
    for name, paths in summary["figures"].items():
        lines += [f"![{name}]({p})" for p in paths if p.endswith(".png")]
    return "\n".join(lines) + "\n"
