import copy
import json
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from typer.testing import CliRunner

from curvlab.analysis.report import analyze_checkpoint, load_report
from curvlab.analysis.targets import AnalysisSettings
from curvlab.cli import app
from curvlab.errors import CurvlabError
from curvlab.models.nanogpt import load_nanogpt
from curvlab.runs.checkpoint import load_checkpoint, save_checkpoint
from curvlab.runs.match import MatchCriteria, match_runs
from curvlab.runs.train import build_run, restore
from curvlab.studies.compare import compare_runs
from curvlab.studies.track import track_run
from tests.builders import assert_made_with_these_packages, nanogpt_checkpoint, small_run

runner = CliRunner()


@pytest.fixture(scope="module")
def runs(pcfg_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    small_run(pcfg_data, root / "muon", "muon", steps=16)
    small_run(pcfg_data, root / "adamw", "adamw", steps=16, lr=0.01)
    return root


def test_report_identities_and_schema(runs):
    report = analyze_checkpoint(runs / "muon" / "ckpt_000008.pt", AnalysisSettings(blocks="layer")).to_dict()
    b = report["blocks"]
    assert_made_with_these_packages(report["versions"])
    assert report["schema_version"] == 4 and report["step"] == 8 and report["optimizer"] == "muon"
    assert sum(map(sum, b["matrix"])) == pytest.approx(report["nds"], rel=1e-5)
    assert b["within"] + b["cross"] == pytest.approx(report["nds"], rel=1e-5)
    assert b["nds"] == pytest.approx(report["nds"], rel=1e-5)  # the total under its own name
    own = [b["matrix"][i][i] * report["update_norm"] ** 2 / b["norm"][i] ** 2 for i in range(len(b["names"]))]
    assert b["block_nds"] == pytest.approx(own, rel=1e-9)  # each block's own NDS under block_nds
    assert report["predicted"] == pytest.approx(report["first_order"] - report["curvature_penalty"], rel=1e-12)
    assert b["names"] == ["embedding", "layer0", "layer1", "final_norm", "head"]
    assert report["hidden"]["names"] and all(".h." in n for n in report["hidden"]["names"])
    for key in (
        "val_loss",
        "nds",
        "first_order",
        "curvature_penalty",
        "predicted",
        "realized",
        "update_norm",
        "grad_norm",
        "cosine",
    ):
        assert math.isfinite(report[key])
        if key != "val_loss":
            assert math.isfinite(report["hidden"][key])
    for key in ("names", "matrix", "within", "cross", "rho_within", "first_order", "norm", "nds"):
        assert key in b


def test_nds_matches_finite_differences_along_the_step_really_taken(pcfg_data, tmp_path):
    """Z comes independently from two consecutive checkpoints; NDS by central differences in float64."""
    cfg = small_run(pcfg_data, tmp_path / "r", "muon", steps=4, eval_every=1, ckpt_every=1)
    report = analyze_checkpoint(tmp_path / "r" / "ckpt_000002.pt", AnalysisSettings(dtype="float64")).to_dict()
    before = load_checkpoint(tmp_path / "r" / "ckpt_000002.pt")
    after = load_checkpoint(tmp_path / "r" / "ckpt_000003.pt")["model"]
    run = build_run(cfg)
    restore(run, before)
    x, y = run.loader.next()  # the batch the run trained on next
    model = copy.deepcopy(run.model).double().eval()
    names = [n for n, _ in model.named_parameters()]
    W = {n: p.detach().clone() for n, p in model.named_parameters()}
    Z = {n: before["model"][n].double() - after[n].double() for n in names}
    znorm2 = sum(float((z * z).sum()) for z in Z.values())
    assert report["update_norm"] == pytest.approx(znorm2**0.5, rel=1e-6)  # the analysed Z is the real step

    def loss_at(c):
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
            for n, p in model.named_parameters():
                p.copy_(W[n] + c * Z[n])
            logits = model(x)
            return float(F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)))

    eps = 1e-2
    fd = (loss_at(eps) - 2 * loss_at(0.0) + loss_at(-eps)) / (eps**2 * znorm2)
    assert report["nds"] == pytest.approx(fd, rel=1e-4)
    realized = loss_at(0.0) - loss_at(-1.0)
    assert report["realized"] == pytest.approx(realized, rel=1e-6)


def test_both_methods_and_both_block_ways_give_the_same_report(runs):
    """--method and --block-method are choices of algorithm, not of result: float64 reports agree."""
    path = runs / "adamw" / "ckpt_000008.pt"
    reports = [
        analyze_checkpoint(path, AnalysisSettings(dtype="float64", method=m, block_method=b)).to_dict()
        for m, b in (("rev_rev", "hvp"), ("fwd_rev", "hvp"), ("rev_rev", "alpha"))
    ]
    for other in reports[1:]:
        for key in ("nds", "first_order", "curvature_penalty", "realized"):
            assert other[key] == pytest.approx(reports[0][key], rel=1e-9)
        assert other["hidden"]["nds"] == pytest.approx(reports[0]["hidden"]["nds"], rel=1e-9)
        np.testing.assert_allclose(other["blocks"]["matrix"], reports[0]["blocks"]["matrix"], rtol=1e-8, atol=1e-12)
    with pytest.raises(ValueError, match="unknown HVP method"):
        analyze_checkpoint(path, AnalysisSettings(method="magic"))


def test_analysis_never_changes_the_checkpoint(runs):
    path = runs / "adamw" / "ckpt_000004.pt"
    before = path.read_bytes()
    analyze_checkpoint(path)
    assert path.read_bytes() == before


def test_matched_pairs_are_within_tolerance(runs):
    m = match_runs(runs / "muon", runs / "adamw", levels=6, tolerance=0.03)
    assert m.pairs
    for p in m.pairs:
        assert p.mismatch <= 0.03
        assert m.low <= p.target <= m.high


def test_compare_and_track_write_results_and_reuse_reports(runs, tmp_path, monkeypatch):
    out = tmp_path / "cmp"
    result = compare_runs(
        runs / "muon", runs / "adamw", out, MatchCriteria(levels=3, tolerance=0.05, phase="any"), progress=False
    )
    assert result.ratio_label == "adamw/muon"
    data = json.loads((out / "compare.json").read_text())
    assert len(data["pairs"]) == len(result.rows) >= 1
    assert_made_with_these_packages(data["versions"])
    row = result.rows[0]
    assert row["ratio_nds"] == pytest.approx(row["nds_b"] / row["nds_a"])  # run B is the AdamW one
    assert (out / "compare.csv").read_text().startswith("target,mismatch,")
    import curvlab.analysis.report as analysis

    def forbidden(*args, **kwargs):
        raise AssertionError("a cached report was recomputed")

    monkeypatch.setattr(analysis, "analyze_checkpoint", forbidden)
    compare_runs(
        runs / "muon", runs / "adamw", out, MatchCriteria(levels=3, tolerance=0.05, phase="any"), progress=False
    )
    monkeypatch.undo()
    rows = track_run(runs / "muon", tmp_path / "track", every=4, progress=False)
    assert [r.step for r in rows] == [2, 10]
    assert all(r.within + r.cross == pytest.approx(r.all.nds, rel=1e-5) for r in rows)
    assert_made_with_these_packages(json.loads((tmp_path / "track" / "track.json").read_text())["versions"])
    for p in (tmp_path / "track" / "reports").iterdir():
        load_report(p)


def token_data(tmp_path, val_tokens=2000):
    import numpy as np

    from curvlab.data.shards import write_shard

    data = tmp_path / "data"
    rng = np.random.default_rng(0)
    write_shard(data / "train_000000.bin", rng.integers(0, 64, 5000))
    write_shard(data / "val_000000.bin", rng.integers(0, 64, val_tokens))
    return data


def assert_same_parameters(ours: dict, theirs: dict, atol: float) -> None:
    """curvlab-named tensors against nanoGPT-named ones (c_attn split into c_q, c_k, c_v)."""
    for name, p in theirs.items():
        if ".attn.c_attn." in name:
            parts = [ours[name.replace("c_attn", s)] for s in ("c_q", "c_k", "c_v")]
            if name.endswith("bias"):
                # softmax is invariant to the key bias: its gradient is 0 up to rounding noise, which
                # Adam's m/sqrt(v) blows up to steps of size lr; compare the query and value biases only
                parts[1], p = parts[1][:0], torch.cat([p.chunk(3)[0], p.chunk(3)[2]])
            mine = torch.cat(parts)
        else:
            mine = ours[name]
        assert torch.allclose(mine, p, atol=atol), name


@pytest.mark.parametrize("grouping", ["dimension", "modules"])
def test_nanogpt_import_gives_same_logits_and_same_next_step(tmp_path, grouping):
    """Both of nanoGPT's optimizer groupings (by dimension since 2023, by module type and sorted before)."""
    ref, ref_opt, _ = nanogpt_checkpoint(tmp_path, grouping=grouping)
    model, opt = load_nanogpt(torch.load(tmp_path / "ckpt.pt", weights_only=True))
    idx = torch.randint(0, 64, (3, 16))
    with sdpa_kernel(SDPBackend.MATH):
        assert torch.allclose(model(idx), ref(idx), atol=1e-6, rtol=1e-5)
    x = torch.randint(0, 64, (4, 17))
    for m, o in ((ref, ref_opt), (model, opt)):
        o.zero_grad()
        F.cross_entropy(m(x[:, :-1]).reshape(-1, 64), x[:, 1:].reshape(-1)).backward()
        o.step()
    assert_same_parameters(dict(model.named_parameters()), dict(ref.named_parameters()), atol=1e-6)


def test_a_nanogpt_optimizer_of_other_groups_is_refused(tmp_path):
    _, _, ckpt = nanogpt_checkpoint(tmp_path)
    state = ckpt["optimizer"]
    first, second = state["param_groups"]
    split = [{**first, "params": first["params"][:2]}, {**first, "params": first["params"][2:]}, second]
    with pytest.raises(CurvlabError, match=r"groups of \[2, \d+, \d+\] parameters, which fit neither"):
        load_nanogpt({**ckpt, "optimizer": {**state, "param_groups": split}})
    # the right sizes with the moments in another order: the shapes tell
    moved = dict(state["state"])
    moved[0], moved[2] = moved[2], moved[0]  # (wte's and an attention matrix's moments swapped)
    with pytest.raises(CurvlabError, match="its moments' shapes fit neither"):
        load_nanogpt({**ckpt, "optimizer": {**state, "state": moved}})


def test_nds_command_on_a_nanogpt_checkpoint(tmp_path):
    nanogpt_checkpoint(tmp_path)
    data = token_data(tmp_path)
    r = runner.invoke(app, ["nds", str(tmp_path / "ckpt.pt"), "--data", str(data), "--out", str(tmp_path / "r.json")])
    assert r.exit_code == 0, r.output
    report = load_report(tmp_path / "r.json")
    assert report.optimizer == "adamw" and report.step == 3 and math.isfinite(report.split.nds)
    r = runner.invoke(app, ["nds", str(tmp_path / "ckpt.pt")])
    assert r.exit_code == 2 and "pass --data" in r.output
    assert report.next_batch.source == "seeded draw" and report.next_batch.seed == 3
    # what --batches can't have, and a device this torch can't use: one line each, no report
    r = runner.invoke(app, ["nds", str(tmp_path / "ckpt.pt"), "--data", str(data), "--batch", "val", "--batches", "50",
                            "--out", str(tmp_path / "v.json")])  # fmt: skip
    assert r.exit_code == 2 and "asks for 50 val batches, but there are 31" in r.output
    assert not (tmp_path / "v.json").exists()
    device = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"
    r = runner.invoke(app, ["nds", str(tmp_path / "ckpt.pt"), "--data", str(data), "--device", device])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1 and "CUDA" in r.output
    help_text = runner.invoke(app, ["nds", "--help"]).output
    assert "curvlab's own draw" in " ".join(re.sub("[│─╭╮╰╯]", " ", help_text).split())  # (rich's boxes wrap it)


def test_nanogpt_next_step_accumulates_its_micro_batches(tmp_path):
    """With gradient_accumulation_steps = 2, Z is nanoGPT's own step over the two micro-batches
    (loss / 2 each, clip, AdamW), and the report records where every row came from."""
    import numpy as np

    from curvlab.analysis.targets import open_checkpoint
    from curvlab.data.shards import TokenData
    from curvlab.engine.loss import make_loss_fn
    from curvlab.steps.update import next_update

    ref, ref_opt, _ = nanogpt_checkpoint(tmp_path, accumulation=2)
    data = token_data(tmp_path)
    target = open_checkpoint(tmp_path / "ckpt.pt", data)
    micro = target.train_batches[0]
    assert isinstance(micro, list) and len(micro) == 2 and target.draw.micro_batches == 2
    model = target.model.eval()
    _, Z = next_update(model, target.optimizer, make_loss_fn(model), micro, max_grad_norm=target.grad_clip)
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ref_opt.zero_grad()
    with sdpa_kernel(SDPBackend.MATH):
        for x, y in micro:  # nanoGPT's train loop
            (F.cross_entropy(ref(x).reshape(-1, 64), y.reshape(-1)) / 2).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    ref_opt.step()
    assert_same_parameters(Z, {n: before[n] - p.detach() for n, p in ref.named_parameters()}, atol=1e-6)
    _, Z_one = next_update(model, target.optimizer, make_loss_fn(model), micro[0], max_grad_norm=target.grad_clip)
    assert not torch.allclose(Z_one["transformer.h.0.mlp.c_fc.weight"], Z["transformer.h.0.mlp.c_fc.weight"])
    shards = TokenData.open(data, 64).train
    rows = np.stack([np.asarray(shards[s][o : o + 17]) for s, o in target.draw.rows])
    tokens = torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y in micro])
    assert torch.equal(torch.from_numpy(rows.astype(np.int64)), tokens)


def test_nanogpt_dropout_gives_the_same_z_every_run(tmp_path):
    """Dropout is off for Z as for G and H: with dropout 0.2 the report equals itself on every run,
    and equals that of the same weights saved with dropout 0."""
    nanogpt_checkpoint(tmp_path, dropout=0.2, name="drop.pt")
    nanogpt_checkpoint(tmp_path, dropout=0.0, name="nodrop.pt")
    data = token_data(tmp_path)
    runs = [analyze_checkpoint(tmp_path / n, data=data).to_dict() for n in ("drop.pt", "drop.pt", "nodrop.pt")]
    assert runs[0]["nds"] == runs[1]["nds"] == runs[2]["nds"]
    assert runs[0]["update_norm"] == runs[2]["update_norm"]


def test_bad_inputs(runs, tmp_path):
    r = runner.invoke(app, ["nds", str(tmp_path / "missing.pt")])
    assert r.exit_code == 2 and "no such checkpoint" in r.output
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    r = runner.invoke(app, ["nds", str(tmp_path / "bad.pt"), "--out", str(tmp_path / "out.json")])
    assert r.exit_code == 2 and "corrupt" in r.output and not (tmp_path / "out.json").exists()
    ckpt = load_checkpoint(runs / "muon" / "ckpt_000004.pt")
    save_checkpoint(
        tmp_path / "noopt.pt", {k: v for k, v in ckpt.items() if k not in ("optimizer", "format", "version")}
    )
    r = runner.invoke(app, ["nds", str(tmp_path / "noopt.pt")])
    assert r.exit_code == 2 and "no optimizer state" in r.output
    moved = dict(ckpt)
    moved["config"] = {**ckpt["config"], "data": str(tmp_path / "gone")}
    save_checkpoint(tmp_path / "moved.pt", {k: v for k, v in moved.items() if k not in ("format", "version")})
    r = runner.invoke(app, ["nds", str(tmp_path / "moved.pt")])
    assert r.exit_code == 2 and "is gone" in r.output
    r = runner.invoke(app, ["nds", str(runs / "muon" / "ckpt_000004.pt"), "--blocks", "rows"])
    assert r.exit_code == 2 and "unknown block grouping" in r.output
    r = runner.invoke(app, ["nds", str(runs / "muon" / "ckpt_000004.pt"), "--batch", "test"])
    assert r.exit_code == 2 and "--batch" in r.output
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "index.json").write_text(json.dumps([{"step": 5, "val_loss": 0.5, "path": "x.pt"}]))
    with pytest.raises(ValueError, match="never overlap"):
        match_runs(runs / "muon", fake)


def test_report_spectrum_connects_nds_to_lambda_max(runs):
    report = analyze_checkpoint(runs / "adamw" / "ckpt_000012.pt", AnalysisSettings(spectrum_top=2)).to_dict()
    s = report["spectrum"]
    assert report["nds"] <= s["lambda_max"] * (1 + 1e-4) + max(s["residuals"])
    assert 0.0 <= s["overlap_top_k"] <= 1.0 + 1e-9
    assert s["top"][0] >= s["top"][1]
    assert math.isfinite(s["trace"]) and s["trace_std_error"] > 0
    assert s["nds_over_lambda_max"] == pytest.approx(report["nds"] / s["lambda_max"])


@pytest.mark.heavy
def test_spectrum_command(runs, tmp_path):
    ckpt = str(runs / "adamw" / "ckpt_000008.pt")
    r = runner.invoke(app, ["spectrum", ckpt, "--top", "2", "--bottom", "1", "--trace", "--density", "--blocks", "layer",
                            "--preconditioned", "--max-iter", "15", "--out", str(tmp_path)])  # fmt: skip
    assert r.exit_code == 0, r.output
    result = json.loads((tmp_path / "spectrum.json").read_text())
    assert len(result["top"]["eigenvalues"]) == 2 and len(result["bottom"]["eigenvalues"]) == 1
    assert result["top"]["eigenvalues"][0] >= max(b["eigenvalues"][0] for b in result["blocks"].values()) * (1 - 1e-3)
    assert result["preconditioned"]["edge_of_stability"] == pytest.approx(38.0 / result["preconditioned"]["lr"])
    assert (tmp_path / "spectral_density.png").is_file()
    r = runner.invoke(app, ["spectrum", str(runs / "muon" / "ckpt_000008.pt"), "--preconditioned", "--top", "0"])
    assert r.exit_code == 2 and "no Adam state" in r.output
    r = runner.invoke(
        app, ["track", str(runs / "muon"), "--every", "4", "--spectrum", "1", "--out", str(tmp_path / "t")]
    )
    assert r.exit_code == 0, r.output
    assert (tmp_path / "t" / "lambda_max_vs_nds.png").is_file()
    rows = json.loads((tmp_path / "t" / "track.json").read_text())["rows"]
    assert all(row["nds"] <= row["lambda_max"] * 1.001 for row in rows)


def test_compare_and_track_take_the_method_and_the_block_method(runs, tmp_path):
    """--block-method and --method reach the analysis of compare and track, as they do nds's: the settings
    recorded are those asked for, and the float64 numbers equal the default methods' report."""
    methods = ["--block-method", "alpha", "--method", "fwd_rev", "--dtype", "float64", "--quiet"]
    r = runner.invoke(app, ["track", str(runs / "muon"), "--every", "8", "--source", "checkpoints", "--out",
                            str(tmp_path / "t"), *methods])  # fmt: skip
    assert r.exit_code == 0, r.output
    track = json.loads((tmp_path / "t" / "track.json").read_text())
    assert (track["settings"]["block_method"], track["settings"]["method"]) == ("alpha", "fwd_rev")
    row = track["rows"][0]
    default = analyze_checkpoint(runs / "muon" / f"ckpt_{row['step']:06d}.pt", AnalysisSettings(dtype="float64"))
    assert row["nds"] == pytest.approx(default.split.nds, rel=1e-9)
    assert row["within"] == pytest.approx(default.blocks.within, rel=1e-8)
    r = runner.invoke(app, ["compare", str(runs / "muon"), str(runs / "adamw"), "--levels", "1", "--phase", "any",
                            "--tolerance", "1", "--out", str(tmp_path / "c"), *methods])  # fmt: skip
    assert r.exit_code == 0, r.output
    settings = json.loads((tmp_path / "c" / "compare.json").read_text())["settings"]
    assert (settings["block_method"], settings["method"], settings["dtype"]) == ("alpha", "fwd_rev", "float64")
    r = runner.invoke(app, ["track", str(runs / "muon"), "--block-method", "magic", "--out", str(tmp_path / "m")])
    assert r.exit_code == 2 and "magic" in r.output


def test_more_validation_batches_than_the_run_evaluates(runs):
    """--batch val --batches 5 on a run that validates on 2 batches: the next windows of the same
    validation stream, the run's own first; never silently fewer than asked."""
    from curvlab.analysis.targets import evaluation_batches, open_checkpoint

    ckpt = runs / "muon" / "ckpt_000008.pt"
    own = open_checkpoint(ckpt).val_batches
    target = open_checkpoint(ckpt, batches=5)
    D = evaluation_batches(target, AnalysisSettings(batch="val", batches=5))
    assert len(own) == 2 and len(D) == 5
    assert all(torch.equal(a, b) for mine, theirs in zip(D, own) for a, b in zip(mine, theirs))
    with pytest.raises(ValueError, match="asks for 5 val batches, but there are 2"):
        evaluation_batches(open_checkpoint(ckpt), AnalysisSettings(batch="val", batches=5))
