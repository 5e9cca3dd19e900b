"""The G_i a server sends, checked against what the node knows of the join it took part in.

G_iu is the number of joined rows row u of table i takes part in (TablePuppet Eq. 15; VFL coresets Alg. 1).
The server computes it from every table's keys, so a node cannot recompute it; what it can check, it does:

* one whole count >= 0 per row of its table (a VFL expansion: per expanded row);
* equal on rows with equal join keys: G_iu depends on the row's key values only (a dimension table's rows
  each have their own key, so there the check holds for any G: the bound a node cannot give);
* none on the label owner's test rows when the join is the training join (ADMM, coresets): the test rows are
  joined apart; nor on its validation rows, which it finds as the server does (tpflower.validation, from the
  run's validation_fraction and seed);
* the counts add up to the joined rows N the run's messages name, and stay the same for the whole run (every
  phase that carries G_i gets the first one again).

A G that fails is no join's: the phase is refused (:class:`JoinCountsRefusal`, one line naming the table and
the phase) before anything computed from it leaves the node.
"""

from __future__ import annotations

import numpy as np

from tpflower.guard import ProtocolRefusal
from tpflower.validation import validation_mask

#: where a node keeps the first G_i of the run (any later phase's G_i must equal it)
STATE_KEY = "join.G"


class JoinCountsRefusal(ProtocolRefusal):
    """G_i is not the counts of any join the node took part in."""


def check_join_counts(
    client,
    G: np.ndarray,
    where: str,
    *,
    training_join: bool,
    N: float | None = None,
    validation: float = 0.0,
) -> np.ndarray:
    """``G`` (one count per row of ``client``'s table) as float64, or :class:`JoinCountsRefusal` (module
    docstring). ``training_join``: the label owner's test rows must have G = 0, and with a ``validation``
    share its validation rows too; ``N``: the joined rows G must add up to. The first G of a run is kept: a later
    one must be the same."""
    G = np.asarray(G, dtype=np.float64)
    n = len(client.data.row_ids)
    expanded = client.state.get("expand")
    rows = n if expanded is None else len(expanded)
    if G.shape != (rows,) or not np.isfinite(G).all() or (G < 0).any():
        raise JoinCountsRefusal(f"{where}: G must hold one count >= 0 per row ({rows}), got shape {G.shape}")
    if (np.round(G) != G).any():
        raise JoinCountsRefusal(f"{where}: G must hold whole counts of joined rows")
    if N is not None and float(N) != float(G.sum()):
        raise JoinCountsRefusal(f"{where}: N = {N:g} joined rows, but G adds up to {G.sum():g}")
    kept = client.state.get(STATE_KEY)
    if kept is not None:
        if not np.array_equal(kept, G):
            raise JoinCountsRefusal(f"{where}: G differs from the G_i this node received earlier in the run")
        return G
    if expanded is None:  # per table row: the label owner's test rows and the key check
        is_test = client.data.is_test
        train = ~is_test if (training_join and is_test is not None) else np.ones(n, dtype=bool)
        if training_join and is_test is not None and validation > 0:
            train &= ~validation_mask(np.asarray(client.data.row_ids), validation, int(client.settings.seed))
        if (G[~train] > 0).any():
            raise JoinCountsRefusal(
                f"{where}: G counts {int((G[~train] > 0).sum())} test or validation row(s); the training join has none"
            )
        keys = client.data.keys
        if keys.shape[1] and train.any() and not _same_per_key(keys, train, G):
            raise JoinCountsRefusal(f"{where}: G differs between rows with the same join keys; no join gives that")
    client.state.put(STATE_KEY, compact_counts(G))  # whole counts: the narrowest dtype
    return G


def count_dtype(G: np.ndarray) -> np.dtype:
    """The narrowest unsigned dtype holding the whole counts ``G`` (>= 0) exactly: uint8 .. uint64."""
    return np.min_scalar_type(int(G.max()) if len(G) else 0)


def compact_counts(G: np.ndarray) -> np.ndarray:
    """``G`` in :func:`count_dtype` (no copy if it is in that dtype already): how G_i is kept and sent."""
    return G.astype(count_dtype(G), copy=False)


#: rows per chunk of the per-key check of G over integer keys
CHECK_CHUNK = 1 << 20


def _same_per_key(keys, train: np.ndarray, G: np.ndarray) -> bool:
    """Whether G is equal on the training rows with the same key tuple. Integer key columns whose value ranges
    multiply to at most a few per row: one code per tuple (mixed radix), checked chunk by chunk (a few MB of
    temporaries); other keys: grouped by pandas (the rows' key tuples factorized)."""
    columns = [keys[c].to_numpy() for c in keys.columns]
    if all(c.dtype.kind in "iu" for c in columns) and len(train):
        lows = [int(c.min()) for c in columns]
        spans = [int(c.max()) - lo + 1 for c, lo in zip(columns, lows)]
        if int(np.prod(spans, dtype=object)) <= 4 * len(train) + 1024:
            n_codes = int(np.prod(spans, dtype=object))
            first = np.zeros(n_codes)
            starts = list(range(0, len(train), CHECK_CHUNK))

            def codes_of(s: slice) -> np.ndarray:
                code = np.zeros(s.stop - s.start, dtype=np.int64)
                for c, lo, span in zip(columns, lows, spans):
                    code *= span
                    code += c[s].astype(np.int64) - lo
                return code

            # one training row's G per tuple (whichever write lands: all must equal it)
            for start in starts:
                s = slice(start, min(start + CHECK_CHUNK, len(train)))
                live = train[s]
                first[codes_of(s)[live]] = G[s][live]
            for start in starts:
                s = slice(start, min(start + CHECK_CHUNK, len(train)))
                live = train[s]
                if (first[codes_of(s)[live]] != G[s][live]).any():
                    return False
            return True
    codes = keys[train].groupby(list(keys.columns), sort=False, dropna=False).ngroup().to_numpy()
    first = np.zeros(codes.max() + 1)
    first[codes[::-1]] = G[train][::-1]  # each key tuple's G at its first training row
    return not (first[codes] != G[train]).any()
