r"""What each parameter of a model does, read from the model's structure rather than its names.

:func:`parameter_roles` gives every parameter one role:

* ``embedding``: the parameters of an ``nn.Embedding`` (or ``nn.EmbeddingBag``), and those of an
  input patch embedding: the model's first linear map or convolution, when it is a convolution whose
  stride equals its kernel size (ViT's, Swin's and ConvNext's patchify stem: a linear embedding of
  non-overlapping patches, the image model's token embedding; a ResNet's overlapping 7x7 stem is not);
* ``head``: the parameters of the module that produces the logits: the model's output embeddings
  when it declares them (Hugging Face's ``get_output_embeddings()``), else the last module, in
  registration order (the order ``named_modules`` lists, which is the order of the forward pass in
  practically every model), that holds a weight matrix. When that weight is tied to an embedding,
  the shared tensor is the head;
* ``norm``: the parameters of a normalization layer: torch's LayerNorm, GroupNorm, RMSNorm,
  BatchNorm and InstanceNorm, or any module whose class name says ``Norm`` and whose parameters are
  vectors (Llama's ``LlamaRMSNorm``, T5's ``T5LayerNorm``);
* ``bias``: a vector registered as the ``bias`` of any other module;
* ``hidden``: every other matrix: 2-D weights (``nn.Linear``, Hugging Face's ``Conv1D``, peft's
  LoRA factors, a bare 2-D ``nn.Parameter``), the kernels of convolutions, and stacks of matrices
  (:func:`stacked_matrices`: an MoE's fused experts, experts x out x in, one matrix per expert);
* ``other``: anything else (scalars, gates, learned tables of shape (1, n, d) or of 4 or more dimensions), and
  vectors stored as matrices: a bare (n, 1) or (1, n) parameter, not the weight of a linear map or
  convolution (peft IA3's scaling vectors ``ia3_l``, which multiply activations elementwise; Muon's
  orthogonalization of one would only normalize it). A linear map with one input or output (an
  ``nn.Linear(1, n)``, a rank-1 LoRA factor) stays ``hidden``.

The mathematical shape of a hidden matrix, :math:`d_\text{out} \times d_\text{in}`, is what
:func:`matrix_shapes` gives: ``nn.Linear`` stores (out, in), Hugging Face's ``Conv1D`` stores
(in, out) and is read transposed, a convolution kernel (out, in/groups, k...) is read as
out x (in/groups * prod k). A bare 2-D parameter is taken as stored (out, in); a stack as
(experts, out, in), or (experts, in, out) where its module declares ``is_transposed = True`` (Hugging
Face's experts modules carry the flag: Mixtral's are (experts, out, in), GPT-OSS's (experts, in, out)).
DBRX's 2-D (experts * out, in) stacks are read as (experts, out, in), as stored (its ``w2`` is applied
as ``x @ w2``, (in, out) by that reading, which nothing in its structure declares).

Overrides ``{name or glob: role}`` settle what structure can't (a head registered before the body,
say), and reverse any of the rules above: ``parameter_roles(model, overrides={"*.ia3_l.*": "hidden"})``, then
``build_optimizer("muon", model, muon_rule=lambda n, p: roles[n] == "hidden")`` and
``taylor_split(..., scope=[n for n, r in roles.items() if r == "hidden"])``. The roles drive Muon's
parameter split (:func:`~curvlab.optim.build.build_optimizer`), the hidden subset of
:func:`~curvlab.curvature.taylor.taylor_split` and the ``"layer"``/``"kind"`` groupings of
:mod:`curvlab.curvature.groupings`.
"""

from __future__ import annotations

import fnmatch
import math
import sys
from collections.abc import Mapping

from torch import nn

from curvlab.errors import CurvlabError

ROLES = ("embedding", "head", "hidden", "norm", "bias", "other")
_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.LocalResponseNorm, nn.modules.batchnorm._NormBase)
_CONVS = (nn.modules.conv._ConvNd,)
_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)


def _conv1d_types() -> tuple[type, ...]:
    """Hugging Face's ``Conv1D`` (weight stored in x out), if transformers is loaded (else no model has one)."""
    if "transformers" not in sys.modules:
        return ()
    from transformers.pytorch_utils import Conv1D  # optional: only once the user has imported transformers

    return (Conv1D,)


def _is_stack(module: nn.Module, p: nn.Parameter) -> bool:
    """A stack of matrices: 3-D, outside a convolution (whose 3-D kernels are one matrix), with more than one
    matrix (a (1, n, d) tensor is a table, ViT's position embeddings, not a stack)."""
    return p.dim() == 3 and p.shape[0] > 1 and not isinstance(module, _CONVS + _conv1d_types())


# the attributes in which transformers' mixture-of-experts modules declare how many experts they hold
_EXPERT_COUNTS = ("num_experts", "moe_num_experts", "num_local_experts", "n_routed_experts", "num_routed_experts")


def _row_stack(module: nn.Module, p: nn.Parameter) -> int | None:
    """n for a 2-D parameter that ``module`` holds as n experts' matrices stacked by rows: the module
    declares n > 1 experts and ``p``'s rows are n blocks of more than one row (DBRX's ``w1``, ``v1``,
    ``w2``, (n * ffn) x hidden, which its experts module views as n x ffn x hidden). A router's n x d
    weight, one row per expert, is not a stack; nor is a linear map's or an embedding's weight."""
    if p.dim() != 2 or isinstance(module, (*_linear_types(), *_EMBEDDINGS)):
        return None
    declared = [getattr(module, k) for k in _EXPERT_COUNTS if isinstance(getattr(module, k, None), int)]
    n = next((d for d in declared if d > 1 and not isinstance(d, bool)), None)
    return n if n is not None and p.shape[0] % n == 0 and p.shape[0] > n else None


def stack_sizes(model: nn.Module) -> dict[str, int]:
    """The number of matrices in each stack of matrices (:func:`stacked_matrices`), by every name it has:
    a 3-D stack's first dimension; the experts a module declares for a 2-D parameter that holds their
    matrices stacked by rows (DBRX's)."""
    sizes: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            n = p.shape[0] if _is_stack(m, p) else _row_stack(m, p)
            if n is not None:
                sizes[id(p)] = n
    return {n: sizes[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if id(p) in sizes}


def stacked_matrices(model: nn.Module) -> set[str]:
    """Names of the parameters that are stacks of matrices (:func:`stack_sizes`), under every name they have:
    the fused experts of Hugging Face's MoE models (Mixtral's, Qwen2-MoE's and OLMoE's ``gate_up_proj`` and
    ``down_proj``; DBRX's ``w1``, ``v1``, ``w2``), each expert's slice its own matrix, which Muon orthogonalizes
    and scales one by one (:class:`~curvlab.optim.muon.Muon`'s ``stacked`` groups)."""
    return set(stack_sizes(model))


def is_norm(module: nn.Module) -> bool:
    """A normalization layer: one of torch's, or a module named ``*Norm*`` holding only vectors."""
    if isinstance(module, _NORMS):
        return True
    own = list(module.parameters(recurse=False))
    return "Norm" in type(module).__name__ and bool(own) and all(p.dim() <= 1 for p in own)


def head_module(model: nn.Module) -> nn.Module | None:
    """The module that produces the logits: ``model.get_output_embeddings()`` where the model
    declares it, else the last registered module holding a weight of 2 or more dimensions that isn't
    a norm (``None`` for a model without one)."""
    getter = getattr(model, "get_output_embeddings", None)
    if callable(getter):
        try:
            declared = getter()
        except (AttributeError, NotImplementedError):  # declared by a base class, not implemented
            declared = None
        if isinstance(declared, nn.Module):
            return declared
    last = None
    for module in model.modules():
        if not is_norm(module) and any(p.dim() >= 2 for p in module.parameters(recurse=False)):
            last = module
    return last


def _linear_types() -> tuple[type, ...]:
    """The modules whose 2-D weight is a linear map (a size-1 side included)."""
    return (nn.Linear, *_CONVS, *_conv1d_types())


def patch_embedding(model: nn.Module) -> nn.Module | None:
    """The model's input patch embedding: its first linear map or convolution (in registration order),
    when that is a convolution with stride equal to its kernel size; ``None`` otherwise. (Tables
    such as ViT's class token and position embeddings are not linear maps, and are passed over.)"""
    first = next((m for m in model.modules() if isinstance(m, _linear_types())), None)
    if isinstance(first, _CONVS) and tuple(first.stride) == tuple(first.kernel_size):
        return first
    return None


def parameter_roles(model: nn.Module, *, overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """The role of every parameter of ``model``, keyed by name (see the module docstring).

    Tied parameters appear under every name they have (``named_parameters(remove_duplicate=False)``),
    each with the same role.

    Args:
        model: any ``nn.Module`` (a Hugging Face, peft or timm model included); read, never modified.
        overrides: ``{name or glob pattern: role}``, applied last, in order.

    Returns:
        ``{parameter name: role}``, one of ``embedding``, ``head``, ``norm``, ``bias``, ``hidden`` and
        ``other`` per name, in ``named_parameters`` order.

    Raises:
        CurvlabError: an unknown role, or an override pattern that matches no parameter.
    """
    role_of: dict[int, str] = {}  # by parameter identity, so tied names agree

    def claim(params, role):
        for p in params:
            role_of.setdefault(id(p), role)

    head = head_module(model)
    if head is not None:
        claim(head.parameters(), "head")
    for module in model.modules():
        if isinstance(module, _EMBEDDINGS):
            claim(module.parameters(recurse=False), "embedding")
    patches = patch_embedding(model)
    if patches is not None:
        claim(patches.parameters(recurse=False), "embedding")
    for module in model.modules():
        if is_norm(module):
            claim(module.parameters(recurse=False), "norm")
    convs = _CONVS + _conv1d_types()
    linear = _linear_types()
    for module in model.modules():
        bias = getattr(module, "bias", None)
        if isinstance(bias, nn.Parameter) and bias.dim() == 1:
            claim([bias], "bias")
        for p in module.parameters(recurse=False):
            if p.dim() == 2 and 1 in p.shape and not isinstance(module, linear):
                claim([p], "other")  # a vector stored as a matrix (IA3's)
            elif p.dim() == 2 or (p.dim() > 2 and isinstance(module, convs)) or _is_stack(module, p):
                claim([p], "hidden")
    roles = {name: role_of.get(id(p), "other") for name, p in model.named_parameters(remove_duplicate=False)}
    for pattern, role in (overrides or {}).items():
        if role not in ROLES:
            raise CurvlabError(f"unknown role {role!r} for {pattern!r}; choose one of {', '.join(ROLES)}")
        matched = [n for n in roles if fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            raise CurvlabError(f"role override {pattern!r} matches no parameter")
        for n in matched:
            roles[n] = role
    return roles


def stored_transposed(model: nn.Module) -> set[str]:
    """Names of the matrices stored (in, out), the transpose of their mathematical shape, under every name
    they have: the weights of Hugging Face's ``Conv1D`` (GPT-2's attention and MLP), and the stacks
    (:func:`stacked_matrices`) of a module that declares ``is_transposed = True`` (experts x in x out)."""
    conv1d = _conv1d_types()
    ids = {id(m.weight) for m in model.modules() if isinstance(m, conv1d) and m.weight.dim() == 2}
    for m in model.modules():
        if getattr(m, "is_transposed", None) is True:
            ids |= {id(p) for p in m.parameters(recurse=False) if _is_stack(m, p)}
    return {n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in ids}


def matrix_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    r"""The mathematical shape :math:`(d_\text{out}, d_\text{in})` of every parameter of 2 or more
    dimensions, or :math:`(n, d_\text{out}, d_\text{in})` of a stack of n matrices
    (:func:`stacked_matrices`): stored (in, out) matrices (:func:`stored_transposed`) transposed,
    convolution kernels flattened to out x (in/groups * prod k), everything else as stored."""
    transposed, sizes = stored_transposed(model), stack_sizes(model)
    shapes = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.dim() >= 2:
            lead = (sizes[name],) if name in sizes else ()
            # (a stack's matrix: its last dimension is the columns, whether it is n x r x c or (n * r) x c)
            cols = p.shape[-1] if lead else math.prod(p.shape[1:])
            rows = p.numel() // (cols * sizes[name]) if lead else p.shape[0]
            shapes[name] = (*lead, *((cols, rows) if name in transposed else (rows, cols)))
    return shapes
