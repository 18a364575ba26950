"""Independent references for the tests: dense Hessians from double-backward rows, in float64.

Deliberately *not* ``torch.func.hessian`` (wrong through an affine nn.LayerNorm on torch 2.13) and
not curvlab's exact_second_order mode: the native LayerNorm kernel's double backward is exact, and
attention is pinned to the math backend directly.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.modules.batchnorm import _NormBase

from curvlab.engine import params as param_dicts


def deterministic(loss_fn):
    """The same loss on a copy of the model with dropout off, independently of curvlab: every module
    leaves training mode except batch and instance norms, which keep their batch statistics."""
    model = getattr(loss_fn, "model", None)
    if model is None or not model.training:
        return loss_fn
    same = copy.copy(loss_fn)  # (every setting kept: criterion, shift, ignore_index, tie_weights)
    same.model = copy.deepcopy(model)
    for m in same.model.modules():
        if not isinstance(m, _NormBase):
            m.training = False
    return same


_CACHE: dict = {}
_CACHE_SIZE = 4


def dense_hessian(loss_fn, params, batch) -> torch.Tensor:
    """The full Hessian of ``loss_fn`` at ``params`` (flattened in key order), row by row.

    Cached per (loss_fn, parameter tensors, batch) identity for the last few problems (the session
    fixtures alternate between problems); each entry keeps its objects alive so that an id can't be
    reused by a different object while it is cached.
    """
    key = (id(loss_fn), id(batch), *(id(t) for t in params.values()))
    if key not in _CACHE:
        if len(_CACHE) >= _CACHE_SIZE:
            del _CACHE[next(iter(_CACHE))]
        _CACHE[key] = (_dense_hessian(loss_fn, params, batch), (loss_fn, batch, list(params.values())))
    return _CACHE[key][0]


def _dense_hessian(loss_fn, params, batch) -> torch.Tensor:
    loss_fn = deterministic(loss_fn)
    flat = param_dicts.flatten(params).detach().double().clone().requires_grad_()
    with sdpa_kernel(SDPBackend.MATH), torch.enable_grad():
        loss = loss_fn(param_dicts.unflatten(flat, {k: v.double() for k, v in params.items()}), batch)
        (g,) = torch.autograd.grad(loss, flat, create_graph=True)
        eye = torch.eye(flat.numel(), dtype=torch.float64)
        rows = [torch.autograd.grad(g, flat, e, retain_graph=True)[0] for e in eye]
    return torch.stack(rows)


def dense_gradient(loss_fn, params, batch) -> torch.Tensor:
    loss_fn = deterministic(loss_fn)
    flat = param_dicts.flatten(params).detach().double().clone().requires_grad_()
    with sdpa_kernel(SDPBackend.MATH), torch.enable_grad():
        loss = loss_fn(param_dicts.unflatten(flat, {k: v.double() for k, v in params.items()}), batch)
        (g,) = torch.autograd.grad(loss, flat)
    return g


class MLP(nn.Module):
    def __init__(self, d_in=5, d_hidden=7, d_out=3):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


ADAM_LR, ADAM_BETAS, ADAM_EPS = 0.05, (0.9, 0.999), 1e-8  # adam_trained_mlp's


def adam_trained_mlp(steps=3, seed=0, *, optimizer=torch.optim.Adam, width=7, group_lrs=None, **options):
    """A float64 MLP after ``steps`` full-batch steps of ``optimizer`` (torch's Adam; ``options`` such as
    ``weight_decay`` or ``amsgrad``) at :data:`ADAM_LR`, :data:`ADAM_BETAS`, :data:`ADAM_EPS` (``group_lrs``:
    fc1 and fc2 in two param groups at these lrs): its model, optimizer, loss function, parameters and batch."""
    from curvlab.engine.loss import make_loss_fn

    torch.manual_seed(seed)
    model = MLP(d_hidden=width).double()
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(9, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (9,), generator=g)
    params = model.parameters()
    if group_lrs is not None:
        params = [{"params": list(m.parameters()), "lr": lr} for m, lr in zip((model.fc1, model.fc2), group_lrs)]
    opt = optimizer(params, lr=ADAM_LR, betas=ADAM_BETAS, eps=ADAM_EPS, **options)
    for _ in range(steps):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return model, opt, make_loss_fn(model, criterion=F.cross_entropy), params, (x, y)


class TinyBlock(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(d)
        self.attn_qkv = nn.Linear(d, 3 * d)
        self.attn_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp_fc = nn.Linear(d, 2 * d)
        self.mlp_proj = nn.Linear(2 * d, d)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.attn_qkv(self.ln_1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        drop = 0.5 if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.drop(self.mlp_proj(F.gelu(self.mlp_fc(self.ln_2(x)))))


class TinyTransformer(nn.Module):
    """A 2-layer causal transformer with LayerNorm, GELU, softmax attention (and dropout layers,
    which curvature computations must switch off)."""

    def __init__(self, vocab=11, d=8, heads=2, layers=2, seq=6):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.h = nn.ModuleList(TinyBlock(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1])
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def perturb_norms(model: nn.Module, seed: int = 0) -> None:
    """Give LayerNorm weights and biases non-trivial values (the affine case is where bugs hide)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.add_(0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.add_(0.3 * torch.randn(m.bias.shape, generator=g))


def assert_same(a, b) -> None:
    """Nested state (tensors, dicts, lists, numbers) equal bit for bit; NaN equals NaN."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b or (isinstance(a, float) and a != a and b != b)


def double_backward(f, params, batch, directions):
    """(L, G, [H v for v in directions]) by plain autograd double backward, in float64, math attention:
    the reference for a loss ``f(params, batch)`` written from the logits."""
    leaves = {k: t.detach().double().clone().requires_grad_() for k, t in params.items()}
    with sdpa_kernel(SDPBackend.MATH), torch.enable_grad():
        loss = f(leaves, batch)
        g = torch.autograd.grad(loss, list(leaves.values()), create_graph=True)
        hvs = []
        for v in directions:
            gv = sum((gi * v[k]).sum() for gi, k in zip(g, leaves))
            hvs.append(dict(zip(leaves, torch.autograd.grad(gv, list(leaves.values()), retain_graph=True))))
    return float(loss.detach()), {k: t.detach() for k, t in zip(leaves, g)}, hvs
