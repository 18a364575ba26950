"""curvlab: exact curvature analysis of neural-network optimizers (NDS, Taylor split, block matrix)."""

from curvlab.blocks import group_parameters, hidden_matrices
from curvlab.curvature import BlockMatrix, TaylorScope, TaylorSplit, block_matrix, taylor_split
from curvlab.exact_ops import exact_second_order
from curvlab.hvp import (
    evaluate_loss,
    gradient_and_hvps,
    hvp,
    hvps,
    quadratic_form,
    quadratic_forms,
)
from curvlab.loss import Batches, make_loss_fn, token_cross_entropy
from curvlab.operator import Operator, hessian_operator, preconditioned_operator
from curvlab.optim import build_optimizer, next_update
from curvlab.polar import msign
from curvlab.spectral import hutch_plus_plus, hutchinson, lanczos, spectral_density

__version__ = "0.1.0"

__all__ = [
    "Batches",
    "BlockMatrix",
    "Operator",
    "TaylorScope",
    "TaylorSplit",
    "block_matrix",
    "build_optimizer",
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
    "next_update",
    "preconditioned_operator",
    "quadratic_form",
    "quadratic_forms",
    "spectral_density",
    "taylor_split",
    "token_cross_entropy",
]
