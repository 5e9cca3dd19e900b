"""simulations.reproduce: results.json records -> table and the two paper figures (fake records, no training)."""

from __future__ import annotations

import json
import math

import pytest
from matplotlib.image import imread

from simulations import reproduce
from tpflower.results import EpochRecord, RunResults, write_results

DATASETS = {  # dataset -> (task, metric, start, end, N)
    "movielens": ("regression", "rmse", 1.10, 0.93, 265_517),
    "nycflights13_delayed": ("classification", "accuracy", 0.62, 0.81, 271_594),
}
# algorithm -> (rounds per epoch, bytes per round, modelled seconds per round)
ALGORITHMS = {"tp_join_admm": (4, 2_000_000, 0.9), "tp_join_sgd": (260, 150_000, 0.25), "centralized": (0, 0, 0.0)}


def fake_run(algorithm: str, dataset: str, epochs: int = 6, lr: float = 0.1, bump: int | None = None) -> RunResults:
    """A plausible record: the metric moves from start to end; `bump` makes one epoch better than the last."""
    task, metric, start, end, n = DATASETS[dataset]
    per_epoch, bytes_round, secs_round = ALGORITHMS[algorithm]
    history = []
    for e in range(1, epochs + 1):
        value = start + (end - start) * (1 - math.exp(-e / 2)) / (1 - math.exp(-epochs / 2))
        if bump == e:
            value = end + (-0.05 if metric == "rmse" else 0.05)  # best epoch, not the last
        r = per_epoch * e
        history.append(
            EpochRecord(
                epoch=e,
                test_metric=value,
                train_loss=value**2,
                rounds=r,
                bytes_up=r * bytes_round,
                bytes_down=r * bytes_round // 2,
                comm_time_s=r * secs_round,
                wall_time_s=1.5 * e,
            )
        )
    return RunResults(
        algorithm=algorithm,
        scenario="join",
        dataset=dataset,
        model="linear",
        task=task,
        metric=metric,
        n_joined=n,
        table_rows={"t0": n, "t1": 100},
        history=history,
        config={
            "algorithm": {"name": algorithm, "lr": lr, "batch_size": 256},
            "dataset": {"name": dataset},
            "seed": 0,
            "epochs": epochs,
        },
    )


@pytest.fixture
def run_dirs(tmp_path):
    """Six single runs (3 algorithms x 2 datasets) and a Hydra-multirun-style sweep of tp_join_sgd over lr."""
    dirs = []
    for dataset in DATASETS:
        for algorithm in ALGORITHMS:
            bump = 3 if (algorithm, dataset) == ("tp_join_admm", "nycflights13_delayed") else None
            bump = 4 if (algorithm, dataset) == ("tp_join_admm", "movielens") else bump
            d = tmp_path / "outputs" / f"{algorithm}-{dataset}"
            write_results(fake_run(algorithm, dataset, bump=bump), d)
            dirs.append(d)
    sweep = tmp_path / "multirun" / "2025-01-01" / "12-00-00"
    for i, lr in enumerate([0.05, 0.2]):
        write_results(fake_run("tp_join_sgd", "movielens", lr=lr), sweep / f"{i}-tp_join_sgd-movielens")
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    return dirs, sweep


def test_main_writes_both_figures(run_dirs, tmp_path, capsys):
    dirs, sweep = run_dirs
    out = tmp_path / "figs" / "fig"
    assert reproduce.main([*map(str, dirs), str(sweep), "--out", str(out), "--title", "fake runs"]) == 0
    printed = capsys.readouterr().out
    for suffix in ("_epoch.png", "_comm.png"):
        png = out.with_name("fig" + suffix)
        assert png.exists() and png.stat().st_size > 10_000, png
        assert str(png) in printed
        img = imread(png)
        assert img.ndim == 3 and img.shape[0] > 400 and img.shape[1] > 1000  # two dataset columns
    assert "tp_join_admm" in printed and "nycflights13_delayed" in printed  # the rich table


def test_summary_rows_final_and_best(run_dirs):
    dirs, _ = run_dirs
    runs = reproduce.load_runs(dirs)
    rows = reproduce.summary_rows(runs)
    assert len(rows) == 6
    by = {(r["algorithm"], r["dataset"]): r for r in rows}
    for (algorithm, dataset), row in by.items():
        record = json.loads((dirs[0].parent / f"{algorithm}-{dataset}" / "results.json").read_text())
        values = [h["test_metric"] for h in record["history"]]
        assert row["final"] == pytest.approx(values[-1])
        expected_best = min(values) if record["metric"] == "rmse" else max(values)
        assert row["best"] == pytest.approx(expected_best)
        assert row["epochs"] == 6 and row["n_joined"] == record["n_joined"]
        last = record["history"][-1]
        assert row["rounds"] == last["rounds"] and row["comm_time_s"] == pytest.approx(last["comm_time_s"])
        assert row["mb_up"] == pytest.approx(last["bytes_up"] / 1e6)
    # the bumped runs: best is not the final value, in the metric's own direction
    admm_ml, admm_fl = by["tp_join_admm", "movielens"], by["tp_join_admm", "nycflights13_delayed"]
    assert admm_ml["best"] < admm_ml["final"] and admm_fl["best"] > admm_fl["final"]
    assert by["centralized", "movielens"]["rounds"] == 0 and by["centralized", "movielens"]["mb_down"] == 0
    # RunResults objects are accepted too
    assert reproduce.summary_rows([fake_run("tp_join_sgd", "movielens")])[0]["best"] == pytest.approx(0.93)


def test_multirun_dir_expands_and_labels_distinguish(run_dirs):
    _, sweep = run_dirs
    files = reproduce.find_results([sweep])
    assert [f.parent.name for f in files] == ["0-tp_join_sgd-movielens", "1-tp_join_sgd-movielens"]
    runs = reproduce.load_runs([sweep, files[0]])  # a results.json path named twice is read once
    assert len(runs) == 2
    labels = reproduce.run_labels(runs)
    assert labels == ["tp_join_sgd, linear (lr=0.05)", "tp_join_sgd, linear (lr=0.2)"]


def test_centralized_is_no_communication(run_dirs):
    dirs, _ = run_dirs
    runs = reproduce.load_runs(dirs)
    assert [reproduce.is_centralized(r) for r in runs] == [False, False, True] * 2


def test_missing_path_exits_with_its_name(run_dirs, tmp_path, capsys):
    dirs, _ = run_dirs
    missing = tmp_path / "no-such-run"
    out = tmp_path / "fig"
    with pytest.raises(SystemExit) as exc:
        reproduce.main([str(dirs[0]), str(missing), "--out", str(out)])
    assert exc.value.code == 2
    assert str(missing) in capsys.readouterr().err
    assert not out.with_name("fig_epoch.png").exists()  # nothing drawn


def test_a_sweeps_failed_jobs_and_other_files_are_skipped_one_line_each(run_dirs, tmp_path, capsys):
    """A sweep's folder as the shell globs it (its jobs and multirun.yaml) or as one folder: a job folder without
    results.json (a failed job) and multirun.yaml are skipped, one line each, the others plotted."""
    _, sweep = run_dirs
    failed = sweep / "2-tp_join_sgd-movielens"
    (failed / ".hydra").mkdir(parents=True)
    for paths in (sorted(map(str, sweep.iterdir())), [str(sweep)]):
        assert reproduce.main([*paths, "--out", str(tmp_path / "fig")]) == 0
        printed = capsys.readouterr().out
        assert f"skipped {failed}: no results.json (a failed or unfinished run)" in printed
        assert (f"skipped {sweep / 'multirun.yaml'}: not a results.json" in printed) == (len(paths) > 1)
    with pytest.raises(SystemExit):
        reproduce.main([str(failed), "--out", str(tmp_path / "fig")])  # nothing to plot: exit 2


def test_invalid_file_and_empty_dir(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "results.json").write_text("{not json")
    with pytest.raises(reproduce.ResultsError, match=str(bad / "results.json")):
        reproduce.load_runs([bad])
    (bad / "results.json").write_text(json.dumps({"algorithm": "x", "dataset": "y"}))
    with pytest.raises(reproduce.ResultsError, match="missing keys"):
        reproduce.load_runs([bad])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(reproduce.ResultsError, match=str(empty)):
        reproduce.find_results([empty])


def test_labels_name_algorithm_model_and_only_settings_of_the_same_model():
    linear, mlp = fake_run("tp_join_admm", "movielens").to_json(), fake_run("tp_join_admm", "movielens").to_json()
    linear["config"]["model"] = {"kind": "linear", "bias": "label"}
    mlp["model"], mlp["config"]["model"] = "mlp", {"kind": "mlp", "bias": "all", "hidden": [16]}
    assert reproduce.run_labels([linear, mlp]) == ["tp_join_admm, linear", "tp_join_admm, mlp"]


def test_a_model_named_as_its_algorithm_is_said_once():
    trees, kmeans = fake_run("tp_join_admm", "movielens").to_json(), fake_run("tp_join_admm", "movielens").to_json()
    (trees["algorithm"], trees["model"]), (kmeans["algorithm"], kmeans["model"]) = ("gbdt",) * 2, ("kmeans",) * 2
    assert reproduce.run_labels([trees, kmeans]) == ["gbdt", "kmeans"]


def test_the_same_job_of_two_sweeps_is_labelled_by_its_sweeps_folder_too():
    """Identical configs are told apart by their run dirs: the same job folder of two sweeps by its sweep's
    folder as well (were: the job folder's name twice, two rows of the same label)."""
    one, two, other = (fake_run("tp_join_admm", "movielens").to_json() for _ in range(3))
    job = "algorithm=pcg,dataset=synthetic"
    one[reproduce.PATH_KEY], two[reproduce.PATH_KEY] = (f"/x/multirun/{m}/{job}/results.json" for m in ("m1", "m3"))
    other[reproduce.PATH_KEY] = "/x/outputs/pcg-2/results.json"
    assert reproduce.run_labels([one, two]) == [f"tp_join_admm, linear (m1/{job})", f"tp_join_admm, linear (m3/{job})"]
    assert reproduce.run_labels([one, other]) == [f"tp_join_admm, linear ({job})", "tp_join_admm, linear (pcg-2)"]


def test_exact_solution_and_constant_predictor_are_reference_lines():
    exact = fake_run("centralized", "movielens", epochs=1).to_json()
    exact["history"][0]["epoch"] = 0
    exact["config"]["algorithm"]["solver"] = "exact"
    run = fake_run("tp_join_admm", "movielens").to_json()
    run["reference"] = {"constant_rmse": 1.05}
    assert reproduce.is_exact(exact) and not reproduce.is_exact(run)
    assert reproduce.constant_reference([exact, run]) == 1.05


def test_y_range_shows_the_converged_part():
    spike = [5.0, 1.00, 0.96, 0.95, 0.95, 0.95, 0.95, 0.95]
    lo, hi = reproduce.converged_ylim([spike], [0.94, 0.97])
    assert lo < 0.94 and 0.97 < hi < 1.0  # the first epochs' spike is out, both reference lines in
    lo, hi = reproduce.converged_ylim([spike], [0.94, 1.05])
    assert lo < 0.94 and hi < 1.0  # a far-off constant predictor does not flatten the curves (legend: off the axis)


def test_an_out_prefix_under_a_file_is_one_line(run_dirs, tmp_path, capsys):
    """--out under a file was mkdir's FileExistsError traceback."""
    (tmp_path / "afile").touch()
    with pytest.raises(SystemExit) as done:
        reproduce.main([str(run_dirs[0][0]), "--out", str(tmp_path / "afile" / "plot")])
    assert done.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(f"error: --out {tmp_path / 'afile' / 'plot'}: {tmp_path / 'afile'}: File exists")


def test_one_shot_runs_get_an_epoch_axis_with_their_epoch_on_it():
    """k-means records one result at epoch 1: the axis ran from 0.945 to 1.055 with ticks 0.960, 0.975 ...; it is
    0.5 to 1.5 now (its one integer tick, 1). Runs over several epochs keep matplotlib's range."""
    assert reproduce.epoch_xlim([1, 1]) == (0.5, 1.5)
    assert reproduce.epoch_xlim([1, 2, 3]) is None and reproduce.epoch_xlim([]) is None


def gbdt_run(values: list[float], kept: int | None = None) -> dict:
    """Boosted trees' record: an evaluation every 10 trees (results.json's ``trees``), and with ``kept`` the
    kept evaluation's record again at the end (early stopping's model selection)."""
    record = fake_run("tp_join_admm", "nycflights13_delayed", epochs=len(values)).to_json()
    record["algorithm"] = "gbdt"
    for i, (h, v) in enumerate(zip(record["history"], values)):
        h.update(epoch=10 * (i + 1), trees=10.0 * (i + 1), test_metric=v)
    if kept is not None:
        again = dict(next(h for h in record["history"] if h["epoch"] == kept))
        again.update(kept=1.0, comm_time_s=record["history"][-1]["comm_time_s"])
        record["history"].append(again)
    return record


def test_boosted_trees_plot_their_trees_and_mark_the_kept_model_without_a_line_back(tmp_path, monkeypatch):
    """A gbdt run stopped early at 50 trees keeping 30: its history ends with the 30 trees' record again, which
    the curve drew as a line from 50 back to 30 (a triangle), under an x axis saying "epoch" for trees. The
    curve ends at 50, the kept model is a marker at 30 (on the time axis: where 30 trees were evaluated) named
    in the legend, and the axis says trees ("epoch (boosted trees: trees)" beside runs of epochs)."""
    axes = []
    monkeypatch.setattr(reproduce, "_legend", lambda ax, n: axes.append(ax))
    run = gbdt_run([0.9642, 0.9693, 0.9694, 0.9693, 0.9573], kept=30)
    reproduce.plot_runs([run], tmp_path / "fig")
    by_epoch, by_time = axes
    curve, star = by_epoch.lines[:2]
    assert list(curve.get_xdata()) == [10, 20, 30, 40, 50]
    assert list(star.get_xdata()) == [30] and list(star.get_ydata()) == [0.9694]
    assert "kept model (trees 30" in star.get_label()
    assert list(by_time.lines[1].get_xdata()) == [run["history"][2]["comm_time_s"]]
    assert by_epoch.get_xlabel() == "trees" and by_time.get_xlabel() == "modelled communication time (s)"
    other = fake_run("tp_join_admm", "nycflights13_delayed").to_json()
    assert reproduce.epoch_label([run, other]) == "epoch (boosted trees: trees)"
    assert reproduce.epoch_label([other]) == "epoch"
    assert reproduce.kept_point(other, comm=False) is None
    (row,) = reproduce.summary_rows([run])  # the table said epochs 30, the kept record's, for 50 trees
    assert row["epochs"] == "50 trees, kept 30" and row["final"] == 0.9694
    assert reproduce.summary_rows([gbdt_run([0.96, 0.97])])[0]["epochs"] == "20 trees"
    assert reproduce.summary_rows([other])[0]["epochs"] == 6


def test_a_first_evaluation_better_than_the_rest_stays_on_the_axis():
    """The first point is left out of the y range as the first epoch's spike; a gbdt run whose first
    evaluation was its best (accuracy 0.8498, then 0.8464 twice) had it cut off the top of the axis. A first
    point no worse than the rest stays in view; a spike (worse) is still left out."""
    lo, hi = reproduce.converged_ylim([[0.8498, 0.84642, 0.84646]], [], lower_better=False)
    assert lo < 0.8464 and hi > 0.8498
    lo, hi = reproduce.converged_ylim([[0.60, 0.84642, 0.84646]], [], lower_better=False)
    assert lo > 0.84  # a spike below the rest: out
    lo, hi = reproduce.converged_ylim([[5.0, 1.0, 0.96, 0.95]], [], lower_better=True)
    assert hi < 1.1
    lo, hi = reproduce.converged_ylim([[0.90, 0.95, 0.96, 0.97]], [], lower_better=True)
    assert lo < 0.90
