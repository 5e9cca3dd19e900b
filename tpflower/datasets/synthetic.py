"""Synthetic relational data with a planted label: star, chain or snowflake joins of a fact table.

Tables: ``fact`` (n_fact rows, the label ``y``) and dimensions ``d1``..``d{n_dims}``. Every table has numeric
features x0..x{w-1} (standard normal, stored as float32). Dimension ``di`` is keyed by ``ki`` (the narrowest
signed integer dtype of its ``dim_rows`` values, e.g. int16 for 200; with
``composite=True`` by the pair ``ki_a``, ``ki_b`` and the join is on both columns); its parent table holds the
same column(s) as a foreign key, drawn uniformly from the dimension's ``dim_rows`` key values.

* star: fact -> d1, fact -> d2, ...;  chain: fact -> d1 -> d2 -> ...;
* snowflake: the first ceil(n_dims/2) dims hang off the fact, the others off those in turn
  (n_dims=3: fact -> d1, fact -> d2, d1 -> d3).

``fanout`` = rows per key value in every dimension (>1: each parent row joins ``fanout`` rows: many-to-many).

Label planting (vectorized, no join materialised): each table t has a score s_t(row) in R^{d_c}
(``label='linear'``: x W_t; ``'nonlinear'`` and ``'interaction'``: tanh(x A_t) B_t, a random one-hidden-layer
teacher), with d_c = n_classes for multiclass, else 1. A row's effective score is its own score plus, for each
child dimension, the MEAN effective score of the child rows with the matching key. The fact rows' effective
score S gives the label: regression y = S + noise N(0, 1); binary y = 1[S + noise Logistic > 0];
multiclass y = argmax(S + noise Gumbel). With fanout 1 and a linear label, y is exactly a sum of per-table
linear models of the joined row plus noise; the linear and nonlinear labels are additive over the tables (a sum
of per-table functions of the joined row), the form of the federated linear model and MLP.

``label='interaction'`` plants interactions ACROSS tables: a switch on the parent row scales each child's effect.
The j-th child dimension (0-based, ascending) of a table t is switched by t's column x_{j mod width_t}:
the child's mean effective score enters the parent row's score times s = 2 * 1[x_j > 0] (0 or 2, mean 1), so
half of every child subtree's effect depends on a column of another table (on a joined row, table i's score
times the product of the switches on the path from the fact table to i). A parent without columns does not
switch (s = 1). Additive models over the tables reach only the average effect (s = 1); trees, which split on the
parent's column and then on the child's, can model it.

``correlation`` c in [0, 1): a parent row's feature k becomes c z + sqrt(1 - c^2) x, z the standardized mean of
feature k (mod width) over its child dimensions' matching rows (key means), so small dimension tables carry
features correlated with the fact table's (the case where block methods slow down). ``label_scale`` multiplies
a regression label (other units); ``imbalance`` k lowers class c's multiclass score by k c (imbalanced classes).
``categories`` k > 0: every table's last feature column x{w-1} is replaced by a categorical column ``c`` of k
levels (its k equal-probability bins under N(0, 1), named in a random order): the label still depends on it.
``missing`` m in [0, 1): after the label is planted, each numeric feature value is missing (NaN) with
probability m, independently (the label still depends on the lost value).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from tpflower.schema import TASKS, SpecError

SCHEMAS: tuple[str, ...] = ("star", "chain", "snowflake")
LABELS: tuple[str, ...] = ("linear", "nonlinear", "interaction")
REGIONS: tuple[str, ...] = ("us-east", "us-west", "eu")
FACT = "fact"
HIDDEN = 8  # hidden units of the nonlinear teacher
SWITCH = 2.0  # the interaction teacher's switch: a child's effect times SWITCH where the parent's column is > 0, else 0


@dataclass(frozen=True)
class Layout:
    """Table names, widths, key columns and the join tree implied by the generator's parameters."""

    names: tuple[str, ...]  # fact first, then d1..dn
    widths: tuple[int, ...]  # per table, same order
    dim_rows: tuple[int, ...]  # distinct key values per dimension (d1..dn)
    parents: tuple[int, ...]  # parents[i - 1] = index of the parent table of dimension i (0 = fact)
    composite: bool

    def key_columns(self, dim: int) -> tuple[str, ...]:
        """The key column(s) of dimension ``dim`` (1-based), also its parent's foreign key."""
        return (f"k{dim}_a", f"k{dim}_b") if self.composite else (f"k{dim}",)


def _per_table(value: int | Sequence[int], count: int, what: str) -> tuple[int, ...]:
    if isinstance(value, (int, np.integer)):
        values = (int(value),) * count
    else:
        values = tuple(int(v) for v in value)
        if len(values) != count:
            raise SpecError(f"synthetic: {what} needs {count} values, got {len(values)}")
    return values


def _parents(schema: str, n_dims: int) -> tuple[int, ...]:
    if schema == "star":
        return (0,) * n_dims
    if schema == "chain":
        return tuple(range(n_dims))
    first = max(1, math.ceil(n_dims / 2))  # snowflake: first-level dims, then dims of dims round-robin
    return tuple(0 if i <= first else (i - first - 1) % first + 1 for i in range(1, n_dims + 1))


def layout(
    schema: str = "star",
    n_dims: int = 3,
    widths: int | Sequence[int] = 4,
    dim_rows: int | Sequence[int] = 100,
    composite: bool = False,
) -> Layout:
    """Check the structural parameters and return the :class:`Layout` (widths: fact first, then d1..dn)."""
    if schema not in SCHEMAS:
        raise SpecError(f"synthetic: schema must be one of {SCHEMAS}, got {schema!r}")
    if int(n_dims) < 1:
        raise SpecError(f"synthetic: n_dims must be >= 1, got {n_dims}")
    n_dims = int(n_dims)
    w = _per_table(widths, n_dims + 1, "widths (fact, d1, ...)")
    m = _per_table(dim_rows, n_dims, "dim_rows (d1, ...)")
    if min(w) < 0 or min(m) < 1:
        raise SpecError(f"synthetic: widths must be >= 0 and dim_rows >= 1, got {w} and {m}")
    names = (FACT,) + tuple(f"d{i}" for i in range(1, n_dims + 1))
    return Layout(names, w, m, _parents(schema, n_dims), bool(composite))


def describe(
    schema: str = "star",
    n_fact: int = 1000,
    dim_rows: int | Sequence[int] = 100,
    n_dims: int = 3,
    widths: int | Sequence[int] = 4,
    fanout: int = 1,
    composite: bool = False,
    label: str = "linear",
    noise: float = 0.1,
    task: str = "regression",
    n_classes: int = 3,
    seed: int = 0,
    shards: Mapping[str, int] | None = None,
    label_scale: float = 1.0,  # generate() only: the tables' spec does not depend on it
    correlation: float = 0.0,  # generate() only
    imbalance: float = 0.0,  # generate() only
    categories: int = 0,
    missing: float = 0.0,  # generate() only
) -> dict[str, Any]:
    """The spec parts (tables, label, joins) matching :func:`generate` called with the same arguments.

    ``shards`` ({table: q}) splits those tables into q random shards for the union scenario.
    """
    lay = layout(schema, n_dims, widths, dim_rows, composite)
    cat = int(categories) > 0
    tables = {
        name: {
            "numeric": [f"x{k}" for k in range(w - (cat and w > 0))],
            "categorical": ["c"] if cat and w > 0 else [],
            "region": REGIONS[t % len(REGIONS)],
            # a dimension's fanout rows per key: the many-to-many joins are meant
            **({"unique": False} if t > 0 and fanout > 1 else {}),
        }
        for t, (name, w) in enumerate(zip(lay.names, lay.widths))
    }
    joins = [
        {"left": lay.names[p], "right": lay.names[i], "on": list(lay.key_columns(i))}
        for i, p in enumerate(lay.parents, start=1)
    ]
    for name, parts in (shards or {}).items():
        if name not in tables:
            raise SpecError(f"synthetic: shards names table {name!r}; tables are {list(tables)}")
        tables[name]["shards"] = {"parts": int(parts), "seed": seed}
    return {"tables": tables, "label": {"table": FACT, "column": "y", "task": task}, "joins": joins}


def _key_frame(lay: Layout, dim: int, values: np.ndarray) -> dict[str, np.ndarray]:
    """Key value(s) -> the key column(s) of dimension ``dim`` (composite: quotient and remainder)."""
    if not lay.composite:
        return {f"k{dim}": values}
    base = max(2, math.isqrt(lay.dim_rows[dim - 1] - 1) + 1)
    return {f"k{dim}_a": values // base, f"k{dim}_b": values % base}


def _score(x: np.ndarray, kind: str, d_c: int, rng: np.random.Generator) -> np.ndarray:
    """Per-row score (n x d_c, float64) of one table under a random linear or one-hidden-layer tanh teacher;
    ``x`` is the table's (width, n) feature columns, used in float64 chunk by chunk."""
    w, n = x.shape
    if w == 0:
        return np.zeros((n, d_c))
    if kind == "linear":
        weights = rng.standard_normal((w, d_c)) / math.sqrt(w)
        layer = lambda rows: rows @ weights  # noqa: E731
    else:
        a = rng.standard_normal((w, HIDDEN)) * (2.0 / math.sqrt(w))
        b = rng.standard_normal((HIDDEN, d_c)) / math.sqrt(HIDDEN)
        layer = lambda rows: np.tanh(rows @ a) @ b  # noqa: E731
    out = np.empty((n, d_c))
    for start in range(0, n, GEN_CHUNK):
        stop = min(start + GEN_CHUNK, n)
        out[start:stop] = layer(x[:, start:stop].T.astype(np.float64))
    return out


def _key_mean(keys: np.ndarray, scores: np.ndarray, n_keys: int) -> np.ndarray:
    """Mean of ``scores`` rows per key value 0..n_keys-1 (every key value has at least one row)."""
    counts = np.bincount(keys, minlength=n_keys)
    sums = np.stack([np.bincount(keys, weights=scores[:, c], minlength=n_keys) for c in range(scores.shape[1])], 1)
    return sums / np.maximum(counts, 1)[:, None]


def _switch_column(lay: Layout, features: np.ndarray, dim: int) -> np.ndarray | None:
    """The parent's column that switches child dimension ``dim`` under the interaction teacher: the j-th child
    (ascending) of its parent is switched by the parent's x_{j mod width}; None if the parent has no columns."""
    width = features.shape[0]
    if width == 0:
        return None
    j = _children(lay, lay.parents[dim - 1]).index(dim)
    return features[j % width]


def _children(lay: Layout, t: int) -> list[int]:
    """The dimensions whose parent is table ``t`` (ascending: the order of their foreign-key draws)."""
    return [i for i, p in enumerate(lay.parents, start=1) if p == t]


def _descendants(lay: Layout, t: int) -> list[int]:
    out = []
    for c in _children(lay, t):
        out += [c, *_descendants(lay, c)]
    return out


def _correlate(lay: Layout, draws: dict[int, _Draws], c: float) -> None:
    """Children before parents (children have larger indices): each parent's feature k becomes
    c z + sqrt(1 - c^2) x, z the standardized mean over its children of their key-mean feature k (mod width)."""
    for t in sorted(draws, reverse=True):
        x = draws[t].features.T.astype(np.float64)
        kids = [i for i in _children(lay, t) if lay.widths[i] > 0]
        if not kids or x.shape[1] == 0:
            continue
        z = np.zeros_like(x)
        for i in kids:
            child = draws[i].features.T.astype(np.float64)
            means = _key_mean(draws[i].own_keys, child, lay.dim_rows[i - 1])[draws[t].foreign[i]]
            z += means[:, np.arange(x.shape[1]) % means.shape[1]]
        z = (z - z.mean(0)) / np.where(z.std(0) > 0, z.std(0), 1.0)
        draws[t].features = np.ascontiguousarray((c * z + math.sqrt(1.0 - c * c) * x).T, dtype=np.float32)


@dataclass
class _Draws:
    """What table t draws from its own random stream, in this order: its key values (a dimension), its
    features, then a foreign key per child dimension (ascending). Features are stored float32, one contiguous
    column each (``features[k]``: feature k of every row); keys in the narrowest signed integer dtype."""

    own_keys: np.ndarray | None
    features: np.ndarray  # (width, rows) float32
    foreign: dict[int, np.ndarray]


#: rows per chunk of the generator's row-wise passes (draws, scores, label): its temporaries stay a few MB
GEN_CHUNK = 1 << 20


def key_dtype(n_values: int) -> np.dtype:
    """The narrowest signed integer dtype that holds key values 0..n_values-1."""
    for dtype in (np.int8, np.int16, np.int32):
        if n_values - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.int64)


def _draw(lay: Layout, t: int, stream: np.random.Generator, rows: int, fanout: int) -> _Draws:
    own = None
    if t > 0:
        m = lay.dim_rows[t - 1]
        own = stream.permutation(np.repeat(np.arange(m, dtype=np.int64), fanout)).astype(key_dtype(m))
    w = lay.widths[t]
    features = np.empty((w, rows), dtype=np.float32)
    for start in range(0, rows, GEN_CHUNK):  # the same stream as one (rows, w) draw, row-major
        stop = min(start + GEN_CHUNK, rows)
        features[:, start:stop] = stream.standard_normal((stop - start, w)).T
    foreign = {}
    for i in _children(lay, t):
        m = lay.dim_rows[i - 1]
        # uint32 draws equal int64 ones (both 32-bit bounded draws) at half the transient memory
        dtype = np.uint32 if m <= 2**32 else np.int64
        foreign[i] = stream.integers(0, m, size=rows, dtype=dtype).astype(key_dtype(m))
    return _Draws(own, features, foreign)


def _categories(x: np.ndarray, k: int, seed: int, t: int) -> np.ndarray:
    """Level names of ``x`` (standard normal) cut into ``k`` equal-probability bins, the names in a random order
    of table ``t``'s own (so no order of the names follows x)."""
    cuts = np.array([statistics.NormalDist().inv_cdf(q) for q in np.arange(1, k) / k])
    names = np.random.default_rng([int(seed), 1000 + t]).permutation(k)
    return np.array([f"v{j}" for j in names], dtype=object)[np.searchsorted(cuts, x)]


def generate(
    schema: str = "star",
    n_fact: int = 1000,
    dim_rows: int | Sequence[int] = 100,
    n_dims: int = 3,
    widths: int | Sequence[int] = 4,
    fanout: int = 1,
    composite: bool = False,
    label: str = "linear",
    noise: float = 0.1,
    task: str = "regression",
    n_classes: int = 3,
    seed: int = 0,
    shards: Mapping[str, int] | None = None,  # describe() only: the tables do not depend on it
    label_scale: float = 1.0,
    tables: Sequence[str] | None = None,
    correlation: float = 0.0,
    imbalance: float = 0.0,
    categories: int = 0,
    missing: float = 0.0,
) -> dict[str, pd.DataFrame]:
    """Generate the tables (see the module docstring); deterministic in ``seed``, vectorized throughout.

    ``label_scale`` (regression): the label in other units, ``y = label_scale * (S + noise)`` (e.g. 10000: grams
    instead of 10 kg), for checking that training does not depend on the label's units.

    ``tables``: only these tables (default: all), each equal to its frame in the full output. Each table draws
    from its own random stream (so the dimensions do not change with ``n_fact``, and a dimension is made without
    drawing anything of the others). The label table also draws the other tables' features and keys to plant
    its label (arrays of their size; their frames are never built).
    """
    lay = layout(schema, n_dims, widths, dim_rows, composite)
    if int(n_fact) < 1 or int(fanout) < 1:
        raise SpecError(f"synthetic: n_fact and fanout must be >= 1, got {n_fact} and {fanout}")
    if label not in LABELS:
        raise SpecError(f"synthetic: label must be one of {LABELS}, got {label!r}")
    if task not in TASKS:
        raise SpecError(f"synthetic: task must be one of {TASKS}, got {task!r}")
    if task == "multiclass" and int(n_classes) < 2:
        raise SpecError(f"synthetic: multiclass needs n_classes >= 2, got {n_classes}")
    if not 0.0 <= float(correlation) < 1.0:
        raise SpecError(f"synthetic: correlation must be in [0, 1), got {correlation}")
    if not 0.0 <= float(missing) < 1.0:
        raise SpecError(f"synthetic: missing must be in [0, 1), got {missing}")
    wanted = list(lay.names) if tables is None else list(tables)
    unknown = [t for t in wanted if t not in lay.names]
    if unknown:
        raise SpecError(f"synthetic: no table(s) {unknown}; the tables are {list(lay.names)}")
    d_c = int(n_classes) if task == "multiclass" else 1
    # one stream per table, then one for the teacher's weights and one for the label noise
    seeds = np.random.SeedSequence(int(seed)).spawn(len(lay.names) + 2)
    rows = [int(n_fact)] + [m * int(fanout) for m in lay.dim_rows]
    need = set(range(len(lay.names))) if FACT in wanted else {lay.names.index(t) for t in wanted}
    if correlation:  # a table's features then depend on its descendants'
        need |= {i for t in list(need) for i in _descendants(lay, t)}
    draws = {t: _draw(lay, t, np.random.default_rng(seeds[t]), rows[t], int(fanout)) for t in sorted(need)}
    if correlation:
        _correlate(lay, draws, float(correlation))

    y = None
    if FACT in wanted:
        weight_rng, noise_rng = np.random.default_rng(seeds[-2]), np.random.default_rng(seeds[-1])
        kind = "linear" if label == "linear" else "nonlinear"
        effective = [_score(draws[t].features, kind, d_c, weight_rng) for t in range(len(lay.names))]
        for i in range(len(lay.names) - 1, 0, -1):  # children have larger indices than their parents
            p = lay.parents[i - 1]
            means = _key_mean(draws[i].own_keys, effective[i], lay.dim_rows[i - 1])
            switch = _switch_column(lay, draws[p].features, i) if label == "interaction" else None
            for start in range(0, rows[p], GEN_CHUNK):
                stop = min(start + GEN_CHUNK, rows[p])
                pushed = means[draws[p].foreign[i][start:stop]]
                if switch is not None:
                    pushed *= np.where(switch[start:stop] > 0, SWITCH, 0.0)[:, None]
                effective[p][start:stop] += pushed
        total = effective[0]
        del effective
        if task == "multiclass":
            logits = total + noise * noise_rng.gumbel(size=total.shape) - float(imbalance) * np.arange(d_c)
            y = np.argmax(logits, axis=1).astype(np.int64)
        else:  # in place, chunk by chunk (the noise stream drawn in order: the same values as one draw)
            y = total.reshape(-1)
            binary = np.empty(rows[0], dtype=np.int64) if task == "binary" else None
            for start in range(0, rows[0], GEN_CHUNK):
                stop = min(start + GEN_CHUNK, rows[0])
                if binary is None:
                    y[start:stop] = float(label_scale) * (
                        y[start:stop] + noise * noise_rng.standard_normal(stop - start)
                    )
                else:
                    binary[start:stop] = y[start:stop] + noise * noise_rng.logistic(size=stop - start) > 0
            if binary is not None:
                y = binary
        del total

    frames: dict[str, pd.DataFrame] = {}
    for name in wanted:
        t = lay.names.index(name)
        d = draws.pop(t)  # the frame takes the arrays over: no copy (one block per column)
        cols: dict[str, np.ndarray] = {}
        if t > 0:
            cols.update(_key_frame(lay, t, d.own_keys))
        for child, values in d.foreign.items():
            cols.update(_key_frame(lay, child, values))
        cols.update({f"x{k}": d.features[k] for k in range(lay.widths[t])})
        if int(categories) > 0 and lay.widths[t] > 0:
            cols["c"] = _categories(cols.pop(f"x{lay.widths[t] - 1}"), int(categories), seed, t)
        if float(missing) > 0:  # after the label is planted: the values were there, the table lost them
            blank = np.random.default_rng([int(seed), 2000 + t])
            for k in range(lay.widths[t]):
                if f"x{k}" in cols:
                    cols[f"x{k}"][blank.random(len(cols[f"x{k}"])) < float(missing)] = np.nan
        if t == 0:
            cols["y"] = y
        frames[name] = pd.DataFrame(cols, copy=False)
        del d, cols
    return frames
