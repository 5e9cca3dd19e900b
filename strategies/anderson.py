"""Safeguarded type-II Anderson acceleration of a fixed-point iteration w <- G(w).

Anderson (1965), in the form of Walker & Ni (2011): from the last m + 1 pairs (w_j, g_j = G(w_j)) with residuals
f_j = g_j - w_j, the next iterate is sum_j alpha_j g_j with alpha = argmin ||sum_j alpha_j f_j|| subject to
sum_j alpha_j = 1. For ADMM (Zhang, Peng, Hou & Wang 2019, "Accelerating ADMM for efficient simulation and
optimization"; Fu, Zhang & Boyd 2019, "Anderson accelerated Douglas-Rachford splitting") the extrapolated iterate
is kept only if its residual is below the last accepted iterate's; otherwise the iteration falls back to the
plain step from the last accepted iterate (already computed: g of that iterate) and the memory restarts. Each
iteration still evaluates G once: a rejected extrapolation costs that one evaluation, nothing more.

An iterate is a list of arrays (blocks); the inner product is sum_b sum(weight_b * a_b * b_b), accumulated in
float64 chunk by chunk, with a per-block weight (a scalar or an array broadcasting against the block).
Memory: 2 (m + 1) iterates (the g_j and f_j of the window) plus the Gram matrix of the f_j.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tpflower.mapping import chunks

Blocks = list[np.ndarray]


class Anderson:
    """Type-II Anderson acceleration with memory ``memory`` (m >= 1) and the residual safeguard (module doc)."""

    def __init__(self, memory: int, reg: float = 1e-12):
        if memory < 1:
            raise ValueError(f"Anderson memory must be >= 1, got {memory}")
        self.memory, self.reg = int(memory), float(reg)
        self.weights: Sequence[float | np.ndarray] = ()
        self.accepted = self.rejected = 0  # extrapolated iterates kept / replaced by the plain step
        self.restart()

    def restart(self, weights: Sequence[float | np.ndarray] | None = None) -> None:
        """Forget the window (a new map, e.g. a new ADMM penalty); ``weights``: the inner product's from now on."""
        if weights is not None:
            self.weights = list(weights)
        self.g: list[Blocks] = []
        self.f: list[Blocks] = []
        self.gram = np.zeros((0, 0))
        self.extrapolated = False  # whether the current iterate is an extrapolation (the safeguard tests it)
        self.best = np.inf  # the residual norm of the last accepted iterate
        self.fallback: Blocks | None = None  # G of the last accepted iterate

    def dot(self, a: Blocks, b: Blocks) -> float:
        """The weighted inner product of two iterates, in float64."""
        total = 0.0
        for x, y, w in zip(a, b, self.weights, strict=True):
            for s in chunks(len(x)):
                xs, ys = x[s].astype(np.float64), y[s].astype(np.float64)
                ws = w[s] if isinstance(w, np.ndarray) else w
                total += float(np.sum(ws * xs * ys))
        return total

    def step(self, w: Blocks, g: Blocks) -> Blocks:
        """The next iterate, given the current one ``w`` and ``g`` = G(w) (the arrays are not modified; the result
        may be ``g`` itself or the fallback, otherwise new arrays in the dtypes of ``g``)."""
        f = [gb.astype(np.float64) - wb for gb, wb in zip(g, w, strict=True)]
        residual = float(np.sqrt(self.dot(f, f)))
        if self.extrapolated:
            if not residual < self.best:  # the safeguard: back to the plain step from the last accepted iterate
                self.rejected += 1
                fallback = self.fallback
                assert fallback is not None
                self.restart()
                return fallback
            self.accepted += 1
        self.best, self.fallback = residual, g
        self.g.append(g)
        self.f.append([x.astype(g_b.dtype) for x, g_b in zip(f, g, strict=True)])
        k = len(self.f)
        gram = np.zeros((k, k))
        gram[: k - 1, : k - 1] = self.gram
        for j in range(k - 1):
            gram[j, k - 1] = gram[k - 1, j] = self.dot(self.f[j], f)
        gram[k - 1, k - 1] = residual**2
        if k > self.memory + 1:
            self.g.pop(0)
            self.f.pop(0)
            gram = gram[1:, 1:]
        self.gram = gram
        if len(self.g) < 2:
            self.extrapolated = False
            return g
        alpha = self.coefficients(self.gram)
        self.extrapolated = True
        out = []
        for b, gb in enumerate(g):
            acc = np.zeros(gb.shape, dtype=np.float64)
            for a, gj in zip(alpha, self.g, strict=True):
                acc += a * gj[b].astype(np.float64)
            out.append(acc.astype(gb.dtype))
        return out

    def coefficients(self, gram: np.ndarray) -> np.ndarray:
        """alpha = argmin alpha^T K alpha subject to sum alpha = 1 (K the Gram matrix of the residuals), i.e.
        alpha proportional to K^-1 1, with K regularized by ``reg`` times its largest diagonal entry."""
        k = len(gram)
        K = gram + self.reg * max(float(np.max(np.diag(gram))), np.finfo(np.float64).tiny) * np.eye(k)
        x = np.linalg.lstsq(K, np.ones(k), rcond=None)[0]
        total = float(np.sum(x))
        if not np.isfinite(total) or total == 0.0:
            alpha = np.zeros(k)
            alpha[-1] = 1.0
            return alpha
        return x / total
