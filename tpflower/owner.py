"""What a table owner decides on its own node: its data, the columns it exposes, its privacy floor, its secret.

The party that submits or serves a run is not trusted with an owner's data. In a deployment the SuperNode's
node config names the owner's settings file (``--node-config "table='ratings' client-config='/path/r.yaml'"``)::

    source: /data/ratings.csv        # the table's file (.csv/.parquet); or  loader: movielens  (a bundled table)
    where: "rating_year >= 2000"     # optional: the rows it serves (a SQL predicate; the run's must be the same)
    columns:                         # what this node exposes; the run's spec for the table must stay inside
      keys: [movieId, userId]
      numeric: [rating_year, rating_month]
      categorical: []
      label: rating                  # only on the label owner's node
      label_task: regression         # optional: the label's task as its owner states it (regression, binary,
                                     # multiclass; with label_classes: [no, yes], the classes in id order); a
                                     # run declaring another task or other classes is refused at the hello
    privacy:                         # the floor: the weakest privacy this node accepts (missing bounds: the
      name: label                    # defaults of conf/privacy/<name>.yaml)
      label_epsilon: 5.66            # largest label epsilon accepted (or label_lambda, the smallest lambda:
                                     # epsilon = 2 sqrt(2) / lambda; one level, set one of the two)
      total_epsilon: 10              # feature DP: all runs together (default 10 x epsilon; docs/settings.md)
      eval_epsilon: 1                # label DP: one released evaluation metric; total_eval_epsilon: all of them
    keys: blind                      # join keys blinded with this node's own scalar (state_dir/blind.key,
                                     # created on first use; no shared secret); default hmac: the secret below
    secret_file: /etc/tpflower/key   # the join-key secret (else $TPFLOWER_KEY_SECRET of the SuperNode)
    min_sketch_rows: 2048            # union preprocessing: fewest values a shard summarizes by order statistics
    min_group_rows: 20               # fewest of its rows any aggregate it releases covers (k-means centres and
                                     # costs, shard summaries, label-DP evaluation metrics; k bounded by it)
    shards: {parts: 2, seed: 0}      # union: the split of its file its nodes serve (each node: its shard of it);
                                     # none: the node serves its whole file. A run cannot re-split it
    state_dir: /var/lib/tpflower     # this node's checkpoints, for resuming a run, and its saved model parts
                                     # (default: state/<file name> next to this file)
    serve_predictions: true          # answer prediction requests for a model it trained (default true)
    max_prediction_rows: 100000      # most rows one prediction request may score on this node (default 100000)
    prediction_rows: /data/new.csv   # the query owner: the new rows it asks predictions for (docs/prediction.md)
    algorithms: [pcg, tp_join_admm]  # the algorithms it takes part in: as `algorithm=` names them (pcg: in
                                     # every scenario) or as results.json does (tp_join_admm: the join's
                                     # only); default: every one
    threads: 2                       # CPU threads its key blinding uses (default: the CPUs the node may run on)
    peers: {orders/0: 3b6a27bc...}   # keys: blind: the Ed25519 verify keys of the federation's other nodes
                                     # (table/shard: hex), exchanged out of band; it re-blinds only lists they
                                     # signed (tpflower.signing; simulations.deploy fills them in)
    exact_releases: {pcg: 2000}      # exact releases it answers per algorithm family over all runs (default:
                                     # tpflower.releases.DEFAULT_CAPS, 20 default runs; docs/threat-model.md);
                                     # total: N caps every family's together (default: none)

A run may ask for STRONGER privacy than the floor (it is then honoured), never weaker; a run that asks for
weaker privacy, another loader (or a file for a bundled table), another label, or columns the node does not
expose is refused by
:meth:`OwnerSettings.check_spec` / :meth:`OwnerSettings.check_privacy` before the client sends anything
(:class:`Refusal`, naming the table and the setting). In a simulation (one user plays every party) the same
object is built from the Hydra config (:func:`simulation_owner`), so both paths run the same client code.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from tpflower.datasets.files import resolve_path
from tpflower.fedprep import DEFAULT_MIN_SKETCH_ROWS
from tpflower.params import positive_finite
from tpflower.schema import TASKS, RelationalSpec, ShardSpec, SpecError, parse_shards

SECRET_ENV = "TPFLOWER_KEY_SECRET"
REDACTED = "<redacted>"
#: fewest of a node's rows one released aggregate covers (docs/settings.md: min_group_rows)
DEFAULT_MIN_GROUP_ROWS = 20
#: the ``exact_releases`` key of the owner's cap on every family's exact releases together (tpflower.releases;
#: none by default: each family's own cap bounds it alone)
TOTAL_RELEASES = "total"
PRIVACY_DIR = Path(__file__).resolve().parents[1] / "conf" / "privacy"
#: floor bounds: (field, direction) -- "max": the run's value may not exceed the floor's; "min": not below
_LABEL_BOUNDS = (("label_epsilon", "max"), ("label_lambda", "min"))
_FEATURE_BOUNDS = (("epsilon", "max"), ("delta", "max"))


def _as_text(classes: tuple[Any, ...] | None) -> tuple[str, ...] | None:
    """Classes compared as text (a YAML 1 and a column's "1" code the same rows: tpflower.schema.class_codes)."""
    return None if classes is None else tuple(map(str, classes))


def uses_label_dp(privacy: Mapping[str, Any]) -> bool:
    """As tpflower.privacy's, without importing torch (the hello query checks the floor in a fresh process)."""
    return str(privacy.get("name", "none")) in ("label", "label_dpsgd")


def uses_feature_dp(privacy: Mapping[str, Any]) -> bool:
    return str(privacy.get("name", "none")) in ("dpsgd", "label_dpsgd")


#: label DP's level when neither ``label_lambda`` nor ``label_epsilon`` is set (TablePuppet Sec. 4.3's lambda)
DEFAULT_LABEL_LAMBDA = 0.5
#: how far a ``label_lambda`` and a ``label_epsilon`` set together may disagree (relative): 5.66 for 5.657
LABEL_LEVEL_TOLERANCE = 1e-3


def label_levels(privacy: Mapping[str, Any], what: str = "privacy") -> tuple[float, float]:
    """``(label_lambda, label_epsilon)`` of a label-DP setting: one level under two names, epsilon = 2 sqrt(2) /
    lambda (TablePuppet Eq. 25; docs/algorithms.md, Label DP). Either may be set (the other follows), neither
    (lambda 0.5, epsilon 5.66), or both if they agree; else ValueError naming both (``what``: whose setting).
    Classification draws at lambda, regression at epsilon, so neither name is ever ignored."""
    lam, eps = (privacy.get(k) for k in ("label_lambda", "label_epsilon"))
    lam = None if lam is None else positive_finite(f"{what}: privacy.label_lambda", lam)
    eps = None if eps is None else positive_finite(f"{what}: privacy.label_epsilon", eps)
    scale = 2.0 * math.sqrt(2.0)
    if lam is None and eps is None:
        lam = DEFAULT_LABEL_LAMBDA
    if lam is not None and eps is not None and abs(eps * lam / scale - 1.0) > LABEL_LEVEL_TOLERANCE:
        raise ValueError(
            f"{what}: privacy.label_lambda={lam:g} (epsilon 2 sqrt(2) / lambda = {scale / lam:.4g}) and "
            f"privacy.label_epsilon={eps:g} disagree; they name one label-DP level: set only one of them"
        )
    return (scale / eps if lam is None else lam), (scale / lam if eps is None else eps)


class Refusal(SpecError):
    """A table owner's node refuses what the run asks of it (raised before the client sends anything)."""


@dataclass(frozen=True)
class Exposed:
    """The columns a node exposes: join keys, features and (label owner) the label."""

    keys: tuple[str, ...] = ()
    numeric: tuple[str, ...] = ()
    categorical: tuple[str, ...] = ()
    label: str | None = None
    # the label's task and classes as its owner states them (None: not stated, the run's word is taken; the
    # label-DP draw is then pinned to the first run's task, tpflower.privacy.budget.OwnerBudget.stored_labels)
    label_task: str | None = None
    label_classes: tuple[Any, ...] | None = None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], where: str) -> Exposed:
        known = ("keys", "numeric", "categorical", "label", "label_task", "label_classes")
        unknown = set(raw) - set(known)
        if unknown:
            raise SpecError(f"{where}: unknown keys {sorted(unknown)} under columns ({', '.join(known)})")
        label = None if raw.get("label") is None else str(raw["label"])
        task = None if raw.get("label_task") is None else str(raw["label_task"])
        classes = raw.get("label_classes")
        if task is not None and (label is None or task not in TASKS):
            raise SpecError(
                f"{where}: columns.label_task must be one of {list(TASKS)}, beside columns.label, got {task!r}"
            )
        if classes is not None:
            distinct = isinstance(classes, list) and len(set(map(str, classes))) == len(classes) >= 2  # as schema's
            if task not in ("binary", "multiclass") or not distinct:
                raise SpecError(
                    f"{where}: columns.label_classes must be a list of two or more distinct classes, beside "
                    "columns.label_task binary or multiclass"
                )
            if task == "binary" and len(classes) != 2:
                raise SpecError(f"{where}: columns.label_classes of a binary label are [negative, positive]")
        return cls(
            *(tuple(str(c) for c in raw.get(k) or ()) for k in ("keys", "numeric", "categorical")),
            label=label,
            label_task=task,
            label_classes=None if classes is None else tuple(classes),
        )

    @property
    def all(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.keys + self.numeric + self.categorical + ((self.label,) if self.label else ())))


@dataclass(frozen=True)
class OwnerSettings:
    """One node's own settings (module docstring); ``secret`` never leaves the node."""

    table: str
    exposed: Exposed
    privacy: Mapping[str, Any]  # the floor, with every bound filled in
    secret: bytes = field(repr=False)
    source: str | None = None  # an absolute file path, or None: the bundled loader ``loader``
    loader: str | None = None
    min_sketch_rows: int = DEFAULT_MIN_SKETCH_ROWS
    origin: str = "simulation"  # where the settings come from (shown in refusals)
    state_dir: str | None = None  # node-local checkpoints of this node's state (None: none kept, no resume)
    where: str | None = None  # the rows it serves (a SQL predicate, tpflower.sql); None: all of them
    # outputs per row one reply may carry (the width d_c of its predictions); None: no bound (a simulation,
    # whose user owns every table). A deployed node's default is 1, the width of regression and binary labels:
    # more outputs per row than the model's own would let one reply spell out the row (h = X theta, d_c >= d_i)
    max_outputs: int | None = None
    keys: str = "hmac"  # how the node maps its join keys: hmac (the shared secret) or blind (its own scalar)
    # fewest of its rows any aggregate it releases covers: a k-means centre or cost, a shard summary, an
    # evaluation metric under label DP; k <= rows in the join / min_group_rows
    min_group_rows: int = DEFAULT_MIN_GROUP_ROWS
    shards: ShardSpec | None = None  # deployed: the split of its file its nodes serve (None: the whole file)
    serve_predictions: bool = True  # answers prediction requests for a model it trained and still holds
    # rows one prediction request may score on this node; None: no bound (a simulation, whose user owns every table)
    max_prediction_rows: int | None = None
    prediction_rows: str | None = None  # the query owner's file of new rows to predict (it alone reads it)
    # what the node's lines call those rows; None: "rows file PATH" (a simulation's DataFrame: "the rows")
    prediction_rows_name: str | None = None
    # the algorithms it takes part in, as `algorithm=` names them (every scenario's) or as results.json does
    # (that one alone); None: every installed one
    algorithms: tuple[str, ...] | None = None
    threads: int | None = None  # CPU threads of its key blinding (tpflower.blind); None: the CPUs it may run on
    # exact releases it answers per algorithm family over all runs (tpflower.releases); None: the defaults
    exact_releases: Mapping[str, int] | None = None
    # keys=blind: the verify keys of the nodes whose lists it re-blinds ("table/shard" -> hex); None: no peer
    # (a deployed node then re-blinds nothing; a simulation, whose user plays every owner, checks no signature)
    peers: Mapping[str, str] | None = None

    @property
    def deployed(self) -> bool:
        return self.origin != "simulation"

    def refuse(self, what: str) -> Refusal:
        # a deployed node's refusal travels to the server: it names the setting, never its file's path
        settings = "its owner's settings file" if self.deployed else self.origin
        return Refusal(f"table {self.table!r} refuses the run: {what} (settings: {settings})")

    # -------------------------------------------------------------------------------------------- checks

    def check_spec(self, spec: RelationalSpec, dataset: Mapping[str, Any], base_dir: str | Path | None) -> None:
        """The run's dataset for this table must stay inside what the node serves and exposes. A node with a
        ``source`` serves that file whatever ``source`` the run names for the table (or none), never another;
        a node with a ``loader`` serves the bundled table and refuses a run naming a file or another loader."""
        t = spec.table(self.table)
        if self.source is not None:  # the node serves its own file, whatever the run names (docs/deployment.md)
            asked_loader = (dataset.get("loader") or {}).get("name")
            if t.source is None and asked_loader is not None:
                raise self.refuse(
                    f"the run asks for the bundled table of loader {asked_loader!r}; this node serves its own file"
                )
            if t.source is not None and str(resolve_path(t.source, base_dir).resolve()) != self.source:
                logging.getLogger("tpflower").info(
                    "table %r: the run names source %r for it; serving its own file %s (source in its settings)",
                    self.table,
                    t.source,
                    self.source,
                )
        elif t.source is not None:  # a bundled table: no run may make the node read a file
            raise self.refuse(
                f"the run names a source file for it; this node serves the bundled table of loader {self.loader!r}"
            )
        else:
            asked_loader = (dataset.get("loader") or {}).get("name")
            if self.loader is None or asked_loader != self.loader:
                raise self.refuse(
                    f"the run asks for the bundled table of loader {asked_loader!r}; this node serves "
                    f"{'its own file' if self.source else 'loader ' + repr(self.loader)}"
                )
            if "path" in (dataset.get("loader") or {}):
                raise self.refuse("the run names a loader path; this node's bundled table has none")
        if t.where != self.where:
            raise self.refuse(
                f"the run filters its rows with where {t.where!r}; this node serves "
                f"{'all its rows' if self.where is None else 'the rows where its own predicate holds'}"
            )
        e = self.exposed
        for kind, asked_cols, allowed in (
            ("join key", spec.key_columns(self.table), e.keys),
            ("numeric feature", t.numeric + tuple(c for c, _ in t.binned), e.numeric),
            ("categorical feature", t.categorical, e.categorical),
        ):
            extra = [c for c in asked_cols if c not in allowed]
            if extra:
                raise self.refuse(
                    f"the run asks for {kind} column(s) {extra}, which this node does not expose "
                    f"(it exposes {list(allowed)})"
                )
        if spec.label.table == self.table and spec.label.column != e.label:
            raise self.refuse(
                f"the run asks for label column {spec.label.column!r}; this node exposes "
                f"{'no label' if e.label is None else 'label ' + repr(e.label)}"
            )
        if spec.label.table == self.table and e.label_task is not None:
            if spec.label.task != e.label_task:
                raise self.refuse(
                    f"the run declares its label {spec.label.task}; its owner states it is {e.label_task} (label.task)"
                )
            # the class list is the owner's word too (a run's own list, padded or reordered, is another task):
            # stated, the run's must be it; not stated, the run may state none (the column's values decide)
            if _as_text(spec.label.classes) != _as_text(e.label_classes):
                raise self.refuse(
                    "the run's label.classes are not the classes its owner states for its label "
                    + (
                        "(the owner states none: leave label.classes out)"
                        if e.label_classes is None
                        else "(the owner tells them out of band)"
                    )
                )

    def check_shards(self, spec: RelationalSpec, scenario: str) -> None:
        """Union shards (scenario ucq): ``shards.by`` must be a column the node exposes (its values decide the
        rows of each shard), and a deployed node serves its owner's split of its file (``shards``; none: the
        whole file): a run cannot re-split it. The refusal names no value of the column."""
        t = spec.table(self.table)
        if scenario != "ucq" or (t.shards is None and not self.deployed):
            return
        if t.shards is not None and t.shards.by is not None and t.shards.by not in self.exposed.all:
            fix = (
                f"expose {t.shards.by!r} in this node's settings (exposed)"
                if self.deployed
                else f"declare {t.shards.by!r} a numeric or categorical column of table {self.table!r} (a shard "
                "column is a feature its owner exposes)"
            )
            raise self.refuse(
                f"the run splits it into shards by column {t.shards.by!r}, which this node does not expose; {fix}"
            )
        if self.deployed and t.shards != self.shards:
            raise self.refuse(
                f"the run splits it into shards ({_shard_words(t.shards)}); this node serves "
                f"{'its whole file' if self.shards is None else 'its owner split of its file'} "
                "(shards in its settings): a run cannot re-split a deployed table"
            )

    def check_algorithm(self, name: str, selector: str, scenario: str) -> None:
        """The run's algorithm (results.json's ``name``, selected by ``algorithm=selector`` in ``scenario``)
        must be one its owner allows (``algorithms``, by either name; none named: every one)."""
        if self.algorithms is not None and not {name, selector} & set(self.algorithms):
            raise self.refuse(
                f"algorithm={selector} scenario={scenario} ({name}) is not among the algorithms its owner allows "
                "(algorithms)"
            )

    def algorithms_problem(self, known: Mapping[str, str]) -> str | None:
        """None if every name of ``algorithms`` is an installed algorithm's (``known``: results.json's names
        and ``algorithm=`` selectors, each to what it allows), else one line naming the unknown ones."""
        unknown = [a for a in self.algorithms or () if a not in known]
        if not unknown:
            return None
        return (
            f"table {self.table!r}: algorithms names {unknown}, which no installed algorithm is called; the names "
            f"are {sorted(set(known.values()))} (every scenario's) or {sorted(set(known) - set(known.values()))}"
        )

    def releases_problem(self, families: set[str]) -> str | None:
        """None if every family ``exact_releases`` caps is an installed algorithm's (``families``), else one line
        naming the unknown ones: a cap under a name no family has would bound nothing while the owner believes
        it does (the family's default cap applies)."""
        unknown = sorted(set(self.exact_releases or ()) - families - {TOTAL_RELEASES})
        if not unknown:
            return None
        return (
            f"table {self.table!r}: exact_releases names {unknown}, which no installed algorithm family is called; "
            f"the families are {sorted(families)}"
        )

    def check_privacy(self, run: Mapping[str, Any], label_owner: bool) -> None:
        """The run's privacy must be at least the floor: label DP (label owner only) and feature DP."""
        floor, name = self.privacy, str(run.get("name", "none"))
        parts = [("label DP", uses_label_dp, _LABEL_BOUNDS)] if label_owner else []
        parts.append(("feature DP", uses_feature_dp, _FEATURE_BOUNDS))
        for what, uses, bounds in parts:
            if not uses(floor):
                continue
            if not uses(run):
                raise self.refuse(
                    f"privacy={name} is weaker than this node's floor privacy={floor['name']} ({what} required)"
                )
            if what == "label DP":  # the run's level under both names (a run may set either, or neither)
                try:
                    run = {**run, **dict(zip(("label_lambda", "label_epsilon"), label_levels(run, "the run")))}
                except ValueError as exc:
                    raise self.refuse(str(exc)) from None
            for key, direction in bounds:
                if floor.get(key) is None:
                    continue
                value = run.get(key)
                bad = value is None or (
                    float(value) > float(floor[key]) if direction == "max" else float(value) < float(floor[key])
                )
                if bad:
                    sign = "<=" if direction == "max" else ">="
                    raise self.refuse(
                        f"privacy.{key}={value} is weaker than this node's floor ({key} {sign} {floor[key]})"
                    )
        if (
            uses_feature_dp(floor)
            and floor.get("sample_rate", "worst_row") == "worst_row"
            and str(run.get("sample_rate", "worst_row")) != "worst_row"
        ):
            raise self.refuse(
                f"privacy.sample_rate={run.get('sample_rate')} understates duplicated rows; this node's "
                "floor accounts the worst row (sample_rate=worst_row)"
            )


def _shard_words(shards: ShardSpec | None) -> str:
    """A run's shards setting in words (the run's own, never the node's values)."""
    if shards is None:
        return "none"
    return f"by {shards.by!r}" if shards.by is not None else f"parts {shards.parts}, seed={shards.seed}"


# ------------------------------------------------------------------------------------------------ building


def privacy_floor(raw: Mapping[str, Any] | None, where: str) -> dict[str, Any]:
    """A floor with every bound: missing ones from conf/privacy/<name>.yaml (the shipped defaults)."""
    raw = dict(raw or {"name": "none"})
    name = str(raw.get("name", "none"))
    if not (PRIVACY_DIR / f"{name}.yaml").is_file():
        known = sorted(p.stem for p in PRIVACY_DIR.glob("*.yaml"))
        raise SpecError(f"{where}: privacy.name must be one of {known}, got {name!r}")
    # a misspelt bound (label_epsilion) would leave the shipped default as the floor without a word
    known_keys = {"name", *BUDGET_KEYS, *_privacy_keys()}
    if unknown := set(raw) - known_keys:
        raise SpecError(f"{where}: unknown keys {sorted(unknown)} under privacy ({', '.join(sorted(known_keys))})")
    for key in (*BUDGET_KEYS, *(k for k, _ in (*_LABEL_BOUNDS, *_FEATURE_BOUNDS))):
        value = raw.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf")
        ):
            raise SpecError(f"{where}: privacy.{key} must be a positive number, got {value!r}")
    floor = {**_privacy_defaults(name), **raw}
    if uses_label_dp(floor):  # both names filled in: the bounds a run is held to and the draw's level
        try:
            floor["label_lambda"], floor["label_epsilon"] = label_levels(floor, where)
        except ValueError as exc:
            raise SpecError(str(exc)) from None
    return floor


#: the owner's budget over all runs (tpflower.privacy.budget; defaults in docs/settings.md): feature DP's
#: total epsilon, one label-DP evaluation's epsilon and the total of all evaluations
BUDGET_KEYS = ("total_epsilon", "eval_epsilon", "total_eval_epsilon")


@cache
def _privacy_keys() -> frozenset[str]:
    """Every setting of conf/privacy/*.yaml (a floor may state any of them)."""
    return frozenset(k for p in PRIVACY_DIR.glob("*.yaml") for k in yaml.safe_load(p.read_text()) or {})


@cache
def _privacy_defaults(name: str) -> dict[str, Any]:
    """conf/privacy/<name>.yaml without its interpolations, read once per process."""
    text = (PRIVACY_DIR / f"{name}.yaml").read_text()
    return {k: v for k, v in (yaml.safe_load(text) or {}).items() if not (isinstance(v, str) and "${" in v)}


def node_secret(secret_file: str | Path | None, table: str, where: str) -> bytes:
    """The join-key secret of a deployed node: its ``secret_file``, else $TPFLOWER_KEY_SECRET; no default."""
    if secret_file is not None:
        try:
            value = Path(secret_file).expanduser().read_text().strip()
        except OSError as exc:
            raise SpecError(
                f"table {table!r}: cannot read secret_file {str(secret_file)!r} ({where}): {exc.strerror}"
            ) from None
    else:
        value = os.environ.get(SECRET_ENV, "")
    if not value:
        raise SpecError(
            f"table {table!r}: no join-key secret. Set secret_file in {where} or {SECRET_ENV} in the SuperNode's "
            "environment, the same value on every table's node and unknown to the server, e.g. "
            "python -c 'import secrets; print(secrets.token_hex(32))' > key && chmod 600 key"
        )
    return value.encode()


#: a deployed node's bound on the outputs per row of a reply when its settings name none
DEFAULT_MAX_OUTPUTS = 1
DEFAULT_MAX_PREDICTION_ROWS = 100_000  # a deployed node's bound on the rows of one prediction request


def _min_group_rows(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(f"{where}: min_group_rows must be a whole number >= 1, got {value!r}")
    return value


def _max_outputs(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(f"{where}: max_outputs must be a whole number >= 1, got {value!r}")
    return value


def _algorithms(value: Any, where: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SpecError(f"{where}: algorithms must be a list of algorithm names (e.g. [pcg, admm]), got {value!r}")
    return tuple(value)


def _release_caps(value: Any, where: str) -> dict[str, int] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0 for k, v in value.items()
    ):
        raise SpecError(f"{where}: exact_releases must map algorithm families to whole numbers >= 0, got {value!r}")
    return dict(value)


def _peers(value: Any, where: str) -> dict[str, str] | None:
    if value is None:
        return None
    ok = isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v) for k, v in value.items()
    )
    if not ok:
        raise SpecError(f"{where}: peers must map node names (table/shard) to Ed25519 verify keys (64 hex digits)")
    return dict(value)


def _flag(value: Any, name: str, where: str) -> bool:
    if not isinstance(value, bool):
        raise SpecError(f"{where}: {name} must be true or false, got {value!r}")
    return value


def _whole(value: Any, name: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(f"{where}: {name} must be a whole number >= 1, got {value!r}")
    return value


class OwnerSettingsError(SpecError):
    """A problem in an owner's settings file or secret. ``str()`` is the line that may reach the server (the
    table and the problem; no path of the owner's machine); ``local`` the same line with its paths, which the
    node writes to its own log."""

    def __init__(self, line: str, local: str):
        super().__init__(line)
        self.local = local


#: an absolute path in an error line (what a line bound for the server must not carry)
_ABSOLUTE_PATH = re.compile(r"(?<![\w.~])/[^\s'\",;()\[\]]+")


def without_paths(line: str) -> str:
    """``line`` with every absolute path as ``<a path>`` (a deployed node's line bound for the server)."""
    return _ABSOLUTE_PATH.sub("<a path>", line)


def server_line(local: str, settings_path: Path, table: str) -> str:
    """``local`` without the owner's paths: the settings file named as such, any other absolute path (its
    secret_file, a state_dir) as ``<a path>``; prefixed with the table when the line does not name it."""
    line = without_paths(local.replace(str(settings_path), "its owner's settings file"))
    return line if line.startswith("table ") else f"table {table!r}: {line}"


def load_owner_settings(path: str | Path, table: str) -> OwnerSettings:
    """A deployed node's settings file (module docstring); paths in it are relative to the file. A problem is
    one :class:`OwnerSettingsError`: the server-bound line names the table and the problem, the owner's log
    (logger ``tpflower``) the line with its paths."""
    resolved = Path(path).expanduser().resolve()
    try:
        return _read_owner_settings(resolved, table)
    except SpecError as exc:
        local = str(exc)
        logging.getLogger("tpflower").error("%s", local)
        raise OwnerSettingsError(server_line(local, resolved, table), local) from None


def read_owner_settings(path: str | Path, table: str) -> OwnerSettings:
    """:func:`load_owner_settings` for the owner's own terminal (the node service's check as it starts): a
    problem is a :class:`SpecError` whose line keeps its paths, and is not logged."""
    return _read_owner_settings(Path(path).expanduser().resolve(), table)


def _read_owner_settings(path: Path, table: str) -> OwnerSettings:
    where = str(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise SpecError(f"table {table!r}: cannot read client-config {where}: {exc.strerror}") from None
    except yaml.YAMLError as exc:  # a typo in the file's syntax: one line, not the parser's traceback
        raise SpecError(f"{where}: {yaml_problem(exc)}") from None
    if not isinstance(raw, dict):
        raise SpecError(f"{where}: a client settings file is a mapping (source, columns, privacy, secret_file)")
    unknown = set(raw) - {
        "table",
        "source",
        "loader",
        "columns",
        "privacy",
        "secret_file",
        "min_sketch_rows",
        "state_dir",
        "where",
        "max_outputs",
        "keys",
        "min_group_rows",
        "shards",
        "serve_predictions",
        "max_prediction_rows",
        "prediction_rows",
        "algorithms",
        "threads",
        "exact_releases",
        "peers",
    }
    if unknown:
        raise SpecError(f"{where}: unknown keys {sorted(unknown)}")
    if raw.get("table", table) != table:
        raise SpecError(f"{where} is the settings of table {raw['table']!r}, but the node config says table {table!r}")
    if (raw.get("source") is None) == (raw.get("loader") is None):
        raise SpecError(f"{where}: set exactly one of source (the table's file) or loader (a bundled table)")
    for key in ("privacy", "columns", "shards", "exact_releases"):
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            raise SpecError(f"{where}: {key} must be a mapping (key: value lines under it), got {raw[key]!r}")
    for key in ("source", "loader", "secret_file", "state_dir", "prediction_rows", "where", "keys", "table"):
        if raw.get(key) is not None and not isinstance(raw[key], str):
            raise SpecError(f"{where}: {key} must be text, got {raw[key]!r}")
    base = path.parent
    secret_file = raw.get("secret_file")
    keys = str(raw.get("keys", "hmac"))
    if keys not in KEY_MODES:
        raise SpecError(f"{where}: keys must be one of {list(KEY_MODES)}, got {keys!r}")
    # blind: no shared secret (the join-key scalar is the node's own, in state_dir); a secret_file is still read
    # when given (the shards of one table share it for federated preprocessing)
    needs_secret = bool(keys == "hmac" or secret_file is not None or os.environ.get(SECRET_ENV))
    return OwnerSettings(
        table=table,
        exposed=Exposed.from_dict(raw.get("columns") or {}, where),
        privacy=privacy_floor(raw.get("privacy"), where),
        secret=node_secret(None if secret_file is None else resolve_path(secret_file, base), table, where)
        if needs_secret
        else b"",
        source=None if raw.get("source") is None else str(resolve_path(raw["source"], base).resolve()),
        loader=None if raw.get("loader") is None else str(raw["loader"]),
        min_sketch_rows=_whole(raw.get("min_sketch_rows", DEFAULT_MIN_SKETCH_ROWS), "min_sketch_rows", where),
        where=None if raw.get("where") is None else str(raw["where"]),
        max_outputs=_max_outputs(raw.get("max_outputs", DEFAULT_MAX_OUTPUTS), where),
        min_group_rows=_min_group_rows(raw.get("min_group_rows", DEFAULT_MIN_GROUP_ROWS), where),
        shards=parse_shards(raw.get("shards"), f"{where}: shards"),
        serve_predictions=_flag(raw.get("serve_predictions", True), "serve_predictions", where),
        max_prediction_rows=_whole(
            raw.get("max_prediction_rows", DEFAULT_MAX_PREDICTION_ROWS), "max_prediction_rows", where
        ),
        prediction_rows=None
        if raw.get("prediction_rows") is None
        else str(resolve_path(raw["prediction_rows"], base).resolve()),
        algorithms=_algorithms(raw.get("algorithms"), where),
        threads=None if raw.get("threads") is None else _whole(raw["threads"], "threads", where),
        exact_releases=_release_caps(raw.get("exact_releases"), where),
        peers=_peers(raw.get("peers"), where),
        origin=where,
        # checkpoints for resuming a run: next to the settings file unless the owner says where
        state_dir=str(resolve_path(raw.get("state_dir") or f"state/{path.stem}", base).resolve()),
        keys=keys,
    )


KEY_MODES = ("hmac", "blind")


def yaml_problem(exc: yaml.YAMLError) -> str:
    """A settings file's YAML syntax error in a few words: where, and what the parser expected."""
    parts = [
        f"{text} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else text
        for text, mark in (
            (getattr(exc, "context", None), getattr(exc, "context_mark", None)),  # e.g. the [ left open
            (getattr(exc, "problem", None), getattr(exc, "problem_mark", None)),
        )
        if text
    ]
    return f"not valid YAML: {', '.join(parts) or exc}"


def mapping_keys(cfg: Mapping[str, Any]) -> str:
    """The run's ``mapping.keys`` (hmac or blind; default hmac), checked."""
    keys = str((cfg.get("mapping") or {}).get("keys") or "hmac")
    if keys not in KEY_MODES:
        raise SpecError(f"mapping.keys must be one of {list(KEY_MODES)}, got {keys!r}")
    return keys


def simulation_secret(cfg: Mapping[str, Any]) -> bytes:
    """Simulation (the user plays every party): ``mapping.secret`` (or $TPFLOWER_KEY_SECRET) if set, else a
    secret derived from the run seed, so runs stay reproducible; never a public constant."""
    secret = (cfg.get("mapping") or {}).get("secret")
    if secret:
        return str(secret).encode()
    try:
        seed = int(cfg["seed"])
    except (TypeError, ValueError):
        raise SpecError(f"seed must be a number, got {cfg['seed']!r}") from None
    return hmac.digest(b"tpflower simulation join-key secret", f"seed={seed}".encode(), hashlib.sha256).hex().encode()


def simulation_owner(
    cfg: Mapping[str, Any], spec: RelationalSpec, table: str, base_dir: str | Path | None
) -> OwnerSettings:
    """The settings a simulated node would hold: the run's own dataset, columns and privacy (one config)."""
    t = spec.table(table)
    dataset = cfg["dataset"]
    return OwnerSettings(
        table=table,
        exposed=Exposed(
            spec.key_columns(table),
            t.numeric + tuple(c for c, _ in t.binned),
            t.categorical,
            spec.label.column if spec.label.table == table else None,
        ),
        privacy=privacy_floor(cfg.get("privacy"), "the run config"),
        secret=simulation_secret(cfg),
        source=None if t.source is None else str(resolve_path(t.source, base_dir).resolve()),
        loader=(dataset.get("loader") or {}).get("name"),
        min_sketch_rows=int(cfg.get("min_sketch_rows") or DEFAULT_MIN_SKETCH_ROWS),
        min_group_rows=_min_group_rows(cfg.get("min_group_rows") or DEFAULT_MIN_GROUP_ROWS, "the run config"),
        where=t.where,
        keys=mapping_keys(cfg),
    )


def redact(config: Any, secret: bytes | str | None = None) -> Any:
    """A copy of a (nested) config with ``mapping.secret`` and any string equal to ``secret`` redacted."""
    value = secret.decode() if isinstance(secret, bytes) else secret
    if isinstance(config, Mapping):
        out = {k: redact(v, secret) for k, v in config.items()}
        if isinstance(out.get("mapping"), dict) and out["mapping"].get("secret") is not None:
            out["mapping"] = {**out["mapping"], "secret": REDACTED}
        return out
    if isinstance(config, (list, tuple)):
        return [redact(v, secret) for v in config]
    if value and isinstance(config, str) and value in config:
        return config.replace(value, REDACTED)
    return config


def redact_run_dir(directory: str | Path, secret: bytes) -> None:
    """Replace the secret's value in every file under ``directory`` (Hydra's saved command line and config)."""
    value = secret.decode()
    for path in Path(directory).rglob("*") if Path(directory).is_dir() else ():
        if path.is_file():
            text = path.read_text(errors="replace")
            if value in text:
                path.write_text(text.replace(value, REDACTED))
