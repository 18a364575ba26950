import platform

import numpy
import pytest
import scipy
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers

import curvlab
from curvlab import make_loss_fn
from curvlab.data.shards import write_shard
from tests.reference import MLP, TinyTransformer, perturb_norms


@pytest.fixture(scope="session")
def mlp_problem():
    torch.manual_seed(0)
    model = MLP().double()
    x = torch.randn(9, 5, dtype=torch.float64)
    y = torch.randint(0, 3, (9,))
    loss_fn = make_loss_fn(model, criterion=torch.nn.functional.cross_entropy)
    params = {k: v.detach() for k, v in model.named_parameters()}
    return loss_fn, params, (x, y)


@pytest.fixture(scope="session")
def transformer_problem():
    torch.manual_seed(0)
    model = TinyTransformer().double()
    perturb_norms(model)
    model.train()  # dropout layers are on: curvature code must switch them off itself
    idx = torch.randint(0, 11, (3, 6))
    tgt = torch.randint(0, 11, (3, 6))
    loss_fn = make_loss_fn(model)
    params = {k: v.detach() for k, v in model.named_parameters()}
    return loss_fn, params, (idx, tgt)


def random_direction(params, seed=1, dtype=None):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g, dtype=dtype or v.dtype) for k, v in params.items()}


@pytest.fixture(scope="session")
def pcfg_data(tmp_path_factory):
    """A small Zipf-PCFG data directory (s = 1 train, s = 0 validation), generated once."""
    from curvlab.data.dataset import generate_pcfg_dataset

    out = tmp_path_factory.mktemp("data") / "s1"
    generate_pcfg_dataset(out, s=1.0, tokens="200k", val_tokens="20k", progress=False)
    return out


SMALL_MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32}


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


TRAINER_VOCAB = 50


@pytest.fixture(scope="session")
def trainer_checkpoint(tmp_path_factory):
    """A real Trainer checkpoint (tiny GPT-2, 2 AdamW steps) and a data directory for its next batch."""
    out = tmp_path_factory.mktemp("trainer")
    torch.manual_seed(0)
    ids = torch.randint(1, TRAINER_VOCAB, (16, 8), generator=torch.Generator().manual_seed(0))
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-3, save_steps=2,
        lr_scheduler_type="constant", report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
    )  # fmt: skip
    config = transformers.GPT2Config(vocab_size=TRAINER_VOCAB, n_positions=8, n_embd=16, n_layer=1, n_head=2)
    data = [{"input_ids": x, "labels": x} for x in ids]
    transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=data).train()
    rng = numpy.random.default_rng(0)
    write_shard(out / "data" / "train_000000.bin", rng.integers(0, TRAINER_VOCAB, 4000))
    write_shard(out / "data" / "val_000000.bin", rng.integers(0, TRAINER_VOCAB, 2000))
    return out / "checkpoint-2", out / "data"


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
