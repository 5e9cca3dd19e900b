"""One privacy budget per owner, across runs (docs/settings.md, Privacy; docs/threat-model.md).

Everything here lives in the owner's ``state_dir/budget/`` (files 0600, written atomically, under one file lock
per table shard, so concurrent runs on one node are serialized):

* ``<table>-<shard>-ledger.json``: the owner ledger. ``dp``: the accountant history ``[[sigma, q, steps], ...]``
  of EVERY feature-DP step this node ever released, whatever run it belonged to (fresh, restarted with the same
  run id, resumed, concurrent); the owner's total epsilon is the RDP composition of all of it and may not
  exceed ``privacy.total_epsilon``. ``eval_epsilon``: the epsilon spent by label-DP evaluations (pure DP,
  summed), bounded by ``privacy.total_eval_epsilon``.
* ``<table>-<shard>-labels-<digest>.npz``: the label-DP draw of the training labels (TablePuppet Eq. 25), made
  once per (table, shard, label column, label-DP setting) and served to every later run. A new draw only when
  the owner deletes the file (``python -m simulations.node --client-config F --reset-label-dp``).
* ``<table>-<shard>-labels-tasks.json``: the label task (task, class count) each owner setting's draw was made
  for; the task is the run's word, so a run declaring another one is refused rather than drawn for afresh.

No torch here: the RDP arithmetic is :func:`tpflower.privacy.accounting.rdp_epsilon` (Opacus on first use).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tpflower.files import atomic_write
from tpflower.params import positive_finite
from tpflower.privacy.accounting import rdp_epsilon

BUDGET_DIR = "budget"
#: the default of ``privacy.total_epsilon``: this many runs at the floor's per-run epsilon
DEFAULT_RUNS = 10
#: the default of ``privacy.eval_epsilon``: the epsilon of one label-DP evaluation (Laplace noise on the metric)
DEFAULT_EVAL_EPSILON = 1.0
#: the default of ``privacy.total_eval_epsilon``: ten runs of ten evaluations (plus the reference) each
DEFAULT_TOTAL_EVAL_EPSILON = 110.0


class BudgetExhausted(ValueError):
    """A release would exceed what the owner allows (nothing of it leaves the node)."""


# ------------------------------------------------------------------------------------------------ settings


def owner_bound(floor: Mapping[str, Any], run: Mapping[str, Any], key: str) -> float:
    """The owner's ``privacy.<key>`` (``total_epsilon``, ``eval_epsilon``, ``total_eval_epsilon``), checked,
    else its documented default (``total_epsilon``: DEFAULT_RUNS times the floor's epsilon, or the run's when
    the floor has no feature DP). The run's word is never read for these."""
    if floor.get(key) is not None:
        return positive_finite(f"privacy.{key}", floor[key])
    if key == "total_epsilon":
        return DEFAULT_RUNS * float(floor.get("epsilon") or run.get("epsilon") or 1.0)
    if key == "eval_epsilon":
        return DEFAULT_EVAL_EPSILON
    if key == "total_eval_epsilon":
        return DEFAULT_TOTAL_EVAL_EPSILON
    raise KeyError(key)


def owner_delta(floor: Mapping[str, Any], run: Mapping[str, Any]) -> float:
    """The delta the owner ledger's epsilon is read at: the floor's, else the run's (a floor without feature DP)."""
    return float(floor.get("delta") or run["delta"])


def planned_evaluations(cfg: Mapping[str, Any]) -> int:
    """The label-DP evaluations a run of ``cfg`` releases when it runs to its last epoch (docs/settings.md,
    Privacy): one per epoch (boosted trees: one per ``eval_every`` trees and the last), and the constant
    predictor's reference with the first unless the run resumes; k-means none (labels unused). Early stopping
    or a tolerance may release fewer, an ``eval_every`` within an epoch more (each still charged and bounded)."""
    algorithm = cfg.get("algorithm") or {}
    if "kmeans" in str(algorithm.get("name", "")):
        return 0
    if algorithm.get("trees") is not None:
        every = max(int(algorithm.get("eval_every") or 1), 1)
        evaluations = -(-int(algorithm["trees"]) // every)
    else:
        evaluations = max(int(cfg.get("epochs") or 1), 1)
    return evaluations + (0 if cfg.get("resume") else 1)


def spent_eval(state_dir: str | None, table: str, shard: int) -> float:
    """The label-DP evaluation epsilon a shard's ledger in ``state_dir`` holds, read without charging (0 for a
    node without a state_dir: it bounds one run, which has spent nothing at its hello)."""
    return 0.0 if state_dir is None else float(OwnerBudget(state_dir, table, shard).read().get("eval_epsilon", 0.0))


def check_eval_plan(
    spent: float, epsilon: float, total: float, evaluations: int, cfg: Mapping[str, Any] | None = None
) -> str | None:
    """What refuses a run whose ``evaluations`` of ``epsilon`` each would pass the owner's ``total`` with the
    ``spent`` its ledger already holds (at least one evaluation is asked for: a resumed run's own), and what of
    the run ``cfg`` fits in what is left (:func:`eval_room`); None if they fit. Nothing is charged: a refused
    run spends nothing."""
    need = max(evaluations, 1) * epsilon
    if spent + need <= total * (1 + 1e-12):
        return None
    left = max(total - spent, 0.0)
    return (
        f"its label-DP evaluations have spent epsilon {spent:.3g} of the {total:.3g} its owner allows over all runs "
        f"(privacy.total_eval_epsilon), {left:.3g} left; the run plans {max(evaluations, 1)} "
        f"evaluation(s) at eval_epsilon {epsilon:.3g} each, {need:.3g} in all"
        + ("" if cfg is None else f"; {eval_room(cfg, left, epsilon)}")
    )


def eval_room(cfg: Mapping[str, Any], left: float, epsilon: float) -> str:
    """What of the run ``cfg`` the ``left`` evaluation epsilon covers at ``epsilon`` per evaluation, counted as
    :func:`planned_evaluations` counts them: the most epochs (boosted trees: the most ``algorithm.trees`` at its
    ``eval_every``), or that not one evaluation fits. Of the owner's ledger it says only what the refusal says
    (its ``left``); of the run only its settings."""
    fits = int(left / epsilon * (1 + 1e-12))
    reference = 0 if cfg.get("resume") else 1
    algorithm = cfg.get("algorithm") or {}
    if fits - reference < 1:
        return (
            f"what is left covers no evaluation at eval_epsilon {epsilon:.3g}"
            if fits < 1
            else "what is left covers the reference alone, not one epoch's evaluation with it"
        )
    if algorithm.get("trees") is not None:
        every = max(int(algorithm.get("eval_every") or 1), 1)
        return (
            f"what is left covers {fits} evaluation(s): algorithm.trees={(fits - reference) * every} or fewer "
            f"(algorithm.eval_every={every}), or a larger algorithm.eval_every"
        )
    return f"what is left covers {fits} evaluation(s): epochs={fits - reference} or fewer"


def feature_room(
    history: Iterable[Sequence[float]], total: float, owner_delta: float, run_delta: float, q: float, steps: int
) -> str:
    """What of a feature-DP plan of ``steps`` DP steps at sample rate ``q`` fits in the owner's ``total`` (at
    ``owner_delta``) beside the ledger's ``history``, by the accountant the run uses (Opacus' RDP accountant):
    the largest ``privacy.epsilon`` (at the run's ``run_delta``) whose calibrated noise composes with the ledger
    within ``total``, or that none does. Its inputs are the refusal's own (the ledger, the plan's steps and sample
    rate, which the run's plan line prints): nothing of the table beyond them. The search is over sigma, the one
    thing a run's privacy.epsilon sets once its plan is fixed (fewer epochs are calibrated to the same epsilon,
    which barely changes what the run composes to: docs/settings.md, Privacy)."""
    from tpflower.privacy.accounting import LARGEST_SIGMA, smallest_epsilon  # noqa: PLC0415

    history = merged(history)
    left = max(total - rdp_epsilon(history, owner_delta), 0.0)

    def fits(sigma: float) -> bool:
        with warnings.catch_warnings():  # a small sigma probed: its best RDP order is the smallest
            warnings.filterwarnings("ignore", message="Optimal order is the smallest alpha")
            return rdp_epsilon(merged([*history, [sigma, q, float(steps)]]), owner_delta) <= total

    head = f"epsilon {left:.3g} is left"
    if steps < 1 or not fits(LARGEST_SIGMA):
        return f"{head}, which no noise makes this plan's {steps:,} DP steps at sample rate {q:.3g} fit"
    lo, hi = 1e-2, LARGEST_SIGMA  # fits(hi); find the least sigma that fits, in log scale to 0.1%
    if fits(lo):
        hi = lo
    while hi / lo > 1.001:
        mid = (lo * hi) ** 0.5
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    run_epsilon = rdp_epsilon([[hi, q, float(steps)]], run_delta)
    shown = float(f"{run_epsilon * 0.999:.3g}")  # rounded down: Opacus calibrates within 0.01 below it
    if shown <= smallest_epsilon(run_delta):
        return f"{head}, below what any privacy.epsilon of this plan ({steps:,} DP steps at sample rate {q:.3g}) spends"
    return f"{head}: this plan ({steps:,} DP steps at sample rate {q:.3g}) fits at privacy.epsilon={shown:g} or less"


def check_feature_room(
    state_dir: str | None, table: str, shard: int, floor: Mapping[str, Any], run: Mapping[str, Any]
) -> str | None:
    """What refuses a feature-DP run at its hello: the owner ledger in ``state_dir`` has spent all of its
    ``privacy.total_epsilon`` (at the owner's delta), so any DP step would pass it; None while room is left
    (the run's own plan is checked against the room when it arrives, before any DP step). Read without
    charging; a node without a state_dir bounds one run, which has spent nothing at its hello."""
    if state_dir is None:
        return None
    budget = OwnerBudget(state_dir, table, shard)
    history = budget.read()["dp"]
    if not history:
        return None
    total = owner_bound(floor, run, "total_epsilon")
    spent = rdp_epsilon(merged(history), owner_delta(floor, run))
    if spent < total:
        return None
    return (
        f"its feature-DP steps have spent epsilon {spent:.3g} of the {total:.3g} its owner allows over all runs "
        "(privacy.total_epsilon): no DP step is left"
    )


# ------------------------------------------------------------------------------------------------ histories


def merged(history: Iterable[Sequence[float]]) -> list[list[float]]:
    """An accountant history with the steps of equal ``(sigma, q)`` added up (RDP composes additively)."""
    out: dict[tuple[float, float], int] = {}
    for sigma, q, n in history:
        out[(float(sigma), float(q))] = out.get((float(sigma), float(q)), 0) + int(n)
    return [[s, q, float(n)] for (s, q), n in out.items() if n > 0]


def added(before: Iterable[Sequence[float]], after: Iterable[Sequence[float]]) -> list[list[float]]:
    """The steps in ``after`` that are not in ``before`` (per ``(sigma, q)``): what one message released."""
    old = {(s, q): n for s, q, n in merged(before)}
    return [[s, q, n - old.get((s, q), 0.0)] for s, q, n in merged(after) if n > old.get((s, q), 0.0)]


def steps_of(history: Iterable[Sequence[float]]) -> int:
    return int(sum(int(n) for _, _, n in history))


# ------------------------------------------------------------------------------------------------ files


def private_write(path: Path, data: bytes) -> None:
    """``data`` to ``path`` atomically, readable by the owner only (0600, in a 0700 folder)."""
    atomic_write(path, data, dir_mode=0o700)


def npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.asarray(a))
    return buf.getvalue()


class OwnerBudget:
    """The budget files of one table shard under its owner's ``state_dir`` (module docstring)."""

    def __init__(self, state_dir: str | Path, table: str, shard: int):
        self.dir = Path(state_dir) / BUDGET_DIR
        self.name = f"{table}-{int(shard)}"
        self.ledger = self.dir / f"{self.name}-ledger.json"

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Exclusive access to this shard's budget (an OS file lock: concurrent runs and processes wait)."""
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.dir / f"{self.name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def read(self) -> dict[str, Any]:
        if not self.ledger.is_file():
            return {"dp": [], "eval_epsilon": 0.0}
        return json.loads(self.ledger.read_text())

    def write(self, ledger: Mapping[str, Any]) -> None:
        private_write(self.ledger, json.dumps(dict(ledger), sort_keys=True).encode())

    # -------------------------------------------------------------------------------------------- feature DP

    def spent(self, delta: float, plus: Iterable[Sequence[float]] = ()) -> float:
        """The owner's total feature-DP epsilon at ``delta`` over every run, with ``plus`` added."""
        return rdp_epsilon(merged(list(self.read()["dp"]) + list(plus)), delta)

    def charge_dp(
        self,
        new: list[list[float]],
        run_ledger: Path | None,
        check: Callable[[list[list[float]], list[list[float]]], None],
    ) -> list[list[float]]:
        """Charge the steps ``new`` to this run's ledger (``run_ledger``, an .npy of every step of the run in any
        process; None: the run has no id) and to the owner ledger, under the lock. ``check(run_after,
        owner_after)`` raises to refuse (then nothing is written). Returns the run's history after."""
        with self.locked():
            run_old = np.load(run_ledger).tolist() if run_ledger is not None and run_ledger.is_file() else []
            run_after = merged(run_old + new)
            ledger = self.read()
            owner_after = merged(list(ledger["dp"]) + new)
            check(run_after, owner_after)
            if run_ledger is not None:
                private_write(run_ledger, npy_bytes(np.asarray(run_after, dtype=np.float64).reshape(-1, 3)))
            self.write({**ledger, "dp": owner_after})
        return run_after

    # -------------------------------------------------------------------------------------------- label DP

    def charge_eval(self, epsilon: float, total: float, where: str) -> float:
        """Charge one label-DP evaluation of ``epsilon``; refused beyond ``total``. Returns the total after."""
        with self.locked():
            ledger = self.read()
            after = float(ledger.get("eval_epsilon", 0.0)) + float(epsilon)
            if after > total * (1 + 1e-12):
                raise BudgetExhausted(
                    f"{where}: this evaluation would bring the label-DP evaluations of this node to epsilon "
                    f"{after:.3g}; its owner allows {total:.3g} over all runs (privacy.total_eval_epsilon)"
                )
            self.write({**ledger, "eval_epsilon": after})
        return after

    def labels_path(self, key: Mapping[str, Any]) -> Path:
        digest = setting_digest(key)
        return self.dir / f"{self.name}-labels-{digest}.npz"

    @property
    def label_tasks(self) -> Path:
        """The label task each owner setting's draw was made for (``{digest of the owner's setting: task}``)."""
        return self.dir / f"{self.name}-labels-tasks.json"

    def stored_labels(
        self,
        key: Mapping[str, Any],
        y: np.ndarray,
        row_ids: np.ndarray,
        draw: Callable[[], np.ndarray],
        where: str,
        owner: tuple[Mapping[str, Any], Mapping[str, Any]] | None = None,
    ) -> np.ndarray:
        """The randomized labels for ``key`` (the setting they were drawn under): the stored draw, else
        ``draw()`` once, stored. A draw over other rows or other labels is refused (the owner resets it).

        ``owner``: (the owner's own label-DP setting, the label task the run declares: task and class count).
        The task is the run's word, so it must not buy a new draw: once a draw was made under an owner setting,
        a run declaring another task (a regression label as multiclass, a class list padded with classes no
        row holds) is refused rather than drawn for afresh (each fresh draw would be one more vote for the true
        label: docs/threat-model.md, label DP across runs)."""
        path = self.labels_path(key)
        fingerprint = hashlib.sha256(np.ascontiguousarray(y).tobytes()).hexdigest()
        with self.locked():
            tasks = json.loads(self.label_tasks.read_text()) if owner and self.label_tasks.is_file() else {}
            setting = setting_digest(owner[0]) if owner else ""
            if owner and not path.is_file() and tasks.get(setting, dict(owner[1])) != dict(owner[1]):
                made, asked = tasks[setting], dict(owner[1])
                declared = (
                    f"a {asked.get('task')} label"
                    if asked.get("task") != made.get("task")
                    else f"its {asked.get('task')} label with other classes"
                )
                raise BudgetExhausted(
                    f"{where}: its label-DP draw under its owner's setting was made for a {made.get('task')} label; "
                    f"the run declares {declared}, which would need a new draw (one per owner setting, so that runs "
                    "cannot average the noise away); a new draw is the owner's decision "
                    "(python -m simulations.node --client-config FILE --reset-label-dp)"
                )
            if owner and setting not in tasks:
                private_write(self.label_tasks, json.dumps({**tasks, setting: dict(owner[1])}, sort_keys=True).encode())
            if path.is_file():
                with np.load(path) as saved:
                    if str(saved["fingerprint"]) != fingerprint or not np.array_equal(saved["row_ids"], row_ids):
                        raise BudgetExhausted(
                            f"{where}: its labels changed since the label-DP draw kept in its state_dir; a new draw "
                            "is the owner's decision (python -m simulations.node --client-config FILE --reset-label-dp)"
                        )
                    return saved["y"]
            noisy = np.asarray(draw())
            buf = io.BytesIO()
            np.savez(buf, y=noisy, row_ids=np.asarray(row_ids), fingerprint=np.asarray(fingerprint))
            private_write(path, buf.getvalue())
            return noisy


def setting_digest(setting: Mapping[str, Any]) -> str:
    """A short name of a label-DP setting (its JSON, keys sorted, hashed): a stored draw's file, a task's key."""
    return hashlib.sha256(json.dumps(dict(setting), sort_keys=True).encode()).hexdigest()[:16]


def reset_label_draws(state_dir: str | Path) -> list[Path]:
    """Delete every stored label-DP draw under ``state_dir`` (the owner's reset), and the label task each was
    made for (the next run's task is then drawn for); returns the draws removed."""
    folder = Path(state_dir) / BUDGET_DIR
    removed = sorted(folder.glob("*-labels-*.npz"))
    for path in [*removed, *folder.glob("*-labels-tasks.json")]:
        path.unlink()
    return removed
