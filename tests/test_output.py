"""Output worth reading: the reference in every results.json, the WAN time model, the
default link, results.json's file mode."""

from __future__ import annotations

import json
import os
import re
import stat

import numpy as np
import pandas as pd
import pytest
from omegaconf import OmegaConf

from simulations.federated import run_in_process
from simulations.job import run_job
from strategies.centralized import constant_predictor_metric
from tests.conftest import make_cfg
from tpflower.comm import CommMeter, WanModel
from tpflower.relation import load_relation
from tpflower.results import ResultsError, RunResults, figure, read_results, write_results

NETWORK = {
    "server_region": "us-east",
    "default_link": {"latency_ms": 63, "bandwidth_mb_s": 60.0},
    "links": {
        "us-east": {
            "us-east": {"latency_ms": 0.5, "bandwidth_mb_s": 1000.0},
            "eu": {"latency_ms": 110, "bandwidth_mb_s": 33.8},
        }
    },
}


def test_wan_time_equals_a_hand_computation():
    wan = WanModel.from_config(NETWORK, {"a": "eu", "b": "us-east", "c": None})
    meter = CommMeter(wan)
    # round 1: a gets 1 MB and sends 0.5 MB over eu (110 ms, 33.8 MB/s): 0.110 + 1.5/33.8 = 0.154379 s;
    # b: 0.0005 + 2/1000 = 0.0025 s; c (no region: default link 63 ms, 60 MB/s): 0.063 + 3/60 = 0.113 s.
    # The slowest link decides: 0.154379 s.
    meter.record({"a": 1_000_000, "b": 2_000_000, "c": 3_000_000}, {"a": 500_000})
    assert meter.comm_time_s == pytest.approx(0.110 + 1.5 / 33.8, rel=1e-12)
    # round 2: only b and c: max(0.0005 + 0.001, 0.063 + 0.5 / 60) = 0.0713333 s
    meter.record({"b": 1_000_000}, {"c": 500_000})
    assert meter.comm_time_s == pytest.approx(0.110 + 1.5 / 33.8 + 0.063 + 0.5 / 60, rel=1e-12)
    assert meter.rounds == 2 and meter.bytes_down == 7_000_000 and meter.bytes_up == 1_000_000
    assert "1 client(s) without a region on the default link (63 ms, 60 MB/s)" in wan.note


def test_tables_without_region_use_the_default_link_and_say_so():
    wan = WanModel.from_config(NETWORK, {"a": None, "b": ""})
    assert wan.note == "comm time modelled on one default link (63 ms, 60 MB/s; no table sets a region)"
    assert wan.round_time({"a": 6_000_000}, {}) == pytest.approx(0.063 + 0.1)
    with pytest.raises(ValueError, match="region 'mars' has no link"):
        WanModel.from_config(NETWORK, {"a": "mars"})


@pytest.mark.parametrize("privacy", ["none", "label"])
def test_federated_results_carry_the_constant_predictor(privacy, tmp_path):
    lines: list[str] = []
    # label DP: every released metric is eval_epsilon-DP (tpflower.label_dp); a large one keeps the noise small here
    extra = (
        ["privacy.label_range=[-20,20]", "+privacy.eval_epsilon=1000", "+privacy.total_eval_epsilon=1e5"]
        if privacy == "label"
        else []
    )
    cfg = make_cfg("algorithm=admm", "dataset=synthetic", "epochs=1", f"privacy={privacy}", *extra)
    run_in_process(cfg, tmp_path, log=lines.append)
    record = read_results(tmp_path)
    rmse = record["reference"]["constant_rmse"]
    assert rmse > record["history"][-1]["test_metric"]
    if privacy == "none":  # the same number as the centralized baseline's
        rel = load_relation(cfg.dataset, b"any", verbose=False)
        assert rmse == pytest.approx(constant_predictor_metric(rel)["rmse"], rel=1e-6)
        assert f"constant predictor rmse={rmse:.4f}" in lines[0]
    else:  # the label owner scored it at the first evaluation
        assert any(line.startswith(f"reference: constant predictor rmse={rmse:.4f}") for line in lines)
    assert "comm time modelled on" in lines[0]
    assert not any(line.startswith("warning: the model ends worse") for line in lines)  # it learnt


def noise_shop(tmp_path, n_orders: int) -> dict:
    """orders (a label of noise) x customers (a 50-category town column): a join no model beats the constant on."""
    import numpy as np
    import pandas as pd

    from tests.test_checks import shop

    rng = np.random.default_rng(1)
    orders = pd.DataFrame(
        {"cust": rng.integers(0, 50, n_orders), "qty": rng.normal(size=n_orders), "spend": rng.normal(size=n_orders)}
    )
    customers = pd.DataFrame({"cust": np.arange(50), "age": rng.normal(size=50), "town": [f"t{i}" for i in range(50)]})
    dataset = shop(tmp_path, orders, customers)
    dataset["tables"]["customers"]["categorical"] = ["town"]
    return dataset


def test_a_model_worse_than_the_constant_predictor_ends_with_a_warning(tmp_path):
    """A label of noise over few rows and a wide one-hot block: the weakly regularized solution overfits, and
    the run says so in one line, with the setting that helps."""
    dataset = noise_shop(tmp_path, 120)
    lines: list[str] = []
    run_in_process(make_cfg("algorithm=pcg", dataset=dataset), tmp_path / "run", tmp_path, log=lines.append)
    record = read_results(tmp_path / "run")
    assert record["history"][-1]["test_metric"] > record["reference"]["constant_rmse"]
    (warning,) = [line for line in lines if line.startswith("warning: the model ends worse")]
    assert warning.endswith("; it overfits: a larger model.beta (e.g. 0.1)"), warning


def test_results_json_is_readable_like_the_other_files(tmp_path):
    old = os.umask(0o022)
    try:
        path = write_results(RunResults("a", "join", "d", "linear", "regression", "rmse", 1, {"t": 1}), tmp_path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    bad = RunResults("a", "join", "d", "linear", "regression", "rmse", 1, {"t": 1})
    bad.importance = {"t": {"share": object()}}  # JSON cannot hold it: the earlier file stays, no temporary file
    with pytest.raises(TypeError):
        write_results(bad, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]
    assert json.loads(path.read_text())["algorithm"] == "a"


def test_read_results_checks_the_schema(tmp_path):
    """results.json's one reader: the record write_results wrote, or an error naming the file and the field."""
    results = RunResults("a", "join", "d", "linear", "regression", "rmse", 1, {"t": 1})
    path = write_results(results, tmp_path)
    assert read_results(tmp_path) == read_results(path) == results.to_json()
    record = results.to_json()
    record["history"] = [{"epoch": 1, "test_metric": "high"}]
    path.write_text(json.dumps(record))
    with pytest.raises(ResultsError, match=r"results\.json: .*history\[0\]\.test_metric"):
        read_results(path)


def test_label_owner_scores_only_one_constant_reference():
    import numpy as np

    from tpflower.guard import ProtocolRefusal
    from tpflower.phases.setup import reference_score

    # the refusals come before the label owner touches a label (its released value: the test above)
    rows, client = np.array([0, 2, 3]), None
    assert reference_score(client, {}, rows, True, "t") == {}
    with pytest.raises(ProtocolRefusal, match="only a constant one"):  # a server probing labels row by row
        reference_score(client, {"H_ref": np.array([[0.0], [9.0], [0.0]])}, rows, True, "t")
    with pytest.raises(ProtocolRefusal, match="only at its first evaluation"):
        reference_score(client, {"H_ref": np.full((3, 1), 2.5)}, rows, False, "t")


def test_the_progress_line_shows_small_and_large_units_in_significant_digits():
    """A loss of 1e-4 (a label in small units) is not 0.0000; an RMSE in dollars is not 13 digits wide."""
    assert [figure(x) for x in (0.0, 0.9458, 17.3888, 0.00869, 1.379e7)] == [
        "0.0000",
        "0.9458",
        "17.3888",
        "0.00869",
        "1.379e+07",
    ]


def test_a_refusal_in_the_serverapp_is_one_line_and_an_unexpected_error_keeps_its_traceback():
    """Flower logs a ServerApp's exception with exc_info (flwr-serverapp, the simulation); tpflower's filter
    makes a deliberate refusal (RunError, SpecError, also as the cause of Flower's wrapper) one line, and
    leaves any other exception's traceback (tpflower.app.server_app.OneLineRefusals)."""
    import io
    import logging

    from strategies.transport import RunError
    from tpflower.app import server_app  # noqa: F401  installs the filter
    from tpflower.schema import SpecError

    flwr_log = logging.getLogger("flwr")
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    flwr_log.addHandler(handler)
    try:
        for exc in (RunError("table 'a' shard 0: refused\ntable 'b' shard 0: refused"), SpecError("bad spec")):
            try:
                try:
                    raise exc
                except Exception as inner:
                    raise RuntimeError("An error was encountered. Ending simulation.") from inner
            except Exception as ex:
                flwr_log.error("An exception occurred !! %s", ex)  # the engine thread's lines: dropped
                flwr_log.error("Traceback (most recent call last): ...")
                flwr_log.error("%s raised an exception", "ServerApp", exc_info=ex)
        try:
            raise KeyError("a bug")
        except KeyError as ex:
            flwr_log.error("%s raised an exception", "ServerApp", exc_info=ex)
    finally:
        flwr_log.removeHandler(handler)
    lines = out.getvalue().splitlines()
    assert lines[:2] == [
        "the run stopped: table 'a' shard 0: refused; table 'b' shard 0: refused",
        "the run stopped: bad spec",
    ], lines
    assert lines[2] == "ServerApp raised an exception" and "Traceback" in lines[3] and "KeyError: 'a bug'" in lines[-1]


@pytest.mark.parametrize(
    "overrides, said",
    [
        (["dataset=synthetic", "privacy=label"], "the label's public range [lo, hi] is not set"),
        (["algorithm=centralized"], "algorithm 'centralized' is not a federated algorithm"),
    ],
)
def test_a_setting_the_serverapp_refuses_is_a_one_line_refusal(tmp_path, overrides, said):
    """`flwr run` with a setting the strategy refuses before any message (ValueError building it): a SpecError,
    which Flower's log shows as one line (OneLineRefusals), not a traceback."""
    from tpflower.app.server_app import expected_refusal, run_of
    from tpflower.schema import SpecError

    with pytest.raises(SpecError, match=re.escape(said)) as refused:
        run_of(make_cfg(*overrides), tmp_path, None, log=lambda _: None)
    assert expected_refusal(refused.value) is refused.value


def test_flwr_runs_unknown_name_or_typod_key_in_its_overrides_is_a_one_line_refusal():
    """`flwr run . --run-config "overrides='algorithm=nosuch'"`: Hydra's composition error was the ServerApp's
    traceback in Flower's log."""
    from tpflower.app.server_app import expected_refusal, run_config_of
    from tpflower.schema import SpecError

    for overrides, said in [
        ("algorithm=nosuch dataset=synthetic", "Could not find 'algorithm/nosuch'"),
        ("algorithm=admm algoritm.rho=1", "algoritm.rho"),
    ]:
        with pytest.raises(SpecError, match=re.escape(said)) as refused:
            run_config_of({"overrides": overrides})
        assert expected_refusal(refused.value) is refused.value and "\n" not in str(refused.value)


def test_a_hint_below_the_constant_predictor_never_names_a_setting_the_run_has(tmp_path):
    """Boosted trees on a label of noise that already hold out a validation part and stop early: the warning
    does not tell them to set validation_fraction=0.1 to stop early (they did, and kept the trees of their best
    evaluation) but names the finer evaluation that lets them keep fewer trees; a linear model with a
    validation part is not told to set it either."""
    dataset = noise_shop(tmp_path, 400)
    for overrides, setting in [
        (["algorithm=gbdt", "algorithm.trees=40", "algorithm.min_child_rows=2"], "algorithm.eval_every"),
        (["algorithm=sgd", "model.beta=0", "epochs=20"], "model.beta"),
    ]:
        lines: list[str] = []
        cfg = make_cfg(*overrides, "validation_fraction=0.2", dataset=dataset)
        run_in_process(cfg, tmp_path / overrides[0], tmp_path, log=lines.append)
        (warning,) = [line for line in lines if line.startswith("warning: the model ends worse")]
        assert "validation_fraction" not in warning and setting in warning, warning


def test_below_the_constant_predictor_is_judged_by_auc_for_a_binary_label():
    """A rare positive class: a useful model (AUC 0.75) often has the majority's accuracy or a hair less, which is
    no reason to warn; an AUC below the constant's 0.5 is. RMSE and several classes' accuracy as they are."""
    from tpflower.reference import below_constant

    ref = {"constant_accuracy": 0.9502, "constant_auc": 0.5}
    assert below_constant("binary", {"accuracy": 0.9496, "auc": 0.7515}, ref) == ""
    assert below_constant("binary", {"accuracy": 0.655, "auc": 0.44}, ref) == (
        "test auc 0.4400 against the constant predictor's 0.5000"
    )
    assert below_constant("multiclass", {"accuracy": 0.542}, {"constant_accuracy": 0.690}).startswith("test accuracy")
    assert below_constant("regression", {"rmse": 2.9}, {"constant_rmse": 2.96}) == ""


def test_the_constant_predictor_is_shown_in_the_labels_units_however_small_or_large():
    """A label in tiny units (an order's total in millions of dollars, RMSE 6e-5) or huge ones (in micro-dollars):
    the summary line and the warning show the constant predictor's metric as the progress lines show theirs, not
    as 0.0001 against 0.0001."""
    from tpflower.reference import below_constant, reference_text

    assert reference_text("regression", {"constant_rmse": 5.38734e-05}) == "constant predictor rmse=5.3873e-05"
    assert reference_text("regression", {"constant_rmse": 53873388.37}) == "constant predictor rmse=5.3873e+07"
    assert reference_text("binary", {"constant_accuracy": 0.91992}) == "constant predictor accuracy=0.9199"
    assert below_constant("regression", {"rmse": 6.16616e-05}, {"constant_rmse": 5.38734e-05}) == (
        "test rmse 6.1662e-05 against the constant predictor's 5.3873e-05"
    )


def test_boosted_trees_whose_training_loss_ends_above_its_first_evaluation_are_said_to_diverge():
    """Each boosting round is a Newton step on the training loss, so a loss that ends above its first evaluation
    is leaves diverging (a rare class at lambda_l2 0: openintro's loans went 1.63, 1.89, 2.29, 8.72 and then
    1.4e6 at trees 50 to 250), not overfitting; a falling loss, one evaluation or a first loss that is not
    finite say nothing."""
    from tpflower.reference import loss_grew

    assert loss_grew([(50, 1.6255), (100, 1.8851), (200, 8.7165)]) == (
        "training loss grew from 1.6255 (trees 50) to 8.716 (trees 200)"
    )
    assert (
        loss_grew([(50, 1.6255), (250, float("inf"))]) == "training loss grew from 1.6255 (trees 50) to inf (trees 250)"
    )
    assert loss_grew([(10, 1.40), (20, 1.33), (30, 1.54), (40, 1.28)]) == ""  # a swing, ending below its start
    assert loss_grew([(10, 1.40)]) == "" and loss_grew([(10, float("nan")), (20, 1.0)]) == ""


def test_trees_of_one_leaf_say_why_and_are_not_said_to_diverge(tmp_path):
    """45 rows (carData's Duncan occupations, 38 fit): no split has min_child_rows=20 rows on each side, so every
    tree is one leaf and the loss stays the constant's to its last digits (0.6708198443868175, then ...177).
    That was 'warning: the training loss grew from 0.6708 (trees 10) to 0.6708 (trees 50): the trees' leaf
    values diverge ... algorithm.lambda_l2=1 bounds them' after 'importance ...: no split'; now no warning, and
    the importance line says why no tree split and the min_child_rows that lets one."""
    from tpflower.reference import loss_grew
    from tpflower.results import importance_line

    assert loss_grew([(10, 0.6708198443868175), (20, 0.6708198443868172), (50, 0.6708198443868177)]) == ""
    assert importance_line({}, 38, 20) == (
        "importance (share of the trees' split gain): no split, every tree is one leaf (the constant predictor); "
        "a split needs algorithm.min_child_rows=20 joined rows on each side and the trees were fit on 38: set "
        "algorithm.min_child_rows=9 or less"
    )
    assert importance_line({}, 400, 20).endswith("no split, every tree is one leaf (the constant predictor)")
    rng = np.random.default_rng(0)
    occ = pd.DataFrame({"kind": rng.choice(["a", "b"], 45), "income": rng.normal(size=45)})
    occ["high"] = (occ["income"] + rng.normal(size=45) > 0).astype(int)
    occ.to_csv(tmp_path / "occ.csv", index=False)
    pd.DataFrame({"kind": ["a", "b"], "rank": [1.0, 2.0]}).to_csv(tmp_path / "kinds.csv", index=False)
    dataset = {
        "name": "tiny",
        "tables": {
            "occ": {"source": "occ.csv", "numeric": ["income"]},
            "kinds": {"source": "kinds.csv", "numeric": ["rank"]},
        },
        "label": {"table": "occ", "column": "high", "task": "binary"},
        "joins": [{"left": "occ", "right": "kinds", "on": "kind"}],
    }
    lines: list[str] = []
    cfg = make_cfg("algorithm=gbdt", "algorithm.trees=30")
    cfg.dataset = OmegaConf.create(dataset)
    run_job(cfg, tmp_path / "run", base_dir=tmp_path, log=lines.append)
    text = "\n".join(lines)
    assert "leaf values diverge" not in text, text
    assert "set algorithm.min_child_rows=" in text, text


@pytest.mark.parametrize("algorithm", ["sgd", "gbdt"])
def test_a_long_stretch_of_round_trips_without_a_line_prints_where_the_run_is(tmp_path, monkeypatch, algorithm):
    """An epoch of many round trips (TP-Join-SGD under Flower's engine on a big join) prints a line every
    HEARTBEAT_S with the epoch in progress (boosted trees: their count so far), its round trips and bytes."""
    from strategies.base import TablePuppetStrategy

    monkeypatch.setattr(TablePuppetStrategy, "HEARTBEAT_S", 0.0)  # every round trip
    lines: list[str] = []
    extra = ["algorithm.trees=2", "algorithm.eval_every=2"] if algorithm == "gbdt" else ["epochs=1"]
    run_in_process(make_cfg(f"algorithm={algorithm}", "dataset=synthetic", *extra), tmp_path, log=lines.append)
    beats = [line for line in lines if "round trips so far (MB up/down=" in line]
    where = "trees 0 done" if algorithm == "gbdt" else "epoch 1 in progress"
    assert beats and beats[0].startswith(f"{where}: ") and beats[0].endswith("s since the last line"), beats[:2]
    rounds = [int(re.search(r": ([\d,]+) round trips so far", b)[1].replace(",", "")) for b in beats]  # type: ignore[index]
    assert rounds == sorted(rounds) and rounds[-1] > rounds[0]
    monkeypatch.setattr(TablePuppetStrategy, "HEARTBEAT_S", 3600.0)
    quiet: list[str] = []
    run_in_process(make_cfg(f"algorithm={algorithm}", "dataset=synthetic", *extra), tmp_path / "q", log=quiet.append)
    assert not [line for line in quiet if "round trips so far (MB up/down=" in line]


def test_an_sgd_training_loss_that_rises_by_a_quarter_over_an_earlier_epoch_is_named():
    """A step size past SGD's stable range shows as an epoch's training loss well above an earlier one's (the
    test shop's MLP at lr 0.2, batch 32: 4.21, 6.21, 1.95); the few per cent an epoch's mini-batch mean moves
    by sampling (txhousing's MLP: 78.66 after 76.88) says nothing; the largest rise is named."""
    from tpflower.reference import loss_rose

    assert (
        loss_rose([(1, 4.2117), (2, 6.2069), (3, 1.9458)])
        == "training loss rose from 4.212 (epoch 1) to 6.207 (epoch 2)"
    )
    assert loss_rose([(1, 1.0), (2, 0.8), (3, 1.01), (4, 0.7), (5, 1.2)]) == (
        "training loss rose from 0.7 (epoch 4) to 1.2 (epoch 5)"
    )
    assert (
        loss_rose([(1, 1.0), (2, 0.8), (3, float("inf"))]) == "training loss rose from 0.8 (epoch 2) to inf (epoch 3)"
    )
    assert loss_rose([(1, 78.66), (2, 76.88), (3, 78.66), (4, 75.0)]) == ""
    assert loss_rose([(1, 1.0)]) == "" and loss_rose([(1, float("nan")), (2, 1.0)]) == ""


def test_below_the_constant_predictor_under_label_dp_names_label_dp_not_model_beta(tmp_path, monkeypatch):
    """Label DP at epsilon 0.05 over synthetic's label range [-20, 20] randomizes the training labels far beyond
    the label's own spread (std 1.7; measured at 0.5: exact test RMSE 8.6 against 0.91 without): the warning
    said "it overfits: a larger model.beta", which cannot undo the noise; it names the label DP setting and the
    label range. (Both metrics compared are noised releases, so whether the model ends below the constant
    predictor is left to chance: the comparison is forced here, the hint is what is tested.)"""
    monkeypatch.setattr("strategies.base.below_constant", lambda *a: "test rmse 9 against the constant's 2")
    lines: list[str] = []
    cfg = make_cfg(
        "algorithm=admm",
        "dataset=synthetic",
        "privacy=label",
        "privacy.label_epsilon=0.05",
        "privacy.label_range=[-20,20]",
        "epochs=2",
    )
    run_in_process(cfg, tmp_path / "run", tmp_path, log=lines.append)
    (warning,) = [line for line in lines if line.startswith("warning: the model ends worse")]
    assert warning.endswith(
        "; the label DP noise (privacy.label_epsilon=0.05) outweighs what the labels teach: a larger "
        "privacy.label_epsilon, or a tighter label range (its noise grows with it)"
    ), warning


def test_trees_diverging_at_a_learning_rate_above_1_name_the_learning_rate_not_lambda_l2(tmp_path):
    """Squared error's leaves multiply the residuals by 1 - learning_rate at every tree, so at learning_rate 5
    the scores swing wider whatever lambda_l2 is (synthetic, 20 trees: test RMSE 1.4e12; 1.3e12 at lambda_l2 1,
    8.6e10 at 100). Both warnings said 'algorithm.lambda_l2=1 bounds them', also to a run that had it; they
    name the learning rate."""
    lines: list[str] = []
    cfg = make_cfg(
        "algorithm=gbdt",
        "dataset=synthetic",
        "algorithm.trees=20",
        "algorithm.learning_rate=5",
        "algorithm.lambda_l2=1",
    )
    run_in_process(cfg, tmp_path / "run", tmp_path, log=lines.append)
    (diverge,) = [line for line in lines if "leaf values diverge" in line]
    (below,) = [line for line in lines if line.startswith("warning: the model ends worse")]
    for line in (diverge, below):
        assert "algorithm.learning_rate=0.1" in line and "lambda_l2" not in line, line
    assert "algorithm.learning_rate=5 scales every leaf's Newton step" in diverge, diverge


def test_the_setting_named_for_diverging_trees_is_never_the_one_the_run_has():
    """At a learning_rate of at most 1 the leaves are bounded by lambda_l2: 1 where the run has less, ten times
    the run's where it has 1 or more (it was told 'algorithm.lambda_l2=1' whatever it had)."""
    from types import SimpleNamespace

    from strategies.base import LoJStrategy

    def fix(learning_rate: float, lambda_l2: float) -> str:
        run = SimpleNamespace(params=SimpleNamespace(learning_rate=learning_rate, lambda_l2=lambda_l2))
        return LoJStrategy.trees_divergence_fix.fget(run)

    assert fix(0.1, 0.0) == "algorithm.lambda_l2=1 bounds them"
    assert fix(0.1, 1.0) == "algorithm.lambda_l2=10 bounds them more tightly"
    assert fix(1.5, 0.0).startswith("algorithm.learning_rate=0.1")
