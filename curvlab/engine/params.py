"""Arithmetic on parameter dicts: ``{name: tensor}`` mappings that share keys and shapes.

Directions (gradients G, updates Z, Hessian-vector products H[Z]) are dicts keyed like
``model.named_parameters()``. Inner products accumulate in float64 whatever the tensors' dtype: the NDS
of a late checkpoint is a ratio of two sums over ~10^8 terms.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import Tensor

from curvlab.engine.dtensors import all_finite, check_layout, is_dtensor, resolved
from curvlab.errors import CurvlabError

Params = dict[str, Tensor]


PIECE = 1 << 16
"""Entries per float64 piece of an inner product on the CPU: a whole float64 copy of a large tensor is fresh
memory faulted in page by page, where a 512 KiB piece comes back from the heap and stays in cache (8.5-10.6x
faster, ``benchmarks/inner_products.py``). On a GPU the caching allocator reuses memory: converted whole."""


def dot_table(pairs: Sequence[tuple[Mapping[str, Tensor], Mapping[str, Tensor]]], keys: Iterable[str]) -> Tensor:
    r"""Inner products :math:`\langle a_k, b_k\rangle` of every pair ``(a, b)``, key by key, in float64: a
    ``(len(keys), len(pairs))`` tensor on the host, each tensor converted once per piece however many pairs
    it is in, the table in one transfer (or all-reduce): sums over any subset of the keys cost nothing more.
    """
    keys = list(keys)
    n = len(pairs)
    plain: list[Tensor] = []  # (0-d terms, key by key, pair by pair)
    plain_at: list[int] = []
    sharded: list[Tensor] = []
    sharded_at: list[int] = []
    for i, k in enumerate(keys):
        first = pairs[0][0][k]  # (a key's tensors are laid out alike: check_layout)
        if is_dtensor(first):
            sharded += [torch.sum(a[k].double() * b[k].double()) for a, b in pairs]
            sharded_at.append(i)
            continue
        plain_at.append(i)
        whole = first.device.type != "cpu" or first.numel() <= PIECE
        plain += _dots([(a[k], b[k]) for a, b in pairs], max(first.numel(), 1) if whole else PIECE)
    table = torch.zeros(len(keys), n, dtype=torch.float64, device="cpu")  # (scalars, on the host)
    if plain:
        table[plain_at] = _stacked(plain).view(-1, n).cpu()
    if sharded:
        table[sharded_at] = resolved(torch.stack(sharded)).view(-1, n).cpu()
    return table


def group_sums(table: Tensor, keys: Sequence[str], groups: Iterable[Iterable[str]]) -> Tensor:
    """The rows of a per-key ``table`` (:func:`dot_table`'s over ``keys``, or one of its columns) summed over
    each group of keys: shape ``(len(groups), *table.shape[1:])``."""
    index = {k: i for i, k in enumerate(keys)}
    return torch.stack([table[[index[k] for k in group]].sum(0) for group in groups])


def _stacked(terms: list[Tensor]) -> Tensor:
    """0-d terms stacked on the first one's device (parameters may live on several)."""
    device = terms[0].device
    return torch.stack([t if t.device == device else t.to(device) for t in terms])


def _dots(pairs: Sequence[tuple[Tensor, Tensor]], piece: int) -> list[Tensor]:
    """0-d float64 inner products of pairs of plain tensors of one shape, ``piece`` entries at a time, each
    distinct tensor converted once per piece (the list of pairs holds the tensors, so their ids name them)."""
    flat: dict[int, Tensor] = {}
    for pair in pairs:
        for t in pair:
            flat.setdefault(id(t), t.reshape(-1))
    parts: list[list[Tensor]] = [[] for _ in pairs]
    for i in range(0, max(pairs[0][0].numel(), 1), piece):
        converted = {key: f[i : i + piece].double() for key, f in flat.items()}
        for j, (x, y) in enumerate(pairs):
            parts[j].append(torch.dot(converted[id(x)], converted[id(y)]))
    return [p[0] if len(p) == 1 else torch.stack(p).sum() for p in parts]


def dots(pairs: Sequence[tuple[Mapping[str, Tensor], Mapping[str, Tensor]]], keys: Iterable[str]) -> list[float]:
    r"""The inner products :math:`\langle a, b\rangle` over ``keys`` of every pair, in float64 (:func:`dot_table`)."""
    return dot_table(pairs, keys).sum(0).tolist()


def dot(a: Mapping[str, Tensor], b: Mapping[str, Tensor], keys: Iterable[str] | None = None) -> float:
    r"""Euclidean inner product :math:`\langle a, b\rangle = \sum_k \sum_i a_{k,i} b_{k,i}` in float64 (over
    ``keys`` if given)."""
    return dots([(a, b)], a.keys() if keys is None else keys)[0]


def stacked_dot(a: Mapping[str, Tensor], b: Mapping[str, Tensor], keys: Iterable[str]) -> Tensor:
    r"""Inner products :math:`\langle a_k, b_k\rangle` over ``keys`` for K stacked entries, float64 ``(K,)``;
    an unstacked tensor pairs with every entry."""
    total = None
    for k in keys:
        x, y = a[k].double(), b[k].double()
        if x.dim() < y.dim():  # (unsqueeze rather than broadcast_tensors: it keeps a DTensor's sharding)
            x = x.unsqueeze(0)
        elif y.dim() < x.dim():
            y = y.unsqueeze(0)
        xy = x * y
        part = xy.sum(dim=tuple(range(1, xy.dim()))) if xy.dim() > 1 else xy
        total = part if total is None else total + part
    return resolved(total).cpu()


def norm(a: Mapping[str, Tensor], keys: Iterable[str] | None = None) -> float:
    r"""Frobenius norm :math:`\|a\|_F = \langle a, a\rangle^{1/2}` over all (or ``keys``) tensors."""
    return dot(a, a, keys) ** 0.5


def add(a: Mapping[str, Tensor], b: Mapping[str, Tensor], alpha: float = 1.0) -> Params:
    """``a + alpha * b``, key by key."""
    return {k: a[k] + alpha * b[k] for k in a}


def scale(a: Mapping[str, Tensor], c: float) -> Params:
    """``c * a``, key by key."""
    return {k: c * t for k, t in a.items()}


def zeros_like(a: Mapping[str, Tensor]) -> Params:
    """A dict of zeros with ``a``'s keys, shapes and dtypes."""
    return {k: torch.zeros_like(t) for k, t in a.items()}


def restrict(a: Mapping[str, Tensor], keys: Iterable[str]) -> Params:
    """``a`` with every tensor outside ``keys`` replaced by zeros (the direction padded to all params)."""
    keep = set(keys)
    return {k: t if k in keep else torch.zeros_like(t) for k, t in a.items()}


def cast(a: Mapping[str, Tensor], dtype: torch.dtype) -> Params:
    """``a`` detached, its floating tensors in ``dtype`` (copied only to change their dtype; others as they are)."""
    return {k: _cast(t, dtype) for k, t in a.items()}


def _cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    if t.is_floating_point() and t.dtype != dtype:
        return t.detach().to(dtype)
    # (a plain tensor outside autograd as it is: its detached alias would be the same tensor, one op more)
    return t if type(t) is Tensor and not t.requires_grad else t.detach()


def flatten(a: Mapping[str, Tensor]) -> Tensor:
    """Concatenate the tensors of ``a`` (in key order) into one vector."""
    return torch.cat([t.reshape(-1) for t in a.values()])


def unflatten(vector: Tensor, like: Mapping[str, Tensor]) -> Params:
    """Inverse of :func:`flatten`: split ``vector`` into tensors shaped like ``like``'s values."""
    sizes = [t.numel() for t in like.values()]
    if vector.numel() != sum(sizes):
        raise CurvlabError(f"vector has {vector.numel()} entries but the parameters have {sum(sizes)}")
    return {k: piece.view(t.shape) for (k, t), piece in zip(like.items(), vector.split(sizes))}


def check_like(
    params: Mapping[str, Tensor], direction: Mapping[str, Tensor], what: str = "direction", *, finite: bool = True
) -> None:
    """Raise ``CurvlabError`` unless ``direction`` has exactly ``params``' keys and shapes and (``finite``) is
    finite: ``finite=False`` for a caller that learns finiteness from a float64 sum it takes anyway."""
    missing = [k for k in params if k not in direction]
    extra = [k for k in direction if k not in params]
    if missing or extra:
        parts = "; ".join(
            f"{label} {names_text(names)}" for label, names in (("missing", missing), ("unknown", extra)) if names
        )
        raise CurvlabError(f"{what} does not match the parameters: {parts}")
    for k, p in params.items():
        d, where = direction[k], f"{what}[{k!r}]"
        if d.shape != p.shape:
            raise CurvlabError(f"{where} has shape {tuple(d.shape)}, parameter has {tuple(p.shape)}")
        check_layout(p, d, where)
        check_device(p, d, where)
    bad = non_finite({k: direction[k] for k in params}) if finite else []
    if bad:
        raise CurvlabError(f"{what}[{bad[0]!r}] holds non-finite values (NaN or inf)")


def non_finite(a: Mapping[str, Tensor]) -> list[str]:
    """The names of the tensors of ``a`` that hold a NaN or an inf, in order (one synchronization unless one does)."""
    if all_finite(a.values()):
        return []
    return [k for k, t in a.items() if not all_finite([t])]


def check_device(param: Tensor, direction: Tensor, what: str) -> None:
    """Raise ``CurvlabError`` unless ``direction`` lives on ``param``'s device and holds values (not ``meta``)."""
    if direction.is_meta or param.is_meta:
        which = "it" if direction.is_meta else "the parameter"
        raise CurvlabError(
            f"{what}: {which} is on the meta device (a shape, no values): materialize it first (e.g. .to_empty and "
            "an initialization, or a load)"
        )
    if direction.device != param.device:
        raise CurvlabError(
            f"{what} is on {direction.device}, the parameter on {param.device}: create directions on the parameters' "
            "device"
        )


def names_text(keys: list[str], most: int = 4) -> str:
    """Up to ``most`` names quoted, then how many more: for error messages."""
    shown = ", ".join(repr(k) for k in keys[:most])
    return shown + (f" and {len(keys) - most} more" if len(keys) > most else "")
