"""What a call's fixed cost was cut to keep (issue 47, item 6; benchmarks/small_models.py): the finiteness checks
find every NaN and inf in one pass, eval_forward finds every checkpointing flag without nn.Module's own
attribute machinery, a point's gradient is never the kept graph's own tensor once read, one direction gives
the rows of a stack of one, and casting passes a tensor that needs nothing as it is."""

import math
import subprocess
import sys

import pytest
import torch
from torch import nn

from curvlab import CurvaturePoint, exact_second_order
from curvlab.engine import dtensors
from curvlab.engine import params as param_dicts
from curvlab.engine.exact import eval_forward
from tests.builders import random_direction

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.complex64]
# one vector of them all up to dtensors._FLAT entries, a norm each beyond it
SIZES = [1, 7, 1000, dtensors._FLAT + 3]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", SIZES)
def test_every_nan_and_inf_is_found_wherever_it_is(dtype, size):
    g = torch.Generator().manual_seed(0)
    other = torch.randn(5, 3, generator=g).to(dtype).t()  # (not contiguous)
    assert dtensors.all_finite([other, torch.randn(size, generator=g).to(dtype)])
    for bad in (math.nan, math.inf, -math.inf):
        for where in {0, size // 2, size - 1}:
            t = torch.randn(size, generator=g).to(dtype)
            t[where] = bad
            assert not dtensors.all_finite([other, t])
            assert param_dicts.non_finite({"other": other, "t": t}) == ["t"]


def test_finite_entries_whose_sum_overflows_are_finite_and_what_needs_no_check_passes():
    big = torch.full((100,), 3e38)  # (its float32 sum is inf)
    assert dtensors.all_finite([big, torch.full((1000,), 6e4, dtype=torch.float16)])
    assert not dtensors.all_finite([big, torch.tensor([math.inf, -math.inf])])  # (inf - inf: NaN, still caught)
    assert dtensors.all_finite([torch.zeros(0), torch.arange(3), torch.ones(2, dtype=torch.bool)])
    assert dtensors.all_finite([torch.randn(3, dtype=torch.float64), torch.randn(4).bfloat16()])


class _Flags(nn.Module):
    """Checkpointing flags in every place one can be: on the instance, a class default and a property."""

    grad_checkpointing = True  # (a class default that is on)

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(2, 2)
        self.inner.gradient_checkpointing = True
        self._on = True

    @property
    def gradient_checkpointing(self):
        return self._on

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, value):
        self._on = value


class _OwnSetattr(nn.Linear):
    """A module that sets its attributes its own way (and counts them)."""

    def __setattr__(self, name, value):
        if name == "training":
            self.__dict__["set_training"] = self.__dict__.get("set_training", 0) + 1
        super().__setattr__(name, value)


def test_eval_forward_turns_off_every_flag_and_training_and_puts_them_back():
    model = nn.Sequential(_Flags(), _OwnSetattr(2, 2), nn.BatchNorm1d(2)).train()
    before = model[1].__dict__.get("set_training", 0)
    with exact_second_order(), eval_forward(model):
        flags = model[0]
        assert (flags.gradient_checkpointing, flags.grad_checkpointing, flags.inner.gradient_checkpointing) == (
            False,
            False,
            False,
        )
        assert not any(m.training for m in model.modules() if not isinstance(m, nn.BatchNorm1d))
        assert model[2].training  # (batch norms keep their batch statistics)
    flags = model[0]
    assert flags.gradient_checkpointing and flags.grad_checkpointing and flags.inner.gradient_checkpointing
    assert all(m.training for m in model.modules())
    assert model[1].__dict__["set_training"] == before + 2  # (through its own __setattr__, off and on)


def test_a_gradient_read_while_the_graph_is_kept_is_a_copy(mlp_problem):
    loss_fn, params, batch = mlp_problem
    v = random_direction(params, 1)
    with CurvaturePoint(loss_fn, params, batch) as point:
        expected = point.hvp(v)
        gradient = point.gradient
        kept = {n: t.clone() for n, t in gradient.items()}
        for t in gradient.values():
            t.mul_(-3.0)  # (the user's to change)
        assert point.gradient is gradient
        assert all(torch.equal(a, b) for a, b in zip(point.hvp(v).values(), expected.values()))
    with CurvaturePoint(loss_fn, params, batch) as point:
        pass
    assert all(torch.equal(point.gradient[n], kept[n]) for n in params)  # (read after close: the same values)


def test_one_direction_gives_the_row_of_a_stack_of_one(transformer_problem):
    loss_fn, params, batch = transformer_problem
    v = random_direction(params, 2)
    top = {n: t for n, t in v.items() if n.startswith("lm_head")}
    with CurvaturePoint(loss_fn, params, batch) as point:
        for d in (v, top):
            one = point.hvp(d)
            stacked = point.hvps({n: t.unsqueeze(0) for n, t in d.items()})
            assert all(torch.equal(one[n], stacked[n][0]) for n in params)


def test_cast_passes_a_tensor_that_needs_nothing_as_it_is():
    plain, float64, leaf = torch.randn(3), torch.randn(3, dtype=torch.float64), torch.randn(3, requires_grad=True)
    out = param_dicts.cast({"plain": plain, "float64": float64, "leaf": leaf, "int": torch.arange(3)}, torch.float32)
    assert out["plain"] is plain
    assert out["float64"].dtype == torch.float32 and torch.equal(out["float64"], float64.float())
    assert not out["leaf"].requires_grad and out["leaf"].data_ptr() == leaf.data_ptr()
    assert out["int"].dtype == torch.int64


def test_a_process_that_compiled_nothing_does_not_import_the_compiler():
    """torch.compile's module takes about a second to import: an HVP where nothing was compiled leaves it
    unimported (and a compiled model's curvature is still the eager model's: test_compiled.py)."""
    code = (
        "import sys, torch\n"
        "from curvlab import hvp, make_loss_fn\n"
        "model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))\n"
        "params = {n: p.detach() for n, p in model.named_parameters()}\n"
        "batch = (torch.randn(5, 3), torch.randint(0, 2, (5,)))\n"
        "hv = hvp(make_loss_fn(model), params, batch, {n: torch.ones_like(p) for n, p in params.items()})\n"
        "print(sorted(hv) == sorted(params), 'torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "False"]
