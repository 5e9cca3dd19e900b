"""Model selection (docs/algorithms.md, Model selection): the kept model of a run with the shipped validation part
against the last model of the same run without one, per algorithm and dataset, side by side.

    python -m simulations.bench selection [--epochs 10]      -> bench_results/selection.json
    python -m simulations.bench.selection plot bench_results/selection.json docs/selection.png

Each case runs twice in this process, in-process runtime, shipped defaults otherwise: with ``validation_fraction``
left at null (the algorithm's default, 0.1, with ``early_stopping`` 5) and with ``validation_fraction=0`` (the
whole training split, the last epoch's model). The test split is the same in both.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from simulations.bench.common import peak_rss_mb
from tpflower.config import compose_config

#: (dataset, algorithm, model): the MLP trained by SGD on the two regression datasets
SELECTION_CASES = (
    ("movielens", "sgd", "mlp"),
    ("nycflights13", "sgd", "mlp"),
)


def selection_run(dataset: str, algorithm: str, model: str, epochs: int, *overrides: str) -> dict[str, Any]:
    """One run: its evaluations (epoch, test metric, validation loss), the kept record and its selection."""
    from simulations.federated import run_in_process  # noqa: PLC0415  torch, flwr: in the case's process only

    cfg = compose_config(
        f"dataset={dataset}", f"algorithm={algorithm}", f"model={model}", f"epochs={epochs}", *overrides
    )
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tpflower-bench-selection-") as tmp:
        results = run_in_process(cfg, Path(tmp) / "run", log=lambda _: None).strategy.results
    evaluations = [h for h in results.history if "kept" not in h.extra]
    return {
        "metric": results.metric,
        "evaluations": [
            {"epoch": h.epoch, "test_metric": h.test_metric, "val_loss": h.extra.get("val_loss")} for h in evaluations
        ],
        "final": results.history[-1].test_metric,
        "selection": results.selection,
        "stopped": results.stopped,
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def selection_suite(epochs: int = 10) -> dict[str, Any]:
    cases = []
    for dataset, algorithm, model in SELECTION_CASES:
        kept = selection_run(dataset, algorithm, model, epochs)
        last = selection_run(dataset, algorithm, model, epochs, "validation_fraction=0")
        cases.append({"dataset": dataset, "algorithm": algorithm, "model": model, "kept": kept, "last": last})
        print(dataset, algorithm, model, kept["selection"], kept["final"], last["final"], flush=True)
    return {"case": "selection", "epochs": epochs, "cases": cases, "peak_rss_mb": round(peak_rss_mb(), 1)}


def plot(path: Path, png: Path) -> None:
    """Per case: the test metric per epoch with and without the validation part, the kept model (a star on its
    epoch) and the validation loss (right axis); one legend under the panels, so no curve hides behind it."""
    import matplotlib  # noqa: PLC0415  only the plot draws (the suite never imports it)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415

    data = json.loads(path.read_text())
    cases = data["cases"]
    fig, axes = plt.subplots(1, len(cases), figsize=(4.8 * len(cases), 4.0), squeeze=False)
    vals = [ax.twinx() for ax in axes[0]]
    for ax, val, c in zip(axes[0], vals, cases):
        kept, last = c["kept"], c["last"]
        ev = kept["evaluations"]
        val.plot(
            [e["epoch"] for e in ev],
            [e["val_loss"] for e in ev],
            ":",
            color="tab:green",
            lw=1.2,
            label="validation loss (right axis)",
        )
        val.set_ylabel("validation loss", color="tab:green")
        val.tick_params(axis="y", colors="tab:green")
        for run, label, style in (
            (last, "test, no validation part (keeps the last)", "--"),
            (kept, "test, validation part 0.1", "-"),
        ):
            ev = run["evaluations"]
            ax.plot([e["epoch"] for e in ev], [e["test_metric"] for e in ev], style, marker=".", label=label)
        k = kept["selection"]["kept_epoch"]
        ax.plot(
            [k], [kept["final"]], "*", ms=14, color="tab:red", zorder=5, label="kept model (lowest validation loss)"
        )
        ax.set_zorder(val.get_zorder() + 1)  # the test curves over the validation loss
        ax.patch.set_visible(False)
        ax.set_title(f"{c['dataset']}: {c['algorithm']}, {c['model']} (kept: epoch {k})", fontsize=10)
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(f"test {kept['metric']}")
        ax.grid(alpha=0.3)
    handles = [h for a in (axes[0][0], vals[0]) for h in a.get_legend_handles_labels()[0]]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.suptitle(f"Model selection: the kept model against the last one ({data['epochs']} epochs at most)", fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(png, dpi=110)
    print(f"written: {png}")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "plot":
        plot(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        raise SystemExit("usage: python -m simulations.bench.selection plot SELECTION_JSON OUT_PNG")
