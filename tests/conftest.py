"""The fixtures the tests share (what they build is in ``tests/builders.py``, which tests import)."""

import pytest
import torch

from curvlab import make_loss_fn
from tests.builders import hf_trainer, tiny_gpt2, token_data, write_token_shards
from tests.reference import MLP, TinyTransformer, perturb_norms

TRAINER_VOCAB = 50


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


@pytest.fixture(scope="session")
def pcfg_data(tmp_path_factory):
    """A small Zipf-PCFG data directory (s = 1 train, s = 0 validation), generated once."""
    from curvlab.data.dataset import generate_pcfg_dataset

    out = tmp_path_factory.mktemp("data") / "s1"
    generate_pcfg_dataset(out, s=1.0, tokens="200k", val_tokens="20k", progress=False)
    return out


@pytest.fixture(scope="session")
def trainer_checkpoint(tmp_path_factory):
    """A real Trainer checkpoint (tiny GPT-2, 2 AdamW steps) and a data directory for its next batch."""
    out = tmp_path_factory.mktemp("trainer")
    torch.manual_seed(0)
    ids = torch.randint(1, TRAINER_VOCAB, (16, 8), generator=torch.Generator().manual_seed(0))
    model = tiny_gpt2(TRAINER_VOCAB, positions=8, n_embd=16, n_layer=1)
    hf_trainer(
        model, out, token_data(ids), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-3, save_steps=2,
        lr_scheduler_type="constant", seed=0,
    ).train()  # fmt: skip
    return out / "checkpoint-2", write_token_shards(out / "data", TRAINER_VOCAB)
