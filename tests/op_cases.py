"""The op sweep's cases: torch's ops with derivative formulas of their own, each with one choice of its
optional arguments and modes, over named float64 inputs (``tests/op_sweep.py`` checks them).

A case is checked with all its inputs differentiated together and with each alone (the others held
constant: torch's backward formulas take other paths then); a module case, with its input, with its
parameters, and with both. A case whose gradient is by design not the function's derivative
(``padding_idx``, ``scale_grad_by_freq``) names a ``reference`` function: the same values, torch's
true gradient.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

DT = torch.float64


@dataclass(frozen=True)
class Case:
    """One op with one choice of its options: ``op(**inputs)``, every input differentiable."""

    family: str
    name: str
    op: Callable[..., object]
    inputs: dict[str, Tensor]
    reference: Callable[..., object] | None = None  # the same values, where torch's gradient isn't f's derivative
    subsets: tuple[tuple[str, ...], ...] = field(default=())

    def differentiated(self) -> list[tuple[str, ...]]:
        """All inputs together, then each alone (one subset if there is one input)."""
        if self.subsets:
            return list(self.subsets)
        keys = tuple(self.inputs)
        return [keys] + ([(k,) for k in keys] if len(keys) > 1 else [])


def _r(*shape: int) -> Tensor:
    return torch.randn(*shape, dtype=DT)


def grid(**options) -> Iterator[dict]:
    """Every combination of the options' values."""
    keys = list(options)
    for values in itertools.product(*(options[k] for k in keys)):
        yield dict(zip(keys, values))


def label(options: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in options.items())


# ----------------------------------------------------------------------------------------------- norms


def norm_cases() -> Iterator[Case]:
    for o in grid(shape=[(5,), (4, 5)], affine=["none", "weight", "bias", "both"]):
        x = _r(3, 4, 5)
        inputs = {"x": x} | _affine_inputs(o["affine"], o["shape"])
        yield Case("norms", f"layer_norm[{label(o)}]", _layer_norm(o["shape"]), inputs)
    for o in grid(shape=[(5,), (4, 5)], weight=[False, True], eps=[None, 1e-3]):
        inputs = {"x": _r(3, 4, 5)} | ({"weight": _r(*o["shape"])} if o["weight"] else {})
        yield Case("norms", f"rms_norm[{label(o)}]", _rms_norm(o["shape"], o["eps"]), inputs)
    for o in grid(groups=[1, 2, 4], affine=["none", "weight", "bias", "both"]):
        inputs = {"x": _r(3, 4, 5)} | _affine_inputs(o["affine"], (4,))
        # (a bias without a weight: torch's own first derivative fails, so the reference is the same sum)
        ref = _group_norm_bias_apart(o["groups"]) if o["affine"] == "bias" else None
        yield Case("norms", f"group_norm[{label(o)}]", _group_norm(o["groups"]), inputs, ref)
    for o in grid(training=[True, False], running=[True, False], affine=["none", "weight", "bias", "both"]):
        if not (o["training"] or o["running"]):
            continue  # torch needs running statistics in eval mode
        inputs = {"x": _r(4, 3, 5)} | _affine_inputs(o["affine"], (3,))
        yield Case("norms", f"batch_norm[{label(o)}]", _batch_norm(o["training"], o["running"], F.batch_norm), inputs)
    for o in grid(use_input_stats=[True, False], affine=["none", "bias", "both"]):
        inputs = {"x": _r(4, 3, 5)} | _affine_inputs(o["affine"], (3,))
        op = _batch_norm(o["use_input_stats"], not o["use_input_stats"], F.instance_norm)
        yield Case("norms", f"instance_norm[{label(o)}]", op, inputs)
    for o in grid(size=[2, 3], beta=[0.75, 1.5]):
        yield Case(
            "norms",
            f"local_response_norm[{label(o)}]",
            lambda x, o=o: F.local_response_norm(x, o["size"], alpha=0.3, beta=o["beta"], k=1.5),
            {"x": _r(2, 4, 5)},
        )
    for p in (1.5, 2.0, 3.0):
        yield Case("norms", f"normalize[p={p}]", lambda x, p=p: F.normalize(x, p=p, dim=1), {"x": _r(3, 4)})


def _affine_inputs(affine: str, shape: tuple[int, ...]) -> dict[str, Tensor]:
    weight = {"weight": 1 + 0.3 * _r(*shape)} if affine in ("weight", "both") else {}
    return weight | ({"bias": _r(*shape)} if affine in ("bias", "both") else {})


def _layer_norm(shape):
    return lambda x, weight=None, bias=None: F.layer_norm(x, shape, weight, bias, eps=1e-3)


def _rms_norm(shape, eps):
    return lambda x, weight=None: F.rms_norm(x, shape, weight, eps=eps)


def _group_norm(groups):
    return lambda x, weight=None, bias=None: F.group_norm(x, groups, weight, bias, eps=1e-3)


def _group_norm_bias_apart(groups):
    return lambda x, bias: F.group_norm(x, groups, None, None, eps=1e-3) + bias.view(1, -1, 1)


def _batch_norm(batch_stats: bool, running: bool, fn):
    mean, var = 0.3 * torch.randn(3, dtype=DT), torch.rand(3, dtype=DT) + 0.5

    def op(x, weight=None, bias=None):
        stats = (mean.clone(), var.clone()) if running else (None, None)  # (torch updates them in place)
        return fn(x, *stats, weight, bias, batch_stats, 0.1, 1e-3)

    return op


# ---------------------------------------------------------------------------------- weight parametrizations


def parametrization_cases() -> Iterator[Case]:
    for o in grid(shape=[(4, 3), (4, 3, 2)], dim=[0, 1, -1]):
        if o["dim"] == 1 and len(o["shape"]) == 2:
            g_shape = (1, 3)
        else:
            g_shape = tuple(s if i == o["dim"] else 1 for i, s in enumerate(o["shape"])) if o["dim"] != -1 else ()
        v, g = _r(*o["shape"]), 0.5 + torch.rand(g_shape or (1,) * len(o["shape"]), dtype=DT)
        yield Case("parametrizations", f"_weight_norm[{label(o)}]", _weight_norm(o["dim"]), {"v": v, "g": g})
    yield from module_cases(
        "parametrizations",
        {
            "weight_norm (parametrization)": lambda: nn.utils.parametrizations.weight_norm(nn.Linear(3, 4)),
            "weight_norm (parametrization, dim=1)": lambda: nn.utils.parametrizations.weight_norm(
                nn.Linear(3, 4), dim=1
            ),
            "weight_norm (hook)": lambda: nn.utils.weight_norm(nn.Linear(3, 4)),
            "weight_norm (conv1d)": lambda: nn.utils.parametrizations.weight_norm(nn.Conv1d(2, 3, 3)),
            "spectral_norm (parametrization)": lambda: nn.utils.parametrizations.spectral_norm(nn.Linear(3, 4)).eval(),
            "spectral_norm (hook)": lambda: nn.utils.spectral_norm(nn.Linear(3, 4)).eval(),
            **{
                f"orthogonal[{m}]": lambda m=m: nn.utils.parametrizations.orthogonal(nn.Linear(3, 3), orthogonal_map=m)
                for m in ("matrix_exp", "cayley", "householder")
            },
        },
        lambda m: _r(2, 2, 5) if isinstance(m, nn.Conv1d) else _r(2, 3),
    )


def _weight_norm(dim):
    return lambda v, g: torch._weight_norm(v, g, dim)


# ------------------------------------------------------------------------------------------- embeddings


def embedding_cases() -> Iterator[Case]:
    idx = torch.tensor([[0, 2, 2, 4], [1, 2, 0, 0]])
    for o in grid(padding_idx=[None, 0, 2], scale_grad_by_freq=[False, True]):
        op = lambda weight, o=o: torch.tanh(F.embedding(idx, weight, **o))  # noqa: E731
        ref = lambda weight: torch.tanh(F.embedding(idx, weight))  # noqa: E731
        by_design = o["padding_idx"] is not None or o["scale_grad_by_freq"]
        yield Case("embeddings", f"embedding[{label(o)}]", op, {"weight": _r(5, 3)}, ref if by_design else None)
    for name, op in (("embedding", lambda weight: F.embedding(idx, weight, max_norm=1.0)),
                     ("embedding_bag", lambda weight: F.embedding_bag(idx, weight, max_norm=1.0))):  # fmt: skip
        yield Case("embeddings", f"{name}[max_norm=1.0]", op, {"weight": _r(5, 3)})
    flat, offsets = torch.tensor([0, 2, 2, 4, 1, 3, 0]), torch.tensor([0, 3, 3, 5])
    for o in grid(
        mode=["sum", "mean", "max"],
        per_sample=[False, True],
        padding_idx=[None, 2],
        include_last_offset=[False, True],
        two_d=[False, True],
    ):
        if o["per_sample"] and o["mode"] != "sum":
            continue  # torch: per_sample_weights only with mode 'sum'
        if o["two_d"] and o["include_last_offset"]:
            continue  # (offsets only for 1-D input)
        yield _embedding_bag_case(o, flat, offsets)


def _embedding_bag_case(o: dict, flat: Tensor, offsets: Tensor) -> Case:
    inp = flat[:6].view(2, 3) if o["two_d"] else flat
    offs = None if o["two_d"] else (torch.cat([offsets, torch.tensor([7])]) if o["include_last_offset"] else offsets)
    kw = dict(mode=o["mode"], padding_idx=o["padding_idx"], include_last_offset=o["include_last_offset"])

    def op(weight, per_sample_weights=None):
        return F.embedding_bag(inp, weight, offs, per_sample_weights=per_sample_weights, **kw)

    inputs = {"weight": _r(5, 3)} | ({"per_sample_weights": _r(*inp.shape)} if o["per_sample"] else {})
    return Case("embeddings", f"embedding_bag[{label(o)}]", op, inputs)


# ------------------------------------------------------------------------------------------- attention


def attention_cases() -> Iterator[Case]:
    for o in grid(mask=["none", "bool", "float"], is_causal=[False, True], scale=[None, 0.4], gqa=[False, True]):
        if o["mask"] != "none" and o["is_causal"]:
            continue  # torch: a mask and is_causal together are refused
        mask = {"none": None, "bool": torch.rand(4, 4) > 0.3, "float": torch.randn(4, 4, dtype=DT)}[o["mask"]]
        if mask is not None and mask.dtype == torch.bool:
            mask[:, 0] = True  # no row fully masked
        heads_kv = 1 if o["gqa"] else 2

        def op(q, k, v, o=o, mask=mask):
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=o["is_causal"], scale=o["scale"], enable_gqa=o["gqa"]
            )

        inputs = {"q": _r(2, 2, 4, 3), "k": _r(2, heads_kv, 4, 3), "v": _r(2, heads_kv, 4, 3)}
        yield Case("attention", f"scaled_dot_product_attention[{label(o)}]", op, inputs)
    yield from module_cases(
        "attention",
        {
            "MultiheadAttention": lambda: nn.MultiheadAttention(4, 2, batch_first=True),
            "MultiheadAttention[bias_kv,kdim]": lambda: nn.MultiheadAttention(
                4, 2, batch_first=True, add_bias_kv=True, kdim=3, vdim=3
            ),
            "TransformerEncoderLayer": lambda: nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True),
            "TransformerEncoderLayer[norm_first,gelu]": lambda: nn.TransformerEncoderLayer(
                4, 2, 8, dropout=0.0, batch_first=True, norm_first=True, activation="gelu"
            ),
        },
        lambda m: _r(2, 3, 4),
        call=lambda m, x: _mha_call(m, x) if isinstance(m, nn.MultiheadAttention) else m(x),
    )
    yield from module_cases(
        "recurrent",
        {
            "LSTM": lambda: nn.LSTM(3, 4, batch_first=True),
            "LSTM[bidirectional,proj_size]": lambda: nn.LSTM(3, 4, batch_first=True, bidirectional=True, proj_size=2),
            "GRU[2 layers]": lambda: nn.GRU(3, 4, num_layers=2, batch_first=True),
            "RNN[relu]": lambda: nn.RNN(3, 4, nonlinearity="relu", batch_first=True),
            "RNN[tanh,no bias]": lambda: nn.RNN(3, 4, bias=False, batch_first=True),
        },
        lambda m: _r(2, 3, 3),
        call=lambda m, x: m(x)[0],
    )


def _mha_call(m, x):
    if m.kdim == m.embed_dim:
        return m(x, x, x)[0]
    kv = x[..., : m.kdim]
    return m(x, kv, kv)[0]


class _Called(nn.Module):
    """``call(module, x)`` as a module's forward, so that its parameters can be swapped by functional_call."""

    def __init__(self, module: nn.Module, call):
        super().__init__()
        self.module, self.call = module, call

    def forward(self, x):
        return self.call(self.module, x)


def module_cases(family, modules: dict, make_input, *, call=None) -> Iterator[Case]:
    """A module (in float64, eval mode) as a function of its input ``x`` and its parameters ``p0, p1, ...``,
    differentiated in all together, in the input alone and in the parameters alone."""
    for name, make in modules.items():
        module = _Called(make(), call or (lambda m, x: m(x))).double().eval()
        names = [n for n, _ in module.named_parameters()]
        inputs = {"x": make_input(module.module)} | {
            f"p{i}": p.detach() + 0.1 * torch.randn_like(p) for i, (_, p) in enumerate(module.named_parameters())
        }  # (moved off their initial values: orthogonal's householder map starts on its .int() steps)

        def op(x, module=module, names=names, **ps):
            return functional_call(module, {n: ps[f"p{i}"] for i, n in enumerate(names) if f"p{i}" in ps}, (x,))

        keys = tuple(inputs)
        yield Case(family, name, op, inputs, subsets=(keys, ("x",), keys[1:]))


# ---------------------------------------------------------------------------------------- convolutions


def convolution_cases() -> Iterator[Case]:
    for dims in (1, 2, 3):
        conv = (F.conv1d, F.conv2d, F.conv3d)[dims - 1]
        options = grid(stride=[1, 2], padding=[0, 1, "same"], dilation=[1, 2], groups=[1, 2], bias=[False, True])
        for o in options:
            if o["padding"] == "same" and o["stride"] != 1:
                continue  # torch: 'same' needs stride 1
            if dims == 3 and (o["dilation"] == 2 or o["groups"] == 2):
                continue  # (3-D: a lighter grid; its kernels share the 1-D and 2-D paths' formulas)
            x, w = _r(2, 4, *(6,) * dims), _r(4, 4 // o["groups"], *(2,) * dims)
            inputs = {"x": x, "weight": w} | ({"bias": _r(4)} if o["bias"] else {})
            kw = {k: o[k] for k in ("stride", "padding", "dilation", "groups")}
            yield Case(
                "convolutions", f"conv{dims}d[{label(o)}]", lambda conv=conv, kw=kw, **t: conv(**_xwb(t), **kw), inputs
            )
        tconv = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[dims - 1]
        for o in grid(stride=[1, 2], padding=[0, 1], output_padding=[0, 1], groups=[1, 2], bias=[False, True]):
            if o["output_padding"] >= o["stride"] or (dims == 3 and o["groups"] == 2):
                continue
            x, w = _r(2, 4, *(4,) * dims), _r(4, 4 // o["groups"], *(2,) * dims)
            inputs = {"x": x, "weight": w} | ({"bias": _r(4 // o["groups"] * o["groups"])} if o["bias"] else {})
            kw = {k: o[k] for k in ("stride", "padding", "output_padding", "groups")}
            yield Case(
                "convolutions",
                f"conv_transpose{dims}d[{label(o)}]",
                lambda tconv=tconv, kw=kw, **t: tconv(**_xwb(t), **kw),
                inputs,
            )
    for dims, mode in itertools.product((1, 2, 3), ("constant", "reflect", "replicate", "circular")):
        pad = (1, 2) * dims
        yield Case(
            "convolutions",
            f"pad[{dims}d,{mode}]",
            lambda x, pad=pad, mode=mode: F.pad(x, pad, mode=mode),
            {"x": _r(2, 2, *(4,) * dims)},
        )
    for o in grid(kernel=[2, 3], stride=[1, 2], dilation=[1, 2], padding=[0, 1]):
        yield Case(
            "convolutions",
            f"unfold[{label(o)}]",
            lambda x, o=o: F.unfold(x, o["kernel"], o["dilation"], o["padding"], o["stride"]),
            {"x": _r(2, 2, 6, 6)},
        )
    yield Case("convolutions", "fold", lambda x: F.fold(x, (4, 4), 2), {"x": _r(2, 8, 9)})


def _xwb(t: dict) -> dict:
    return {"input": t["x"], "weight": t["weight"], "bias": t.get("bias")}


# -------------------------------------------------------------------------------------------- pooling


def pooling_cases() -> Iterator[Case]:
    for dims in (1, 2, 3):
        shape = (2, 2, *(5,) * dims)
        maxpool = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[dims - 1]
        for o in grid(stride=[1, 2], padding=[0, 1], dilation=[1, 2], ceil_mode=[False, True]):
            op = lambda x, o=o, f=maxpool: f(x, 2, **o)  # noqa: E731
            yield Case("pooling", f"max_pool{dims}d[{label(o)}]", op, {"x": _r(*shape)})
        avgpool = (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)[dims - 1]
        for o in grid(padding=[0, 1], ceil_mode=[False, True], count_include_pad=[False, True], divisor=[None, 3]):
            if dims == 1 and o["divisor"] is not None:
                continue  # (avg_pool1d has no divisor_override)
            kw = {k: o[k] for k in ("padding", "ceil_mode", "count_include_pad")}
            kw |= {"divisor_override": o["divisor"]} if dims > 1 else {}
            op = lambda x, kw=kw, f=avgpool: f(x, 2, 2, **kw)  # noqa: E731
            yield Case("pooling", f"avg_pool{dims}d[{label(o)}]", op, {"x": _r(*shape)})
        for kind, f in (("avg", (F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d)[dims - 1]),
                        ("max", (F.adaptive_max_pool1d, F.adaptive_max_pool2d, F.adaptive_max_pool3d)[dims - 1])):  # fmt: skip
            yield Case("pooling", f"adaptive_{kind}_pool{dims}d", lambda x, f=f: f(x, 3), {"x": _r(*shape)})
        lp = (F.lp_pool1d, F.lp_pool2d, F.lp_pool3d)[dims - 1]
        for p in (1.0, 2.0, 3.0):
            op = lambda x, f=lp, p=p: f(x.abs() + 0.1, p, 2)  # noqa: E731
            yield Case("pooling", f"lp_pool{dims}d[p={p}]", op, {"x": _r(*shape)})
        unpool = (F.max_unpool1d, F.max_unpool2d, F.max_unpool3d)[dims - 1]
        x0 = _r(*shape)
        _, indices = maxpool(x0, 2, return_indices=True)
        op = lambda x, f=unpool, i=indices, size=shape[2:]: f(x, i, 2, output_size=size)  # noqa: E731
        yield Case("pooling", f"max_unpool{dims}d", op, {"x": _r(*indices.shape)})
    for dims in (2, 3):
        f = (F.fractional_max_pool2d, F.fractional_max_pool3d)[dims - 2]
        samples = torch.rand(2, 2, dims, dtype=DT)  # the random draws, fixed: the op is then a function
        op = lambda x, f=f, s=samples: f(x, 2, output_size=3, _random_samples=s)  # noqa: E731
        yield Case("pooling", f"fractional_max_pool{dims}d", op, {"x": _r(2, 2, *(6,) * dims)})
    yield Case("pooling", "pixel_shuffle", lambda x: F.pixel_shuffle(x, 2), {"x": _r(1, 4, 2, 3)})
    yield Case("pooling", "pixel_unshuffle", lambda x: F.pixel_unshuffle(x, 2), {"x": _r(1, 1, 4, 4)})


# -------------------------------------------------------------------------------------- interpolation


def interpolation_cases() -> Iterator[Case]:
    shapes = {"nearest": 4, "nearest-exact": 4, "area": 4, "linear": 3, "bilinear": 4, "bicubic": 4, "trilinear": 5}
    for mode, ndim in shapes.items():
        aligned = [None] if mode in ("nearest", "nearest-exact", "area") else [False, True]
        antialias = [False, True] if mode in ("bilinear", "bicubic") else [False]
        for o in grid(align_corners=aligned, antialias=antialias, by=["size", "scale"]):
            size = {"size": (7,) * (ndim - 2)} if o["by"] == "size" else {"scale_factor": 1.7}
            kw = size | {"align_corners": o["align_corners"], "antialias": o["antialias"]}
            op = lambda x, mode=mode, kw=kw: F.interpolate(x, mode=mode, **kw)  # noqa: E731
            yield Case("interpolation", f"interpolate[{mode},{label(o)}]", op, {"x": _r(2, 2, *(4,) * (ndim - 2))})
    for o in grid(mode=["bilinear", "nearest", "bicubic"], padding_mode=["zeros", "border", "reflection"],
                  align_corners=[False, True], dims=[2, 3]):  # fmt: skip
        if o["dims"] == 3 and o["mode"] == "bicubic":
            continue  # torch: bicubic is 2-D only
        d = o["dims"]
        kw = {k: o[k] for k in ("mode", "padding_mode", "align_corners")}
        inputs = {"x": _r(1, 2, *(4,) * d), "grid": 1.1 * torch.rand(1, *(3,) * d, d, dtype=DT) * 2 - 1.1}
        yield Case(
            "interpolation", f"grid_sample[{label(o)}]", lambda x, grid, kw=kw: F.grid_sample(x, grid, **kw), inputs
        )
    for align in (False, True):
        op = lambda theta, a=align: F.affine_grid(theta, [1, 1, 3, 4], align_corners=a)  # noqa: E731
        yield Case("interpolation", f"affine_grid[align_corners={align}]", op, {"theta": _r(1, 2, 3)})


# --------------------------------------------------------------------------------------------- losses


def loss_cases() -> Iterator[Case]:
    yield from _classification_losses()
    yield from _regression_losses()
    yield from _pair_losses()
    classes = torch.tensor([[1, 2, 1], [3, 1, 1]])
    for reduction in ("mean", "sum", "none"):
        op = lambda logits, r=reduction: F.ctc_loss(  # noqa: E731
            logits.log_softmax(-1), classes, [5, 5], [3, 2], reduction=r
        )
        yield Case("losses", f"ctc_loss[reduction={reduction}]", op, {"logits": _r(5, 2, 4)})


def _classification_losses() -> Iterator[Case]:
    target = torch.tensor([0, 2, 1, 2])
    for o in grid(weight=[False, True], ignore_index=[-100, 1], reduction=["mean", "sum", "none"],
                  label_smoothing=[0.0, 0.2], spatial=[False, True]):  # fmt: skip
        t = target.view(2, 2) if o["spatial"] else target
        kw = {"ignore_index": o["ignore_index"], "reduction": o["reduction"], "label_smoothing": o["label_smoothing"]}
        kw |= {"weight": torch.rand(3, dtype=DT) + 0.5} if o["weight"] else {}
        shape = (2, 3, 2) if o["spatial"] else (4, 3)
        op = lambda logits, t=t, kw=kw: F.cross_entropy(logits, t, **kw)  # noqa: E731
        yield Case("losses", f"cross_entropy[indices,{label(o)}]", op, {"logits": _r(*shape)})
    for o in grid(reduction=["mean", "sum", "none"], label_smoothing=[0.0, 0.2]):
        op = lambda logits, probs, o=o: F.cross_entropy(logits, probs.softmax(-1), **o)  # noqa: E731
        yield Case("losses", f"cross_entropy[probabilities,{label(o)}]", op, {"logits": _r(4, 3), "probs": _r(4, 3)})
    for o in grid(
        weight=[False, True], ignore_index=[-100, 1], reduction=["mean", "sum", "none"], spatial=[False, True]
    ):
        t = target.view(2, 2) if o["spatial"] else target
        kw = {"ignore_index": o["ignore_index"], "reduction": o["reduction"]}
        kw |= {"weight": torch.rand(3, dtype=DT) + 0.5} if o["weight"] else {}
        shape = (2, 3, 2) if o["spatial"] else (4, 3)
        yield Case("losses", f"nll_loss[{label(o)}]", lambda x, t=t, kw=kw: F.nll_loss(x, t, **kw), {"x": _r(*shape)})
    for o in grid(weight=[False, True], reduction=["mean", "none"]):
        kw = {"reduction": o["reduction"]} | ({"weight": torch.rand(4, 3, dtype=DT)} if o["weight"] else {})
        op = lambda x, y, kw=kw: F.binary_cross_entropy(torch.sigmoid(x), torch.sigmoid(y), **kw)  # noqa: E731
        yield Case("losses", f"binary_cross_entropy[{label(o)}]", op, {"x": _r(4, 3), "y": _r(4, 3)})
    for o in grid(weight=[False, True], pos_weight=[False, True], reduction=["mean", "none"]):
        kw = {"reduction": o["reduction"]} | ({"weight": torch.rand(4, 3, dtype=DT)} if o["weight"] else {})
        kw |= {"pos_weight": torch.rand(3, dtype=DT) + 0.5} if o["pos_weight"] else {}
        op = lambda x, y, kw=kw: F.binary_cross_entropy_with_logits(x, torch.sigmoid(y), **kw)  # noqa: E731
        yield Case("losses", f"binary_cross_entropy_with_logits[{label(o)}]", op, {"x": _r(4, 3), "y": _r(4, 3)})
    multi = torch.tensor([[0, 2, -1], [1, -1, 0]])
    for o in grid(p=[1, 2], margin=[1.0, 0.5], weight=[False, True]):
        kw = {"p": o["p"], "margin": o["margin"]} | ({"weight": torch.rand(3, dtype=DT)} if o["weight"] else {})
        op = lambda x, kw=kw: F.multi_margin_loss(x, target, **kw)  # noqa: E731
        yield Case("losses", f"multi_margin_loss[{label(o)}]", op, {"x": _r(4, 3)})
    yield Case("losses", "multilabel_margin_loss", lambda x: F.multilabel_margin_loss(x, multi), {"x": _r(2, 3)})
    repeated = torch.tensor([[0, 0, -1], [1, 2, 1]])  # (torch counts a listed class as often as it is listed)
    op = lambda x: F.multilabel_margin_loss(x, repeated)  # noqa: E731
    yield Case("losses", "multilabel_margin_loss[repeated targets]", op, {"x": _r(2, 3)})
    labels = (torch.rand(4, 3) > 0.5).double()
    yield from _legacy_reductions(target, multi, labels)
    yield Case(
        "losses", "multilabel_soft_margin_loss", lambda x: F.multilabel_soft_margin_loss(x, labels), {"x": _r(4, 3)}
    )
    yield Case("losses", "soft_margin_loss", lambda x: F.soft_margin_loss(x, 2 * labels - 1), {"x": _r(4, 3)})


def _legacy_reductions(target: Tensor, multi: Tensor, labels: Tensor) -> Iterator[Case]:
    """The losses curvlab reroutes, with torch's legacy ``size_average`` and ``reduce`` arguments."""
    losses = {
        "mse_loss": lambda x, **kw: F.mse_loss(x, labels, **kw),
        "soft_margin_loss": lambda x, **kw: F.soft_margin_loss(x, 2 * labels - 1, **kw),
        "multi_margin_loss": lambda x, **kw: F.multi_margin_loss(x, target, **kw),
        "multilabel_margin_loss": lambda x, **kw: F.multilabel_margin_loss(x[:2], multi, **kw),
        "binary_cross_entropy_with_logits": lambda x, **kw: F.binary_cross_entropy_with_logits(x, labels, **kw),
    }
    for (name, f), o in itertools.product(losses.items(), grid(size_average=[False, True], reduce=[None, False])):
        yield Case("losses", f"{name}[{label(o)}]", lambda x, f=f, o=o: f(x, **o), {"x": _r(4, 3)})


def _regression_losses() -> Iterator[Case]:
    for reduction in ("mean", "sum", "none"):
        weight = torch.rand(4, 3, dtype=DT) + 0.5
        op = lambda x, y, w=weight, r=reduction: F.mse_loss(x, y, reduction=r, weight=w)  # noqa: E731
        yield Case("losses", f"mse_loss[{reduction},weight]", op, _xy())
        for name, f in (("mse_loss", F.mse_loss), ("l1_loss", F.l1_loss)):
            yield Case("losses", f"{name}[{reduction}]", lambda x, y, f=f, r=reduction: f(x, y, reduction=r), _xy())
        for beta in (1.0, 0.5):
            op = lambda x, y, b=beta, r=reduction: F.smooth_l1_loss(x, y, reduction=r, beta=b)  # noqa: E731
            yield Case("losses", f"smooth_l1_loss[{reduction},beta={beta}]", op, _xy())
            op = lambda x, y, d=beta, r=reduction: F.huber_loss(x, y, reduction=r, delta=d)  # noqa: E731
            yield Case("losses", f"huber_loss[{reduction},delta={beta}]", op, _xy())
    for o in grid(log_target=[False, True], reduction=["batchmean", "sum", "none"]):
        op = lambda x, y, o=o: F.kl_div(x.log_softmax(-1), y.log_softmax(-1) if o["log_target"] else y.softmax(-1), **o)  # noqa: E731
        yield Case("losses", f"kl_div[{label(o)}]", op, _xy())
    for o in grid(log_input=[True, False], full=[False, True]):
        op = lambda x, y, o=o: F.poisson_nll_loss(x if o["log_input"] else x.exp(), y.exp(), **o)  # noqa: E731
        yield Case("losses", f"poisson_nll_loss[{label(o)}]", op, _xy())
    for o in grid(full=[False, True], var=["same", "one"]):
        shape = (4, 3) if o["var"] == "same" else (4, 1)
        op = lambda x, y, var, o=o: F.gaussian_nll_loss(x, y, var.exp(), full=o["full"])  # noqa: E731
        yield Case("losses", f"gaussian_nll_loss[{label(o)}]", op, _xy() | {"var": _r(*shape)})


def _xy() -> dict[str, Tensor]:
    return {"x": _r(4, 3), "y": _r(4, 3)}


def _pair_losses() -> Iterator[Case]:
    sign = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=DT)
    yield Case(
        "losses",
        "margin_ranking_loss",
        lambda a, b: F.margin_ranking_loss(a, b, sign, margin=0.3),
        {"a": _r(4), "b": _r(4)},
    )
    yield Case("losses", "hinge_embedding_loss", lambda x: F.hinge_embedding_loss(x, sign, margin=1.5), {"x": _r(4)})
    yield Case(
        "losses",
        "cosine_embedding_loss",
        lambda a, b: F.cosine_embedding_loss(a, b, sign, margin=0.2),
        {"a": _r(4, 3), "b": _r(4, 3)},
    )
    for o in grid(p=[1.0, 2.0, 3.0], swap=[False, True]):
        op = lambda a, p, n, o=o: F.triplet_margin_loss(a, p, n, margin=2.0, **o)  # noqa: E731
        yield Case("losses", f"triplet_margin_loss[{label(o)}]", op, {"a": _r(4, 3), "p": _r(4, 3), "n": _r(4, 3)})
    yield Case("losses", "cosine_similarity", lambda a, b: F.cosine_similarity(a, b), {"a": _r(4, 3), "b": _r(4, 3)})
    for p in (1.0, 2.0, 3.0, math.inf):
        yield Case(
            "losses",
            f"pairwise_distance[p={p}]",
            lambda a, b, p=p: F.pairwise_distance(a, b, p),
            {"a": _r(4, 3), "b": _r(4, 3)},
        )
        for mode in ("use_mm_for_euclid_dist_if_necessary", "donot_use_mm_for_euclid_dist"):
            op = lambda a, b, p=p, m=mode: torch.cdist(a, b, p, compute_mode=m)  # noqa: E731
            yield Case("losses", f"cdist[p={p},{mode}]", op, {"a": _r(2, 4, 3), "b": _r(2, 5, 3)})
        yield Case("losses", f"pdist[p={p}]", lambda a, p=p: F.pdist(a, p), {"a": _r(5, 3)})


# ---------------------------------------------------------------------------------------- activations


def activation_cases() -> Iterator[Case]:
    unary = {
        "gelu": F.gelu, "gelu[tanh]": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu, "mish": F.mish,
        "softplus": F.softplus, "softplus[beta=2,threshold=1]": lambda x: F.softplus(x, 2.0, 1.0),
        "elu": F.elu, "elu[alpha=0.5]": lambda x: F.elu(x, 0.5), "selu": F.selu, "celu[alpha=2]": lambda x: F.celu(x, 2.0),
        "leaky_relu": lambda x: F.leaky_relu(x, 0.1), "hardswish": F.hardswish, "hardsigmoid": F.hardsigmoid,
        "hardtanh": lambda x: F.hardtanh(x, -0.5, 0.7), "relu6": lambda x: F.relu6(3 * x), "relu": F.relu,
        "logsigmoid": F.logsigmoid, "softsign": F.softsign, "tanhshrink": F.tanhshrink,
        "softshrink": lambda x: F.softshrink(x, 0.3), "hardshrink": lambda x: F.hardshrink(x, 0.3),
        "threshold": lambda x: F.threshold(x, 0.2, -1.0), "sigmoid": torch.sigmoid, "tanh": torch.tanh,
        "rrelu[eval]": lambda x: F.rrelu(x, training=False), "log_softmax": lambda x: F.log_softmax(x, -1),
        "softmax": lambda x: F.softmax(x, 0), "softmin": lambda x: F.softmin(x, -1), "glu": lambda x: F.glu(x, -1),
        "glu[dim=0]": lambda x: F.glu(x, 0), "logsumexp": lambda x: torch.logsumexp(x, -1),
        "logcumsumexp": lambda x: torch.logcumsumexp(x, 0), "cumprod": lambda x: torch.cumprod(x, 1),
        "prod": lambda x: torch.prod(x, 1), "std": lambda x: x.std(0), "var[correction=0]": lambda x: x.var(0, correction=0),
        "erf": torch.erf, "erfinv": lambda x: torch.erfinv(0.9 * torch.tanh(x)), "lgamma": lambda x: torch.lgamma(x.abs() + 0.5),
        "digamma": lambda x: torch.digamma(x.abs() + 0.5), "atan2": lambda x: torch.atan2(x, x.flip(0)),
    }  # fmt: skip
    for name, f in unary.items():
        yield Case("activations", name, lambda x, f=f: f(x), {"x": _r(4, 6)})
    for channels in (1, 3):
        op = lambda x, weight: F.prelu(x, weight)  # noqa: E731
        yield Case(
            "activations",
            f"prelu[{channels} weights]",
            op,
            {"x": _r(4, 3, 2), "weight": 0.1 + 0.2 * torch.rand(channels, dtype=DT)},
        )


# -------------------------------------------------------------------------------------- linear algebra


def linalg_cases() -> Iterator[Case]:
    spd = lambda x: x @ x.mT + 3 * torch.eye(x.shape[-1], dtype=DT)  # noqa: E731
    sym = lambda x: x + x.mT  # noqa: E731
    ops = {
        "matrix_exp": lambda x: torch.linalg.matrix_exp(0.5 * x),
        "solve": lambda x, b: torch.linalg.solve(spd(x), b),
        "solve[left=False]": lambda x, b: torch.linalg.solve(spd(x), b.mT, left=False),
        "inv": lambda x: torch.linalg.inv(spd(x)),
        "cholesky": lambda x: torch.linalg.cholesky(spd(x)),
        "cholesky[upper]": lambda x: torch.linalg.cholesky(spd(x), upper=True),
        "eigh": lambda x: _gauge_free(*torch.linalg.eigh(sym(x))),
        "eigvalsh": lambda x: torch.linalg.eigvalsh(sym(x)),
        "svd": lambda x: _gauge_free(*torch.linalg.svd(x, full_matrices=False)),
        "svdvals": lambda x: torch.linalg.svdvals(x),
        "qr": lambda x: _gauge_free(*torch.linalg.qr(x)),
        "householder_product": lambda x, tau: torch.linalg.householder_product(x, tau),
        "det": lambda x: torch.linalg.det(x), "slogdet": lambda x: torch.linalg.slogdet(spd(x))[1],
        "logdet": lambda x: torch.logdet(spd(x)), "pinv": lambda x: torch.linalg.pinv(x),
        "matrix_power[3]": lambda x: torch.linalg.matrix_power(x, 3),
        "matrix_power[-2]": lambda x: torch.linalg.matrix_power(spd(x), -2),
        "cholesky_solve": lambda x, b: torch.cholesky_solve(b, torch.linalg.cholesky(spd(x))),
        "solve_triangular": lambda x, b: torch.linalg.solve_triangular(spd(x).tril(), b, upper=False),
        "lu_solve": lambda x, b: torch.linalg.lu_solve(*torch.linalg.lu_factor(spd(x)), b),
        "lstsq": lambda x, b: torch.linalg.lstsq(spd(x), b).solution,
        "cross": lambda x, b: torch.linalg.cross(x, torch.cat([b, b[:, :1]], 1)),
        # the aliases of the ops above (Tensor methods, LAPACK names, the _ex forms) and torch's vector rule
        "Tensor.det": lambda x: x.det(), "Tensor.logdet": lambda x: spd(x).logdet(),
        "Tensor.slogdet": lambda x: spd(x).slogdet()[1], "det[singular]": lambda x: torch.linalg.det(x),
        "orgqr": lambda x, tau: torch.orgqr(x, tau), "Tensor.orgqr": lambda x, tau: x.orgqr(tau),
        "solve_ex": lambda x, b: torch.linalg.solve_ex(spd(x), b).result,
        "solve[batch of A, one vector b]": lambda x, b: torch.linalg.solve(spd(x).expand(2, 3, 3), b[:, 0]),
    }  # fmt: skip
    for name, f in ops.items():
        inputs = {"x": _r(3, 3)}
        if "b" in f.__code__.co_varnames[: f.__code__.co_argcount]:
            inputs["b"] = _r(3, 2)
        if name == "det[singular]":
            inputs["x"][2] = inputs["x"][0]  # (det 0 at the point, not along the directions)
        if name in ("householder_product", "orgqr", "Tensor.orgqr"):
            inputs["tau"] = 0.5 * _r(2)
            inputs["x"] = _r(3, 2)
        yield Case("linalg", name, f, inputs)
    for order in ("fro", "nuc", 2, -2, 1, math.inf):
        yield Case(
            "linalg", f"matrix_norm[ord={order}]", lambda x, o=order: torch.linalg.matrix_norm(x, o), {"x": _r(3, 4)}
        )
    for order in (1, 2, 3, 0.5, math.inf, -math.inf):
        yield Case(
            "linalg",
            f"vector_norm[ord={order}]",
            lambda x, o=order: torch.linalg.vector_norm(x, o, dim=-1),
            {"x": _r(3, 4)},
        )
    for p in (1.0, 2.0, 3.0):
        yield Case("linalg", f"renorm[p={p}]", lambda x, p=p: torch.renorm(x, p, 0, 1.0), {"x": _r(3, 4)})
        yield Case("linalg", f"dist[p={p}]", lambda x, y, p=p: torch.dist(x, y, p), {"x": _r(3, 4), "y": _r(3, 4)})


def _gauge_free(values: Tensor, vectors: Tensor, *more: Tensor) -> tuple[Tensor, ...]:
    """A factorization's outputs without its sign gauge: the values and the squared entries."""
    return (values, vectors * vectors, *(m * m for m in more))


FAMILIES = {
    "norms": norm_cases,
    "parametrizations": parametrization_cases,
    "embeddings": embedding_cases,
    "attention": attention_cases,
    "convolutions": convolution_cases,
    "pooling": pooling_cases,
    "interpolation": interpolation_cases,
    "losses": loss_cases,
    "activations": activation_cases,
    "linalg": linalg_cases,
}
