"""The ``tpflower`` command (pyproject's [project.scripts]), one entry as Flower has ``flwr``::

    tpflower train   [HYDRA OVERRIDES]        python -m simulations.run: train one model, write results.json
    tpflower predict RUN_DIR --rows FILE      python -m simulations.predict: federated prediction for new rows
    tpflower sql     [HYDRA OVERRIDES]        python -m simulations.sql: the dataset spec a training query compiles to
    tpflower node    --client-config FILE     python -m simulations.node: a table owner's node
    tpflower deploy  start|run|predict|stop   python -m simulations.deploy: a SuperLink and nodes on this machine

Each subcommand is the module's own command line (its arguments, output and exit status); the module is
imported only when its subcommand runs, so ``tpflower node`` starts without the server's code.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

#: subcommand -> the module whose main() it runs
COMMANDS = {
    "train": "simulations.run",
    "predict": "simulations.predict",
    "sql": "simulations.sql",
    "node": "simulations.node",
    "deploy": "simulations.deploy",
}


def installed(package: str) -> str:
    """The installed version of ``package`` ('unknown' when it is not installed as a distribution)."""
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    try:
        return version(package)
    except PackageNotFoundError:
        return "unknown"


def usage() -> str:
    return (
        __doc__.split("\n\n")[1].rstrip()
        + "\n\n`tpflower COMMAND --help` shows a command's arguments; `tpflower --version` the installed versions."
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(f"usage: tpflower COMMAND ...\n{usage()}")
        return 0 if args else 2
    if args[0] in ("-V", "--version"):  # as `flwr --version`: the installed tpflower and the Flower it runs on
        print(f"tpflower {installed('tpflower')} (Flower {installed('flwr')})")
        return 0
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        print(f"error: no command {command!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command])
    if command == "train":  # Hydra's main reads sys.argv; it exits with status 1 on a failed run
        sys.argv = [f"tpflower {command}", *rest]
        module.main()
        return 0
    return int(module.main(rest, prog=f"tpflower {command}"))


if __name__ == "__main__":
    sys.exit(main())
