import pytest
import torch

from curvlab import make_loss_fn
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
