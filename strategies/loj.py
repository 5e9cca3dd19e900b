"""The LoJ operator's common part: the table-mapping setup round, test evaluation and the run record.

Setup (TablePuppet Sec. 3.1.1): every client sends row ids and keyed digests of its join keys, the label
owner also its labels and test-split flags; the server checks the key kinds agree, joins the digests into
p_i, and splits the joined rows into train and test by the label-table row. VFL baselines then send each
client its p_i once ("expand") and continue on the identity mapping over the N joined rows.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

import numpy as np

from strategies.lou import ShardRouter
from strategies.phase import BROADCAST, ClientKey, PhaseStrategy, Protocol, Reply
from tpflower.fedprep import ShardSummary, merge_summaries
from tpflower.comm import CommMeter, WanModel
from tpflower.losses import metrics, output_dim, primary_metric
from tpflower.mapping import KeyProjection, TableMapping, build_mapping
from tpflower.relation import summary_line
from tpflower.results import EpochRecord, RunResults, epoch_line, new_run_results, write_results
from tpflower.schema import RelationalSpec, SpecError, validate_key_kinds


class LoJStrategy(PhaseStrategy):
    """Setup, evaluation and results shared by TP-Join-SGD/ADMM and the VFL baselines."""

    algorithm = "loj"
    expand = False  # VFL baselines: clients expand their tables to the joined rows (no duplicate reduction)

    def __init__(self, cfg: Any, spec: RelationalSpec, run_dir: str | Path | None, log: Callable[[str], None] = print):
        self.cfg = cfg
        self.spec = spec
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.log = log
        self.scenario = str(cfg.scenario.name)
        self.clients: list[ClientKey] = spec.clients(self.scenario)
        super().__init__(num_clients=len(self.clients))
        self.task = spec.label.task
        self.metric = primary_metric(self.task)
        self.results: RunResults | None = None
        self.comm: CommMeter | None = None
        self._t0 = time.perf_counter()

    # ------------------------------------------------------------------------------------------ setup

    def setup(self) -> Protocol:
        """Round 1 (keys) builds the mapping; VFL adds round 2 (expand). Sets train/test mappings and labels."""
        replies = yield {BROADCAST: ([], {"phase": "keys"})}
        self._t0 = time.perf_counter()
        missing = [k for k in self.clients if k not in replies]
        if missing:
            raise SpecError(f"no client holds table shard(s) {missing}; connected: {sorted(replies)}")
        validate_key_kinds(self.spec, self._key_kinds(replies))
        projections: dict[str, list[KeyProjection]] = {t: [] for t in self.spec.table_names}
        for (table, shard), (arrays, _) in replies.items():
            joins = [k for k, j in enumerate(self.spec.joins) if table in (j.left, j.right)]
            projections[table].append(
                KeyProjection(table, np.asarray(arrays[0], dtype=np.int64), dict(zip(joins, arrays[1 : 1 + len(joins)])))
            )
        mapping = build_mapping(self.spec, projections)
        self.log(summary_line(self.spec, mapping))
        self.routers = {
            t: ShardRouter({q: np.asarray(r[0][0], dtype=np.int64) for (tt, q), r in replies.items() if tt == t},
                           mapping.n_rows[t])
            for t in self.spec.table_names
        }
        y_rows, is_test_rows, n_classes = self._labels(replies, mapping.n_rows[self.spec.label_table])
        is_test = is_test_rows[mapping.p[self.spec.label_table]]
        self.train, self.test = mapping.subset(~is_test), mapping.subset(is_test)
        self.y_train = y_rows[self.train.p[self.spec.label_table]]
        self.y_test = y_rows[self.test.p[self.spec.label_table]]
        self.d_out = output_dim(self.task, n_classes)
        self.comm = CommMeter(WanModel.from_config(self.cfg.network, {k: str(r[1]["region"]) for k, r in replies.items()}))
        self.results = new_run_results(self.cfg, self.algorithm, self.spec, mapping)
        self.mapping = mapping
        yield from self._federated_preprocessing()
        if self.expand:
            yield from self._expand()
        return None

    def _labels(self, replies: Mapping[ClientKey, Reply], n_label_rows: int) -> tuple[np.ndarray, np.ndarray, int | None]:
        """Labels and test flags over the label table's rows, from every shard of the label table."""
        y_rows: np.ndarray | None = None
        is_test = np.zeros(n_label_rows, dtype=bool)
        n_classes = 0
        for (t, _), (arrays, metrics) in replies.items():
            if t != self.spec.label_table:
                continue
            ids, y, flags = np.asarray(arrays[0], dtype=np.int64), arrays[-2], arrays[-1].astype(bool)
            if y_rows is None:
                y_rows = np.zeros(n_label_rows, dtype=y.dtype)
            y_rows[ids], is_test[ids] = y, flags
            n_classes = max(n_classes, int(metrics.get("n_classes", 0)))
        assert y_rows is not None
        return y_rows, is_test, n_classes or None

    def _federated_preprocessing(self) -> Protocol:
        """Sec. 4.4: tables with several shards merge their shards' summaries into one global rule."""
        sharded = [t for t in self.spec.table_names if len(self.routers[t].shards) > 1]
        if not sharded:
            return
        replies = yield {k: ([], {"phase": "stats"}) for k in self.clients if k[0] in sharded}
        messages = {}
        for t in sharded:
            spec_t = self.spec.table(t)
            summaries = [
                ShardSummary.from_arrays(r[0], spec_t.numeric, spec_t.categorical) for k, r in replies.items() if k[0] == t
            ]
            rule = merge_summaries(summaries).arrays(with_sketch=False)
            rule_id = hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in rule)).hexdigest()[:16]
            messages.update({k: (rule, {"phase": "rule", "rule_id": rule_id}) for k in self.clients if k[0] == t})
        yield messages

    def _key_kinds(self, replies: Mapping[ClientKey, Reply]) -> dict[str, dict[str, str]]:
        kinds: dict[str, dict[str, str]] = {}
        for (table, _), (_, m) in replies.items():
            pairs = [kv.split("=", 1) for kv in str(m.get("key_kinds", "")).split(",") if kv]
            kinds.setdefault(table, {}).update(dict(pairs))
        return kinds

    def _expand(self) -> Protocol:
        """VFL: send p_i over all joined rows (train, then test); continue on the identity mapping."""
        N_train, N_test = self.train.N, self.test.N
        order = {t: np.concatenate([self.train.p[t], self.test.p[t]]) for t in self.spec.table_names}
        yield {k: ([order[k[0]]], {"phase": "expand"}) for k in self.clients}
        n_all = N_train + N_test
        self.train = TableMapping({t: np.arange(N_train) for t in order}, {t: n_all for t in order})
        self.test = TableMapping({t: N_train + np.arange(N_test) for t in order}, {t: n_all for t in order})

    # ------------------------------------------------------------------------------------------ records

    def on_round(self, down: Mapping[ClientKey, int], up: Mapping[ClientKey, int]) -> None:
        # setup rounds (mapping, preprocessing) come before the meter exists and are not training traffic;
        # the VFL expansion is. Rounds whose messages say "lou" are the union's inner (coordinator) rounds.
        if self.comm is not None:
            inner = any(bool(config.get("lou")) for _, config in self._outbox.values())
            self.comm.record(down, up, inner=inner)

    def record_epoch(self, epoch: int, H_test: np.ndarray, train_loss: float, extra: dict[str, float] | None = None) -> None:
        """Evaluate the test predictions, append the epoch to the record and print its line."""
        assert self.results is not None and self.comm is not None
        test = metrics(self.task, H_test, self.y_test)
        if not np.isfinite(train_loss):
            raise RuntimeError(f"{self.algorithm} diverged in epoch {epoch} (train loss {train_loss})")
        rec = EpochRecord(
            epoch=epoch,
            test_metric=test[self.metric],
            train_loss=train_loss,
            wall_time_s=time.perf_counter() - self._t0,
            extra={**{f"test_{k}": v for k, v in test.items() if k not in (self.metric, "loss")}, **(extra or {})},
            **{k: v for k, v in self.comm.snapshot().items()},  # type: ignore[arg-type]
        )
        self.results.history.append(rec)
        self.log(epoch_line(self.metric, rec))

    def finish(self) -> None:
        """Write results.json (atomically) once the protocol has run to its end."""
        if self.run_dir is not None and self.results is not None:
            path = write_results(self.results, self.run_dir)
            self.log(f"results: {path}")

    def messages(self, build: Callable[[str], tuple[list[np.ndarray], dict[str, Any]]]) -> dict[ClientKey, Any]:
        """One message per client, built from its table name (join scenario: one client per table)."""
        return {k: build(k[0]) for k in self.clients}

    @staticmethod
    def outputs(replies: Mapping[ClientKey, Reply], index: int = 0) -> dict[str, np.ndarray]:
        """Reply array ``index`` of every client, keyed by table (join scenario)."""
        return {k[0]: r[0][index] for k, r in replies.items()}

    def shard_messages(self, build: Callable[[ClientKey], tuple[list[np.ndarray], dict[str, Any]]]) -> dict[ClientKey, Any]:
        """One message per shard client (union scenario)."""
        return {k: build(k) for k in self.clients}

    def gather_rows(self, replies: Mapping[ClientKey, Reply], rows: Mapping[str, np.ndarray], index: int = 0) -> dict[str, np.ndarray]:
        """Per table, the shards' reply array ``index`` for the table rows ``rows[t]``, in that order."""
        return {
            t: self.routers[t].gather(rows[t], {q: r[0][index] for (tt, q), r in replies.items() if tt == t})
            for t in self.spec.table_names
        }
