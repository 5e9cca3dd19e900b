"""Per-table subspace (Rayleigh-Ritz) acceleration of TP-Join-ADMM for ridge regression with linear models.

Krylov acceleration of ADMM (Zhang & White 2018, "GMRES-accelerated ADMM for quadratic objectives", SIAM J.
Optim. 28(4)) with the tables' blocks kept apart. For a linear model the theta-update (TablePuppet Eq. 16) is
linear in Y_i: theta_i = -(rho K_i + beta I)^-1 T_i^T Y_i / N with K_i = T_i^T diag(G_i) T_i / N, and the table
replies with h_i = T_i theta_i. So every output h_i^(k) the server received is T_i theta_i^(k) for a model the
table could hold, and the server knows the ridge objective on the span of each table's last m outputs:

    F(c) = 1/(2N) ||sum_i sum_k c_ik h_i^(k)[p_i] - y||^2 + beta/2 sum_i ||sum_k c_ik theta_i^(k)||^2,

where beta theta_i^(k)^T theta_i^(j) = -(Y_i^(k)^T h_i^(j) + rho_k h_i^(k)^T diag(G_i) h_i^(j)) / N follows from
the theta-update's normal equations (Y_i^(k) the message that produced theta_i^(k)). The minimiser c* of F (a
small symmetric system, M m unknowns) gives the best model in that space, h_i* = sum_k c*_ik h_i^(k), and the
server continues ADMM from the consistent state at it: z = H* = sum_i h_i*[p_i] (D = 0) and lambda = H* - y
(Eq. 8's dual, dl/dz(z), for the squared loss). ADMM's fixed point is unchanged: at the ridge optimum c* keeps
it. The span grows by one vector per table per epoch (M directions a round trip, where Anderson acceleration
and GMRES on the whole state get one), which is why it beats them on tables correlated with each other.
Post-processing of values the server holds (no message changes; the tables' code is unchanged).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from tpflower.join_counts import compact_counts
from tpflower.mapping import SegmentSums, TableMapping, chunks, segment_sum

#: eigenvalues of the Ritz system below this fraction of its largest are dropped (the outputs of a converging run
#: become nearly dependent). The system is formed in float64 whatever the run's precision (float32 outputs are
#: exact in it); a cutoff at float32's level dropped the slow directions that matter (measured: the chain of the
#: schema matrix +3.35% from the exact ridge after 10 epochs at 7.6e-6, 0.000% at 1e-10 and 1e-12)
RCOND = 1e-12


def _dots(rows: list[np.ndarray], w: np.ndarray) -> np.ndarray:
    """[r @ w for r in rows] in float64, over chunks of the rows' entries (no float64 copy of a stored row)."""
    out = np.zeros(len(rows))
    for s in chunks(len(w)):
        ws = np.asarray(w[s], np.float64)
        for j, r in enumerate(rows):
            out[j] += np.asarray(r[s], np.float64) @ ws
    return out


def _combine(c: np.ndarray, rows: list[np.ndarray]) -> np.ndarray:
    """sum_j c_j rows[j] (float64), chunk by chunk."""
    out = np.zeros(len(rows[0]))
    for s in chunks(len(out)):
        for cj, r in zip(c, rows, strict=True):
            out[s] += cj * np.asarray(r[s], np.float64)
    return out


class TableSubspace:
    """The last ``memory`` pairs (Y_i, h_i) per table and the Ritz point of the ridge objective over their span.

    The system is kept up to date as pairs arrive: a new output v of table b meets every stored output of table a
    through w_ab = S_a(v[p_b]) (the segment sums of v over a's rows, G_b v when a = b), so an epoch costs O(N M^2
    + m sum_i n_i) at the server (M tables), not O(N (M m)^2). The pairs are kept as they travelled, in ``dtype``
    (the run's precision: lossless), 2 m sum_i n_i values; the system is formed in float64."""

    def __init__(self, memory: int, mapping: TableMapping, y: np.ndarray, dtype: np.dtype | type = np.float64):
        if memory < 1:
            raise ValueError(f"subspace memory must be >= 1, got {memory}")
        self.memory, self.mapping, self.dtype = int(memory), mapping, np.dtype(dtype)
        self.tables = list(mapping.p)
        self.G = {t: compact_counts(mapping.G(t)) for t in self.tables}
        y = np.asarray(y).reshape(-1)
        # S_i y, kept in ``dtype`` (the run's precision; exact in a float64 run)
        self.ys = {t: segment_sum(mapping.p[t], y, mapping.n_rows[t]).astype(self.dtype) for t in self.tables}
        # the outputs h_i^(k) and the messages Y_i^(k) that produced them, oldest first, and their rho
        self.V: dict[str, list[np.ndarray]] = {t: [] for t in self.tables}
        self.W: dict[str, list[np.ndarray]] = {t: [] for t in self.tables}
        self.rho: list[float] = []
        n = memory * len(self.tables)
        self.data = np.zeros((n, n))  # J^T J / N over the slots (table-major: table b, slot k at b m + k)
        self.beta = np.zeros((n, n))  # blockdiag(B_i): beta Theta_i^T Theta_i
        self.rhs = np.zeros(n)  # J^T y / N

    def add(self, Y: Mapping[str, np.ndarray], h: Mapping[str, np.ndarray], rho: float) -> None:
        """One epoch's pair: the Y_i the tables received with penalty ``rho`` and the h_i they replied."""
        m, M = self.memory, len(self.tables)
        if len(self.rho) == m:  # the oldest slot leaves: shift every table's rows and block by one slot
            self.rho.pop(0)
            for rows in (*self.V.values(), *self.W.values()):
                rows.pop(0)
            keep = np.array([b * m + k for b in range(M) for k in range(1, m)])
            to = np.array([b * m + k for b in range(M) for k in range(m - 1)])
            for mat in (self.data, self.beta):
                mat[np.ix_(to, to)] = mat[np.ix_(keep, keep)]
            self.rhs[to] = self.rhs[keep]
        k, N, p, n_rows = len(self.rho), self.mapping.N, self.mapping.p, self.mapping.n_rows
        self.rho.append(float(rho))
        rhos = np.asarray(self.rho)
        for t in self.tables:
            self.V[t].append(self._kept(h[t]))
            self.W[t].append(self._kept(Y[t]))
        for b, tb in enumerate(self.tables):
            v = np.asarray(self.V[tb][k], np.float64)
            self.rhs[b * m + k] = float(_dots([self.ys[tb]], v)[0]) / N
            Gv = self.G[tb] * v
            for a, ta in enumerate(self.tables):
                w = Gv if a == b else self._cross(p[tb], p[ta], v, n_rows[ta])
                col = _dots(self.V[ta], w) / N  # (h_a^(j))^T S_a(v[p_b]) / N for every slot j of a
                self.data[a * m : a * m + k + 1, b * m + k] = col
                self.data[b * m + k, a * m : a * m + k + 1] = col
            # B_b[k, j] = -(Y^(k)^T h^(j) + rho_k h^(k)^T G h^(j)) / N, symmetrized (module doc)
            GV = _dots(self.V[tb], Gv)  # h^(j)^T G h^(k) for every slot j
            kj = -(_dots(self.V[tb], self.W[tb][k]) + rhos[k] * GV) / N
            jk = -(_dots(self.W[tb], v) + rhos[: k + 1] * GV) / N
            self.beta[b * m : b * m + k + 1, b * m + k] = 0.5 * (kj + jk)
            self.beta[b * m + k, b * m : b * m + k + 1] = 0.5 * (kj + jk)

    def _kept(self, a: np.ndarray) -> np.ndarray:
        """``a`` as a flat array in ``dtype``: a read-only array (a message's) in it as it is, else a copy."""
        a = np.asarray(a)
        return a.reshape(-1) if a.dtype == self.dtype and not a.flags.writeable else a.astype(self.dtype).reshape(-1)

    @staticmethod
    def _cross(p_b: np.ndarray, p_a: np.ndarray, v: np.ndarray, n_a: int) -> np.ndarray:
        """S_a(v[p_b]): table b's values summed into table a's rows over the joined rows, chunk by chunk."""
        sums = SegmentSums(n_a)
        for s in chunks(len(p_b)):
            sums.add(p_a[s], v[p_b[s]])
        return sums.result()

    def point(self) -> dict[str, np.ndarray]:
        """h_i* (n_i x 1, float64) of the Ritz point c* = argmin F (module doc)."""
        m, k = self.memory, len(self.rho)
        idx = np.array([b * m + j for b in range(len(self.tables)) for j in range(k)])
        K = self.data[np.ix_(idx, idx)] + self.beta[np.ix_(idx, idx)]
        w, U = np.linalg.eigh(0.5 * (K + K.T))
        keep = w > RCOND * max(float(w[-1]), np.finfo(np.float64).tiny)
        c = U[:, keep] @ ((U[:, keep].T @ self.rhs[idx]) / w[keep])
        return {t: _combine(c[b * k : (b + 1) * k], self.V[t])[:, None] for b, t in enumerate(self.tables)}
