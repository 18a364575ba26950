"""``curvlab finetune``: adapter-scoped curvature against a dense float64 reference, the micro
pipeline end to end through the CLI, equal treatment of the arms, and bad input. (Notebook 05 runs in
tests/test_reproduce.py, against the micro reproduction's fine-tuning stage.)"""

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from curvlab import block_matrix, make_loss_fn, taylor_split
from curvlab.cli import app
from curvlab.engine import params as param_dicts
from curvlab.errors import CurvlabError
from curvlab.models.gpt import GPT, get_config
from curvlab.optim.lora import adapter_blocks, lora_layers
from curvlab.runs.adapt import adapter_targets, curvature_rows, lora_model
from curvlab.runs.checkpoint import read_index, save_checkpoint
from curvlab.studies.adapters import ADAPTER_ARMS, LEVEL_KEYS, MUON_VARIANTS, FinetuneResult, _side_means, estimates
from curvlab.util import schema
from tests.builders import assert_made_with_these_packages
from tests.reference import dense_gradient, dense_hessian

runner = CliRunner()
F64 = torch.float64


def tiny_adapted(rank=2):
    torch.manual_seed(0)
    base = GPT(get_config("tiny", vocab_size=24, block_size=6, n_layer=2, n_head=2, n_embd=8)).double()
    model = lora_model(base, rank)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # peft starts from B = 0; any point will do for the reference
        for layer in lora_layers(model):
            for p in (layer.A, layer.B):
                p.copy_(0.4 * torch.randn(p.shape, generator=g, dtype=F64))
    return model


def test_lora_targets_every_attention_and_mlp_linear_by_structure():
    model = tiny_adapted()
    names = [layer.name for layer in lora_layers(model)]
    kinds = ("attn.c_q", "attn.c_k", "attn.c_v", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    assert names == [f"transformer.h.{i}.{k}" for i in range(2) for k in kinds]  # not wte, wpe or lm_head
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable) and len(trainable) == 2 * len(names)


def test_adapter_taylor_split_and_block_matrix_match_a_dense_float64_reference():
    """Over the adapter parameters only: I1, I2, NDS and every M_lm (one block per adapted layer,
    its A and B together) against a dense Hessian from double-backward rows."""
    model = tiny_adapted()
    loss_fn = make_loss_fn(model)
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    g = torch.Generator().manual_seed(2)
    z = {n: 0.05 * torch.randn(p.shape, generator=g, dtype=F64) for n, p in params.items()}
    batch = (torch.randint(0, 24, (3, 6), generator=g), torch.randint(0, 24, (3, 6), generator=g))
    H, G, zf = dense_hessian(loss_fn, params, batch), dense_gradient(loss_fn, params, batch), param_dicts.flatten(z)
    norm2 = float(zf @ zf)

    split = taylor_split(loss_fn, params, batch, z, scope=None)
    assert split.first_order == pytest.approx(float(G @ zf), rel=1e-10)
    assert split.curvature_penalty == pytest.approx(0.5 * float(zf @ H @ zf), rel=1e-10)
    assert split.nds == pytest.approx(float(zf @ H @ zf) / norm2, rel=1e-10)

    blocks = adapter_blocks(model)
    assert len(blocks) == 12 and all(len(m) == 2 for m in blocks.values())
    M = block_matrix(loss_fn, params, batch, z, blocks=blocks)
    offsets = np.cumsum([0] + [p.numel() for p in params.values()])
    where = {n: slice(offsets[i], offsets[i + 1]) for i, n in enumerate(params)}
    masks = []
    for members in blocks.values():
        mask = torch.zeros_like(zf)
        for n in members:
            mask[where[n]] = 1.0
        masks.append(mask * zf)
    dense = np.array([[float(a @ H @ b) / norm2 for b in masks] for a in masks])
    np.testing.assert_allclose(np.array(M.matrix), dense, rtol=1e-9, atol=1e-12 * np.abs(dense).max())
    assert np.trace(dense) + (dense.sum() - np.trace(dense)) == pytest.approx(split.nds, rel=1e-9)


# --- the micro pipeline through the CLI ------------------------------------------------------------------


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    out = tmp_path_factory.mktemp("finetune") / "micro"
    r = runner.invoke(app, ["finetune", "--preset", "micro", "--out", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    return out, r.output


@pytest.mark.heavy
def test_micro_writes_typed_reloadable_results(micro):
    out, output = micro
    for name in ("finetune.json", "tuning.json", "report.md", "figures/finetune_ratios.png"):
        assert (out / name).is_file(), name
    result = FinetuneResult.load(out / "finetune.json")
    assert FinetuneResult.from_dict(json.loads(json.dumps(result.to_dict()))) == result
    assert_made_with_these_packages(json.loads((out / "finetune.json").read_text())["versions"])
    assert [c.variant for c in result.comparisons] == list(MUON_VARIANTS)
    nds = result.entry("nds_ratio", "smuon")
    assert nds.n_seeds == 2 and nds.n_levels == len(nds.per_level) >= 2 and nds.ci95 is not None
    assert "adamw/smuon" in output and "Curvature of adapter steps" in (out / "report.md").read_text()
    data = json.loads((out / "finetune.json").read_text())
    data["schema_version"] = 0
    (out / "edited.json").write_text(json.dumps(data))
    with pytest.raises(CurvlabError, match="edited or corrupt"):  # the seal no longer matches
        FinetuneResult.load(out / "edited.json")
    del data[schema.SEAL]  # (another version written as such: no seal to break)
    (out / "bad.json").write_text(json.dumps(data))
    with pytest.raises(CurvlabError, match="schema 0"):
        FinetuneResult.load(out / "bad.json")


@pytest.mark.heavy
def test_every_summary_number_is_rederived_from_the_per_level_data_and_the_runs(micro):
    out, _ = micro
    result = FinetuneResult.load(out / "finetune.json")
    assert estimates(result.comparisons) == result.entries
    for c in result.comparisons:
        for level in c.levels:  # each window mean from the curvature rows the runs wrote
            for arm in ("adamw", c.variant):
                rows = curvature_rows(out / "runs" / arm / f"seed{level.seed}")
                assert _side_means(rows, level.windows[arm]) == level.values[arm]
                assert set(level.values[arm]) == set(LEVEL_KEYS)
        nds = result.entry("nds_ratio", c.variant)  # a ratio of sums over every level: none dropped
        num = sum(lv.values["adamw"]["nds"] for lv in c.levels)
        den = sum(lv.values[c.variant]["nds"] for lv in c.levels)
        assert nds.value == pytest.approx(num / den, rel=1e-12) and nds.n_levels == len(c.levels)
        ratios = {}  # each seed's median of its per-level ratios, then the mean over seeds
        for lv in c.levels:
            ratios.setdefault(lv.seed, []).append(lv.values["adamw"]["nds"] / lv.values[c.variant]["nds"])
        medians = [np.median(r) for r in ratios.values()]
        assert len(medians) >= 2
        assert result.entry("nds_ratio_median", c.variant).value == pytest.approx(np.mean(medians), rel=1e-12)


@pytest.mark.heavy
def test_every_arm_gets_the_same_treatment(micro):
    out, _ = micro
    configs = {
        arm: [json.loads((out / "runs" / arm / f"seed{s}" / "config.json").read_text()) for s in range(2)]
        for arm in ADAPTER_ARMS
    }
    same = ("steps", "warmup_steps", "schedule", "cooldown_frac", "batch_size", "grad_clip", "val_windows", "data")
    for key in same:
        assert len({json.dumps(c[key]) for cs in configs.values() for c in cs}) == 1, key
    assert {arm: [c["seed"] for c in cs] for arm, cs in configs.items()} == {arm: [0, 1] for arm in ADAPTER_ARMS}
    assert all(c["optimizer"] == arm for arm, cs in configs.items() for c in cs)
    tuning = json.loads((out / "tuning.json").read_text())
    searches = [tuning["searches"][f"{arm}.lr"] for arm in ADAPTER_ARMS]
    assert {len(s["initial"]) for s in searches} == {2}  # the same grid size
    assert {len(v) for s in searches for v in s["grid"].values()} == {1}  # and seeds per point
    chosen = {arm: [c["optimizer_options"]["lr"] for c in cs] for arm, cs in configs.items()}
    assert chosen == {arm: [tuning["chosen"][arm]["lr"]] * 2 for arm in ADAPTER_ARMS}
    steps = {tuple(e["step"] for e in read_index(out / "runs" / arm / "seed0")) for arm in ADAPTER_ARMS}
    assert len(steps) == 1  # the same checkpoints, so the same candidate levels


# --- bad input -------------------------------------------------------------------------------------------


def _one_line_error(args, match):
    r = runner.invoke(app, ["finetune", "--preset", "micro", "--quiet", *args])
    assert r.exit_code == 2, r.output
    assert r.output.strip().startswith("error:") and len(r.output.strip().splitlines()) == 1, r.output
    assert match in r.output, r.output


def _checkpoint(path, **overrides):
    cfg = get_config("tiny", vocab_size=64, block_size=8, n_head=2, n_embd=16, **overrides)
    save_checkpoint(path, {"model_config": cfg.to_dict(), "model": GPT(cfg).state_dict(), "config": {}})


def test_bad_input_is_one_line_and_exit_code_2(tmp_path):
    _one_line_error(["--out", str(tmp_path / "a"), "--base", str(tmp_path / "nowhere")], "no such base run")
    (tmp_path / "empty").mkdir()
    _one_line_error(["--out", str(tmp_path / "b"), "--base", str(tmp_path / "empty")], "not a training run")
    (tmp_path / "corrupt.pt").write_bytes(b"not a checkpoint")
    _one_line_error(["--out", str(tmp_path / "c"), "--base", str(tmp_path / "corrupt.pt")], "corrupt.pt")
    _checkpoint(tmp_path / "flat.pt", n_layer=0)  # no hidden linear layer: nothing for LoRA to adapt
    _one_line_error(["--out", str(tmp_path / "d"), "--base", str(tmp_path / "flat.pt")], "no hidden linear layers")
    _checkpoint(tmp_path / "ok.pt", n_layer=1)
    _one_line_error(
        ["--out", str(tmp_path / "e"), "--base", str(tmp_path / "ok.pt"), "--rank", "20"], "rank 20 exceeds layer"
    )
    _one_line_error(["--out", str(tmp_path / "f"), "--rank", "40"], "rank 40 exceeds layer")  # micro's 32-wide GPT
    _one_line_error(["--out", str(tmp_path / "g"), "--rank", "0"], "Invalid value for '--rank'")
    _one_line_error(["--out", str(tmp_path / "h"), "--base", str(tmp_path / "ok.pt")], "not a Zipf-PCFG directory")
    data = tmp_path / "data"
    data.mkdir()
    (data / "stats.json").write_text(json.dumps({"vocab_size": 300}))
    args = ["--out", str(tmp_path / "i"), "--base", str(tmp_path / "ok.pt"), "--data", str(data)]
    _one_line_error(args, "larger than the base model's (64)")  # an incompatible base
    _one_line_error(["--out", str(tmp_path / "j"), "--preset", "huge"], "unknown fine-tuning preset")
    assert not (tmp_path / "a").exists()
    with pytest.raises(CurvlabError, match="no hidden linear layers"):
        adapter_targets(torch.nn.Sequential(torch.nn.Embedding(4, 3)))


@pytest.mark.heavy
def test_a_failed_curvature_row_makes_its_window_mean_nan(micro):
    """A non-finite or zero-step row (no block split) counts as NaN: the window mean says so, and
    nothing is dropped or crashes."""
    import dataclasses
    import math

    out, _ = micro
    rows = curvature_rows(out / "runs" / "adamw" / "seed0")
    steps = sorted(rows)[:2]
    failed = dataclasses.replace(rows[steps[0]], status="non-finite", message="NDS is nan", blocks=None)
    means = _side_means({**rows, steps[0]: failed}, steps)
    assert all(math.isnan(v) for v in means.values())
    assert all(math.isfinite(v) for v in _side_means(rows, steps[1:]).values())


@pytest.mark.heavy
def test_a_finished_run_is_not_reused_under_other_settings(micro, tmp_path):
    """A finished adaptation run is reused only when its saved settings are the ones asked for."""
    import dataclasses
    import shutil

    from curvlab.runs.adapt import adapt
    from curvlab.runs.config import TrainConfig

    out, _ = micro
    run = tmp_path / "run"
    shutil.copytree(out / "runs" / "adamw" / "seed0", run)
    saved = json.loads((run / "config.json").read_text())
    adapter = json.loads((run / "adapter.json").read_text())
    cfg = TrainConfig.from_dict(saved)
    assert adapt(cfg, adapter["base"], adapter["rank"], None) == read_index(run)[-1]["val_loss"]
    cfg = dataclasses.replace(cfg, optimizer_options={**cfg.optimizer_options, "lr": 2 * cfg.optimizer_options["lr"]})
    with pytest.raises(CurvlabError, match="other settings.*lr"):
        adapt(cfg, adapter["base"], adapter["rank"], None)
    with pytest.raises(CurvlabError, match="other settings.*rank"):
        adapt(TrainConfig.from_dict(saved), adapter["base"], adapter["rank"] + 1, None)
