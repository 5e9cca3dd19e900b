"""The LoJ operator's common part: the table-mapping setup round, test evaluation and the run record.

Setup (TablePuppet Sec. 3.1.1): every client sends row ids and keyed digests of its join keys, the label
owner also its labels and test-split flags; the server checks the key kinds agree, joins the digests into
p_i, and splits the joined rows into train and test by the label-table row. VFL baselines then send each
client its p_i once ("expand") and continue on the identity mapping over the N joined rows.

Privacy (tpflower.privacy; checked by validate_privacy in the constructor, before anything runs). The keys
message carries the run's privacy settings. Label DP: the label owner (every shard of the label table) sends
randomized TRAINING labels only; the server never holds test labels, so the test metric of each epoch is
computed by the label owner in an extra ``evaluate`` round (not training traffic: not counted in the
communication figures). Feature DP: the strategy plans each client's local DP steps and sample rate
(:meth:`LoJStrategy.plan_feature_dp`), sent with the first training message; the clients report the epsilon
they spent, shown as ``eps`` (max over clients) in the epoch line and kept in results.privacy.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Callable

import numpy as np

from strategies.base import TablePuppetStrategy
from tpflower.checkpoint import CHECKPOINT, SETUP_CHECKPOINT, load_checkpoint, save_checkpoint
from strategies.setup import ShardRouter
from strategies.transport import ClientKey, Kind, Payload, Reply
from tpflower.fedprep import ShardSummary, merge_summaries, quantile_bin_edges, sketch_columns_needed
from tpflower.comm import CommMeter, WanModel
from tpflower.batches import BatchPlan, SGDSchedule, batch_size_of
from tpflower import privacy as dp
from tpflower.losses import LabelScale, metrics, output_dim, primary_metric, standardizes_label
from tpflower.mapping import KeyProjection, TableMapping, build_mapping, index_dtype
from tpflower.records import numbered, unnumbered
from tpflower.params import AlgorithmParams, run_settings
from tpflower.reference import as_reference, constant_predictions, reference_metrics, reference_text
from tpflower.relation import summary_line
from tpflower.results import EpochRecord, RunResults, epoch_line, new_run_results, write_results
from tpflower.schema import RelationalSpec, validate_key_kinds


#: what a checkpoint keeps of a strategy beside its training loop's state: everything setup built
SETUP_STATE = ("mapping", "train", "test", "routers", "client_rows", "y_train", "y_test", "label_scale", "_evaluation",
               "d_out", "dp_plan")  # written once (checkpoint-setup.pkl): it does not change after setup
EPOCH_STATE = ("comm", "results", "eps_spent")  # written every epoch with the training loop's state


class LoJStrategy(TablePuppetStrategy):
    """Setup, evaluation and results shared by TP-Join-SGD/ADMM and the VFL baselines.

    ``params``: the algorithm's typed settings, validated (with the run settings and the privacy settings)
    in the constructor, before any client is contacted."""

    algorithm = "loj"
    params_type: type[AlgorithmParams] = AlgorithmParams
    expand = False  # VFL baselines: clients expand their tables to the joined rows (no duplicate reduction)
    resumable = False  # the protocol checkpoints every epoch (begin / checkpoint_config / end_epoch)
    one_shot = False  # True: the run records one result whatever `epochs` says (k-means: DistDim has no epochs)
    checkpointed = EPOCH_STATE  # the attributes an epoch's checkpoint keeps (subclasses add theirs)

    def __init__(self, cfg: Any, spec: RelationalSpec, run_dir: str | Path | None, log: Callable[[str], None] = print,
                 feature_dp: bool = True, label_dp: bool = True, why_no_feature_dp: str = ""):
        self.cfg = cfg
        self.spec = spec
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.scenario = str(cfg.scenario.name)
        super().__init__(spec.clients(self.scenario), log)
        run_settings(cfg)
        self.params = self.params_type.from_cfg(cfg.algorithm)
        self.task = spec.label.task
        self.metric = primary_metric(self.task)
        self.privacy = cfg.get("privacy") or {"name": "none"}
        # impossible privacy settings fail here, before any client is asked for anything (also under flwr run)
        dp.validate_privacy(self.privacy, self.algorithm, self.task, feature_dp=feature_dp, label_dp=label_dp,
                            why_not=why_no_feature_dp)
        self.label_dp = dp.uses_label_dp(self.privacy)
        self.feature_dp = dp.uses_feature_dp(self.privacy)
        self.dp_plan: dict[ClientKey, tuple[int, float]] = {}  # feature DP: (local DP steps of the run, q)
        self.eps_spent: dict[ClientKey, float] = {}  # feature DP: the latest epsilon each client reported
        self.results: RunResults | None = None
        self.label_scale = LabelScale()  # fitted in setup, on the training labels the server holds
        self.finished = False
        self.comm: CommMeter | None = None
        self._t0 = time.perf_counter()
        self.run_id = secrets.token_hex(16)  # names this run's checkpoints on the nodes (kept when resumed)
        self.resume = bool(cfg.get("resume", False))
        if self.resume and self.one_shot:
            raise ValueError(f"resume=true: {self.algorithm} runs in one shot (no epochs, no checkpoint to resume "
                             "from); run it again")
        if self.resume and not self.resumable:
            from tpflower.registry import entries

            resumable = sorted(e.name for e in entries() if e.strategy.resumable)
            raise ValueError(f"resume=true: {self.algorithm} does not checkpoint its epochs yet "
                             f"(algorithms that do: {', '.join(resumable)})")
        if self.resume and (self.run_dir is None or not (self.run_dir / CHECKPOINT).is_file()):
            raise ValueError(f"resume=true but there is no checkpoint {CHECKPOINT} in the run dir {self.run_dir}")

    # ------------------------------------------------------------------------------------------ setup

    def setup(self) -> None:
        """Round 1 (keys) builds the mapping; VFL adds round 2 (expand). Sets train/test mappings and labels."""
        replies = self.send({k: ({}, {"phase": "keys", "run_id": self.run_id, **dp.privacy_message(self.privacy)})
                             for k in self.clients})
        self._t0 = time.perf_counter()
        validate_key_kinds(self.spec, self._key_kinds(replies))
        projections: dict[str, list[KeyProjection]] = {t: [] for t in self.spec.table_names}
        for (table, shard), (arrays, _) in replies.items():
            joins = [k for k, j in enumerate(self.spec.joins) if table in (j.left, j.right)]
            projections[table].append(
                KeyProjection(table, np.asarray(arrays["row_ids"], dtype=np.int64), {k: arrays[f"digest.{k}"] for k in joins})
            )
        mapping = build_mapping(self.spec, projections)
        self.routers = {
            t: ShardRouter({q: np.asarray(r[0]["row_ids"], dtype=np.int64) for (tt, q), r in replies.items() if tt == t},
                           mapping.n_rows[t])
            for t in self.spec.table_names
        }
        self.client_rows = {k: len(r[0]["row_ids"]) for k, r in replies.items()}
        for r in replies.values():  # the digests have served their purpose: free them before N-sized state
            for name in [n for n in r[0] if n.startswith("digest.")]:
                del r[0][name]
        y_rows, is_test_rows, n_classes = self._labels(replies, mapping.n_rows[self.spec.label_table])
        # train and test are views of the mapping, reordered in place: train rows first, then test rows
        self.train, self.test = mapping.partition(is_test_rows[mapping.p[self.spec.label_table]])
        y_train = y_rows[self.train.p[self.spec.label_table]]
        # regression: training sees the label standardized on the training rows (after label DP, which the
        # label owner applied to the raw label); predictions go back to the label's units before any metric
        self.label_scale = LabelScale.fit(self.task, y_train, standardizes_label(self.cfg))
        self.y_train = self.state_labels(self.label_scale.scaled(y_train))
        # label DP: the server holds the randomized training labels only; the label owner evaluates the test rows
        self.y_test = None if self.label_dp else y_rows[self.test.p[self.spec.label_table]]
        self._evaluation = self._evaluation_split() if self.label_dp else {}
        self.d_out = output_dim(self.task, n_classes)
        self.comm = CommMeter(WanModel.from_config(self.cfg.network, {k: str(r[1]["region"]) for k, r in replies.items()}))
        self.results = new_run_results(self.cfg, self.algorithm, self.spec, mapping)
        self.results.privacy = dp.privacy_summary(self.privacy, self.task, 0.0 if self.feature_dp else None)
        if self.y_test is not None:  # label DP: the label owner scores the constant predictor at the first evaluation
            self.results.reference = reference_metrics(self.task, y_train, self.y_test, self.d_out)  # label units
        del y_train  # the raw training labels: only the reference needs them
        self.log(" | ".join(p for p in (summary_line(self.spec, mapping), reference_text(self.task, self.results.reference),
                                         self.comm.wan.note) if p))
        self.mapping = mapping
        if self.feature_dp:  # on the table-row mapping, before a VFL expansion
            self.dp_plan = self.plan_feature_dp()
        self._federated_preprocessing()
        if self.expand:
            self._expand()

    @property
    def state_dtype(self) -> np.dtype:
        """The dtype of the server's per-joined-row float state: float32 in a float32 run, else float64."""
        return np.dtype(np.float32 if str(self.cfg.get("precision", "float64")) == "float32" else np.float64)

    def state_labels(self, y: np.ndarray) -> np.ndarray:
        """The training labels as the server keeps them: regression/binary labels in :attr:`state_dtype`
        (float32 in a float32 run), class ids as int32."""
        if self.task == "multiclass":
            return np.asarray(y).astype(np.int32, copy=False)
        return np.asarray(y).astype(self.state_dtype, copy=False)

    def _labels(self, replies: Mapping[ClientKey, Reply], n_label_rows: int) -> tuple[np.ndarray, np.ndarray, int | None]:
        """Labels and test flags over the label table's rows, from every shard of the label table."""
        y_rows: np.ndarray | None = None
        is_test = np.zeros(n_label_rows, dtype=bool)
        n_classes = 0
        for (t, q), (arrays, reply_metrics) in replies.items():
            if t != self.spec.label_table:
                continue
            ids, y, flags = np.asarray(arrays["row_ids"], dtype=np.int64), arrays["y"], arrays["is_test"].astype(bool)
            randomized = reply_metrics.get("labels") == "train_randomized"
            if randomized != self.label_dp:
                raise RuntimeError(
                    f"label table {t!r} shard {q}: privacy={self.privacy.get('name')} but the label owner sent "
                    f"{'randomized training labels' if randomized else 'its raw labels'}"
                )
            if y_rows is None:
                y_rows = np.zeros(n_label_rows, dtype=y.dtype)
            if randomized:  # training rows only, in the order of the shard's rows; test labels stay with it
                y_rows[ids[~flags]] = y
                is_test[ids] = flags
            else:
                y_rows[ids], is_test[ids] = y, flags
            n_classes = max(n_classes, int(reply_metrics.get("n_classes", 0)))
        assert y_rows is not None
        return y_rows, is_test, n_classes or None

    def _federated_preprocessing(self) -> None:
        """Sec. 4.4: tables with several shards merge their shards' summaries into one global rule.

        Round 1 asks for summaries without order statistics; round 2 (only when needed) asks for the sketches
        of the columns that need them (a missing fit value somewhere, or binned), so no other column's
        values (min/max and order statistics) leave the shards. Both rounds name the table's feature columns
        (``columns``, spec order): the clients refuse a request without that exact list.
        """
        sharded = [t for t in self.spec.table_names if len(self.routers[t].shards) > 1]
        if not sharded:
            return
        columns = {t: ",".join([*self.spec.table(t).numeric, *self.spec.table(t).categorical]) for t in sharded}
        replies = self.send({
            k: ({}, {"phase": "stats", "columns": columns[k[0]], "sketch": ""}) for k in self.clients if k[0] in sharded
        })
        summaries = self._summaries(replies)
        wanted = {
            t: sketch_columns_needed(summaries[t], [c for c, _ in self.spec.table(t).binned]) for t in sharded
        }
        if any(wanted.values()):
            again = self.send({
                k: ({}, {"phase": "stats", "columns": columns[k[0]], "sketch": ",".join(wanted[k[0]])})
                for k in self.clients if wanted.get(k[0])
            })
            summaries.update(self._summaries(again))
        messages = {}
        for t in sharded:
            spec_t = self.spec.table(t)
            merged = merge_summaries(summaries[t])
            # the binned columns' quantile edges come from the merged sketch, which stays on the server
            edges = [quantile_bin_edges(merged, col, bins) for col, bins in spec_t.binned]
            rule = merged.arrays(with_sketch=False) + edges
            rule_id = hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in rule)).hexdigest()[:16]
            messages.update({k: (numbered("rule", rule), {"phase": "rule", "rule_id": rule_id}) for k in self.clients if k[0] == t})
        self.send(messages)

    def _summaries(self, replies: Mapping[ClientKey, Reply]) -> dict[str, list[ShardSummary]]:
        """The decoded preprocessing summaries of each table's shards, in shard order."""
        out: dict[str, list[ShardSummary]] = {}
        for (t, _), (arrays, _) in sorted(replies.items()):
            spec_t = self.spec.table(t)
            out.setdefault(t, []).append(ShardSummary.from_arrays(unnumbered(arrays, "summary"), spec_t.numeric, spec_t.categorical))
        return out

    def _key_kinds(self, replies: Mapping[ClientKey, Reply]) -> dict[str, dict[str, str]]:
        kinds: dict[str, dict[str, str]] = {}
        for (table, _), (_, m) in replies.items():
            pairs = [kv.split("=", 1) for kv in str(m.get("key_kinds", "")).split(",") if kv]
            kinds.setdefault(table, {}).update(dict(pairs))
        return kinds

    def _expand(self) -> None:
        """VFL: send p_i over all joined rows (train, then test); continue on the identity mapping."""
        N_train, N_test = self.train.N, self.test.N
        order = self.mapping.p  # train rows, then test rows (setup's partition)
        self.send({k: ({"p": order[k[0]]}, {"phase": "expand"}) for k in self.clients})
        n_all = N_train + N_test
        self.client_rows = {k: n_all for k in self.clients}
        ids = np.arange(n_all, dtype=index_dtype(n_all))
        identity = TableMapping({t: ids for t in order}, {t: n_all for t in order})
        self.train, self.test = identity.rows(0, N_train), identity.rows(N_train, n_all)

    # ------------------------------------------------------------------------------------------ checkpoints

    def begin(self, start: Callable[[], dict[str, Any]]) -> tuple[int, dict[str, Any]]:
        """The epochs done and the training loop's state: (0, ``start()``) for a fresh run (``start`` runs the
        setup and the algorithm's first rounds); for ``resume=true`` the last checkpoint's, after a ``resume``
        round in which every client restores its own checkpoint of that epoch (tpflower.checkpoint)."""
        if not self.resume:
            return 0, start()
        assert self.run_dir is not None
        saved = load_checkpoint(self.run_dir / CHECKPOINT, self.cfg)
        setup = load_checkpoint(self.run_dir / SETUP_CHECKPOINT, self.cfg)
        if setup["run_id"] != saved["run_id"]:
            raise ValueError(f"{SETUP_CHECKPOINT} and {CHECKPOINT} in {self.run_dir} are of different runs")
        epoch = int(saved["epoch"])
        self.run_id = str(saved["run_id"])
        self.send({k: ({}, {"phase": "resume", "run_id": self.run_id, "epoch": epoch, **dp.privacy_message(self.privacy)})
                   for k in self.clients})
        for name, value in {**setup["attributes"], **saved["attributes"]}.items():
            setattr(self, name, value)
        self._setup_saved = True
        self._t0 = time.perf_counter() - float(saved["elapsed"])
        self.log(f"resumed after epoch {epoch} from {self.run_dir / CHECKPOINT}")
        return epoch, saved["loop"]

    def checkpoint_config(self, epoch: int) -> dict[str, Any]:
        """Config of an epoch's last training message: each client checkpoints its state after answering it."""
        return {"checkpoint": int(epoch), "run_id": self.run_id} if self.run_dir is not None and self.resumable else {}

    def end_epoch(self, epoch: int, loop: dict[str, Any]) -> None:
        """Checkpoint the server's state after epoch ``epoch`` (atomically, into the run dir); what setup built
        is written with the first epoch only."""
        if self.run_dir is None or not self.resumable:
            return
        if not getattr(self, "_setup_saved", False):
            save_checkpoint(self.run_dir / SETUP_CHECKPOINT, self.cfg, {
                "run_id": self.run_id, "attributes": {name: getattr(self, name) for name in SETUP_STATE if hasattr(self, name)}})
            self._setup_saved = True
        save_checkpoint(self.run_dir / CHECKPOINT, self.cfg, {
            "epoch": int(epoch), "run_id": self.run_id, "elapsed": time.perf_counter() - self._t0, "loop": loop,
            "attributes": {name: getattr(self, name) for name in self.checkpointed if hasattr(self, name)},
        })

    # ------------------------------------------------------------------------------------------ records

    def on_round(self, kind: Kind, down: Mapping[ClientKey, int], up: Mapping[ClientKey, int]) -> None:
        # setup rounds (mapping, preprocessing) come before the meter exists and are not training traffic;
        # the VFL expansion is. "inner" rounds are the union's inner (coordinator) rounds. The label owner's
        # evaluation rounds (label DP, "eval") are evaluation, not training: not counted.
        for key, (_, m) in self._inbox.items():  # feature DP: every reply after a DP step says what was spent
            if "eps" in m:
                self.eps_spent[key] = float(m["eps"])
        if self.comm is not None and kind != "eval":
            self.comm.record(down, up, inner=kind == "inner")

    # ------------------------------------------------------------------------------------------ privacy

    def plan_feature_dp(self) -> dict[ClientKey, tuple[int, float]]:
        """Feature DP: per client, (local DP steps over the whole run, per-step sample rate of a table row).

        Called in setup on the training mapping of TABLE rows. The client calibrates sigma to these once."""
        raise ValueError(f"privacy={self.privacy.get('name')}: {self.algorithm} has no feature-DP plan")

    def client_G(self, key: ClientKey) -> np.ndarray:
        """G_iu over the training join of the rows of client ``key`` (its shard of table i), in shard order."""
        t, q = key
        return self.train.G(t)[self.routers[t].ids[q]]

    def dp_config(self, key: ClientKey) -> dict[str, Any]:
        """The DP plan of client ``key`` for the config of its first training message ({} without feature DP)."""
        if not self.feature_dp:
            return {}
        steps, q = self.dp_plan[key]
        return {"dp_steps": int(steps), "dp_q": float(q)}

    def feature_epsilon(self) -> float:
        """The feature epsilon spent so far: the max over clients (each row belongs to one client's table)."""
        return max(self.eps_spent.values(), default=0.0)

    def _evaluation_split(self) -> dict[ClientKey, tuple[np.ndarray, np.ndarray]]:
        """Label DP: per label-table shard, (indices into the test joined rows, positions of their label rows
        in the shard), ordered by the shard's rows: what the label owner needs to score the test predictions."""
        label = self.spec.label_table
        rows = self.test.p[label]  # label-table row of every test joined row (before any VFL expansion)
        router = self.routers[label]
        split = {}
        for q in router.shards:
            idx = np.flatnonzero(router.shard_of[rows] == q)
            pos = router.position[rows[idx]]
            order = np.argsort(pos, kind="stable")
            split[(label, q)] = (idx[order], pos[order])
        return split

    def test_metrics(self, H_test: np.ndarray) -> dict[str, float]:
        """Metrics of the test predictions.

        Without label DP the server holds the test labels and computes them. With label DP it sends each
        label-table shard its part of H (one ``evaluate`` round) and combines the replies exactly: loss and
        accuracy as row-weighted means, rmse from the summed squared errors. AUC needs all scores and labels
        together: it is reported only when the label table has one shard (the join scenario).
        """
        if self.y_test is not None:
            return metrics(self.task, H_test, self.y_test)
        assert self.results is not None
        ref = None  # the first evaluation also scores the constant predictor (results.json reference)
        if not self.results.reference:
            ref = self.label_scale.to_label(constant_predictions(self.task, self.y_train, len(H_test), self.d_out))
        replies = self.send(
            {k: ({"H": H_test[idx], "rows": pos, **({} if ref is None else {"H_ref": ref[idx]})}, {"phase": "evaluate"})
             for k, (idx, pos) in self._evaluation.items()},
            kind="eval",
        )
        parts = [(int(m["n"]), m) for _, m in (replies[k] for k in self._evaluation)]
        if ref is not None:
            self.results.reference = as_reference(self._combine([(c, {k[4:]: v for k, v in m.items() if k.startswith("ref_")})
                                                                 for c, m in parts]))
            self.log(f"reference: {reference_text(self.task, self.results.reference)} (scored by the label owner)")
        return self._combine([(c, {k: v for k, v in m.items() if not k.startswith("ref_")}) for c, m in parts])

    def _combine(self, parts: list[tuple[int, Mapping[str, Any]]]) -> dict[str, float]:
        """The test metrics of the whole test split from each label shard's (row count, metrics)."""
        n = sum(c for c, _ in parts)
        if n == 0:
            raise RuntimeError("evaluate: the label owner scored no test rows")
        if len(parts) == 1:
            return {k: float(v) for k, v in parts[0][1].items() if k != "n"}
        live = [(c, m) for c, m in parts if c > 0]
        out = {"loss": sum(c * float(m["loss"]) for c, m in live) / n}
        if self.task == "regression":
            out["rmse"] = float(np.sqrt(sum(c * float(m["rmse"]) ** 2 for c, m in live) / n))
        else:
            out["accuracy"] = sum(c * float(m["accuracy"]) for c, m in live) / n
        return out

    def record_epoch(self, epoch: int | float, H_test: np.ndarray, train_loss: float, extra: dict[str, float] | None = None) -> None:
        """Evaluate the test predictions, append the epoch to the record and print its line.

        With label DP the evaluation is a round with the label owner. With feature DP the line shows ``eps``, the max over clients of the epsilon spent so far;
        ``train_loss`` is against the labels the server holds (the randomized ones under label DP)."""
        assert self.results is not None and self.comm is not None
        scale = self.label_scale
        test = self.test_metrics(scale.to_label(H_test))
        train_loss = scale.loss(train_loss)
        if "objective" in (extra or {}):
            extra = {**(extra or {}), "objective": scale.loss(extra["objective"])}  # type: ignore[index]
        if not np.isfinite(train_loss):
            raise RuntimeError(f"{self.algorithm} diverged in epoch {epoch} (train loss {train_loss})")
        feature_eps = self.feature_epsilon() if self.feature_dp else None
        self.results.privacy = dp.privacy_summary(self.privacy, self.task, feature_eps)
        privacy: dict[str, float] = {}
        if feature_eps is not None:
            privacy["eps"] = feature_eps
        if self.label_dp:
            privacy["label_eps"] = float(self.results.privacy["label_epsilon"])  # type: ignore[arg-type]
        rec = EpochRecord(
            epoch=epoch,
            test_metric=test[self.metric],
            train_loss=train_loss,
            wall_time_s=time.perf_counter() - self._t0,
            extra={**{f"test_{k}": v for k, v in test.items() if k not in (self.metric, "loss")}, **(extra or {}), **privacy},
            **self.comm.snapshot(),  # type: ignore[arg-type]
        )
        self.results.history.append(rec)
        self.log(epoch_line(self.metric, rec))

    def finish(self) -> None:
        """Write results.json (atomically) once the protocol has run to its end."""
        self.finished = True
        if self.run_dir is not None and self.results is not None:
            path = write_results(self.results, self.run_dir)
            self.log(f"results: {path}")

    def messages(self, build: Callable[[str], Payload]) -> dict[ClientKey, Payload]:
        """One message per client, built from its table name (join scenario: one client per table)."""
        return {k: build(k[0]) for k in self.clients}

    @staticmethod
    def outputs(replies: Mapping[ClientKey, Reply], name: str = "h") -> dict[str, np.ndarray]:
        """Reply array ``name`` of every client, keyed by table (join scenario)."""
        return {k[0]: r[0][name] for k, r in replies.items()}

    def sgd_schedule(self) -> tuple[SGDSchedule, BatchPlan]:
        """The run's mini-batches over the training join (algorithm.batch_size, seed) and the test rows' plan."""
        B = batch_size_of(self.cfg.algorithm.batch_size, self.train.N)
        schedule = SGDSchedule(self.train, B, int(self.cfg.epochs), np.random.default_rng(int(self.cfg.seed)))
        return schedule, BatchPlan.of(self.test, np.arange(self.test.N))

    @staticmethod
    def sgd_rounds(schedule: SGDSchedule, done: int) -> Iterator[tuple[int, tuple]]:
        """The schedule's rounds, numbered from 1, after the ``done`` epochs a resumed run already has (the same
        seed draws the same batches, so they are drawn and skipped)."""
        rounds = enumerate(schedule, start=1)
        if done:
            for _, (epoch, _, _, _, last) in rounds:
                if epoch == done and last:
                    break
        return rounds

    def eval_point(self, round_no: int, epoch: int, last: bool, per_epoch: int) -> float | None:
        """SGD family: whether exchange round ``round_no`` (1-based) carries an evaluation, as the epoch it
        stands for: an epoch's last batch (the epoch, an int) and every algorithm.eval_every rounds (a fraction:
        the batches done so far over the batches of an epoch); None: no evaluation."""
        if last:
            return epoch
        every = getattr(self.params, "eval_every", None)
        if every and round_no % every == 0:
            return round(epoch - 1 + ((round_no - 1) % per_epoch + 1) / per_epoch, 6)
        return None

    def shard_messages(self, build: Callable[[ClientKey], Payload]) -> dict[ClientKey, Payload]:
        """One message per shard client (union scenario)."""
        return {k: build(k) for k in self.clients}

    def gather_rows(self, replies: Mapping[ClientKey, Reply], rows: Mapping[str, np.ndarray], name: str = "h") -> dict[str, np.ndarray]:
        """Per table, the shards' reply array ``name`` for the table rows ``rows[t]``, in that order."""
        return {
            t: self.routers[t].gather(rows[t], {q: r[0][name] for (tt, q), r in replies.items() if tt == t})
            for t in self.spec.table_names
        }
