from curvlab.data.dataset import generate_pcfg_dataset
from curvlab.runs.config import TrainConfig
from curvlab.runs.schedule import schedule_phase
from curvlab.runs.train import train


def test_progress_bar_shows_no_validation_loss_before_the_first_evaluation(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("CURVLAB_PROGRESS_INTERVAL", "0")  # stderr is no terminal here: a plain line every step
    generate_pcfg_dataset(
        tmp_path / "data", s=0.0, tokens="20k", val_tokens="4k", grammar_options={"n_tokens": 60}, progress=False
    )
    model = {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16, "vocab_size": 64}
    cfg = TrainConfig(
        str(tmp_path / "data"),
        str(tmp_path / "run"),
        model_overrides=model,
        optimizer="adamw",
        batch_size=4,
        steps=4,
        warmup_steps=1,
        eval_every=4,
        ckpt_every=4,
        val_windows=4,
        device="cpu",
    )
    train(cfg, progress=True)
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("train adamw:")]
    assert "\r" not in err and len(lines) == 4 + 1  # one per step, and the closing one
    assert all("loss=" in line for line in lines) and "val=nan" not in err
    assert "val=" not in lines[0] and "val=" in lines[-1]  # shown once evaluated, at the last step


def test_schedule_phases():
    wsd = TrainConfig("d", "o", steps=100, warmup_steps=10, schedule="wsd", cooldown_frac=0.2)
    assert [schedule_phase(k, wsd) for k in (0, 9, 10, 79, 80, 100)] == ["warmup"] * 2 + ["stable"] * 2 + ["decay"] * 2
    cosine = TrainConfig("d", "o", steps=100, warmup_steps=10, schedule="cosine")
    assert {schedule_phase(k, cosine) for k in range(10, 100)} == {"decay"}  # a cosine schedule has no stable phase
    constant = TrainConfig("d", "o", steps=100, warmup_steps=10, schedule="constant")
    assert {schedule_phase(k, constant) for k in range(10, 100)} == {"stable"}


def test_the_default_schedule_is_one_compare_accepts(pcfg_data, tmp_path):
    import shutil

    from typer.testing import CliRunner

    from curvlab.cli import app

    runner = CliRunner()
    run = tmp_path / "a"
    model = ["--model-opt", "n_layer=1", "--model-opt", "n_embd=16", "--model-opt", "n_head=2"]
    args = ["train", "--data", pcfg_data, "--out", run, "--optimizer", "adamw", "--steps", "10", "--quiet", *model]
    args += ["--model-opt", "block_size=16", "--batch-size", "4", "--warmup-steps", "1", "--val-windows", "8"]
    args += ["--ckpt-every", "1"]
    r = runner.invoke(app, [str(a) for a in args])  # no --schedule: the default
    assert r.exit_code == 0, r.output
    assert __import__("json").loads((run / "config.json").read_text())["schedule"] == "wsd"
    shutil.copytree(run, tmp_path / "b")
    r = runner.invoke(app, ["compare", str(run), str(tmp_path / "b"), "--out", str(tmp_path / "cmp"), "--levels", "2"])
    assert r.exit_code == 0, r.output  # compare's default phase, stable, pairs inside it
    assert "nds 1.000" in r.output  # a run against its copy
