"""The kept model, node side: a copy of theta_i at the server's best validation evaluation (docs/algorithms.md,
Model selection; the server's side: strategies/selection.py).

Two config scalars of a training message, no array (the phases' declared inputs are unchanged):

- ``snapshot: n``: after answering, the node copies its theta_i as the model of evaluation n (one copy, the
  latest: a later snapshot replaces it);
- ``keep: n``: before answering, the node keeps that copy as its kept model (a second slot), which
  ``save_part`` saves instead of the last theta_i. A ``keep`` of another evaluation than the copy or the kept
  model it holds is refused (the refusal rule: tpflower.guard).

Both copies are theta_i of this run's own iterates, whose outputs the server already received: keeping one
releases nothing new. They live in the node's state (context.state), so epoch checkpoints keep them.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Any

from flwr.common import ArrayRecord

from tpflower.guard import GuardedClient, refusal

COPY, KEPT = "theta.snapshot", "theta.kept"


class SelectingClient(GuardedClient, typing.Protocol):
    """What keeping a model needs of a client (the client operator, TableClient)."""

    @property
    def state(self) -> Any: ...  # tpflower.state.ClientState: records and scalars


def before_message(client: SelectingClient, config: Mapping[str, Any]) -> None:
    """``keep: n``: the copy of evaluation n becomes the kept model (refused when the node holds no model of n)."""
    if "keep" not in config:
        return
    n, state = int(config["keep"]), client.state
    if state.scalar("keep.snapshot") == n and COPY in state.records:
        state.records[KEPT] = state.records[COPY]
        state.set_scalar("keep.kept", n)
    elif state.scalar("keep.kept") != n:
        raise refusal(client, "keep names a model this node did not copy", f"evaluation {n}")


def after_message(client: SelectingClient, config: Mapping[str, Any]) -> None:
    """``snapshot: n``: copy theta_i as the model of evaluation n."""
    if "snapshot" not in config:
        return
    theta = client.state.records.get("theta")
    if theta is None:
        raise refusal(client, "snapshot before a model exists")
    client.state.records[COPY] = ArrayRecord(
        torch_state_dict={k: v.clone() for k, v in theta.to_torch_state_dict().items()}
    )
    client.state.set_scalar("keep.snapshot", int(config["snapshot"]))


def kept_theta(client: SelectingClient, config: Mapping[str, Any]) -> ArrayRecord | None:
    """The theta_i to save: the kept model when the message says ``keep``, else the last one."""
    return client.state.records.get(KEPT if "keep" in config else "theta")
