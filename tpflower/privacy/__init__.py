"""Differential privacy for TablePuppet (Sec. 4.3 of the paper; docs/algorithms.md, Privacy).

Two separate mechanisms, as in the paper:

* **Label DP** (:func:`randomize_labels`), applied once by the label owner before the labels leave it.
  Classification (Eq. 25): ``y_hat = argmax(OneHot(y) + Laplace noise of per-coordinate standard deviation
  lambda)``; the Laplace scale is ``b = lambda / sqrt(2)`` and the one-hot vectors of two labels differ by 2
  in L1, so the release is ``epsilon = 2 / b = 2 sqrt(2) / lambda``-label-DP (TablePuppet Eq. 25; lambda = 0.5
  gives 5.66). Binary labels are two classes. Regression: clip to ``[lo, hi]`` and add Laplace noise of
  scale ``(hi - lo) / epsilon`` (sensitivity ``hi - lo``).
* **Feature DP** (:class:`~tpflower.privacy.trainer.DPLocalTrainer`): DP-SGD (Abadi et al. 2016) on ONE
  client's local model, with Opacus (``GradSampleModule`` for per-row gradients, ``DPOptimizer`` for clipping
  and noise, an ``RDPAccountant`` for the budget). The privacy unit is one row of that client's table.

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
accountant composes all steps. The paper (TablePuppet Sec. 4.3.2) calls every message a client sends
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
in a deployment. ``DPLocalTrainer(seed=...)`` exists for unit tests of the trainer only; with a seed, the
generator of a trainer rebuilt by :meth:`DPLocalTrainer.from_state` is seeded from ``(seed, steps taken so
far)``, so a client rebuilt per Flower message never replays the noise of an earlier step.

Config (``conf/privacy/*.yaml``, checked by :func:`validate_privacy`): ``name`` (none | label | dpsgd |
label_dpsgd), ``epsilon`` and ``delta`` (feature DP target per client), ``clip`` (C), ``label_lambda`` or
``label_epsilon`` (label DP's level, one of the two: epsilon = 2 sqrt(2) / lambda), ``label_range``
(regression), ``sample_rate`` (worst_row | batch).

The package, bottom up: :mod:`.settings` (the settings, their validation and wire format; no torch),
:mod:`.label` (label DP), :mod:`.accounting` (RDP accounting and sigma calibration; Opacus imported on first
use), :mod:`.trainer` (the Opacus DP-SGD trainer; torch). This package re-exports the torch-free names;
users of the trainer import :mod:`tpflower.privacy.trainer` explicitly.
"""

from tpflower.privacy.accounting import (
    admm_steps,
    noise_multiplier_for,
    plan_problem,
    rdp_epsilon,
    sgd_steps,
    table_row_sample_rate,
)
from tpflower.privacy.label import (
    label_keep_probability,
    label_rng,
    randomize_class_labels,
    randomize_labels,
    randomize_regression_labels,
)
from tpflower.privacy.settings import (
    PRIVACY_NAMES,
    TASKS,
    label_epsilon,
    label_levels,
    privacy_from_message,
    privacy_message,
    privacy_summary,
    uses_feature_dp,
    uses_label_dp,
    validate_privacy,
)

__all__ = [
    "PRIVACY_NAMES",
    "TASKS",
    "admm_steps",
    "label_epsilon",
    "label_keep_probability",
    "label_levels",
    "label_rng",
    "noise_multiplier_for",
    "plan_problem",
    "privacy_from_message",
    "privacy_message",
    "privacy_summary",
    "randomize_class_labels",
    "randomize_labels",
    "randomize_regression_labels",
    "rdp_epsilon",
    "sgd_steps",
    "table_row_sample_rate",
    "uses_feature_dp",
    "uses_label_dp",
    "validate_privacy",
]
