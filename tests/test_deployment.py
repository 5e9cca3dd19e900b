"""The algorithms on real Flower infrastructure: `flwr run` against a SuperLink with one SuperNode per table
(deployment runtime), and `flwr run .` on the local simulation SuperLink.

Every process a test starts gets its own session and the environment variable TPFLOWER_DEPLOY_TAG; the
finally blocks stop them all (including the flower-superexec processes the SuperLinks and SuperNodes start)
and the tests assert that no tagged process is left. FLWR_HOME is a temporary directory, so ~/.flwr is not
touched, and all ports are free 127.0.0.1 ports.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import yaml

from simulations import deploy
from tests.test_resume import assert_same_forest, checkpoint_epoch
from tpflower.overrides import searchpath_override, split_overrides
from tpflower.schema import SpecError

OVERRIDES = "algorithm=admm dataset=synthetic epochs=2"
# the join deployment: the label owner's settings file sets label DP as its floor (deploy.start writes the
# overrides' privacy as every node's floor); CELU with label DP, 1 epoch of 2 exchange rounds
FLOOR = "algorithm=celu dataset=synthetic privacy=label"
JOIN_RUN = f"{FLOOR} privacy.label_range=[-20,20] algorithm.batch_size=8000 epochs=1"
SYNTHETIC_TABLES = ["fact", "d1", "d2", "d3"]
# the union scenario: fact and d1 in two shards each (6 SuperNodes), federated preprocessing, consensus ADMM
UCQ_OVERRIDES = "algorithm=admm dataset=synthetic scenario=ucq epochs=1 algorithm.inner_rounds=2"
UCQ_CLIENTS = [("fact", 0), ("fact", 1), ("d1", 0), ("d1", 1), ("d2", 0), ("d3", 0)]
RUN_TIMEOUT_S = 200.0  # per 4 nodes: the 6-node union test took 194 s on a quiet 2-core machine (limit 300 s)
# kill and resume: float64 TP-Join-ADMM, 6 epochs, no privacy (its results are compared with an in-process run);
# tol=0: the accelerated default meets the default tol after epoch 3 on the synthetic join
RESUME_RUN = "algorithm=admm dataset=synthetic epochs=6 precision=float64 algorithm.tol=0"
# kill and resume of boosted trees: 6 small trees (8 leaves), a checkpoint at every evaluation (each tree), never
# stopped early; the resumed deployment grows the in-process simulation's forest
GBDT_RESUME_RUN = (
    "algorithm=gbdt dataset=synthetic precision=float64 algorithm.trees=6 algorithm.max_leaves=8 "
    "algorithm.eval_every=1 algorithm.early_stopping=0"
)


@pytest.fixture(autouse=True)
def _no_legacy_federations():
    # `flwr run .` (1.41) migrates a [tool.flwr.federations] table to $FLWR_HOME and comments it out in
    # pyproject.toml: the tests must not rewrite the project's pyproject.toml.
    text = (deploy.APP_DIR / "pyproject.toml").read_text()
    assert not any(line.strip().startswith("[tool.flwr.federations") for line in text.splitlines()), (
        "pyproject.toml declares [tool.flwr.federations]; `flwr run` would rewrite it"
    )


def _wait_for_run(proc, results: Path, logs: list[Path], timeout: float = RUN_TIMEOUT_S) -> dict:
    """Wait for `flwr run --stream` to end (it streams the run's log until the run finishes); read results.json."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    tails = "\n".join(f"--- {log}\n{deploy._log_tail(log, 40)}" for log in logs)
    if proc.poll() is None:
        pytest.fail(f"`flwr run` did not finish within {timeout:.0f} s\n{tails}")
    if not results.is_file():
        pytest.fail(f"`flwr run` exited with {proc.returncode} without writing {results}\n{tails}")
    return json.loads(results.read_text())


def refused_run(dep: deploy.Deployment, tmp_path: Path) -> None:
    """A run submitted with privacy=none to nodes whose label owner's floor is label DP: the submitter's log
    shows the label owner's refusal, and no results are written."""
    floor = (tmp_path / "deploy" / "clients" / "fact-0.yaml").read_text()
    assert "name: label" in floor and "secret_file" in floor
    run_dir, log = tmp_path / "refused", tmp_path / "flwr-refused.log"
    proc = deploy.spawn(
        deploy.flwr_run_command(dep.connection, "algorithm=celu dataset=synthetic epochs=1", run_dir),
        log,
        dep.env(),
        cwd=deploy.APP_DIR,
    )
    dep.popens.append(proc)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert (
        "table 'fact' refuses the run: privacy=none is weaker than this node's floor privacy=label" in log.read_text()
    ), deploy._log_tail(log, 60)
    assert not (run_dir / "results.json").exists()


def _check_results(data: dict, algorithm: str = "tp_join_admm", epochs: int = 2) -> None:
    assert data["algorithm"] == algorithm
    assert data["dataset"] == "synthetic"
    assert [h["epoch"] for h in data["history"]] == list(range(1, epochs + 1))
    assert all(math.isfinite(h["test_metric"]) for h in data["history"])


def test_clients_of_synthetic_are_its_four_tables():
    assert deploy.clients_of(OVERRIDES) == [(t, 0) for t in SYNTHETIC_TABLES]
    assert deploy.clients_of(UCQ_OVERRIDES) == UCQ_CLIENTS


def test_a_config_dir_brings_ones_own_dataset_to_every_deployed_process(tmp_path, capsys):
    """--config-dir, as simulations.run's: the run's overrides carry the folder (every process composes the run
    from them); a folder that does not exist is one line."""
    from tests.test_checks import shop

    (tmp_path / "conf" / "dataset").mkdir(parents=True)
    (tmp_path / "conf" / "dataset" / "mine.yaml").write_text(
        yaml.safe_dump({**shop(tmp_path), "name": "mine"}, sort_keys=False)
    )
    assert deploy.main(["clients", "--overrides", "dataset=mine", "--config-dir", str(tmp_path / "conf")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "orders customers"
    # the printed flwr run runs as it is from any folder: the venv's flwr, the run's results.json into an absolute
    # run dir (was none: the ServerApp's default, relative to wherever Flower ran it), relative sources found
    # where they are
    cmd = shlex.split(out[1])
    assert cmd[:3] == [
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1",
        f"PATH={Path(sys.executable).parent}:$PATH",
        "flwr",
    ]
    assert Path(cmd[4]).is_dir()
    run_config = cmd[cmd.index("--run-config") + 1]
    assert searchpath_override(tmp_path / "conf") in json.loads(run_config.split(" run-dir=")[0].split("=", 1)[1])
    assert f"run-dir={json.dumps(str(Path.cwd() / 'outputs' / 'flwr' / 'run'))}" in run_config
    assert f"base-dir={json.dumps(str(Path.cwd()))}" in run_config
    assert "num-supernodes=2" in cmd[cmd.index("--federation-config") + 1]
    assert deploy.main(["clients", "--overrides", "dataset=mine", "--config-dir", str(tmp_path / "nope")]) == 1
    assert capsys.readouterr().err.strip() == f"error: --config-dir {tmp_path / 'nope'}: no such folder"


def test_a_config_dir_with_spaces_composes_from_the_overrides_string(tmp_path):
    """Every deployed process composes the run from one overrides string: a --config-dir holding spaces is one
    quoted override in it."""
    from tests.test_checks import shop

    conf = tmp_path / "my data" / "conf"
    (conf / "dataset").mkdir(parents=True)
    (conf / "dataset" / "mine.yaml").write_text(yaml.safe_dump({**shop(tmp_path), "name": "mine"}, sort_keys=False))
    overrides = f"dataset=mine algorithm=admm {searchpath_override(conf)}"
    assert split_overrides(overrides)[-1] == f"hydra.searchpath=['file://{conf}']"
    assert deploy.clients_of(overrides) == [("orders", 0), ("customers", 0)]


def test_stop_says_when_nothing_runs_or_no_deployment_is_recorded(tmp_path, capsys):
    assert deploy.main(["stop", "--state-dir", str(tmp_path / "none")]) == 1
    assert capsys.readouterr().err.strip() == f"error: no deployment recorded in {tmp_path / 'none'} (its --state-dir?)"
    deploy.Deployment("0" * 32, str(tmp_path), str(tmp_path), 1, "local").save()
    assert deploy.main(["stop", "--state-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == f"nothing running: the deployment recorded in {tmp_path} had stopped"


@pytest.mark.parametrize(
    "overrides, says",
    [
        ("algorithm=admn", "error: In 'config': Could not find 'algorithm/admn'"),
        ("dataset=synthetic epochz=3", "error: epochz is not a setting of the config (did you mean epochs?)"),
    ],
)
def test_run_refuses_overrides_that_do_not_compose_in_one_line(tmp_path, capsys, overrides, says):
    """`deploy run --overrides "algorithm=admn"` printed Hydra's 98-line traceback (`start` said it in one line)."""
    argv = ["run", "--overrides", overrides, "--run-dir", str(tmp_path / "run"), "--state-dir", str(tmp_path)]
    assert deploy.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(says) and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "deployment.json").exists()  # nothing was started


@pytest.mark.parametrize("checkpointed", [True, False])
def test_a_run_that_fails_after_a_checkpoint_says_how_to_resume(tmp_path, monkeypatch, checkpointed):
    """A node killed mid-run: `deploy run` ended 'run N finished:failed: table 'movies' shard 0: Error: Node
    Unavailable ...; no new results.json' with no word that --resume continues it from its checkpoints."""
    from tpflower.checkpoint import CHECKPOINT

    def lost_a_node(_dep, _job, run_dir, _out, _what, _timeout):
        if checkpointed:
            (run_dir / CHECKPOINT).write_bytes(b"")
        raise deploy.RunFailed("run 1 finished:failed: table 'movies' shard 0: Error: Node Unavailable")

    monkeypatch.setattr(deploy, "start", lambda *_a, **_k: None)
    monkeypatch.setattr(deploy, "submit", lost_a_node)
    with pytest.raises(deploy.RunFailed) as failed:
        deploy.run("algorithm=admm", tmp_path)
    hint = "; the run continues from its last checkpoint with the same command and --resume"
    assert str(failed.value).endswith(hint) == checkpointed


@pytest.mark.parametrize("command", ["run", "predict"])
def test_ctrl_c_stops_run_and_predict_in_one_line(tmp_path, monkeypatch, capsys, command):
    """Ctrl-C on `deploy run` printed Python's traceback of stream_run (its deployment was stopped all the same);
    it now says so in one line, how to continue a run, exit status 130."""

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(deploy, command, interrupted)
    argv = [command, "--overrides", "algorithm=admm", "--run-dir", str(tmp_path)]
    try:
        code = deploy.main(argv + (["--rows", str(tmp_path / "rows.csv")] if command == "predict" else []))
    except KeyboardInterrupt:  # pytest would take it for the user's and stop the session
        pytest.fail("Ctrl-C left main as a KeyboardInterrupt (its traceback)")
    assert code == 130
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert err.startswith("error: interrupted (Ctrl-C); the deployment it started is stopped")
    if command == "run":
        assert f"with the same command and --resume (results: {tmp_path})" in err


def test_a_process_of_an_owned_deployment_ends_with_its_launcher(tmp_path):
    """`deploy run` owns its deployment: SIGKILL of the launcher ends the processes it spawned (SIGTERM, the
    parent-death signal), where they had run the job on."""
    code = (
        "import sys, time; from pathlib import Path; from simulations import deploy\n"
        f"p = deploy.spawn(['sleep', '120'], Path({str(tmp_path / 'child.log')!r}), {{}}, owned=True)\n"
        "print(p.pid, flush=True); time.sleep(120)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    os.kill(child, 0)  # alive while its launcher is
    parent.kill()
    parent.wait()
    for _ in range(100):
        if not deploy._alive(child):
            break
        time.sleep(0.05)
    assert not deploy._alive(child)


def test_deployed_predict_refuses_another_datasets_or_scenarios_model_or_an_empty_state_dir_before_starting(tmp_path):
    from simulations.federated import run_in_process
    from tests.conftest import make_cfg

    run_in_process(make_cfg("algorithm=admm", "dataset=synthetic", "epochs=1"), tmp_path / "run", log=lambda _: None)
    rows = tmp_path / "rows.csv"
    with pytest.raises(deploy.RunFailed, match="model of dataset 'synthetic', the overrides name dataset 'movielens'"):
        deploy.predict("algorithm=admm dataset=movielens", tmp_path / "run", rows, tmp_path / "state")
    # a join's model predicted with scenario=ucq: was a union's deployment started, then 'no saved model part'
    with pytest.raises(deploy.RunFailed, match="model of scenario 'join', the overrides name scenario 'ucq'"):
        deploy.predict("algorithm=admm dataset=synthetic scenario=ucq", tmp_path / "run", rows, tmp_path / "state")
    with pytest.raises(deploy.RunFailed, match="holds no deployment, so no node's saved model part"):
        deploy.predict("algorithm=admm dataset=synthetic", tmp_path / "run", rows, tmp_path / "state")
    assert not (tmp_path / "state" / "deployment.json").exists()  # nothing was started
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "deployment.json").write_text("{}")  # a deployment's state dir, stopped
    with pytest.raises(deploy.RunFailed, match=r"--rows .*rows.csv: no such file"):
        deploy.predict("algorithm=admm dataset=synthetic", tmp_path / "run", rows, tmp_path / "state")
    rows.write_bytes(b"\xff\xfe\x00garbage")  # not a table
    with pytest.raises(deploy.RunFailed, match=r"--rows .*rows.csv: cannot read it as csv"):
        deploy.predict("algorithm=admm dataset=synthetic", tmp_path / "run", rows, tmp_path / "state")


def test_a_deployment_keeps_its_flower_config_under_its_state_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("FLWR_HOME", raising=False)
    assert deploy.flwr_home(None, tmp_path / "state") == (tmp_path / "state" / "flwr").resolve()
    assert deploy.flwr_home(tmp_path / "mine", tmp_path / "state") == (tmp_path / "mine").resolve()  # --flwr-home
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "env"))
    assert deploy.flwr_home(None, tmp_path / "state") == (tmp_path / "env").resolve()  # the user's choice


def test_streamed_run_output_is_clean_when_not_a_terminal():
    """No colour codes off a terminal, each line once, no notes on the app's pyproject."""
    import io
    import sys

    script = (
        "print('\\x1b[32mINFO\\x1b[0m :      Starting'); print('epoch 1 | x'); print('epoch 1 | x'); "
        "print(\"Flower App configuration warnings in '/app/pyproject.toml':\"); "
        "print('WARNING: Recommended property \"license\" missing in [project]'); "
        "print('\\x1b[1mSuccessfully started run 7\\x1b[0m'); print('INFO :      '); print('results: /r/results.json')"
    )
    out = io.StringIO()
    run_id, lines = deploy.stream_run([sys.executable, "-c", script], dict(os.environ), 60, out)
    assert run_id == 7 and "\x1b" not in out.getvalue()
    assert out.getvalue().splitlines() == [
        "INFO :      Starting",
        "epoch 1 | x",
        "Successfully started run 7",
        "results: /r/results.json",
    ]


def test_fab_holds_the_app_and_not_the_venv_or_outputs():
    import io
    import zipfile

    from flwr.cli.build import build_fab_from_disk

    fab = build_fab_from_disk(deploy.APP_DIR)  # what `flwr run` ships
    names = zipfile.ZipFile(io.BytesIO(fab)).namelist()
    for needed in (
        "pyproject.toml",
        "tpflower/app/client_app.py",
        "tpflower/app/server_app.py",
        "conf/config.yaml",
        "conf/dataset/synthetic.yaml",
        "strategies/base.py",
        "tpflower/client.py",
    ):
        assert needed in names
    assert not [n for n in names if n.startswith((".venv/", "outputs/", "multirun/", ".git/")) or "__pycache__" in n]
    assert len(fab) < 2_000_000


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize(
    "overrides,clients,algorithm,epochs",
    [
        (JOIN_RUN, [(t, 0) for t in SYNTHETIC_TABLES], "tp_join_celu", 1),
        # 7 rounds (keys, preprocessing stats and rule, ADMM setup, 2 consensus rounds, consensus) on 6 nodes
        (UCQ_OVERRIDES, UCQ_CLIENTS, "tp_ucq_admm", 1),
    ],
    ids=["join", "ucq"],
)
def test_flwr_run_on_superlink_and_one_supernode_per_table(tmp_path, overrides, clients, algorithm, epochs):
    dep = None
    left: list[int] = ["not stopped"]  # type: ignore[list-item]
    try:
        dep = deploy.start(overrides, state_dir=tmp_path / "deploy", home=tmp_path / "flwr-home", cwd=tmp_path)
        assert [p["name"] for p in dep.processes] == ["superlink"] + [f"supernode {t}/{q}" for t, q in clients]
        config = (tmp_path / "flwr-home" / "config.toml").read_text()
        assert f'address = "127.0.0.1:{dep.superlink_port}"' in config
        if overrides == JOIN_RUN:  # first a run asking for less than the label owner's floor: refused at hello
            refused_run(dep, tmp_path)

        run_dir = tmp_path / "run"
        log = tmp_path / "flwr-run.log"
        proc = deploy.spawn(
            deploy.flwr_run_command(dep.connection, overrides, run_dir), log, dep.env(), cwd=deploy.APP_DIR
        )
        dep.popens.append(proc)
        logs = [log] + [Path(p["log"]) for p in dep.processes]
        data = _wait_for_run(proc, run_dir / "results.json", logs, timeout=RUN_TIMEOUT_S * len(clients) / 4)
        _check_results(data, algorithm, epochs)
        # the FAB was shipped to the SuperLink (by the first run: the refused one in the join case)
        assert any("Successfully installed tpflower" in p.read_text() for p in tmp_path.glob("flwr-*.log"))
        # the SuperNodes' ClientApp processes import tpflower.app.client_app from the installed FAB
        assert list((tmp_path / "flwr-home" / "apps").glob("tpflower.tpflower.*/tpflower/app/client_app.py"))
    finally:
        if dep is not None:
            left = deploy.stop(dep)
    assert dep is not None
    assert left == []
    assert deploy.tagged_pids(dep.tag) == []
    assert all(p.poll() is not None for p in dep.popens)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_flwr_run_local_simulation(tmp_path):
    home = tmp_path / "flwr-home"
    tag = uuid.uuid4().hex
    env = deploy.flower_env(home, tag)
    # the managed local SuperLink listens on fixed ports unless these are set
    env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"] = str(deploy.free_port())
    env["FLWR_LOCAL_CONTROL_API_PORT"] = str(deploy.free_port())
    run_dir = tmp_path / "run"
    log = tmp_path / "flwr-run.log"
    cmd = deploy.flwr_run_command(
        None, OVERRIDES, run_dir, federation_config="num-supernodes=4 client-resources-num-cpus=1"
    )
    proc = deploy.spawn(cmd, log, env, cwd=tmp_path)
    running_after_run: list[int] = []
    try:
        data = _wait_for_run(proc, run_dir / "results.json", [log, home / "local-superlink" / "superlink.log"])
        _check_results(data)
        running_after_run = deploy.local_superlink_pids(home)
        assert deploy.stop_local(home) == []
    finally:
        left = deploy.kill_tagged(tag, children=[proc])
    assert len(running_after_run) == 1  # `flwr run .` leaves the local SuperLink running; stop_local stopped it
    assert left == []
    assert deploy.local_superlink_pids(home) == []


def unauthorized_nodes_are_refused(dep: deploy.Deployment, tmp_path: Path) -> None:
    """A SuperNode whose key is not registered, and one talking plain text, never join (TLS + node auth)."""
    from simulations.pki import make_node_keys

    key, _ = make_node_keys(tmp_path / "intruder.key")
    config = tmp_path / "deploy" / "clients" / "d1-0.yaml"
    intruders = {
        "unregistered": deploy.supernode_command(dep.superlink_port, deploy.free_port(), "d1", 0, config, dep.ca, key),
        "plain": deploy.supernode_command(dep.superlink_port, deploy.free_port(), "d1", 0, config, None),
    }
    procs = {name: deploy.spawn(cmd, tmp_path / f"{name}.log", dep.env()) for name, cmd in intruders.items()}
    dep.popens.extend(procs.values())
    deadline = time.monotonic() + 60
    while procs["unregistered"].poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    refused = (tmp_path / "unregistered.log").read_text()
    assert procs["unregistered"].returncode != 0 and "Failed to activate SuperNode" in refused, refused  # auth refused
    assert "Connection attempt failed" in (tmp_path / "plain.log").read_text()  # plain text: no connection
    procs["plain"].kill()


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("run", [RESUME_RUN, GBDT_RESUME_RUN], ids=["admm", "gbdt"])
def test_a_deployment_killed_after_epoch_3_resumes_to_the_simulation_metrics(tmp_path, run):
    """TLS + node authentication by default; a SuperNode killed (kill -9) after epoch 3 of 6 (boosted trees: after
    the evaluation of tree 3) stops the run with a line naming its table; restarted, it rejoins a resumed run,
    which ends with the metrics of the in-process simulation of the same config (float64, to 1e-6; boosted trees:
    the same trees, metrics to 1e-9)."""
    from simulations.federated import run_in_process
    from tpflower.config import compose_config

    dep = None
    left: list[int] = ["not stopped"]  # type: ignore[list-item]
    try:
        dep = deploy.start(run, state_dir=tmp_path / "deploy", home=tmp_path / "flwr-home", cwd=tmp_path)
        assert dep.secure and "--enable-supernode-auth" in dep.processes[0]["cmd"]
        if run == RESUME_RUN:  # once: the refusal does not depend on the algorithm
            unauthorized_nodes_are_refused(dep, tmp_path)
        run_dir = tmp_path / "run"
        logs = [Path(p["log"]) for p in dep.processes]
        proc = deploy.spawn(
            deploy.flwr_run_command(dep.connection, run, run_dir),
            tmp_path / "killed.log",
            dep.env(),
            cwd=deploy.APP_DIR,
        )
        dep.popens.append(proc)
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while checkpoint_epoch(run_dir) < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert checkpoint_epoch(run_dir) >= 3, deploy._log_tail(tmp_path / "killed.log", 60)
        victim = next(p for p in dep.processes if p["name"] == "supernode d2/0")
        os.kill(victim["pid"], signal.SIGKILL)
        _wait_for_exit(proc, RUN_TIMEOUT_S)
        killed_log = (tmp_path / "killed.log").read_text()
        assert "table 'd2' shard 0" in killed_log, deploy._log_tail(tmp_path / "killed.log", 60)
        assert not (run_dir / "results.json").exists()

        deploy.restart_node(dep, "supernode d2/0", cwd=tmp_path)
        proc = deploy.spawn(
            deploy.flwr_run_command(dep.connection, f"{run} resume=true", run_dir),
            tmp_path / "resumed.log",
            dep.env(),
            cwd=deploy.APP_DIR,
        )
        dep.popens.append(proc)
        data = _wait_for_run(proc, run_dir / "results.json", [tmp_path / "resumed.log"] + logs)
        assert "resumed after " in (tmp_path / "resumed.log").read_text()
    finally:
        if dep is not None:
            left = deploy.stop(dep)
    assert left == []
    assert [h["epoch"] for h in data["history"]] == [1, 2, 3, 4, 5, 6]
    simulation = run_in_process(compose_config(*run.split()), None, log=lambda _: None).strategy
    simulated, rtol = simulation.results, 1e-6
    if run == GBDT_RESUME_RUN:  # the simulation's trees
        rtol = 1e-9
        assert_same_forest(json.loads((run_dir / "model.json").read_text()), simulation.model_extra())
    np.testing.assert_allclose(
        [h["test_metric"] for h in data["history"]], [h.test_metric for h in simulated.history], rtol=rtol
    )
    np.testing.assert_allclose(
        [h["train_loss"] for h in data["history"]], [h.train_loss for h in simulated.history], rtol=rtol
    )


def _wait_for_exit(proc, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert proc.poll() is not None, "`flwr run` did not end after its node was killed"


FOREIGN_PYPROJECT = """
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "foreign"
version = "1.0.0"
dependencies = ["flwr"]

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "attacker"

[tool.flwr.app.components]
serverapp = "foreign_app:server"
clientapp = "foreign_app:client"

[tool.flwr.app.config]
targets = ""
out = ""
"""

# a submitter's own app: its ClientApp answers every query with the owner's settings file, the secret file it
# names and the first rows of its data source; its ServerApp collects the replies (and fails on error replies)
FOREIGN_APP = """
import json
from pathlib import Path

import yaml
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

client = ClientApp()
server = ServerApp()


@client.query()
def steal(msg: Message, context: Context) -> Message:
    loot = {}
    for path in [context.node_config.get("client-config")] + str(context.run_config["targets"]).split(","):
        if path and Path(str(path)).is_file():
            text = Path(str(path)).read_text()
            loot[str(path)] = text[:2000]
            settings = yaml.safe_load(text) if str(path).endswith(".yaml") else None
            for extra in ("secret_file", "source"):
                if isinstance(settings, dict) and settings.get(extra):
                    loot[settings[extra]] = Path(settings[extra]).read_text()[:2000]
    return Message(RecordDict({"loot": ConfigRecord({"json": json.dumps(loot)})}), reply_to=msg)


@server.main()
def main(grid: Grid, context: Context) -> None:
    import time

    nodes = list(grid.get_node_ids())
    while len(nodes) < 4:
        time.sleep(1)
        nodes = list(grid.get_node_ids())
    asks = [Message(RecordDict({"q": ConfigRecord({"x": 1})}), dst_node_id=n, message_type="query") for n in nodes]
    replies = list(grid.send_and_receive(asks, timeout=120))
    found = [r.content["loot"]["json"] for r in replies if not r.has_error()]
    refused = [str(r.error.reason) for r in replies if r.has_error()]
    Path(str(context.run_config["out"])).write_text(json.dumps({"loot": found, "refused": refused}))
    print("\\n".join(refused))
    if refused:
        raise RuntimeError("; ".join(refused))
"""
# float64 TP-Join-ADMM, 2 epochs, no privacy: the tpflower run after the foreign one (compared with in-process)
AFTER_FOREIGN_RUN = "algorithm=admm dataset=synthetic epochs=2 precision=float64"


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_a_foreign_app_is_refused_by_every_node_then_tpflower_runs_to_the_simulation_metrics(tmp_path):
    """The owner's node service (simulations.node) never runs a submitter's app: a foreign FAB whose
    ClientApp reads the node's settings, secret and data gets one refusal line per node (naming it) and no
    byte of them; then tpflower's own app on the same deployment ends with the in-process metrics (1e-6)."""
    from simulations.federated import run_in_process
    from tpflower.config import compose_config

    app_dir = tmp_path / "foreign"
    app_dir.mkdir()
    (app_dir / "pyproject.toml").write_text(FOREIGN_PYPROJECT)
    (app_dir / "foreign_app.py").write_text(FOREIGN_APP)
    dep = None
    left: list[int] = ["not stopped"]  # type: ignore[list-item]
    try:
        dep = deploy.start(AFTER_FOREIGN_RUN, state_dir=tmp_path / "deploy", home=tmp_path / "flwr-home", cwd=tmp_path)
        clients = tmp_path / "deploy" / "clients"
        key_files = sorted(clients.glob("*key"))  # keys: blind: each owner's own T.key; hmac: the shared key
        assert key_files
        secrets_ = [k.read_text() for k in key_files]
        settings = [(clients / f"{t}-0.yaml") for t in SYNTHETIC_TABLES]
        owned = [yaml.safe_load(p.read_text()) for p in settings]
        sources = [Path(str(o["source"])) for o in owned if o.get("source")]  # synthetic: generated, no file
        targets = ",".join(str(p) for p in [*settings, *key_files, *sources])
        out = tmp_path / "foreign-out.json"
        cmd = [
            "flwr",
            "run",
            str(app_dir),
            dep.connection,
            "--run-config",
            f"targets={json.dumps(targets)} out={json.dumps(str(out))}",
            "--stream",
        ]
        run_id, lines = deploy.stream_run(cmd, dep.env(), RUN_TIMEOUT_S)
        assert run_id is not None, "\n".join(lines[-20:])
        got = json.loads(out.read_text())
        status = deploy.run_status(run_id, dep.connection, dep.env())
        assert got["loot"] == [] and len(got["refused"]) == 4, got
        for table in SYNTHETIC_TABLES:
            assert any(f"node table {table!r} shard 0 refuses app attacker/foreign 1.0.0" in r for r in got["refused"])
        assert status["status"] != "finished:completed" and "refuses app" in str(status.get("status-details"))
        assert any("refuses app attacker/foreign" in line for line in lines)  # the submitter's own output
        everything = out.read_text() + "\n".join(lines)
        first_rows = [src.read_text().splitlines()[1] for src in sources if src.is_file()]
        assert not any(s in everything for s in secrets_) and not any(row in everything for row in first_rows)

        run_dir = tmp_path / "run"
        results = run_dir / "results.json"
        run_id, lines = deploy.stream_run(
            deploy.flwr_run_command(dep.connection, AFTER_FOREIGN_RUN, run_dir), dep.env(), RUN_TIMEOUT_S
        )
        assert results.is_file(), "\n".join(lines[-30:])
        data = json.loads(results.read_text())
    finally:
        if dep is not None:
            left = deploy.stop(dep)
    assert left == []
    simulated = run_in_process(compose_config(*AFTER_FOREIGN_RUN.split()), None, log=lambda _: None).strategy.results
    np.testing.assert_allclose(
        [h["test_metric"] for h in data["history"]], [h.test_metric for h in simulated.history], rtol=1e-6
    )
    np.testing.assert_allclose(
        [h["train_loss"] for h in data["history"]], [h.train_loss for h in simulated.history], rtol=1e-6
    )


def test_start_keeps_an_owner_settings_file_its_user_edited(tmp_path, capsys):
    """The one-machine path lets a user try an owner's restrictions by editing clients/*.yaml
    (docs/deployment.md): `start` writes a file again only while it is as `start` last wrote it."""
    overrides = deploy.deployment_overrides("dataset=synthetic")
    paths = deploy.write_client_configs(overrides, tmp_path)
    edited, untouched = list(paths.values())[:2]
    settings = yaml.safe_load(edited.read_text())
    settings["min_group_rows"] = 50
    edited.write_text(yaml.safe_dump(settings, sort_keys=False))
    untouched.write_text(untouched.read_text())  # saved unchanged: still the tool's
    capsys.readouterr()
    again = deploy.write_client_configs(deploy.deployment_overrides("dataset=synthetic min_group_rows=7"), tmp_path)
    assert yaml.safe_load(again[next(k for k, p in paths.items() if p == edited)].read_text())["min_group_rows"] == 50
    assert yaml.safe_load(untouched.read_text())["min_group_rows"] == 7  # the overrides' bound, written again
    out = capsys.readouterr().out
    assert out.count("keeping") == 1 and f"keeping {edited}: edited since" in out
    # a prediction's rows file is set in a kept file too (else its node would score the rows an earlier
    # prediction named there), the owner's other lines and comments as they were
    edited.write_text(edited.read_text() + "# the owner's note\nprediction_rows: /old/rows.csv\n")
    client = next(k for k, p in paths.items() if p == edited)
    deploy.write_client_configs(overrides, tmp_path, prediction_rows={client: "/new/rows.csv"})
    kept = yaml.safe_load(edited.read_text())
    assert kept["prediction_rows"] == "/new/rows.csv" and kept["min_group_rows"] == 50
    assert "# the owner's note" in edited.read_text()
    assert f"{edited}: prediction_rows set for this start" in capsys.readouterr().out
    edited.unlink()  # deleted: written from the overrides again
    deploy.write_client_configs(overrides, tmp_path)
    assert yaml.safe_load(edited.read_text())["min_group_rows"] == 20


def test_start_refuses_a_label_dp_floor_without_the_labels_range_before_writing_it(tmp_path):
    """privacy=label on a regression label without label_range: the owners' floor would draw its labels on the
    data's own min and max, and every honest run's range would randomize them again; `start` refuses in one
    line, as a run would, and writes no settings file. With the range (or a class label) it writes them."""
    with pytest.raises(SpecError, match=r"floor privacy=label: the label's public range \[lo, hi\] is not set"):
        deploy.write_client_configs("dataset=synthetic privacy=label", tmp_path / "a")
    assert not list((tmp_path / "a").glob("*.yaml"))
    paths = deploy.write_client_configs("dataset=synthetic privacy=label privacy.label_range=[-9,9]", tmp_path / "b")
    assert all(yaml.safe_load(p.read_text())["privacy"]["label_range"] == [-9, 9] for p in paths.values())
    assert deploy.write_client_configs("dataset=synthetic dataset.loader.task=binary privacy=label", tmp_path / "c")


@pytest.mark.parametrize(
    "overrides, said",
    [
        ("dataset=synthetic privacy=label", "error: --overrides: the owners' floor privacy=label: the label's public"),
        ("dataset=synthetic algorithm=admm algorithm.rhoo=3", "error: algorithm.rhoo is not a setting of algorithm"),
        ("dataset=nosuch", "error: In 'config': Could not find 'dataset/nosuch'"),
    ],
)
def test_start_says_a_bad_setting_in_one_line_and_starts_nothing(tmp_path, capsys, overrides, said):
    assert deploy.main(["start", "--overrides", overrides, "--state-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(said) and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "deployment.json").exists()


def test_deployed_predict_says_a_bad_rows_file_in_one_line_before_starting(tmp_path, monkeypatch):
    """The query owner's node checks its new rows on its saved part before the deployment starts (seconds, not
    the tens of seconds of a start): one line naming the file and the missing column; good rows go on to start."""
    import shutil

    from simulations.federated import run_in_process
    from tests.conftest import make_cfg

    overrides = "algorithm=admm dataset=synthetic epochs=1"
    run_in_process(make_cfg(*overrides.split()), tmp_path / "run", log=lambda _: None)
    configs = deploy.write_client_configs(deploy.deployment_overrides(overrides), tmp_path / "state" / "clients")
    for path in configs.values():  # each node's saved parts where its settings keep its state, as a deployment's
        shutil.copytree(tmp_path / "run" / "node-state", path.parent / "state" / path.stem, dirs_exist_ok=True)
    (tmp_path / "state" / "deployment.json").write_text("{}")

    def start(*args, **kwargs):
        raise deploy.RunFailed("started")

    monkeypatch.setattr(deploy, "start", start)
    rows = tmp_path / "rows.csv"
    rows.write_text("k1,k2,x0,x1,x2\n0,0,0.5,0.5,0.5\n")  # the fact table's x3 is missing
    with pytest.raises(deploy.RunFailed, match=r"table 'fact' shard 0: rows file .*rows.csv lacks feature column"):
        deploy.predict(overrides, tmp_path / "run", rows, tmp_path / "state")
    rows.write_text("k1,k2,x0,x1,x2,x3\n0,0,0.5,0.5,0.5,0.5\n")
    with pytest.raises(deploy.RunFailed, match="^started$"):
        deploy.predict(overrides, tmp_path / "run", rows, tmp_path / "state")


def test_start_prints_a_flwr_run_line_with_a_run_dir_that_runs_as_it_is(tmp_path, monkeypatch, capsys):
    """`start` printed `flwr run . CONNECTION ...` with no run-dir: the results went to the ServerApp's default
    folder (outputs/flwr/ALGORITHM-DATASET under the SuperLink's working directory), and `.` and `flwr` held only
    in the repository with the venv active. Now every word is absolute and quoted for the shell, with the run dir
    (`--run-dir`, default STATE_DIR/run), as `run` passes it (a deployment ran it verbatim from /tmp)."""
    dep = deploy.Deployment("t", str(tmp_path / "my home"), str(tmp_path / "s"), 9093, "local-deployment")
    monkeypatch.setattr(deploy, "start", lambda *_a, **_k: dep)
    for extra, run_dir in (([], tmp_path / "s" / "run"), (["--run-dir", "rel out"], Path.cwd() / "rel out")):
        assert (
            deploy.main(["start", "--overrides", "dataset=synthetic", "--state-dir", str(tmp_path / "s"), *extra]) == 0
        )
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("run:  "))
        words = shlex.split(line.removeprefix("run:  "))
        assert words[0] == f"FLWR_HOME={tmp_path / 'my home'}"
        assert words[1] == str(Path(sys.executable).parent / "flwr")
        assert words[2:] == deploy.flwr_run_command("local-deployment", "algorithm=admm dataset=synthetic", run_dir)[1:]
        assert f'run-dir="{run_dir}"' in words[-2]


def test_a_node_that_refuses_as_it_starts_is_one_line_of_deploy_start(tmp_path, monkeypatch, capsys):
    """A node stopping at start on its settings or data (text in a numeric column, say) made `deploy run` end in
    a RuntimeError traceback with the node's line at its end; it is the command's one error line now."""
    line = "error: node table 'fact' shard 0: source file /owner/fact.csv: 1 problem in the data: ..."
    log = tmp_path / "supernode-fact-0.log"
    log.write_text(f"some output\n{line}\n")
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    proc.wait()
    with pytest.raises(deploy.RunFailed) as err:
        deploy._wait_port(deploy.free_port(), proc, log, timeout=5)
    assert str(err.value) == f"{line.removeprefix('error: ')} (exit status 1; log {log})"

    def refused(*_args, **_kwargs):
        raise err.value

    monkeypatch.setattr(deploy, "start", refused)
    assert deploy.main(["start", "--overrides", "dataset=synthetic", "--state-dir", str(tmp_path / "s")]) == 1
    assert capsys.readouterr().err == f"error: {err.value!s}\n"
