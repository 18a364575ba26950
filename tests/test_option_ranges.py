"""Every option is checked where it is parsed (issue 48): a value out of its range, not finite, of the wrong
type, or larger than the machine can hold is refused in one ``error:`` line naming it, with exit status 2,
before any output folder exists; ``--help`` shows the ranges; a missing optional package is named before a
job starts; and the documentation's commands still parse with every check run."""

import json

import pytest
import typer.main

import curvlab.cli.jobs
import curvlab.cli.options
from curvlab.cli import app
from curvlab.errors import CurvlabError
from curvlab.jobs.presets import FINETUNE_PRESETS, PRESETS, ROBUSTNESS_PRESETS
from tests.builders import assert_refused, runner
from tests.test_docs import SHELL_BLOCKS, curvlab_args, resolve, shell_commands

# a model small enough that only the option under test can be wrong
SMALL = ["--model-opt", "n_layer=1", "--model-opt", "n_embd=16", "--model-opt", "n_head=2", "--steps", "2",
         "--warmup-steps", "0"]  # fmt: skip

TRAIN_PROBES = [  # (options, what the error line must name)
    (["--grad-clip", "-0.5"], "--grad-clip"),
    (["--min-lr-frac", "-1"], "--min-lr-frac"),
    (["--cooldown-frac", "2"], "--cooldown-frac"),
    (["--lr", "nan"], "--lr"),
    (["--lr", "0"], "--lr"),
    (["--seed", "-1"], "--seed"),
    (["--seed", str(2**70)], "--seed"),
    (["--steps", "1e23"], "--steps"),
    (["--steps", str(10**23)], "--steps"),
    (["--warmup-steps", "-1"], "--warmup-steps"),
    (["--curvature-every", "-5"], "--curvature-every"),
    (["--batch-size", "100000000"], "batch_size 100000000"),  # the estimate, before anything is allocated
    (["--opt", "momentum=abc"], "momentum must be a number in [0, 1)"),
    (["--opt", "lr=-1"], "lr must be a finite number > 0"),
    (["--opt", "betas=[0.9]"], "betas must be a pair"),
    (["--opt", "polar_dtype=int64"], "polar_dtype"),
    (["--opt", "ns_steps=0"], "ns_steps"),
    (["--model-opt", "n_head=0"], "n_head must lie in [1,"),
    (["--model-opt", "n_head=3"], "n_head 3 must divide n_embd 16"),
    (["--model-opt", "block_size=0"], "block_size must lie in [1,"),
    (["--model-opt", "n_layer=1.5"], "n_layer must be int"),
    (["--model-opt", "dropout=1"], "dropout must be < 1"),
    (["--model-opt", "heads=2"], "unknown key 'heads'"),
    (["--model-opt", "n_embd=" + "9" * 400], "n_embd must lie in [1,"),  # (beyond the floats: no OverflowError)
    (["--model-opt", "dropout=" + "9" * 400], "dropout"),
    (["--opt", "weight_decay=" + "9" * 400], "weight_decay"),
]


@pytest.mark.parametrize("options, named", TRAIN_PROBES, ids=[" ".join(options) for options, _ in TRAIN_PROBES])
def test_train_refuses_each_bad_option_in_one_line(pcfg_data, tmp_path, options, named):
    out = tmp_path / "run"
    assert_refused(["train", "--data", pcfg_data, "--out", out, "--quiet", *SMALL, *options], named, out=out)
    assert not out.exists()


def test_the_bounds_themselves_are_accepted(tmp_path, monkeypatch):
    """The edges of each range reach the config (so the checks above refuse only what is out of range)."""
    import curvlab.runs.launch
    from curvlab.runs.train import TrainResult

    seen = []
    monkeypatch.setattr(
        curvlab.runs.launch, "train", lambda cfg, **kw: seen.append(cfg) or TrainResult(cfg.out, 1, 1.0, 1.0, 0)
    )
    args = ["train", "--data", "d", "--out", str(tmp_path / "run"), "--seed", str(2**32 - 1), "--min-lr-frac", "0",
            "--cooldown-frac", "1", "--grad-clip", "0", "--opt", "momentum=0", "--opt", "betas=[0,0.999]",
            "--optimizer", "sgd", "--model-opt", "dropout=0.5", "--quiet"]  # fmt: skip
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    cfg = seen[-1]
    assert (cfg.seed, cfg.min_lr_frac, cfg.cooldown_frac, cfg.grad_clip) == (2**32 - 1, 0.0, 1.0, None)


def test_a_config_file_is_checked_as_the_options_are(pcfg_data, tmp_path):
    out = tmp_path / "run"
    config = tmp_path / "config.json"
    cases = [
        ({"min_lr_frac": -1}, "min_lr_frac must lie in [0.0, 1.0], got -1"),
        ({"seed": 2**70}, "seed must lie in [0, 4294967295]"),
        ({"grad_clip": 0}, "grad_clip must be > 0, or null"),
        ({"optimizer_options": {"momentum": "abc"}}, "optimizer_options (--opt): momentum"),
        ({"shadow_options": {"lr": 0}}, "shadow_options: lr"),
        ({"optimizer": "adamax"}, "unknown optimizer 'adamax'"),
    ]
    for fields, message in cases:
        config.write_text(json.dumps({"data": str(pcfg_data), "out": str(out), **fields}))
        assert_refused(["train", "--config", config], message, out=out)
    config.write_text(json.dumps({"data": str(pcfg_data), "out": str(out), "cooldown_frac": float("nan")}))  # NaN
    assert_refused(["train", "--config", config], "cooldown_frac must lie in [0.0, 1.0], got nan", out=out)
    config.write_text(json.dumps({"data": str(pcfg_data), "out": str(out)})[:-1] + ', "steps": ' + "9" * 400 + "}")
    assert_refused(["train", "--config", config], "steps must lie in [1,", out=out)
    for damaged, message in (("[" * 100_000, "nested too deeply"), ("\udcff", "not UTF-8 text")):
        config.write_bytes(damaged.encode("utf-8", "surrogateescape"))
        assert_refused(["train", "--config", config], message, out=out)
    assert not out.exists()


def test_pcfg_generate_refuses_bad_values_and_what_the_machine_cannot_hold(tmp_path):
    out = tmp_path / "data"
    base = ["pcfg", "generate", "--out", out, "--tokens", "1k", "--val-tokens", "1k"]
    for options, named in [
        (["--s", "nan"], "--s"),
        (["--s", "inf"], "--s"),
        (["--val-s", "-1"], "--val-s"),
        (["--rule-s", "nan"], "--rule-s"),
        (["--seed", "-1"], "--seed"),
        (["--tokens", "nan"], "--tokens"),
        (["--tokens", "inf"], "--tokens"),
        (["--val-tokens", "0"], "--val-tokens"),
        (["--depth", "0"], "--depth"),
        (["--tokens", "1e30"], "of disk"),  # would have run until the disk was full
        (["--tokens", "1G", "--shard-tokens", "1"], "of disk"),  # a file (a block at least) per token
        (["--depth", "40"], "--depth 40"),  # a sentence of 2.5^40 tokens
        (["--width", "2147483647"], "--width 2147483647"),
    ]:
        line = assert_refused([*base, *options], named, out=out)
        assert options[0] in line or "of memory" in line or "of disk" in line
    assert not out.exists() and not any(tmp_path.iterdir())


def test_the_analysis_and_job_commands_refuse_bad_values(tmp_path):
    out = tmp_path / "out"
    for args, named in [
        (["compare", tmp_path, tmp_path, "--levels", "1e9"], "--levels"),
        (["compare", tmp_path, tmp_path, "--levels", str(10**9)], "--levels 1000000000 needs about 250 GB"),
        (["compare", tmp_path, tmp_path, "--tolerance", "nan"], "--tolerance"),
        (["compare", tmp_path, tmp_path, "--window", "-1"], "--window"),
        (["track", tmp_path, "--every", "0"], "--every"),
        (["spectrum", tmp_path / "ckpt.pt", "--memory", "nan"], "--memory"),
        (["spectrum", tmp_path / "ckpt.pt", "--memory", "1e9"], "--memory 1e+09 needs about 1e+09 GB"),
        (["spectrum", tmp_path / "ckpt.pt", "--max-iter", "0"], "--max-iter"),
        (["nds", tmp_path / "ckpt.pt", "--batches", "0"], "--batches"),
        (["quadratic", "--w-high", "nan"], "--w-high"),
        (["quadratic", "--sigma-low", "-1"], "--sigma-low"),
        (["quadratic", "--d", "1000000"], "--d 1000000 needs about"),
        (["finetune", "--rank", "0"], "--rank"),
        (["finetune", "--seeds", "-2"], "--seeds"),
    ]:
        assert_refused([*args, "--out", out], named, out=out)
    assert not out.exists()


class Started(CurvlabError):
    pass


def refuse_to_start(*args, **kwargs):
    raise Started("the job started")


def test_a_missing_extra_is_named_before_any_work(tmp_path, monkeypatch):
    real = curvlab.cli.options.find_spec
    monkeypatch.setattr(curvlab.cli.options, "find_spec", lambda name: None if name == "peft" else real(name))
    for name in ("Reproduction", "Robustness", "Finetune"):
        monkeypatch.setattr(curvlab.cli.jobs, name, refuse_to_start)
    out = tmp_path / "micro"
    assert_refused(["reproduce", "--preset", "micro", "--out", out], "needs peft", "pip install 'curvlab[hf]'", out=out)
    assert_refused(["finetune", "--preset", "micro", "--out", out], "finetune needs peft", out=out)
    assert not out.exists()
    # the designs without a fine-tuning need no peft: they get past the check, to the job itself
    assert PRESETS["micro"].extras == {"peft": "hf"} and FINETUNE_PRESETS["quick"].extras == {"peft": "hf"}
    assert PRESETS["quick"].extras == {} and ROBUSTNESS_PRESETS["robustness"].extras == {}
    assert_refused(["reproduce", "--preset", "quick", "--out", tmp_path / "quick"], "the job started")


def help_line(command: list[str], flag: str) -> str:
    r = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "250"})
    assert r.exit_code == 0, r.output
    return next(line for line in r.output.splitlines() if f" {flag} " in line)


@pytest.mark.parametrize(
    "command, flag, shown",
    [
        (["train"], "--batch-size", "[1<=x<=2147483647]"),
        (["train"], "--grad-clip", "[x>=0.0]"),
        (["train"], "--min-lr-frac", "[0.0<=x<=1.0]"),
        (["train"], "--cooldown-frac", "[0.0<=x<=1.0]"),
        (["train"], "--seed", "[0<=x<=4294967295]"),
        (["train"], "--lr", "(x>0)"),
        (["pcfg", "generate"], "--s", "[x>=0.0]"),
        (["pcfg", "generate"], "--depth", "[1<=x<=2147483647]"),
        (["compare"], "--levels", "[1<=x<=2147483647]"),
        (["spectrum"], "--memory", "(x>0)"),
    ],
)
def test_help_shows_the_ranges(command, flag, shown):
    assert shown in help_line(command, flag)


def test_the_documented_commands_parse_with_every_check():
    """Each ``curvlab`` command of README.md and docs/ parses, its values converted and checked by the
    options' types, ranges and callbacks (what tests/test_docs.py checks by flag names alone)."""
    checked = 0
    for block in SHELL_BLOCKS:
        for argv in shell_commands(block.code):
            args = curvlab_args(argv)
            if args is None or "--help" in args:
                continue
            command, names, rest = resolve(args)
            try:
                command.make_context(" ".join(["curvlab", *names]), list(rest))
            except typer.BadParameter as e:
                raise AssertionError(f"{block.where}: curvlab {' '.join(args)}: {e.format_message()}") from None
            checked += 1
    assert checked >= 20
    train = typer.main.get_command(app).commands["train"]
    with pytest.raises(typer.BadParameter):  # (the check above can fail)
        train.make_context("curvlab train", ["--grad-clip", "-1"])


def test_the_memory_estimate_is_a_ranks_share():
    """Each of W ranks takes rows rank::W of the batch, and under FSDP a share of the parameters: torchrun's
    run of a batch no one device could hold is not refused for it."""
    from curvlab.models.gpt import get_config
    from curvlab.runs.config import TrainConfig

    cfg = TrainConfig(data="d", out="o", model="gpt2-124m", batch_size=512, seq_len=1024)
    m = get_config("gpt2-124m")
    per_token = 2 * (16 * m.n_layer * m.n_embd + 2 * m.vocab_size)
    one, eight = cfg.memory_estimate(), cfg.memory_estimate(8)
    assert one - eight == (512 - 64) * 1024 * per_token  # (the activations of 448 of the 512 rows)
    parameters = (eight - 64 * 1024 * per_token) // 16
    assert cfg.memory_estimate(8, sharded=True) == 16 * -(-parameters // 8) + 64 * 1024 * per_token
    assert eight < 80e9 < one  # (an H100 holds a rank's share, not the whole batch)
