"""Naming parameter blocks: which parameters form a layer, a kind, or the hidden matrices.

A grouping maps block names to lists of parameter names; every parameter lands in exactly one
block. Groupings read nothing but parameter names (and shapes, for the hidden matrices), so they
work on any model whose names follow the usual conventions, and fall back sensibly on others.

* ``"layer"`` (default): one block per transformer layer (``...h.3...``, ``layers.3``, ``blocks.3``),
  plus ``embedding`` (token and position embeddings), ``final_norm`` and ``head`` blocks. A parameter
  outside all of these lands in a block named after its top-level module (``fc1`` for ``fc1.weight``).
* ``"tensor"``: one block per parameter tensor.
* ``"kind"``: ``attn_q``, ``attn_k``, ``attn_v``, ``attn_qkv`` (fused), ``attn_o``, ``mlp_in``,
  ``mlp_out``, ``norm``, ``embedding``, ``head``, and ``other`` for anything else.
* a mapping ``{block: [glob patterns]}``: user-defined; a parameter matched by no block, or by two,
  is an error.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping, Sequence

from torch import Tensor

from curvlab.errors import CurvlabError

GROUPINGS = ("layer", "tensor", "kind")

_LAYER = re.compile(r"(?:^|\.)(?:h|layers|layer|blocks|block)\.(\d+)\.")
_EMBEDDING = re.compile(r"(?:^|\.)(?:wte|wpe|embed\w*|tok_emb\w*|pos_emb\w*)(?:\.|$)")
_HEAD = re.compile(r"(?:^|\.)(?:lm_head|head|output)(?:\.|$)")
_FINAL_NORM = re.compile(r"(?:^|\.)(?:ln_f|norm_f|final_norm|final_layernorm)(?:\.|$)")
_KINDS = [
    ("embedding", _EMBEDDING),
    ("head", _HEAD),
    ("norm", re.compile(r"(?:^|\.)(?:ln_\w+|\w*norm\w*)\.")),
    ("attn_qkv", re.compile(r"attn\.(?:c_attn|qkv)\.")),
    ("attn_q", re.compile(r"attn\.(?:c_q|q_proj|q|query)\.")),
    ("attn_k", re.compile(r"attn\.(?:c_k|k_proj|k|key)\.")),
    ("attn_v", re.compile(r"attn\.(?:c_v|v_proj|v|value)\.")),
    ("attn_o", re.compile(r"attn\.(?:c_proj|o_proj|out_proj|o)\.")),
    ("mlp_in", re.compile(r"mlp\.(?:c_fc|fc|up_proj|gate_proj|fc1|w1|w3)\.")),
    ("mlp_out", re.compile(r"mlp\.(?:c_proj|down_proj|proj|fc2|w2)\.")),
]


def is_embedding_or_head(name: str) -> bool:
    """Whether ``name`` looks like an embedding table or the output head."""
    return bool(_EMBEDDING.search(name) or _HEAD.search(name))


def is_hidden_matrix(name: str, tensor: Tensor) -> bool:
    """A 2-D weight that is neither an embedding nor the head: what Muon updates (SCIENCE.md section 5)."""
    return tensor.dim() == 2 and not is_embedding_or_head(name)


def hidden_matrices(params: Mapping[str, Tensor]) -> list[str]:
    """Names of the hidden 2-D matrices among ``params``, in order."""
    return [n for n, t in params.items() if is_hidden_matrix(n, t)]


def layer_block(name: str) -> str:
    """The ``"layer"``-grouping block of one parameter name."""
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
    """The ``"kind"``-grouping block of one parameter name."""
    return next((kind for kind, pattern in _KINDS if pattern.search(name)), "other")


def group_parameters(
    names: Iterable[str], grouping: str | Mapping[str, Sequence[str]] = "layer"
) -> dict[str, list[str]]:
    """Partition parameter names into blocks, in order of first appearance.

    Args:
        names: parameter names (e.g. ``params.keys()``).
        grouping: ``"layer"``, ``"tensor"``, ``"kind"``, or ``{block: [glob patterns or names]}``.

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
        key = {"layer": layer_block, "tensor": lambda n: n, "kind": kind_block}[grouping]
        blocks: dict[str, list[str]] = {}
        for n in names:
            blocks.setdefault(key(n), []).append(n)
        return blocks
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
