"""Whether a checkpoint's weights fill a model: every tensor of the model present, none left over, every
shape equal, every floating tensor saved as floats. Anything else is refused in one line naming the tensors:
transformers initialises what a checkpoint lacks at random, and only logs it.

Tied weights (one tensor under several names: a head tied to the embedding), which safetensors saves under
one name, are known by the model's structure, never by their names' spelling (:func:`tie_groups`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from curvlab.errors import CurvlabError

SHOWN = 3  # tensors named in a message; the rest are counted
# safetensors' names of the floating dtypes weights may be saved in (loading casts them to the model's dtype)
FLOATING = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})


def key_list(keys: Iterable[str], sort: bool = True) -> str:
    """``keys`` (sorted), the first :data:`SHOWN` named and the rest counted: ``"a, b, c and 9 more"``."""
    keys = sorted(keys) if sort else list(keys)
    shown = ", ".join(keys[:SHOWN])
    return shown if len(keys) <= SHOWN else f"{shown} and {len(keys) - SHOWN} more"


def tie_groups(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Each state-dict key of ``model`` -> every state-dict key that names the same tensor object, in
    state-dict order (one key for an untied tensor)."""
    state = model.state_dict(keep_vars=True)  # (the parameters themselves: tied names reach one object)
    names: dict[int, list[str]] = {}
    for key, tensor in state.items():
        names.setdefault(id(tensor), []).append(key)
    return {key: tuple(names[id(tensor)]) for key, tensor in state.items()}


def untied_missing(model: nn.Module, missing: Iterable[str]) -> list[str]:
    """The keys among ``missing`` (its loading didn't find them) whose tensor no other, loaded key of
    ``model`` names: a tied key is filled by the key it shares its tensor with."""
    missing = set(missing)
    groups = tie_groups(model)
    return sorted(k for k in missing if not set(groups.get(k, (k,))) - missing)


def _shapes(mismatched: list[tuple[str, tuple, tuple]]) -> str:
    """``key [saved] saved, [model's] in the model`` of each, as :func:`key_list` names them."""
    return key_list((f"{k} {list(a)} saved, {list(b)} in the model" for k, a, b in mismatched), sort=False)


def _untied_declared(model: nn.Module) -> tuple[str, str] | None:
    """A pair the model's config ties that are two tensors after loading, or None: transformers unties a pair
    the weights hold with different values, giving the model a parameter the config's run never had."""
    declared = getattr(model, "get_expanded_tied_weights_keys", None)
    if not callable(declared):
        return None  # (a transformers without the declarations: its loading ties by the config alone)
    state = model.state_dict(keep_vars=True)
    apart = [
        (t, s)
        for t, s in declared(all_submodels=True).items()
        if t in state and s in state and state[t] is not state[s]
    ]
    return min(apart) if apart else None


def check_loading_info(model: nn.Module, info: Mapping[str, Any], where: Path) -> None:
    """Raise ``CurvlabError`` unless transformers' ``from_pretrained(..., output_loading_info=True)`` loaded
    every tensor of ``model`` from the checkpoint at ``where``: one line naming the missing tensors (tied
    ones aside: :func:`untied_missing`), the unexpected ones and the mis-shaped ones (``info``'s
    ``mismatched_keys``, listed under ``ignore_mismatched_sizes=True``) with both shapes; a config of
    another architecture is said so, and so are tensors the config ties that the weights hold apart."""
    name = type(model).__name__
    missing = untied_missing(model, info.get("missing_keys", ()))
    unexpected = sorted(info.get("unexpected_keys", ()))
    mismatched = sorted((str(k), tuple(a), tuple(b)) for k, a, b in info.get("mismatched_keys", ()))
    not_loaded = set(missing) | {k for k, _, _ in mismatched}
    params = [n for n, _ in model.named_parameters()]  # (one name per tensor: tied ones once)
    if params and not_loaded.issuperset(params):
        raise CurvlabError(
            f"{where}/config.json names {name} ({model.config.model_type}), but none of its {len(params)} "
            f"parameters is among the weights ({key_list(unexpected) or 'none'} saved): a config of another "
            "architecture than the weights'"
        )
    untied = _untied_declared(model)
    if untied:
        raise CurvlabError(
            f"{where}: {untied[1]} and {untied[0]} are one tensor in {name} (tied by its config.json) but differ in "
            "the weights: a model trained untied, which this config doesn't describe"
        )
    problems = []
    if missing:
        problems.append(f"{len(missing)} of its tensors missing ({key_list(missing)})")
    if unexpected:
        problems.append(f"{len(unexpected)} it has no place for ({key_list(unexpected)})")
    if mismatched:
        problems.append(f"{len(mismatched)} of another shape ({_shapes(mismatched)})")
    if problems:
        # (what transformers does with them: the model's tensors would be left as initialised, at random)
        random = " (transformers would start those at random)" if missing or mismatched else ""
        raise CurvlabError(f"{where}: the weights don't fill its config.json's {name}: {'; '.join(problems)}{random}")


def check_floating(model: nn.Module, saved: Mapping[str, str | torch.dtype], where: Path) -> None:
    """Raise ``CurvlabError`` if a floating tensor of ``model`` is saved in a dtype that isn't floating
    (not in :data:`FLOATING`): loading converts values, not bytes, so float data under an ``I32`` header
    would load as the integers its bits spell. ``saved``: each saved tensor's dtype (safetensors' name or
    torch's) by its key, with or without the model's ``base_model_prefix`` (transformers adds and strips it).
    """
    state = model.state_dict()
    prefix = f"{getattr(model, 'base_model_prefix', '')}."
    wrong = []
    for key, dtype in saved.items():
        floating = dtype.is_floating_point if isinstance(dtype, torch.dtype) else dtype in FLOATING
        ours = next((k for k in (key, prefix + key, key.removeprefix(prefix)) if k in state), None)
        if not floating and ours is not None and state[ours].is_floating_point():
            wrong.append(f"{key} ({dtype})")
    if wrong:
        raise CurvlabError(
            f"{where}: {len(wrong)} tensor(s) saved in a dtype that isn't floating for the model's floating weights "
            f"({key_list(wrong)}): loading would convert them into other numbers; refusing them"
        )


def fill_ties(model: nn.Module, weights: Mapping[str, Tensor], where: Path, what: str) -> dict[str, Tensor]:
    """``weights`` as a state dict that loads into ``model`` strictly: a tied key the weights lack is given
    the tensor of the key it is tied to (:func:`tie_groups`). Missing, unexpected and mis-shaped tensors
    (named in one line, ``what`` naming the model), floating tensors saved as integers and tied keys saved
    with different values are refused."""
    state, groups = model.state_dict(), tie_groups(model)
    missing = [k for k in state if not any(g in weights for g in groups[k])]
    unexpected = sorted(set(weights) - set(state))
    mismatched = [
        (k, tuple(v.shape), tuple(state[k].shape))
        for k, v in weights.items()
        if k in state and v.shape != state[k].shape
    ]
    problems = [f"missing {key_list(missing)}"] if missing else []
    problems += [f"unexpected {key_list(unexpected)}"] if unexpected else []
    problems += [f"size mismatch: {_shapes(mismatched)}"] if mismatched else []
    if problems:
        raise CurvlabError(f"{where}: its weights don't fit {what} ({'; '.join(problems)})")
    check_floating(model, {k: v.dtype for k, v in weights.items()}, where)
    filled = dict(weights)
    for key, group in groups.items():
        saved = [g for g in group if g in weights]
        for other in saved[1:]:
            if not torch.equal(weights[saved[0]], weights[other]):
                raise CurvlabError(
                    f"{where}: {saved[0]} and {other} are one tensor in {what} (tied) but differ in the weights: "
                    "they were trained untied, and a model of this config can't hold them"
                )
        filled.setdefault(key, weights[saved[0]])
    return filled
