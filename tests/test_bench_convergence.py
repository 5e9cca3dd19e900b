"""The convergence bench's schema matrix skips a dataset whose files are absent (one line) and still reports."""

from __future__ import annotations

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
