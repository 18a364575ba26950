"""What the tests build, in one place: plain functions (the fixtures in ``conftest.py`` call them, and tests
import them from here, never from ``conftest``).

* a small GPT run: :func:`small_config` (the ``TrainConfig``) and :func:`small_run` (trained);
* processes: :func:`spawn` ranks on one machine, :func:`init_group` and :func:`leave_group` inside them;
* a real Hugging Face ``Trainer``: :func:`tiny_gpt2`, :func:`token_data`, :func:`hf_trainer`,
  :func:`write_token_shards`;
* a nanoGPT checkpoint written by nanoGPT's own model and optimizer groups (:func:`nanogpt_checkpoint`);
* a shadowed run's config (:func:`shadow_config`) and its training losses (:func:`train_losses`);
* an optimizer's step by hand: :func:`batch_for`, :func:`train_step`, :func:`snapshot`;
* the command line: :data:`runner` and :func:`assert_refused` (bad input: status 2, one line, no output left);
* small helpers: :func:`random_direction`, :func:`crash_training_after`, :func:`assert_made_with_these_packages`.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import platform
import socket
import sys
from pathlib import Path

import numpy
import scipy
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import transformers
from typer.testing import CliRunner

import curvlab
from curvlab.cli import app
from curvlab.data.shards import write_shard
from curvlab.runs.config import TrainConfig
from curvlab.runs.train import train

SMALL_MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32}
# the small run's fields; each test overrides the ones it is about
SMALL_RUN = dict(
    model_overrides=SMALL_MODEL, batch_size=8, steps=12, warmup_steps=1, eval_every=2, ckpt_every=2, val_windows=16
)


# -- a small GPT run ----------------------------------------------------------------------------


def small_config(data: str | Path, out: str | Path, **fields) -> TrainConfig:
    """The ``TrainConfig`` of a small GPT (:data:`SMALL_MODEL`) trained on ``data`` into ``out``:
    :data:`SMALL_RUN`'s fields, ``fields`` overriding them."""
    return TrainConfig(data=str(data), out=str(out), **{**SMALL_RUN, **fields})


def small_run(data: str | Path, out: str | Path, optimizer: str, lr: float | None = None, **fields) -> TrainConfig:
    """Train :func:`small_config` with ``optimizer`` (at its default lr, or ``lr``); returns the config."""
    cfg = small_config(data, out, optimizer=optimizer, optimizer_options={"lr": lr} if lr else {}, **fields)
    train(cfg, progress=False)
    return cfg


def crash_training_after(monkeypatch, steps: int):
    """Make the training loader raise KeyboardInterrupt when asked for batch ``steps + 1``; returns a
    function that puts the real loader back."""
    from curvlab.data.shards import TrainBatches

    original_next = TrainBatches.next
    calls = {"n": 0}

    def crashing_next(self):
        calls["n"] += 1
        if calls["n"] > steps:
            raise KeyboardInterrupt
        return original_next(self)

    monkeypatch.setattr(TrainBatches, "next", crashing_next)
    return lambda: monkeypatch.setattr(TrainBatches, "next", original_next)


def stopped_at_the_first_safe_point(job) -> None:
    """Run ``job`` (a :class:`curvlab.jobs.job.Job`) with a SIGTERM sent at its first safe point (after its first
    seed's analysis), as a stop from outside would: it must stop there with ``Stopped``."""
    import signal

    import pytest

    from curvlab.jobs.job import Job
    from curvlab.util.safe_stop import Stopped

    real, calls = Job.safe_point, []

    def stop_once(self, done):
        calls.append(done)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # honoured here, at the safe point
        real(self, done)

    Job.safe_point = stop_once
    try:
        with pytest.raises(Stopped):
            job.run()
    finally:
        Job.safe_point = real


# -- processes ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, tmp_path: Path, world: int, *args) -> None:
    """``fn(rank, tmp, world, *args)`` on ``world`` processes, joined. The rendezvous address travels in
    ``tmp_path / "port"`` (a TCP store on loopback: a FileStore's clean-up at exit sometimes aborted a rank)."""
    (tmp_path / "port").write_text(str(_free_port()))
    mp.spawn(_then_exit, args=(fn, str(tmp_path), world, *args), nprocs=world, join=True)


def _then_exit(rank: int, fn, *args) -> None:
    """Run ``fn`` and leave without the interpreter's teardown: a gloo worker thread still joinable at
    finalization aborts the rank ("terminate called without an active exception", seen once in CI on the
    FSDP test after every value had been computed). An exception still reaches the spawn as its error."""
    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def init_group(rank: int, tmp: str, world: int, timeout: float = 60) -> None:
    """Join the gloo group of :func:`spawn`'s ranks (each collective waits at most ``timeout`` seconds)."""
    port = Path(tmp, "port").read_text()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=timeout),
    )  # fmt: skip


def leave_group() -> None:
    dist.barrier()  # gloo aborts a rank whose peer tore the group down first
    dist.destroy_process_group()


# -- a real Hugging Face Trainer ----------------------------------------------------------------


def tiny_gpt2(vocab: int = 64, positions: int = 16, n_embd: int = 32, n_layer: int = 2, **config):
    """A freshly initialised GPT-2 of a few thousand parameters (``config``: more ``GPT2Config`` fields)."""
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=vocab, n_positions=positions, n_embd=n_embd, n_layer=n_layer, n_head=2, **config
        )
    )


def token_data(ids: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """A causal-LM training set of the rows of ``ids``, each its own labels."""
    return [{"input_ids": x, "labels": x} for x in ids]


def hf_trainer(model, out: str | Path, data, callbacks=(), **arguments) -> transformers.Trainer:
    """A real ``transformers.Trainer`` of ``model`` on ``data``, on CPU, with no progress bar and no
    report unless ``arguments`` (more ``TrainingArguments``: ``max_steps``, ``learning_rate``, ...) say so."""
    args = transformers.TrainingArguments(
        output_dir=str(out), **{"report_to": [], "use_cpu": True, "disable_tqdm": True, **arguments}
    )
    return transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=list(callbacks))


def write_token_shards(directory: Path, vocab: int) -> Path:
    """A data directory of uniform random tokens below ``vocab``: a 4000-token train and a 2000-token
    validation shard."""
    rng = numpy.random.default_rng(0)
    write_shard(directory / "train_000000.bin", rng.integers(0, vocab, 4000))
    write_shard(directory / "val_000000.bin", rng.integers(0, vocab, 2000))
    return directory


# -- nanoGPT ------------------------------------------------------------------------------------


class NanoBlock(nn.Module):
    """nanoGPT's block, written here as the reference: fused c_attn, LayerNorm with bias, GELU MLP."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(d)
        self.attn = nn.Module()
        self.attn.c_attn = nn.Linear(d, 3 * d)
        self.attn.c_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(d, 4 * d)
        self.mlp.c_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.attn.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.attn.c_proj(y)
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x))))


class NanoGPT(nn.Module):
    def __init__(self, vocab=64, block=16, layers=2, heads=2, d=16):
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(vocab, d),
                "wpe": nn.Embedding(block, d),
                "h": nn.ModuleList(NanoBlock(d, heads) for _ in range(layers)),
                "ln_f": nn.LayerNorm(d),
            }
        )
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx):
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.shape[1]))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))

    def configure_optimizers(self, lr, grouping="dimension"):
        """nanoGPT's groups: since 2023 every parameter of dim >= 2 decays; before ("modules", as minGPT) the
        weights of nn.Linear modules decay (not the tied head), and both groups are sorted by name."""
        params = {n: p for n, p in self.named_parameters()}
        if grouping == "dimension":
            decay = [p for p in params.values() if p.dim() >= 2]
            no_decay = [p for p in params.values() if p.dim() < 2]
        else:
            linear = {f"{mn}.weight" for mn, m in self.named_modules() if isinstance(m, nn.Linear)} - {"lm_head.weight"}
            decay = [params[n] for n in sorted(linear)]
            no_decay = [params[n] for n in sorted(set(params) - linear)]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def nanogpt_checkpoint(tmp_path, dropout=0.0, accumulation=None, name="ckpt.pt", grouping="dimension"):
    """A nanoGPT ``ckpt.pt`` (the reference model above, 3 AdamW steps) written at ``tmp_path / name``;
    returns the model, its optimizer and the payload."""
    torch.manual_seed(0)
    ref = NanoGPT()
    with torch.no_grad():
        for m in ref.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.normal_(1.0, 0.2)
                m.bias.normal_(0.0, 0.2)
    opt = ref.configure_optimizers(lr=1e-2, grouping=grouping)
    for _ in range(3):
        idx = torch.randint(0, 64, (4, 17))
        loss = F.cross_entropy(ref(idx[:, :-1]).reshape(-1, 64), idx[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model_args = {
        "n_layer": 2,
        "n_head": 2,
        "n_embd": 16,
        "block_size": 16,
        "bias": True,
        "vocab_size": 64,
        "dropout": dropout,
    }
    config = {"batch_size": 4, "grad_clip": 1.0}
    if accumulation is not None:
        config["gradient_accumulation_steps"] = accumulation
    ckpt = {"model": ref.state_dict(), "optimizer": opt.state_dict(), "model_args": model_args, "iter_num": 3,
            "best_val_loss": 4.0, "config": config}  # fmt: skip
    torch.save(ckpt, tmp_path / name)
    return ref, opt, ckpt


# -- small helpers ------------------------------------------------------------------------------


def random_direction(params, seed=1, dtype=None):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g, dtype=dtype or v.dtype) for k, v in params.items()}


def assert_made_with_these_packages(versions: dict) -> None:
    """A record's ``versions`` name the packages this process imported (their own ``__version__``)."""
    assert versions == {
        "python": platform.python_version(),
        "curvlab": curvlab.__version__,
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "scipy": scipy.__version__,
        "transformers": transformers.__version__,
    }


# -- a shadowed run ----------------------------------------------------------------------------


def shadow_config(data, out, **kw):
    return small_config(
        data, out, **{"steps": 10, "warmup_steps": 2, "eval_every": 4, "ckpt_every": 4, "val_windows": 8, **kw}
    )


def train_losses(out):
    return [json.loads(line)["train_loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


# -- an optimizer's step by hand -----------------------------------------------------------------


def batch_for(model, seed=0, batch=4):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, model.config.vocab_size, (batch, model.config.block_size + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def train_step(model, opt, loss_fn, batch):
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(dict(model.named_parameters()), batch)
    loss.backward()
    opt.step()
    return float(loss.detach())


def snapshot(opt):
    """The optimizer's full state as plain nested data, tensors cloned."""
    return copy.deepcopy(opt.state_dict())


# -- the command line ----------------------------------------------------------------------------

runner = CliRunner()


def assert_refused(args, *expected, out=None):
    """Exit status 2, one line starting with "error:" that holds every ``expected`` text, and no ``out``."""
    r = runner.invoke(app, [str(a) for a in args])
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2, r.output
    assert len(lines) == 1 and lines[0].startswith("error:"), r.output
    for text in expected:
        assert text in lines[0], r.output
    if out is not None:
        assert not Path(out).exists() or (Path(out).is_dir() and not any(Path(out).iterdir()))
    return lines[0]
