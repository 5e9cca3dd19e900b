"""A child process that ends with the one that started it (Linux's parent-death signal), for the processes a
node service or a deployment launcher owns."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def parent_death_signal(sig: int) -> Callable[[], None]:
    """A ``preexec_fn``: the child gets ``sig`` when the thread that started it ends (its parent dies, also on
    SIGKILL): Linux prctl(PR_SET_PDEATHSIG); nothing elsewhere."""

    def arm() -> None:  # pragma: no cover - runs in the child before exec
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
        except OSError:
            pass

    return arm
