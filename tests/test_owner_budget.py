"""One privacy budget per owner, across runs: the curious server runs many fresh runs (or restarts, resumes,
understated plans, crafted evaluations) against the deployed client path (node config + the owner's settings
file, pattern of tests/test_curious_server.py) and the node bounds what all of them reveal together."""

from __future__ import annotations

import functools
import multiprocessing
import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from flwr.app import Context, RecordDict

from simulations.federated import run_in_process
from simulations.job import exact_metric_line
from tests.conftest import make_cfg
from tests.test_conformance import call
from tests.test_curious_server import SYNTHETIC, hello, node
from tests.test_privacy_e2e import BINARY
from tpflower.app.client_app import app as deployed_app
from tpflower.app.client_app import make_client
from tpflower.config import compose_config
from tpflower.privacy import label_keep_probability, noise_multiplier_for, privacy_message, rdp_epsilon
from tpflower.privacy.budget import OwnerBudget, reset_label_draws
from tpflower.records import unpack_reply
from tpflower.results import figure

LABEL = f"{SYNTHETIC} {BINARY} privacy=label"
REGRESSION_LABEL = f"{SYNTHETIC} privacy=label privacy.label_range=[-20,20]"
DPSGD = f"{SYNTHETIC} privacy=dpsgd"


@functools.cache
def cfg(overrides: str):
    return compose_config(*overrides.split())


def fresh(context: Context, overrides: str | None = None) -> Context:
    """A fresh run on the same node (same owner settings file, so the same state_dir)."""
    return Context(
        run_id=0,
        node_id=1,
        node_config=dict(context.node_config),
        state=RecordDict(),
        run_config={"overrides": overrides or context.run_config["overrides"]},
    )


def keys(context: Context, overrides: str, **extra) -> tuple[dict, dict]:
    msg = {"phase": "keys", **privacy_message(dict(cfg(overrides).privacy)), **extra}
    arrays, metrics = unpack_reply(call(deployed_app, context, "train", {}, msg).content)
    return arrays, metrics


def truth(context: Context, overrides: str) -> tuple[np.ndarray, np.ndarray]:
    """The owner's true labels and test mask (read on the node, for scoring the attack)."""
    client = make_client(cfg(overrides), context)
    return np.asarray(client.data.y), np.asarray(client.data.is_test)


def train_ready(context: Context, overrides: str, **plan) -> int:
    """keys, then admm_setup (with the DP plan ``plan`` under feature DP): the table's row count."""
    out = keys(context, overrides, **({"run_id": plan["run_id"]} if "run_id" in plan else {}))[0]
    n = len(out["row_ids"])
    G = np.ones(n) if "is_test" not in out else 1.0 - out["is_test"]  # the training join: no test row
    setup = {"phase": "admm_setup", "N": float(G.sum()), "rho": 1.0, "d_out": 1, **plan}
    call(deployed_app, context, "train", {"G": G}, setup)
    return n


def update(context: Context, n: int, **config) -> dict:
    reply = call(deployed_app, context, "train", {"Y": np.zeros((n, 1))}, {"phase": "admm_update", **config})
    return unpack_reply(reply.content)[1]


# ------------------------------------------------------------------------------------ label DP across runs


def test_label_recovery_over_many_fresh_runs_stays_at_the_single_run_rate(tmp_path):
    """Fresh runs (and runs asking for stronger label DP, 1.5x lambda) get the one stored draw: a majority vote
    over 30 of them recovers no more training labels than one run (binary keep probability at lambda 0.5: 93%)."""
    context = node(tmp_path, "fact", LABEL, LABEL)
    assert hello(deployed_app, context)["table"] == "fact"
    first = keys(context, LABEL)[0]
    y, is_test = truth(context, LABEL)
    y_train = y[~is_test]
    single = np.mean(first["y"] == y_train)
    keep = label_keep_probability(0.5, 2)
    assert abs(single - keep) < 0.05
    stronger = f"{LABEL} privacy.label_lambda=0.75"
    draws = [first["y"]]
    for run in range(30):
        overrides = stronger if run % 2 else LABEL
        draws.append(keys(fresh(context, overrides), overrides)[0]["y"])
    same = [draws[0]] + [draws[run + 1] for run in range(0, 30, 2)]
    assert all(np.array_equal(d, first["y"]) for d in same)  # the floor's runs: the same draw every time
    majority = (np.mean(draws, axis=0) > 0.5).astype(first["y"].dtype)
    recovered = np.mean(majority == y_train)
    assert recovered <= keep + 0.05, (recovered, keep)  # was 55.7% after 10 runs, 100% after 200


def test_a_run_chosen_label_range_does_not_narrow_the_randomization(tmp_path):
    """Regression: runs with label_range [t, t + 0.01] for 9 thresholds t (the attack recovered 77.6% of the
    labels to within one bin) only post-process the owner's stored draw, whose noise is that of one run."""
    context = node(tmp_path, "fact", REGRESSION_LABEL, REGRESSION_LABEL)
    honest = keys(context, REGRESSION_LABEL)[0]["y"]
    y, is_test = truth(context, REGRESSION_LABEL)
    y_train = y[~is_test]
    edges = np.quantile(y_train, np.linspace(0.1, 0.9, 9))
    above = []
    for t in edges:
        attack = f"{SYNTHETIC} privacy=label privacy.label_range=[{t},{t + 0.01}]"
        above.append(keys(fresh(context, attack), attack)[0]["y"] > t + 0.005)
    guessed_bin = np.sum(above, axis=0)
    true_bin = np.searchsorted(edges, y_train)
    one_run_bin = np.searchsorted(edges, honest)
    attack_rate, single_rate = np.mean(guessed_bin == true_bin), np.mean(one_run_bin == true_bin)
    assert attack_rate <= single_rate + 0.05, (attack_rate, single_rate)
    assert attack_rate < 0.4  # vs 77.6% when each run drew afresh under its own range


MOVIELENS_LABEL = "algorithm=admm dataset=movielens privacy=label"
RATINGS = "0.5,1.0,1.5,2.0,2.5,3.0,3.5,4.0,4.5,5.0"
#: a run declaring movielens' regression rating multiclass, with and without a padded class list
TASK_ATTACKS = (
    f"{MOVIELENS_LABEL} dataset.label.task=multiclass",
    f"{MOVIELENS_LABEL} dataset.label.task=multiclass +dataset.label.classes=[{RATINGS},98,99]",
)


def test_a_run_declaring_another_label_task_than_its_owner_states_is_refused_at_the_hello(tmp_path):
    """The owner states its label's task (``columns.label_task``, as ``simulations.deploy start`` writes it): a
    run declaring another task or other classes is refused before the node loads or draws anything, so a
    hostile first run pins nothing and honest runs go on."""
    context = node(tmp_path, "ratings", MOVIELENS_LABEL, MOVIELENS_LABEL)
    settings = yaml.safe_load(Path(context.node_config["client-config"]).read_text())
    assert settings["columns"]["label_task"] == "regression" and "label_classes" not in settings["columns"]
    for attack in TASK_ATTACKS:
        with pytest.raises(ValueError, match=r"the run declares its label multiclass; its owner states it is "):
            hello(deployed_app, fresh(context, attack))
    assert not list((tmp_path / "clients").rglob("*-labels-*"))  # no draw, no task pinned
    assert hello(deployed_app, fresh(context))["table"] == "ratings"
    keys(fresh(context), MOVIELENS_LABEL)


def test_a_class_list_the_owner_did_not_state_is_refused(tmp_path):
    """A binary label whose owner states no classes: a run's own class list (reordered: another coding of
    every row) is refused; the owner's stated list must be the run's (compared as text)."""
    owner = "algorithm=admm dataset=nycflights13_delayed privacy=label"
    context = node(tmp_path, "flights", owner, owner)
    flipped = f"{owner} +dataset.label.classes=[1,0]"
    with pytest.raises(ValueError, match=r"label.classes are not the classes its owner states .*states none"):
        hello(deployed_app, fresh(context, flipped))

    def state(settings):
        settings["columns"]["label_classes"] = ["0", "1"]

    stated = node(tmp_path, "flights", owner, owner, edit=state)
    with pytest.raises(ValueError, match=r"label.classes are not the classes its owner states .*out of band"):
        hello(deployed_app, fresh(stated, owner))
    for run in (f"{owner} +dataset.label.classes=[0,1]", f"{owner} +dataset.label.classes=['0','1']"):
        assert hello(deployed_app, fresh(stated, run))["table"] == "flights"
    with pytest.raises(ValueError, match=r"label.classes are not the classes its owner states"):
        hello(deployed_app, fresh(stated, flipped))


@pytest.mark.parametrize(
    ("columns", "match"),
    [
        ({"label_task": "ordinal"}, r"columns.label_task must be one of \['regression', 'binary', 'multiclass'\]"),
        ({"label_task": "regression", "label_classes": [1, 2]}, "label_classes must be a list of two or more"),
        ({"label_task": "multiclass", "label_classes": [1, "1", 2]}, "label_classes must be a list of two or more"),
        ({"label_task": "binary", "label_classes": [0, 1, 2]}, r"of a binary label are \[negative, positive\]"),
    ],
)
def test_a_stated_label_task_is_checked_in_the_owners_file(tmp_path, columns, match):
    def state(settings):
        settings["columns"].update(columns)

    context = node(tmp_path, "ratings", MOVIELENS_LABEL, MOVIELENS_LABEL, edit=state)
    with pytest.raises(ValueError, match=match):
        hello(deployed_app, context)


def test_a_run_declaring_another_label_task_gets_no_new_label_draw(tmp_path):
    """An owner who states no label task (an older settings file): the task is the run's word. Movielens'
    regression rating declared multiclass, its class list padded with classes no row holds, was a fresh draw
    per run (the draw was keyed by the declared task and class count): a majority over 15 such runs read 99.8%
    of the training ratings exactly, against 68.1% from one. Now one owner setting has one draw, whatever task
    a run declares; another task is refused."""
    owner = MOVIELENS_LABEL

    def unstated(settings):
        del settings["columns"]["label_task"]

    context = node(tmp_path, "ratings", owner, owner, edit=unstated)
    first = keys(context, owner)[0]["y"]
    for attack in TASK_ATTACKS:
        with pytest.raises(
            ValueError,
            match=r"its label-DP draw under its owner's setting was made for a regression "
            r"label; the run declares .*a new draw is the owner's decision",
        ):
            keys(fresh(context, attack), attack)
    assert len(list((tmp_path / "clients").rglob("*-labels-*.npz"))) == 1
    assert np.array_equal(keys(fresh(context), owner)[0]["y"], first)  # the honest run: the one stored draw


def test_the_owner_resets_its_label_draw(tmp_path, capsys):
    """The draw is the owner's file (0600, in its state_dir); only the owner's reset makes a new one."""
    from simulations.node import main

    context = node(tmp_path, "fact", LABEL, LABEL)
    before = keys(context, LABEL)[0]["y"]
    files = sorted((tmp_path / "clients").rglob("*-labels-*.npz"))
    assert len(files) == 1 and oct(files[0].stat().st_mode & 0o777) == "0o600"
    assert main(["--client-config", context.node_config["client-config"], "--reset-label-dp"]) == 0
    assert "removed 1 label-DP draw(s) of table 'fact'" in capsys.readouterr().out
    assert not files[0].exists() and reset_label_draws(tmp_path / "clients") == []
    after = keys(fresh(context), LABEL)[0]["y"]
    assert not np.array_equal(before, after)


# ------------------------------------------------------------------------------------ feature DP across runs


def plan(steps: int, q: float = 1.0, run_id: str = "r1") -> dict:
    return {"dp_steps": steps, "dp_q": q, "run_id": run_id}


def test_a_restarted_run_id_is_charged_to_the_same_run(tmp_path):
    """The same run id started afresh (its context lost): its steps add to the run's ledger; beyond the plan
    the node refuses (was: 12 DP steps released, ledger 6)."""
    context = node(tmp_path, "d1", DPSGD, DPSGD)
    n = train_ready(context, DPSGD, **plan(6))  # 400 rows, local batch 256: 2 steps per update
    for _ in range(3):
        update(context, n)
    restarted = fresh(context)
    train_ready(restarted, DPSGD, **plan(6))
    with pytest.raises(
        ValueError, match=r"8 DP steps exceed the 6 the noise was calibrated for .*counting every process of this run"
    ):
        update(restarted, n)


def test_concurrent_resumes_of_one_checkpoint_share_the_runs_ledger(tmp_path):
    """Two resumes of one checkpoint, interleaved: together at most the plan (was 10 steps against 6)."""
    context = node(tmp_path, "d1", DPSGD, DPSGD)
    n = train_ready(context, DPSGD, **plan(6))
    update(context, n, checkpoint=1, run_id="r1")  # 2 steps, checkpointed as epoch 1
    resume = {
        "phase": "resume",
        "run_id": "r1",
        "epoch": 1,
        **privacy_message(dict(cfg(DPSGD).privacy)),
    }
    a, b = fresh(context), fresh(context)
    for c in (a, b):
        call(deployed_app, c, "train", {}, resume)
    update(a, n)
    update(b, n)  # 6 steps in all
    for c in (a, b):
        with pytest.raises(ValueError, match="8 DP steps exceed the 6"):
            update(c, n)


def charge_steps(state_dir: str, steps: int) -> None:
    budget = OwnerBudget(state_dir, "d1", 0)
    for _ in range(steps):
        budget.charge_dp([[1.0, 0.1, 1.0]], Path(state_dir) / "run-ledger.npy", lambda run, owner: None)


def test_concurrent_processes_charge_the_ledgers_under_one_lock(tmp_path):
    """Two processes charging one node's ledgers at once lose no step (the file lock serializes them)."""
    ctx = multiprocessing.get_context("fork")
    workers = [ctx.Process(target=charge_steps, args=(str(tmp_path), 40)) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert [w.exitcode for w in workers] == [0, 0]
    assert OwnerBudget(tmp_path, "d1", 0).read()["dp"] == [[1.0, 0.1, 80.0]]
    assert np.load(tmp_path / "run-ledger.npy").tolist() == [[1.0, 0.1, 80.0]]


def test_the_owner_total_epsilon_bounds_every_run_together(tmp_path):
    """Fresh runs with new run ids, each within the per-run epsilon 1: the owner's ledger composes them all and
    refuses the run whose plan would pass ``privacy.total_epsilon`` (here 1.5: two runs compose to ~1.4)."""
    context = node(tmp_path, "d1", DPSGD, DPSGD, edit=lambda s: s["privacy"].update(total_epsilon=1.5))
    runs = 0
    with pytest.raises(ValueError, match=r"feature-DP budget to epsilon .*the owner allows 1.5 over all runs"):
        for run in range(10):
            c = fresh(context)
            n = train_ready(c, DPSGD, **plan(4, 1.0, f"run{run}"))
            update(c, n)
            update(c, n)
            runs += 1
    assert 1 <= runs <= 3
    state_dir = make_client(cfg(DPSGD), context).settings.owner.state_dir
    ledger = OwnerBudget(state_dir, "d1", 0)
    assert 1.0 < ledger.spent(1e-5) <= 1.5 * 1.02
    assert oct(ledger.ledger.stat().st_mode & 0o777) == "0o600"


def test_a_run_the_feature_dp_budget_refuses_is_told_the_epsilon_that_fits(tmp_path):
    """(ADMM: 4 steps at the node's own rate 256 / 400 rows.) A plan that would pass the owner's total_epsilon named the limit, not what fits; its line now says the
    epsilon left and the largest privacy.epsilon at which the same plan (steps, sample rate) fits, by Opacus'
    RDP accountant, as the node calibrates: a run at that epsilon is answered and stays within the total."""
    context = node(tmp_path, "d1", DPSGD, DPSGD, edit=lambda s: s["privacy"].update(total_epsilon=1.2))
    n = train_ready(context, DPSGD, **plan(4, 0.64, "run0"))
    update(context, n)
    update(context, n)
    with pytest.raises(ValueError) as refusal:
        train_ready(fresh(context), DPSGD, **plan(4, 0.64, "run1"))
    line = str(refusal.value)
    said = re.search(
        r"the owner allows 1\.2 over all runs \(privacy\.total_epsilon\); epsilon (\S+) is left: this plan \(4 DP "
        r"steps at sample rate 0\.64\) fits at privacy\.epsilon=(\S+) or less$",
        line,
    )
    assert said is not None and "\n" not in line, line
    state_dir = make_client(cfg(DPSGD), context).settings.owner.state_dir
    ledger = OwnerBudget(state_dir, "d1", 0)
    assert float(said[1]) == pytest.approx(1.2 - ledger.spent(1e-5), abs=1e-3)
    smaller = f"{DPSGD} privacy.epsilon={said[2]}"
    c = fresh(context, smaller)
    n = train_ready(c, smaller, **plan(4, 0.64, "run2"))
    update(c, n)
    update(c, n)
    assert 1.0 < ledger.spent(1e-5) <= 1.2


def test_what_an_evaluation_budget_left_covers():
    from tpflower.privacy.budget import eval_room

    assert eval_room({"epochs": 9}, 4.0, 1.0) == "what is left covers 4 evaluation(s): epochs=3 or fewer"
    assert eval_room({"epochs": 9, "resume": True}, 4.5, 1.0).endswith("epochs=4 or fewer")
    trees = {"algorithm": {"trees": 300, "eval_every": 10}}
    assert eval_room(trees, 3.0, 1.0) == (
        "what is left covers 3 evaluation(s): algorithm.trees=20 or fewer (algorithm.eval_every=10), or a larger "
        "algorithm.eval_every"
    )
    assert eval_room({}, 0.5, 1.0) == "what is left covers no evaluation at eval_epsilon 1"


def test_a_spent_feature_dp_budget_is_refused_at_the_hello(tmp_path):
    """Once the owner ledger holds its whole total_epsilon (here: the owner lowers it below what earlier runs
    spent), a new run is refused at its hello, before its keys round releases the table's key digests (was:
    hello and keys answered, the refusal came with the DP plan)."""
    context = node(tmp_path, "d1", DPSGD, DPSGD)
    n = train_ready(context, DPSGD, **plan(4, 1.0, "run0"))
    update(context, n)
    update(context, n)
    path = Path(context.node_config["client-config"])
    settings = yaml.safe_load(path.read_text())
    settings["privacy"]["total_epsilon"] = 0.5
    path.write_text(yaml.safe_dump(settings))
    with pytest.raises(ValueError, match=r"feature-DP steps have spent epsilon \S+ of the 0.5 its owner allows"):
        hello(deployed_app, fresh(context))
    with pytest.raises(ValueError, match=r"no DP step is left"):
        keys(fresh(context), DPSGD)
    # a node without labels or DP in the run and floor is not concerned: another table's node still answers
    assert hello(deployed_app, node(tmp_path / "other", "d1", SYNTHETIC, SYNTHETIC))["table"] == "d1"


def test_an_understated_sample_rate_buys_no_smaller_noise(tmp_path):
    """ADMM: dp_q = 1e-6 while the node samples b / n_a = 256 / 400: sigma is calibrated at the node's own q
    (was 0.56 instead of 8.59 in the reported attack)."""
    context = node(tmp_path, "d1", DPSGD, DPSGD)
    n = train_ready(context, DPSGD, **plan(20, 1e-6))
    sigma = float(context.state["scalars"]["dp_sigma"])
    assert sigma == pytest.approx(noise_multiplier_for(1.0, 1e-5, 256 / n, 20))
    assert sigma > 3 * noise_multiplier_for(1.0, 1e-5, 1e-6, 20)
    eps = update(context, n)["eps"]
    assert eps <= 1.0


def test_sgd_accounts_the_rows_a_step_holds(tmp_path):
    """SGD: the node observes its rows per batch. A first batch of 85% of its rows calibrates sigma at 0.85
    whatever dp_q says (1e-6), and the epsilon it reports is that of the observed sampling."""
    sgd = f"{SYNTHETIC} algorithm=sgd privacy=dpsgd"
    context = node(tmp_path, "d1", sgd, sgd)
    n = len(keys(context, sgd, run_id="r1")[0]["row_ids"])
    rows = np.arange(int(0.85 * n))
    call(deployed_app, context, "train", {"rows": rows}, {"phase": "predict", "d_out": 1, **plan(5, 1e-6)})
    sigma = float(context.state["scalars"]["dp_sigma"])
    assert sigma == pytest.approx(noise_multiplier_for(1.0, 1e-5, len(rows) / n, 5))
    small = np.arange(10)
    step = {"phase": "sgd_step", "batch_size": len(small)}
    out = call(deployed_app, context, "train", {"Y": np.zeros((len(rows), 1)), "rows": small}, step)
    assert unpack_reply(out.content)[1]["eps"] <= 1.0
    history = context.state["arr.dp_history"]["a"].numpy()
    assert rdp_epsilon(history, 1e-5) <= 1.0


# ------------------------------------------------------------------------------------ label-DP evaluation


def test_crafted_predictions_at_evaluate_recover_test_labels_at_the_dp_rate(tmp_path):
    """The server sends predictions all 0 but one row (its predicted class flipped) and differences the accuracy
    against a baseline evaluation: exact, one test label per evaluation (8 with crafted magnitudes). Released
    as eval_epsilon = 1-DP metrics, the guesses are right at about the DP rate, not always; and the owner's
    total_eval_epsilon (here 60) bounds the evaluations of all runs together."""
    context = node(tmp_path, "fact", LABEL, LABEL, edit=lambda s: s["privacy"].update(total_eval_epsilon=60.0))
    y, is_test = truth(context, LABEL)
    test_rows = np.flatnonzero(is_test)
    guesses, truths, evaluations = [], [], 0
    with pytest.raises(ValueError, match=r"of the 60 its owner allows over all runs \(privacy.total_eval_epsilon\)"):
        for run in range(20):
            c = fresh(context)
            n = train_ready(c, LABEL)
            base = None
            for k in range(5):
                update(c, n)
                H = np.full((len(test_rows), 1), -1.0)
                row = 4 * run + k  # a new test row each time
                if k:
                    H[row] = 1.0  # that test row predicted positive
                acc = unpack_reply(
                    call(deployed_app, c, "train", {"H": H, "rows": test_rows}, {"phase": "evaluate"}).content
                )[1]["accuracy"]
                evaluations += 1
                if base is None:
                    base = acc
                else:
                    guesses.append(acc > base)
                    truths.append(y[test_rows[row]] == 1)
    # one epsilon each; a run's keys round is refused once its plan (11 evaluations) no longer fits, so the
    # server stops at 50 (it crafts 5 per run): the 61st evaluation is never reached
    assert evaluations == 50
    right = np.mean(np.asarray(guesses) == np.asarray(truths))
    # eps/2 = 0.5 per accuracy release, Laplace(2/n) noise on each of the two: a guess is right with
    # probability 1 - exp(-1/2) 1.25 / 2 = 0.62 (the exact metric: 100%); 40 guesses, 0.85 is 3 sd above
    assert right < 0.85, right


def test_a_run_the_evaluation_budget_cannot_cover_is_refused_at_the_hello_and_charges_nothing(tmp_path):
    """The sweep's owner: eval_epsilon 1, total_eval_epsilon 5, 4 already spent. A 3-epoch run plans 4
    evaluations (3 epochs and the reference): refused at the hello, in one line naming the table and the
    numbers, before setup; its ledger is as it was. A run the rest covers is answered."""
    from tpflower.owner import load_owner_settings

    budget = {"eval_epsilon": 1.0, "total_eval_epsilon": 5.0}
    run = f"{LABEL} epochs=3"
    context = node(tmp_path, "fact", LABEL, run, edit=lambda s: s["privacy"].update(budget))
    owner = load_owner_settings(context.node_config["client-config"], "fact")
    ledger = OwnerBudget(owner.state_dir, "fact", 0)
    for _ in range(4):
        ledger.charge_eval(1.0, 5.0, "test")
    before = sorted((p.name, p.read_bytes()) for p in ledger.dir.iterdir())
    with pytest.raises(ValueError) as refusal:
        call(deployed_app, context, "query", {}, {"phase": "hello"})
    line = str(refusal.value)
    assert line.startswith("table 'fact' refuses the run: shard 0: its label-DP evaluations have spent epsilon 4"), line
    assert "5 its owner allows" in line and "1 left" in line and "plans 4 evaluation(s)" in line and "\n" not in line
    assert "4 in all; what is left covers the reference alone, not one epoch's evaluation with it" in line, line
    assert sorted((p.name, p.read_bytes()) for p in ledger.dir.iterdir()) == before  # nothing charged
    assert hello(deployed_app, fresh(context, f"{LABEL} epochs=0 resume=true"))["table"] == "fact"  # 1 fits


def test_the_harness_scores_the_trained_model_exactly_beside_the_dp_release():
    """The evaluation noise is the server's view only: the harness (it holds every table) scores the same last
    test predictions exactly. With a huge eval_epsilon the release equals it; with the owner's default it is
    the release minus Laplace noise of scale m (hi - lo)^2 / n on the MSE (m: the most scored rows one test label
    touches, tpflower.label_dp.evaluation_metrics), never more than 30 scales."""

    base = ("algorithm=admm", "dataset=synthetic", "epochs=2", "privacy=label", "privacy.label_range=[-20,20]")
    huge = run_in_process(
        make_cfg(*base, "+privacy.eval_epsilon=1e12", "+privacy.total_eval_epsilon=1e14"), None, log=lambda _: None
    )
    released = huge.strategy.results.history[-1].test_metric
    assert huge.exact_test_metrics()["rmse"] == pytest.approx(released, rel=1e-6)
    honest = run_in_process(make_cfg(*base), None, log=lambda _: None)
    exact, released = honest.exact_test_metrics()["rmse"], honest.strategy.results.history[-1].test_metric
    split = honest.strategy.record.setup.evaluation_split.values()
    n = sum(len(pos) for _, pos in split)
    m = max(int(np.bincount(np.asarray(rows)).max()) for _, rows in split)  # a test label: its scored rows
    assert exact != released  # the release is noised
    assert abs(exact**2 - released**2) < 30 * m * 40.0**2 / n
    plain = run_in_process(make_cfg(*base[:3]), None, log=lambda _: None)  # no label DP: the server's own metric
    assert plain.exact_test_metrics()["rmse"] == plain.strategy.results.history[-1].test_metric


def test_an_in_process_run_under_label_dp_says_its_exact_test_metric():
    """The progress lines under label DP show the DP release, on labels clipped to the label range (a CPS wage
    clipped to [0, 3000] read test RMSE 331.6 where the model's is 390.0, below exact ridge's 389.6): the
    in-process harness adds one line with the exact metric; none without label DP."""
    base = ("algorithm=admm", "dataset=synthetic", "epochs=2")
    run = run_in_process(make_cfg(*base, "privacy=label", "privacy.label_range=[-1,1]"), None, log=lambda _: None)
    exact = run.exact_test_metrics()["rmse"]
    released = run.strategy.results.history[-1].test_metric
    assert abs(exact - released) > 0.05 * exact  # the narrow range's clipping: far from the model's own metric
    line = exact_metric_line(run)
    assert line is not None and "\n" not in line
    assert line.endswith(f"scores the final model exactly: test rmse={figure(exact)}"), line
    assert exact_metric_line(run_in_process(make_cfg(*base), None, log=lambda _: None)) is None


@pytest.mark.parametrize("with_run_dir", [True, False])
def test_a_simulation_the_evaluation_budget_cannot_cover_is_refused_at_the_hello(tmp_path, with_run_dir):
    """A simulated label owner checks its plan at the hello as a deployed one does (its ledger in
    RUN_DIR/node-state, or none): 3 epochs and the reference plan 4 evaluations, its owner allows 3, so the run
    is refused before setup in one line, and the ledger charged nothing (without the check it trained 3 epochs
    and stopped at the fourth evaluation)."""
    overrides = (*REGRESSION_LABEL.split(), "epochs=3", "runtime=inprocess", "+privacy.total_eval_epsilon=3")
    run_dir = tmp_path if with_run_dir else None
    logged: list[str] = []
    with pytest.raises(Exception) as refusal:
        run_in_process(make_cfg(*overrides), run_dir, log=logged.append)
    line = str(refusal.value)
    assert "table 'fact' refuses the run: shard 0: its label-DP evaluations have spent epsilon 0 of the 3" in line
    assert "plans 4 evaluation(s)" in line and "\n" not in line, line
    assert not any("epoch" in entry for entry in logged), logged  # nothing trained
    ledger = tmp_path / "node-state" / "budget" / "fact-0-ledger.json"
    assert not ledger.exists()  # nothing charged
    run_in_process(make_cfg(*overrides[:-2], "epochs=2", "+privacy.total_eval_epsilon=3"), run_dir, log=lambda _: None)
