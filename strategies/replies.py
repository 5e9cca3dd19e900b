"""Replies checked at the door: every reply of a round against what the round asked for, before the strategy
uses it. A bad reply stops the run with one line naming the table, shard and phase.

- model outputs (:data:`MODEL_OUTPUTS`: predictions, parameters, gradients): finite, |x| <= :data:`MAX_ABS`
  (a prediction of 1e30 is no prediction: it would end the run as ``objective=inf`` several steps later);
  preprocessing summaries may hold NaN (a column without values) and are checked by their decoder;
- predictions ``h``: one row per row the message asked for (its ``rows``; all the client's rows otherwise),
  ``d_out`` columns; ``h_eval``: one row per ``eval_rows``;
- the arrays a phase must return are there (:data:`REQUIRED`);
- coreset phases: sensitivities ``sens`` and k-means ``labels`` one per row asked (or per client row),
  ``total`` and ``cost`` one finite number, centres ``C`` finite;
- ``keys``: row ids unique and non-negative, per join key one code (and label, test flag) per row id into its
  list of (n, 2) uint64 digests (hmac) or (n, 32) blinded values (blind), no list without codes; ``reblind``:
  the lists sent, one value per value sent;
- model-shaped arrays (``theta``, ``g``): the same shape from every shard of a table; a consensus shard's
  ``used`` mask: 0/1, shaped like its ``theta``;
- boosted trees: one gain per node (finite or -inf), side bits packed one per row (and split) asked, a shard's
  histograms finite and one per node, as their non-empty bins: a bit per bin, none past the last, the sums of
  g (and h) and a count per bit set (:func:`check_gbdt`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from strategies.transport import ClientKey, Payload, Reply, RunError
from tpflower.trees import sparse_problem

MAX_ABS = 1e12

#: arrays a reply to each phase must hold (other phases: whatever they hold is checked as above)
REQUIRED: dict[str, tuple[str, ...]] = {
    "keys": ("row_ids",),
    "admm_setup": (),
    "admm_update": ("h",),
    "admm_shard": ("theta",),
    "admm_consensus": ("h",),
    "predict": ("h",),
    "sgd_step": ("h",),
    "sgd_apply": ("h",),
    "sgd_partial": ("g",),
    "lbfgs_start": ("h",),
    "lbfgs_grad": ("gram",),
    "lbfgs_trial": ("h",),
    # coresets and k-means (strategies/coreset.py, kmeans.py)
    "sensitivity": ("total",),
    "sample": ("rows",),
    "weigh": ("sens",),
    "coreset_admm_setup": (),
    "coreset_admm_update": ("h",),
    "coreset_predict": ("h",),
    "kmeans_local": ("labels", "C"),
    "kmeans_assign": ("labels",),
    "kmeans_cost": ("cost",),
    # prediction (strategies/predict.py)
    "predict_keys": ("row_ids",),
    # boosted trees (strategies/gbdt.py)
    "gbdt_split": ("gain", "bits"),
    "gbdt_hist": ("mask", "hist", "count", "shape"),
    "gbdt_shard_split": ("gain", "bits"),
    "gbdt_route": ("bits",),
}
#: per-row replies of the coreset phases: (array, the request's array naming its rows); none sent: every row
ROW_REPLIES = (("sens", "rows"), ("labels", "rows"))
#: one number: a sensitivity total (DIS round 1), a table's k-means cost share
SCALAR_REPLIES = ("total", "cost")
#: other numbers that must be finite (sensitivities, k-means centres, totals, costs)
FINITE = ("sens", "C", "total", "cost")
MODEL_SHAPED = ("theta", "g")
MODEL_OUTPUTS = ("h", "h_eval", "theta", "g")
#: what a reply of non-finite model outputs most likely means, unless the run names its own setting
DIVERGED = "lower the learning rate or raise rho"


class ReplyError(RunError):
    """A reply that does not answer what its round asked for."""


def _who(key: ClientKey, phase: str) -> str:
    return f"table {key[0]!r} shard {key[1]}, phase {phase!r}"


def check_numbers(key: ClientKey, phase: str, name: str, a: np.ndarray, diverged: str = DIVERGED) -> None:
    """Finite values, floats within +-MAX_ABS; ``diverged``: the setting to change that the error names."""
    if a.dtype.kind not in "fc" or a.size == 0:
        return
    bad = ~np.isfinite(a) | (np.abs(a) > MAX_ABS)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ReplyError(
            f"{_who(key, phase)}: reply array {name!r} holds {int(bad.sum())} non-finite or out-of-range "
            f"value(s) (|x| > {MAX_ABS:g}), the first {a[at].item()!r} at index {at}: the model "
            f"diverged ({diverged}) or the client is faulty"
        )


def _rows(key: ClientKey, phase: str, name: str, a: np.ndarray, want: int, what: str) -> None:
    if a.ndim == 0 or a.shape[0] != want:
        got = "a scalar" if a.ndim == 0 else f"{a.shape[0]} rows"
        raise ReplyError(f"{_who(key, phase)}: reply array {name!r} has {got}; the round asked for {want} ({what})")


def check_reply(
    key: ClientKey, sent: Payload, reply: Reply, n_rows: int | None, d_out: int | None, diverged: str = DIVERGED
) -> None:
    """Check one reply (module docstring); ``n_rows``: the client's rows (None before the mapping exists),
    ``d_out``: the prediction width (None before it is set), ``diverged``: the setting a non-finite output names."""
    arrays, config = sent[0], sent[1]
    out = reply[0]
    phase = str(config.get("phase", "?"))
    missing = [n for n in REQUIRED.get(phase, ()) if n not in out]
    if missing:
        raise ReplyError(f"{_who(key, phase)}: the reply lacks array(s) {', '.join(map(repr, missing))}")
    for name in MODEL_OUTPUTS:
        if name in out:
            check_numbers(key, phase, name, np.asarray(out[name]), diverged)
    for name, asked in (("h", "rows"), ("h_eval", "eval_rows")):
        if name not in out:
            continue
        h = np.asarray(out[name])
        if asked in arrays:
            _rows(key, phase, name, h, len(arrays[asked]), f"the rows of its {asked!r}")
        elif name == "h" and n_rows is not None:
            _rows(key, phase, name, h, n_rows, "the client's rows")
        if d_out is not None and (h.ndim != 2 or h.shape[1] != d_out):
            raise ReplyError(
                f"{_who(key, phase)}: reply array {name!r} has shape {h.shape}; predictions have {d_out} column(s)"
            )
    for name in FINITE:
        if name in out:
            a = np.asarray(out[name])
            if a.dtype.kind in "fc" and not np.isfinite(a).all():
                raise ReplyError(f"{_who(key, phase)}: reply array {name!r} holds non-finite values")
    for name, asked in ROW_REPLIES:
        if name in out:
            if asked in arrays:
                _rows(key, phase, name, np.asarray(out[name]), len(arrays[asked]), f"the rows of its {asked!r}")
            elif n_rows is not None:
                _rows(key, phase, name, np.asarray(out[name]), n_rows, "the client's rows")
    for name in SCALAR_REPLIES:
        if name in out and np.asarray(out[name]).size != 1:
            raise ReplyError(
                f"{_who(key, phase)}: reply array {name!r} holds {np.asarray(out[name]).size} values; "
                "the round asked for one number"
            )
    if phase in ("keys", "predict_keys") and _chunks(key, phase, reply[1]) == 1:  # chunked: strategies.key_chunks
        check_keys(key, out)
    if phase == "reblind":  # the lists it was sent, each blinded once more: same names, same lengths
        if set(out) != set(arrays):
            raise ReplyError(f"{_who(key, phase)}: reply arrays {sorted(out)}; the round sent {sorted(arrays)}")
        for name, points in out.items():
            check_points(key, phase, name, np.asarray(points))
            _rows(key, phase, name, np.asarray(points), len(arrays[name]), "one per value sent")
    if phase.startswith("gbdt_"):
        check_gbdt(key, phase, arrays, out)
    if "used" in out:
        used, theta = np.asarray(out["used"]), np.asarray(out.get("theta"))
        if used.shape != theta.shape or not np.isin(used, (0, 1)).all():
            raise ReplyError(
                f"{_who(key, phase)}: reply array 'used' must be a 0/1 mask shaped like 'theta' "
                f"{theta.shape}, got {used.dtype} {used.shape}"
            )


def packed_bits(key: ClientKey, phase: str, bits: np.ndarray, shape: tuple[int, ...]) -> None:
    """Side bits packed by np.packbits along the last axis: uint8 of ``shape`` with its last entry in bits."""
    want = (*shape[:-1], (shape[-1] + 7) // 8)
    if bits.dtype != np.uint8 or bits.shape != want:
        raise ReplyError(
            f"{_who(key, phase)}: reply array 'bits' is {bits.dtype} {bits.shape}; the round asked for uint8 {want} "
            f"(side bits of {' x '.join(map(str, shape))} packed)"
        )


def check_gbdt(key: ClientKey, phase: str, arrays: Mapping[str, np.ndarray], out: Mapping[str, Any]) -> None:
    """A boosted-trees reply: one gain per node sent (finite, or -inf: no split), side bits packed one per row
    sent (``gbdt_split``; a shard's own rows, unknown here, in ``gbdt_shard_split``: checked by the strategy) or
    per (row, split) (``gbdt_route``), a shard's part of the histograms finite, (nodes built from rows, 3, bins),
    as its non-empty bins (tpflower.trees.sparse_histograms: ``mask``, a bit per bin, none past the last;
    ``hist``, the sums of g (and h), ``count``, rows, per bit set; ``shape``: the dense (nodes, bins))."""
    nodes = len(arrays["nodes"]) if "nodes" in arrays else None
    if "gain" in out:
        gain = np.asarray(out["gain"])
        if gain.dtype.kind != "f" or gain.shape != (nodes,) or np.isnan(gain).any() or np.isposinf(gain).any():
            raise ReplyError(
                f"{_who(key, phase)}: reply array 'gain' is {gain.dtype} {gain.shape}; the round asked for one "
                f"float per node ({nodes}), finite or -inf"
            )
    if phase == "gbdt_split":
        packed_bits(key, phase, np.asarray(out["bits"]), (len(arrays["rows"]),))
    if phase == "gbdt_route":
        packed_bits(key, phase, np.asarray(out["bits"]), (len(arrays["rows"]), len(arrays["splits"])))
    if phase == "gbdt_hist":  # the nodes built from rows: not those the shards derive (``derive``), unless
        nodes = len(arrays["nodes"]) - len(arrays.get("derive", ()))  # the shard lost its memory: every node
        shape = np.asarray(out["shape"])
        if (
            shape.shape != (2,)
            or shape.dtype.kind not in "iu"
            or shape[0] not in (nodes, len(arrays["nodes"]))
            or shape[1] < 0
        ):
            raise ReplyError(
                f"{_who(key, phase)}: reply array 'shape' is {shape.dtype} {shape.shape}; the round asked for the "
                f"histograms' (nodes, bins): one per node built from rows ({nodes}) or per node of the step"
            )
        sparse = (np.asarray(out[name]) for name in ("mask", "hist", "count"))
        problem = sparse_problem(*sparse, int(shape[0]), int(shape[1]))
        if problem:  # their non-empty bins (tpflower.trees.sparse_histograms)
            raise ReplyError(
                f"{_who(key, phase)}: reply arrays 'mask', 'hist', 'count' are not the non-empty bins of finite sums of g, h "
                f"and rows per node built from rows ({nodes}, 3, {int(shape[1])} bins): {problem}"
            )


def whole_number(value: Any, low: int, high: int | None = None) -> bool:
    """Whether a number a client announced in its metrics is a whole number in low..high (None: no bound)."""
    try:
        return value is not None and float(value) == int(value) >= low and (high is None or int(value) <= high)
    except (TypeError, ValueError, OverflowError):
        return False


def _chunks(key: ClientKey, phase: str, metrics: Mapping) -> int:
    """The chunks a keys reply announces (``n_chunks``, default 1): a whole number >= 1."""
    value = metrics.get("n_chunks", 1)
    if not whole_number(value, 1):
        raise ReplyError(f"{_who(key, phase)}: its reply announces n_chunks={value!r}, not a number of chunks")
    return int(value)


def check_keys(key: ClientKey, out: Mapping[str, np.ndarray]) -> None:
    """The keys reply: row ids (unique, >= 0), for every join key one code per row id into that key's list of
    digests (hmac) or blinded values (blind); labels and test flags per row (all rows, or the training rows when
    the labels are randomized)."""
    ids = np.asarray(out["row_ids"])
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise ReplyError(f"{_who(key, 'keys')}: row_ids must be a vector of integers, got {ids.dtype} {ids.shape}")
    if ids.size and (ids.min() < 0 or not _distinct(ids)):
        raise ReplyError(f"{_who(key, 'keys')}: row_ids must be distinct and non-negative")
    for name, a in out.items():
        if name.startswith(("digest.", "blind.")) and "code." + name.split(".", 1)[1] not in out:
            raise ReplyError(f"{_who(key, 'keys')}: reply array {name!r} comes without the rows' codes")
        if name.startswith("code.") or name == "is_test":
            _rows(key, "keys", name, np.asarray(a), ids.size, "one per row id")
        if name.startswith("code."):  # each row's code into its join's list: digests (hmac) or blinded values
            k = name[5:]
            if "blind." + k in out:
                values, what = np.asarray(out["blind." + k]), "blinded values"
                check_points(key, "keys", "blind." + k, values)
            else:
                values, what = np.asarray(out.get("digest." + k, np.zeros((0, 2), np.uint64))), "digests"
                if values.ndim != 2 or values.shape[1] != 2 or values.dtype != np.uint64:
                    raise ReplyError(
                        f"{_who(key, 'keys')}: reply array {'digest.' + k!r} must be (n, 2) uint64 (one digest per "
                        f"key value), got {values.dtype} {values.shape}"
                    )
            codes = np.asarray(a)
            if codes.dtype.kind not in "iu" or (codes.size and (codes.min() < 0 or codes.max() >= len(values))):
                raise ReplyError(
                    f"{_who(key, 'keys')}: reply array {name!r} must hold codes into its {len(values)} {what}"
                )
    if "y" in out and "is_test" in out:
        n_train = int(np.count_nonzero(np.asarray(out["is_test"]) == 0))
        if len(out["y"]) not in (ids.size, n_train):
            _rows(key, "keys", "y", np.asarray(out["y"]), ids.size, "one label per row id, or per training row")


def _distinct(ids: np.ndarray) -> bool:
    """Whether the non-negative integers ``ids`` are distinct: marked in a bitmap of their range when that is
    at most a few bytes per id (a table's row ids: 1 byte per row, no sort), else by sorting."""
    top = int(ids.max()) + 1
    if top > 4 * ids.size + 1024:
        return bool(np.unique(ids).size == ids.size)
    seen = np.zeros(top, dtype=bool)
    seen[ids] = True
    return int(np.count_nonzero(seen)) == ids.size


def check_points(key: ClientKey, phase: str, name: str, points: np.ndarray) -> None:
    """keys=blind: a list of blinded key values is an (n, 32) byte array."""
    if points.ndim != 2 or points.shape[1] != 32 or points.dtype != np.uint8:
        raise ReplyError(
            f"{_who(key, phase)}: reply array {name!r} must be (n, 32) bytes (blinded keys), got {points.dtype} "
            f"{points.shape}"
        )


def check_round(
    sent: Mapping[ClientKey, Payload],
    replies: Mapping[ClientKey, Reply],
    n_rows: Mapping[ClientKey, int],
    d_out: int | None,
    diverged: str = DIVERGED,
) -> None:
    """Check every reply of a round, then that model-shaped arrays agree between the shards of a table
    (``diverged``: the setting that a non-finite model output's error names)."""
    shapes: dict[tuple[str, str], tuple[ClientKey, tuple[int, ...]]] = {}
    for key, reply in replies.items():
        check_reply(key, sent[key], reply, n_rows.get(key), d_out, diverged)
        for name in MODEL_SHAPED:
            if name in reply[0]:
                shape = np.shape(reply[0][name])
                first = shapes.setdefault((key[0], name), (key, shape))
                if first[1] != shape:
                    phase = str(sent[key][1].get("phase", "?"))
                    raise ReplyError(
                        f"{_who(key, phase)}: reply array {name!r} has shape {shape}; shard "
                        f"{first[0][1]} of the same table sent {first[1]}"
                    )
