"""The monitor on the clients users bring: its hidden scope on a Hugging Face ViT, its rows in the
Hugging Face Trainer's logs and in a Lightning run, and TensorBoard scalars from ``curvlab train``."""

import pytest
import torch

from curvlab.curvature import taylor_split
from curvlab.loss import make_loss_fn
from curvlab.monitor import SCOPE_KEYS, CurvatureMonitor


def tiny_vit():
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    config = ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, num_labels=3,
    )  # fmt: skip
    return ViTForImageClassification(config).eval()


def test_the_monitors_hidden_scope_is_taylor_splits_on_a_vit():
    model = tiny_vit()
    g = torch.Generator().manual_seed(0)
    batch = {"pixel_values": torch.randn(4, 3, 8, 8, generator=g), "labels": torch.tensor([0, 1, 2, 0])}
    loss_fn = make_loss_fn(model)
    params = {n: p.detach() for n, p in model.named_parameters()}
    z = {n: 1e-2 * torch.randn(p.shape, generator=g) for n, p in params.items()}
    monitor = CurvatureMonitor(model, None, loss_fn, batch)
    row = monitor.measure(0, params, z)
    ref = taylor_split(loss_fn, params, batch, z)
    assert row.hidden_names == ref.subset_names and "classifier.weight" not in row.hidden_names
    for k in SCOPE_KEYS:
        assert getattr(row.hidden, k) == pytest.approx(getattr(ref.subset, k), rel=1e-6), k
