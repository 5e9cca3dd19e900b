"""``flower-superlink`` with its per-request middleware gated by path
(tpflower.app.flower_patch.install_gated_superlink_middleware) and its message pulls held until there is
something to return (tpflower.app.held_pulls): ``python -m tpflower.app.superlink ARGS`` takes
flower-superlink's arguments and runs Flower's code only, with TLS and SuperNode authentication as given.
simulations.deploy starts a deployment's SuperLink this way."""

from __future__ import annotations

import sys

from flwr.superlink.cli.flower_superlink import flower_superlink

from tpflower.app.flower_patch import install_gated_superlink_middleware
from tpflower.app.held_pulls import install_held_pulls


def main() -> None:
    install_gated_superlink_middleware()
    install_held_pulls()
    sys.argv[0] = "flower-superlink"
    flower_superlink()


if __name__ == "__main__":
    main()
