"""A Flower strategy driven by a protocol generator, and the server loop that runs it to completion.

A TablePuppet algorithm is a sequence of gather/scatter rounds whose number depends on the data (N / B
batches per epoch for SGD). Subclasses write that sequence as a generator, :meth:`PhaseStrategy.protocol`:
each ``yield`` hands over the messages of one round, {client key: (arrays, config)}, and receives the
replies {client key: (arrays, metrics)}. One Flower round = one yield.

Client keys are (table, shard). The first round goes to every connected client (``BROADCAST``); its replies
say which table and shard each client holds. The same strategy object runs under Flower (configure_fit /
aggregate_fit, driven by :class:`PhaseServer`) and in-process (:func:`run_direct`), so the framework's
overhead can be measured on identical code.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Mapping
from typing import Any

import numpy as np
from flwr.common import FitIns, FitRes, Parameters, Scalar, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server import Server
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.history import History
from flwr.server.strategy import Strategy

from tpflower.comm import payload_bytes

ClientKey = tuple[str, int]  # (table, shard)
Message = tuple[list[np.ndarray], dict[str, Scalar]]
Reply = tuple[list[np.ndarray], dict[str, Scalar]]
Protocol = Generator[dict[Any, Message], dict[ClientKey, Reply], None]
BROADCAST = "*"
CLIENT_WAIT_S = 600.0


class PhaseStrategy(Strategy):
    """Base class: Flower plumbing around a protocol generator, with per-client byte accounting."""

    def __init__(self, num_clients: int):
        self.num_clients = num_clients
        self.finished = False
        self.proxies: dict[ClientKey, ClientProxy] = {}
        self._cid_key: dict[str, ClientKey] = {}
        self._protocol: Protocol | None = None
        self._outbox: dict[Any, Message] = {}
        self._down: dict[Any, int] = {}

    def protocol(self) -> Protocol:  # pragma: no cover - abstract
        raise NotImplementedError

    def on_round(self, down: Mapping[ClientKey, int], up: Mapping[ClientKey, int]) -> None:
        """Called after every round with the payload bytes sent to and received from each client."""

    # ------------------------------------------------------------------------ transport-independent core

    def start(self) -> dict[Any, Message]:
        self._protocol = self.protocol()
        self._outbox = next(self._protocol)
        return self._outbox

    def deliver(self, replies: dict[ClientKey, Reply], down: Mapping[ClientKey, int], up: Mapping[ClientKey, int]) -> dict[Any, Message]:
        """Hand the replies of the current round to the protocol; returns the next round's messages."""
        self.on_round(down, up)
        assert self._protocol is not None
        try:
            self._outbox = self._protocol.send(replies)
        except StopIteration:
            self.finished = True
            self._outbox = {}
        return self._outbox

    # ------------------------------------------------------------------------ Flower Strategy API

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return None

    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: ClientManager):
        if self._protocol is None:
            if not client_manager.wait_for(self.num_clients, timeout=CLIENT_WAIT_S):
                raise RuntimeError(
                    f"only {client_manager.num_available()} of {self.num_clients} clients connected "
                    f"within {CLIENT_WAIT_S:.0f} s (one per table shard is needed)"
                )
            self.start()
        instructions = []
        self._down = {}
        for key, (arrays, config) in self._outbox.items():
            targets = list(client_manager.all().values()) if key == BROADCAST else [self.proxies[key]]
            params = ndarrays_to_parameters(arrays)
            for proxy in targets:
                instructions.append((proxy, FitIns(params, dict(config))))
                self._down[proxy.cid] = payload_bytes(params)
        return instructions

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]], failures):
        if failures:
            first = failures[0]
            detail = first if isinstance(first, BaseException) else getattr(first[1], "status", first)
            raise RuntimeError(f"round {server_round}: {len(failures)} client(s) failed: {detail!r}")
        replies: dict[ClientKey, Reply] = {}
        up: dict[ClientKey, int] = {}
        for proxy, res in results:
            key = self._cid_key.get(proxy.cid)
            if key is None:  # the first (broadcast) round: the client says which table and shard it holds
                key = (str(res.metrics["table"]), int(res.metrics["shard"]))
                if key in self.proxies:
                    raise RuntimeError(f"two clients both hold table {key[0]!r} shard {key[1]}")
                self._cid_key[proxy.cid] = key
                self.proxies[key] = proxy
            replies[key] = (parameters_to_ndarrays(res.parameters), dict(res.metrics))
            up[key] = payload_bytes(res.parameters)
        down = {self._cid_key[cid]: b for cid, b in self._down.items()}
        self.deliver(replies, down, up)
        return None, {}

    def configure_evaluate(self, server_round, parameters, client_manager):
        return []  # evaluation is part of the protocol (test predictions ride on training messages)

    def aggregate_evaluate(self, server_round, results, failures):
        return None, {}

    def evaluate(self, server_round, parameters):
        return None


class PhaseServer(Server):
    """Flower's server loop, run until the strategy's protocol ends instead of for a fixed round count."""

    def fit(self, num_rounds: int, timeout: float | None) -> tuple[History, float]:
        import timeit

        strategy = self.strategy
        assert isinstance(strategy, PhaseStrategy)
        start = timeit.default_timer()
        logging.getLogger("flwr").setLevel(logging.WARNING)  # three INFO lines per round would drown the epochs
        server_round = 0
        while not strategy.finished:
            server_round += 1
            self.fit_round(server_round=server_round, timeout=timeout)
        return History(), timeit.default_timer() - start


def run_direct(strategy: PhaseStrategy, clients: Mapping[ClientKey, Callable[[], Any]]) -> None:
    """Run a strategy in-process against NumPyClients (no Flower transport): same code, same payloads.

    ``clients[key]()`` returns the client for one message (built anew each time, as Flower may do).
    Payload bytes are measured on the same serialization Flower uses.
    """
    outbox = strategy.start()
    while not strategy.finished:
        replies: dict[ClientKey, Reply] = {}
        down: dict[ClientKey, int] = {}
        up: dict[ClientKey, int] = {}
        for key, (arrays, config) in outbox.items():
            targets = list(clients) if key == BROADCAST else [key]
            params = ndarrays_to_parameters(arrays)
            for target in targets:
                out, _, metrics = clients[target]().fit(parameters_to_ndarrays(params), dict(config))
                reply_params = ndarrays_to_parameters(out)
                replies[target] = (parameters_to_ndarrays(reply_params), metrics)
                down[target] = payload_bytes(params)
                up[target] = payload_bytes(reply_params)
        outbox = strategy.deliver(replies, down, up)
