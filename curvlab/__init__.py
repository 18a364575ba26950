"""curvlab: exact curvature analysis of neural-network optimizers (NDS, Taylor split, block matrix).

The public API, by layer (each imports only the ones above it in this list). Every curvature function
takes ``(loss_fn, params, batch, <directions>)`` positionally and its options by keyword only, named
alike everywhere: ``method`` (the HVP method, :data:`METHODS`), ``dtype``, ``chunk_size``, ``blocks``,
``block_method`` (:data:`BLOCK_METHODS`) and ``scope`` (:data:`SCOPES`, or parameter names); each
``f`` of a :class:`CurvaturePoint` has its ``f_at(point, ...)``.

The training layer (the monitor, its Trainer and Lightning callbacks, ``restore_lightning``) is not
imported by ``import curvlab``: its names here are loaded on first use (:func:`__getattr__`), and live in
:mod:`curvlab.runs.monitor` and :mod:`curvlab.runs.checkpoint`.
"""

import importlib
from importlib import metadata as _metadata

# the imports and __all__ go by layer, bottom up, as tests/test_layers.py orders them
# isort: off
# models: the GPT of the experiments, and the roles that say which parameters are hidden matrices
from curvlab.models.gpt import GPT, get_config
from curvlab.models.roles import parameter_roles

# engine: losses over parameter dicts, exact Hessian-vector products at a point, operators
from curvlab.engine import params
from curvlab.engine.exact import exact_second_order
from curvlab.engine.forward import evaluate_loss, forward_quadratic_form, forward_quadratic_forms
from curvlab.engine.hvp import METHODS, CurvaturePoint, gradient_and_hvps, hvp, hvps
from curvlab.engine.loss import Batches, make_loss_fn, token_cross_entropy
from curvlab.engine.operator import Operator, hessian_operator, hessian_operator_at, preconditioned_operator

# curvature: a direction's curvature over a scope, NDS, the Taylor split, the block matrix, spectra,
# the preconditioned sharpness
from curvlab.curvature.groupings import group_parameters, hidden_matrices
from curvlab.curvature.preconditioned import preconditioned_sharpness, preconditioned_sharpness_at
from curvlab.curvature.scope import SCOPES, DirectionCurvature
from curvlab.curvature.spectral import EigenResult, hutch_plus_plus, hutchinson, lanczos, spectral_density
from curvlab.curvature.taylor import (
    BLOCK_METHODS,
    BlockMatrix,
    TaylorSplit,
    block_matrix,
    block_matrix_at,
    nds,
    nds_at,
    taylor_split,
    taylor_split_and_block_matrix,
    taylor_split_and_block_matrix_at,
    taylor_split_at,
)

# optim: optimizers by name, Adam's preconditioner and its edge of stability
from curvlab.optim.adam import adam_edge_of_stability, adam_preconditioner
from curvlab.optim.build import build_optimizer
from curvlab.optim.model_optimizer import trainable_parameters
from curvlab.optim.polar import msign

# steps: the side-effect-free next update Z of any optimizer, and the sharpness its step sees
from curvlab.steps.stability_point import StabilityPoint, stability_point
from curvlab.steps.update import next_update

# isort: on
try:  # pyproject.toml states the version, once; records read the same metadata (curvlab.util.versions)
    __version__ = _metadata.version("curvlab")
except _metadata.PackageNotFoundError:  # a source tree on the path that was never installed
    __version__ = "0+unknown"

# runs (the training layer), loaded on first use: name -> its module
_LAZY = {
    "CurvatureMonitor": "curvlab.runs.monitor",
    "MonitorRow": "curvlab.runs.monitor",
    "add_trainer_curvature_callback": "curvlab.runs.monitor",
    "lightning_curvature_callback": "curvlab.runs.monitor",
    "trainer_curvature_callback": "curvlab.runs.monitor",
    "restore_lightning": "curvlab.runs.checkpoint",
}


def __getattr__(name: str):
    """A training-layer name of :data:`__all__`, imported from its module on first access (PEP 562), so
    that ``import curvlab`` loads no training code."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'curvlab' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [  # noqa: RUF022 (by layer, as the imports)
    # models
    "GPT",
    "get_config",
    "parameter_roles",
    # engine
    "METHODS",
    "Batches",
    "CurvaturePoint",
    "Operator",
    "evaluate_loss",
    "exact_second_order",
    "forward_quadratic_form",
    "forward_quadratic_forms",
    "gradient_and_hvps",
    "hessian_operator",
    "hessian_operator_at",
    "hvp",
    "hvps",
    "make_loss_fn",
    "params",
    "preconditioned_operator",
    "token_cross_entropy",
    # curvature
    "BLOCK_METHODS",
    "SCOPES",
    "BlockMatrix",
    "DirectionCurvature",
    "EigenResult",
    "TaylorSplit",
    "block_matrix",
    "block_matrix_at",
    "group_parameters",
    "hidden_matrices",
    "hutch_plus_plus",
    "hutchinson",
    "lanczos",
    "nds",
    "nds_at",
    "preconditioned_sharpness",
    "preconditioned_sharpness_at",
    "spectral_density",
    "taylor_split",
    "taylor_split_and_block_matrix",
    "taylor_split_and_block_matrix_at",
    "taylor_split_at",
    # optim
    "adam_edge_of_stability",
    "adam_preconditioner",
    "build_optimizer",
    "msign",
    "trainable_parameters",
    # steps
    "StabilityPoint",
    "next_update",
    "stability_point",
    # runs (loaded on first use)
    "CurvatureMonitor",
    "MonitorRow",
    "add_trainer_curvature_callback",
    "lightning_curvature_callback",
    "restore_lightning",
    "trainer_curvature_callback",
]
