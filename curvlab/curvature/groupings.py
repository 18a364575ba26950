"""Naming parameter blocks: which parameters form a layer, a kind, or the hidden matrices.

A grouping maps block names to lists of parameter names; every parameter lands in exactly one
block. Given the model, groupings read its structure (:func:`~curvlab.models.roles.parameter_roles` and
its stack of repeated layers); without one (a loss function that isn't a module's), they read
parameter names, which works on models that follow the usual naming conventions.

* ``"layer"`` (default): one block per layer of the model's layer stack (an ``nn.ModuleList`` or
  ``nn.Sequential`` of two or more modules of one class: ``transformer.h``, ``model.layers``), named
  ``layer0``, ``layer1``, ...; ``embedding`` (embedding tables outside the stack, and what shares a
  module with them), ``final_norm`` (a norm after the stack, or named as a final norm, as OPT's) and
  ``head`` (a tied embedding included) blocks. A parameter outside all of these lands in a block named
  after its module below the stack's parents (``pooler`` for BERT's ``bert.pooler.dense.weight``).
  With several stacks, each layer is named by the shortest tail of its stack's path that tells the
  stacks apart, and its index: ``layer1.0`` for a ResNet's stages, ``encoder.block.0`` and
  ``decoder.block.0`` for T5, with ``encoder.final_norm`` and ``decoder.final_norm``. Without the
  model: by name (``...h.3...``, ``layers.3``, ``blocks.3``; a top-level module's name otherwise).
* ``"tensor"``: one block per parameter tensor.
* ``"kind"``: ``embedding``, ``head`` and ``norm`` by role; the projections of each layer by their
  place in it (:func:`structural_kind_blocks`): ``mlp_in``/``mlp_out``, ``attn_q``, ``attn_k``,
  ``attn_v`` (or ``attn_qkv``), ``attn_o``, ``cross_attn_*``, whatever the projections are called;
  anything else under its role (``hidden``, ``bias``, ``other``). Without the model: by name.
* a mapping ``{block: [glob patterns]}``: user-defined; a parameter matched by no block, or by two,
  is an error.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping, Sequence

from torch import Tensor, nn

from curvlab.errors import CurvlabError
from curvlab.models.roles import parameter_roles, stacked_matrices

GROUPINGS = ("layer", "tensor", "kind")

_LAYER = re.compile(r"(?:^|\.)(?:h|layers|layer|blocks|block)\.(\d+)\.")
_EMBEDDING = re.compile(r"(?:^|\.)(?:wte|wpe|embed\w*|tok_emb\w*|pos_emb\w*)(?:\.|$)")
_HEAD = re.compile(r"(?:^|\.)(?:lm_head|head|output)(?:\.|$)")
_FINAL_NORM = re.compile(r"(?:^|\.)(?:ln_f|norm_f|final_norm|final_layernorm|final_layer_norm)(?:\.|$)")
_NORM = re.compile(r"(?:^|\.)(?:ln_\w+|\w*norm\w*)\.", re.IGNORECASE)
_ATTN = r"(?:attn|attention|self_attn)\.(?:self\.)?"
_SUBKINDS = [  # the parts of attention and MLP by name, for the name rule (without a model)
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


def hidden_matrices(params: Mapping[str, Tensor], *, model: nn.Module | None = None) -> list[str]:
    """Names of the hidden matrices among ``params``, in order: role ``hidden`` given the model
    (:func:`~curvlab.models.roles.parameter_roles`), else 2-D tensors whose names say neither embedding nor
    head. These are what Muon updates (docs/science.md section 5).

    Args:
        params: the parameter dict (only its names, shapes and order are read).
        model: the module the names belong to (default ``None``: the name rules alone, for a bare dict).

    Returns:
        The hidden matrices' names, in ``params``' order.
    """
    if model is None:
        return [n for n, t in params.items() if is_hidden_matrix(n, t)]
    roles = parameter_roles(model)
    return [n for n, t in params.items() if roles.get(n, "hidden" if is_hidden_matrix(n, t) else "") == "hidden"]


def model_of(loss_fn: object) -> nn.Module | None:
    """The module behind a loss function (``loss_fn.model``, as :func:`~curvlab.engine.loss.make_loss_fn`
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

    labels = _stack_labels(stacks)
    names = list(roles)
    last_in_stack = max((i for i, n in enumerate(names) if stack_of(n) is not None), default=-1)
    embedding_units = {unit(n)[0] for n, r in roles.items() if r == "embedding" and stack_of(n) is None}
    out = {}
    for i, name in enumerate(names):
        role, stack = roles[name], stack_of(name)
        if role == "head" or (role == "embedding" and stack is None):
            out[name] = role
        elif stack is not None:  # (an embedding inside a layer, T5's relative position bias, is the layer's)
            out[name] = f"{labels[stack]}{'' if len(stacks) == 1 else '.'}{_within(name, stack).split('.')[0]}"
        elif role == "norm" and stacks and (i > last_in_stack or _FINAL_NORM.search(name)):
            out[name] = _final_norm_block(name, stacks, labels)
        else:
            path, below = unit(name)
            out[name] = "embedding" if path in embedding_units else below.split(".")[0]
    return out


def _stack_labels(stacks: list[str]) -> dict[str, str]:
    """Each stack's name in block names: ``layer`` for a model's one stack; with several, the shortest
    tail of its path that no other stack's shares (``layer1`` for a ResNet's stages, ``encoder.block``
    and ``decoder.block`` for T5's)."""
    if len(stacks) == 1:
        return {stacks[0]: "layer"}
    labels = {}
    for stack in stacks:
        parts = stack.split(".")
        tails = [".".join(parts[-k:]) for k in range(1, len(parts) + 1)]
        others = [s for s in stacks if s != stack]
        labels[stack] = next((t for t in tails if not any(o == t or o.endswith("." + t) for o in others)), stack)
    return labels


def _final_norm_block(name: str, stacks: list[str], labels: Mapping[str, str]) -> str:
    """``final_norm``; with several stacks, a norm beside one of them (in the same parent module, as
    T5's ``encoder.final_layer_norm``) is that stack's: ``encoder.final_norm``."""
    if len(stacks) > 1:
        parent = name.rsplit(".", 2)[0] if name.count(".") >= 2 else ""
        for stack in stacks:
            label = labels[stack]
            if stack.rsplit(".", 1)[0] == parent and "." in label:
                return f"{label.rsplit('.', 1)[0]}.final_norm"
    return "final_norm"


_QKV_NAMES = {  # the last name component of separate query, key and value projections (a tiebreak only)
    "attn_q": re.compile(r"^(?:q|q_proj|query|q_lin|c_q|wq|to_q)$"),
    "attn_k": re.compile(r"^(?:k|k_proj|key|k_lin|c_k|wk|to_k)$"),
    "attn_v": re.compile(r"^(?:v|v_proj|value|v_lin|c_v|wv|to_v)$"),
}


def _is_projection(module: nn.Module, roles_by_id: Mapping[int, str]) -> bool:
    """A module that computes one linear map: ``nn.Linear``, Hugging Face's ``Conv1D`` (by name: not
    imported here), a convolution, a peft tuner layer (its ``base_layer`` and adapters together), or any
    module that holds a hidden matrix of its own (an MoE's fused experts)."""
    peft = isinstance(getattr(module, "base_layer", None), nn.Module)
    if peft or isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)) or type(module).__name__ == "Conv1D":
        return True
    return any(p.dim() >= 2 and roles_by_id.get(id(p)) == "hidden" for p in module.parameters(recurse=False))


def _projections(module: nn.Module, path: str, roles_by_id: Mapping[int, str]) -> list[str]:
    """Paths of the outermost projections in ``module``'s subtree, in registration order."""
    if _is_projection(module, roles_by_id):
        return [path]
    return [q for name, child in module.named_children() for q in _projections(child, f"{path}.{name}", roles_by_id)]


def _layer_parts(layer: nn.Module, path: str, roles_by_id: Mapping[int, str]) -> list[list[str]]:
    """A layer's sub-blocks, in registration order, each as the paths of its projections: every child
    with two or more projections is one (attention, MLP), a run of children with one projection each
    is one (OPT's ``fc1``, ``fc2``; BERT's ``intermediate``, ``output``), and a ``ModuleList`` of
    sub-blocks (T5's ``layer``) is looked into."""
    parts: list[list[str]] = []
    run: list[str] = []
    for name, child in layer.named_children():
        child_path = f"{path}.{name}"
        found = _projections(child, child_path, roles_by_id)
        if not found:
            continue
        if isinstance(child, (nn.ModuleList, nn.Sequential)) and not _is_projection(child, roles_by_id):
            parts.extend([run] if run else [])
            parts.extend(_layer_parts(child, child_path, roles_by_id))
            run = []
        elif len(found) == 1:
            run.extend(found)
        else:
            parts.extend([run] if run else [])
            parts.append(found)
            run = []
    return parts + ([run] if run else [])


def _attention_kinds(projections: list[str], prefix: str) -> dict[str, str]:
    """Kinds of an attention sub-block's projections: the last is the output projection (``_o``); one
    before it is a fused ``_qkv``; three are ``_q``, ``_k``, ``_v``, told apart by their names where
    each says one (OPT registers k, v, q), else in registration order; any other number is ``_in``."""
    inputs, out = projections[:-1], projections[-1]
    kinds = {out: f"{prefix}_o"}
    if len(inputs) == 1:
        kinds[inputs[0]] = f"{prefix}_qkv"
    elif len(inputs) == 3:
        by_name = {}
        for q in inputs:
            said = [k for k, pattern in _QKV_NAMES.items() if pattern.match(q.rsplit(".", 1)[-1])]
            by_name[q] = said[0] if len(said) == 1 else None
        if sorted(filter(None, by_name.values())) == sorted(_QKV_NAMES):
            kinds.update({q: prefix + k[4:] for q, k in by_name.items()})
        else:
            kinds.update({q: f"{prefix}{suffix}" for q, suffix in zip(inputs, ("_q", "_k", "_v"))})
    else:
        kinds.update({q: f"{prefix}_in" for q in inputs})
    return kinds


def structural_kind_blocks(model: nn.Module) -> dict[str, str]:
    """Parameter name -> ``"kind"`` block, from the model's structure: embedding, head and norm parameters
    by role. In each layer of a layer stack, the sub-blocks
    (:func:`_layer_parts`) are attention and MLP by their place: the last is the MLP (``mlp_in`` for
    each projection but its last, ``mlp_out``), those before it attention (``attn_*``, then a decoder's
    ``cross_attn_*``, then ``attn3_*``, ...: :func:`_attention_kinds`). A projection's bias and adapters
    share its kind. Everything else keeps its role, as do parameters outside the stacks.
    """
    roles = parameter_roles(model)
    roles_by_id = {id(p): roles[n] for n, p in model.named_parameters(remove_duplicate=False)}
    kind_of_module: dict[str, str] = {}
    for stack in layer_stacks(model):
        for index, layer in model.get_submodule(stack).named_children():
            parts = _layer_parts(layer, f"{stack}.{index}", roles_by_id)
            for number, part in enumerate(parts):
                if number == len(parts) - 1:
                    kind_of_module.update({q: "mlp_in" for q in part[:-1]} | {part[-1]: "mlp_out"})
                else:
                    prefix = "attn" if number == 0 else "cross_attn" if number == 1 else f"attn{number + 1}"
                    kind_of_module.update(_attention_kinds(part, prefix))
    out = {}
    for name, role in roles.items():
        module = name.rsplit(".", 1)[0] if "." in name else ""
        owner = next((m for m in _ancestors(module) if m in kind_of_module), None)
        out[name] = role if role in ("embedding", "head", "norm") or owner is None else kind_of_module[owner]
    # A fused experts module is one projection unit holding the MLP's matrices as stacks (Mixtral's
    # gate_up_proj, down_proj): its last stack is the MLP's output, those before it the input, whatever
    # kind the unit got as a whole
    units: dict[str, list[str]] = {}
    for name in stacked_matrices(model):
        if out.get(name) in ("mlp_in", "mlp_out"):
            units.setdefault(name.rsplit(".", 1)[0], []).append(name)
    order = {n: i for i, n in enumerate(roles)}
    for stacks in (u for u in units.values() if len(u) > 1):
        stacks.sort(key=order.__getitem__)
        out.update({n: "mlp_in" for n in stacks[:-1]} | {stacks[-1]: "mlp_out"})
    return out


def _ancestors(path: str) -> list[str]:
    """``path`` and the paths of the modules above it, innermost first (``a.b.c``, ``a.b``, ``a``)."""
    parts = path.split(".") if path else []
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def _ordered(blocks: dict[str, list[str]]) -> dict[str, list[str]]:
    """``embedding`` first, then the rest in order of first appearance, ``final_norm`` and ``head`` last."""
    first = [b for b in ("embedding",) if b in blocks]
    last = [b for b in ("final_norm", "head") if b in blocks]
    middle = [b for b in blocks if b not in first and b not in last]
    return {b: blocks[b] for b in first + middle + last}


def group_parameters(
    names: Iterable[str], *, blocks: str | Mapping[str, Sequence[str]] = "layer", model: nn.Module | None = None
) -> dict[str, list[str]]:
    """Partition parameter names into blocks, in order of first appearance (``"layer"`` given the
    model: embedding first, final norm and head last).

    Args:
        names: parameter names (e.g. ``params.keys()``).
        blocks: the grouping, ``"layer"``, ``"tensor"``, ``"kind"``, or ``{block: [glob patterns or names]}``.
        model: the module the names belong to: ``"layer"`` and ``"kind"`` then read its structure
            (names it doesn't have fall back to the name rules).

    Returns:
        ``{block: [parameter names]}``, the blocks ordered as above, each block's names in ``names``' order.

    Raises:
        CurvlabError: an unknown grouping, a mapping that leaves a parameter out or claims it twice,
            or a block that names no parameter.
    """
    names = list(names)
    if not names:
        raise CurvlabError("no parameters to group")
    if isinstance(blocks, str):
        if blocks not in GROUPINGS:
            raise CurvlabError(f"unknown block grouping {blocks!r}; choose one of {', '.join(GROUPINGS)} or a mapping")
        rule = {"layer": layer_block, "tensor": lambda n: n, "kind": kind_block}[blocks]
        known: dict[str, str] = {}
        if model is not None and blocks != "tensor":
            known = structural_layer_blocks(model) if blocks == "layer" else structural_kind_blocks(model)
        out: dict[str, list[str]] = {}
        for n in names:
            out.setdefault(known.get(n) or rule(n), []).append(n)
        return _ordered(out) if model is not None and blocks == "layer" else out
    claimed: dict[str, str] = {}
    out = {}
    for block, patterns in blocks.items():
        if isinstance(patterns, str):
            patterns = [patterns]
        members = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
        if not members:
            raise CurvlabError(f"block {block!r} matches no parameter (patterns {list(patterns)})")
        for n in members:
            if n in claimed:
                raise CurvlabError(f"parameter {n!r} is claimed by two blocks, {claimed[n]!r} and {block!r}")
            claimed[n] = block
        out[block] = members
    left = [n for n in names if n not in claimed]
    if left:
        more = f" and {len(left) - 3} more" if len(left) > 3 else ""
        raise CurvlabError(f"block patterns leave parameters out: {', '.join(map(repr, left[:3]))}{more}")
    return out
