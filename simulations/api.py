"""tpflower's Python API (docs/python-api.md): ``tpflower.fit`` runs the job ``python -m simulations.run`` runs
for the same settings and returns a :class:`Model`; ``tpflower.load`` opens a run dir again.

The settings are the command line's Hydra overrides, spelled as keywords (``epochs=3``, ``model="mlp"``,
``model__hidden=[32, 16]`` for ``model.hidden=[32,16]``) or given as the command line's strings
(``overrides=["model.hidden=[32,16]"]``): both are composed by Hydra exactly as the command line is, so a fit
and a ``tpflower train`` of the same overrides write the same results.json. Progress lines go to a rich
console (a notebook cell or the terminal); a refused setting, bad data or a failed run raises TpflowerError
with the command line's message.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import pandas as pd
import yaml
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from rich.console import Console

from simulations.job import failure_message, run_job
from simulations.predict import predict_run
from simulations.run import CONF_DIR, choices, unknown_choice
from strategies.model_record import MODEL_FILE
from tpflower.checks import NA_ATTR
from tpflower.config import compose_config
from tpflower.config_errors import override_error
from tpflower.datasets.files import NA_TEXT
from tpflower.errors import TpflowerError, traceback_wanted
from tpflower.overrides import searchpath_override
from tpflower.results import RESULTS_FILE, ResultsError, read_results

SECONDARY_METRICS = ("auc",)  # test metrics an evaluation reports beside the primary one (tpflower.losses)
PLAIN = re.compile(r"[\w.:/@+-]*")  # an override value Hydra reads as it is written (no quoting needed)


def override_value(value: Any) -> str:
    """A Python value in Hydra's override grammar: null, true/false, numbers, quoted strings, [lists], {dicts}."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{override_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(override_value(v) for v in value) + "]"
    text = str(value)
    if PLAIN.fullmatch(text) and text and text.lower() not in ("null", "true", "false"):
        return text
    quote = "'" if "'" not in text else '"'
    return quote + text.replace("\\", "\\\\").replace(quote, "\\" + quote) + quote


def overrides_of(settings: Mapping[str, Any]) -> list[str]:
    """Keyword settings as Hydra overrides (``a__b=v`` -> ``a.b=v``, scikit-learn's nested-parameter spelling);
    a config group given as a dict, ``privacy={"name": "label", "label_epsilon": 2}``, is its choice and its
    settings (``privacy=label privacy.label_epsilon=2``; without ``name``: the settings of the default choice)."""
    out: list[str] = []
    for key, value in settings.items():
        key = key.replace("__", ".")
        if isinstance(value, Mapping) and (Path(CONF_DIR) / key).is_dir():
            out += [f"{key}={override_value(value['name'])}"] if "name" in value else []
            out += overrides_of({f"{key}.{k}": v for k, v in value.items() if k != "name"})
        else:
            out.append(f"{key}={override_value(value)}")
    return out


def console_log(verbose: bool) -> Callable[[str], None]:
    """The progress lines' printer: a rich console (rendered in a notebook cell, plain text when not a
    terminal), lines never wrapped nor coloured, so they read as the command line's."""
    if not verbose:
        return lambda _line: None
    console = Console(soft_wrap=True, highlight=False, markup=False, emoji=False)
    return lambda line: console.print(line)


def compose(
    dataset: str | Mapping[str, Any] | Path | None,
    sql: str | None,
    algorithm: str | None,
    runtime: str,
    overrides: Sequence[str],
    settings: Mapping[str, Any],
    config_dir: str | Path | None,
    base_dir: str | Path | None = None,
) -> DictConfig:
    """The run config the command line composes for the same choices (a dataset given as a spec or a YAML
    file replaces the dataset group, as a ``--config-dir`` file would); ``base_dir``: where the dataset's
    relative paths start, for a refused setting's message."""
    args: list[str] = []
    if config_dir is not None:
        args.append(searchpath_override(config_dir))
    spec: dict[str, Any] | None = None
    if isinstance(dataset, (str, Path)) and Path(dataset).suffix.lower() in DATA_FILES:
        raise TpflowerError(
            f"dataset={str(dataset)!r}: a table's data file, not a dataset: give a dataset's name, the path of its "
            f"spec's YAML file or the spec as a dict, whose tables name their files ({{'tables': {{'NAME': "
            f"{{'source': {str(dataset)!r}}}}}, ...}}: docs/datasets.md)"
        )
    if isinstance(dataset, Path) or (isinstance(dataset, str) and dataset.endswith((".yaml", ".yml"))):
        spec = spec_file(dataset)
    elif isinstance(dataset, Mapping):
        spec = plain_spec(dataset)
    elif dataset is not None:
        args.append(f"dataset={dataset}")
    if sql is not None:
        if spec is not None:
            spec["sql"] = sql
        else:
            args += [] if dataset is not None else ["dataset=sql"]
            args.append(f"++dataset.sql={override_value(sql)}")
    if algorithm is not None:
        args.append(f"algorithm={algorithm}")
    if isinstance(algorithm, (list, tuple)):
        raise TpflowerError(sweep_line("algorithm", [str(a) for a in algorithm]))
    problem = hydra_problem([*overrides, *overrides_of(settings)])
    if problem is not None:
        raise TpflowerError(problem)
    args += [f"runtime={runtime}", *overrides, *overrides_of(settings)]
    swept = sweep_in(args)
    if swept is not None:
        raise TpflowerError(sweep_line(*swept))
    wrong = unknown_choice(choices(args)[0], [str(config_dir)] if config_dir is not None else [])
    if wrong is not None:
        raise TpflowerError(wrong)
    try:
        return compose_config(*args, dataset=spec)
    except (HydraException, OmegaConfBaseException) as exc:
        raise TpflowerError(override_error(exc, args, base_dir, spec)) from None


def plain_spec(value: Any, key: str = "") -> Any:
    """A dataset spec given as a dict, in the plain values a config holds: a path (``Path``) as its text, numpy
    and pandas scalars as Python numbers, a tuple, numpy array, pandas Index or Series as a list (``label_range=
    [df.y.min(), df.y.max()]``, ``numeric=df.columns[2:5]``). A DataFrame anywhere but a table's ``source``
    (those :func:`frames_apart` takes out first), or any other object, is a one-line TpflowerError naming its key."""
    import numpy as np  # noqa: PLC0415  (pandas' own dependency)

    where = f"dataset {key}" if key else "dataset"
    if isinstance(value, Mapping):
        return {str(k): plain_spec(v, f"{key}.{k}" if key else str(k)) for k, v in value.items()}
    if isinstance(value, pd.DataFrame):  # (a table's source is taken apart before: frames_apart)
        raise TpflowerError(f"{where}: a pandas DataFrame; only a table's source may be one (tables.NAME.source)")
    if isinstance(value, (list, tuple, np.ndarray, pd.Index, pd.Series)):
        return [plain_spec(v, f"{key}[{k}]") for k, v in enumerate(list(value))]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    raise TpflowerError(
        f"{where}: a {type(value).__name__} value; a dataset spec holds text, numbers, booleans, lists and dicts "
        "(docs/datasets.md)"
    )


#: where fit writes the DataFrames given as table sources, in the run dir
TABLES_DIR = "tables"


def frames_apart(dataset: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, pd.DataFrame]]:
    """A dataset spec dict without its DataFrame sources (``tables.NAME.source``), each in its place the path of
    the Parquet file fit writes it to (``RUN_DIR/tables/NAME.parquet``, set once the run dir is known), and the
    DataFrames by table."""
    tables = dataset.get("tables")
    if not isinstance(tables, Mapping):
        return dict(dataset), {}
    frames = {
        str(t): v["source"]
        for t, v in tables.items()
        if isinstance(v, Mapping) and isinstance(v.get("source"), pd.DataFrame)
    }
    if not frames:
        return dict(dataset), {}
    out = dict(dataset)
    out["tables"] = {
        t: {**v, "source": f"{TABLES_DIR}/{t}.parquet"} if str(t) in frames else v for t, v in tables.items()
    }
    return out, frames


def write_tables(frames: Mapping[str, pd.DataFrame], run_dir: Path, cfg: DictConfig) -> None:
    """Each DataFrame source as RUN_DIR/tables/NAME.parquet, the file its owner's node reads (a simulation's
    user holds every table); a named index (``set_index('cust')``) is columns, as pandas writes it; a column
    of numbers and text as text, which the data checks then read as a CSV file's (:func:`write_rows`)."""
    folder = run_dir / TABLES_DIR
    folder.mkdir(parents=True, exist_ok=True)
    for name, frame in frames.items():
        named = [n for n in frame.index.names if n is not None and n not in frame.columns]
        path = folder / f"{name}.parquet"
        write_rows(frame.reset_index(level=named) if named else frame, path, f"dataset tables.{name}.source")
        cfg.dataset.tables[name].source = str(path)


def moved_sources(config: Any, old: Path, new: Path) -> Any:
    """A run's config with each table source under ``old`` (a fit's DataFrame written to its run dir) under
    ``new`` instead (the copy ``save`` made)."""
    config = json.loads(json.dumps(config))
    for table in ((config.get("dataset") or {}).get("tables") or {}).values():
        source = table.get("source") if isinstance(table, dict) else None
        if isinstance(source, str) and Path(source).is_relative_to(old):
            table["source"] = str(new / Path(source).relative_to(old))
    return config


def hydra_problem(overrides: Sequence[str]) -> str | None:
    """Why fit refuses a ``hydra.*`` override other than ``hydra.run.dir`` (``hydra.job.name``, ``hydra.verbose``,
    ``hydra.sweep.dir`` ...): they set up Hydra's own job (its logging, working directory, sweeps), which fit does
    not run, and Hydra's compose dropped them without a word; ``hydra.searchpath`` is ``config_dir=``. None when
    there is none."""
    for text in overrides:
        key = text.split("=", 1)[0].lstrip("+~")
        if (key == "hydra" or key.startswith("hydra.")) and key != "hydra.run.dir":
            return (
                f"{text}: fit runs no Hydra job, so of Hydra's settings it takes only hydra.run.dir (or run_dir=); "
                "a folder of dataset/NAME.yaml files is config_dir=; the command line (tpflower train) takes the others"
            )
    return None


def sweep_in(overrides: Sequence[str]) -> tuple[str, list[str]] | None:
    """The first override that is a Hydra sweep (``algorithm=admm,pcg``, ``epochs=range(1,4)``), or a list for a
    group's choice (``algorithm=[admm,pcg]``), as its key and values; None when there is none (an override
    Hydra cannot read is compose's to name)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser  # noqa: PLC0415

    parser = OverridesParser.create()
    for text in overrides:
        try:
            override = parser.parse_overrides([text])[0]
            if override.is_sweep_override():
                return override.key_or_group, [str(v) for v in override.sweep_string_iterator()]
            value = override.value()
        except Exception:  # grammar errors, interval sweeps: compose's line
            continue
        if isinstance(value, list) and (Path(CONF_DIR) / override.key_or_group).is_dir():
            return override.key_or_group, [str(v) for v in value]
    return None


def sweep_line(key: str, values: Sequence[str]) -> str:
    """Why fit refuses a sweep, and the two ways to run one."""
    joined = ",".join(values)
    return (
        f"{key}={joined} is a sweep (one run per value), and fit trains one model: call fit once per value "
        f"(for v in {list(values)!r}: tpflower.fit(..., {key.replace('.', '__')}=v)), or run the sweep: "
        f"tpflower train -m {key}={joined} ..."
    )


#: a table's file, which ``fit(dataset=...)`` would otherwise look up as a dataset's name
DATA_FILES = (".csv", ".parquet", ".pq", ".tsv", ".xlsx")


def spec_file(dataset: str | Path) -> dict[str, Any]:
    """The dataset spec in the YAML file ``dataset`` (``fit(dataset=PATH)``); a missing or unreadable file, or
    one that holds no mapping, is a one-line TpflowerError naming it."""
    path = Path(dataset).expanduser()
    if not path.is_file():
        raise TpflowerError(
            f"dataset={str(dataset)!r}: no such file ({path.resolve()}); give the path of a dataset spec's YAML "
            "file (docs/datasets.md), or a dataset's name"
        )
    try:
        spec = OmegaConf.to_container(OmegaConf.load(path))
    except (OSError, yaml.YAMLError, OmegaConfBaseException) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TpflowerError(f"dataset file {path}: cannot be read as YAML: {first}") from None
    if not isinstance(spec, dict):
        raise TpflowerError(
            f"dataset file {path}: holds no mapping of settings (name, tables, label, joins: docs/datasets.md)"
        )
    return {str(k): v for k, v in spec.items()}


def run_dir_of(run_dir: str | Path | None, overrides: Sequence[str]) -> str | Path | None:
    """The run dir: ``run_dir``, else a ``hydra.run.dir=DIR`` override as the command line takes it (Hydra's
    compose drops it: the run went to outputs/ instead); both, naming two folders, is one line."""
    given = [o.split("=", 1)[1].strip("'\"") for o in overrides if o.split("=", 1)[0].lstrip("+") == "hydra.run.dir"]
    if not given:
        return run_dir
    if run_dir is not None and Path(run_dir).expanduser().resolve() != Path(given[-1]).expanduser().resolve():
        raise TpflowerError(f"run_dir={str(run_dir)!r} and hydra.run.dir={given[-1]} name two folders; give one")
    return run_dir if run_dir is not None else given[-1]


def default_run_dir(cfg: DictConfig, base_dir: Path) -> Path:
    """Where the command line's run would go (conf/config.yaml's hydra.run.dir): outputs/DATE/TIME-ALGORITHM-
    DATASET under ``base_dir``; a suffix -2, -3 ... when a run started in the same second holds it already."""
    now = datetime.now()
    name = f"{now:%H-%M-%S}-{cfg.algorithm.name}-{cfg.dataset.name}"
    path = base_dir / "outputs" / f"{now:%Y-%m-%d}" / name
    k = 1
    while path.exists():
        k += 1
        path = path.with_name(f"{name}-{k}")
    return path


def fit(
    dataset: str | Mapping[str, Any] | Path | None = None,
    *,
    sql: str | None = None,
    algorithm: str | None = None,
    runtime: str = "flower",
    run_dir: str | Path | None = None,
    overrides: Iterable[str] = (),
    config_dir: str | Path | None = None,
    base_dir: str | Path | None = None,
    verbose: bool = True,
    **settings: Any,
) -> Model:
    """Train one model over the join (or union) and return it; results.json, model.json and the owners' saved
    parts are in its run dir.

    ``dataset``: a bundled or ``config_dir`` dataset name (``dataset=NAME``), a dataset spec as a dict, or the
    path of a spec's YAML file (docs/datasets.md); default conf/'s (movielens). ``sql``: the training set as a
    query over the dataset's tables (with no ``dataset``: the bundled MovieLens tables, ``dataset=sql``).
    ``algorithm``: ``algorithm=`` (default auto). ``runtime``: ``flower`` (Flower's simulation engine, as
    ``make run``) or ``inprocess`` (the same strategy and ClientApp called directly: the fast path when you hold
    every table). ``run_dir``: where the run writes (default outputs/DATE/TIME-ALGORITHM-DATASET, as the command
    line). ``overrides``: Hydra override strings as typed on the command line; ``settings``: the same as
    keywords (``epochs=3``, ``model="mlp"``, ``algorithm__rho=2``). ``base_dir``: where relative data paths
    start (default: the working directory). Raises TpflowerError (the command line's message)."""
    base = Path(base_dir).expanduser().resolve() if base_dir is not None else Path.cwd()
    run_dir = run_dir_of(run_dir, [*overrides, *overrides_of(settings)])
    frames: dict[str, pd.DataFrame] = {}
    if isinstance(dataset, Mapping):  # DataFrame sources: written to the run dir once it is known
        dataset, frames = frames_apart(dataset)
    cfg = compose(dataset, sql, algorithm, runtime, list(overrides), settings, config_dir, base)
    path = Path(run_dir).expanduser().resolve() if run_dir is not None else default_run_dir(cfg, base)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TpflowerError(f"run_dir {path}: {exc.strerror} ({exc.filename})") from None
    write_tables(frames, path, cfg)
    log = console_log(verbose)
    engine = "Flower's simulation engine" if runtime == "flower" else f"runtime={runtime}"
    log(
        f"tpflower.fit: algorithm={cfg.algorithm.name} dataset={cfg.dataset.name} on {engine}; results: {path}/results.json"
    )
    try:
        run_job(cfg, path, base_dir=str(base), log=log)
    except Exception as exc:
        if traceback_wanted():
            raise
        raise TpflowerError(failure_message(exc, path), path / "error.log") from None
    return Model(path, verbose, base)


def write_rows(rows: pd.DataFrame, path: Path, subject: str = "the rows") -> None:
    """New rows given as a DataFrame, as the Parquet file the query owner's node reads. An object column Parquet
    cannot hold as one type (numbers beside text, as ``df.loc[i, 'age'] = '99plus'`` makes an int column) is
    written as text, each value as a CSV file holds it (missing values stay missing): the node then reads and
    checks it as it does a CSV rows file's column (a numeric feature's text: one line naming the column and
    row). What still cannot be written (column names that are not strings, say) is a one-line TpflowerError."""
    import pyarrow as pa  # noqa: PLC0415  pandas' Parquet engine: only for a DataFrame's rows

    if rows.columns.has_duplicates:
        twice = sorted({str(c) for c in rows.columns[rows.columns.duplicated()]})
        who = "the rows name" if subject == "the rows" else f"{subject}: the DataFrame names"
        raise TpflowerError(f"{who} column(s) {twice} twice; give each column once")
    out = rows.copy(deep=False)
    noted = {}
    for column in [c for c in rows.columns if rows[c].dtype == object]:  # (pandas 3's text columns: str, written)
        try:
            pa.array(rows[column], from_pandas=True)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            text = rows[column].astype(str).where(rows[column].notna(), None)
            is_na = text.isin(NA_TEXT).to_numpy()  # "n/a" beside numbers: a missing number, as a CSV file reads it
            if is_na.any() and pd.to_numeric(text[~is_na], errors="coerce").notna().eq(text[~is_na].notna()).all():
                first = int(is_na.argmax())
                noted[str(column)] = (int(is_na.sum()), first, str(text.iloc[first]))
            out[column] = text.mask(is_na, None)
    out.attrs = {NA_ATTR: noted} if noted else {}  # read back by the node as a CSV file's notes (read_rows_file)
    try:
        out.to_parquet(path, index=False)
    except (ValueError, TypeError, pa.ArrowException) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TpflowerError(f"{subject} cannot be handed to the nodes as a Parquet file: {first}") from None


def load(run_dir: str | Path, base_dir: str | Path | None = None, verbose: bool = True) -> Model:
    """The model of a finished run (its results.json; predict needs its model.json and node-state/ too);
    ``base_dir``: where its dataset's relative paths start (default: the working directory at predict);
    ``verbose=False``: its ``predict`` prints no line (as a model of ``fit(verbose=False)``)."""
    return Model(run_dir, verbose=verbose, base_dir=base_dir)


class Model:
    """A trained model: its run dir's results.json (``results``, ``metrics``, ``history``) and, for prediction,
    its model.json and the owners' saved parts (RUN_DIR/node-state in a simulation)."""

    def __init__(self, run_dir: str | Path, verbose: bool = True, base_dir: str | Path | None = None):
        self.run_dir = Path(run_dir).expanduser().resolve()
        self.verbose = verbose  # predict's default: fit(verbose=False) gives a quiet model
        # predict's default: where the fit read its relative data paths from (None: the working directory)
        self.base_dir = None if base_dir is None else Path(base_dir).expanduser().resolve()
        jobs = sorted(p.parent.name for p in self.run_dir.glob(f"*/{RESULTS_FILE}"))
        if not (self.run_dir / RESULTS_FILE).exists() and jobs:  # a sweep's folder (multirun/DATE/TIME)
            shown = ", ".join(map(repr, jobs[:3])) + (f" and {len(jobs) - 3} more" if len(jobs) > 3 else "")
            raise TpflowerError(
                f"{self.run_dir} is a sweep's folder, not a run's: load one of its {len(jobs)} jobs' folders, {shown} "
                f"(python -m simulations.reproduce {self.run_dir} --out PREFIX compares them)"
            )
        if not self.run_dir.is_dir():
            raise TpflowerError(f"{self.run_dir}: no such folder (a run's folder holds its {RESULTS_FILE})")
        if not (self.run_dir / RESULTS_FILE).exists():
            raise TpflowerError(
                f"{self.run_dir}: no {RESULTS_FILE} in it: not a finished run's folder (a run writes it as it ends; "
                "one still running, or stopped before its end, has none)"
            )
        try:
            self.results: dict[str, Any] = read_results(self.run_dir / RESULTS_FILE)
        except ResultsError as exc:
            raise TpflowerError(str(exc)) from None
        self.run_id = self._saved_run_id()  # the run whose parts predict uses (model.json), None: no predictor

    def _saved_run_id(self) -> str | None:
        """The run id in the run dir's model.json now (None: there is none, or it cannot be read)."""
        try:
            return str(json.loads((self.run_dir / MODEL_FILE).read_text())["run_id"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _check_same_run(self) -> None:
        """A later fit or run into the same run dir replaced this model's run: its predict would use the newer
        model's parts under this model's metrics, so it is refused in one line."""
        now = self._saved_run_id()
        if self.run_id is not None and now != self.run_id:
            newer = read_results(self.run_dir / RESULTS_FILE).get("algorithm", "?") if now is not None else None
            held = f"another run ({newer})" if newer is not None else "no model of this run"
            raise TpflowerError(
                f"{self.run_dir} now holds {held}, not this model's ({self.results['algorithm']}): a later fit or run "
                f"wrote into the same run dir; tpflower.load({str(self.run_dir)!r}) opens what it holds (give each "
                "fit its own run_dir, or leave run_dir unset)"
            )

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v:.4g}" for k, v in self.metrics.items())
        return f"Model({self.results['algorithm']} on {self.results['dataset']}: {shown}; run_dir={self.run_dir})"

    @property
    def metrics(self) -> dict[str, float]:
        """The test metrics of the model the run kept: the primary one (``rmse`` or ``accuracy``) and, for a
        binary label, ``auc``; empty when the run made no evaluation. ``history`` has every epoch's numbers."""
        if not self.results["history"]:
            return {}
        last = self.results["history"][-1]
        out = {self.results["metric"]: float(last["test_metric"])}
        # results.json's history names them test_auc ... (strategies/evaluation.py)
        out.update({k: float(last[f"test_{k}"]) for k in SECONDARY_METRICS if last.get(f"test_{k}") is not None})
        return out

    @property
    def history(self) -> pd.DataFrame:
        """One line per evaluation (epoch, test_metric, train_loss, rounds, bytes, comm and wall times ...)."""
        return pd.DataFrame(self.results["history"])

    @property
    def importance(self) -> pd.DataFrame:
        """Boosted trees: one line per table (splits, gain, share of the gain), largest gain first, as results.json's
        ``importance`` (docs/algorithms.md, Boosted trees over the join); empty for other models."""
        rows = self.results.get("importance") or {}
        return pd.DataFrame([{"table": t, **v} for t, v in rows.items()], columns=["table", "splits", "gain", "share"])

    def get_params(self, deep: bool = True) -> dict[str, Any]:
        """The run's whole config (secret redacted), as results.json records it (scikit-learn's name)."""
        return json.loads(json.dumps(self.results.get("config", {})))

    def predict(
        self,
        rows: pd.DataFrame | str | Path,
        table: str | None = None,
        shard: int = 0,
        runtime: str = "inprocess",
        base_dir: str | Path | None = None,
        verbose: bool | None = None,
        per_joined_row: bool = False,
    ) -> pd.DataFrame:
        """Score new rows of table ``table`` (default the label table) federated, as ``tpflower predict``
        (docs/prediction.md): ``rows`` a DataFrame or a CSV / Parquet file in the table's own format (its join
        keys and the columns its features come from; other columns are ignored). One line per new row: ``row``
        (its position), ``joined_rows``, ``prediction`` (the mean over its joined rows; classification: the
        class of the mean probabilities; multiclass, or binary of two values other than 0/1: its id, and
        ``class`` its name) and class probabilities, in the rows' order; a new row that joins no partner has
        ``joined_rows`` 0 and a missing prediction (NaN; a class id: <NA>). ``per_joined_row``: one line per
        joined row with the partner tables' rows (a row that joins nothing has none). ``verbose`` None: as the
        fit that made the model (a loaded model: True). ``base_dir`` None: the fit's (a loaded model:
        ``load``'s). Errors about the rows of a DataFrame call them "the rows"."""
        if not isinstance(rows, (pd.DataFrame, str, os.PathLike)):
            raise TpflowerError(
                f"predict takes the rows as a pandas DataFrame or the path of a CSV / Parquet file, got "
                f"{type(rows).__name__} (a dict or list of rows: pd.DataFrame(rows))"
            )
        self._check_same_run()
        if isinstance(rows, pd.DataFrame) and len(rows) == 0:  # (a file of a header only is the node's to say)
            raise TpflowerError(f"the rows: a DataFrame of no row ({len(rows.columns)} columns): nothing to score")
        log = console_log(self.verbose if verbose is None else verbose)
        with tempfile.TemporaryDirectory(prefix="tpflower-rows-") as tmp:
            if isinstance(rows, pd.DataFrame):
                # a named index (rows.set_index("cust")) is columns of the rows, as pandas' to_parquet keeps it
                named = [n for n in rows.index.names if n is not None and n not in rows.columns]
                rows = rows.reset_index(level=named) if named else rows
                path = Path(tmp) / "rows.parquet"
                write_rows(rows, path)
            else:
                path = Path(rows)
            try:
                pred = predict_run(
                    self.run_dir,
                    path,
                    shard,
                    runtime,
                    base_dir if base_dir is not None else self.base_dir,
                    log=log,
                    table=table,
                    per_joined_row=per_joined_row,
                    rows_name="the rows" if isinstance(rows, pd.DataFrame) else None,
                    python=True,
                )
            except Exception as exc:
                if traceback_wanted():
                    raise
                raise TpflowerError(failure_message(exc, self.run_dir), self.run_dir / "error.log") from None
        if len(pred.unjoined):
            log(f"{len(pred.unjoined)} new row(s) joined no partner: their prediction is missing (NaN)")
        return pred.frame(every_row=True)

    def save(self, path: str | Path) -> Model:
        """Copy the run dir (results.json, model.json and, in a simulation, the owners' parts under
        node-state/) to ``path``; returns the model there (``tpflower.load(path)`` opens it again)."""
        self._check_same_run()
        target = Path(path).expanduser().resolve()
        if target.exists():
            raise TpflowerError(f"{target}: exists already; save to a new directory")
        shutil.copytree(self.run_dir, target, symlinks=True)
        if (self.run_dir / TABLES_DIR).is_dir():  # a fit's DataFrame tables: the copy reads its own
            self._move_sources(target)
        return Model(target, self.verbose, self.base_dir)

    def _move_sources(self, target: Path) -> None:
        """The copy's results.json and model.json name the tables it holds (RUN_DIR/tables), not the original's;
        model.json's dataset digest follows its spec."""
        from strategies.model_record import dataset_digest  # noqa: PLC0415

        results = target / RESULTS_FILE
        record = json.loads(results.read_text())
        record["config"] = moved_sources(record.get("config") or {}, self.run_dir, target)
        results.write_text(json.dumps(record, indent=2))
        model = target / MODEL_FILE
        if model.is_file():
            saved = json.loads(model.read_text())
            saved["config"] = moved_sources(saved.get("config") or {}, self.run_dir, target)
            saved["dataset_digest"] = dataset_digest(saved["config"])
            model.write_text(json.dumps(saved, indent=2))
