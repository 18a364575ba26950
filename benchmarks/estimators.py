"""The cheap estimators of the directional curvature <Z, H[Z]> against the exact one (issue 52): how far
each one's NDS lies from the exact NDS, whether its own stated error covers that, what it costs in passes
and in wall time. Run by hand:

    python benchmarks/estimators.py [--models tiny,hf-gpt2-small] [--dtypes float32,bfloat16]
                                    [--batch-size 4] [--seq-len 32] [--steps 3] [--repeats 3]
                                    [--device cpu] [--checkpoint PATH] [--out results.json]

Every model (``--models``: the curvlab GPT configs ``tiny``, ``pcfg-9m``, ``gpt2-124m``; ``hf-gpt2-small``,
a 4-layer GPT2LMHeadModel, and ``hf-llama-small``, a 4-layer LlamaForCausalLM, both built from
``transformers`` configs, nothing downloaded) is trained ``--steps`` steps from its seeded initialisation by
each arm, AdamW and Muon (``build_model_optimizer`` at its defaults), on seeded batches of Zipf-distributed
tokens, so that it is measured at a point that is not the initialisation. Then the arm's real next update Z
(``next_update``, dropout off, no clipping) on one more batch is the direction, and every estimator of
``curvlab.curvature.estimators`` measures the NDS along it on that batch. ``--checkpoint PATH`` (repeatable)
measures the next step of a curvlab run checkpoint as well, opened by ``open_checkpoint`` (its own batch, its
own clipping); ``--models ""`` measures the checkpoints alone.

The reference is ``exact`` in float32. ``bfloat16`` runs every estimator under
``torch.autocast(device, dtype=torch.bfloat16)`` (parameters and the estimators' working dtype stay float32;
autocast lowers the matrix products) and compares it with that same float32 reference: the error of a
bfloat16 row is what the lower precision costs that estimator. An estimator that raises under autocast is
reported as failed, with its message, and the run goes on.

Per row: the NDS; the relative error |NDS - exact| / |exact|; the estimator's own stated error over |exact|
and whether the true error lies within it; forwards and backwards (the estimators' own pass counts); the
median wall time over ``--repeats`` rounds that interleave every estimator and dtype (timing.py), as a ratio
to float32 ``exact``'s in the same rounds. An estimator with no stated error (``exact``, ``forward``) claims
float32's rounding and is held to ``EXACT_TOLERANCE``. Where an estimator lies outside its stated error the
note gives the likely cause: for ``quadratic_fit`` its fitted cubic term and the error's parts, for
``finite_difference`` truncation against rounding, and whether the exact NDS along Z is negative. One thread unless
``--threads``: on a shared machine OpenMP's spinning swamps small models.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
from timing import interleaved_medians
from torch import nn

from curvlab import GPT, get_config, make_loss_fn, next_update
from curvlab.curvature.estimators import ESTIMATORS, directional_curvature
from curvlab.engine import params as param_dicts
from curvlab.optim.model_optimizer import build_model_optimizer, trainable_parameters

ARMS = ("adamw", "muon")
GPT_MODELS = ("tiny", "pcfg-9m", "gpt2-124m")
HF_VOCAB = 512
# what "exact up to rounding" is held to (an estimator with no stated error): float32 sums over 1e5-1e8 terms
EXACT_TOLERANCE = 1e-3


def hf_gpt2_small(seq_len: int) -> nn.Module:
    """A 4-layer GPT-2 (width 64) from a config, dropout off so that training and Z are deterministic."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=HF_VOCAB, n_positions=max(seq_len, 8), n_embd=64, n_layer=4, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip
    return GPT2LMHeadModel(config)


def hf_llama_small(seq_len: int) -> nn.Module:
    """A 4-layer Llama (width 64, grouped-query attention) from a config."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=HF_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(seq_len, 8),
                         bos_token_id=0, eos_token_id=0)  # fmt: skip
    return LlamaForCausalLM(config)


HF_MODELS: dict[str, Callable[[int], nn.Module]] = {"hf-gpt2-small": hf_gpt2_small, "hf-llama-small": hf_llama_small}
MODELS = (*GPT_MODELS, *HF_MODELS)


def build(name: str, seq_len: int, device: str) -> tuple[nn.Module, int, bool]:
    """The seeded model, its vocabulary size and whether its batches are Hugging Face dicts."""
    torch.manual_seed(0)
    if name in GPT_MODELS:
        cfg = get_config(name)
        if seq_len > cfg.block_size:
            raise SystemExit(f"--seq-len {seq_len} is longer than {name}'s block size {cfg.block_size}")
        return GPT(cfg).to(device), cfg.vocab_size, False
    if name in HF_MODELS:
        from transformers.utils import logging

        logging.set_verbosity_error()
        return HF_MODELS[name](seq_len).to(device), HF_VOCAB, True
    raise SystemExit(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def batches(vocab: int, hf: bool, args, count: int) -> list:
    """``count`` seeded batches of Zipf-distributed tokens (a unigram law a few steps can start to learn)."""
    g = torch.Generator().manual_seed(1)
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    out = []
    for _ in range(count):
        ids = torch.multinomial(weights, args.batch_size * (args.seq_len + 1), replacement=True, generator=g)
        ids = ids.view(args.batch_size, args.seq_len + 1).to(args.device)
        # a Hugging Face causal LM shifts its labels itself; the curvlab GPT takes (inputs, next tokens)
        out.append({"input_ids": ids[:, :-1], "labels": ids[:, :-1]} if hf else (ids[:, :-1], ids[:, 1:]))
    return out


def trained_points(name: str, args) -> list[dict]:
    """For each arm: the model trained ``--steps`` steps, its loss function, W and the arm's next update Z."""
    points = []
    for arm in ARMS:
        model, vocab, hf = build(name, args.seq_len, args.device)
        data = batches(vocab, hf, args, args.steps + 1)
        loss_fn = make_loss_fn(model)
        opt = build_model_optimizer(arm, model)
        model.train()
        start = time.perf_counter()
        for batch in data[:-1]:
            loss_fn(dict(model.named_parameters()), batch).backward()
            opt.step()
            opt.zero_grad()
        model.eval()
        _, z = next_update(model, opt, loss_fn, data[-1], max_grad_norm=None)
        params = trainable_parameters(model)
        points.append(dict(model=name, arm=arm, loss_fn=loss_fn, params=params, batch=data[-1], z=z,
                           parameters=sum(t.numel() for t in params.values()),
                           train_seconds=time.perf_counter() - start))  # fmt: skip
    return points


def checkpoint_point(path: str, device: str) -> dict:
    """The next step of a curvlab run checkpoint, as ``curvlab nds`` takes it: dropout off, its own batch."""
    from curvlab.analysis.targets import open_checkpoint

    target = open_checkpoint(path, device=device)
    model = target.model
    model.eval()
    loss_fn = make_loss_fn(model)
    batch = target.train_batches[0]
    _, z = next_update(model, target.optimizer, loss_fn, batch, max_grad_norm=target.grad_clip)
    params = trainable_parameters(model)
    return dict(model=f"{Path(path).name} (step {target.step})", arm=target.optimizer_name, loss_fn=loss_fn,
                params=params, batch=batch, z=z, parameters=sum(t.numel() for t in params.values()),
                train_seconds=0.0)  # fmt: skip


def precision(dtype: str, device: str):
    """The context an estimator runs in: nothing for float32, bfloat16 autocast for bfloat16."""
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


def run_estimators(point: dict, dtypes: list[str], repeats: int) -> tuple[dict, dict]:
    """Every estimator once under each dtype (its estimate, or its failure as text), then the survivors' median
    seconds over ``repeats`` rounds that interleave every estimator and dtype, so that all ratios hold in one run."""
    device = str(next(iter(point["params"].values())).device)

    def call(dtype: str, name: str):
        with precision(dtype, device):
            return directional_curvature(point["loss_fn"], point["params"], point["batch"], point["z"], estimator=name)

    results: dict[tuple[str, str], object] = {}
    for key in [(d, n) for d in dtypes for n in ESTIMATORS]:
        try:
            results[key] = call(*key)
        except Exception as e:  # (reported in the table: the point is to see which ones survive autocast)
            results[key] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]
    alive = {f"{d}/{n}": (lambda d=d, n=n: call(d, n)) for (d, n), r in results.items() if not isinstance(r, str)}
    seconds = interleaved_medians(alive, repeats, warmup=0) if repeats else {}
    return results, {tuple(k.split("/")): s for k, s in seconds.items()}


def cause(est, exact_nds: float, dtype: str) -> str:
    """The likely reason an estimate lies outside its own stated error."""
    d, parts = est.detail, []
    if dtype != "float32":
        parts.append("autocast's bfloat16 products; " + ("no error stated: it claims float32's rounding" if est.error
                     is None else "its rounding term assumes float32's ε"))  # fmt: skip
    if est.estimator == "quadratic_fit":
        # the cubic term's size against the quadratic one at the grid's largest step: |b α| / |a|, a = <Z,HZ>/2
        share = abs(d["cubic"] * max(d["steps"])) / max(abs(est.zhz) / 2, 1e-300)
        parts.append(f"cubic b={d['cubic']:.3g}, b·α_max/a={share:.2g} in size")
    if "truncation" in d:  # (both estimators state their error's two parts on the NDS: shown over |exact|)
        trunc, rnd = d["truncation"] / abs(exact_nds), d["rounding"] / abs(exact_nds)
        which = "truncation" if trunc >= rnd else "rounding"
        parts.append(f"stated {which} dominates: truncation {trunc:.2g}, rounding {rnd:.2g}")
    if exact_nds < 0:
        parts.append("exact NDS < 0")
    return "; ".join(parts)


def rows_of(point: dict, dtype: str, reference, results: dict, seconds: dict) -> list[dict]:
    """The table's rows of one point and dtype, against the float32 exact ``reference``; times as ratios to
    float32 ``exact``'s (to this dtype's ``exact`` where float32 wasn't run)."""
    ref, rows = reference.nds, []
    base = seconds.get(("float32", "exact"), seconds.get((dtype, "exact")))
    for name in ESTIMATORS:
        row = dict(model=point["model"], arm=point["arm"], dtype=dtype, estimator=name, exact_nds=ref)
        est = results[dtype, name]
        if isinstance(est, str):
            rows.append({**row, "failed": est})
            continue
        rel = abs(est.nds - ref) / abs(ref)
        stated = None if est.error is None else est.error / abs(ref)
        # no stated error claims exactness up to the rounding of the float32 working dtype
        within = rel <= (stated if stated is not None else EXACT_TOLERANCE)
        secs = seconds.get((dtype, name))
        rows.append({**row, "nds": est.nds, "rel_error": rel, "stated_rel_error": stated, "within": within,
                     "forwards": est.forwards, "backwards": est.backwards, "seconds": secs,
                     "time_ratio": None if secs is None or not base else secs / base,
                     "cause": "" if within else cause(est, ref, dtype), "detail": est.detail})  # fmt: skip
    return rows


def fmt(x, spec: str = ".2e") -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def print_table(rows: list[dict]) -> None:
    print("| model | arm | dtype | estimator | NDS | rel. error | stated / \\|exact\\| | within | fwd/bwd | ms "
          "| time vs float32 exact | likely cause |")  # fmt: skip
    print("|---|---|---|---|---:|---:|---:|---|---:|---:|---:|---|")
    for r in rows:
        head = f"| {r['model']} | {r['arm']} | {r['dtype']} | {r['estimator']} |"
        if "failed" in r:
            print(f"{head} failed | | | | | | | {r['failed'].replace('|', '/')} |")
            continue
        within = "yes" if r["within"] else "**no**"
        ratio = "—" if r["time_ratio"] is None else f"{r['time_ratio']:.2f}x"
        print(f"{head} {r['nds']:.5g} | {fmt(r['rel_error'])} | {fmt(r['stated_rel_error'])} | {within} | "
              f"{r['forwards']}/{r['backwards']} | {fmt(r['seconds'] and r['seconds'] * 1e3, '.1f')} | "
              f"{ratio} | {r['cause'].replace('|', '/')} |")  # fmt: skip


def print_points(points: list[dict]) -> None:
    print("| model | arm | parameters | \\|Z\\| | exact NDS (float32) |")
    print("|---|---|---:|---:|---:|")
    for p in points:
        print(f"| {p['model']} | {p['arm']} | {p['parameters']:,} | {p['z_norm']:.3g} | {p['exact_nds']:.5g} |")
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,hf-gpt2-small", help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="float32 and/or bfloat16 (autocast)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3, help="training steps of each arm before measuring")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved timing rounds (0: no timing)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--checkpoint", action="append", default=[], help="a curvlab run checkpoint (repeatable)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtypes = [d for d in args.dtypes.split(",") if d]
    if not set(dtypes) <= {"float32", "bfloat16"}:
        raise SystemExit(f"--dtypes: float32 and/or bfloat16, got {args.dtypes}")
    names = [m for m in args.models.split(",") if m]
    if unknown := [m for m in names if m not in MODELS]:  # (before any model is trained, not after)
        raise SystemExit(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    start, load = time.perf_counter(), os.getloadavg()[0]
    points_of = [lambda n=n: trained_points(n, args) for n in names]
    points_of += [lambda p=p: [checkpoint_point(p, args.device)] for p in args.checkpoint]
    rows, setups = [], []
    for make in points_of:
        for point in make():
            reference = directional_curvature(point["loss_fn"], point["params"], point["batch"], point["z"])
            setups.append({k: point[k] for k in ("model", "arm", "parameters", "train_seconds")}
                          | {"z_norm": param_dicts.norm(point["z"]), "exact_nds": reference.nds})  # fmt: skip
            results, seconds = run_estimators(point, dtypes, args.repeats)
            for dtype in dtypes:
                rows += rows_of(point, dtype, reference, results, seconds)
            print(f"measured {point['model']} / {point['arm']}: exact NDS {reference.nds:.5g}", flush=True)
    print(
        f"\ntorch {torch.__version__}, {platform.processor() or platform.machine()}, {args.device}, "
        f"{torch.get_num_threads()} thread(s), models trained {args.steps} steps on batches of "
        f"{args.batch_size}x{args.seq_len}, medians of {args.repeats} interleaved rounds; load average "
        f"{load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} cores; "
        f"{time.perf_counter() - start:.0f} s\n"
    )
    print_points(setups)
    print_table(rows)
    if args.out:
        record = dict(date=datetime.date.today().isoformat(), torch=torch.__version__, args=vars(args),
                      points=setups, rows=rows)  # fmt: skip
        Path(args.out).write_text(json.dumps(record, indent=1, default=str))


if __name__ == "__main__":
    main()
