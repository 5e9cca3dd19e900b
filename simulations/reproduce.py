"""Paper figures from results.json records: test metric vs epoch and vs modelled communication time.

    python -m simulations.reproduce RUN_DIRS... [--out FIGURE_PREFIX] [--title TEXT]

Each RUN_DIR is a run directory holding results.json, the path of a results.json file, or a directory (a Hydra
multirun dir) whose subdirectories hold results.json files; it expands to all of them. Every path is read and
checked before anything is drawn. Writes FIGURE_PREFIX_epoch.png (test metric vs epoch) and
FIGURE_PREFIX_comm.png (test metric vs cumulative modelled communication time, TablePuppet Figs. 5 and 7), one
column of plots per dataset, and prints the table behind them.

Per dataset, each run has its own colour, dash pattern and marker (identical runs stay visible), its label
names the algorithm, the model and the settings that tell it apart from runs of the same algorithm and model;
the exact solution (a centralized ``algorithm.solver=exact`` run) and the constant predictor (results.json
``reference``) are horizontal reference lines; the y-range shows where the runs converge (the first epochs'
spike is left out, a far-off constant predictor is named in the legend as off the axis). A run that never
communicates (the centralized baseline) is a horizontal line in the communication figure.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tpflower.results import RESULTS_FILE, ResultsError, read_results

LOWER_IS_BETTER = {"rmse", "mse", "mae", "loss", "log_loss", "logloss", "error"}
# Config keys tried, in this order, to tell apart runs that share algorithm and dataset.
LABEL_KEY_PREFERENCE = ("algorithm.", "privacy.", "model.", "epochs", "seed", "precision", "network.", "scenario.")
IGNORED_CONFIG_PREFIXES = ("hydra", "mapping.secret")
LOG_SPAN = 100.0  # use a log time axis when the positive times span more than 2 decades
PATH_KEY = "_path"  # where load_runs records the file a run was read from


# ---------------------------------------------------------------------------------------------------- loading


def _natural_key(path: Path) -> list[Any]:
    """Sort Hydra job dirs 0, 1, ..., 10 numerically rather than 0, 1, 10, 2."""
    return [int(tok) if tok.isdigit() else tok for tok in re.split(r"(\d+)", str(path))]


def find_results(paths: Sequence[str | Path], skipped: list[str] | None = None) -> list[Path]:
    """The results.json files named by ``paths``, in the order given (multirun dirs expanded, duplicates dropped).

    Raises ResultsError naming the path when it does not exist or holds no results.json. With ``skipped`` (a
    list), a sweep's other files (multirun.yaml) and its job folders without results.json (a failed or
    unfinished job) are left out, one line each in it; ResultsError then only when no path holds results.
    """
    found: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise ResultsError(f"{path}: no such file or directory")
        if path.is_file() and skipped is not None and path.suffix != ".json":
            skipped.append(f"{path}: not a {RESULTS_FILE}")
            continue
        if path.is_file():
            files = [path]
        elif (path / RESULTS_FILE).is_file():
            files = [path / RESULTS_FILE]
        else:
            files = sorted((p for p in path.rglob(RESULTS_FILE) if p.is_file()), key=_natural_key)
            if skipped is not None:  # a sweep's job folders (each has .hydra/) that hold no results
                jobs = {p.parent for p in path.rglob(".hydra") if p.is_dir()} | ({path} if not files else set())
                done = {f.parent for f in files}
                skipped += [f"{j}: no {RESULTS_FILE} (a failed or unfinished run)" for j in sorted(jobs - done)]
            elif not files:
                raise ResultsError(f"{path}: no {RESULTS_FILE} in this directory or its subdirectories")
        for f in files:
            if f.resolve() not in {g.resolve() for g in found}:
                found.append(f)
    if not found:
        raise ResultsError(f"no {RESULTS_FILE} in {', '.join(map(str, paths))}")
    return found


def load_runs(paths: Sequence[str | Path], skipped: list[str] | None = None) -> list[dict[str, Any]]:
    """Read and check every results.json named by ``paths`` (see find_results, ``skipped`` too) before
    returning any.

    Each returned dict is the record itself plus ``"_path"``: the file it came from.
    """
    runs = []
    for f in find_results(paths, skipped):
        record = dict(read_results(f))  # the schema of tpflower.results; ResultsError names the file and field
        record[PATH_KEY] = str(f)
        runs.append(record)
    return runs


def _as_dict(run: Any) -> dict[str, Any]:
    """Accept RunResults objects as well as loaded dicts."""
    return run.to_json() if hasattr(run, "to_json") else run


# ---------------------------------------------------------------------------------------------------- summary


def lower_is_better(metric: str) -> bool:
    return metric.lower() in LOWER_IS_BETTER


def _metric_values(run: dict[str, Any]) -> list[float]:
    return [float("nan") if h["test_metric"] is None else float(h["test_metric"]) for h in run["history"]]


def best_metric(run: dict[str, Any]) -> float | None:
    """min of the test metric over epochs for error metrics (rmse, ...), max otherwise (accuracy, auc); NaNs skipped."""
    values = [v for v in _metric_values(run) if not math.isnan(v)]
    if not values:
        return None
    return min(values) if lower_is_better(run["metric"]) else max(values)


def is_centralized(run: dict[str, Any]) -> bool:
    """No communication at all: every record has rounds = 0 and comm_time_s = 0 (the centralized baseline)."""
    hist = run["history"]
    return bool(hist) and all((h.get("rounds") or 0) == 0 and (h.get("comm_time_s") or 0) == 0 for h in hist)


def _flatten(cfg: Any, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    if isinstance(cfg, dict):
        for k, v in cfg.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    else:
        key = prefix[:-1]
        out[key] = cfg if isinstance(cfg, str) else json.dumps(cfg, sort_keys=True)
    return out


def _key_rank(key: str) -> tuple[int, str]:
    for i, p in enumerate(LABEL_KEY_PREFERENCE):
        if key == p or key.startswith(p):
            return i, key
    return len(LABEL_KEY_PREFERENCE), key


def _distinguishing(group: list[dict[str, Any]]) -> list[str]:
    """Per run of ``group`` (same algorithm and dataset): a short 'key=value, ...' telling it apart from the rest."""
    flats = [_flatten(r.get("config") or {}) for r in group]
    keys = set().union(*flats)
    differing = sorted(
        (k for k in keys if not k.startswith(IGNORED_CONFIG_PREFIXES) and len({f.get(k) for f in flats}) > 1),
        key=_key_rank,
    )
    chosen: list[str] = []
    n_distinct = 1
    for k in differing:  # greedy: keep a key only if it separates more runs
        n = len({tuple(f.get(c) for c in [*chosen, k]) for f in flats})
        if n > n_distinct:
            chosen.append(k)
            n_distinct = n
        if n_distinct == len(group):
            break
    leaves = [k.rsplit(".", 1)[-1] for k in chosen]
    names = leaves if len(set(leaves)) == len(leaves) else chosen  # "lr=0.1" rather than "algorithm.lr=0.1"
    parts = [", ".join(f"{n}={f.get(k, '-')}" for n, k in zip(names, chosen)) for f in flats]
    if n_distinct < len(group):  # identical configs: fall back to the run directory
        parts = [", ".join(p for p in (part, folder) if p) for part, folder in zip(parts, run_folders(group))]
    return parts


def run_folders(group: Sequence[dict[str, Any]]) -> list[str]:
    """Each run's directory by its shortest trailing part that tells it from the others' (its name, else with its
    parent's: the same job of two sweeps, ``m1/algorithm=pcg`` and ``m3/algorithm=pcg``, not the same name twice)."""
    dirs = [Path(r.get(PATH_KEY, f"run{i}/{RESULTS_FILE}")).parent for i, r in enumerate(group)]
    deepest = max(len(d.parts) for d in dirs)
    for depth in range(1, deepest + 1):
        tails = ["/".join(d.parts[-depth:]) for d in dirs]
        if len(set(tails)) == len(tails):
            return tails
    return [str(d) for d in dirs]


def run_labels(runs: Sequence[dict[str, Any]], with_dataset: bool | None = None) -> list[str]:
    """Label of every run: algorithm, model (unless it is the algorithm's name: gbdt, kmeans), [dataset] when
    several datasets, (config values) when ambiguous.

    ``with_dataset`` forces the [dataset] part on or off (the plots leave it off: each subplot is titled by its
    dataset); by default it is there when the runs cover several datasets.
    """
    if with_dataset is None:
        with_dataset = len({r["dataset"] for r in runs}) > 1
    labels = [
        r["algorithm"]
        + ("" if r.get("model") == r["algorithm"] else f", {r.get('model') or 'model?'}")  # gbdt, kmeans: said once
        + (f" [{r['dataset']}]" if with_dataset else "")
        for r in runs
    ]
    return [lab + (f" ({v})" if v else "") for lab, v in zip(labels, run_variants(runs))]


def run_variants(runs: Sequence[dict[str, Any]]) -> list[str]:
    """Per run, the config values ('lr=0.1, ...') that tell it apart from runs of the same algorithm, model and
    dataset ('' when it is the only one): settings of another model kind never label a run."""
    variants = [""] * len(runs)
    groups: dict[tuple[str, str, str], list[int]] = {}
    for i, r in enumerate(runs):
        groups.setdefault((r["algorithm"], r["dataset"], str(r.get("model"))), []).append(i)
    for idx in groups.values():
        if len(idx) > 1:
            for i, part in zip(idx, _distinguishing([runs[i] for i in idx])):
                variants[i] = part
    return variants


def summary_rows(runs: Sequence[Any]) -> list[dict[str, Any]]:
    """The table behind the plots, one dict per run (None where a run has no history)."""
    runs = [_as_dict(r) for r in runs]
    rows = []
    for run, label, variant in zip(runs, run_labels(runs), run_variants(runs)):
        hist = run["history"]
        last = hist[-1] if hist else {}
        values = _metric_values(run)
        rows.append(
            {
                "label": label,
                "variant": variant,
                "algorithm": run["algorithm"],
                "scenario": run.get("scenario"),
                "dataset": run["dataset"],
                "model": run.get("model"),
                "metric": run["metric"],
                "epochs": run_length(hist),
                "final": values[-1] if values else None,
                "best": best_metric(run),
                "rounds": last.get("rounds"),
                "mb_up": (last.get("bytes_up") or 0) / 1e6 if hist else None,
                "mb_down": (last.get("bytes_down") or 0) / 1e6 if hist else None,
                "comm_time_s": last.get("comm_time_s"),
                "wall_time_s": last.get("wall_time_s"),
                "n_joined": run.get("n_joined"),
                "path": run.get(PATH_KEY),
            }
        )
    return rows


def run_length(hist: Sequence[dict[str, Any]]) -> Any:
    """The table's ``epochs`` cell: the last evaluated epoch, for boosted trees their number ("50 trees"), and
    the kept model's when the run kept an earlier one ("50 trees, kept 30"); it showed the kept record's epoch
    alone (30), as if the run had stopped there."""
    if not hist:
        return None
    evaluated = [h for h in hist if not h.get("kept")] or list(hist)
    last = evaluated[-1]["epoch"]
    if "trees" not in hist[-1] and not hist[-1].get("kept"):
        return last
    text = f"{last:g} trees" if "trees" in hist[-1] else f"{last:g}"
    return text + (f", kept {hist[-1]['epoch']:g}" if hist[-1].get("kept") else "")


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.{digits}g}"
    return str(value)


def summary_table(rows: Sequence[dict[str, Any]], title: str | None = None):
    """The rich Table of summary_rows."""
    table = Table(title=title or "runs")
    columns = [
        ("algorithm", "algorithm", "left"),
        ("scenario", "scenario", "left"),
        ("dataset", "dataset", "left"),
        ("model", "model", "left"),
        ("config", "variant", "left"),
        ("epochs / trees", "epochs", "right"),
        ("final test", "final", "right"),
        ("best test", "best", "right"),
        ("rounds", "rounds", "right"),
        ("MB up", "mb_up", "right"),
        ("MB down", "mb_down", "right"),
        ("comm time (s)", "comm_time_s", "right"),
        ("wall time (s)", "wall_time_s", "right"),
        ("N", "n_joined", "right"),
    ]
    for header, _, justify in columns:
        table.add_column(header, justify=justify)
    for row in rows:
        cells = []
        for _, key, _ in columns:
            text = _fmt(row[key] or None if key == "variant" else row[key], 5 if key in ("final", "best") else 4)
            if key in ("final", "best") and row[key] is not None:
                text += f" {row['metric']}"
            cells.append(escape(text))
        table.add_row(*cells)
    return table


# ---------------------------------------------------------------------------------------------------- plots


LINESTYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
EXACT_STYLE = {"color": "black", "linestyle": "--", "linewidth": 1.2}
CONSTANT_STYLE = {"color": "0.45", "linestyle": ":", "linewidth": 1.4}


def _colors(labels_wo_dataset: Sequence[str]) -> dict[str, Any]:
    """One colour per run kind, the same in every subplot and both figures."""
    kinds = list(dict.fromkeys(labels_wo_dataset))
    cmap = colormaps["tab10" if len(kinds) <= 10 else "tab20"]
    return {k: cmap(i % cmap.N) for i, k in enumerate(kinds)}


def _ylabel(runs: Sequence[dict[str, Any]]) -> str:
    return "test " + " / ".join(dict.fromkeys(r["metric"] for r in runs))


def _new_figure(n_cols: int, legend_rows: int, title: str | None):
    fig = Figure(figsize=(6.4 * n_cols, 4.4 + 0.22 * legend_rows + (0.3 if title else 0)), layout="constrained")
    axes = fig.subplots(1, n_cols, squeeze=False)[0]
    if title:
        fig.suptitle(title)
    return fig, axes


def is_exact(run: dict[str, Any]) -> bool:
    """The closed-form solution (centralized, solver=exact): one record at epoch 0, drawn as a reference line."""
    solver = ((run.get("config") or {}).get("algorithm") or {}).get("solver")
    hist = run["history"]
    return run["algorithm"] == "centralized" and (solver == "exact" or (len(hist) == 1 and hist[0]["epoch"] == 0))


def constant_reference(runs: Sequence[dict[str, Any]]) -> float | None:
    """The constant predictor's test metric (results.json ``reference``), from the first run that has it."""
    for r in runs:
        value = (r.get("reference") or {}).get(f"constant_{r['metric']}")
        if value is not None and math.isfinite(float(value)):
            return float(value)
    return None


def converged_ylim(
    curves: Sequence[Sequence[float]], refs: Sequence[float], lower_better: bool | None = None
) -> tuple[float, float] | None:
    """y limits that show where the runs end up: every point after each curve's first quarter (at least its
    first point dropped when it has 3 or more: the first epoch's spike), and the reference lines that fall
    near that range (a far-off constant predictor would flatten every curve). With ``lower_better`` (the
    metric's direction) a dropped point no worse than the rest of its curve is no spike and stays in view:
    boosted trees whose first evaluation was their best (accuracy 0.8498, then 0.8464 twice) had it cut off
    the axis."""
    kept: list[float] = []
    for values in curves:
        finite = [v for v in values if math.isfinite(v)]
        skip = max(1, len(finite) // 4) if len(finite) >= 3 else 0
        kept += finite[skip:]
        if skip and lower_better is not None:
            worst = max(finite[skip:]) if lower_better else min(finite[skip:])
            kept += [v for v in finite[:skip] if (v <= worst if lower_better else v >= worst)]
    if not kept:
        kept = [r for r in refs if math.isfinite(r)]
    if not kept:
        return None
    lo, hi = min(kept), max(kept)
    span = hi - lo or 0.02 * (abs(hi) or 1.0)
    for r in refs:  # include a reference line if it does not stretch the axis more than 3x
        if math.isfinite(r) and max(hi, r) - min(lo, r) <= 3 * span:
            lo, hi = min(lo, r), max(hi, r)
    pad = 0.08 * (hi - lo or span)
    return lo - pad, hi + pad


def _reference_lines(
    ax, exact: list[dict[str, Any]], constant: float | None, metric: str, ylim: tuple[float, float] | None
) -> int:
    """Horizontal lines for the exact solution and the constant predictor; returns the legend entries added."""
    n = 0
    for run in exact:
        value = _metric_values(run)[-1]
        ax.axhline(value, label=f"exact solution (centralized ridge): {metric} {value:.4g}", **EXACT_STYLE)
        n += 1
    if constant is not None:
        off = ylim is not None and not ylim[0] <= constant <= ylim[1]
        ax.axhline(
            constant,
            label=f"constant predictor: {metric} {constant:.4g}" + (" (off the axis)" if off else ""),
            **CONSTANT_STYLE,
        )
        n += 1
    return n


def _legend(ax, n_entries: int) -> None:
    """Below the axes, outside the plotting area, so it never covers a line."""
    if n_entries:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=1, fontsize="small", frameon=False)


def _style(k: int, n_points: int) -> dict[str, Any]:
    """The k-th run of a subplot: its own dash pattern and marker, and thinner than the runs drawn before it,
    so identical curves stay visible (the earlier, wider line shows around the later one)."""
    style: dict[str, Any] = {"linestyle": LINESTYLES[k % len(LINESTYLES)], "linewidth": max(1.0, 3.0 - 0.45 * k)}
    style.update(
        {
            "marker": MARKERS[k % len(MARKERS)],
            "markersize": 4,
            "markevery": max(1, n_points // 12),
            "markerfacecolor": "none" if k % 2 else None,
        }
    )
    return style


def epoch_xlim(epochs: Sequence[float]) -> tuple[float, float] | None:
    """The epoch axis of runs that all recorded the same one epoch (k-means, one-shot): half an epoch either
    side, whose one integer tick is that epoch (matplotlib's own range, 0.945 to 1.055, had none); None
    otherwise."""
    if not epochs or max(epochs) - min(epochs) >= 1:
        return None
    return min(epochs) - 0.5, max(epochs) + 0.5


def kept_point(run: dict[str, Any], comm: bool) -> tuple[float, float, float] | None:
    """A run that kept an earlier evaluation's model (model selection): its history ends with that record
    again, marked ``kept``. Its (x, metric, epoch) where the curve has it (x: its epoch, or the modelled
    communication time when it was evaluated); None for a run that kept its last evaluation. Drawn as part of
    the curve, it went from the last epoch back to the kept one (boosted trees stopped at 50: a line from 50
    back to 30)."""
    hist = run["history"]
    if not hist or not hist[-1].get("kept") or hist[-1]["test_metric"] is None:
        return None
    epoch = hist[-1]["epoch"]
    at = next((h for h in hist[:-1] if h["epoch"] == epoch and not h.get("kept")), hist[-1])
    x = (at.get("comm_time_s") or 0.0) if comm else epoch
    return float(x), float(hist[-1]["test_metric"]), float(epoch)


def epoch_label(runs: Sequence[dict[str, Any]]) -> str:
    """The x axis of the epoch figure: boosted trees record their number of trees as the epoch (results.json's
    ``trees``), so a panel of boosted trees alone says "trees"; one with other runs says both."""
    trees = [bool(r["history"]) and "trees" in r["history"][0] for r in runs]
    if trees and all(trees):
        return "trees"
    return "epoch (boosted trees: trees)" if any(trees) else "epoch"


def plot_runs(runs: Sequence[Any], out_prefix: str | Path, title: str | None = None) -> list[Path]:
    """Write OUT_PREFIX_epoch.png and OUT_PREFIX_comm.png; return their paths.

    Per dataset: one line per run (its own colour, dash pattern and marker), the exact solution (a centralized
    solver=exact run) and the constant predictor (results.json reference) as horizontal reference lines, and a
    y-range around where the runs converge (the first epochs' spike is left out)."""
    runs = [_as_dict(r) for r in runs]
    if not runs:
        raise ValueError("plot_runs: no runs to plot")
    labels = run_labels(runs, with_dataset=False)  # each subplot is titled by its dataset
    colors = _colors(labels)
    datasets = list(dict.fromkeys(r["dataset"] for r in runs))
    by_dataset = {d: [i for i, r in enumerate(runs) if r["dataset"] == d] for d in datasets}
    legend_rows = max(len(v) for v in by_dataset.values()) + 2
    out_prefix = Path(out_prefix)
    out_prefix.parent.mkdir(parents=True, exist_ok=True)

    def panel(ax, d: str, comm: bool) -> None:
        idx = by_dataset[d]
        exact = [runs[i] for i in idx if is_exact(runs[i])]
        drawn = [
            i for i in idx if runs[i]["history"] and not is_exact(runs[i]) and not (comm and is_centralized(runs[i]))
        ]
        flat = [i for i in idx if comm and runs[i]["history"] and is_centralized(runs[i]) and not is_exact(runs[i])]
        metric = runs[idx[0]]["metric"]
        times = [h.get("comm_time_s") or 0.0 for i in drawn for h in runs[i]["history"]]
        positive = [t for t in times if t > 0]
        log_x = comm and bool(positive) and max(positive) / min(positive) > LOG_SPAN
        curves, epochs = [], []
        marked = 0
        for k, i in enumerate(drawn):
            run = runs[i]
            evaluated = [h for h in run["history"] if not h.get("kept")]  # the kept model's repeat: a marker
            xs = [(h.get("comm_time_s") or 0.0) if comm else h["epoch"] for h in evaluated]
            values = _metric_values({"history": evaluated})
            pts = [(x, v) for x, v in zip(xs, values) if not (log_x and x <= 0)]
            curves.append([v for _, v in pts])
            epochs += [x for x, _ in pts]
            ax.plot(
                [x for x, _ in pts],
                [v for _, v in pts],
                label=labels[i],
                color=colors[labels[i]],
                **_style(k, len(pts)),
            )
            if (point := kept_point(run, comm)) is not None and not (log_x and point[0] <= 0):
                what = "trees" if "trees" in run["history"][-1] else "epoch"
                ax.plot(
                    point[0],
                    point[1],
                    linestyle="none",
                    marker="*",
                    markersize=13,
                    color=colors[labels[i]],
                    markeredgecolor="black",
                    label=f"{labels[i]}: kept model ({what} {point[2]:g}, lowest validation loss)",
                )
                marked += 1
        for k, i in enumerate(flat, start=len(drawn)):
            ax.axhline(
                _metric_values(runs[i])[-1],
                label=f"{labels[i]} (no communication)",
                color=colors[labels[i]],
                linestyle=LINESTYLES[k % len(LINESTYLES)],
                linewidth=1.4,
            )
            curves.append([_metric_values(runs[i])[-1]])
        constant = constant_reference([runs[i] for i in idx])
        refs = [_metric_values(r)[-1] for r in exact] + ([constant] if constant is not None else [])
        ylim = converged_ylim(curves, refs, lower_is_better(metric))
        n = len(drawn) + len(flat) + marked + _reference_lines(ax, exact, constant, metric, ylim)
        if ylim is not None:
            ax.set_ylim(*ylim)
        ax.set_title(d)
        ax.set_ylabel(_ylabel([runs[i] for i in idx]))
        if comm:
            if log_x:
                ax.set_xscale("log")
            elif positive:
                ax.set_xlim(left=0)
            else:
                ax.set_xlim(0, 1)
            ax.set_xlabel("modelled communication time (s)")
        else:
            ax.set_xlabel(epoch_label([runs[i] for i in drawn]))
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            if (span := epoch_xlim(epochs)) is not None:
                ax.set_xlim(*span)
                ax.set_xticks(sorted(set(epochs)))  # MaxNLocator falls back to fractions on a span under 2
        ax.grid(True, alpha=0.3, which="both" if log_x else "major")
        _legend(ax, n)

    paths = []
    for suffix, comm in (("_epoch.png", False), ("_comm.png", True)):
        fig, axes = _new_figure(len(datasets), legend_rows, title)
        for ax, d in zip(axes, datasets):
            panel(ax, d, comm)
        path = out_prefix.with_name(out_prefix.name + suffix)
        fig.savefig(path, dpi=150)
        paths.append(path)
    return paths


# ---------------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m simulations.reproduce",
        description="Plot test metric vs epoch and vs modelled communication time from results.json records.",
    )
    parser.add_argument(
        "run_dirs",
        nargs="+",
        metavar="RUN_DIR",
        help="run dir with results.json, a results.json file, or a Hydra multirun dir",
    )
    parser.add_argument(
        "--out",
        default="figure",
        metavar="FIGURE_PREFIX",
        help="writes FIGURE_PREFIX_epoch.png and FIGURE_PREFIX_comm.png (default: figure)",
    )
    parser.add_argument("--title", default=None, help="figure title")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    skipped: list[str] = []
    try:
        runs = load_runs(args.run_dirs, skipped)
    except ResultsError as exc:
        parser.error(str(exc))  # exit code 2, before anything is drawn
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    for line in skipped:
        console.print(f"skipped {line}", markup=False)
    console.print(summary_table(summary_rows(runs), args.title))
    try:
        paths = plot_runs(runs, args.out, args.title)
    except OSError as exc:  # --out under a file, a folder it may not write
        parser.error(f"--out {args.out}: {exc.filename}: {exc.strerror}")
    for path in paths:
        console.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
