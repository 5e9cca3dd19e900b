"""Differential privacy for TablePuppet (Sec. 4.3; ALGORITHMS.md, Privacy): label DP, feature DP, accounting.

Two separate mechanisms, as in the paper:

* **Label DP** (:func:`randomize_labels`), applied once by the label owner before the labels leave it.
  Classification (Eq. 25): ``y_hat = argmax(OneHot(y) + Laplace noise of per-coordinate standard deviation
  lambda)``; the Laplace scale is ``b = lambda / sqrt(2)`` and the one-hot vectors of two labels differ by 2
  in L1, so the release is ``epsilon = 2 / b = 2 sqrt(2) / lambda``-label-DP (000, Theorem 1; lambda = 0.5
  gives 5.66). Binary labels are two classes. Regression: clip to ``[lo, hi]`` and add Laplace noise of
  scale ``(hi - lo) / epsilon`` (sensitivity ``hi - lo``).
* **Feature DP** (:class:`DPLocalTrainer`): DP-SGD (Abadi et al. 2016) on ONE client's local model, with
  Opacus (``GradSampleModule`` for per-row gradients, ``DPOptimizer`` for clipping and noise, an
  ``RDPAccountant`` for the budget). The privacy unit is one row of that client's table.

  - SGD (Eq. 12): the per-row term of row u is ``Y_iu^T dh_iu/dtheta``. ``Y_iu`` already sums ``dl/dH``
    over all the joined rows of the batch that come from u (Eq. 10), so one table row is ONE per-sample
    gradient however often it occurs in the batch; it is clipped to norm C as a whole. The step is
    ``theta -= lr [ (sum_u clip_C(g_u) + N(0, sigma^2 C^2 I)) / |B| + beta dR/dtheta ]``.
  - ADMM (Eq. 16): the theta-update becomes DP-SGD (or DP-Adam) over the table's rows, per-row term
    ``Y_u^T f_u + rho G_u / 2 ||f_u||^2`` (the closed form of the linear model is not private).
  - LoU SGD (Eq. 18): each shard sends ``sum_u clip_C(g_u) + N(0, sigma^2 C^2 I) + beta G_sum dR/dtheta``
    (:meth:`DPLocalTrainer.partial_gradient`); LoU ADMM (Eq. 22): :meth:`DPLocalTrainer.admm_update` with
    the prox term as regulariser.

  **The regulariser** ``beta R(theta)`` does not depend on any row: it is not a per-sample term, so it is
  neither clipped nor counted in the sensitivity. Its gradient ``beta dR/dtheta`` (autograd of
  ``beta * regularizer(module)``, outside the Opacus hooks) is added to ``p.grad`` AFTER Opacus has clipped,
  summed, noised and divided the data term, right before the inner optimiser's step. Adding a
  data-independent vector is post-processing and costs no privacy. Folding it into the per-row terms
  instead would clip it together with each row's data gradient (shrinking the regulariser whenever rows are
  clipped, and spending the clipping budget C on a term that needs none).

**What the guarantee covers.** Each local DP step is a subsampled Gaussian mechanism on the rows of table i
for whatever Y the server sent (sensitivity C: removing a row removes exactly one clipped term), and the
accountant composes all steps. The paper (Sec. 4.3.2) and ALGORITHMS.md call every message a client sends
post-processing of the DP model. That is true of theta_i and of anything computed from theta_i and public
inputs, but NOT of the forward messages ``h_iu = f_i(theta_i; T_iu)``: they are evaluated on the private rows
themselves (for a linear model h_u is a linear projection of x_u), and the server's later messages depend on
them. So the reported epsilon is that of the sequence of noisy local-model updates, not of the whole
transcript; the forward messages carry no formal feature-DP guarantee.

**Sampling assumption.** Opacus' RDP accountant bounds the *Poisson*-subsampled Gaussian mechanism: every
record joins a step independently with probability q. See :func:`table_row_sample_rate` for the q of a
TABLE row under the server's batches of JOINED rows, and :meth:`DPLocalTrainer.admm_update` for the local
(client-side) sampling of the ADMM theta-update.

**Noise randomness.** The clients draw every noise and sampling generator's seed from the operating system
(``secrets``): nothing the server knows (run seed, table, shard) can regenerate the noise, in a simulation as
in a deployment. ``DPLocalTrainer(seed=...)`` exists for unit tests of the trainer only; with a seed, the generator of a trainer rebuilt by :meth:`DPLocalTrainer.from_state` is seeded
from ``(seed, steps taken so far)``, so a client rebuilt per Flower message never replays the noise of an
earlier step.

Config (``conf/privacy/*.yaml``, checked by :func:`validate_privacy`): ``name`` (none | label | dpsgd |
label_dpsgd), ``epsilon`` and ``delta`` (feature DP target per client), ``clip`` (C), ``label_lambda``
(classification), ``label_range`` and ``label_epsilon`` (regression), ``sample_rate`` (worst_row | batch).
"""

from __future__ import annotations

import functools
import math
import secrets
import zlib
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
# Opacus is imported where it is used: it pulls in torch.distributed and sympy (about 1 s per process), which
# a run without feature DP, and the server, never need.
from torch import Tensor, nn

from tpflower.models import l2_penalty
from tpflower.owner import uses_feature_dp, uses_label_dp  # noqa: F401  (part of this module's API)

PRIVACY_NAMES: tuple[str, ...] = ("none", "label", "dpsgd", "label_dpsgd")
TASKS: tuple[str, ...] = ("regression", "binary", "multiclass")

#: Which algorithm supports which privacy is declared in its registry entry (tpflower.registry:
#: feature_dp, label_dp) and passed to :func:`validate_privacy`. Feature DP needs a client that runs DP-SGD on
#: its local model with a TABLE row as the privacy unit. VFL baselines qualify only because the client sums
#: the expanded (duplicated) rows of one table row before clipping (it expanded its table with p_i itself);
#: clipping per joined row would make the unit a joined row and the sensitivity of a table row G_max * C. The
#: same holds for VFL-ADMM: summing the expanded rows' terms of one table row gives exactly TP-Join-ADMM's
#: per-row term (Y_u, G_u) of Eq. 16. LoU (tp_ucq_*): every shard adds the FULL noise sigma C to its own
#: partial gradient (:meth:`DPLocalTrainer.partial_gradient`): the server sees each shard's message
#: separately, so each message alone must be the Gaussian mechanism on that shard's rows. The coordinator's
#: sum then carries sqrt(Q_i) sigma C of noise; adding it once per table step (sigma / sqrt(Q_i) per shard)
#: would need secure aggregation, which this project does not have.


# ----------------------------------------------------------------------------------------------------------
# Label DP
# ----------------------------------------------------------------------------------------------------------


def label_epsilon(lam: float) -> float:
    """epsilon of classification label DP with per-coordinate Laplace standard deviation ``lam``: ``2 sqrt(2)/lam``.

    (000, Theorem 1.) ``label_epsilon(0.5) = 5.657``.
    """
    lam = _positive_finite(lam, "label_lambda")
    return 2.0 * math.sqrt(2.0) / lam


def label_lambda(epsilon: float) -> float:
    """The inverse of :func:`label_epsilon`: the per-coordinate Laplace std giving ``epsilon``-label-DP."""
    epsilon = _positive_finite(epsilon, "label_epsilon")
    return 2.0 * math.sqrt(2.0) / epsilon


def randomize_class_labels(y: np.ndarray, n_classes: int, lam: float, rng: np.random.Generator) -> np.ndarray:
    """Eq. 25: ``argmax(OneHot(y) + Laplace(scale = lam / sqrt(2)))`` per row; ``label_epsilon(lam)``-label-DP.

    ``y``: class ids in ``[0, n_classes)`` (binary: 0/1, bool, or floats 0.0/1.0). Returns the noisy labels
    with ``y``'s dtype (so float 0/1 stays float, int ids stay int). ``rng`` is a numpy ``Generator``.
    """
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    n_classes = int(n_classes)
    if n_classes < 2:
        raise ValueError(f"n_classes must be >= 2, got {n_classes}")
    lam = _positive_finite(lam, "label_lambda")
    y = np.asarray(y)
    if y.ndim != 1:
        raise ValueError(f"labels must be a 1-d array, got shape {y.shape}")
    ids = y.astype(np.float64) if y.dtype.kind in "fb" else y
    bad = y.size and (not np.all(np.isfinite(ids)) or np.any(ids != np.round(ids)))
    if bad or (y.size and (ids.min() < 0 or ids.max() >= n_classes)):
        raise ValueError(f"labels must be class ids in [0, {n_classes}); got values in [{ids.min()}, {ids.max()}]")
    ids = ids.astype(np.int64)
    scores = rng.laplace(loc=0.0, scale=lam / math.sqrt(2.0), size=(len(ids), n_classes))
    scores[np.arange(len(ids)), ids] += 1.0
    return np.argmax(scores, axis=1).astype(y.dtype, copy=False)


def randomize_regression_labels(
    y: np.ndarray, lo: float, hi: float, epsilon: float, rng: np.random.Generator
) -> np.ndarray:
    """``clip(y, lo, hi) + Laplace(scale = (hi - lo) / epsilon)``: ``epsilon``-label-DP (sensitivity hi - lo).

    Returns float64 (float32 if ``y`` is float32). The result is not clipped again (the noise is unbiased).
    """
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    lo, hi = _label_range((lo, hi))
    epsilon = _positive_finite(epsilon, "label_epsilon")
    y = np.asarray(y)
    if y.ndim != 1:
        raise ValueError(f"labels must be a 1-d array, got shape {y.shape}")
    dtype = y.dtype if y.dtype in (np.float32, np.float64) else np.float64
    yf = y.astype(np.float64)
    if not np.all(np.isfinite(yf)):
        raise ValueError("regression labels contain NaN or infinite values")
    noisy = np.clip(yf, lo, hi) + rng.laplace(loc=0.0, scale=(hi - lo) / epsilon, size=yf.shape)
    return noisy.astype(dtype, copy=False)


def randomize_labels(
    y: np.ndarray, task: str, privacy_cfg: Mapping[str, Any], rng: np.random.Generator, n_classes: int | None = None
) -> np.ndarray:
    """Label DP by task and config: the label owner calls this once, before sending its labels.

    ``task``: regression | binary | multiclass (``n_classes`` required for multiclass; binary is 2 classes).
    Uses ``privacy_cfg.label_lambda`` (classification) or ``label_range`` and ``label_epsilon`` (regression).
    """
    if task == "regression":
        lo, hi = _label_range(privacy_cfg.get("label_range"))
        return randomize_regression_labels(y, lo, hi, _cfg_number(privacy_cfg, "label_epsilon"), rng)
    if task == "binary":
        return randomize_class_labels(y, 2, _cfg_number(privacy_cfg, "label_lambda"), rng)
    if task == "multiclass":
        if n_classes is None:
            raise ValueError("randomize_labels: n_classes is required for task 'multiclass'")
        return randomize_class_labels(y, n_classes, _cfg_number(privacy_cfg, "label_lambda"), rng)
    raise ValueError(f"unknown task {task!r}; expected one of {list(TASKS)}")


def label_keep_probability(lam: float, n_classes: int) -> float:
    """P(y_hat = y) under :func:`randomize_class_labels`: ``E[F(1 + L)^(C-1)]``, L ~ Laplace(lam/sqrt 2).

    F is the Laplace CDF (a row keeps its label iff its own noisy score 1 + L_y beats the C - 1 others).
    Binary closed form: ``1 - exp(-1/b) (2 + 1/b) / 4``. Computed by quadrature (error < 1e-6). A wrong label
    is uniform over the other C - 1 classes (symmetry).
    """
    lam = _positive_finite(lam, "label_lambda")
    n_classes = int(n_classes)
    if n_classes < 2:
        raise ValueError(f"n_classes must be >= 2, got {n_classes}")
    b = lam / math.sqrt(2.0)
    if n_classes == 2:
        return 1.0 - math.exp(-1.0 / b) * (2.0 + 1.0 / b) / 4.0
    x = np.linspace(-40.0 * b, 40.0 * b, 400_001)
    pdf = np.exp(-np.abs(x) / b) / (2.0 * b)
    z = x + 1.0
    cdf = np.where(z < 0, 0.5 * np.exp(np.minimum(z, 0.0) / b), 1.0 - 0.5 * np.exp(-np.maximum(z, 0.0) / b))
    return float(np.trapezoid(pdf * cdf ** (n_classes - 1), x))


# ----------------------------------------------------------------------------------------------------------
# Accounting helpers
# ----------------------------------------------------------------------------------------------------------


def noise_multiplier_for(epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
    """The smallest sigma (within Opacus' binary-search tolerance 0.01 in epsilon) such that ``steps`` steps
    of the Poisson-subsampled Gaussian mechanism at rate ``sample_rate`` spend at most ``epsilon`` at
    ``delta`` under the RDP accountant (``opacus.accountants.utils.get_noise_multiplier``)."""
    epsilon = _positive_finite(epsilon, "epsilon")
    delta = _probability(delta, "delta")
    sample_rate = _sample_rate(sample_rate)
    steps = int(steps)
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    return _noise_multiplier(epsilon, delta, sample_rate, steps)


@functools.lru_cache(maxsize=256)
def _noise_multiplier(epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
    """Opacus' binary search (up to seconds for q < 1), once per setting and process."""
    with warnings.catch_warnings():  # the binary search probes huge sigmas, where the best RDP order is the largest
        warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
        return float(
            _opacus().get_noise_multiplier(
                target_epsilon=epsilon, target_delta=delta, sample_rate=sample_rate, steps=steps, accountant="rdp"
            )
        )


def rdp_epsilon(history: Iterable[Sequence[float]], delta: float) -> float:
    """epsilon spent at ``delta`` by a history of ``(noise_multiplier, sample_rate, steps)`` (RDP accountant).

    The same numbers as ``RDPAccountant.get_epsilon`` (bit for bit: Opacus computes the RDP of ``steps`` steps
    as ``steps`` times that of one step, at its default orders), with the one-step RDP of each
    ``(sigma, q)`` cached: a client reports its epsilon after every step, and the uncached accountant costs
    ~0.2 s per call for q < 1. The "optimal order is the largest alpha" warning is silenced (the bound is
    valid, only possibly loose).
    """
    hist = _history(history)
    if not hist:
        return 0.0
    delta = _probability(delta, "delta")
    rdp = sum([_rdp_one_step(float(sigma), float(q)) * steps for sigma, q, steps in hist])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
        eps, _ = _opacus().rdp.get_privacy_spent(orders=_opacus().RDPAccountant.DEFAULT_ALPHAS, rdp=rdp, delta=delta)
    return float(eps)


@functools.lru_cache(maxsize=1024)
def _rdp_one_step(sigma: float, q: float) -> np.ndarray:
    rdp = _opacus().rdp.compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=_opacus().RDPAccountant.DEFAULT_ALPHAS)
    rdp.setflags(write=False)
    return rdp


def table_row_sample_rate(batch_size: int, n_joined: int, max_multiplicity: int, sampling: str = "shuffle") -> float:
    """The per-step probability q that a row of table i takes part in a TP-Join-SGD batch (the q to account).

    The server draws batches of ``batch_size`` JOINED rows out of ``n_joined``; row u of table i takes part
    (u in U_i) iff at least one of its G_iu joined rows is drawn. DP is worst case over rows, so q is the
    probability for the most duplicated row, ``g = max_u G_iu``:

    * ``"shuffle"`` (what the server does: shuffle [N] each epoch, consecutive batches): one batch is a
      uniform draw without replacement, ``q = 1 - prod_{k<g} (N - B - k) / (N - k)`` (<= g B / N).
    * ``"poisson"`` (joined rows drawn independently with p = B / N): table-i rows are then drawn
      independently (each joined row belongs to exactly one row of T_i) with rate ``1 - (1 - p)^G_iu``; the
      worst is ``q = 1 - (1 - p)^g``. This is exactly the Poisson sampling the RDP accountant assumes (rows
      with a smaller G_iu have a smaller rate, which only helps).

    With ``"shuffle"`` the accountant's Poisson bound is the usual approximation (Opacus does the same for
    shuffled loaders); it is not a proof: batches of one epoch are not independent (a row with G = 1 occurs
    exactly once per epoch). Note also that g is a statistic of the join (data-dependent); a public upper
    bound can be passed instead.
    """
    B, N, g = int(batch_size), int(n_joined), int(max_multiplicity)
    if N < 1 or B < 1 or g < 1:
        raise ValueError(f"batch_size, n_joined and max_multiplicity must be >= 1, got {B}, {N}, {g}")
    if g > N:
        raise ValueError(f"max_multiplicity {g} exceeds the number of joined rows {N}")
    if B >= N:
        return 1.0
    if sampling == "poisson":
        return float(-math.expm1(g * math.log1p(-B / N)))
    if sampling == "shuffle":
        if N - B < g:
            return 1.0
        k = np.arange(g, dtype=np.float64)
        return float(-np.expm1(np.sum(np.log1p(-B / (N - k)))))
    raise ValueError(f"unknown sampling {sampling!r}; expected 'shuffle' or 'poisson'")


def sgd_steps(epochs: int, n_joined: int, batch_size: int) -> int:
    """Local DP steps of one TP-Join-SGD client over a run: one per batch, ``epochs * ceil(N / B)``."""
    return int(epochs) * math.ceil(int(n_joined) / min(int(batch_size), int(n_joined)))


def admm_steps(epochs: int, local_epochs: int, n_active: int, batch_size: int) -> int:
    """Local DP steps of one TP-Join-ADMM client over a run: ``epochs * local_epochs * ceil(n_a / b)``."""
    if int(n_active) < 1:
        return 0
    return int(epochs) * int(local_epochs) * math.ceil(int(n_active) / min(int(batch_size), int(n_active)))


# ----------------------------------------------------------------------------------------------------------
# Feature DP: DP-SGD on one client's local model
# ----------------------------------------------------------------------------------------------------------


def _device_of(model: nn.Module) -> torch.device:
    """The device of a model's parameters (the CPU for a model without any)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


class DPLocalTrainer:
    """DP-SGD for ONE client's local model f_i (Opacus), with its own RDP accountant.

    Wraps ``model`` in an Opacus ``GradSampleModule`` (hooks on the model itself: the parameters are the same
    objects, no copy) and steps it with a ``DPOptimizer`` (flat clipping at ``max_grad_norm`` = C, Gaussian
    noise ``noise_multiplier * C`` on the sum of clipped per-row gradients). Every DP step records
    ``(noise_multiplier, sample_rate)`` in the accountant; :meth:`epsilon` reports the budget spent.

    Opacus clips with the factor ``min(1, C / (||g_u|| + 1e-6))`` (so a clipped row has norm just below C).

    State between Flower messages: :meth:`state_dict` (the plain module state, no ``_module.`` prefix) and
    :meth:`accountant_state` (a list of ``[sigma, q, steps]``); rebuild with :meth:`from_state`.
    Use :meth:`predict` (no autograd) for forward messages: a forward pass with autograd on, in train mode,
    makes the Opacus hooks store activations for a backward pass that never comes.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        noise_multiplier: float,
        max_grad_norm: float,
        sample_rate: float | None = None,
        seed: int | None = None,
        secure_mode: bool = False,
        regularizer: Callable[[nn.Module], Tensor] = l2_penalty,
        history: Iterable[Sequence[float]] = (),
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch nn.Module, got {type(model).__name__}")
        self.noise_multiplier = _nonnegative_finite(noise_multiplier, "noise_multiplier")
        self.max_grad_norm = _positive_finite(max_grad_norm, "max_grad_norm (clip C)")
        self.sample_rate = None if sample_rate is None else _sample_rate(sample_rate)
        self.secure_mode = bool(secure_mode)
        self.regularizer = regularizer
        if hasattr(model, "autograd_grad_sample_hooks"):
            raise ValueError(
                "this model already carries Opacus hooks (another DPLocalTrainer wraps it): reuse that trainer, "
                "call its close() first, or build the trainer on a fresh model (e.g. DPLocalTrainer.from_state)"
            )
        self._module = model
        self._gsm = _opacus().GradSampleModule(model, batch_first=True, loss_reduction="sum", strict=True)
        self.accountant = _opacus().RDPAccountant()
        self.accountant.history = _history(history)
        self.seed = None if seed is None else int(seed)
        # Opacus draws the noise on the parameters' device, with this generator: it must live there too
        self._noise_generator = torch.Generator(device=_device_of(model))
        if self.seed is None:
            self._noise_generator.manual_seed(secrets.randbits(63))
        else:
            self._noise_generator.manual_seed(_derived_seed(self.seed, self.steps))
        # plain SGD: no state; lr set per step (None for a model without parameters: steps only account)
        self._sgd = torch.optim.SGD(self._params(), lr=0.0) if self._params() else None

    # -- state ---------------------------------------------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The underlying local model (the same object that was passed in)."""
        return self._module

    @property
    def steps(self) -> int:
        """The number of DP steps recorded by the accountant."""
        return int(sum(int(s) for _, _, s in self.accountant.history))

    def state_dict(self) -> dict[str, Tensor]:
        """The local model's plain ``state_dict`` (keys as in the unwrapped module; no ``_module.`` prefix)."""
        return {k: v.detach().clone() for k, v in self._module.state_dict().items()}

    def load_state_dict(self, state_dict: Mapping[str, Tensor]) -> None:
        """Load a plain ``state_dict``; a ``_module.``-prefixed one (of a GradSampleModule) is accepted too."""
        sd = {(k[len("_module.") :] if k.startswith("_module.") else k): v for k, v in state_dict.items()}
        self._module.load_state_dict(sd)

    def accountant_state(self) -> list[list[float]]:
        """The accountant's history as ``[[sigma, q, steps], ...]`` (plain floats: JSON / Flower config safe)."""
        return [[float(s), float(q), float(int(n))] for s, q, n in self.accountant.history]

    @classmethod
    def from_state(
        cls,
        model: nn.Module,
        state_dict: Mapping[str, Tensor] | None,
        accountant_state: Iterable[Sequence[float]],
        **kwargs: Any,
    ) -> DPLocalTrainer:
        """Rebuild a trainer: load ``state_dict`` (if given) into ``model`` and restore the accountant history.

        ``kwargs`` are the constructor's (``noise_multiplier``, ``max_grad_norm``, ``sample_rate``, ``seed``...).
        """
        trainer = cls(model, history=accountant_state, **kwargs)
        if state_dict is not None:
            trainer.load_state_dict(state_dict)
        return trainer

    def epsilon(self, delta: float) -> float:
        """epsilon spent so far at ``delta`` (Opacus RDP accountant; 0 before any step, inf if sigma = 0)."""
        if not self.accountant.history:
            return 0.0
        return rdp_epsilon(self.accountant.history, delta)  # == self.accountant.get_epsilon(delta), cached

    def close(self) -> nn.Module:
        """Remove the Opacus hooks and attributes from the model and return it (the trainer is then unusable)."""
        self._gsm._close()
        return self._module

    # -- forward -------------------------------------------------------------------------------------------

    def predict(self, X: Tensor) -> Tensor:
        """``f_i(theta_i; X)`` without autograd (the forward message h_i)."""
        with torch.no_grad():
            return self._module(X)

    # -- SGD (Eq. 12-13) -----------------------------------------------------------------------------------

    def sgd_step(
        self,
        X: Tensor,
        Y: Tensor,
        batch_size: int,
        lr: float,
        beta: float,
        sample_rate: float | None = None,
    ) -> None:
        """One DP step of Eq. 12-13 on the rows U_i of the batch.

        ``theta -= lr [ (sum_u clip_C(Y_u^T dh_u/dtheta) + N(0, sigma^2 C^2)) / batch_size + beta dR/dtheta ]``

        X: ``T_i[U_i]`` (|U_i| x d_i), one row per TABLE row (unique). Y: the aggregated ``Y_iu`` (|U_i| x d_c).
        ``batch_size``: |B|, the nominal number of JOINED rows of the batch (the same divisor as the
        non-private :func:`tpflower.local_update.sgd_step`). ``sample_rate``: q of this step for the
        accountant (default: the constructor's; see :func:`table_row_sample_rate`).
        """
        q = self.sample_rate if sample_rate is None else _sample_rate(sample_rate)
        if q is None:
            raise ValueError("sgd_step needs a sample_rate (constructor or argument) for the accountant")
        X, Y = self._check_rows(X, Y)
        batch_size = int(batch_size)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if self._sgd is not None:
            for group in self._sgd.param_groups:
                group["lr"] = float(lr)

        def per_row_loss(rows: Tensor) -> Tensor:
            return (Y[rows] * self._gsm(X[rows])).sum()

        self._dp_step(self._sgd, per_row_loss, torch.arange(len(X)), float(batch_size), float(beta), q)

    def partial_gradient(
        self,
        X: Tensor,
        Y: Tensor,
        reg_weight: float,
        sample_rate: float | None = None,
    ) -> Tensor:
        """One DP step of a LoU shard (Eq. 18): the noisy, UNNORMALISED partial gradient, as one flat vector.

        ``sum_u clip_C(Y_u^T dh_u/dtheta) + N(0, sigma^2 C^2 I) + reg_weight dR/dtheta``, in the order of
        ``module.parameters()`` (zeros for a model without parameters: the step is still accounted). The model
        is not changed: the coordinator sums the shards' vectors, divides by |B| and every shard applies the
        same step (Eq. 17, 19). ``reg_weight`` is ``beta G_sum`` with G_sum the number of the batch's joined
        rows that use this shard's rows (sent by the server, which knows it): the regulariser is data
        independent given it and is added unclipped, after the noise (post-processing). Each shard adds the
        full noise (see the note on LoU at the top of this module). An empty X (the shard has no row in the batch) gives
        pure noise.
        """
        q = self.sample_rate if sample_rate is None else _sample_rate(sample_rate)
        if q is None:
            raise ValueError("partial_gradient needs a sample_rate (constructor or argument) for the accountant")
        X, Y = self._check_rows(X, Y)
        params = list(self._module.parameters())
        trainable = self._params()
        out: Tensor
        if trainable and self._sgd is not None:
            dp = _opacus().DPOptimizer(
                self._sgd,
                noise_multiplier=self.noise_multiplier,
                max_grad_norm=self.max_grad_norm,
                expected_batch_size=None,
                loss_reduction="sum",  # p.grad = sum of clipped per-row gradients + noise, not divided
                generator=self._noise_generator,
                secure_mode=self.secure_mode,
            )
            was_training = self._module.training
            self._module.train()
            dp.zero_grad(set_to_none=True)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Full backward hook is firing")
                (Y * self._gsm(X)).sum().backward()
            dp.pre_step()  # clip per row, sum, add N(0, sigma^2 C^2)
            reg_weight = float(reg_weight)
            if reg_weight != 0.0:
                reg = torch.autograd.grad(reg_weight * self.regularizer(self._module), trainable, allow_unused=True)
                with torch.no_grad():
                    for p, g in zip(trainable, reg):
                        if g is not None:
                            p.grad.add_(g)
            out = torch.cat(
                [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).clone() for p in params]
            )
            dp.zero_grad(set_to_none=True)
            self._module.train(was_training)
        else:
            out = torch.cat([torch.zeros_like(p).reshape(-1) for p in params]) if params else torch.zeros(0)
        self.accountant.step(noise_multiplier=self.noise_multiplier, sample_rate=q)
        return out

    # -- ADMM theta-update (Eq. 16) ------------------------------------------------------------------------

    def admm_update(
        self,
        X: Tensor,
        G: Tensor,
        Y: Tensor,
        N: int,
        rho: float,
        beta: float,
        epochs: int,
        lr: float,
        batch_size: int,
        generator: torch.Generator,
        sampling: str = "poisson",
        optimizer: str = "adam",
        regularizer: Callable[[nn.Module], Tensor] | None = None,
    ) -> int:
        """The DP version of :func:`tpflower.local_update.admm_update_local_opt` (Eq. 16); returns the steps taken.

        Objective: ``beta R(theta) + (1/N) sum_u phi_u`` with the per-row term
        ``phi_u = Y_u^T f_u + rho G_u / 2 ||f_u||^2`` over the n_a active rows (G_u > 0; the others have
        Y_u = 0, G_u = 0 and no gradient). Each step: per-row gradients of phi_u clipped to C, summed, plus
        N(0, sigma^2 C^2), divided by ``q N`` (an unbiased estimate of ``(1/N) sum_u grad phi_u``, as the
        non-private ``n_a / (|b| N)`` scaling), plus ``beta dR/dtheta`` (not clipped), then an Adam or SGD
        step (fresh optimiser per call, like the non-private update; it only post-processes noisy gradients).

        Sampling of the rows (``q = min(1, batch_size / n_a)``, recorded per step):

        * ``"poisson"`` (default, matches the RDP accountant exactly): ``ceil(n_a / batch_size)`` steps per
          local epoch, each including every active row independently with probability q (the batch may be
          empty; it still gets noise and is still a step). The divisor is the expected ``q N``.
        * ``"shuffle"``: the non-private scheme (a permutation of the active rows cut into batches of
          ``batch_size``); divisor ``|b| N / n_a`` of the actual batch. The Poisson accountant is then the
          usual approximation, not a proof. With sigma = 0 and a huge C this reproduces
          ``admm_update_local_opt`` with the same ``generator``.

        ``regularizer`` replaces ``R`` for this call (default: the trainer's, ``1/2 ||theta||^2``); e.g. the
        LoU shard step (Eq. 22) passes ``lambda m: rho'/2 ||theta(m) - w + u^q||^2`` with ``beta = 1``. It
        must not depend on the rows (it is added after noising, unclipped).
        """
        if sampling not in ("poisson", "shuffle"):
            raise ValueError(f"unknown sampling {sampling!r}; expected 'poisson' or 'shuffle'")
        if optimizer not in ("adam", "sgd"):
            raise ValueError(f"unknown optimizer {optimizer!r}; expected 'adam' or 'sgd'")
        X, Y = self._check_rows(X, Y)
        G = torch.as_tensor(G)
        if G.shape != (len(X),):
            raise ValueError(f"G must have shape ({len(X)},), got {tuple(G.shape)}")
        N, batch_size, epochs = int(N), int(batch_size), int(epochs)
        if N < 1 or batch_size < 1 or epochs < 0:
            raise ValueError(f"need N >= 1, batch_size >= 1, epochs >= 0; got {N}, {batch_size}, {epochs}")
        active = torch.nonzero(G > 0).flatten()
        n_a = len(active)
        if n_a == 0 or epochs == 0:
            return 0
        q = min(1.0, batch_size / n_a)
        Gf = G.to(Y.dtype)
        rho = float(rho)
        params = self._params()
        inner: torch.optim.Optimizer | None = None
        if params:
            inner = torch.optim.Adam(params, lr=lr) if optimizer == "adam" else torch.optim.SGD(params, lr=lr)

        def per_row_loss(rows: Tensor) -> Tensor:
            f = self._gsm(X[rows])
            return (Y[rows] * f).sum() + 0.5 * rho * (Gf[rows, None] * f * f).sum()

        steps = 0
        per_epoch = math.ceil(n_a / min(batch_size, n_a))
        for _ in range(epochs):
            if sampling == "poisson":
                for _ in range(per_epoch):
                    if q >= 1.0:
                        rows = active
                    else:
                        rows = active[torch.rand(n_a, generator=generator, dtype=torch.float64) < q]
                    self._dp_step(inner, per_row_loss, rows, q * N, float(beta), q, regularizer)
                    steps += 1
            else:
                perm = active[torch.randperm(n_a, generator=generator)]
                for s in range(0, n_a, batch_size):
                    rows = perm[s : s + batch_size]
                    self._dp_step(inner, per_row_loss, rows, len(rows) * N / n_a, float(beta), q, regularizer)
                    steps += 1
        return steps

    # -- internals -----------------------------------------------------------------------------------------

    def _params(self) -> list[nn.Parameter]:
        return [p for p in self._module.parameters() if p.requires_grad]

    def _check_rows(self, X: Tensor, Y: Tensor) -> tuple[Tensor, Tensor]:
        X, Y = torch.as_tensor(X), torch.as_tensor(Y)
        if X.dim() != 2 or Y.dim() != 2 or len(X) != len(Y):
            raise ValueError(
                f"X and Y must be 2-d with the same number of rows, got {tuple(X.shape)}, {tuple(Y.shape)}"
            )
        return X, Y

    def _dp_step(
        self,
        inner: torch.optim.Optimizer | None,
        per_row_loss: Callable[[Tensor], Tensor],
        rows: Tensor,
        divisor: float,
        beta: float,
        sample_rate: float,
        regularizer: Callable[[nn.Module], Tensor] | None = None,
    ) -> None:
        """clip each row's gradient of ``per_row_loss`` (a SUM over rows) to C, add noise, divide, add beta dR, step."""
        params = self._params()
        if params and inner is not None:
            dp = _opacus().DPOptimizer(
                inner,
                noise_multiplier=self.noise_multiplier,
                max_grad_norm=self.max_grad_norm,
                expected_batch_size=divisor,
                loss_reduction="mean",  # p.grad = (sum of clipped + noise) / expected_batch_size
                generator=self._noise_generator,
                secure_mode=self.secure_mode,
            )
            was_training = self._module.training
            self._module.train()
            dp.zero_grad(set_to_none=True)
            with warnings.catch_warnings():  # inputs do not require grad: torch warns about the full backward hook
                warnings.filterwarnings("ignore", message="Full backward hook is firing")
                per_row_loss(rows).backward()
            dp.pre_step()  # clip per row, sum, add N(0, sigma^2 C^2), divide by `divisor` (no step yet)
            if beta != 0.0:
                R = (regularizer or self.regularizer)(self._module)
                reg = torch.autograd.grad(beta * R, params, allow_unused=True)
                with torch.no_grad():
                    for p, g in zip(params, reg):
                        if g is not None:
                            p.grad.add_(g)
            inner.step()
            dp.zero_grad(set_to_none=True)  # drop grad_sample / summed_grad
            self._module.train(was_training)
        self.accountant.step(noise_multiplier=self.noise_multiplier, sample_rate=sample_rate)


def make_trainer(
    model: nn.Module,
    privacy_cfg: Mapping[str, Any],
    *,
    sample_rate: float,
    steps: int,
    seed: int | None = None,
    history: Iterable[Sequence[float]] = (),
) -> DPLocalTrainer:
    """A :class:`DPLocalTrainer` calibrated so that ``steps`` steps at ``sample_rate`` spend ``privacy_cfg.epsilon``
    at ``privacy_cfg.delta`` (``sigma = noise_multiplier_for(...)``), clipping at ``privacy_cfg.clip``."""
    sigma = noise_multiplier_for(
        _cfg_number(privacy_cfg, "epsilon"), _cfg_number(privacy_cfg, "delta"), sample_rate, steps
    )
    return DPLocalTrainer(
        model,
        noise_multiplier=sigma,
        max_grad_norm=_cfg_number(privacy_cfg, "clip"),
        sample_rate=sample_rate,
        seed=seed,
        history=history,
    )


# ----------------------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------------------




def validate_privacy(privacy_cfg: Mapping[str, Any], algorithm: str, task: str, *, feature_dp: bool,
                     label_dp: bool = True, why_not: str = "") -> None:
    """Refuse, before training, privacy settings that are impossible or that ``algorithm`` cannot honour.

    Checks (ValueError naming the setting and the value): ``name`` in none | label | dpsgd | label_dpsgd;
    label DP: classification ``label_lambda`` > 0, regression a finite ``label_range [lo, hi]`` with
    ``lo < hi`` and ``label_epsilon`` > 0; feature DP: ``epsilon`` > 0 (finite), ``0 < delta < 1``,
    ``clip`` > 0. ``feature_dp`` / ``label_dp``: whether the algorithm supports them (its registry entry);
    ``why_not`` says why feature DP is not supported (shown in the error). ``privacy=none`` ignores the rest.
    """
    name = privacy_cfg.get("name", "none")
    if name not in PRIVACY_NAMES:
        raise ValueError(f"privacy.name must be one of {list(PRIVACY_NAMES)}, got {name!r}")
    if name == "none":
        return
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {list(TASKS)}")
    if uses_label_dp(privacy_cfg):
        if not label_dp:
            raise ValueError(f"privacy={name}: label DP is not supported for algorithm {algorithm!r}")
        if task == "regression":
            _label_range(privacy_cfg.get("label_range"), f"privacy={name} (regression labels)")
            _positive_finite(_cfg_get(privacy_cfg, "label_epsilon"), f"privacy={name}: privacy.label_epsilon")
        else:
            _positive_finite(_cfg_get(privacy_cfg, "label_lambda"), f"privacy={name}: privacy.label_lambda")
    if uses_feature_dp(privacy_cfg):
        if not feature_dp:
            why = why_not or "it is not known to support DP-SGD on local models"
            raise ValueError(f"privacy={name}: feature DP (DP-SGD) cannot be honoured by algorithm {algorithm!r}: {why}")
        _positive_finite(_cfg_get(privacy_cfg, "epsilon"), f"privacy={name}: privacy.epsilon")
        _probability(_cfg_get(privacy_cfg, "delta"), f"privacy={name}: privacy.delta")
        _positive_finite(_cfg_get(privacy_cfg, "clip"), f"privacy={name}: privacy.clip (clipping norm C)")


def privacy_summary(
    privacy_cfg: Mapping[str, Any], task: str, feature_epsilon: float | None = None
) -> dict[str, float | None]:
    """The ``privacy`` entry of results.json: ``{"label_epsilon", "feature_epsilon", "delta"}`` (None if unused).

    ``feature_epsilon``: the spent epsilon to report (e.g. the max over clients of
    :meth:`DPLocalTrainer.epsilon`); defaults to the configured target.
    """
    label_eps: float | None = None
    feat_eps: float | None = None
    delta: float | None = None
    if uses_label_dp(privacy_cfg):
        if task == "regression":
            label_eps = _cfg_number(privacy_cfg, "label_epsilon")
        else:
            label_eps = label_epsilon(_cfg_number(privacy_cfg, "label_lambda"))
    if uses_feature_dp(privacy_cfg):
        feat_eps = float(feature_epsilon) if feature_epsilon is not None else _cfg_number(privacy_cfg, "epsilon")
        delta = _cfg_number(privacy_cfg, "delta")
    return {"label_epsilon": label_eps, "feature_epsilon": feat_eps, "delta": delta}


#: The privacy settings a client needs, as flat Flower config scalars (the keys message carries them).
_MESSAGE_FIELDS: tuple[str, ...] = ("epsilon", "delta", "clip", "label_lambda", "label_epsilon")
_MESSAGE_WORDS: tuple[str, ...] = ("sample_rate",)  # sent as strings


def privacy_message(privacy_cfg: Mapping[str, Any] | None) -> dict[str, Any]:
    """``privacy_cfg`` as flat scalars for a Flower config (``{}`` for privacy=none).

    Keys ``privacy`` (the name) and ``privacy.<field>``; ``label_range`` travels as ``privacy.label_lo`` and
    ``privacy.label_hi`` (Flower config values are scalars). :func:`privacy_from_message` inverts it.
    """
    if privacy_cfg is None or str(privacy_cfg.get("name", "none")) == "none":
        return {}
    out: dict[str, Any] = {"privacy": str(privacy_cfg.get("name"))}
    for key in _MESSAGE_FIELDS:
        value = _cfg_get(privacy_cfg, key)
        if value is not None:
            out[f"privacy.{key}"] = float(value)
    for key in _MESSAGE_WORDS:
        if _cfg_get(privacy_cfg, key) is not None:
            out[f"privacy.{key}"] = str(_cfg_get(privacy_cfg, key))
    rng = _cfg_get(privacy_cfg, "label_range")
    if rng is not None:
        lo, hi = list(rng)
        out["privacy.label_lo"], out["privacy.label_hi"] = float(lo), float(hi)
    return out


def privacy_from_message(config: Mapping[str, Any]) -> dict[str, Any]:
    """The privacy settings carried by a config made with :func:`privacy_message` (``{"name": "none"}`` if none)."""
    name = config.get("privacy")
    if not name:
        return {"name": "none"}
    out: dict[str, Any] = {"name": str(name)}
    for key in _MESSAGE_FIELDS + _MESSAGE_WORDS:
        if f"privacy.{key}" in config:
            out[key] = config[f"privacy.{key}"]
    if "privacy.label_lo" in config:
        out["label_range"] = [config["privacy.label_lo"], config["privacy.label_hi"]]
    return out


def label_rng() -> np.random.Generator:
    """The numpy Generator of a label owner's label DP: seeded from the operating system's entropy, never from
    anything the server knows (a seed the server could guess would let it regenerate and subtract the noise)."""
    return np.random.default_rng(secrets.randbits(128))


# ----------------------------------------------------------------------------------------------------------
# Small validators
# ----------------------------------------------------------------------------------------------------------


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or value is None:
        raise ValueError(f"{what} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number, got {value!r}") from None


def _positive_finite(value: Any, what: str) -> float:
    x = _number(value, what)
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"{what} must be a finite number > 0, got {value!r}")
    return x


def _nonnegative_finite(value: Any, what: str) -> float:
    x = _number(value, what)
    if not (math.isfinite(x) and x >= 0):
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}")
    return x


def _probability(value: Any, what: str) -> float:
    x = _number(value, what)
    if not (0.0 < x < 1.0):
        raise ValueError(f"{what} must be in (0, 1), got {value!r}")
    return x


def _sample_rate(value: Any) -> float:
    x = _number(value, "sample_rate")
    if not (0.0 < x <= 1.0):
        raise ValueError(f"sample_rate must be in (0, 1], got {value!r}")
    return x


def _label_range(value: Any, what: str = "label_range") -> tuple[float, float]:
    if value is None or isinstance(value, (str, bytes)):
        raise ValueError(f"{what}: privacy.label_range must be [lo, hi] with finite lo < hi, got {value!r}")
    try:
        items = list(value)
    except TypeError:
        raise ValueError(f"{what}: privacy.label_range must be [lo, hi] with finite lo < hi, got {value!r}") from None
    if len(items) != 2:
        raise ValueError(f"{what}: privacy.label_range must be [lo, hi] with finite lo < hi, got {value!r}")
    lo, hi = (_number(v, f"{what}: privacy.label_range") for v in items)
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(f"{what}: privacy.label_range must be [lo, hi] with finite lo < hi, got {items!r}")
    return lo, hi


def _cfg_get(cfg: Mapping[str, Any], key: str) -> Any:
    return cfg.get(key) if hasattr(cfg, "get") else None


def _cfg_number(cfg: Mapping[str, Any], key: str) -> float:
    return _number(_cfg_get(cfg, key), f"privacy.{key}")


def _history(history: Iterable[Sequence[float]]) -> list[tuple[float, float, int]]:
    out: list[tuple[float, float, int]] = []
    for entry in history:
        items = list(entry)
        if len(items) != 3:
            raise ValueError(
                f"accountant history entries must be (noise_multiplier, sample_rate, steps), got {entry!r}"
            )
        sigma = _nonnegative_finite(items[0], "accountant history noise_multiplier")
        q = _sample_rate(items[1])
        steps = _number(items[2], "accountant history steps")
        if steps < 0 or steps != int(steps):
            raise ValueError(f"accountant history steps must be a non-negative integer, got {items[2]!r}")
        out.append((sigma, q, int(steps)))
    return out


def _derived_seed(seed: int, steps: int) -> int:
    return zlib.crc32(f"tpflower-dp-noise:{int(seed)}:{int(steps)}".encode()) * 2654435761 % 2**63


def _opacus():
    """The Opacus names this module uses (imported on first use)."""
    import types

    from opacus import GradSampleModule
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis import rdp
    from opacus.accountants.utils import get_noise_multiplier
    from opacus.optimizers import DPOptimizer

    return types.SimpleNamespace(GradSampleModule=GradSampleModule, RDPAccountant=RDPAccountant, rdp=rdp,
                                 get_noise_multiplier=get_noise_multiplier, DPOptimizer=DPOptimizer)
