"""Several optimizers stepped as one (Muon on the hidden matrices, AdamW on the rest), with one state and one
list of param groups, and the list form any optimizer argument may take.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import Any

import torch

from curvlab.errors import CurvlabError
from curvlab.optim.muon import evaluate_closure


class JointState(MutableMapping):
    """The per-parameter state of several optimizers over disjoint parameters, read and written as one
    mapping: ``state[p]`` is the state of ``p`` in the optimizer that holds it."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]):
        self._optimizers = list(optimizers)

    def _owner(self, p: Any) -> torch.optim.Optimizer:
        for o in self._optimizers:
            if any(q is p for g in o.param_groups for q in g["params"]):
                return o
        raise KeyError(p)

    def __getitem__(self, p: Any) -> Any:
        return self._owner(p).state[p]  # (a child's defaultdict makes a missing entry, as torch's own)

    def __contains__(self, p: Any) -> bool:
        return any(p in o.state for o in self._optimizers)

    def get(self, p: Any, default: Any = None) -> Any:
        """The state of ``p``, or ``default`` where there is none yet (nothing is made, as ``dict.get``)."""
        return next((o.state[p] for o in self._optimizers if p in o.state), default)

    def __setitem__(self, p: Any, value: Any) -> None:
        self._owner(p).state[p] = value

    def __delitem__(self, p: Any) -> None:
        del self._owner(p).state[p]

    def __iter__(self) -> Iterator[Any]:
        return (p for o in self._optimizers for p in o.state)

    def __len__(self) -> int:
        return sum(len(o.state) for o in self._optimizers)


class CombinedOptimizer(torch.optim.Optimizer):
    """Several optimizers over disjoint parameters, driven as one.

    ``param_groups`` is the concatenation of the children's groups (the same dicts, so an LR scheduler
    on this object drives the children) and ``state`` is the children's states read as one
    (:class:`JointState`; each child keeps its own, so a child's ``state_dict()`` works too), so
    ``state_dict`` and ``load_state_dict`` cover everything in the layout torch uses for a single optimizer.
    """

    def __init__(self, optimizers: Mapping[str, torch.optim.Optimizer]):
        self.optimizers = dict(optimizers)
        if not self.optimizers:
            raise CurvlabError("CombinedOptimizer needs at least one optimizer")
        params = [p for o in self.optimizers.values() for g in o.param_groups for p in g["params"]]
        if len({id(p) for p in params}) != len(params):
            raise CurvlabError("the combined optimizers share a parameter")
        super().__init__(params, {})
        self._share([g for o in self.optimizers.values() for g in o.param_groups])

    @property
    def state(self) -> JointState:
        return JointState(list(self.optimizers.values()))

    @state.setter
    def state(self, value: Mapping) -> None:
        """Hand each entry to the child holding its parameter (``Optimizer.__init__`` sets an empty one)."""
        joint = self.state
        for p, entry in value.items():
            joint[p] = entry

    def _share(self, groups: list[dict]) -> None:
        """Make ``groups`` (in children's order) both this optimizer's and the children's."""
        start = 0
        for o in self.optimizers.values():
            n = len(o.param_groups)
            o.param_groups = groups[start : start + n]
            start += n
        self.param_groups = groups

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # builds new group dicts and a new state dict
        self._share(self.param_groups)
        # torch's __setstate__ put the new state in __dict__, where the property hides it: hand it out
        loaded = vars(self).pop("state", {})
        for o in self.optimizers.values():
            o.state = defaultdict(dict)
        self.state = loaded

    @torch.no_grad()
    def step(self, closure=None):
        loss = evaluate_closure(closure)
        for o in self.optimizers.values():
            o.step()
        return loss


Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer]


def as_optimizer_list(optimizer: Optimizers) -> list[torch.optim.Optimizer]:
    """``optimizer`` as a list: one optimizer, or a list/tuple of optimizers over disjoint parameters
    (a user's own ``torch.optim.Muon`` on the matrices and ``AdamW`` on the rest, say)."""
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if not optimizers:
        raise CurvlabError("no optimizer given")
    bad = [type(o).__name__ for o in optimizers if not isinstance(o, torch.optim.Optimizer)]
    if bad:
        raise CurvlabError(f"not a torch.optim.Optimizer: {', '.join(bad)}")
    seen: set[int] = set()
    for o in optimizers:
        ids = {id(p) for g in o.param_groups for p in g["params"]}
        if ids & seen:
            raise CurvlabError("the optimizers given share a parameter: each parameter must have one optimizer")
        seen |= ids
    return optimizers
