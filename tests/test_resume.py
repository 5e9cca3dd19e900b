"""Checkpoint and resume (strategies.checkpoint on the server, tpflower.checkpoint on each node): a run that
dies after epoch 3 of 6 and is resumed in its run dir ends with the metrics of an uninterrupted run.

In-process (the same strategy, ClientApp and records as under Flower): the crash is a client failing in epoch
4, which stops the run after the checkpoints of epoch 3; the resumed run starts from fresh client contexts (a
new process), as after a kill -9. The deployment test kills a real SuperNode.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import Message

from simulations.federated import in_process_contexts, run_in_process
from strategies.transport import DirectTransport, RunError
from tpflower.app.client_app import client_app_for
from tpflower.app.server_app import make_strategy
from tpflower.config import compose_config
from tpflower.records import unpack_payload

RUN = ("dataset=synthetic", "algorithm=admm", "epochs=6", "precision=float64")


def quiet(_line: str) -> None:
    pass


def crashed_run(run_dir, *overrides: str, crash_epoch: int = 4, table: str | None = "d2") -> None:
    """The run dies in epoch ``crash_epoch``: ``table``'s client fails on that epoch's update (the other
    clients answer it), or with ``table=None`` the server dies before sending it."""
    cfg = compose_config(*RUN, *overrides)
    strategy = make_strategy(cfg, run_dir, log=quiet)
    contexts = in_process_contexts(strategy)
    app = client_app_for(cfg, None, run_dir)
    key_of = {c.node_id: k for k, c in contexts.items()}

    def dying(msg: Message, context) -> Message:
        if msg.metadata.message_type != "query":
            _, config = unpack_payload(msg.content)
            if key_of[context.node_id][0] == table and epoch_of(config, run_dir) == crash_epoch:
                raise RuntimeError("killed")
        return app(msg, context)

    class DyingServer(DirectTransport):
        def exchange(self, messages):  # the server dies right after its checkpoint of epoch crash_epoch - 1
            if table is None and checkpoint_epoch(run_dir) == crash_epoch - 1:
                raise RunError("server killed")
            return super().exchange(messages)

    with pytest.raises(RunError, match=f"table '{table}' shards? 0[:,].*killed" if table else "server killed"):
        strategy.run(DyingServer(dying, {c.node_id: c for c in contexts.values()}))


def epoch_of(config, run_dir) -> int | None:
    """The epoch a training message belongs to: its config's, or for boosted trees (whose messages name no
    epoch; an epoch is a tree) the tree after the server's last checkpoint (one per tree: eval_every=1)."""
    if str(config.get("phase")) in ("gbdt_split", "gbdt_hist"):
        return checkpoint_epoch(run_dir) + 1
    return config.get("epoch")


def checkpoint_epoch(run_dir) -> int:
    import pickle

    path = run_dir / "checkpoint.pkl"
    return int(pickle.loads(path.read_bytes())["epoch"]) if path.is_file() else 0


def history(run) -> list[tuple[int, float, float]]:
    return [(h.epoch, h.test_metric, h.train_loss) for h in run.strategy.results.history]


SGD = ("algorithm.batch_size=4000",)


@pytest.mark.parametrize(
    "overrides, crash_at",
    [
        # tol=0: accelerated ADMM (the default) meets the default tol before epoch 4 (the crash's)
        (("algorithm.tol=0",), "d2"),
        (("privacy=label", "privacy.label_range=[-20,20]", "algorithm.tol=0"), "d2"),
        (("algorithm=sgd", *SGD), None),
        (("algorithm=sgd", *SGD, "algorithm.eval_every=3"), None),
        (("algorithm=celu", *SGD, "algorithm.lr=0.02"), None),
        (("algorithm=vfl_admm", "algorithm.tol=0"), None),
        (("scenario=ucq", "algorithm.inner_rounds=3"), None),
        (("scenario=ucq", "algorithm=sgd", *SGD), None),
        (("algorithm=coreset", "algorithm.m=300"), "d2"),
        (("algorithm=coreset", "algorithm.m=300", "algorithm.train=sgd", "algorithm.batch_size=100"), None),
        (("algorithm=pcg", "algorithm.tol=0"), "d2"),
        (("algorithm=lbfgs", "algorithm.tol=0", "model=mlp"), "d2"),
        (("algorithm=pcg", "algorithm.tol=0", "scenario=ucq"), None),
        (("algorithm=lbfgs", "algorithm.tol=0", "model=mlp", "scenario=ucq"), None),
        (("algorithm=coreset", "algorithm.m=300", "algorithm.train=pcg", "algorithm.tol=0"), "d2"),
    ],
    ids=[
        "admm",
        "admm-label-dp",
        "sgd",
        "sgd-eval-every",
        "celu",
        "vfl-admm",
        "ucq-admm",
        "ucq-sgd",
        "coreset-admm",
        "coreset-sgd",
        "pcg",
        "lbfgs",
        "ucq-pcg",
        "ucq-lbfgs",
        "coreset-pcg",
    ],
)
def test_a_run_killed_after_epoch_3_resumes_to_the_metrics_of_an_uninterrupted_run(tmp_path, overrides, crash_at):
    full = run_in_process(compose_config(*RUN, *overrides), tmp_path / "full", log=quiet)
    run_dir = tmp_path / "resumed"
    crashed_run(run_dir, *overrides, table=crash_at)
    assert not (run_dir / "results.json").exists() and (run_dir / "checkpoint.pkl").is_file()
    lines: list[str] = []
    resumed = run_in_process(compose_config(*RUN, *overrides, "resume=true"), run_dir, log=lines.append)
    assert any("resumed after epoch 3" in line for line in lines), lines
    got, want = history(resumed), history(full)
    assert [e for e, _, _ in got] == [e for e, _, _ in want] and {1, 2, 3, 4, 5, 6} <= {e for e, _, _ in got}
    if "privacy=label" not in overrides:  # label DP: the randomized labels differ between the runs (OS entropy)
        np.testing.assert_allclose([m for _, m, _ in got], [m for _, m, _ in want], rtol=1e-9)
        np.testing.assert_allclose([t for _, _, t in got], [t for _, _, t in want], rtol=1e-9)
    data = json.loads((run_dir / "results.json").read_text())
    assert [h["epoch"] for h in data["history"]] == [e for e, _, _ in want]  # every evaluation once
    for key, _context in resumed.contexts.items():  # the resumed clients end on the uninterrupted run's theta
        if "privacy=label" not in overrides:
            for name, value in resumed.theta(key).items():
                np.testing.assert_allclose(value, full.theta(key)[name], rtol=1e-9, atol=1e-12)


def assert_same_forest(forest: dict, want: dict) -> None:
    """Two forests of model.json have the same trees: each table's split ids, the nodes' ids, tables and
    children, and the leaf values to 1e-9."""
    assert forest["split_ids"] == want["split_ids"]
    for trees, trees_want in zip(forest["trees"], want["trees"], strict=True):
        for tree, tree_want in zip(trees, trees_want, strict=True):
            assert [n[:4] for n in tree["nodes"]] == [n[:4] for n in tree_want["nodes"]]  # ids, tables, children
            np.testing.assert_allclose([n[4] for n in tree["nodes"]], [n[4] for n in tree_want["nodes"]], rtol=1e-9)


#: boosted trees: 6 trees, a checkpoint at every evaluation (each tree), never stopped early
GBDT = ("algorithm=gbdt", "algorithm.trees=6", "algorithm.eval_every=1", "algorithm.early_stopping=0")


@pytest.mark.parametrize(
    "overrides, crash_at",
    [
        ((), "d2"),
        ((), None),
        (("dataset.loader.task=multiclass",), "fact"),
        (("scenario=ucq", "min_sketch_rows=100"), "fact"),
        (("+dataset.loader.categories=8", "algorithm.categorical=native"), "fact"),
    ],
    ids=["a-table-dies", "the-server-dies", "multiclass", "ucq-a-shard-dies", "native-categorical"],
)
def test_a_gbdt_run_killed_after_tree_3_resumes_to_the_forest_of_an_uninterrupted_run(tmp_path, overrides, crash_at):
    """Boosted trees checkpoint at every evaluation (the forest, the scores F; each node its bin edges and
    splits): a run killed in tree 4 and resumed grows the uninterrupted run's trees, with its metrics."""
    from tpflower.state import ClientState

    full = run_in_process(compose_config(*RUN, *GBDT, *overrides), tmp_path / "full", log=quiet)
    run_dir = tmp_path / "resumed"
    crashed_run(run_dir, *GBDT, *overrides, table=crash_at)
    assert not (run_dir / "results.json").exists() and checkpoint_epoch(run_dir) == 3
    lines: list[str] = []
    resumed = run_in_process(compose_config(*RUN, *GBDT, *overrides, "resume=true"), run_dir, log=lines.append)
    assert any("resumed after 3 trees" in line for line in lines), lines
    got, want = history(resumed), history(full)
    assert [e for e, _, _ in got] == [e for e, _, _ in want] == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose([m for _, m, _ in got], [m for _, m, _ in want], rtol=1e-9)
    np.testing.assert_allclose([t for _, _, t in got], [t for _, _, t in want], rtol=1e-9)
    forest = resumed.strategy.model_extra()
    assert_same_forest(forest, full.strategy.model_extra())
    assert sum(map(len, forest["split_ids"].values())) > 6
    for key, context in resumed.contexts.items():  # every node ends with the uninterrupted run's splits
        for name in ("gbdt.splits", "gbdt.category_splits"):  # thresholds and category sets
            state, state_full = ClientState(context.state), ClientState(full.contexts[key].state)
            np.testing.assert_array_equal(state.get(name), state_full.get(name))
    assert json.loads((run_dir / "model.json").read_text())["trees"] == forest["trees"]


#: tol=0: accelerated ADMM (the default) meets the default tol before epoch 4 (the crash's)
TO_EPOCH_4 = "algorithm.tol=0"


def test_resume_needs_a_checkpoint_and_the_same_config(tmp_path):
    with pytest.raises(ValueError, match="resume=true but there is no checkpoint checkpoint.pkl"):
        make_strategy(compose_config(*RUN, "resume=true"), tmp_path, log=quiet)
    crashed_run(tmp_path, TO_EPOCH_4)
    with pytest.raises(ValueError, match=r"made by another config \(differs in: seed\)"):
        run_in_process(compose_config(*RUN, TO_EPOCH_4, "resume=true", "seed=3"), tmp_path, log=quiet)
    with pytest.raises(ValueError, match=r"made by another config \(differs in: algorithm\.tol\)"):  # the leaf
        run_in_process(compose_config(*RUN, "algorithm.tol=1e-9", "resume=true"), tmp_path, log=quiet)


def test_the_settings_a_config_changed_are_named_by_their_leaves():
    from tpflower.checkpoint import config_changes

    old = {"algorithm": {"name": "gbdt", "trees": 300, "lr": 0.1}, "seed": 0, "model": {"hidden": [8]}}
    new = {"algorithm": {"name": "gbdt", "trees": 30, "lr": 0.1, "depth": 2}, "seed": 0, "model": "linear"}
    assert config_changes(old, new) == ["algorithm.depth", "algorithm.trees", "model"]
    assert config_changes(old, old) == []


def test_a_checkpoint_of_another_tpflower_is_refused_in_one_line(tmp_path):
    import collections
    import pickle

    from tpflower.checkpoint import CHECKPOINT

    crashed_run(tmp_path, TO_EPOCH_4)
    path = tmp_path / CHECKPOINT
    record = pickle.loads(path.read_bytes())
    path.write_bytes(pickle.dumps({**record, "written_by": "tpflower 0.0.1"}))
    with pytest.raises(ValueError, match=r"written by another tpflower .* new run dir") as refused:
        run_in_process(compose_config(*RUN, TO_EPOCH_4, "resume=true"), tmp_path, log=quiet)
    assert "\n" not in str(refused.value)
    moved = pickle.dumps({**record, "meters": collections.OrderedDict()})  # an object whose class moved:
    path.write_bytes(moved.replace(b"collections", b"collectionz"))
    with pytest.raises(ValueError, match=r"written by another tpflower .*ModuleNotFoundError"):
        run_in_process(compose_config(*RUN, TO_EPOCH_4, "resume=true"), tmp_path, log=quiet)


def test_a_node_without_its_checkpoint_refuses_to_resume(tmp_path):
    crashed_run(tmp_path, TO_EPOCH_4)
    for path in (tmp_path / "node-state").glob("d1-0-*/epoch-3.rd"):
        path.unlink()
    with pytest.raises(RunError, match=r"^table 'd1' shard 0 cannot resume: this node has no checkpoint of epoch 3"):
        run_in_process(compose_config(*RUN, TO_EPOCH_4, "resume=true"), tmp_path, log=quiet)


DPSGD = ("privacy=dpsgd", "algorithm.local_epochs=1", "algorithm.local_batch_size=500")


def test_a_resumed_dp_run_carries_its_privacy_accountant_over(tmp_path):
    full = run_in_process(compose_config(*RUN, *DPSGD), tmp_path / "full", log=quiet)
    crashed_run(tmp_path / "run", *DPSGD, table=None)  # the server dies: no client took a DP step of epoch 4
    resumed = run_in_process(compose_config(*RUN, *DPSGD, "resume=true"), tmp_path / "run", log=quiet)
    eps = [h.extra["eps"] for h in resumed.strategy.results.history]
    assert eps == pytest.approx([h.extra["eps"] for h in full.strategy.results.history], rel=1e-9)
    assert eps[-1] > eps[2] > 0  # epochs 4-6 added to the checkpoint's accountant, not to a fresh one


def test_dp_steps_taken_after_the_checkpoint_stay_spent(tmp_path):
    # fact and d1 took their DP steps of epoch 4 before d2 died: redoing epoch 4 costs them budget again,
    # so they run out at the last epoch and refuse (the ledger never goes back; nothing is released unaccounted)
    crashed_run(tmp_path, *DPSGD)
    for _ in range(2):  # the refusing node keeps serving: its cached model carries no Opacus hooks into the
        lines: list[str] = []
        with pytest.raises(  # next resume, which is refused for the budget again (not for the model's state)
            RunError,
            match=r"table 'fact' shard 0: .*DP steps exceed the \d+ the noise was calibrated "
            r"for \(privacy budget exhausted\)",
        ):
            run_in_process(compose_config(*RUN, *DPSGD, "resume=true"), tmp_path, log=lines.append)
        # said as the run resumes, before its epochs spend the rest of the plan, not only at the refusal
        resumed = next(i for i, line in enumerate(lines) if line.startswith("resumed after epoch"))
        epoch = lines[resumed].split()[3]
        warnings = [line for line in lines if f"after the checkpoint of epoch {epoch}, which stay spent" in line]
        tables = [w.split(" took ")[0].removeprefix("warning: table ") for w in warnings]
        assert warnings and lines.index(warnings[0]) == resumed + 1
        if epoch == "3":  # every table but d2, which died before its DP step of epoch 4
            assert tables == ["'d1' shard 0", "'d3' shard 0", "'fact' shard 0"]
        else:  # the first resume stopped at fact's refusal in epoch 6, after d2 took its step of it
            assert epoch == "5" and tables == ["'d2' shard 0"]


def test_every_registered_algorithm_resumes():
    """Every algorithm with epochs resumes (boosted trees: an epoch is an evaluation's trees); a one-shot one
    (k-means: DistDim has no epochs) refuses by name."""
    from tpflower.registry import entries

    not_resumable = [e.name for e in entries() if e.federated and not e.strategy.resumable and not e.strategy.one_shot]
    assert not_resumable == []
    assert {e.name for e in entries() if e.strategy.one_shot} == {"kmeans", "coreset_kmeans"}


@pytest.mark.parametrize("algorithm", ["kmeans", "coreset_kmeans"])
def test_a_one_shot_algorithm_refuses_resume_naming_it(tmp_path, algorithm):
    with pytest.raises(ValueError, match=f"resume=true: algorithm={algorithm} runs in one shot"):
        make_strategy(compose_config("dataset=synthetic", f"algorithm={algorithm}", "resume=true"), tmp_path, log=quiet)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_flower_simulation_killed_with_sigkill_resumes_to_the_uninterrupted_metrics(tmp_path):
    """The CLI run (Flower simulation) killed with SIGKILL once it checkpointed epoch 3 of 6, then resumed
    in its run dir: its results equal an uninterrupted run's (float64, to 1e-6)."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    overrides = ["algorithm=admm", "dataset=movielens", "epochs=6", "precision=float64"]
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "simulations.run", *overrides, f"hydra.run.dir={run_dir}"]
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline, seen = time.monotonic() + 240, None
    while proc.poll() is None and time.monotonic() < deadline:
        path = run_dir / "checkpoint.pkl"
        stamp = path.stat().st_mtime_ns if path.is_file() else None
        if stamp != seen:
            seen = stamp
            if checkpoint_epoch(run_dir) >= 3:
                os.killpg(proc.pid, signal.SIGKILL)  # the run and its Ray workers
                break
        time.sleep(0.002)
    proc.wait(30)
    killed_at = checkpoint_epoch(run_dir)
    assert 3 <= killed_at < 6 and not (run_dir / "results.json").exists(), f"not killed mid-run ({killed_at})"
    done = subprocess.run(cmd + ["resume=true"], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"resumed after epoch {killed_at}" in done.stdout
    data = json.loads((run_dir / "results.json").read_text())
    want = run_in_process(compose_config(*overrides), None, log=quiet).strategy.results.history
    assert [h["epoch"] for h in data["history"]] == [h.epoch for h in want]
    np.testing.assert_allclose([h["test_metric"] for h in data["history"]], [h.test_metric for h in want], rtol=1e-6)
