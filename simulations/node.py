"""A table owner's node: ``python -m simulations.node --client-config owner.yaml --superlink HOST:PORT ...``.

Starts the owner's SuperNode with process isolation (``flower-supernode --isolation process``: it runs no
app of its own and serves a Runtime API on loopback) and this process, the node service
(tpflower.app.node_service), which answers every message of every run with the tpflower the owner installed.
It never installs, imports or runs code from a run's app bundle (FAB); a run whose app is not this tpflower
version is refused with one line naming the node and the app. The settings file, its secret and the data
are read only by this process (docs/threat-model.md "The node service"): run the SuperNode as an OS user
that cannot read them (``--supernode-user``, when started as root) or start the two yourself
(``--runtime-port`` with ``--no-supernode``).

    python -m simulations.node --client-config clients/ratings-0.yaml --superlink 10.0.0.5:9092 \\
        --root-certificates ca.crt --auth-supernode-private-key clients/ratings-0.key
"""

from __future__ import annotations

import argparse
import logging
import os
import pwd
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import yaml

from simulations.child_process import parent_death_signal

HOST = "127.0.0.1"
WARMED = "torch and the training code imported"  # the node's log line once its warm-up is done
#: Flower's lines when the SuperLink refuses to activate the SuperNode: exit code 305 (SUPERNODE_CONNECTION_ERROR)
#: with API error 2004 (FLEET_NODE_ACTIVATION_FAILED: the SuperLink holds this key's node online, another node's
#: or the last session of one that crashed; the same error when the key is not registered). The process itself
#: exits with status 1, as for any Flower error.
NOT_ACTIVATED = ("Exit Code: 305", "[code: 2004]")
CONNECTION_ERROR = NOT_ACTIVATED[0]
#: Flower's line as its SuperNode retries a SuperLink that does not answer (no SuperLink at --superlink, or one
#: restarting): it retries without end, so the node says once which address it waits for
RETRYING = "Connection attempt failed, retrying"
#: Flower's SuperNode ends "gracefully", exit code 0, when the SuperLink refuses its pull or heartbeat (401: a
#: restarted SuperLink forgot its session), as it does on SIGTERM: a SIGTERM to the node's process group stops
#: the service too, whose handler runs once its task lets it (up to 10 s); only then is it the SuperLink's doing
SESSION_WAIT_S = 10.0
ACTIVATION_RETRY_S, RETRY_WAIT_S = 120.0, 5.0  # how long the service starts a refused SuperNode again, how often
STOP_S = 5.0  # a stopped SuperNode's time to end before SIGKILL (Flower's own forced exit comes after 5 s)
STOCK_SUPERNODE = (
    "import sys; from flwr.supernode.cli import flower_supernode; sys.argv[0] = 'flower-supernode'; flower_supernode()"
)


def supernode_command(
    superlink: str,
    runtime_port: int,
    node_config: str,
    root_certificates: str | None,
    auth_key: str | None,
    fast: bool = True,
    python: str | None = None,
) -> list[str]:
    """The owner's SuperNode: process isolation, Runtime API on 127.0.0.1:``runtime_port``; TLS verified
    against ``root_certificates`` (else plain text) and authenticated by ``auth_key`` when given; run by
    ``python`` (default: this interpreter)."""
    security = (
        ["--root-certificates", root_certificates] + (["--auth-supernode-private-key", auth_key] if auth_key else [])
        if root_certificates
        else ["--insecure"]
    )
    if fast:
        program = [python or sys.executable, "-m", "tpflower.app.supernode"]
    else:  # Flower's own program, by that interpreter if given
        program = [python, "-c", STOCK_SUPERNODE] if python else ["flower-supernode"]
    return [
        *program,
        *security,
        "--superlink",
        superlink,
        "--isolation",
        "process",
        "--host",
        HOST,
        "--port",
        str(runtime_port),
        "--node-config",
        node_config,
    ]


def owner_table(client_config: str | Path, table: str | None) -> str:
    """The table the settings file serves (its ``table`` key), or ``table`` when given."""
    if table:
        return table
    try:
        raw = yaml.safe_load(Path(client_config).read_text()) or {}
    except OSError as exc:
        raise SystemExit(f"error: cannot read --client-config {client_config}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        from tpflower.owner import yaml_problem  # noqa: PLC0415  (argparse errors first: no heavy imports)

        raise SystemExit(f"error: --client-config {client_config}: {yaml_problem(exc)}") from None
    if not isinstance(raw, dict) or not raw.get("table"):
        raise SystemExit(f"error: --client-config {client_config} names no table; pass --table")
    return str(raw["table"])


def state_dir_problem(state: Path) -> str | None:
    """None if the node can keep its state in folder ``state`` (made on first use), else why not."""
    if state.exists():
        return None if state.is_dir() and os.access(state, os.W_OK | os.X_OK) else "is not a folder it can write"
    parent = next(p for p in state.parents if p.exists())
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be made: {parent} is not a folder it can write"
    return None


def settings_problem(client_config: str, table: str, shard: int = 0) -> str | None:
    """None if the owner's settings file and data are what a run will find, else one line saying what is
    wrong (docs/deployment.md, the node service): the settings as a run's hello reads them
    (tpflower.owner), the algorithms it allows named as installed ones are, and its ``source`` file read with
    the node's reader, filtered by its ``where``, holding every column it exposes (join keys, features,
    label, a shard column) with the values a run's checks accept (:func:`owner_table_problems`)."""
    from tpflower.checks import DataProblems, errors  # noqa: PLC0415  (argparse errors first: no heavy imports)
    from tpflower.datasets.files import read_table  # noqa: PLC0415
    from tpflower.owner import read_owner_settings  # noqa: PLC0415
    from tpflower.registry import algorithm_names, release_families  # noqa: PLC0415
    from tpflower.schema import SpecError  # noqa: PLC0415
    from tpflower.sql.predicate import filter_rows  # noqa: PLC0415

    try:
        owner = read_owner_settings(client_config, table)
        if owner.algorithms and (problem := owner.algorithms_problem(algorithm_names())):
            return problem
        if owner.exact_releases and (problem := owner.releases_problem(release_families())):
            return problem
        if problem := state_dir_problem(Path(owner.state_dir)):  # else the run's first message: '[Errno 17] ...'
            return f"table {table!r}: {client_config}: state_dir {owner.state_dir} {problem}"
        if problem := shard_problem(owner.shards, shard):
            return f"table {table!r}: {client_config}: {problem}"
        if owner.source is None:  # a bundled table (loader): its loader makes it when a run asks
            return None
        frame = filter_rows(table, read_table(table, owner.source, keys=owner.exposed.keys), owner.where)
    except DataProblems as exc:
        return exc.one_line(values=True)
    except SpecError as exc:
        return str(exc)
    shard_column = (owner.shards.by,) if owner.shards is not None and owner.shards.by is not None else ()
    missing = [c for c in (*owner.exposed.all, *shard_column) if c not in frame.columns]
    if missing:
        return (
            f"table {table!r}: source file {owner.source} has no column(s) {missing}, which {client_config} "
            f"names; its columns are {list(frame.columns)}"
        )
    if problems := errors(
        owner_table_problems(table, owner, frame, f"the columns: of its settings file {client_config}")
    ):
        return f"source file {owner.source}: {DataProblems(problems).one_line(values=True)}"
    return None


def shard_problem(shards: Any, shard: int) -> str | None:
    """None if ``--shard`` ``shard`` is one of the shards the settings' ``shards`` split the file into (no
    ``shards``: 0, the whole file), else one line; a split by a column without its ``values`` is the data's to
    tell (the run's). (Before, a node of shard 3 of an unsplit file served, and each run found no such shard.)"""
    count = 1 if shards is None else shards.parts if shards.parts is not None else None
    if shards is not None and count is None and shards.values is not None:
        count = len(shards.values)
    if shard < 0 or (count is not None and shard >= count):
        split = "no shards: it serves its whole file as shard 0" if shards is None else f"its shards are 0-{count - 1}"
        return f"--shard {shard} is no shard of this table ({split})"
    return None


def owner_table_problems(table: str, owner: Any, frame: Any, declared: str | None = None) -> list:
    """The problems of the owner's table that its settings alone show (tpflower.checks.table_problems, as a
    run's first message would find them: text in a numeric column, no rows, a column both numeric and
    categorical; the label's only when its owner states its task), with a one-table spec built from the
    columns it exposes. ``declared``: where its hints send the owner to declare a column (its settings file's
    ``columns:``, what a node's owner edits, not a dataset config)."""
    from tpflower.checks import table_problems  # noqa: PLC0415
    from tpflower.schema import LabelSpec, RelationalSpec, TableSpec  # noqa: PLC0415

    e = owner.exposed
    spec = RelationalSpec(
        name=table,
        tables=(TableSpec(name=table, source=str(owner.source), numeric=e.numeric, categorical=e.categorical),),
        label=LabelSpec(e.label, table, e.label_task, e.label_classes)
        if e.label is not None and e.label_task is not None
        else LabelSpec(e.label or "", None, "regression"),
        joins=(),  # its join keys: a run checks those it joins on (a key column no run joins may miss values)
    )
    return table_problems(spec, table, frame, declared)


def certificate_problem(path: str) -> str | None:
    """None if file ``path`` holds a PEM certificate, read as Flower's SuperNode reads its root certificates,
    else one line saying what it holds. (Flower's SuperNode raised ssl.SSLError 'no start line' in its main
    thread, its traceback, and the node hung: its Runtime API server kept the SuperNode's process alive.)"""
    import ssl  # noqa: PLC0415

    data = Path(path).read_bytes()
    try:
        ssl.create_default_context().load_verify_locations(cadata=data.decode("ascii"))
    except (ssl.SSLError, UnicodeDecodeError, ValueError) as exc:
        what = "a private key" if b"PRIVATE KEY" in data else "no PEM certificate"
        return (
            f"{path} holds {what} ({exc.__class__.__name__}: {exc}); give the CA certificate the SuperLink's "
            "operator handed out (ca.crt, '-----BEGIN CERTIFICATE-----')"
        )
    return None


def forward_output(stream: IO[str], out: IO[str], seen: set[str], unreachable: str = "") -> None:
    """Copy the SuperNode's output ``stream`` to ``out`` line by line, adding to ``seen`` each of
    :data:`NOT_ACTIVATED` a line holds; at its first :data:`RETRYING` line, the line ``unreachable`` too."""
    for line in stream:
        out.write(line)
        if unreachable and RETRYING in line and RETRYING not in seen:
            seen.add(RETRYING)
            out.write(unreachable + "\n")
        out.flush()
        seen.update(marker for marker in NOT_ACTIVATED if marker in line)


def supernode_exit_line(node: str, code: int, seen: set[str]) -> str:
    """The node's last line when its SuperNode exited with ``code``, its output having shown ``seen``."""
    if seen >= set(NOT_ACTIVATED):
        return (
            f"node {node}: the SuperLink refused to activate this node's key for {ACTIVATION_RETRY_S:.0f} s (Flower's "
            "exit code 305, error 2004): another node with this key is connected (stop it, or start this one again "
            "once the SuperLink drops that node's session, about a minute after it stopped), or the SuperLink's "
            "operator has not registered this key (flwr supernode register KEY.pub)"
        )
    if CONNECTION_ERROR in seen:
        return (
            f"node {node}: the SuperNode could not connect to the SuperLink (Flower's exit code 305, above): check "
            "--superlink, --root-certificates and that the operator registered this node's public key"
        )
    if code == 0:  # Flower's SuperNode ends "gracefully" when the SuperLink refuses it (SESSION_WAIT_S)
        return (
            f"node {node}: the SuperNode ended (exit code 0): the SuperLink ended this node's session (a SuperLink "
            "restarted without --database forgets the registered keys); start the node again once the SuperLink "
            "is up and its operator has registered this node's key (flwr supernode register KEY.pub)"
        )
    return f"node {node}: the SuperNode exited with code {code}"


class SuperNodeChild:
    """The owner's SuperNode, a child of the node service: its log (stderr) copied to the service's and read for
    why it exited; started again while the SuperLink refuses to activate its key (:data:`ACTIVATION_RETRY_S`);
    stopped within :data:`STOP_S`."""

    def __init__(
        self,
        cmd: list[str],
        env: dict[str, str],
        preexec: Callable[[], None] | None,
        node: str,
        stop: threading.Event,
        exit: Callable[[int], None] = os._exit,
    ) -> None:
        self.cmd, self.env, self.preexec, self.node, self.stop, self.exit = cmd, env, preexec, node, stop, exit
        self.seen: set[str] = set()  # Flower's NOT_ACTIVATED lines in the current SuperNode's output
        self.reported = threading.Event()  # its watcher said why it exited
        self.proc, self.reader = self._start()

    def _start(self) -> tuple[subprocess.Popen, threading.Thread]:
        proc = subprocess.Popen(
            self.cmd,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            preexec_fn=self.preexec,
        )
        assert proc.stderr is not None
        self.seen.clear()
        superlink = self.cmd[self.cmd.index("--superlink") + 1] if "--superlink" in self.cmd else "--superlink"
        unreachable = (
            f"node {self.node}: no SuperLink answers at {superlink} (the SuperNode retries, above, until one does): "
            "check --superlink and that the SuperLink is running"
        )
        reader = threading.Thread(
            target=forward_output, args=(proc.stderr, sys.stderr, self.seen, unreachable), daemon=True
        )
        reader.start()
        return proc, reader

    def watch(self) -> None:
        """Until the SuperNode exits for good (in a thread): then, unless the service stopped it, say why, set
        ``stop`` and end the process 5 s later if the service's loop has not (a call stuck in retries)."""
        deadline = time.monotonic() + ACTIVATION_RETRY_S
        while True:
            code = self.proc.wait()
            self.reader.join(timeout=5.0)  # its last lines say why it exited
            if self.stop.is_set():  # the service stops it (SIGTERM, Ctrl-C): nothing to say
                return
            if code == 0 or not self.seen >= set(NOT_ACTIVATED) or time.monotonic() >= deadline:
                break
            # another node with this key is connected, or the SuperLink still holds this node's last session
            # (a restart after a crash): it lets the node in once that session times out
            print(
                f"node {self.node}: the SuperLink does not activate this node's key yet (another node with it is "
                "connected, its last session has not timed out, or the key is not registered); again in "
                f"{RETRY_WAIT_S:.0f} s",
                flush=True,
            )
            if self.stop.wait(RETRY_WAIT_S):
                return
            self.proc, self.reader = self._start()
        if code == 0 and self.stop.wait(SESSION_WAIT_S):  # stopped with its service: nothing to say
            return
        if code != -signal.SIGTERM:
            print(supernode_exit_line(self.node, code, self.seen), flush=True)
            self.reported.set()
        self.stop.set()
        time.sleep(5.0)
        self.exit(1)

    def terminate(self, grace: float = STOP_S) -> int | None:
        """Stop the SuperNode (SIGTERM; SIGKILL after ``grace`` s); its exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def end_after(supernode: SuperNodeChild | None, seconds: float, exit: Callable[[int], None] = os._exit) -> None:
    """A stopped node's last resort, in a thread: ``seconds`` after the stop, or 1 s after its SuperNode ended
    (the service's loop may be retrying a call to it), kill its SuperNode and end the process (status 0: its
    owner stopped it)."""
    deadline, gone = time.monotonic() + seconds, None
    while time.monotonic() < deadline:
        if supernode is not None and supernode.proc.poll() is not None:
            gone = gone or time.monotonic()
            if time.monotonic() - gone > 1.0:
                break
        time.sleep(0.1)
    if supernode is not None and supernode.proc.poll() is None:
        supernode.proc.kill()
    sys.stdout.flush()
    sys.stderr.flush()
    exit(0)


def _as_user(name: str | None):  # pragma: no cover - needs root
    if not name:
        return None
    entry = pwd.getpwnam(name)

    def switch() -> None:
        parent_death_signal(signal.SIGKILL)()
        os.setgroups([])
        os.setgid(entry.pw_gid)
        os.setuid(entry.pw_uid)

    return switch


def supernode_start_problem(python: str, user: str | None, env: dict[str, str]) -> str | None:
    """None if ``python`` (as ``user``, when given) can import Flower's SuperNode and tpflower's adapter, else
    one line saying why not and what to do: a SuperNode as another OS user needs an interpreter that user can
    run (this venv's may sit in a directory only its owner can enter)."""
    probe = [python, "-c", "import flwr.supernode.cli, tpflower.app.supernode"]
    who = f"user {user!r}" if user else "this user"
    try:
        done = subprocess.run(
            probe,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
            preexec_fn=_as_user(user),
        )
    except OSError as exc:
        reason = exc.strerror or str(exc)
    else:
        if done.returncode == 0:
            return None
        reason = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
    return (
        f"error: the SuperNode cannot start as {who} with {python}: {reason}; pass --supernode-python an "
        "interpreter that user can run with flwr and tpflower installed, or start the SuperNode yourself "
        "(--no-supernode; docs/deployment.md)"
    )


def reset_label_dp(client_config: str, table: str | None) -> int:
    """The owner's reset of its label-DP draws (docs/settings.md, Privacy): a new draw at the next run."""
    from tpflower.owner import load_owner_settings  # noqa: PLC0415  (argparse errors first: no heavy imports)
    from tpflower.privacy.budget import reset_label_draws  # noqa: PLC0415

    owner = load_owner_settings(client_config, owner_table(client_config, table))
    removed = reset_label_draws(owner.state_dir or ".")
    print(f"removed {len(removed)} label-DP draw(s) of table {owner.table!r}; the next run draws afresh")
    return 0


def show_importance(client_config: str, table: str | None, shard: int, run_id: str) -> int:
    """The owner's view of a boosted-trees run: which of its table's columns the run's splits are on, from its
    saved part (tpflower.model_part.ModelPart.importance); nothing is sent anywhere."""
    from tpflower.model_part import ModelPart  # noqa: PLC0415  (argparse errors first: no heavy imports)
    from tpflower.owner import load_owner_settings  # noqa: PLC0415

    owner = load_owner_settings(client_config, owner_table(client_config, table))
    state_dir = owner.state_dir or "."
    try:
        part = ModelPart.load(state_dir, run_id, owner.table, shard)
        if part is None:
            raise ValueError(f"table {owner.table!r} shard {shard}: no saved part of run {run_id} in {state_dir}")
        columns = part.importance()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    total = sum(c["splits"] for c in columns.values())
    print(f"table {owner.table!r} shard {shard}, run {run_id}: {total} splits (share of the table's split gain)")
    for name, c in columns.items():
        print(f"  {name}: {100 * c['share']:.1f}% ({c['splits']} splits)")
    return 0


def main(argv: list[str] | None = None, prog: str = "python -m simulations.node") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--client-config", help="the owner's settings file (tpflower.owner)")
    parser.add_argument("--superlink", help="the SuperLink's Fleet API, HOST:PORT")
    parser.add_argument("--table", default=None, help="the table served (default: the settings file's `table`)")
    parser.add_argument("--shard", type=int, default=0)
    parser.add_argument("--root-certificates", default=None, help="the SuperLink operator's CA (TLS)")
    parser.add_argument("--auth-supernode-private-key", default=None, help="this node's registered private key")
    parser.add_argument("--insecure", action="store_true", help="plain text to the SuperLink (no TLS)")
    parser.add_argument("--runtime-port", type=int, default=None, help="the SuperNode's loopback Runtime API port")
    parser.add_argument("--no-supernode", action="store_true", help="attach to a SuperNode started separately")
    parser.add_argument("--supernode-user", default=None, help="OS user to run the SuperNode as (when root)")
    parser.add_argument(
        "--supernode-python",
        default=None,
        help="the interpreter that runs the SuperNode (default: this one); with --supernode-user, one that user "
        "can run, with flwr and tpflower installed",
    )
    parser.add_argument(
        "--doorbell-port",
        type=int,
        default=None,
        help="with --no-supernode: the loopback UDP port the SuperNode started as `python -m tpflower.app.supernode` "
        "with TPFLOWER_TASK_DOORBELL=PORT rings when a task is ready (else the service polls)",
    )
    parser.add_argument("--slow-supernode", action="store_true", help="Flower's own SuperNode sleeps (3 s idle)")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="threads for torch's (and OpenMP's) parallel work in this service (default: torch's, one per core); "
        "nodes that share a machine's cores each take their share (simulations.deploy start does)",
    )
    parser.add_argument(
        "--reset-label-dp",
        action="store_true",
        help="delete this node's stored label-DP draws (the next run draws afresh, spending the label budget "
        "again) and exit",
    )
    parser.add_argument(
        "--importance",
        metavar="RUN_ID",
        help="print which of the table's columns the boosted trees of run RUN_ID split on (this node's saved part: "
        "splits and share of the gain per column) and exit",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="print the state of each of tpflower's Flower adapters with the installed Flower and exit "
        "(status 1 if any is off)",
    )
    args = parser.parse_args(argv)
    if args.check:
        from tpflower.app.flower_guard import ADAPTERS, report, state  # noqa: PLC0415

        print("\n".join(report()))
        return 0 if all(state(name)[0] for name in ADAPTERS) else 1
    if not args.client_config:
        parser.error("--client-config is required")
    if args.reset_label_dp:
        return reset_label_dp(args.client_config, args.table)
    if args.importance:
        return show_importance(args.client_config, args.table, args.shard, args.importance)
    if args.torch_threads is not None:
        if args.torch_threads < 1:
            parser.error(f"--torch-threads must be >= 1, got {args.torch_threads}")
        # read as torch (and its OpenMP runtime) loads, for every thread: torch is not imported yet
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.torch_threads)
    level = logging.DEBUG if os.environ.get("TPFLOWER_NODE_TRACE") == "1" else logging.INFO
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(message)s")
    if level > logging.DEBUG:  # Flower's logger prints its lines itself: through ours too, each came twice (and
        logging.getLogger("flwr").propagate = False  # its DEBUG ones: 'Connection attempt failed with exception')
    for noisy in ("httpx", "httpcore"):  # one line per Runtime API call otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)

    from simulations.deploy import free_port  # noqa: PLC0415  (argparse errors first: no heavy imports)
    from tpflower.app.flower_guard import enabled  # noqa: PLC0415
    from tpflower.app.flower_patch import DOORBELL_ENV  # noqa: PLC0415
    from tpflower.app.node_service import (  # noqa: PLC0415
        OwnerNode,
        installed_app,
        open_doorbell,
        serve,
        wait_for_runtime,
        warmed,
    )
    from tpflower.owner import SECRET_ENV  # noqa: PLC0415

    table = owner_table(args.client_config, args.table)
    owner = OwnerNode(table, args.shard, str(Path(args.client_config).resolve()))
    problem = settings_problem(args.client_config, table, args.shard)  # before anything starts, not at a run's
    if problem:
        print(f"error: node {owner.name}: {problem}", file=sys.stderr, flush=True)
        return 1
    port = args.runtime_port or free_port()
    address = f"{HOST}:{port}"
    stop = threading.Event()
    supernode: SuperNodeChild | None = None
    bell = None
    if not args.no_supernode:
        if not args.superlink:
            parser.error("--superlink HOST:PORT is required unless --no-supernode")
        if not args.insecure and not args.root_certificates:
            parser.error("--root-certificates CA is required (or --insecure for plain text)")
        for option, path in (
            ("--root-certificates", None if args.insecure else args.root_certificates),
            ("--auth-supernode-private-key", args.auth_supernode_private_key),
        ):  # else Flower's SuperNode says it (a missing key: its traceback) after the node started
            if path and not Path(path).is_file():
                print(f"error: node {owner.name}: {option} {path}: no such file", file=sys.stderr, flush=True)
                return 1
        if not args.insecure and (problem := certificate_problem(args.root_certificates)):
            print(f"error: node {owner.name}: --root-certificates {problem}", file=sys.stderr, flush=True)
            return 1
        cmd = supernode_command(
            args.superlink,
            port,
            f'table="{table}" shard={args.shard}',  # no path of the owner's: the SuperNode never reads them
            None if args.insecure else args.root_certificates,
            args.auth_supernode_private_key,
            fast=not args.slow_supernode,
            python=args.supernode_python,
        )
        env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}  # the secret stays with the service
        if args.supernode_user or args.supernode_python:
            problem = supernode_start_problem(cmd[0], args.supernode_user, env)
            if problem:
                print(problem, file=sys.stderr, flush=True)
                return 2
        if not args.slow_supernode and enabled("tasks-when-ready", notice=False):  # it rings when a task is ready
            bell = open_doorbell()
            env[DOORBELL_ENV] = str(bell.getsockname()[1])

        supernode = SuperNodeChild(
            cmd, env, _as_user(args.supernode_user) or parent_death_signal(signal.SIGKILL), owner.name, stop
        )
        threading.Thread(target=supernode.watch, daemon=True).start()
    elif args.doorbell_port:
        bell = open_doorbell(args.doorbell_port)
    requested = threading.Event()  # the owner stops the node (SIGTERM, Ctrl-C)

    def on_stop(*_: object) -> None:
        requested.set()
        stop.set()
        # a task in progress, or a Runtime API call retrying a SuperNode that is gone, may hold the loop: end anyway
        threading.Thread(target=end_after, args=(supernode, 2 * STOP_S), daemon=True).start()

    signal.signal(signal.SIGTERM, on_stop)
    app_id, app_version = installed_app()
    print(f"node {owner.name}: serving {app_id} {app_version} on the SuperNode's Runtime API {address}", flush=True)
    try:
        wait_for_runtime(address, 120.0, lambda: not stop.is_set())  # (its watcher sets stop when it gives up)
        from tpflower.app.client_app import app, warm_up  # noqa: PLC0415  pandas, Hydra: once, kept across runs

        def warm() -> None:
            began = time.perf_counter()
            warm_up()
            print(f"node {owner.name}: {WARMED} ({time.perf_counter() - began:.1f} s)", flush=True)

        serve(address, owner, warmed(app.respond, warm), stop=stop, bell=bell)  # type: ignore[attr-defined]
    except KeyboardInterrupt:
        on_stop()
    except RuntimeError:  # the SuperNode exited before its Runtime API answered: its watcher says why
        if not stop.is_set():
            raise
    finally:
        code = supernode.terminate() if supernode is not None else None
    failed = not requested.is_set() and code not in (-signal.SIGTERM, None)  # 0: the SuperLink ended its session
    if failed and supernode is not None and not supernode.reported.is_set():
        print(f"node {owner.name}: the SuperNode exited with code {code}", flush=True)
    # the node keeps nothing in memory that is not on disk: skip the interpreter's teardown of torch, pandas and
    # Flower (1.5-3.5 s measured on an idle machine), so a stopped node ends at once
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
