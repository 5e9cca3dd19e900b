"""The command line's sweeps and interruptions (simulations.run): a Hydra sweep over algorithms or datasets, a
failed job that leaves the others running, resume within a sweep's job folders, Ctrl-C in one line, and one
run per run dir."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from simulations.job import LOCK, run_dir_lock
from simulations.run import announce, composition_error, interrupted_line, mixed_modes, unknown_choice
from tpflower.schema import SpecError

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TPFLOWER_TRACEBACK", "HYDRA_FULL_ERROR")}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "simulations.run", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_a_sweeps_list_of_choices_is_checked_name_by_name():
    assert unknown_choice({"algorithm": "admm,pcg,gbdt", "dataset": "movielens,synthetic"}, []) is None
    assert unknown_choice({"algorithm": "choice(admm,pcg)", "dataset": "glob(m*)"}, []) is None  # Hydra's to check
    line = unknown_choice({"dataset": "/data/conf/dataset/shop.yaml"}, [])  # a file: the command line's way
    assert line is not None and line.endswith(
        "; for the file /data/conf/dataset/shop.yaml: --config-dir /data/conf dataset=shop"
    )
    line = unknown_choice({"dataset": "shop.yml"}, [])
    assert line is not None and line.endswith(
        "; a dataset file is chosen by name from a folder dataset/: --config-dir DIR dataset=shop for "
        "DIR/dataset/shop.yaml"
    )
    assert unknown_choice({"dataset": "shop"}, []).endswith("synthetic")  # a name: no hint
    line = unknown_choice({"algorithm": "admm,pgc"}, [])
    assert line is not None and line.startswith("algorithm=pgc: no such algorithm; choose one of ")


def test_a_config_dir_that_holds_the_dataset_file_itself_names_the_folder_to_give(tmp_path):
    (tmp_path / "dataset").mkdir()
    (tmp_path / "dataset" / "shop.yaml").write_text("name: shop\n")
    line = unknown_choice({"dataset": "shop"}, [str(tmp_path / "dataset")])  # the group's folder, not its parent
    assert line is not None and line.endswith(
        f"; config dir {tmp_path / 'dataset'} holds shop.yaml itself, not in a folder dataset/: give its parent, "
        f"{tmp_path}"
    )
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "shop.yaml").write_text("name: shop\n")
    line = unknown_choice({"dataset": "shop"}, [str(tmp_path / "mine")])
    assert line is not None and line.endswith(f"not in a folder dataset/: move it to {tmp_path / 'mine' / 'dataset'}/")
    assert unknown_choice({"dataset": "shop"}, [str(tmp_path)]) is None  # DIR/dataset/shop.yaml: found


def test_a_sweep_functions_unknown_choice_is_the_same_line_as_a_lists():
    """choice(pcg,nosuch) is expanded by Hydra: its error listed the private defaults (_admm ...) and the search
    path; now the line a list's unknown name gets."""
    from hydra.errors import MissingConfigException

    exc = MissingConfigException("In 'config': Could not find 'algorithm/nosuch'\nAvailable options in ...", "x")
    line = composition_error(exc, ["-m", "algorithm=choice(pcg,nosuch)"])
    assert line.startswith("a job of the sweep: algorithm=nosuch: no such algorithm; choose one of admm, auto, ")
    assert line.endswith(" (Hydra checks every job first: none ran)") and " _admm" not in line


def test_a_sweep_with_hydras_cfg_flag_is_one_line():
    """`-m ... --cfg job` (to see the sweep's configs) was Hydra's ValueError traceback."""
    line = "--multirun and --cfg: Hydra takes one of --run, --multirun, --cfg, --info and --shell-completion"
    assert mixed_modes(["-m", "algorithm=admm,sgd", "--cfg", "job"]) == line
    assert mixed_modes(["algorithm=admm", "--cfg", "job"]) is None and mixed_modes(["-m", "-cd", "x"]) is None
    out = run_cli("-m", "algorithm=admm,sgd", "--cfg", "job", cwd=ROOT)
    assert out.returncode == 1 and out.stderr.strip() == f"error: {line}", out.stderr


def test_a_sweep_job_folder_name_too_long_says_how_to_number_them(tmp_path):
    """A long override (a dataset.sql, say) names a job folder the file system refuses: the line says how to
    number the folders instead."""
    name = "n" * 300
    out = run_cli("-m", "dataset=synthetic", f"dataset.name={name}", f"hydra.sweep.dir={tmp_path}", cwd=tmp_path)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip().endswith(
        "File name too long (hydra.run.dir / hydra.sweep.dir); a sweep's job folder is named by its overrides: "
        "'hydra.sweep.subdir=${hydra.job.num}' numbers them"
    ), out.stderr


def test_a_failed_job_leaves_the_sweeps_other_jobs_running_and_resume_keeps_the_jobs_folder(tmp_path):
    sweep = tmp_path / "sweep"
    common = ("-m", "algorithm=admm", "dataset=synthetic", "runtime=inprocess", "epochs=1", f"hydra.sweep.dir={sweep}")
    out = run_cli(*common, "algorithm.rho=1,-1,3", cwd=tmp_path)
    assert out.returncode == 1, out.stderr
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert [(sweep / j / "results.json").exists() for j in jobs] == [False, True, True]  # rho=-1 refused, 1 and 3 ran
    assert out.stderr.strip().splitlines()[-1] == f"error: 1 job(s) of the sweep failed: #1 ({jobs[0]})"
    again = run_cli(*common, "algorithm.rho=3", "resume=true", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == jobs  # resume=true names no new folder
    assert "resumed after epoch 1" in again.stdout


def test_a_sweep_run_again_with_resume_starts_the_jobs_it_never_checkpointed(tmp_path):
    """Ctrl-C before a job's first checkpoint (or before the job) left nothing to continue: the same sweep with
    resume=true runs that job from the start (it failed, "no checkpoint"), and a single run says so at Ctrl-C."""
    sweep = tmp_path / "sweep"
    args = ("-m", "algorithm=admm", "dataset=synthetic", "runtime=inprocess", "epochs=1", f"hydra.sweep.dir={sweep}")
    out = run_cli(*args, "resume=true", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    (job,) = [p for p in sweep.iterdir() if p.is_dir()]
    assert f"resume: {job} holds no checkpoint yet; this job starts from the beginning" in out.stdout
    assert (job / "results.json").exists()
    line = interrupted_line([f"hydra.run.dir={tmp_path / 'run'}"])
    assert line.startswith("interrupted (Ctrl-C) before the run's first checkpoint: nothing to continue; the same ")


def test_ctrl_c_stops_a_run_in_one_line_saying_how_to_continue(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TPFLOWER_TRACEBACK", "HYDRA_FULL_ERROR")}
    env["PYTHONPATH"] = str(ROOT)
    run_dir = tmp_path / "run"
    args = ("algorithm=admm", "dataset=synthetic", "runtime=inprocess", "epochs=500", "algorithm.tol=0")
    cmd = [sys.executable, "-m", "simulations.run", *args, f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("epoch   2"):
            proc.send_signal(signal.SIGINT)
            break
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == f"error: {interrupted_line([*args, f'hydra.run.dir={run_dir}'])}"
    assert "resume=true" in err and str(run_dir) in err and not (run_dir / "results.json").exists()


def test_ctrl_c_right_after_the_first_line_is_the_interrupted_line_too(tmp_path):
    """The imports after the first line take seconds (torch, Flower): Ctrl-C there was a KeyboardInterrupt
    traceback."""
    env = {k: v for k, v in os.environ.items() if k not in ("TPFLOWER_TRACEBACK", "HYDRA_FULL_ERROR")}
    env["PYTHONPATH"] = str(ROOT)
    args = ("algorithm=admm", "dataset=synthetic", "runtime=inprocess", f"hydra.run.dir={tmp_path / 'run'}")
    cmd = [sys.executable, "-m", "simulations.run", *args]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().startswith("tpflower train: ")
    time.sleep(0.3)  # past the first line's flush, well before the imports end
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err.strip() == f"error: {interrupted_line(list(args))}", err


def test_a_run_dir_holds_one_run_at_a_time(tmp_path):
    """A second run into a run dir in use is refused naming the holder; the lock goes with its run, and a lock
    left by a run that died is taken over."""
    with run_dir_lock(tmp_path):
        assert (tmp_path / LOCK).read_text() == str(os.getpid())
        held = rf"run dir {tmp_path} is in use by another run \(process {os.getpid()}\)"
        with pytest.raises(SpecError, match=held), run_dir_lock(tmp_path):
            pass
    assert not (tmp_path / LOCK).exists()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / LOCK).write_text(dead.stdout.strip())
    with run_dir_lock(tmp_path):
        assert (tmp_path / LOCK).read_text() == str(os.getpid())


def test_the_default_run_dir_of_a_run_started_in_the_same_second_is_another(tmp_path, monkeypatch):
    from datetime import datetime

    monkeypatch.chdir(tmp_path)
    now = datetime(2026, 1, 2, 3, 4, 5)
    first = announce(["algorithm=admm"], now)[1][-1]
    assert first == "hydra.run.dir=outputs/2026-01-02/03-04-05-admm-movielens"
    (tmp_path / first.split("=", 1)[1]).mkdir(parents=True)
    assert announce(["algorithm=admm"], now)[1][-1] == f"{first}-2"


def test_a_run_dir_that_cannot_be_made_is_one_line(tmp_path):
    import tpflower

    (tmp_path / "afile").touch()
    out = run_cli("dataset=synthetic", "runtime=inprocess", f"hydra.run.dir={tmp_path / 'afile' / 'run'}", cwd=tmp_path)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert (
        out.stderr.strip() == f"error: {tmp_path / 'afile' / 'run'}: Not a directory (hydra.run.dir / hydra.sweep.dir)"
    )
    with pytest.raises(tpflower.TpflowerError, match="run_dir .*: Not a directory"):
        tpflower.fit(dataset="synthetic", runtime="inprocess", run_dir=tmp_path / "afile" / "x", verbose=False)
