"""Run the federated algorithms on real Flower infrastructure on this machine (127.0.0.1 only).

Deployment runtime: one ``flower-superlink`` and, per client (table) of the configured dataset, the owner's
node service (``python -m simulations.node``: a process-isolated ``flower-supernode`` whose tasks the owner's
installed tpflower answers; it never runs the submitted app's code, docs/threat-model.md). ``start`` writes
each node's owner settings (tpflower.owner: its data source, the columns it exposes, its privacy floor = the
privacy of ``--overrides``, ``keys: blind``: each node blinds its join keys with its own scalar, no secret shared
by the owners) into STATE_DIR/clients/T-0.yaml, and the owner's own secret for its shards' preprocessing into
STATE_DIR/clients/T.key (mode 0600). ``--overrides "mapping.keys=hmac"``: one join-key secret shared by the nodes
(never given to the SuperLink) in STATE_DIR/clients/key instead.
``flwr run`` builds a FAB from this directory and ships it to the SuperLink and the SuperNodes::

    python -m simulations.deploy start --overrides "dataset=synthetic"      # SuperLink + 4 SuperNodes
    flwr run . local-deployment --stream \
        --run-config "overrides='algorithm=admm dataset=synthetic epochs=2' run-dir='/tmp/tp-run'"
    python -m simulations.deploy stop

or all three in one (stops everything on exit, also on failure or Ctrl-C)::

    python -m simulations.deploy run --overrides "algorithm=admm dataset=synthetic epochs=2" --run-dir /tmp/tp-run

Secure by default: ``start`` makes a CA and the SuperLink's certificate (STATE_DIR/pki, simulations.pki), a
key pair per SuperNode (STATE_DIR/clients/T-Q.key and .pub), registers the public keys with the SuperLink
(``flwr supernode register``) and starts everything with TLS and SuperNode authentication; ``--insecure``
(plain text, no authentication) only when asked. It writes the SuperLink connection ``local-deployment``
(address 127.0.0.1:PORT, root-certificates = the CA) into ``FLWR_HOME/config.toml``, FLWR_HOME being
``--flwr-home``, else ``$FLWR_HOME``, else STATE_DIR/flwr (the user's ~/.flwr is left alone): Flower 1.41 reads
connections from there, not from pyproject.toml. Every process is started in its own session
(process group) and carries the environment variable ``TPFLOWER_DEPLOY_TAG``; ``stop`` kills the recorded groups and then any process still carrying the
tag (the SuperLink starts its ``flower-superexec`` in a session of its own). The state of a deployment (ports,
pids, logs) is in ``STATE_DIR/deployment.json`` (default outputs/deploy).

Simulation runtime: ``flwr run .`` without a connection name uses the default connection ``local``, a
simulation SuperLink that ``flwr`` starts in the background (and leaves running) with one virtual SuperNode
per ``num-supernodes``, which must equal the number of tables (``python -m simulations.deploy clients``)::

    export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1   # else the SuperLink `uv sync`s the app into a new env
    flwr run . --stream --federation-config "num-supernodes=3 client-resources-num-cpus=1"
    python -m simulations.deploy stop-local
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import secrets
import shlex
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TextIO

import tomli_w
import yaml
from hydra.errors import HydraException
from omegaconf import OmegaConf

from simulations.child_process import parent_death_signal
from simulations.pki import ServerTLS, make_node_keys, make_server_tls
from tpflower.config_errors import override_error
from tpflower.datasets import load_spec
from tpflower.overrides import searchpath_override, split_overrides
from tpflower.owner import SECRET_ENV, privacy_floor, simulation_owner, uses_label_dp
from tpflower.privacy.settings import label_range
from tpflower.schema import SpecError
from tpflower.signing import node_name, node_signing_key, verify_key_hex

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]  # a dependency of flwr

HOST = "127.0.0.1"
TAG_VAR = "TPFLOWER_DEPLOY_TAG"
CONNECTION = "local-deployment"
APP_DIR = Path(__file__).resolve().parents[1]
DEFAULT_STATE_DIR = Path("outputs") / "deploy"
DEFAULT_FLOWER_CONFIG = {"superlink": {"default": "local", "local": {"address": ":local:"}}}


# ---------------------------------------------------------------------------------------------- helpers


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def flwr_home(explicit: str | Path | None = None, state_dir: str | Path | None = None) -> Path:
    """Flower's home directory (config.toml, installed FABs, the local SuperLink's state): ``explicit``
    (--flwr-home), else $FLWR_HOME, else STATE_DIR/flwr for a deployment (``state_dir``: its connection stays
    out of the user's ~/.flwr), else ~/.flwr (the home `flwr run .` uses)."""
    if explicit:
        return Path(explicit).expanduser().resolve()
    if os.environ.get("FLWR_HOME"):
        return Path(os.environ["FLWR_HOME"]).expanduser().resolve()
    return (Path(state_dir) / "flwr" if state_dir is not None else Path.home() / ".flwr").expanduser().resolve()


def flower_env(home: Path, tag: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for the Flower processes: venv binaries first on PATH, FLWR_HOME, no runtime `uv sync`.

    Flower 1.41's SuperLink (and the local simulation SuperLink that `flwr run` starts) installs the app's
    dependencies into a fresh environment with `uv sync` unless FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1;
    the dependencies are already in this venv.
    """
    env = dict(os.environ if base is None else base)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["FLWR_HOME"] = str(home)
    env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env[TAG_VAR] = tag
    env.pop(SECRET_ENV, None)  # the nodes read their secret_file; the SuperLink must never hold the secret
    return env


def clients_of(overrides: str, base_dir: str | Path | None = None) -> list[tuple[str, int]]:
    """The (table, shard) clients of the run the Hydra overrides describe: one SuperNode each."""
    # flwr (via client_app): its import sets GRPC_VERBOSITY in os.environ, which env() would hand on to the
    # SuperLink and SuperNodes; only the commands that compose a run's config import it
    from tpflower.app.client_app import config_from_run_config  # noqa: PLC0415

    cfg = config_from_run_config({"overrides": overrides})
    return load_spec(cfg.dataset, base_dir=base_dir).clients(str(cfg.scenario.name))


def deployment_overrides(overrides: str) -> str:
    """The owners' settings of a deployment map join keys by blinding (no shared secret) unless the overrides
    name ``mapping.keys``."""
    return overrides if "mapping.keys=" in overrides else f"{overrides} mapping.keys=blind".strip()


def write_client_configs(
    overrides: str,
    directory: Path,
    base_dir: str | Path | None = None,
    prediction_rows: dict[tuple[str, int], str] | None = None,
) -> dict[tuple[str, int], Path]:
    """One owner settings file per client of the run ``overrides`` describes (what each table's owner would
    write on its own node: tpflower.owner), and one fresh join-key secret they share (mode 0600).
    ``prediction_rows``: the query owner's file of new rows, by client (docs/prediction.md)."""
    from tpflower.app.client_app import config_from_run_config  # noqa: PLC0415  flwr: see clients_of

    cfg = config_from_run_config({"overrides": overrides})
    spec = load_spec(cfg.dataset, base_dir=base_dir)
    directory.mkdir(parents=True, exist_ok=True)
    container = OmegaConf.to_container(cfg, resolve=True)
    floor = privacy_floor(container["privacy"], "--overrides")
    if uses_label_dp(floor) and spec.label.task == "regression":  # a floor drawn without it: every run's too
        try:
            label_range("--overrides: the owners' floor privacy=" + str(floor["name"]), floor.get("label_range"))
        except ValueError as exc:
            raise SpecError(str(exc)) from None
    paths = {}
    record = directory / WRITTEN
    written: dict[str, str] = json.loads(record.read_text()) if record.is_file() else {}
    # each node's Ed25519 key for re-blinding lists, in its state_dir (the settings' default: state/<file stem>);
    # every owner's settings name the others' verify keys (peers), as an out-of-band exchange would
    clients = spec.clients(str(cfg.scenario.name))
    verify = {node_name(t, q): verify_key_hex(node_signing_key(directory / "state" / f"{t}-{q}")) for t, q in clients}
    for table, shard in clients:
        owner = simulation_owner(container, spec, table, base_dir)
        # keys=hmac: one join-key secret all owners share; keys=blind: no shared secret (each node blinds with its
        # own scalar), only the owner's own secret for its shards' preprocessing, one per table
        key = directory / ("key" if owner.keys == "hmac" else f"{table}.key")
        if not key.exists():
            key.touch(mode=0o600)
            key.write_text(secrets.token_hex(32))
        e = owner.exposed
        settings = {
            "table": table,
            **({"source": owner.source} if owner.source else {"loader": owner.loader}),  # source: an absolute path
            **({"where": owner.where} if owner.where else {}),
            "columns": {
                "keys": list(e.keys),
                "numeric": list(e.numeric),
                "categorical": list(e.categorical),
                **({"label": e.label, "label_task": spec.label.task} if e.label else {}),
                **({"label_classes": list(spec.label.classes)} if e.label and spec.label.classes else {}),
            },
            # the label-DP level as its epsilon alone (label_lambda follows from it): an owner who edits it
            # later edits one number, not a pair that must agree (tpflower.owner.label_levels)
            "privacy": {k: v for k, v in floor.items() if v is not None and k != "label_lambda"},
            "keys": owner.keys,
            # the owner's bounds as the run gives them (the one-machine deployment: the user is every owner)
            "min_sketch_rows": owner.min_sketch_rows,
            "min_group_rows": owner.min_group_rows,
            "secret_file": str(key),
            "peers": {name: hex_key for name, hex_key in verify.items() if name != node_name(table, shard)},
            **(
                {"prediction_rows": prediction_rows[(table, shard)]}
                if (table, shard) in (prediction_rows or {})
                else {}
            ),
        }
        shards = spec.table(table).shards
        if str(cfg.scenario.name) == "ucq" and shards is not None:  # the owner's split of its file (a run's is refused)
            settings["shards"] = (
                {"by": shards.by, **({"values": list(shards.values)} if shards.values else {})}
                if shards.by is not None
                else {"parts": shards.parts, "seed": shards.seed}
            )
        paths[(table, shard)] = directory / f"{table}-{shard}.yaml"
        requested = {k: settings[k] for k in ("prediction_rows",) if k in settings}  # set even in an edited file
        write_owner_settings(paths[(table, shard)], yaml.safe_dump(settings, sort_keys=False), written, requested)
    (directory / WRITTEN).write_text(json.dumps(written, indent=1, sort_keys=True))
    return paths


#: the hash of each owner settings file as `start` last wrote it, in the files' folder: an owner's edit shows
WRITTEN = ".written.json"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def write_owner_settings(path: Path, text: str, written: dict[str, str], requested: dict[str, Any]) -> None:
    """Write ``text`` to ``path`` and note its hash in ``written``, unless the file changed since this tool
    last wrote it (its hash there): then the owner edited it (docs/deployment.md) and it is kept, with one line,
    but for the top-level settings ``requested`` for this start (a prediction's rows file), set in its text
    (its other lines and comments as the owner left them)."""
    current = path.read_text() if path.is_file() else None
    if current not in (None, text) and path.name in written and _digest(current) != written[path.name]:
        print(
            f"keeping {path}: edited since `tpflower deploy` wrote it (delete it to have it written from the "
            "overrides again)",
            flush=True,
        )
        patched = set_top_level(current, requested)
        if patched != current:
            path.write_text(patched)
            print(f"{path}: {', '.join(requested)} set for this start", flush=True)
        return
    if current != text:
        path.write_text(text)
    written[path.name] = _digest(text)


def set_top_level(text: str, values: dict[str, Any]) -> str:
    """``text`` (a YAML mapping) with each top-level key of ``values`` set to its scalar value on its one line
    (added at the end if missing); the other lines as they are."""
    lines = text.splitlines(keepends=True)
    for key, value in values.items():
        line = yaml.safe_dump({key: value}, width=10**6)
        at = next((i for i, old in enumerate(lines) if re.match(rf"{re.escape(key)}\s*:", old)), None)
        if at is not None:
            lines[at] = line
        else:
            lines.append(("" if not lines or lines[-1].endswith("\n") else "\n") + line)
    return "".join(lines)


def write_connection(
    home: Path, name: str, address: str, root_certificates: str | Path | None = None, default: bool = False
) -> Path:
    """Add (or replace) the SuperLink connection `name` in $FLWR_HOME/config.toml: TLS verified against
    ``root_certificates`` (the deployment's CA), or insecure (plain text) when None."""
    path = home / "config.toml"
    config: dict[str, Any] = (
        tomllib.loads(path.read_text()) if path.is_file() else json.loads(json.dumps(DEFAULT_FLOWER_CONFIG))
    )
    superlinks = config.setdefault("superlink", {})
    superlinks[name] = (
        {"address": address, "root-certificates": str(Path(root_certificates).resolve())}
        if root_certificates
        else {"address": address, "insecure": True}
    )
    if default:
        superlinks["default"] = name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(config))
    return path


def _log_tail(path: str | Path, lines: int = 30) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# ---------------------------------------------------------------------------------------------- processes


def _alive(pid: int) -> bool:
    """True if `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] != b"Z"
    except (OSError, ValueError):
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False


def tagged_pids(tag: str) -> list[int]:
    """Live processes whose environment carries TPFLOWER_DEPLOY_TAG=tag (Linux /proc; [] elsewhere)."""
    needle = f"{TAG_VAR}={tag}".encode()
    found = []
    proc = Path("/proc")
    if not proc.is_dir():
        return found
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0") and _alive(int(entry.name)):
            found.append(int(entry.name))
    return sorted(found)


def _signal(pid: int, pgid: int | None, sig: int) -> None:
    try:
        if pgid is not None:
            os.killpg(pgid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_tagged(
    tag: str, groups: Iterable[int] = (), timeout: float = 10.0, children: Iterable[subprocess.Popen] = ()
) -> list[int]:
    """SIGTERM every process carrying `tag`, then SIGKILL what is left after `timeout`; returns the survivors.

    A tagged process that leads its process group, or belongs to one of `groups` (the groups this module
    started), gets its whole group signalled. Only tagged processes are ever looked at, so a recorded group id
    that was reused by an unrelated process is left alone. `children` (our own Popen objects) are reaped.
    """
    groups = set(groups)
    children = list(children)

    def targets() -> list[tuple[int, int | None]]:
        out = []
        for pid in tagged_pids(tag):
            try:
                pgid = os.getpgid(pid)
            except ProcessLookupError:
                continue
            out.append((pid, pgid if pgid == pid or pgid in groups else None))
        return out

    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        for pid, pgid in targets():
            _signal(pid, pgid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            for child in children:
                child.poll()  # reap our direct children
            if not targets():
                break
            time.sleep(0.2)
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=1)
    return [pid for pid, _ in targets()]


def spawn(
    cmd: list[str], log: Path, env: dict[str, str], cwd: str | Path | None = None, owned: bool = False
) -> subprocess.Popen:
    """Start `cmd` in a new session (its own process group), output to `log`. ``owned``: the process gets
    SIGTERM when this one dies (Linux's parent-death signal), as a `deploy run` or `predict` owns its deployment:
    killed (SIGKILL), it would leave the SuperLink and SuperNodes running the job on."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=parent_death_signal(signal.SIGTERM) if owned else None,
        )


# ---------------------------------------------------------------------------------------------- deployment


@dataclass
class Deployment:
    tag: str
    flwr_home: str
    state_dir: str
    superlink_port: int
    connection: str
    ca: str | None = None  # the CA certificate of a TLS deployment (None: insecure, plain text)
    processes: list[dict[str, Any]] = field(default_factory=list)  # name, pid, pgid, cmd, log
    popens: list[subprocess.Popen] = field(default_factory=list, repr=False)  # only in the starting process
    owned: bool = False  # its processes end with the process that started it (spawn), as `deploy run`'s do

    @property
    def address(self) -> str:
        return f"{HOST}:{self.superlink_port}"

    @property
    def secure(self) -> bool:
        return self.ca is not None

    def env(self) -> dict[str, str]:
        return flower_env(Path(self.flwr_home), self.tag)

    def save(self) -> Path:
        path = Path(self.state_dir) / "deployment.json"
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "popens"}
        path.write_text(json.dumps(data, indent=2))
        return path

    @classmethod
    def load(cls, state_dir: str | Path) -> Deployment:
        data = json.loads((Path(state_dir) / "deployment.json").read_text())
        return cls(**data)


def superlink_command(port: int, tls: ServerTLS | None) -> list[str]:
    """flower-superlink on 127.0.0.1:`port`: TLS with SuperNode authentication, or plain text (tls None); run
    as tpflower.app.superlink (Flower's SuperLink, its per-request middleware gated by path)."""
    security = (
        [
            "--ssl-ca-certfile",
            str(tls.ca),
            "--ssl-certfile",
            str(tls.cert),
            "--ssl-keyfile",
            str(tls.key),
            "--enable-supernode-auth",
        ]
        if tls
        else ["--insecure"]
    )
    return [
        sys.executable,
        "-m",
        "tpflower.app.superlink",
        *security,
        "--disable-runtime-dependency-installation",
        "--host",
        HOST,
        "--port",
        str(port),
    ]


def node_security(ca: str | Path | None, auth_key: str | Path | None) -> list[str]:
    """A SuperNode's flags: TLS verified against ``ca`` and authenticated by its private key ``auth_key``, or
    plain text when ``ca`` is None."""
    if not ca:
        return ["--insecure"]
    return ["--root-certificates", str(ca)] + (["--auth-supernode-private-key", str(auth_key)] if auth_key else [])


def supernode_command(
    superlink_port: int,
    port: int,
    table: str,
    shard: int,
    client_config: str | Path,
    ca: str | Path | None = None,
    auth_key: str | Path | None = None,
) -> list[str]:
    """flower-supernode of one table shard: TLS verified against ``ca`` and authenticated by its private key
    ``auth_key`` (registered with the SuperLink), or plain text when ``ca`` is None."""
    security = node_security(ca, auth_key)
    return [
        "flower-supernode",
        *security,
        "--superlink",
        f"{HOST}:{superlink_port}",
        "--host",
        HOST,
        "--port",
        str(port),
        "--node-config",
        f'table="{table}" shard={shard} client-config="{client_config}"',
    ]


def node_command(
    superlink_port: int,
    runtime_port: int,
    table: str,
    shard: int,
    client_config: str | Path,
    ca: str | Path | None = None,
    auth_key: str | Path | None = None,
    torch_threads: int | None = None,
) -> list[str]:
    """The owner's node service of one table shard (simulations.node): a process-isolated SuperNode whose
    Runtime API is on 127.0.0.1:``runtime_port``, answered by the owner's installed tpflower only;
    ``torch_threads``: its share of the machine's cores (default: torch's, every core)."""
    security = node_security(ca, auth_key)
    threads = ["--torch-threads", str(torch_threads)] if torch_threads else []
    return [
        sys.executable,
        "-m",
        "simulations.node",
        "--client-config",
        str(client_config),
        "--table",
        table,
        "--shard",
        str(shard),
        "--superlink",
        f"{HOST}:{superlink_port}",
        "--runtime-port",
        str(runtime_port),
        *security,
        *threads,
    ]


def node_threads(nodes: int, cpus: int | None = None) -> int:
    """Each of ``nodes`` node services on one machine: its share of the ``cpus`` cores (at least one) for
    torch's parallel work. With torch's default every service would start a thread per core, and the nodes'
    threads would outnumber the cores and wait on each other (OpenMP threads spin while they wait)."""
    return max(1, (cpus or os.cpu_count() or 1) // max(nodes, 1))


def node_env(env: dict[str, str]) -> dict[str, str]:
    """The node service's environment: the deployment's, with this project first on the Python path."""
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in (str(APP_DIR), env.get("PYTHONPATH", "")) if p)}


def register_node(public_key: str | Path, connection: str, env: dict[str, str]) -> None:
    """``flwr supernode register PUBLIC_KEY CONNECTION``: the SuperLink accepts the node holding the private key."""
    done = subprocess.run(
        ["flwr", "supernode", "register", str(public_key), connection],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0 or "registered successfully" not in done.stdout:
        raise RuntimeError(
            f"registering {public_key} failed (exit {done.returncode}): {(done.stdout + done.stderr).strip()}"
        )


def _exited(proc: subprocess.Popen, log: Path) -> RuntimeError:
    """The error of a process that exited as it started: its own one line when it said one (a node refusing its
    settings or data: RunFailed, which the commands print as one line, with the log's path), else its log's
    tail. (A node's refusal was a RuntimeError traceback of `deploy run` with the line at its end.)"""
    said = [line for line in _log_tail(log).splitlines() if line.startswith("error: ")]
    if said:
        return RunFailed(f"{said[-1].removeprefix('error: ')} (exit status {proc.returncode}; log {log})")
    return RuntimeError(f"{proc.args[0]} exited with code {proc.returncode}; log {log}:\n{_log_tail(log)}")


def _wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float, ca: str | Path | None = None) -> None:
    context = ssl.create_default_context(cafile=str(ca)) if ca else None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise _exited(proc, log)
        try:
            with urllib.request.urlopen(url, timeout=1, context=context) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{proc.args[0]} not ready at {url} within {timeout:.0f} s; log {log}:\n{_log_tail(log)}")


def _wait_port(port: int, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise _exited(proc, log)
        try:
            with socket.create_connection((HOST, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(
        f"{proc.args[0]} not listening on {HOST}:{port} within {timeout:.0f} s; log {log}:\n{_log_tail(log)}"
    )


def start(
    overrides: str = "",
    state_dir: str | Path = DEFAULT_STATE_DIR,
    port: int | None = None,
    home: str | Path | None = None,
    base_dir: str | Path | None = None,
    connection: str = CONNECTION,
    cwd: str | Path | None = None,
    timeout: float = 60.0,
    insecure: bool = False,
    prediction_rows: dict[tuple[str, int], str] | None = None,
    owned: bool = False,
) -> Deployment:
    """Start a SuperLink on 127.0.0.1:`port` (a free one if None) and one SuperNode per client of the run
    `overrides` describes, each on a free port; register connection `connection` in $FLWR_HOME/config.toml.

    Secure by default: a fresh CA and SuperLink certificate (STATE_DIR/pki), a key pair per SuperNode
    (STATE_DIR/clients/T-Q.key, what each owner would make on its own machine), the public keys registered
    with the SuperLink, which runs with TLS and SuperNode authentication. ``insecure``: plain text, no node
    authentication (any process reaching the port can claim a table), with a warning.
    On any failure everything started so far is stopped before the error propagates.
    """
    state = Path(state_dir).resolve()
    state.mkdir(parents=True, exist_ok=True)
    if (state / "deployment.json").is_file():
        old = Deployment.load(state)
        if tagged_pids(old.tag):
            raise RunFailed(
                f"a deployment recorded in {state} is still running; `python -m simulations.deploy stop "
                f"--state-dir {shlex.quote(str(state))}` first"
            )
    client_configs = write_client_configs(deployment_overrides(overrides), state / "clients", base_dir, prediction_rows)
    if insecure:
        print(
            "WARNING: insecure deployment: plain-text traffic and no SuperNode authentication "
            "(any process that reaches the SuperLink's port can join as a table)",
            file=sys.stderr,
            flush=True,
        )
    tls = None if insecure else make_server_tls(state / "pki")
    dep = Deployment(
        tag=uuid.uuid4().hex,
        flwr_home=str(flwr_home(home, state)),
        state_dir=str(state),
        superlink_port=port or free_port(),
        connection=connection,
        ca=None if tls is None else str(tls.ca),
        owned=owned,
    )
    env = dep.env()
    workdir = cwd or Path.cwd()
    try:
        log = state / "superlink.log"
        proc = spawn(superlink_command(dep.superlink_port, tls), log, node_env(env), workdir, owned)
        dep.popens.append(proc)
        dep.processes.append(
            {"name": "superlink", "pid": proc.pid, "pgid": proc.pid, "cmd": proc.args, "log": str(log)}
        )
        dep.save()
        _wait_http(f"{'https' if tls else 'http'}://{dep.address}/health", proc, log, timeout, dep.ca)
        write_connection(Path(dep.flwr_home), connection, dep.address, dep.ca)
        nodes = []
        threads = node_threads(len(client_configs))
        for (table, shard), client_config in client_configs.items():
            auth_key = None
            if tls is not None:
                auth_key, public_key = make_node_keys(client_config.with_suffix(".key"))
                register_node(public_key, connection, env)
            node_port = free_port()
            log = state / f"supernode-{table}-{shard}.log"
            proc = spawn(
                node_command(dep.superlink_port, node_port, table, shard, client_config, dep.ca, auth_key, threads),
                log,
                node_env(env),
                workdir,
                owned,
            )
            dep.popens.append(proc)
            dep.processes.append(
                {
                    "name": f"supernode {table}/{shard}",
                    "pid": proc.pid,
                    "pgid": proc.pid,
                    "cmd": proc.args,
                    "log": str(log),
                    "port": node_port,
                }
            )
            dep.save()
            nodes.append((node_port, proc, log))
        for node_port, proc, log in nodes:
            _wait_port(node_port, proc, log, timeout)
    except BaseException:
        stop(dep)
        raise
    return dep


def restart_node(dep: Deployment, name: str, cwd: str | Path | None = None) -> subprocess.Popen:
    """Start the recorded SuperNode ``name`` ("supernode T/Q") again with its recorded command (same key, so
    the same node id when authenticated; the same settings file, so the same node-local state)."""
    record = next(p for p in dep.processes if p["name"] == name)
    proc = spawn(list(record["cmd"]), Path(record["log"]), node_env(dep.env()), cwd, dep.owned)
    dep.popens.append(proc)
    record.update(pid=proc.pid, pgid=proc.pid)
    dep.save()
    return proc


def stop(dep: Deployment | str | Path = DEFAULT_STATE_DIR, timeout: float = 10.0) -> list[int]:
    """Stop every process of a deployment (object or state dir); returns the pids that survived (none)."""
    if not isinstance(dep, Deployment):
        dep = Deployment.load(dep)
    return kill_tagged(dep.tag, [int(p["pgid"]) for p in dep.processes], timeout, dep.popens)


def flwr_run_command(
    connection: str | None,
    overrides: str,
    run_dir: str | Path | None = None,
    app_dir: str | Path = APP_DIR,
    federation_config: str | None = None,
    stream: bool = True,
    base_dir: str | Path | None = None,
) -> list[str]:
    """The `flwr run` command line for a job (connection None = the default one, `local`); ``base_dir``: where
    the run's relative table sources start."""
    run_config = [f"overrides={json.dumps(overrides)}"]
    if run_dir is not None:
        run_config.append(f"run-dir={json.dumps(str(run_dir))}")
    if base_dir is not None:
        run_config.append(f"base-dir={json.dumps(str(base_dir))}")
    cmd = ["flwr", "run", str(app_dir)] + ([connection] if connection else []) + ["--run-config", " ".join(run_config)]
    if federation_config:
        cmd += ["--federation-config", federation_config]
    return cmd + (["--stream"] if stream else [])


def started_run_command(dep: Deployment, job: str, run_dir: str | Path) -> str:
    """The shell line that runs ``job`` on the started deployment ``dep``, as `start` prints it: from any folder
    and shell as it is (its Flower home, the venv's `flwr`, the app's folder and the run dir absolute, every word
    quoted for the shell), the run's results.json into ``run_dir``, as `run --run-dir` does."""
    cmd = flwr_run_command(dep.connection, job, Path(run_dir).resolve())
    cmd[0] = str(Path(sys.executable).parent / "flwr")
    return shlex.join([f"FLWR_HOME={dep.flwr_home}", *cmd])


def simulation_run_command(overrides: str, n_clients: int, run_dir: str | Path) -> str:
    """The shell line `clients` prints: `flwr run` of the job on Flower's simulation runtime (the default
    connection, one SuperNode per table shard), from any folder as it is (the venv's bin first on PATH: `flwr`
    starts the local `flower-superlink` from it; no installation of the app's dependencies, which the venv
    holds: docs/deployment.md, `flwr run .`; the app's folder, the run dir and the working directory for
    relative sources absolute, every word quoted for the shell)."""
    cmd = flwr_run_command(
        None,
        overrides,
        Path(run_dir).resolve(),
        federation_config=f"num-supernodes={n_clients} client-resources-num-cpus=1",
        base_dir=Path.cwd(),
    )
    env = f'FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 PATH={shlex.quote(str(Path(sys.executable).parent))}:"$PATH"'
    return f"{env} {shlex.join(cmd)}"


class RunFailed(RuntimeError):
    """A deployment run that did not complete (its status, the last error line of its log)."""


def run_status(run_id: int, connection: str, env: dict[str, str]) -> dict[str, Any]:
    """The SuperLink's record of run ``run_id`` (``flwr ls --run-id --format json``): status, details, ..."""
    done = subprocess.run(
        ["flwr", "ls", connection, "--run-id", str(run_id), "--format", "json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    try:
        return json.loads(done.stdout)["runs"][0]
    except (ValueError, KeyError, IndexError):
        raise RunFailed(
            f"cannot read the status of run {run_id}: {(done.stdout + done.stderr).strip()[-400:]}"
        ) from None


#: terminal colour and cursor codes (`flwr`'s rich console): dropped when the output is not a terminal
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
#: `flwr run`'s note on the app's pyproject that is no run's business ([project] has no license field),
#: its heading, and a log prefix with nothing after it
NOISE = re.compile(r'Recommended property "license" missing|^Flower App configuration warnings in |^[A-Z]+ :\s*$')


def stream_run(
    cmd: list[str], env: dict[str, str], timeout: float, out: TextIO | None = None
) -> tuple[int | None, list[str]]:
    """Run ``flwr run ... --stream``, echoing its output to ``out`` (default stdout), each line once, without
    colour codes unless ``out`` is a terminal; returns (the run id it started, its output lines)."""
    out = out or sys.stdout
    tty = out.isatty()
    if not tty:
        env = {**env, "NO_COLOR": "1"}  # rich (flwr's console) writes no colour codes
    lines: list[str] = []
    shown: set[str] = set()
    run_id = None
    with subprocess.Popen(
        cmd, env=env, cwd=APP_DIR, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        deadline = time.monotonic() + timeout
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip("\n") if tty else ANSI.sub("", raw).rstrip()
            if line.strip() and line not in shown and not NOISE.search(line):
                shown.add(line)  # Flower's log stream may repeat lines (one per poll)
                print(line, file=out, flush=True)
            lines.append(ANSI.sub("", raw).rstrip())
            if run_id is None and (m := re.search(r"Successfully started run (\d+)", line)):
                run_id = int(m.group(1))
            if time.monotonic() > deadline:
                proc.kill()
                raise RunFailed(f"`flwr run` did not finish within {timeout:.0f} s")
    return run_id, lines


def run(
    overrides: str,
    run_dir: str | Path,
    state_dir: str | Path = DEFAULT_STATE_DIR,
    port: int | None = None,
    home: str | Path | None = None,
    timeout: float = 3600.0,
    insecure: bool = False,
    resume: bool = False,
) -> Path:
    """start + `flwr run ... --stream` + stop (always); returns the results.json path of THIS run. ``resume``:
    continue the run in ``run_dir`` from its last checkpoint (the nodes' own checkpoints are in their
    state dirs under ``state_dir``).

    Raises :class:`RunFailed` unless the SuperLink reports the run completed and the run wrote results.json
    (an earlier run's results.json in the run dir never counts)."""
    run_dir = Path(run_dir).resolve()
    if resume:
        overrides = f"{overrides} resume=true"
    began = time.time()
    dep = start(overrides, state_dir, port, home, insecure=insecure, owned=True)
    try:
        return submit(dep, overrides, run_dir, run_dir / "results.json", "run", timeout)
    except RunFailed as exc:  # a node lost mid-run: its checkpoints continue it (docs/deployment.md, resume)
        from tpflower.checkpoint import CHECKPOINT  # noqa: PLC0415  flwr: see clients_of

        checkpoint = run_dir / CHECKPOINT
        if checkpoint.is_file() and checkpoint.stat().st_mtime >= began - 1:  # written by this run (coarse mtime)
            raise RunFailed(
                f"{exc}; the run continues from its last checkpoint with the same command and --resume"
            ) from None
        raise


def submit(dep: Deployment, job: str, run_dir: Path, out: Path, what: str, timeout: float) -> Path:
    """`flwr run` the overrides ``job`` on the started deployment ``dep`` and stop it (always); returns
    ``out``, the file the ServerApp writes into ``run_dir``. Raises :class:`RunFailed` unless the SuperLink
    reports the run completed and the run wrote ``out`` anew (an earlier run's file never counts)."""
    before = out.stat().st_mtime_ns if out.is_file() else None
    try:
        cmd = flwr_run_command(dep.connection, job, run_dir)
        print("$", " ".join(cmd), flush=True)
        run_id, lines = stream_run(cmd, dep.env(), timeout)
        if run_id is None:
            raise RunFailed("`flwr run` did not start a run:\n" + "\n".join(lines[-20:]))
        status = run_status(run_id, dep.connection, dep.env())
        written = out.is_file() and out.stat().st_mtime_ns != before
        if status.get("status") != "finished:completed" or not written:
            # the ServerApp's exception is the run's status detail: the one line naming the table at fault
            why = str(status.get("status-details") or "").removeprefix("ServerApp failed with exception: ")
            raise RunFailed(
                f"{what} {run_id} {status.get('status')}"
                + (f": {why}" if why else "")
                + ("" if written else f"; no new {out}")
                + f" (logs in {dep.state_dir})"
            )
        if not any(str(out) in line for line in lines):  # the ServerApp's log names it, streamed above
            print(f"{what}: wrote {out}", flush=True)
        return out
    finally:
        left = stop(dep)
        if left:
            print(f"processes still alive: {left}", file=sys.stderr)


def predict(
    overrides: str,
    run_dir: str | Path,
    rows: str | Path,
    state_dir: str | Path = DEFAULT_STATE_DIR,
    port: int | None = None,
    home: str | Path | None = None,
    timeout: float = 1800.0,
    insecure: bool = False,
    shard: int = 0,
    table: str | None = None,
    per_joined_row: bool = False,
) -> Path:
    """A prediction request for the model a deployment trained into ``run_dir`` (docs/prediction.md): start
    the nodes again (same ``state_dir``: their saved parts), the query owner's (``table``, default the label
    table's) settings naming ``rows`` as its
    new rows, `flwr run` the request (``predict.run_id``: the run of RUN_DIR/model.json), stop. Returns
    RUN_DIR/predictions.csv, written by the ServerApp; raises RunFailed otherwise."""
    from strategies.model_record import read_model_record  # noqa: PLC0415  torch: only for this command
    from strategies.predict import PREDICTIONS_FILE  # noqa: PLC0415

    run_dir = Path(run_dir).resolve()
    record = read_model_record(run_dir)
    cfg = config_of(overrides)
    spec = load_spec(cfg.dataset)
    for setting, trained, asked in (
        ("dataset", record.get("dataset"), spec.name),
        # (another scenario starts other nodes: a join model's part of shard 1 of a union is nowhere, which the
        # prediction run found after the deployment's start)
        ("scenario", record.get("scenario"), str(cfg.scenario.name)),
    ):
        if trained is not None and trained != asked:  # found here, before any process starts
            raise RunFailed(
                f"{run_dir}/model.json is a model of {setting} {trained!r}, the overrides name {setting} {asked!r}: "
                "predict with the overrides of the run that trained it"
            )
    if not (Path(state_dir) / "deployment.json").is_file():
        raise RunFailed(
            f"--state-dir {state_dir} holds no deployment, so no node's saved model part: predict with the "
            "--state-dir of the run that trained the model"
        )
    table = table or spec.label_table
    check_rows_file(Path(rows), spec.key_columns(table))
    job = f"{overrides} +predict.run_id='{record['run_id']}' +predict.table={table} +predict.shard={int(shard)}"
    job += " +predict.per_joined_row=true" if per_joined_row else ""
    check_query_rows(job, Path(state_dir), (table, int(shard)), Path(rows), str(record["run_id"]))
    query = {(table, int(shard)): str(Path(rows).resolve())}
    dep = start(overrides, state_dir, port, home, insecure=insecure, prediction_rows=query, owned=True)
    return submit(dep, job, run_dir, run_dir / PREDICTIONS_FILE, "prediction run", timeout)


def check_rows_file(rows: Path, keys: tuple[str, ...] | list[str]) -> None:
    """``--rows`` exists and reads as the query owner's node will read it (before any process starts: a
    deployment's start takes tens of seconds); raises RunFailed naming the file. Its columns are the node's
    to check (tpflower.phases.predict.read_rows)."""
    from tpflower.datasets.files import read_rows_file  # noqa: PLC0415

    if not rows.is_file():
        raise RunFailed(f"--rows {rows}: no such file")
    try:
        read_rows_file(rows, keys)
    except (OSError, ValueError) as exc:
        raise RunFailed(f"--rows {rows}: cannot read it as {rows.suffix.lstrip('.') or 'csv'} ({exc})") from None


def check_query_rows(job: str, state: Path, query: tuple[str, int], rows: Path, run_id: str) -> None:
    """The query owner's node's own check of its new rows ``rows`` on its saved model part
    (tpflower.phases.predict.read_rows), made before the deployment starts (its start takes tens of seconds), with
    the node's settings file as the last start wrote it: a bad rows file is one line naming the file in seconds.
    Raises RunFailed with that line. Nothing to check without that file or part (the node says why, as ever)."""
    from dataclasses import replace  # noqa: PLC0415

    from flwr.app import Context, RecordDict  # noqa: PLC0415  flwr: see clients_of

    from tpflower.app.client_app import make_client  # noqa: PLC0415
    from tpflower.phases.predict import read_rows, saved_part  # noqa: PLC0415  torch: only for this command

    settings = state / "clients" / f"{query[0]}-{query[1]}.yaml"
    if not settings.is_file():
        return
    node = {"table": query[0], "shard": query[1], "client-config": str(settings)}
    try:
        client = make_client(config_of(job), Context(0, 0, node, RecordDict(), {}))
        part = saved_part(client, run_id)[0]
    except (SpecError, OSError, ValueError):  # (refusals too) the node says it in its own line once started
        return
    # the user runs this command as the query owner: the line names the file (a node's line to the server does not)
    client.settings = replace(client.settings, owner=replace(client.settings.owner, origin="simulation"))
    try:
        read_rows(str(rows), client, part)
    except (SpecError, ValueError) as exc:
        raise RunFailed(f"table {query[0]!r} shard {query[1]}: {exc}") from None


def config_of(overrides: str) -> Any:
    from tpflower.app.client_app import config_from_run_config  # noqa: PLC0415  flwr: see clients_of

    return config_from_run_config({"overrides": deployment_overrides(overrides)})


# ---------------------------------------------------------------------------------------------- local SuperLink


def local_superlink_pids(home: str | Path | None = None) -> list[int]:
    """The local simulation SuperLink `flwr run` started for this FLWR_HOME (its --log-file is under it)."""
    log_file = str(flwr_home(home) / "local-superlink" / "superlink.log")
    pids = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(a.endswith("flower-superlink") for a in argv[:2]) and log_file in argv and _alive(int(entry.name)):
            pids.append(int(entry.name))
    return pids


def stop_local(home: str | Path | None = None, timeout: float = 10.0) -> list[int]:
    """Stop the local simulation SuperLink of FLWR_HOME and the flower-superexec it started (--parent-pid);
    returns the survivors. Each is signalled with its process group when it leads one (they do)."""
    superlinks = local_superlink_pids(home)
    targets = list(superlinks)
    for entry in Path("/proc").iterdir() if superlinks else []:
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            if "--parent-pid" in argv and argv[argv.index("--parent-pid") + 1 :][:1] in ([str(p)] for p in superlinks):
                targets.append(int(entry.name))

    def signal_all(sig: int) -> None:
        for pid in targets:
            try:
                pgid = os.getpgid(pid)
            except ProcessLookupError:
                continue
            _signal(pid, pgid if pgid == pid else None, sig)

    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        signal_all(sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(_alive(p) for p in targets):
            time.sleep(0.2)
    return [p for p in targets if _alive(p)]


# ---------------------------------------------------------------------------------------------- CLI


def failure_line(exc: Exception, overrides: str) -> str:
    """The one line of a command that failed: a run's failure or a setting or dataset problem (SpecError) as it
    says itself, overrides that do not compose (a typo) as Hydra's lines in one."""
    return override_error(exc, split_overrides(overrides)) if isinstance(exc, HydraException) else str(exc)


def main(argv: list[str] | None = None, prog: str = "python -m simulations.deploy") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_start = sub.add_parser("start", help="start a SuperLink and one SuperNode per table; returns at once")
    p_stop = sub.add_parser("stop", help="stop the deployment recorded in --state-dir")
    p_run = sub.add_parser("run", help="start, `flwr run` one job (waits for it), stop")
    p_local = sub.add_parser("stop-local", help="stop the local simulation SuperLink `flwr run .` left running")
    p_predict = sub.add_parser("predict", help="start, `flwr run` a prediction request for RUN_DIR's model, stop")
    p_clients = sub.add_parser("clients", help="the tables (SuperNodes) of a run and its `flwr run .` command")
    p_pki = sub.add_parser(
        "pki", help="the SuperLink operator's CA and SuperLink certificate (ca.crt goes to everyone)"
    )
    p_pki.add_argument("--dir", required=True, help="where to write ca.crt, ca.key, server.crt, server.key")
    p_pki.add_argument(
        "--host",
        action="append",
        default=None,
        help="a name or address the SuperLink is reached at (repeatable; default 127.0.0.1 and localhost)",
    )
    p_keygen = sub.add_parser("keygen", help="a table owner's SuperNode key pair (KEY, 0600, and KEY.pub to register)")
    p_keygen.add_argument("key", help="path of the private key to write")
    p_predict.add_argument("--run-dir", required=True, help="the training run's directory (model.json)")
    p_predict.add_argument("--rows", required=True, help="the query owner's new rows (CSV or Parquet)")
    p_predict.add_argument("--table", help="the query table (default: the label table)")
    p_predict.add_argument("--shard", type=int, default=0, help="the query table's shard whose owner holds them")
    p_predict.add_argument("--per-joined-row", action="store_true", help="a line per joined row, not per new row")
    for p in (p_start, p_run, p_clients, p_predict):
        p.add_argument(
            "--overrides",
            default="algorithm=admm",
            help="Hydra overrides (one string); selects the dataset, hence the tables",
        )
        p.add_argument("--port", type=int, default=None, help="SuperLink port on 127.0.0.1 (default: a free one)")
        p.add_argument(
            "--config-dir",
            default=None,
            help="a folder with dataset/NAME.yaml (your own tables), as simulations.run's --config-dir",
        )
    p_run.add_argument("--run-dir", required=True, help="directory for results.json")
    p_clients.add_argument(
        "--run-dir", default=None, help="the run dir of the `flwr run` command it prints (default: outputs/flwr/run)"
    )
    p_start.add_argument(
        "--run-dir", default=None, help="the run dir of the `flwr run` command it prints (default: STATE_DIR/run)"
    )
    p_run.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its last checkpoint")
    for p in (p_start, p_run, p_predict):
        p.add_argument(
            "--insecure",
            action="store_true",
            help="plain text and no SuperNode authentication (default: TLS + node authentication)",
        )
    for p in (p_start, p_stop, p_run, p_predict):
        p.add_argument("--state-dir", default=str(DEFAULT_STATE_DIR), help="deployment.json and the process logs")
    for p in (p_start, p_run, p_local, p_predict):
        p.add_argument(
            "--flwr-home",
            default=None,
            help="Flower home (default: $FLWR_HOME, else STATE_DIR/flwr; stop-local: ~/.flwr)",
        )
    args = parser.parse_args(argv)
    if getattr(args, "config_dir", None):  # every process composes the run from its overrides: the folder in them
        folder = Path(args.config_dir).expanduser().resolve()
        if not folder.is_dir():
            print(f"error: --config-dir {args.config_dir}: no such folder", file=sys.stderr)
            return 1
        args.overrides = f"{args.overrides} {searchpath_override(folder)}"

    if args.command == "start":
        try:
            dep = start(args.overrides, args.state_dir, args.port, args.flwr_home, insecure=args.insecure)
        except (RunFailed, ValueError, HydraException) as exc:
            print(f"error: {failure_line(exc, args.overrides)}", file=sys.stderr)
            return 1
        security = f"TLS (CA {dep.ca}) + SuperNode authentication" if dep.secure else "INSECURE"
        print(f"SuperLink {dep.address}, {security} (connection {dep.connection!r} in {dep.flwr_home}/config.toml)")
        for p in dep.processes[1:]:
            print(f"  {p['name']}: pid {p['pid']}, log {p['log']}")
        job = args.overrides if "algorithm=" in args.overrides else f"algorithm=admm {args.overrides}".strip()
        print(f"run:  {started_run_command(dep, job, args.run_dir or Path(args.state_dir) / 'run')}")
        print(f"stop: python -m simulations.deploy stop --state-dir {args.state_dir}")
    elif args.command == "stop":
        if not (Path(args.state_dir) / "deployment.json").is_file():
            print(f"error: no deployment recorded in {args.state_dir} (its --state-dir?)", file=sys.stderr)
            return 1
        if not tagged_pids(Deployment.load(args.state_dir).tag):
            print(f"nothing running: the deployment recorded in {args.state_dir} had stopped")
            return 0
        left = stop(args.state_dir)
        print(f"still alive: {left}" if left else "stopped")
        return 1 if left else 0
    elif args.command == "run":
        try:
            run(
                args.overrides,
                args.run_dir,
                args.state_dir,
                args.port,
                args.flwr_home,
                insecure=args.insecure,
                resume=args.resume,
            )
        except (RunFailed, ValueError, HydraException) as exc:
            print(f"error: {failure_line(exc, args.overrides)}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # its deployment is stopped (submit's finally, or the processes' parent-death signal)
            print(
                "error: interrupted (Ctrl-C); the deployment it started is stopped; the run continues from its last "
                f"checkpoint with the same command and --resume (results: {Path(args.run_dir).resolve()})",
                file=sys.stderr,
            )
            return 130
    elif args.command == "predict":
        try:
            predict(
                args.overrides,
                args.run_dir,
                args.rows,
                args.state_dir,
                args.port,
                args.flwr_home,
                insecure=args.insecure,
                shard=args.shard,
                table=args.table,
                per_joined_row=args.per_joined_row,
            )
        except (RunFailed, ValueError, HydraException) as exc:
            print(f"error: {failure_line(exc, args.overrides)}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("error: interrupted (Ctrl-C); the deployment it started is stopped", file=sys.stderr)
            return 130
    elif args.command == "clients":
        try:
            clients = clients_of(args.overrides)
        except (SpecError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(" ".join(t for t, _ in clients))
        print(simulation_run_command(args.overrides, len(clients), args.run_dir or Path("outputs") / "flwr" / "run"))
    elif args.command == "pki":
        tls = make_server_tls(args.dir, tuple(args.host) if args.host else ("127.0.0.1", "localhost"))
        print(f"CA {tls.ca} (give it to the node owners and to `flwr run` users); SuperLink {tls.cert}, {tls.key}")
    elif args.command == "keygen":
        private, public = make_node_keys(args.key)
        print(
            f"private key {private} (stays on this machine); public key {public} (give it to the SuperLink's "
            "operator: flwr supernode register)"
        )
    elif args.command == "stop-local":
        left = stop_local(args.flwr_home)
        print(f"still alive: {left}" if left else "stopped")
        return 1 if left else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
