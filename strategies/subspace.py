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

from tpflower.mapping import TableMapping, chunks

#: eigenvalues of the Ritz system below this fraction of its largest are dropped (the outputs of a converging run
#: become nearly dependent). The system is formed in float64 whatever the run's precision (float32 outputs are
#: exact in it); a cutoff at float32's level dropped the slow directions that matter (measured: the chain of the
#: schema matrix +3.35% from the exact ridge after 10 epochs at 7.6e-6, 0.000% at 1e-10 and 1e-12)
RCOND = 1e-12


class TableSubspace:
    """The last ``memory`` pairs (Y_i, h_i) per table and the Ritz point of the ridge objective over their span."""

    def __init__(self, memory: int, mapping: TableMapping, y: np.ndarray):
        if memory < 1:
            raise ValueError(f"subspace memory must be >= 1, got {memory}")
        self.memory, self.mapping = int(memory), mapping
        self.y = np.asarray(y, dtype=np.float64).reshape(-1)
        self.Y: list[dict[str, np.ndarray]] = []  # the messages, as sent (n_i x 1 each)
        self.h: list[dict[str, np.ndarray]] = []  # the outputs they produced, as received
        self.rho: list[float] = []

    def add(self, Y: Mapping[str, np.ndarray], h: Mapping[str, np.ndarray], rho: float) -> None:
        """One epoch's pair: the Y_i the tables received with penalty ``rho`` and the h_i they replied."""
        self.Y.append({t: np.asarray(v) for t, v in Y.items()})
        self.h.append({t: np.asarray(v) for t, v in h.items()})
        self.rho.append(float(rho))
        if len(self.h) > self.memory:
            self.Y.pop(0)
            self.h.pop(0)
            self.rho.pop(0)

    def basis(self, table: str) -> np.ndarray:
        """The table's stored outputs as columns (n_i x k, float64)."""
        return np.stack([np.asarray(h[table], dtype=np.float64).reshape(-1) for h in self.h], axis=1)

    def point(self) -> dict[str, np.ndarray]:
        """h_i* (n_i x 1, float64) of the Ritz point c* = argmin F (module doc)."""
        p, N, k = self.mapping.p, self.mapping.N, len(self.h)
        tables = list(p)
        V = {t: self.basis(t) for t in tables}
        rho = np.asarray(self.rho)
        n = k * len(tables)
        K, rhs = np.zeros((n, n)), np.zeros(n)
        for b, t in enumerate(tables):  # beta Theta_i^T Theta_i from the theta-update's normal equations
            G = self.mapping.G(t).astype(np.float64)
            Ys = np.stack([np.asarray(Y[t], dtype=np.float64).reshape(-1) for Y in self.Y], axis=1)
            B = -(Ys.T @ V[t] + rho[:, None] * ((V[t].T * G) @ V[t])) / N
            K[b * k : (b + 1) * k, b * k : (b + 1) * k] = 0.5 * (B + B.T)
        for s in chunks(N):  # the data term over the joined rows, chunk by chunk
            J = np.concatenate([V[t][p[t][s]] for t in tables], axis=1)
            K += J.T @ J / N
            rhs += J.T @ self.y[s] / N
        w, U = np.linalg.eigh(0.5 * (K + K.T))
        keep = w > RCOND * max(float(w[-1]), np.finfo(np.float64).tiny)
        c = U[:, keep] @ ((U[:, keep].T @ rhs) / w[keep])
        return {t: (V[t] @ c[b * k : (b + 1) * k])[:, None] for b, t in enumerate(tables)}
