"""``flower-supernode`` with its hard-coded sleeps shortened (tpflower.app.flower_patch.install_fast_supernode)
and its Runtime API's tracing layer skipped while tracing is off (install_gated_supernode_middleware):
``python -m tpflower.app.supernode ARGS`` takes flower-supernode's arguments. The node service
(simulations.node) starts the owner's SuperNode this way; it runs Flower's code only. With
``--isolation process`` (the node service answers its tasks) a task is created once its message has
fully arrived, ringing the service's doorbell (the UDP port in $TPFLOWER_TASK_DOORBELL, if set:
flower_patch.install_tasks_when_ready).
"""

from __future__ import annotations

import os
import sys
import traceback

from flwr.supernode.cli import flower_supernode

from tpflower.app.flower_patch import (
    DOORBELL_ENV,
    install_fast_supernode,
    install_gated_supernode_middleware,
    install_tasks_when_ready,
)


def process_isolated(argv: list[str]) -> bool:
    """Whether flower-supernode's arguments ``argv`` ask for process isolation (an outside app process)."""
    return any(
        a == "--isolation=process" or (a == "--isolation" and b == "process") for a, b in zip(argv, argv[1:] + [""])
    )


def main() -> None:
    install_fast_supernode()
    install_gated_supernode_middleware()
    if process_isolated(sys.argv[1:]):
        install_tasks_when_ready(port=int(os.environ.get(DOORBELL_ENV) or 0) or None)
    sys.argv[0] = "flower-supernode"
    try:
        flower_supernode()
    except Exception:  # its Runtime API server's thread would keep the process alive: the node service waited on
        traceback.print_exc()  # a SuperNode that had stopped; it exits, and the service says so
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
