import re
from pathlib import Path

from typer.testing import CliRunner

from curvlab.cli import app

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]


def test_pcfg_generate_and_stats(tmp_path):
    out = tmp_path / "s1"
    r = runner.invoke(app, ["pcfg", "generate", "--out", str(out), "--tokens", "50k", "--val-tokens", "10k"])
    assert r.exit_code == 0, r.output
    assert (out / "grammar.json").is_file() and (out / "train_000000.bin").is_file()
    r = runner.invoke(app, ["pcfg", "stats", str(out)])
    assert r.exit_code == 0 and "train" in r.output and "50000" in r.output


def test_bad_input_gives_one_line_and_nonzero_exit(tmp_path):
    r = runner.invoke(app, ["pcfg", "stats", str(tmp_path / "missing")])
    assert r.exit_code == 2
    assert r.output.strip().startswith("error:") and len(r.output.strip().splitlines()) == 1
    r = runner.invoke(app, ["pcfg", "generate", "--out", str(tmp_path / "neg"), "--s", "-1", "--tokens", "1k"])
    assert r.exit_code == 2 and "Invalid value for '--s'" in r.output
    assert not (tmp_path / "neg").exists()


def test_train_command_trains_and_resumes(pcfg_data, tmp_path):
    out = tmp_path / "run"
    args = ["train", "--data", str(pcfg_data), "--out", str(out), "--optimizer", "adamw", "--steps", "6", "--quiet"]
    args += [
        "--model-opt",
        "n_layer=1",
        "--model-opt",
        "n_embd=16",
        "--model-opt",
        "n_head=2",
        "--model-opt",
        "block_size=16",
    ]
    args += [
        "--batch-size",
        "4",
        "--ckpt-every",
        "3",
        "--warmup-steps",
        "1",
        "--val-windows",
        "8",
        "--opt",
        "betas=[0.9,0.99]",
    ]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "trained adamw to step 6" in r.output
    assert (out / "ckpt_000006.pt").is_file()
    cfg = __import__("json").loads((out / "config.json").read_text())
    assert cfg["optimizer_options"] == {"betas": [0.9, 0.99]} and cfg["model_overrides"]["n_layer"] == 1
    r = runner.invoke(app, [*args[:-2], "--steps", "9"])
    assert r.exit_code == 2 and "steps: 6 -> 9" in r.output
    r = runner.invoke(app, ["train", "--out", str(out)])
    assert r.exit_code == 2 and "--data is required" in r.output


def test_quadratic_command_writes_results_and_figures(tmp_path):
    r = runner.invoke(
        app,
        [
            "quadratic",
            "--out",
            str(tmp_path),
            "--d",
            "32",
            "--q",
            "20",
            "--m",
            "2",
            "--steps",
            "6",
            "--sweep-steps",
            "5",
        ],
    )
    assert r.exit_code == 0, r.output
    result = __import__("json").loads((tmp_path / "quadratic.json").read_text())
    assert result["example"]["closed_forms"]["muon_nds"] == 0.1 * 100 + 0.9 * 1
    for stem in ("quadratic_trajectories", "quadratic_phase"):
        assert (tmp_path / f"{stem}.png").stat().st_size > 1000 and (tmp_path / f"{stem}.pdf").is_file()
    r = runner.invoke(app, ["quadratic", "--out", str(tmp_path), "--q", "10", "--m", "6", "--d", "16"])
    assert r.exit_code == 2 and "α = m/q < 1/2" in r.output


def test_train_flags_override_the_config_file_over_the_defaults(tmp_path, monkeypatch):
    import json

    import curvlab.runs.launch
    from curvlab.runs.config import TrainConfig
    from curvlab.runs.train import TrainResult

    seen = []

    def fake_train(cfg, **kw):  # the config the command built, without training
        seen.append(cfg)
        return TrainResult(cfg.out, cfg.steps, 1.0, 1.0, 0)

    monkeypatch.setattr(curvlab.runs.launch, "train", fake_train)  # what `curvlab train` calls
    path = tmp_path / "cfg.json"
    fields = {
        "data": "d",
        "out": str(tmp_path / "run"),
        "steps": 70,
        "seed": 3,
        "optimizer_options": {"lr": 0.1, "momentum": 0.9},
    }
    path.write_text(json.dumps(fields))
    r = runner.invoke(
        app, ["train", "--config", str(path), "--seed", "4", "--lr", "0.2", "--grad-clip", "0", "--quiet"]
    )
    assert r.exit_code == 0, r.output
    cfg = seen[-1]
    assert (cfg.steps, cfg.seed, cfg.grad_clip) == (70, 4, None)
    assert cfg.optimizer_options == {"lr": 0.2, "momentum": 0.9}
    assert cfg.batch_size == TrainConfig(data="d", out="o").batch_size  # neither file nor flag: the default
    path.write_text(json.dumps({**fields, "stepz": 1}))
    r = runner.invoke(app, ["train", "--config", str(path)])
    assert (
        r.exit_code == 2
        and len(r.output.strip().splitlines()) == 1
        and "unknown training config field(s): stepz" in r.output
    )
    path.write_text(json.dumps({**fields, "steps": "70"}))
    r = runner.invoke(app, ["train", "--config", str(path)])
    assert r.exit_code == 2 and "steps must be int, got '70'" in r.output


def test_version_prints_the_one_stated_version():
    """``curvlab version`` prints pyproject.toml's version (read back from the installed metadata), which is the
    CHANGELOG's newest release, and no module repeats it."""
    stated = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE).group(1)
    r = runner.invoke(app, ["version"])
    assert r.exit_code == 0, r.output
    assert r.output.startswith(f"curvlab {stated} (torch "), (
        f"{r.output!r}: installed before the bump? pip install -e ."
    )
    newest = re.search(r"^## \[(\d[^\]]*)\]", (ROOT / "CHANGELOG.md").read_text(), re.MULTILINE).group(1)
    assert newest == stated
    assert not [p for p in (ROOT / "curvlab").rglob("*.py") if f'"{stated}"' in p.read_text()]


def test_train_takes_each_config_field_as_an_option_with_its_help_and_default():
    """The options of `curvlab train` are built from TrainConfig: each field with a help text is an option
    of its name (the dicts --model-opt and --opt), showing that help and the field's default."""
    import dataclasses

    import typer.main

    from curvlab.runs.config import FIELD_HELP, TrainConfig

    train = typer.main.get_command(app).commands["train"]
    options = {p.name: p for p in train.params}
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.name in FIELD_HELP}
    assert set(defaults) == set(FIELD_HELP) and set(FIELD_HELP) <= set(options)
    flags = {"model_overrides": "--model-opt", "optimizer_options": "--opt"}
    for name, default in defaults.items():
        option = options[name]
        assert option.help == FIELD_HELP[name] and option.default is None  # None: not given, the config decides
        assert option.opts[0] == flags.get(name, "--" + name.replace("_", "-"))
        if isinstance(default, bool):
            assert option.secondary_opts == ["--no-" + name.replace("_", "-")]
            assert option.show_default == (name if default else f"no-{name}")
        elif isinstance(default, (int, float, str)) and name not in ("data", "out"):
            assert option.show_default == str(default)
    assert options["seq_len"].show_default == "the model's block size"
    r = runner.invoke(app, ["train", "--help"], env={"COLUMNS": "250"})
    assert r.exit_code == 0 and "Gradient-norm clip; 0 disables. [default: (1.0)]" in r.output


def test_train_flags_reach_the_config(tmp_path, monkeypatch):
    import curvlab.runs.launch
    from curvlab.runs.train import TrainResult

    seen = []
    monkeypatch.setattr(
        curvlab.runs.launch, "train", lambda cfg, **kw: seen.append(cfg) or TrainResult(cfg.out, 1, 1.0, 1.0, 0)
    )
    args = ["train", "--data", "d", "--out", str(tmp_path / "run"), "--model-opt", "n_layer=2", "--opt", "betas=[0.9,0.95]",
            "--opt", "nesterov=false", "--compile", "--seq-len", "16", "--schedule", "cosine", "--quiet"]  # fmt: skip
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    cfg = seen[-1]
    assert (cfg.data, cfg.out, cfg.seq_len, cfg.schedule, cfg.compile) == (
        "d",
        str(tmp_path / "run"),
        16,
        "cosine",
        True,
    )
    assert cfg.model_overrides == {"n_layer": 2} and cfg.optimizer_options == {"betas": [0.9, 0.95], "nesterov": False}
    assert cfg.grad_clip == 1.0 and cfg.shadow is False  # not given: the defaults
    r = runner.invoke(app, ["train", "--data", "d", "--out", str(tmp_path / "run"), "--opt", "lr"])
    assert r.exit_code == 2 and r.output.strip() == "error: --opt expects KEY=VALUE, got 'lr'"


def test_the_table_aligns_its_columns():
    from curvlab.output.console import table

    lines = table([("a", 1.0, 1 / 3), ("bb", 12345678.9, "-")], ("name", "x", "y"), left=1).splitlines()
    assert lines == [
        "name  x            y       ",
        "----  -----------  --------",
        "a               1  0.333333",
        "bb    1.23457e+07         -",
    ]
    assert table([("a", "b")], ("one", "two"), left=2).splitlines()[2] == "a    b  "
