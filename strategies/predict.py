"""Federated prediction over the join, server side (docs/prediction.md; client: tpflower/phases/predict.py).

A trained model is split by construction: f(x_j) = sum_i f_i(theta_i; x_{i, p_i(j)}) (docs/algorithms.md,
Notation), and theta_i stays with the owner of table i. To score new rows, the query owner (by default the
label table's) holds them with their join keys and features, the other owners the rows they serve now. The
request runs like training's setup and one evaluation round:

1. ``predict_keys``: every node sends row ids and keyed digests of its rows' join keys (keys=blind: the blinded
   values, then the same re-blinding hops as training, strategies.setup.JoinSetup.blind_rounds), and the id of
   the part it holds, checked against model.json; in chunks of mapping.keys_chunk_rows rows, as training's keys
   reply (strategies.key_chunks).
2. The server joins the digests into p_i (tpflower.mapping.build_mapping, as in training): one joined row per
   new row and partner; new rows that join no partner are reported, not dropped silently.
3. ``predict_rows``: each node scores the distinct rows U_i the joined rows use, h_i = f_i(theta_i; x_u);
   the server sums H_j = sum_i h_i[p_i(j)] and applies the inverse label transform of model.json.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from strategies.base import TablePuppetStrategy
from strategies.gbdt import forest_scores
from strategies.key_chunks import gather_chunks
from strategies.kmeans import cell_points, grid_cells
from strategies.model_record import dataset_digest, label_scale_of, read_model_record
from strategies.setup import JoinSetup, ShardRouter, key_mode, keys_chunk_rows
from strategies.transport import ClientKey, RunError
from tpflower.batches import joined_predictions
from tpflower.clustering import sq_distances
from tpflower.datasets import load_spec
from tpflower.local_table import with_class_names
from tpflower.mapping import KeyProjection, build_mapping, rows_without_partner
from tpflower.schema import RelationalSpec, SpecError

PREDICTIONS_FILE = "predictions.csv"


@dataclass
class Predictions:
    """The scored new rows: ``rows[j]`` the query row (its position in the rows file) of joined row j,
    ``H[j]`` its prediction in the label's units (classification: the scores, logits), ``unjoined`` the
    query rows that joined no partner; ``p[t][j]`` the row of table t in joined row j (the query table's: the
    query row), the server's mapping. ``per_joined_row``: :meth:`frame` gives a line per joined row."""

    task: str
    rows: np.ndarray
    H: np.ndarray
    unjoined: np.ndarray
    p: dict[str, np.ndarray] = field(default_factory=dict)
    per_joined_row: bool = False
    query_table: str = ""
    classes: list[Any] | None = None  # a class label's names by id, where known (a ``class`` column)

    @property
    def n_rows(self) -> int:
        """The new rows that joined some partner (each gets a prediction)."""
        return len(np.unique(self.rows))

    def frame(self, every_row: bool = False) -> pd.DataFrame:
        """The predictions as written: one line per new row (:meth:`row_frame`), or with ``per_joined_row``
        (and always for k-means, a cluster per joined row) one per joined row (:meth:`joined_frame`); with
        ``classes``, each line's predicted class by name beside its id (:func:`with_class_names`).
        ``every_row`` (the Python API's): the lines per new row include the rows that joined no partner, in
        row order, with ``joined_rows`` 0 and the prediction, class and probabilities missing (NaN; a class id
        pandas' nullable Int64 <NA>)."""
        per_joined = self.per_joined_row or self.task == "cluster"
        out = self.joined_frame() if per_joined else self.row_frame()
        out = out if self.classes is None else with_class_names(out, self.classes)
        if not every_row or per_joined or not len(self.unjoined):
            return out
        every = pd.RangeIndex(self.n_rows + len(self.unjoined), name="row")  # joined and unjoined: rows 0..n-1
        out = out.set_index("row").reindex(every).reset_index()
        out["joined_rows"] = out["joined_rows"].fillna(0).astype(np.int64)
        if self.task != "regression":
            out["prediction"] = out["prediction"].astype("Int64")
        return out

    def joined_frame(self) -> pd.DataFrame:
        """One line per joined new row: ``row``, the partner tables' rows ``TABLE_row`` (per_joined_row, and
        k-means, whose lines of one new row are otherwise alike), ``prediction`` and, for classification, class
        probabilities (binary: ``p_1``; multiclass: ``p_0`` ... ``p_{C-1}``)."""
        out = pd.DataFrame({"row": self.rows.astype(np.int64)})
        if self.per_joined_row or self.task == "cluster":
            for t, p_t in self.p.items():
                if t != self.query_table:
                    out[f"{t}_row"] = np.asarray(p_t, dtype=np.int64)
        H = self.scores()
        if self.task == "cluster":
            out["cluster"] = np.asarray(self.H).reshape(-1).astype(np.int64)
        elif self.task == "regression":
            out["prediction"] = H[:, 0]
        else:
            P = probabilities(self.task, H)
            out["prediction"] = classes(self.task, P)
            for c, name in enumerate(probability_columns(self.task, P.shape[1])):
                out[name] = P[:, c]
        return out

    def scores(self) -> np.ndarray:
        """H as (joined rows, outputs), also when no new row joined."""
        H = np.asarray(self.H, dtype=np.float64)
        return H.reshape(len(self.rows), -1) if len(self.rows) else H.reshape(0, H.shape[-1] if H.ndim > 1 else 1)

    def row_frame(self) -> pd.DataFrame:
        """One line per new row that joined: ``row``, ``joined_rows`` (how many joined rows it is part of) and
        the mean over them of the prediction (regression) or of the class probabilities (classification; its
        ``prediction`` the class of the largest mean probability)."""
        U, inv = np.unique(self.rows.astype(np.int64), return_inverse=True)
        counts = np.bincount(inv, minlength=len(U))
        out = pd.DataFrame({"row": U, "joined_rows": counts.astype(np.int64)})
        H = self.scores()

        def mean(a: np.ndarray) -> np.ndarray:
            return np.bincount(inv, weights=a, minlength=len(U)) / np.maximum(counts, 1)

        if self.task == "regression":
            out["prediction"] = mean(H[:, 0])
            return out
        P = probabilities(self.task, H)
        P_mean = np.stack([mean(P[:, c]) for c in range(P.shape[1])], axis=1) if len(U) else P
        out["prediction"] = classes(self.task, P_mean)
        for c, name in enumerate(probability_columns(self.task, P_mean.shape[1])):
            out[name] = P_mean[:, c]
        return out


def probabilities(task: str, H: np.ndarray) -> np.ndarray:
    """Class probabilities of scores H: binary ``(n, 1)`` P(y = 1) (the logistic of H), multiclass ``(n, C)``
    the softmax."""
    if task == "binary":
        return 1.0 / (1.0 + np.exp(-H[:, :1]))
    e = np.exp(H - H.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def classes(task: str, P: np.ndarray) -> np.ndarray:
    """The predicted class of each row's probabilities (binary: 1 iff P(y = 1) > 1/2, i.e. a positive score)."""
    return (P[:, 0] > 0.5).astype(np.int64) if task == "binary" else P.argmax(axis=1).astype(np.int64)


def probability_columns(task: str, width: int) -> list[str]:
    return ["p_1"] if task == "binary" else [f"p_{c}" for c in range(width)]


class FederatedPrediction(TablePuppetStrategy):
    """One prediction request for the model of ``record`` (model.json): the new rows are held by the query
    client ``query`` (its owner's rows file), every other table's clients serve their current rows."""

    def __init__(
        self,
        cfg: Any,
        spec: RelationalSpec,
        record: Mapping[str, Any],
        query: ClientKey,
        log: Callable[[str], None] = print,
    ):
        scenario = str(cfg.scenario.name)
        super().__init__(spec.clients(scenario), log)
        if query not in self.clients:
            raise ValueError(f"table {query[0]!r} has no shard {query[1]} (clients: {self.clients})")
        self.cfg, self.spec, self.record, self.query = cfg, spec, record, query
        self.clusters = record.get("predicts") == "cluster"  # k-means: a cluster id per joined row
        self.trees = record.get("predicts") == "trees"  # boosted trees: each table's side bits at its splits
        self.d_out = None if self.clusters else int(record["d_out"])
        self.task = "cluster" if self.clusters else str(record["task"])
        self.parts = {(p["table"], int(p["shard"])): p["part"] for p in record["parts"]}
        self.results: Predictions | None = None
        self.finished = False
        self.out: Path | None = None  # a deployed request: the server writes the predictions here
        # one line per joined row (with the partner tables' rows) instead of one per new row
        self.per_joined_row = bool((cfg.get("predict") or {}).get("per_joined_row", False))

    @classmethod
    def from_run_dir(
        cls, cfg: Any, run_dir: str | Path, base_dir: str | Path | None = None, log: Callable[[str], None] = print
    ) -> FederatedPrediction:
        """The request of a deployed ServerApp (config ``predict.run_id``, ``predict.shard``): the model of
        ``run_dir`` (its model.json), the predictions written to RUN_DIR/predictions.csv."""
        record = read_model_record(run_dir)
        asked = str(cfg.predict.get("run_id") or "")
        if asked != str(record["run_id"]):
            raise ValueError(f"predict.run_id={asked}, but the model in {run_dir} is run {record['run_id']}")
        if dataset_digest(cfg) != record.get("dataset_digest"):
            raise ValueError(
                f"the request's dataset spec is not the one the model in {run_dir} was trained on (dataset "
                f"{record.get('dataset')!r}, digest {str(record.get('dataset_digest'))[:12]}): submit it with the "
                "training run's overrides"
            )
        spec = load_spec(cfg.dataset, base_dir=base_dir)
        query = (str(cfg.predict.get("table") or spec.label_table), int(cfg.predict.get("shard", 0)))
        strategy = cls(cfg, spec, record, query, log)
        strategy.out = Path(run_dir) / PREDICTIONS_FILE
        return strategy

    @property
    def members(self) -> list[ClientKey]:
        """The clients of the request: the query shard of the query table, every client of the other tables."""
        return [k for k in self.clients if k[0] != self.query[0] or k == self.query]

    def protocol(self) -> None:
        run_id, chunk_rows = str(self.record["run_id"]), keys_chunk_rows(self.cfg)
        ask = {"phase": "predict_keys", "run_id": run_id, "chunk_rows": chunk_rows}
        replies = self.send({k: ({}, {**ask, "query": int(k == self.query)}) for k in self.members})
        for key, (_, m) in sorted(replies.items()):
            if str(m.get("part")) != self.parts.get(key):
                raise RunError(
                    f"table {key[0]!r} shard {key[1]}: its saved part {m.get('part')} is not the part "
                    f"{self.parts.get(key)} of run {run_id} in model.json (retrained or replaced since)"
                )
        gather_chunks(self.send, replies, chunk_rows)
        if key_mode(replies) == "blind":
            JoinSetup(self.send, self.spec, self.cfg, self.members, {}, self.log).blind_rounds(replies)
        n_query = len(replies[self.query][0]["row_ids"])
        projections = {t: [] for t in self.spec.table_names}
        for (t, _), (arrays, _) in replies.items():
            joins = [k for k, j in enumerate(self.spec.joins) if t in (j.left, j.right)]
            codes = {k: arrays[f"code.{k}"] for k in joins}
            digests = {k: arrays[f"digest.{k}"] for k in joins}
            projections[t].append(KeyProjection(t, np.asarray(arrays["row_ids"], dtype=np.int64), codes, digests))
        self.say_why_unjoined(projections, n_query)
        try:
            mapping = build_mapping(self.spec, projections)
        except SpecError:  # no new row joins: every one is reported (the query node's stages in order: none scored)
            self.send({self.query: ({"rows": np.zeros(0, np.int64)}, {"phase": "predict_rows"})}, "eval")
            self.finish(
                Predictions(
                    self.task,
                    np.zeros(0, np.int64),
                    np.zeros((0, self.d_out or 1)),
                    np.arange(n_query, dtype=np.int64),
                    per_joined_row=self.per_joined_row,
                    query_table=self.query[0],
                )
            )
            return
        routers = {
            t: ShardRouter(
                {q: np.asarray(r[0]["row_ids"], dtype=np.int64) for (tt, q), r in replies.items() if tt == t},
                mapping.n_rows[t],
            )
            for t in self.spec.table_names
        }
        distinct = {t: np.unique(mapping.p[t], return_inverse=True) for t in self.spec.table_names}
        messages = {}
        for t, (U, _) in distinct.items():
            for q, pos in routers[t].split(U).items():
                messages[(t, q)] = ({"rows": pos}, {"phase": "predict_rows"})
        scored = self.send(messages, "eval")
        name = "labels" if self.clusters else "bits" if self.trees else "h"
        h = {
            t: routers[t].gather(U, {q: r[0][name] for (tt, q), r in scored.items() if tt == t})
            for t, (U, _) in distinct.items()
        }
        inv = {t: i.ravel() for t, (_, i) in distinct.items()}
        if self.trees:
            ids = self.record["split_ids"]
            sides = {t: np.unpackbits(b, axis=1, count=len(ids[t])).astype(bool) for t, b in h.items()}
            H = forest_scores(self.record, sides, inv)
        else:
            H = self.cluster_ids(h, inv) if self.clusters else joined_predictions(inv, h)
        rows = np.asarray(mapping.p[self.query[0]], dtype=np.int64)
        self.finish(
            Predictions(
                self.task,
                rows,
                H if self.clusters else label_scale_of(self.record).to_label(H),
                np.setdiff1d(np.arange(n_query), rows),
                dict(mapping.p),
                self.per_joined_row,
                self.query[0],
            )
        )

    def say_why_unjoined(self, projections: Mapping[str, Sequence[KeyProjection]], n_query: int) -> None:
        """One line per join of the query table on which some new rows find no partner: the join, its key
        columns, the count and the first row (the server learns which rows join anyway: it builds the join)."""
        table = self.query[0]
        for k, lonely in rows_without_partner(self.spec, projections, table).items():
            j = self.spec.joins[k]
            other = j.right if j.left == table else j.left
            mine = [a if j.left == table else b for a, b in j.on]
            self.log(
                f"{len(lonely)} of {n_query} new row(s) hold a key {mine} that no row of table {other!r} holds (the "
                f"first in row {int(lonely[0])}): they join no partner"
            )

    def finish(self, predictions: Predictions) -> None:
        """The predictions to the query owner (its node keeps them), then to ``out`` if the server has one."""
        self.results = predictions
        frame = predictions.frame()
        delivery = {f"col.{c}": frame[c].to_numpy() for c in frame.columns} | {"unjoined": predictions.unjoined}
        self.send({self.query: (delivery, {"phase": "deliver"})})
        self.finished = True
        if self.out is not None:
            write_predictions(predictions, self.out, self.log)

    def cluster_ids(self, labels: Mapping[str, np.ndarray], inv: Mapping[str, np.ndarray]) -> np.ndarray:
        """k-means (DistDim): each joined row's grid cell from its tables' local labels, and the final centre
        nearest to the cell's point, as the run assigns its joined rows (strategies/kmeans.py)."""
        local = {t: np.asarray(c, dtype=np.float64) for t, c in self.record["local_centres"].items()}
        C = np.asarray(self.record["centres"], dtype=np.float64)
        cells, cell_of = grid_cells([np.asarray(labels[t])[inv[t]] for t in local], C.shape[0])
        return sq_distances(cell_points(cells, list(local.values())), C).argmin(1)[cell_of]


def unjoined_path(out: Path) -> Path:
    """Where the rows that joined no partner go beside the predictions file ``out``: its suffix replaced by
    ``.unjoined.csv`` (``pred_new.csv``: ``pred_new.unjoined.csv``)."""
    return out.with_suffix(".unjoined.csv")


def write_predictions(pred: Predictions, out: Path, log: Callable[[str], None] = print) -> None:
    """The predictions CSV ``out``, and the new rows that joined no partner (if any) in :func:`unjoined_path`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    frame = pred.frame()
    frame.to_csv(out, index=False)
    log(f"predictions: {out} ({len(frame)} lines: {pred.n_rows} new rows over {len(pred.rows)} joined rows)")
    if len(pred.unjoined):
        side = unjoined_path(out)
        pd.DataFrame({"row": pred.unjoined}).to_csv(side, index=False)
        log(f"{len(pred.unjoined)} new row(s) joined no partner and have no prediction: their row numbers in {side}")
