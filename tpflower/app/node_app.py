"""The ClientApp entry point Flower loads (pyproject ``[tool.flwr.app.components]``), thin on purpose.

tpflower's own deployments never run this on a node: the owner's node service (tpflower.app.node_service,
``python -m simulations.node``) answers with the installed tpflower and never loads a FAB. On a stock
``flower-supernode`` whose node config names its owner's ``client-config``, this entry point hands every
message to its node worker
(tpflower.app.node_worker), a long-lived process that keeps the imports and the prepared table, so the
``flwr-clientapp`` process Flower starts per message imports only Flower and this module. Elsewhere (the
simulation engine, whose actors live across messages) the full ClientApp (tpflower.app.client_app) answers
in this process.
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from tpflower.app import node_worker

app = ClientApp()


def handler(msg: Message, context: Context) -> Message:
    if node_worker.enabled(context):
        return Message(node_worker.forward(msg.metadata.message_type, msg.content, context), reply_to=msg)
    # torch, pandas, Hydra: only when answering in this process (the per-message process forwards instead)
    from tpflower.app.client_app import app as full  # noqa: PLC0415

    return full(msg, context)


app.query()(handler)
app.train()(handler)
app.evaluate()(handler)
