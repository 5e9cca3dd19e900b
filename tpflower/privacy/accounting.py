"""RDP accounting of feature DP (TablePuppet Sec. 4.3.2; docs/algorithms.md, Privacy): sigma calibration,
the epsilon of an accountant history, the per-step sample rate of a table row and the planned step counts.
Opacus is imported on first use (it pulls in torch)."""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Iterable, Sequence

import numpy as np

from tpflower.params import nonnegative_finite, number, positive_finite, probability, rate

#: Opacus' ``RDPAccountant.DEFAULT_ALPHAS``: the RDP orders every epsilon here is computed at (kept here so the
#: settings check needs no torch; tests/test_privacy.py compares them)
RDP_ORDERS: tuple[float, ...] = tuple([1 + x / 10.0 for x in range(1, 100)] + [float(a) for a in range(12, 64)])
#: the largest sigma Opacus' ``get_noise_multiplier`` tries: 10 doubled while at most its MAX_SIGMA 1e6
LARGEST_SIGMA = 655360.0
#: what makes a plan's epsilon reachable: a larger epsilon, fewer steps or a smaller sample rate
PLAN_FIX = (
    "raise privacy.epsilon, train fewer epochs, use a larger batch (fewer steps), or set privacy.sample_rate=batch "
    "(SGD: the paper's q = B / N)"
)


def smallest_epsilon(delta: float) -> float:
    """The smallest epsilon the RDP accountant reports at ``delta`` however much noise is added: the conversion
    of RDP to (epsilon, delta)-DP (Balle et al. 2020, Thm. 21, Opacus' ``get_privacy_spent``) at RDP 0, the
    least over :data:`RDP_ORDERS` (about 0.103 at delta 1e-5)."""
    a = np.asarray(RDP_ORDERS)
    return float(np.min(-(math.log(delta) + np.log(a)) / (a - 1) + np.log((a - 1) / a)))


def epsilon_floor_problem(epsilon: float, delta: float) -> str | None:
    """Why no number of steps or noise reaches ``epsilon`` at ``delta`` (below :func:`smallest_epsilon`), naming
    the settings and what to set; None when some noise does."""
    floor = smallest_epsilon(delta)
    if epsilon > floor:
        return None
    enough = math.ceil(floor * 100) / 100
    return (
        f"privacy.epsilon={epsilon:g} is below {floor:.3g}, the smallest epsilon the RDP accountant reaches at "
        f"privacy.delta={delta:g} however much noise DP-SGD adds: set privacy.epsilon={enough:g} or more "
        "(or a larger privacy.delta)"
    )


def plan_problem(epsilon: float, delta: float, sample_rate: float, steps: int) -> str | None:
    """Why no noise multiplier Opacus searches (up to :data:`LARGEST_SIGMA`) makes ``steps`` DP steps at
    ``sample_rate`` spend at most ``epsilon`` at ``delta``: one line naming the setting, the plan and what to
    change; None when one does. One accountant evaluation (cached per sample rate)."""
    floor = epsilon_floor_problem(epsilon, delta)
    if floor is not None:
        return floor
    if steps < 1 or rdp_epsilon([(LARGEST_SIGMA, sample_rate, steps)], delta) <= epsilon:
        return None
    return (
        f"privacy.epsilon={epsilon:g} (privacy.delta={delta:g}) is too small for the run's {steps:,} DP steps at "
        f"sample rate {sample_rate:.3g}: no noise multiplier up to {LARGEST_SIGMA:g} reaches it; {PLAN_FIX}"
    )


def noise_multiplier_for(epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
    """The smallest sigma (within Opacus' binary-search tolerance 0.01 in epsilon) such that ``steps`` steps
    of the Poisson-subsampled Gaussian mechanism at rate ``sample_rate`` spend at most ``epsilon`` at
    ``delta`` under the RDP accountant (``opacus.accountants.utils.get_noise_multiplier``). A budget no noise
    reaches is a ValueError of one line (:func:`plan_problem`), not Opacus' "The privacy budget is too low"."""
    epsilon = positive_finite("epsilon", epsilon)
    delta = probability("delta", delta)
    sample_rate = rate("sample_rate", sample_rate)
    steps = int(steps)
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    floor = epsilon_floor_problem(epsilon, delta)
    if floor is not None:
        raise ValueError(f"{floor} (the run plans {steps:,} DP steps at sample rate {sample_rate:.3g})")
    try:
        return _noise_multiplier(epsilon, delta, sample_rate, steps)
    except ValueError as exc:  # Opacus: "The privacy budget is too low." (sigma beyond its MAX_SIGMA)
        problem = plan_problem(epsilon, delta, sample_rate, steps)
        if problem is None:
            raise
        raise ValueError(problem) from exc


@functools.lru_cache(maxsize=256)
def _noise_multiplier(epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
    """Opacus' binary search (up to seconds for q < 1), once per setting and process."""
    with warnings.catch_warnings():  # the binary search probes huge sigmas, where the best RDP order is the largest
        warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
        return float(
            opacus_api().get_noise_multiplier(
                target_epsilon=epsilon, target_delta=delta, sample_rate=sample_rate, steps=steps, accountant="rdp"
            )
        )


def rdp_epsilon(history: Iterable[Sequence[float]], delta: float) -> float:
    """epsilon spent at ``delta`` by a history of ``(noise_multiplier, sample_rate, steps)`` (RDP accountant).

    The same numbers as ``RDPAccountant.get_epsilon`` (bit for bit: Opacus computes the RDP of ``steps`` steps
    as ``steps`` times that of one step, at its default orders), with the one-step RDP of each
    ``(sigma, q)`` cached: a client reports its epsilon after every step, and the uncached accountant costs
    ~0.2 s per call for q < 1. The "optimal order is the largest alpha" warning is silenced (the bound is
    valid, only possibly loose). Never below 0: at a large ``delta`` (0.5, say) the conversion (Balle et al.
    2020, Thm. 21) goes negative, and no mechanism is better than 0-DP.
    """
    hist = checked_history(history)
    if not hist:
        return 0.0
    delta = probability("delta", delta)
    rdp = sum([_rdp_one_step(float(sigma), float(q)) * steps for sigma, q, steps in hist])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
        orders = opacus_api().RDPAccountant.DEFAULT_ALPHAS
        eps, _ = opacus_api().rdp.get_privacy_spent(orders=orders, rdp=rdp, delta=delta)
    return max(0.0, float(eps))


@functools.lru_cache(maxsize=1024)
def _rdp_one_step(sigma: float, q: float) -> np.ndarray:
    orders = opacus_api().RDPAccountant.DEFAULT_ALPHAS
    rdp = opacus_api().rdp.compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=orders)
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
        if g > N - B:
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


def checked_history(history: Iterable[Sequence[float]]) -> list[tuple[float, float, int]]:
    out: list[tuple[float, float, int]] = []
    for entry in history:
        items = list(entry)
        if len(items) != 3:
            raise ValueError(
                f"accountant history entries must be (noise_multiplier, sample_rate, steps), got {entry!r}"
            )
        sigma = nonnegative_finite("accountant history noise_multiplier", items[0])
        q = rate("sample_rate", items[1])
        steps = number("accountant history steps", items[2])
        if steps < 0 or steps != int(steps):
            raise ValueError(f"accountant history steps must be a non-negative integer, got {items[2]!r}")
        out.append((sigma, q, int(steps)))
    return out


def opacus_api():
    """The Opacus names this module uses (imported on first use).

    Opacus' import calls ``logging.basicConfig`` (opacus/utils/module_utils.py): in a process whose root logger
    had no handler (the deployed ServerApp's) that handler printed every record the loggers pass on, Flower's
    DEBUG lines included, into the run's output; it is removed again."""
    import logging  # noqa: PLC0415
    import types  # noqa: PLC0415  with the Opacus names below: loaded on first use

    root = logging.getLogger()
    before = list(root.handlers)
    try:
        from opacus import GradSampleModule  # noqa: PLC0415  Opacus imports torch: the settings stay torch-free
        from opacus.accountants import RDPAccountant  # noqa: PLC0415  Opacus imports torch: the settings stay torch-free
        from opacus.accountants.analysis import rdp  # noqa: PLC0415  Opacus imports torch: the settings stay torch-free
        from opacus.accountants.utils import get_noise_multiplier  # noqa: PLC0415  Opacus imports torch: the settings stay torch-free
        from opacus.optimizers import DPOptimizer  # noqa: PLC0415  Opacus imports torch: the settings stay torch-free
    finally:
        for handler in [h for h in root.handlers if h not in before]:
            root.removeHandler(handler)

    return types.SimpleNamespace(
        GradSampleModule=GradSampleModule,
        RDPAccountant=RDPAccountant,
        rdp=rdp,
        get_noise_multiplier=get_noise_multiplier,
        DPOptimizer=DPOptimizer,
    )
