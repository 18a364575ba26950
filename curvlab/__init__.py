"""curvlab: exact curvature analysis of neural-network optimizers (NDS, Taylor split, block matrix)."""

from importlib import metadata as _metadata

from curvlab.curvature.groupings import group_parameters, hidden_matrices
from curvlab.curvature.spectral import hutch_plus_plus, hutchinson, lanczos, spectral_density
from curvlab.curvature.taylor import (
    BlockMatrix,
    TaylorScope,
    TaylorSplit,
    block_matrix,
    block_matrix_at,
    nds,
    taylor_split,
    taylor_split_at,
)
from curvlab.engine.exact import exact_second_order
from curvlab.engine.hvp import (
    CurvaturePoint,
    evaluate_loss,
    gradient_and_hvps,
    hvp,
    hvps,
    quadratic_form,
    quadratic_forms,
)
from curvlab.engine.loss import Batches, make_loss_fn, token_cross_entropy
from curvlab.engine.operator import Operator, hessian_operator, preconditioned_operator
from curvlab.models.roles import parameter_roles
from curvlab.optim.build import build_optimizer
from curvlab.optim.model_optimizer import trainable_parameters
from curvlab.optim.polar import msign
from curvlab.optim.update import next_update
from curvlab.runs.checkpoint import restore_lightning
from curvlab.runs.monitor import (
    CurvatureMonitor,
    MonitorRow,
    add_curvature_callback,
    curvature_callback,
    curvature_lightning_callback,
)

try:  # pyproject.toml states the version, once; records read the same metadata (curvlab.util.versions)
    __version__ = _metadata.version("curvlab")
except _metadata.PackageNotFoundError:  # a source tree on the path that was never installed
    __version__ = "0+unknown"

__all__ = [
    "Batches",
    "BlockMatrix",
    "CurvatureMonitor",
    "CurvaturePoint",
    "MonitorRow",
    "Operator",
    "TaylorScope",
    "TaylorSplit",
    "add_curvature_callback",
    "block_matrix",
    "block_matrix_at",
    "build_optimizer",
    "curvature_callback",
    "curvature_lightning_callback",
    "evaluate_loss",
    "exact_second_order",
    "gradient_and_hvps",
    "group_parameters",
    "hessian_operator",
    "hidden_matrices",
    "hutch_plus_plus",
    "hutchinson",
    "hvp",
    "hvps",
    "lanczos",
    "make_loss_fn",
    "msign",
    "nds",
    "next_update",
    "parameter_roles",
    "preconditioned_operator",
    "quadratic_form",
    "quadratic_forms",
    "restore_lightning",
    "spectral_density",
    "taylor_split",
    "taylor_split_at",
    "token_cross_entropy",
    "trainable_parameters",
]
