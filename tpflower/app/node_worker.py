"""A deployed node's worker: one long-lived process per node (table shard) that answers the node's messages.

Flower 1.41's SuperNode starts a fresh ``flwr-clientapp`` process for every message; importing torch, pandas
and Hydra and re-reading and re-preprocessing the table there costs seconds per message. So the ClientApp
entry point (tpflower.app.node_app) of a deployed node only forwards each message (its type, content, the
node's context.state, node and run config) over a Unix socket to this worker and hands the reply and the new
state back to Flower. The worker keeps the imports, the composed config and the prepared table between
messages (tpflower.app.client_app's caches); the state still travels with every message, so Flower's view of
the node (context.state) is the truth and a restarted worker loses nothing.

The first message of a node starts its worker (from the same installed app, with the node's environment:
its secret stays on the node). The socket is private to the node's user (a 0700 directory, a 0600 socket)
and named by the app's code directory and the node config, so a new app version or another node never talks
to a stale worker. A worker exits after :data:`IDLE_EXIT_S` without messages. A worker that cannot start
(or ``TPFLOWER_NODE_WORKER=0``) leaves the node answering in the message's own process, as before.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flwr.app import Context, RecordDict

from tpflower.records import recorddict_bytes as _to_bytes
from tpflower.records import recorddict_of as _from_bytes

IDLE_EXIT_S = 900.0
START_TIMEOUT_S = 120.0
ENV_SWITCH = "TPFLOWER_NODE_WORKER"  # "0": answer in the message's process


class WorkerError(RuntimeError):
    """The worker's answer was an error (its message is the client's own error line)."""


def code_dir() -> Path:
    """The installed app's root (the FAB's directory under $FLWR_HOME/apps, or the project)."""
    return Path(__file__).resolve().parents[2]


def socket_path(node_config: dict[str, Any]) -> Path:
    """The node's worker socket: in a private directory, named by the app's code and the node config (short:
    Unix socket paths are limited to about 100 bytes)."""
    ident = json.dumps([str(code_dir()), sorted((str(k), str(v)) for k, v in node_config.items())])
    folder = private_dir(Path(tempfile.gettempdir()) / f"tpflower-{os.getuid()}")
    return folder / f"{hashlib.sha256(ident.encode()).hexdigest()[:20]}.sock"


def private_dir(folder: Path) -> Path:
    """``folder`` created 0700; refused if it is a symlink, not a directory, or owned by another user (someone
    else's directory in a shared /tmp could stand in for the worker's socket)."""
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise PermissionError(f"node worker directory {folder} is not a directory owned by uid {os.getuid()}")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(folder, 0o700)
    return folder


# ------------------------------------------------------------------------------------------------ frames


def _send(conn: socket.socket, *frames: bytes) -> None:
    conn.sendall(b"".join(struct.pack("!Q", len(f)) + f for f in frames))


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("the node worker closed the connection")
        buf += chunk
    return bytes(buf)


def _recv(conn: socket.socket, count: int) -> list[bytes]:
    return [_recv_exact(conn, struct.unpack("!Q", _recv_exact(conn, 8))[0]) for _ in range(count)]


# ------------------------------------------------------------------------------------------------ client side


def enabled(context: Context) -> bool:
    """A deployed node (its node config names its owner's settings) with the worker not switched off."""
    return bool(context.node_config.get("client-config")) and os.environ.get(ENV_SWITCH, "1") != "0"


def forward(message_type: str, content: RecordDict, context: Context) -> RecordDict:
    """Have the node's worker answer one message; context.state becomes the state the worker returns."""
    path = socket_path(dict(context.node_config))
    conn = _connect(path) or _start(path)
    header = {
        "type": message_type,
        "run_id": context.run_id,
        "node_id": context.node_id,
        "node_config": dict(context.node_config),
        "run_config": dict(context.run_config),
    }
    with conn:
        _send(conn, json.dumps(header, default=str).encode(), _to_bytes(content), _to_bytes(context.state))
        status, reply, state = _recv(conn, 3)
    answer = json.loads(status)
    if not answer["ok"]:
        raise WorkerError(answer["error"])
    new_state = _from_bytes(state)
    for name in list(context.state.keys()):
        del context.state[name]
    for name, record in new_state.items():
        context.state[name] = record
    return _from_bytes(reply)


def _connect(path: Path) -> socket.socket | None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(path))
        return conn
    except OSError:
        conn.close()
        return None


def _start(path: Path) -> socket.socket:
    """Start the node's worker (one at a time: a lock next to the socket) and connect to it."""
    fd = os.open(path.with_suffix(".lock"), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        conn = _connect(path)  # another message's process may have started it meanwhile
        if conn is not None:
            return conn
        path.unlink(missing_ok=True)  # a stale socket of a worker that died
        log = path.with_suffix(".log")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(code_dir()), os.environ.get("PYTHONPATH", "")])}
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tpflower.app.node_worker", str(path)],
                cwd=code_dir(),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            conn = _connect(path)
            if conn is not None:
                return conn
            if proc.poll() is not None:
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
                raise RuntimeError(f"the node worker exited with code {proc.returncode}; {log}:\n{tail}")
            time.sleep(0.05)
        raise RuntimeError(f"the node worker did not start within {START_TIMEOUT_S:.0f} s; see {log}")


# ------------------------------------------------------------------------------------------------ worker side


def serve(path: Path, respond: Callable[[str, RecordDict, Context], RecordDict], idle_s: float = IDLE_EXIT_S) -> None:
    """Answer messages on ``path`` one at a time until ``idle_s`` pass without one."""
    old = os.umask(0o177)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(str(path))
    finally:
        os.umask(old)
    server.listen(8)
    server.settimeout(idle_s)
    print(f"node worker {os.getpid()} serving {path}", flush=True)
    try:
        while True:
            try:
                conn, _ = server.accept()
            except TimeoutError:
                break
            with conn:
                conn.settimeout(None)
                _answer(conn, respond)
    finally:
        server.close()
        path.unlink(missing_ok=True)


def _answer(conn: socket.socket, respond: Callable[[str, RecordDict, Context], RecordDict]) -> None:
    head, content, state = _recv(conn, 3)
    header = json.loads(head)
    context = Context(
        run_id=int(header["run_id"]),
        node_id=int(header["node_id"]),
        node_config=header["node_config"],
        state=_from_bytes(state),
        run_config=header["run_config"],
    )
    try:
        reply = respond(str(header["type"]), _from_bytes(content), context)
        _send(conn, json.dumps({"ok": True}).encode(), _to_bytes(reply), _to_bytes(context.state))
    except Exception as exc:  # the client's error: its line goes back to the message's process
        print(f"error: {type(exc).__name__}: {exc}", flush=True)
        _send(conn, json.dumps({"ok": False, "error": str(exc)}).encode(), b"", b"")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stopped: remove the socket on the way out
    # the imports and caches this worker keeps: torch, pandas, Hydra, loaded in the worker only, never in the
    # per-message process that imports this module to forward a message
    from tpflower.app.client_app import app  # noqa: PLC0415

    serve(Path(args[0]), app.respond)  # type: ignore[attr-defined]
    return 0


if __name__ == "__main__":
    sys.exit(main())
