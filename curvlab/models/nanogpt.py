"""Reading nanoGPT checkpoints (``ckpt.pt``) into curvlab's GPT, optimizer state included.

nanoGPT's checkpoint holds ``model_args`` (n_layer, n_head, n_embd, block_size, bias, vocab_size,
dropout), ``model`` (its state dict, possibly with torch.compile's ``_orig_mod.`` prefix), ``optimizer``
(an AdamW state dict), ``iter_num`` and ``config``. Two things differ from curvlab's GPT:

* attention fuses q, k, v into ``attn.c_attn`` (rows q, then k, then v); curvlab splits it into
  ``c_q``, ``c_k``, ``c_v``, and splits Adam's moments the same way (they are elementwise);
* the optimizer state is indexed by position in nanoGPT's two groups (decayed, then not): every
  parameter of dim >= 2 in ``named_parameters`` order, then every other one, as nanoGPT groups them
  since 2023; or, as minGPT and nanoGPT before it, the linear maps' weights, then the biases, norms and
  embeddings, each sorted by name (:func:`nanogpt_groupings`). The head is tied to ``wte``.

nanoGPT saves a checkpoint before the step of ``iter_num`` and after setting that step's learning
rate, so the saved group learning rates are those of the next step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from curvlab.errors import CurvlabError
from curvlab.models.gpt import GPT, GPTConfig
from curvlab.models.size import check_model_size

ATTN_SPLIT = ("c_q", "c_k", "c_v")


def is_nanogpt_checkpoint(ckpt: Any) -> bool:
    return isinstance(ckpt, dict) and "model_args" in ckpt and "model" in ckpt


SIZES = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")


def nanogpt_config(model_args: dict[str, Any]) -> GPTConfig:
    """curvlab's GPTConfig of nanoGPT's ``model_args``: every size a positive integer, ``dropout`` in [0, 1]."""
    if not isinstance(model_args, dict):
        raise CurvlabError(f"nanoGPT model_args is a {type(model_args).__name__}, not a dict")
    for key in SIZES:
        if key not in model_args:
            raise CurvlabError(f"nanoGPT model_args lack {key!r}")
        if type(model_args[key]) is not int or model_args[key] < 1:
            raise CurvlabError(f"nanoGPT model_args' {key} {model_args[key]!r:.40} is not a positive integer")
    dropout = model_args.get("dropout", 0.0)
    if type(dropout) not in (int, float) or not 0 <= dropout <= 1:
        raise CurvlabError(f"nanoGPT model_args' dropout {dropout!r:.40} is not a probability")
    sizes = {key: model_args[key] for key in SIZES}
    return GPTConfig(**sizes, dropout=float(dropout), bias=bool(model_args.get("bias", True)), tie_embeddings=True)


def check_fits_weights(cfg: GPTConfig, state: dict[str, Any]) -> None:
    """Raise ``CurvlabError`` unless ``state`` is a dict of tensors, and the model ``cfg`` describes is not
    far larger than them (:func:`curvlab.models.size.check_model_size`), before that model is built: a
    checkpoint of a few kilobytes whose model_args say ``n_embd=60000`` would otherwise allocate gigabytes
    before a shape is compared.

    The count is exact and costs no memory: models of no layer and of one, built on the meta device, give
    the embeddings' and a layer's parameters (and any ``n_layer`` takes constant time).
    """
    if not (isinstance(state, dict) and all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items())):
        raise CurvlabError("nanoGPT model is not a state dict (names -> tensors)")
    with torch.device("meta"):
        base, layer = (GPT(dataclasses.replace(cfg, n_layer=n)).num_parameters() for n in (0, 1))
    what = (
        f"nanoGPT model_args (n_layer={cfg.n_layer}, n_embd={cfg.n_embd}, vocab_size={cfg.vocab_size}, "
        f"block_size={cfg.block_size}) describe"
    )
    check_model_size(base + cfg.n_layer * (layer - base), sum(v.numel() for v in state.values()), what)


def nanogpt_parameter_names(cfg: GPTConfig) -> list[str]:
    """nanoGPT's ``named_parameters()`` order (the tied ``lm_head.weight`` is not listed again)."""

    def linear(prefix: str) -> list[str]:
        return [f"{prefix}.weight"] + ([f"{prefix}.bias"] if cfg.bias else [])

    names = ["transformer.wte.weight", "transformer.wpe.weight"]
    for i in range(cfg.n_layer):
        h = f"transformer.h.{i}"
        names += linear(f"{h}.ln_1") + linear(f"{h}.attn.c_attn") + linear(f"{h}.attn.c_proj")
        names += linear(f"{h}.ln_2") + linear(f"{h}.mlp.c_fc") + linear(f"{h}.mlp.c_proj")
    return names + linear("transformer.ln_f")


def nanogpt_groupings(cfg: GPTConfig) -> dict[str, list[list[str]]]:
    """The two ways nanoGPT has grouped its parameters for AdamW, (decayed, not decayed), by name: since
    2023 by dimension (every parameter of dim >= 2 decays, in ``named_parameters`` order); before, as
    minGPT, by module type (the weights of the linear maps decay; biases, norms and both embeddings
    don't), each group sorted by name."""
    names = nanogpt_parameter_names(cfg)
    matrix = [n for n in names if n.endswith(".weight") and ".ln_" not in n]  # (wte, wpe and the linear maps)
    linear = [n for n in matrix if n.startswith("transformer.h.")]
    return {
        "by dimension": [matrix, [n for n in names if n not in matrix]],
        "by module type": [sorted(linear), sorted(n for n in names if n not in linear)],
    }


def _saved_grouping(
    saved: dict[str, Any], groupings: dict[str, list[list[str]]], shapes: dict[str, tuple[int, ...]]
) -> list[list[str]]:
    """The grouping (:func:`nanogpt_groupings`) whose group sizes fit the saved optimizer state, and whose
    parameters' shapes (``shapes``, nanoGPT's names) fit its saved moments."""
    sizes = [len(g["params"]) for g in saved["param_groups"]]

    def fits(groups: list[list[str]]) -> bool:
        return sizes == [len(g) for g in groups] and all(
            tuple(saved["state"][i]["exp_avg"].shape) == shapes.get(name)
            for group, names in zip(saved["param_groups"], groups)
            for i, name in zip(group["params"], names)
            if torch.is_tensor(saved["state"].get(i, {}).get("exp_avg"))
        )

    for groups in groupings.values():
        if fits(groups):
            return groups
    known = ", ".join(f"{[len(g) for g in groups]} {how}" for how, groups in groupings.items())
    if any(sizes == [len(g) for g in groups] for groups in groupings.values()):
        raise CurvlabError(
            f"nanoGPT optimizer state has groups of {sizes} parameters, but its moments' shapes fit neither of "
            f"nanoGPT's groupings ({known}): a different model or a custom optimizer"
        )
    raise CurvlabError(
        f"nanoGPT optimizer state has groups of {sizes} parameters, which fit neither of nanoGPT's groupings "
        f"({known}): a different model or a custom optimizer"
    )


def curvlab_names(name: str) -> list[str]:
    """The curvlab parameter(s) one nanoGPT parameter becomes: c_attn splits into c_q, c_k, c_v."""
    if ".attn.c_attn." in name:
        return [name.replace("c_attn", part) for part in ATTN_SPLIT]
    return [name]


def _split(name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """A nanoGPT tensor (weight, bias or an elementwise optimizer moment) keyed by curvlab name(s)."""
    ours = curvlab_names(name)
    return dict(zip(ours, value.chunk(3, dim=0))) if len(ours) == 3 else {name: value}


def convert_model_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """nanoGPT model state dict -> curvlab GPT state dict."""
    out = {}
    for key, value in state.items():
        key = key.removeprefix("_orig_mod.")
        if key.endswith(".attn.bias") and value.dim() == 4:  # the causal-mask buffer of the slow path
            continue
        out.update(_split(key, value))
    return out


def load_nanogpt(ckpt: dict[str, Any]) -> tuple[GPT, torch.optim.AdamW | None]:
    """curvlab's GPT and AdamW carrying a nanoGPT checkpoint's weights and optimizer state.

    The optimizer is ``None`` when the checkpoint holds no optimizer state.
    """
    cfg = nanogpt_config(ckpt["model_args"])
    check_fits_weights(cfg, ckpt["model"])
    model = GPT(cfg)
    missing, unexpected = model.load_state_dict(convert_model_state(ckpt["model"]), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to wte
    if missing or unexpected:
        raise CurvlabError(f"nanoGPT state doesn't fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    saved = ckpt.get("optimizer")
    if not saved:
        return model, None
    table = dict(model.named_parameters())
    shapes = {k.removeprefix("_orig_mod."): tuple(v.shape) for k, v in ckpt["model"].items()}
    their_groups = _saved_grouping(saved, nanogpt_groupings(cfg), shapes)
    our_groups = [[m for n in group for m in curvlab_names(n)] for group in their_groups]
    index = {m: i for i, m in enumerate(our_groups[0] + our_groups[1])}
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in saved["param_groups"]]
    optimizer = torch.optim.AdamW([{"params": [table[m] for m in ours], **h} for ours, h in zip(our_groups, hyper)])
    state: dict[int, dict[str, Any]] = {}
    for group, names_in_group in zip(saved["param_groups"], their_groups):
        for their_id, name in zip(group["params"], names_in_group):
            entry = saved["state"].get(their_id)
            if entry is None:
                continue
            pieces = {k: _split(name, v) for k, v in entry.items() if torch.is_tensor(v) and v.dim()}
            for ours in curvlab_names(name):
                # clone what isn't split (Adam's scalar step): torch increments it in place, per parameter
                state[index[ours]] = {
                    k: pieces[k][ours] if k in pieces else (v.clone() if torch.is_tensor(v) else v)
                    for k, v in entry.items()
                }
    groups = [{**h, "params": [index[m] for m in ours]} for ours, h in zip(our_groups, hyper)]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    return model, optimizer
