"""``flower-supernode`` with its hard-coded sleeps shortened (tpflower.app.flower_patch.install_fast_supernode):
``python -m tpflower.app.supernode ARGS`` takes flower-supernode's arguments. The node service
(simulations.node) starts the owner's SuperNode this way; it runs Flower's code only."""

from __future__ import annotations

import sys

from flwr.supernode.cli import flower_supernode

from tpflower.app.flower_patch import install_fast_supernode


def main() -> None:
    install_fast_supernode()
    sys.argv[0] = "flower-supernode"
    flower_supernode()


if __name__ == "__main__":
    main()
