from curvlab.data.dataset import generate_pcfg_dataset
from curvlab.train import TrainConfig, schedule_phase, train


def test_progress_bar_shows_no_validation_loss_before_the_first_evaluation(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("TQDM_MININTERVAL", "0")  # redraw on every step
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
    assert "loss=" in err and "val=nan" not in err
    assert "val=" in err.rsplit("\r", 1)[-1]  # shown once evaluated, at the last step


def test_schedule_phases():
    wsd = TrainConfig("d", "o", steps=100, warmup_steps=10, schedule="wsd", cooldown_frac=0.2)
    assert [schedule_phase(k, wsd) for k in (0, 9, 10, 79, 80, 100)] == ["warmup"] * 2 + ["stable"] * 2 + ["decay"] * 2
    cosine = TrainConfig("d", "o", steps=100, warmup_steps=10, schedule="cosine")
    assert {schedule_phase(k, cosine) for k in range(10, 100)} == {"decay"}  # a cosine schedule has no stable phase
    constant = TrainConfig("d", "o", steps=100, warmup_steps=10, schedule="constant")
    assert {schedule_phase(k, constant) for k in range(10, 100)} == {"stable"}
