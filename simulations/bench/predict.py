"""Prediction throughput: federated prediction of new movielens ratings against one TP-Join-ADMM epoch, side by
side (docs/prediction.md).

python -m simulations.bench predict [--n-joined 100000]      -> bench_results/predict.json

One process, in-process runtime (the same strategy and ClientApp as under Flower, no transport): train
TP-Join-ADMM for two epochs on movielens (its parts saved in a temporary run dir), then score ``n`` rows of the
ratings table as new rows (keys and features, no label) with ``simulations.predict`` and time it. The ADMM
epoch is the second epoch's wall time (the first also holds the admm_setup round).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from simulations.bench.common import peak_rss_mb
from simulations.federated import run_in_process
from simulations.predict import predict_run
from tpflower.config import compose_config
from tpflower.datasets import load_table


def predict_suite(n: int = 100_000) -> dict[str, Any]:
    cfg = compose_config("algorithm=admm", "dataset=movielens", "epochs=2", "runtime=inprocess")
    with tempfile.TemporaryDirectory(prefix="tpflower-bench-predict-") as tmp:
        run_dir = Path(tmp) / "run"
        t0 = time.perf_counter()
        strategy = run_in_process(cfg, run_dir, log=lambda _: None).strategy
        train_s = time.perf_counter() - t0
        history = strategy.results.history
        epoch_s = history[1].wall_time_s - history[0].wall_time_s
        spec, frame = load_table(cfg.dataset, spec_label := strategy.spec.label_table)
        t = spec.table(spec_label)
        columns = [*spec.key_columns(spec_label), *t.numeric, *t.categorical, *(c for c, _ in t.binned)]
        rows = frame[list(dict.fromkeys(columns))].iloc[:n]  # keys and features: what a query owner sends
        path = Path(tmp) / "new.csv"
        rows.to_csv(path, index=False)
        t0 = time.perf_counter()
        pred = predict_run(run_dir, path, log=lambda _: None)
        predict_s = time.perf_counter() - t0
    return {
        "case": "predict",
        "data": "movielens",
        "query_table": spec_label,
        "new_rows": len(rows),
        "joined_rows": len(pred.rows),
        "unjoined_rows": len(pred.unjoined),
        "predict_s": round(predict_s, 2),
        "rows_per_s": round(len(rows) / predict_s),
        "admm_epoch_s": round(epoch_s, 2),
        "admm_train_s": round(train_s, 2),
        "predict_over_epoch": round(predict_s / epoch_s, 2),
        "peak_rss_mb": round(peak_rss_mb(), 1),
    }
