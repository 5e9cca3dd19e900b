"""The convergence bench's schema matrix skips a dataset whose files are absent (one line) and still reports."""

from __future__ import annotations

import json

from simulations.bench import convergence


def test_matrix_skips_a_dataset_whose_files_are_absent(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TPFLOWER_ML1M", str(tmp_path / "absent"))
    monkeypatch.setattr(convergence, "MATRIX_CELLS", [])
    monkeypatch.setattr(convergence, "BUNDLED", {"movielens1m": ("dataset=movielens1m",)})
    out = convergence.matrix_suite(10, quick=False, bundled=True)
    assert out["cells"] == {}
    assert set(out["skipped"]) == {"movielens1m"} and "ratings.dat" in out["skipped"]["movielens1m"]
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"movielens1m: skipped ({out['skipped']['movielens1m']})"]


def test_absent_data_names_only_the_missing_files(tmp_path, monkeypatch):
    monkeypatch.setenv("TPFLOWER_ML1M", str(tmp_path))
    (tmp_path / "ratings.dat").write_text("1::1::5::0\n")
    why = convergence.absent_data(["dataset=movielens1m"])
    assert why is not None and "movies.dat, users.dat" in why and "ratings.dat" not in why
    (tmp_path / "movies.dat").write_text("")
    (tmp_path / "users.dat").write_text("")
    assert convergence.absent_data(["dataset=movielens1m"]) is None
    assert convergence.absent_data(["dataset=movielens"]) is None  # shipped with tpflower


def test_gbdt_matrix_keeps_the_cells_of_an_earlier_run(tmp_path, monkeypatch, capsys):
    """--keep: a cell of the earlier JSON (same epochs, every algorithm of its case) is taken as it is, named when
    another commit (or none recorded) measured it; a cell missing there, or measured with fewer algorithms, runs
    and records its commit."""
    cells = [convergence._cell("star", 20, 15, 0.0), convergence._cell("star", 20, 50, 0.5, task="binary")]
    monkeypatch.setattr(convergence, "MATRIX_CELLS", cells)
    monkeypatch.setattr(convergence, "NONLINEAR_CELLS", [])
    monkeypatch.setattr(convergence, "INTERACTION_CELLS", [convergence._cell("star", 20, 15, 0.0, label="interaction")])
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bench_results").mkdir()  # where the suite writes its partial file
    ran = []

    def fake_cell(module, call, args):
        ran.append(args["overrides"])
        hist = [{"metric": 1.0, "rounds": 1, "bytes": 10}]
        algs = {a: {"history": hist, "wall_s": 0.1} for a in args["algorithms"]}
        return {"algorithms": algs, "metric": "rmse", "reference": 1.0, "constant_metric": 2.0}

    monkeypatch.setattr(convergence, "run_isolated", fake_cell)
    monkeypatch.setattr(convergence, "code_commit", lambda: "abc1234")
    names = [convergence.cell_name(c) for c in cells]
    interaction = convergence.cell_name(convergence.INTERACTION_CELLS[0])
    old = {"algorithms": {"gbdt": {"history": [{"metric": 0.5, "rounds": 3, "bytes": 7}], "wall_s": 9.0}}}
    earlier = tmp_path / "earlier.json"
    # the interaction cell measured gbdt only: its case wants every row, so it runs again
    earlier.write_text(
        json.dumps({"epochs": 10, "load": "1-minute load 9", "cells": {names[0]: old, interaction: old}})
    )
    out = convergence.gbdt_matrix_suite(10, quick=True, bundled=False, keep=earlier)
    assert list(out["cells"]) == [interaction, *names]
    assert out["cells"][names[0]] == old and len(ran) == 2
    assert "label=interaction" in " ".join(ran[0]) and "task=binary" in " ".join(ran[1])
    assert out["load"].startswith("kept cells: 1-minute load 9; new cells: ")
    now = "abc1234"
    assert out["cells"][names[1]]["commit"] == now  # each new cell says which code measured it
    # a kept cell of no recorded commit, or of another one, is named as such; one of this commit is kept quietly
    assert f"{names[0]}: kept (measured at an unrecorded commit, the code is now {now})" in capsys.readouterr().out
    earlier.write_text(json.dumps({"epochs": 10, "cells": {names[0]: {**old, "commit": now}}}))
    convergence.gbdt_matrix_suite(10, quick=True, bundled=False, keep=earlier)
    assert f"{names[0]}: kept\n" in capsys.readouterr().out
    earlier.write_text(
        json.dumps({"epochs": 10, "load": "1-minute load 9", "cells": {names[0]: old, interaction: old}})
    )
    # other epochs: nothing is kept
    ran.clear()
    assert convergence.gbdt_matrix_suite(3, quick=True, bundled=False, keep=earlier)["cells"][names[0]] != old
    assert len(ran) == 3
