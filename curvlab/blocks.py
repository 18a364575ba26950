"""Naming parameter blocks: which parameters form a layer, a kind, or the hidden matrices.

A grouping maps block names to lists of parameter names; every parameter lands in exactly one
block. Given the model, groupings read its structure (:func:`~curvlab.roles.parameter_roles` and
its stack of repeated layers); without one (a loss function that isn't a module's), they read
parameter names, which works on models that follow the usual naming conventions.

* ``"layer"`` (default): one block per layer of the model's layer stack (the ``nn.ModuleList`` or
  ``nn.Sequential`` of two or more modules of one class: ``transformer.h``, ``model.layers``,
  ``encoder.layer``), named ``layer0``, ``layer1``, ...; ``embedding`` (embedding tables, and what
  shares a module with them, such as BERT's embedding LayerNorm), ``final_norm`` (a norm after the
  stack) and ``head`` (the head's parameters, a tied embedding included) blocks. A parameter outside
  all of these lands in a block named after its module below the stack's parents (``pooler`` for
  BERT's ``bert.pooler.dense.weight``, ``fc1`` for ``fc1.weight``). With several stacks (a ResNet's
  stages), each layer is named by its stack and index (``layer1.0``). Without the model: by name
  (``...h.3...``, ``layers.3``, ``blocks.3``; a top-level module's name otherwise).
* ``"tensor"``: one block per parameter tensor.
* ``"kind"``: ``embedding``, ``head`` and ``norm`` by role; the hidden matrices and biases of attention
  and MLP by name, as ``attn_q``, ``attn_k``, ``attn_v``, ``attn_qkv`` (fused), ``attn_o``, ``mlp_in``,
  ``mlp_out``; anything else under its role (``hidden``, ``bias``, ``other``; ``other`` without the
  model).
* a mapping ``{block: [glob patterns]}``: user-defined; a parameter matched by no block, or by two,
  is an error.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping, Sequence

from torch import Tensor, nn

from curvlab.errors import CurvlabError
from curvlab.roles import parameter_roles

GROUPINGS = ("layer", "tensor", "kind")

_LAYER = re.compile(r"(?:^|\.)(?:h|layers|layer|blocks|block)\.(\d+)\.")
_EMBEDDING = re.compile(r"(?:^|\.)(?:wte|wpe|embed\w*|tok_emb\w*|pos_emb\w*)(?:\.|$)")
_HEAD = re.compile(r"(?:^|\.)(?:lm_head|head|output)(?:\.|$)")
_FINAL_NORM = re.compile(r"(?:^|\.)(?:ln_f|norm_f|final_norm|final_layernorm)(?:\.|$)")
_NORM = re.compile(r"(?:^|\.)(?:ln_\w+|\w*norm\w*)\.", re.IGNORECASE)
_ATTN = r"(?:attn|attention|self_attn)\.(?:self\.)?"
_SUBKINDS = [  # the parts of attention and MLP, which only names tell apart
    ("attn_qkv", re.compile(_ATTN + r"(?:c_attn|qkv|qkv_proj|Wqkv)\.")),
    ("attn_q", re.compile(_ATTN + r"(?:c_q|q_proj|q|query)\.")),
    ("attn_k", re.compile(_ATTN + r"(?:c_k|k_proj|k|key)\.")),
    ("attn_v", re.compile(_ATTN + r"(?:c_v|v_proj|v|value)\.")),
    ("attn_o", re.compile(r"(?:(?:attn|self_attn)\.(?:c_proj|o_proj|out_proj|o)|attention\.output\.dense)\.")),
    ("mlp_in", re.compile(r"(?:mlp\.(?:c_fc|fc|up_proj|gate_proj|fc1|w1|w3)|intermediate\.dense)\.")),
    ("mlp_out", re.compile(r"(?:mlp\.(?:c_proj|down_proj|proj|fc2|w2)|(?:^|\.)output\.dense)\.")),
]
_KINDS = [("embedding", _EMBEDDING), ("head", _HEAD), ("norm", _NORM), *_SUBKINDS]


def is_embedding_or_head(name: str) -> bool:
    """Whether ``name`` looks like an embedding table or the output head (name rule, without a model)."""
    return bool(_EMBEDDING.search(name) or _HEAD.search(name))


def is_hidden_matrix(name: str, tensor: Tensor) -> bool:
    """A 2-D weight whose name says neither embedding nor head (name rule, without a model)."""
    return tensor.dim() == 2 and not is_embedding_or_head(name)


def hidden_matrices(params: Mapping[str, Tensor], model: nn.Module | None = None) -> list[str]:
    """Names of the hidden matrices among ``params``, in order: role ``hidden`` given the model
    (:func:`~curvlab.roles.parameter_roles`), else 2-D tensors whose names say neither embedding nor
    head. These are what Muon updates (SCIENCE.md section 5)."""
    if model is None:
        return [n for n, t in params.items() if is_hidden_matrix(n, t)]
    roles = parameter_roles(model)
    return [n for n, t in params.items() if roles.get(n, "hidden" if is_hidden_matrix(n, t) else "") == "hidden"]


def model_of(loss_fn: object) -> nn.Module | None:
    """The module behind a loss function (``loss_fn.model``, as :func:`~curvlab.loss.make_loss_fn`
    keeps it), whose structure groupings read; ``None`` for a plain function."""
    model = getattr(loss_fn, "model", None)
    return model if isinstance(model, nn.Module) else None


def layer_block(name: str) -> str:
    """The ``"layer"``-grouping block of one parameter name (name rule, without a model)."""
    if m := _LAYER.search(name):
        return f"layer{int(m.group(1))}"
    if _EMBEDDING.search(name):
        return "embedding"
    if _FINAL_NORM.search(name):
        return "final_norm"
    if _HEAD.search(name):
        return "head"
    return name.split(".")[0]


def kind_block(name: str) -> str:
    """The ``"kind"``-grouping block of one parameter name (name rule, without a model)."""
    return next((kind for kind, pattern in _KINDS if pattern.search(name)), "other")


def _within(name: str, path: str) -> str | None:
    """``name`` relative to module ``path`` (``""`` is the root), or ``None`` if it lies outside."""
    if not path:
        return name
    return name[len(path) + 1 :] if name.startswith(path + ".") else None


def layer_stacks(model: nn.Module) -> list[str]:
    """Paths of the model's layer stacks: ``nn.ModuleList``/``nn.Sequential`` modules whose children
    that hold parameters are two or more modules of one class, outermost only."""
    stacks: list[str] = []
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        if any(_within(path, s) is not None or path == s for s in stacks):
            continue
        holding = [c for c in module.children() if any(True for _ in c.parameters())]
        if len(holding) >= 2 and len({type(c) for c in holding}) == 1:
            stacks.append(path)
    return stacks


def structural_layer_blocks(model: nn.Module) -> dict[str, str]:
    """Parameter name -> ``"layer"`` block, from the model's structure (see the module docstring)."""
    roles = parameter_roles(model)
    stacks = layer_stacks(model)
    # the modules that contain a stack: a name is told apart by its first component below them
    parents = {""} | {".".join(s.split(".")[:i]) for s in stacks for i in range(1, len(s.split(".")))}

    def unit(name: str) -> tuple[str, str]:
        """(the path down to the first component below the parents, that component onwards)"""
        parts = name.split(".")
        k = max(i for i in range(len(parts)) if ".".join(parts[:i]) in parents)
        return ".".join(parts[: k + 1]), ".".join(parts[k:])

    def stack_of(name: str) -> str | None:
        return next((s for s in stacks if _within(name, s) is not None), None)

    names = list(roles)
    last_in_stack = max((i for i, n in enumerate(names) if stack_of(n) is not None), default=-1)
    embedding_units = {unit(n)[0] for n, r in roles.items() if r == "embedding"}
    out = {}
    for i, name in enumerate(names):
        role, stack = roles[name], stack_of(name)
        if role in ("embedding", "head"):
            out[name] = role
        elif stack is not None:
            index = _within(name, stack).split(".")[0]
            out[name] = f"layer{index}" if len(stacks) == 1 else f"{unit(stack)[1] or 'layer'}.{index}"
        elif role == "norm" and stacks and i > last_in_stack:
            out[name] = "final_norm"
        else:
            path, below = unit(name)
            out[name] = "embedding" if path in embedding_units else below.split(".")[0]
    return out


def structural_kind_blocks(model: nn.Module) -> dict[str, str]:
    """Parameter name -> ``"kind"`` block: roles for embedding, head and norm; names for the parts of
    attention and MLP; the role otherwise."""
    out = {}
    for name, role in parameter_roles(model).items():
        if role in ("embedding", "head", "norm"):
            out[name] = role
        else:
            out[name] = next((kind for kind, pattern in _SUBKINDS if pattern.search(name)), role)
    return out


def _ordered(blocks: dict[str, list[str]]) -> dict[str, list[str]]:
    """``embedding`` first, then the rest in order of first appearance, ``final_norm`` and ``head`` last."""
    first = [b for b in ("embedding",) if b in blocks]
    last = [b for b in ("final_norm", "head") if b in blocks]
    middle = [b for b in blocks if b not in first and b not in last]
    return {b: blocks[b] for b in first + middle + last}


def group_parameters(
    names: Iterable[str], grouping: str | Mapping[str, Sequence[str]] = "layer", model: nn.Module | None = None
) -> dict[str, list[str]]:
    """Partition parameter names into blocks, in order of first appearance (``"layer"`` given the
    model: embedding first, final norm and head last).

    Args:
        names: parameter names (e.g. ``params.keys()``).
        grouping: ``"layer"``, ``"tensor"``, ``"kind"``, or ``{block: [glob patterns or names]}``.
        model: the module the names belong to: ``"layer"`` and ``"kind"`` then read its structure
            (names it doesn't have fall back to the name rules).

    Raises:
        CurvlabError: an unknown grouping, a mapping that leaves a parameter out or claims it twice,
            or a block that names no parameter.
    """
    names = list(names)
    if not names:
        raise CurvlabError("no parameters to group")
    if isinstance(grouping, str):
        if grouping not in GROUPINGS:
            raise CurvlabError(
                f"unknown block grouping {grouping!r}; choose one of {', '.join(GROUPINGS)} or a mapping"
            )
        rule = {"layer": layer_block, "tensor": lambda n: n, "kind": kind_block}[grouping]
        known: dict[str, str] = {}
        if model is not None and grouping != "tensor":
            known = structural_layer_blocks(model) if grouping == "layer" else structural_kind_blocks(model)
        blocks: dict[str, list[str]] = {}
        for n in names:
            blocks.setdefault(known.get(n) or rule(n), []).append(n)
        return _ordered(blocks) if model is not None and grouping == "layer" else blocks
    claimed: dict[str, str] = {}
    blocks = {}
    for block, patterns in grouping.items():
        if isinstance(patterns, str):
            patterns = [patterns]
        members = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
        if not members:
            raise CurvlabError(f"block {block!r} matches no parameter (patterns {list(patterns)})")
        for n in members:
            if n in claimed:
                raise CurvlabError(f"parameter {n!r} is claimed by two blocks, {claimed[n]!r} and {block!r}")
            claimed[n] = block
        blocks[block] = members
    left = [n for n in names if n not in claimed]
    if left:
        more = f" and {len(left) - 3} more" if len(left) > 3 else ""
        raise CurvlabError(f"block patterns leave parameters out: {', '.join(map(repr, left[:3]))}{more}")
    return blocks
