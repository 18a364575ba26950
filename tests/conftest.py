import platform

import numpy
import pytest
import scipy
import torch
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
    loss_fn = make_loss_fn(model, torch.nn.functional.cross_entropy)
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
