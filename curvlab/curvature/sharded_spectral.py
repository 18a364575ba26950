r"""Lanczos and Hutchinson on the Hessian of sharded parameters, with sharded basis vectors.

Here the vectors are parameter dicts laid out like the (sharded) parameters of a
:class:`~curvlab.engine.hvp.CurvaturePoint`, so each rank holds 1/N of every basis vector, and the inner
products are all-reduced: every rank runs the same small tridiagonal eigenproblem. Random vectors are
drawn one full parameter at a time from a seeded generator, so they are those a single process draws.

* :func:`sharded_lanczos`: the k extreme eigenpairs by Lanczos with full reorthogonalization, stopping
  as :func:`curvlab.curvature.spectral.lanczos` does; the basis is ``iterations`` sharded vectors.
* :func:`sharded_hutchinson`: :math:`\operatorname{tr} H \approx \frac1N\sum_i z_i^\top H z_i` with
  Rademacher :math:`z_i`, and its standard error.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor

from curvlab.curvature.spectral import TraceResult
from curvlab.engine import params as param_dicts
from curvlab.engine.dtensors import resolved
from curvlab.engine.hvp import CurvaturePoint
from curvlab.errors import CurvlabError

SCHEMA_VERSION = 1


def random_direction(params: Mapping[str, Tensor], seed: int, *, kind: str = "gaussian") -> param_dicts.Params:
    """A Gaussian or Rademacher direction laid out like ``params``, the same for any sharding: each
    parameter's full tensor is drawn from a generator seeded by ``(seed, its position)``, and a rank
    keeps its shard."""
    out = {}
    for i, (n, p) in enumerate(params.items()):
        g = torch.Generator().manual_seed(seed * 1_000_003 + i)
        full = torch.randn(p.shape, generator=g, dtype=torch.float64)
        if kind == "rademacher":
            full = torch.sign(full) + (full == 0)
        full = full.to(device=p.device, dtype=p.dtype)
        if isinstance(p, DTensor):  # (every rank drew the same tensor: each keeps its shard, no communication)
            full = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
        out[n] = full
    return out


@dataclass(frozen=True)
class ShardedEigenResult:
    """Extreme eigenpairs of a sharded Hessian; ``eigenvectors`` are parameter dicts sharded like the
    parameters, the rest as :class:`curvlab.curvature.spectral.EigenResult`'s, whose JSON keys it has."""

    eigenvalues: Tensor
    eigenvectors: list[param_dicts.Params]
    residuals: Tensor
    num_matvecs: int
    iterations: int
    converged: bool
    which: str

    # by hand: EigenResult's keys, with what a sharded Lanczos does not vary written as constants
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA_VERSION,
            "eigenvalues": self.eigenvalues.tolist(),
            "residuals": self.residuals.tolist(),
            "num_matvecs": self.num_matvecs,
            "iterations": self.iterations,
            "converged": self.converged,
            "algorithm": "sharded lanczos",
            "which": self.which,
            "basis_vectors": self.iterations,
            "restarts": 0,
        }


def _axpy(y: param_dicts.Params, x: param_dicts.Params, a: float) -> param_dicts.Params:
    return {n: y[n] + a * x[n] for n in y}


def _orthogonalize(w: param_dicts.Params, basis: list[param_dicts.Params]) -> param_dicts.Params:
    """``w`` minus its projection on the orthonormal ``basis``, twice (classical Gram-Schmidt); the
    inner products with the whole basis come in one all-reduce per pass."""
    sharded = [n for n in w if isinstance(w[n], DTensor)]
    plain = [n for n in w if n not in sharded]
    for _ in range(2):
        rows = [{n: torch.sum(w[n].double() * u[n].double()) for n in w} for u in basis]
        c = torch.zeros(len(basis), dtype=torch.float64)
        if sharded:
            c = c + resolved(torch.stack([torch.stack([r[n] for n in sharded]).sum() for r in rows])).cpu()
        if plain:
            c = c + torch.stack([torch.stack([r[n] for n in plain]).sum() for r in rows]).cpu()
        for u, coefficient in zip(basis, c.tolist()):
            w = _axpy(w, u, -coefficient)
    return w


def sharded_lanczos(
    point: CurvaturePoint, *, k: int = 1, which: str = "largest", max_iter: int = 100, tol: float = 1e-6, seed: int = 0
) -> ShardedEigenResult:
    r"""The k largest (or smallest) eigenpairs of the Hessian at ``point`` (see the module docstring)."""
    if which not in ("largest", "smallest"):
        raise CurvlabError(f"which must be 'largest' or 'smallest', got {which!r}")
    if k < 1 or max_iter < k:
        raise CurvlabError(f"need 1 <= k <= max_iter, got k={k}, max_iter={max_iter}")
    params = point.params
    q = random_direction(params, seed)
    q = param_dicts.scale(q, 1.0 / param_dicts.norm(q))
    basis, alphas, betas = [q], [], []
    matvecs, theta, S = 0, np.zeros(0), np.zeros((0, 0))
    for j in range(max_iter):
        w = point.hvp(basis[-1])
        matvecs += 1
        alphas.append(param_dicts.dot(w, basis[-1]))
        w = _orthogonalize(w, basis)
        beta = param_dicts.norm(w)
        T = np.diag(alphas) + np.diag(betas, 1) + np.diag(betas, -1)
        theta, S = np.linalg.eigh(T)
        order = np.argsort(-theta if which == "largest" else theta)[:k]
        scale = max(float(np.abs(theta).max()), np.finfo(float).tiny)
        small = beta <= 1e-12 * scale
        if len(order) == k and (small or all(beta * abs(S[-1, i]) <= tol * scale for i in order)):
            break
        if small:  # the Krylov space closed before k pairs: go on from a fresh direction
            w = _orthogonalize(random_direction(params, seed + j + 1), basis)
            beta = param_dicts.norm(w)
        betas.append(beta)
        basis.append(param_dicts.scale(w, 1.0 / beta))
    order = np.argsort(-theta if which == "largest" else theta)[:k]
    vectors, residuals = [], []
    for i in order:
        u = param_dicts.scale(basis[0], float(S[0, i]))
        for b, s in zip(basis[1 : S.shape[0]], S[1:, i]):
            u = _axpy(u, b, float(s))
        hu = point.hvp(u)
        matvecs += 1
        vectors.append(u)
        residuals.append(param_dicts.norm(_axpy(hu, u, -float(theta[i]))))
    scale = max(float(np.abs(theta).max()), np.finfo(float).tiny)
    residuals = np.array(residuals, dtype=np.float64)
    return ShardedEigenResult(
        eigenvalues=torch.from_numpy(np.array(theta[order], dtype=np.float64)),
        eigenvectors=vectors,
        residuals=torch.from_numpy(residuals),
        num_matvecs=matvecs,
        iterations=len(alphas),
        converged=bool((residuals <= 10 * tol * scale).all()),
        which=which,
    )


def sharded_hutchinson(point: CurvaturePoint, *, samples: int = 64, seed: int = 0) -> TraceResult:
    r"""Hutchinson's :math:`\operatorname{tr} H \approx \frac1N \sum_i z_i^\top H z_i` with Rademacher
    :math:`z_i` (:func:`random_direction` with seeds ``seed, seed + 1, ...``), and its standard error."""
    if samples < 2:
        raise CurvlabError("Hutchinson needs at least 2 samples for a standard error")
    values = []
    for i in range(samples):
        z = random_direction(point.params, seed + i, kind="rademacher")
        values.append(param_dicts.dot(z, point.hvp(z)))
    v = np.array(values)
    return TraceResult(float(v.mean()), float(v.std(ddof=1) / math.sqrt(len(v))), samples, "hutchinson", samples)
