"""Centralized baseline (TablePuppet Sec. 6): train the global model on the materialized join.

The global model is the sum of the local models on the concatenated features (same parameters, same
initialisation as the federated runs). Solvers: mini-batch SGD (Eq. 5-6 on the joined table), or for linear
regression the exact ridge solution, the best any linear model can do on these features.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tpflower import privacy as dp
from tpflower.batches import batch_size_of, epoch_batches
from tpflower.categorical import best_native_splits, blocks_of, category_codes, in_set
from tpflower.losses import LabelScale, label_scaling, loss_np, loss_torch, metrics, primary_metric
from tpflower.models import JoinedModel, l2_penalty, torch_dtype
from tpflower.owner import simulation_secret
from tpflower.params import run_settings
from tpflower.phases.centralized import CentralizedParams
from tpflower.phases.gbdt import GBDTParams
from tpflower.reference import as_reference, constant_predictions, reference_text
from tpflower.relation import Relation, build_local_model, load_relation, summary_line
from tpflower.results import EpochRecord, RunResults, epoch_line, importance_line, new_run_results, write_results
from tpflower.schema import RelationalSpec
from tpflower.trees import (
    BinLayout,
    Bundles,
    Candidate,
    Growth,
    Node,
    Tree,
    add_leaves,
    best_splits,
    bin_codes,
    column_edges,
    first_best,
    gradients,
    grow_forest,
    histograms,
    init_scores,
    leaf_values,
    table_importance,
)
from tpflower.validation import validation_fraction_of

EVAL_CHUNK = 65536  # rows of the join materialized at once when predicting


def build_joined_model(rel: Relation, model_cfg: Any, seed: int, dtype: torch.dtype) -> JoinedModel:
    local = {
        t: build_local_model(model_cfg, rel.spec, t, rel.tables[t].width, rel.d_out, seed, dtype)
        for t in rel.spec.table_names
    }
    return JoinedModel(local, {t: rel.tables[t].width for t in rel.spec.table_names})


def predict(
    model: torch.nn.Module, rel: Relation, mapping, dtype: torch.dtype, scale: LabelScale = LabelScale()
) -> np.ndarray:
    """H for every joined row of ``mapping`` in the label's units, materializing the join chunk by chunk."""
    out = []
    with torch.no_grad():
        for start in range(0, mapping.N, EVAL_CHUNK):
            rows = slice(start, min(start + EVAL_CHUNK, mapping.N))
            out.append(model(torch.as_tensor(rel.joined_features(mapping, rows), dtype=dtype)).numpy())
    return scale.to_label(np.concatenate(out)) if out else np.zeros((0, rel.d_out))


def evaluate(model, rel: Relation, dtype, scale: LabelScale = LabelScale()) -> dict[str, float]:
    return metrics(rel.spec.label.task, predict(model, rel, rel.test, dtype, scale), rel.labels(rel.test))


def label_scale_of(cfg: Any, rel: Relation) -> LabelScale:
    """The federated runs' label scale (config ``standardize_label``): fitted on the training join's labels."""
    return LabelScale.fit(rel.spec.label.task, rel.labels(rel.train), label_scaling(cfg))


def exact_ridge(
    rel: Relation, beta: float, intercept: bool = True, scale: LabelScale = LabelScale()
) -> tuple[np.ndarray, float]:
    """argmin_w (1/N) sum_j 1/2 (x_j w + b - y_j)^2 + beta/2 ||(w, b)||^2 on the training join (float64),
    y the scaled labels (``scale``); returned as the scaled solution, whose predictions ``scale.to_label`` maps
    to the label's units.

    The normal equations (X1^T X1 / N + beta I) w1 = X1^T y / N are accumulated chunk by chunk, with
    X1 = [X, 1] (X alone when ``intercept`` is False, and then b = 0). Returns (w of shape (d,), b).
    """
    train, N = rel.train, rel.train.N
    y = scale.scaled(rel.labels(train))
    d = sum(rel.tables[t].width for t in rel.spec.table_names) + int(intercept)
    A = np.zeros((d, d))
    c = np.zeros(d)
    for start in range(0, N, EVAL_CHUNK):
        rows = slice(start, min(start + EVAL_CHUNK, N))
        X1 = rel.joined_features(train, rows)
        if intercept:
            X1 = np.concatenate([X1, np.ones((len(X1), 1))], axis=1)
        A += X1.T @ X1
        c += X1.T @ y[rows]
    w1 = np.linalg.solve(A / N + beta * np.eye(d), c / N)
    return (w1[:-1], float(w1[-1])) if intercept else (w1, 0.0)


def set_linear_weights(model: JoinedModel, rel: Relation, w: np.ndarray, b: float) -> None:
    """Load a flat weight vector (concatenated-feature order) into the local models; the first local bias
    gets the intercept ``b`` and any other local bias 0, so the sum of the local models is x w + b."""
    offset = 0
    placed = False
    with torch.no_grad():
        for t in rel.spec.table_names:
            lin = model.local[t]
            width = rel.tables[t].width
            lin.weight.copy_(torch.as_tensor(w[offset : offset + width]).reshape(1, -1))
            offset += width
            if lin.bias is not None:
                lin.bias.fill_(0.0 if placed else b)
                placed = True


def make_optimizer(name: str, params: Any, lr: float) -> torch.optim.Optimizer:
    """``algorithm.optimizer``: sgd (plain SGD, Eq. 6: the update the federated SGD algorithms apply) or adam."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    raise ValueError(f"algorithm.optimizer must be sgd or adam, got {name!r}")


def centralized_epochs(cfg: Any, N: int, B: int, log=print) -> int:
    """``epochs``, or as algorithm=sgd more when its mini-batch steps fall short of ``algorithm.min_steps`` (a
    small training join; not under privacy, nor with full batches): the baseline a federated run is compared
    with trains at least as many steps (docs/algorithms.md#small-training-joins). One line says so."""
    epochs, min_steps = int(cfg.epochs), int(cfg.algorithm.get("min_steps", 0) or 0)
    private = str((cfg.get("privacy") or {}).get("name", "none")) != "none"
    per_epoch = -(-N // B)
    if private or str(cfg.algorithm.batch_size) == "full" or per_epoch * epochs >= min_steps:
        return epochs
    longer = -(-min_steps // per_epoch)
    log(
        f"epochs: {per_epoch} mini-batch step(s) per epoch ({N:,} training rows, algorithm.batch_size={B}): "
        f"{longer} epochs, not {epochs}, for algorithm.min_steps={min_steps} steps (algorithm.min_steps=0: "
        "exactly epochs)"
    )
    return longer


def train_centralized(cfg: Any, rel: Relation, results: RunResults, log=print) -> JoinedModel:
    """Mini-batch SGD (or the exact ridge solution) on the joined table; appends one record per epoch."""
    dtype = torch_dtype(cfg.precision)
    task = rel.spec.label.task
    metric = primary_metric(task)
    model = build_joined_model(rel, cfg.model, int(cfg.seed), dtype)
    beta = float(cfg.model.beta)
    start = time.perf_counter()
    solver = cfg.algorithm.get("solver", "sgd")
    if validation_fraction_of(cfg.get("validation_fraction"), 0.0) > 0:
        raise ValueError(
            f"validation_fraction={cfg.validation_fraction}: the centralized baseline trains on the whole training "
            "join and keeps its last model; set validation_fraction=0 (or null)"
        )
    scale = label_scale_of(cfg, rel)  # regression: trained on the standardized label, as the federated runs
    if solver == "exact":
        if task != "regression" or cfg.model.kind != "linear":
            raise ValueError("algorithm.solver=exact is the ridge solution: it needs task regression and model=linear")
        intercept = any(m.bias is not None for m in model.local.values())
        w, b = exact_ridge(rel, beta, intercept, scale)
        set_linear_weights(model, rel, w, b)
        train_metrics = metrics(task, predict(model, rel, rel.train, dtype, scale), rel.labels(rel.train))
        test = evaluate(model, rel, dtype, scale)
        rec = EpochRecord(
            epoch=0, test_metric=test[metric], train_loss=train_metrics["loss"], wall_time_s=time.perf_counter() - start
        )
        results.history.append(rec)
        log(epoch_line(metric, rec))
        return model
    N = rel.train.N
    B = batch_size_of(cfg.algorithm.batch_size, N)
    y_all = torch.as_tensor(scale.scaled(rel.labels(rel.train)), dtype=torch.long if task == "multiclass" else dtype)
    opt = make_optimizer(str(cfg.algorithm.get("optimizer", "sgd")), model.parameters(), float(cfg.algorithm.lr))
    gen = np.random.default_rng(int(cfg.seed))
    for epoch in range(1, centralized_epochs(cfg, N, B, log) + 1):
        total, count = 0.0, 0
        for rows in epoch_batches(N, B, gen):  # the federated SGD strategies draw the same batches
            X = torch.as_tensor(rel.joined_features(rel.train, rows), dtype=dtype)
            loss = loss_torch(task, model(X), y_all[rows])
            opt.zero_grad()
            (loss + beta * l2_penalty(model)).backward()  # Eq. 5: batch mean of dl/dtheta + beta dR/dtheta
            opt.step()  # Eq. 6
            total += float(loss.detach()) * len(rows)
            count += len(rows)
        if not np.isfinite(total):
            raise RuntimeError(
                f"training diverged in epoch {epoch} (train loss {total / count}); lower algorithm.lr "
                f"(now {cfg.algorithm.lr}) or raise algorithm.batch_size"
            )
        test = evaluate(model, rel, dtype, scale)
        rec = EpochRecord(
            epoch=epoch,
            test_metric=test[metric],
            train_loss=scale.loss(total / count),
            wall_time_s=time.perf_counter() - start,
            extra={f"test_{k}": v for k, v in test.items() if k not in (metric, "loss")},
        )
        results.history.append(rec)
        log(epoch_line(metric, rec))
    return model


def constant_predictor_metric(rel: Relation) -> dict[str, float]:
    """Test metrics of the constant predictor fitted on the training join (mean, or class prior)."""
    task = rel.spec.label.task
    y_test = rel.labels(rel.test)
    return metrics(task, constant_predictions(task, rel.labels(rel.train), len(y_test), rel.d_out), y_test)


class Centralized:
    """The centralized baseline as a registered algorithm: built like a federated strategy (its settings and
    privacy checked in the constructor, before any table is loaded), run in one place by :meth:`run_local`."""

    algorithm = "centralized"
    params_type: type = CentralizedParams
    resumable = False
    one_shot = False

    def __init__(
        self,
        cfg: Any,
        spec: RelationalSpec,
        run_dir: str | Path | None,
        log: Callable[[str], None] = print,
        feature_dp: bool = False,
        label_dp: bool = True,
        why_no_feature_dp: str = "",
        why_no_label_dp: str = "",
    ):
        self.cfg, self.spec, self.log = cfg, spec, log
        self.run_dir = Path(run_dir) if run_dir is not None else None
        run_settings(cfg)
        self.params = self.params_type.from_cfg(cfg.algorithm)
        self.privacy = cfg.get("privacy") or {"name": "none"}
        dp.validate_privacy(
            self.privacy,
            self.algorithm,
            spec.label.task,
            feature_dp=feature_dp,
            label_dp=label_dp,
            why_not=why_no_feature_dp,
            why_no_label=why_no_label_dp,
        )
        self.results: RunResults | None = None

    def run_local(self, base_dir: str | Path | None = None) -> RunResults:
        """Materialize the join, train, write results.json into the run dir; the run's record."""
        cfg = self.cfg
        rel = load_relation(cfg.dataset, simulation_secret(cfg), base_dir=base_dir, verbose=False)
        if dp.uses_label_dp(self.privacy):
            randomize_training_labels(rel, self.privacy)
        results = new_run_results(cfg, self.algorithm, rel.spec, rel.mapping)
        results.privacy = dp.privacy_summary(self.privacy, rel.spec.label.task)
        results.reference = as_reference(constant_predictor_metric(rel))
        self.log(f"{summary_line(rel.spec, rel.mapping)} | {reference_text(rel.spec.label.task, results.reference)}")
        train_centralized(cfg, rel, results, log=self.log)
        self.results = results
        if self.run_dir is not None:
            self.log(f"results: {write_results(results, self.run_dir)}")
        return results


def randomize_training_labels(rel: Relation, privacy: Any) -> None:
    """Label DP for the centralized baseline: the training labels randomized exactly as the federated label
    owner does (one draw over every row, of which the training rows are kept; noise from the OS entropy); test
    labels stay true."""
    label = rel.label
    assert label.y is not None and label.is_test is not None
    train = ~label.is_test
    y = label.y.copy()
    noisy = dp.randomize_labels(label.y, rel.spec.label.task, privacy, dp.label_rng(), label.n_classes)
    y[train] = noisy[train]
    label.y = y


# ---------------------------------------------------------------------------------------------- boosted trees


def central_gbdt(
    X: Mapping[str, np.ndarray],
    y: np.ndarray,
    task: str,
    d_out: int,
    params: GBDTParams,
    X_eval: Mapping[str, np.ndarray] | None = None,
    on_round: Callable[[int, list[Tree], np.ndarray, np.ndarray], None] | None = None,
    blocks: Mapping[str, list[np.ndarray]] | None = None,
) -> tuple[list[list[Tree]], np.ndarray, np.ndarray]:
    """The central histogram GBDT (tpflower.trees) on the materialized join: ``X[t]`` the joined rows' features
    of table t (training rows, labels ``y`` as training sees them), ``X_eval`` the same for rows to predict.
    Bins on the joined columns (unit weights: the federated owners' G-weighted edges), then
    :func:`central_trees`. Returns the rounds' trees and the final scores of the training and evaluated rows."""
    edges = {t: column_edges(X[t], np.ones(len(y)), params.max_bins) for t in X}
    codes = {t: bin_codes(X[t], edges[t]) for t in X}
    eval_codes = {t: bin_codes(X_eval[t], edges[t]) for t in X} if X_eval is not None else None
    return central_trees(codes, edges, y, task, d_out, params, eval_codes, on_round, blocks)


def central_trees(
    codes: Mapping[str, np.ndarray],
    edges: Mapping[str, list[np.ndarray]],
    y: np.ndarray,
    task: str,
    d_out: int,
    params: GBDTParams,
    eval_codes: Mapping[str, np.ndarray] | None = None,
    on_round: Callable[[int, list[Tree], np.ndarray, np.ndarray], None] | None = None,
    blocks: Mapping[str, list[np.ndarray]] | None = None,
) -> tuple[list[list[Tree]], np.ndarray, np.ndarray]:
    """The central histogram GBDT on the joined rows' bins: ``codes[t]`` (tpflower.trees.bin_codes on
    ``edges[t]``) of the training rows (labels ``y`` as training sees them), ``eval_codes`` of rows to predict;
    the tie rule table, feature, bin; each table's mostly-constant columns histogrammed in bundles
    (tpflower.trees.Bundles), as the owners do. ``on_round(r, trees, F, F_eval)`` after every round. Returns
    the rounds' trees and the final scores of the training and evaluated rows. ``blocks[t]``: the one-hot
    blocks of table t's categorical columns (tpflower.categorical.blocks_of), split natively when
    ``params.categorical`` is native."""
    tables = sorted(codes)
    cat = params.categorical_rule
    blocks = {t: list((blocks or {}).get(t, [])) if cat is not None else [] for t in tables}
    rule = params.rule
    layout = {t: BinLayout.of(edges[t]) for t in tables}
    bundles = {t: Bundles.of(codes[t], layout[t]) for t in tables}
    # each row's category per block (native categorical splits), training and evaluated rows
    cats = {t: {int(b[0]): category_codes(codes[t], layout[t], b) for b in blocks[t]} for t in tables}
    eval_cats = (
        {t: {int(b[0]): category_codes(eval_codes[t], layout[t], b) for b in blocks[t]} for t in tables}
        if eval_codes is not None
        else None
    )
    block_of = {t: {int(b[0]): b for b in blocks[t]} for t in tables}

    def side(
        t: str,
        f: int,
        k: int,
        missing: int,
        chosen: np.ndarray | None,
        codes_t: np.ndarray,
        cats_t: dict,
        s: np.ndarray,
    ) -> np.ndarray:
        """The side of rows ``s``: "flat code <= k" of feature f (or its flat missing bin ``missing`` >= 0: the
        missing values go left too), or its category in ``chosen``."""
        if chosen is not None:
            return in_set(cats_t[f][s], block_of[t][f], chosen)
        code = codes_t[f][s]
        return (code <= k) | (code == missing) if missing >= 0 else code <= k

    def evaluate(nodes: list[Node], perms: list[np.ndarray], g: np.ndarray, h: np.ndarray) -> list[Candidate | None]:
        segs = [perms[node.out][node.start : node.end] for node in nodes]
        rows = np.concatenate(segs)
        slot = np.repeat(np.arange(len(nodes)), [len(s) for s in segs])
        outs = np.repeat([node.out for node in nodes], [len(s) for s in segs])
        hk = None if task == "regression" else h[rows, outs]
        found = []  # per table (in name order: a tie keeps the smallest table name): gains, features, bins
        for t in tables:
            hists = histograms(codes[t], rows, g[rows, outs], hk, None, layout[t].total, slot, len(nodes), bundles[t])
            if blocks[t]:
                found.append(best_native_splits(hists, layout[t], blocks[t], rule, cat))
            else:
                found.append((*best_splits(hists, layout[t], rule), [None] * len(nodes)))
        out: list[Candidate | None] = []
        for i in range(len(nodes)):
            j = first_best(np.array([gains[i] for gains, *_ in found]))
            t, f, b, chosen = tables[j], int(found[j][1][i]), int(found[j][2][i]), found[j][4][i]
            k = -1 if f < 0 else int(layout[t].offsets[f]) + b  # "bin <= b" of feature f: flat code <= k
            missing = int(layout[t].offsets[f + 1]) - 1 if f >= 0 and found[j][3][i] else -1
            gain = float(found[j][0][i])
            left = functools.partial(side, t, f, k, missing, chosen, codes[t], cats[t])
            out.append(None if f < 0 else Candidate(gain, t, left, (f, k, missing), chosen))
        return out

    growth = Growth(params.max_leaves, params.max_depth, params.leaves_per_step, params.learning_rate, rule)
    F0 = init_scores(task, y, d_out)
    F = np.tile(F0, (len(y), 1))
    n_eval = 0 if eval_codes is None else next(iter(eval_codes.values())).shape[1]
    F_eval = np.tile(F0, (n_eval, 1))
    forest, next_id = [], 0
    for r in range(1, params.trees + 1):
        g, h = gradients(task, F, y)
        trees, perms, next_id = grow_forest(np.arange(len(y)), g, h, growth, evaluate, next_id)
        add_leaves(F, trees, perms)
        if eval_codes is not None:
            for tree in trees:
                F_eval[:, tree.out] += leaf_values(
                    tree,
                    n_eval,
                    lambda node, idx: side(
                        node.table, *node.split, node.categories, eval_codes[node.table], eval_cats[node.table], idx
                    ),
                )
        forest.append(trees)
        if on_round is not None:
            on_round(r, trees, F, F_eval)
    return forest, F, F_eval


class CentralizedGBDT(Centralized):
    """algorithm=centralized_gbdt: the central histogram GBDT on the materialized join (the federated gbdt's
    reference: same bins, same growth, same tie rule; its settings are gbdt's)."""

    algorithm = "centralized_gbdt"

    params_type: type = GBDTParams

    def run_local(self, base_dir: str | Path | None = None) -> RunResults:
        cfg, params = self.cfg, self.params
        rel = load_relation(cfg.dataset, simulation_secret(cfg), base_dir=base_dir, verbose=False)
        if dp.uses_label_dp(self.privacy):
            randomize_training_labels(rel, self.privacy)
        task = rel.spec.label.task
        results = new_run_results(cfg, self.algorithm, rel.spec, rel.mapping)
        results.privacy = dp.privacy_summary(self.privacy, task)
        results.reference = as_reference(constant_predictor_metric(rel))
        self.log(f"{summary_line(rel.spec, rel.mapping)} | {reference_text(task, results.reference)}")
        scale = label_scale_of(cfg, rel)
        y = scale.scaled(rel.labels(rel.train))
        # each table's columns binned on its rows weighted by their joined training rows: the joined columns'
        # bins, bit for bit (tpflower.trees.bin_edges), without the join's floats; the join's rows take their
        # table rows' bins
        edges, codes, test_codes = {}, {}, {}
        for t in rel.spec.table_names:
            X_t = rel.features(t, keep_missing=True)  # missing values: their own bin, as the owners'
            G_t = np.bincount(rel.train.p[t], minlength=len(X_t))
            edges[t] = column_edges(X_t, G_t, params.max_bins)
            table_codes = bin_codes(X_t, edges[t], rel.features(t))  # a column no training row missed: median
            codes[t], test_codes[t] = table_codes[:, rel.train.p[t]], table_codes[:, rel.test.p[t]]
        metric, y_test, start = primary_metric(task), rel.labels(rel.test), time.perf_counter()

        def on_round(r: int, trees: list[Tree], F: np.ndarray, F_test: np.ndarray) -> None:
            if r % params.eval_every and r != params.trees:
                return
            test = metrics(task, scale.to_label(F_test), y_test)
            rec = EpochRecord(
                epoch=r,
                test_metric=test[metric],
                train_loss=scale.loss(float(loss_np(task, F, y).mean())),
                wall_time_s=time.perf_counter() - start,
                extra={"trees": float(r), **{f"test_{k}": v for k, v in test.items() if k not in (metric, "loss")}},
            )
            results.history.append(rec)
            self.log(epoch_line(metric, rec))

        blocks = {t: blocks_of(rel.tables[t].preprocessor) for t in rel.spec.table_names}
        forest, _, _ = central_trees(codes, edges, y, task, rel.d_out, params, test_codes, on_round, blocks)
        results.importance = table_importance(forest)
        self.log(importance_line(results.importance, len(y), params.min_child_rows))
        self.results = results
        if self.run_dir is not None:
            self.log(f"results: {write_results(results, self.run_dir)}")
        return results
