from typer.testing import CliRunner

from curvlab.cli import app

runner = CliRunner()


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
    assert r.exit_code == 2 and "Zipf exponent must be >= 0" in r.output
    assert not (tmp_path / "neg").exists()
