"""Communication accounting: bytes and round trips of the arrays that Flower messages carry (counted by
tpflower.records.record_bytes), and the WAN
time model of conf/network (TablePuppet Table 8: per-link latency and bandwidth, server in one region).

A round is one gather/scatter: the server sends a message to some clients and waits for all replies.
Modelled time of a round = max over its clients of (latency of the link + (bytes down + bytes up) / bandwidth):
the slowest link decides, the links work in parallel.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Link:
    latency_s: float
    bandwidth_bytes_s: float

    def time(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth_bytes_s


#: The link to a table without a region when conf/network gives no ``default_link``.
DEFAULT_LINK = {"latency_ms": 63.0, "bandwidth_mb_s": 60.0}


def _link(raw: Mapping[str, Any]) -> Link:
    return Link(float(raw["latency_ms"]) / 1e3, float(raw["bandwidth_mb_s"]) * 1e6)


@dataclass
class WanModel:
    """Links from the server's region to each client's region (``note``: how they were chosen, for the summary
    line)."""

    links: dict[Hashable, Link]
    note: str = ""

    @classmethod
    def from_config(cls, network_cfg: Mapping[str, Any], client_regions: Mapping[Hashable, str | None]) -> WanModel:
        """A client whose region is None or "" gets ``network_cfg.default_link`` (else :data:`DEFAULT_LINK`)."""
        server = network_cfg["server_region"]
        table = network_cfg["links"][server]
        default = network_cfg.get("default_link") or DEFAULT_LINK
        links, defaulted = {}, []
        for client, region in client_regions.items():
            if not region:
                links[client] = _link(default)
                defaulted.append(client)
                continue
            if region not in table:
                raise ValueError(
                    f"client {client}: region {region!r} has no link from the server region {server!r} in "
                    f"conf/network; known regions: {sorted(table)}"
                )
            links[client] = _link(table[region])
        return cls(links, describe_links(server, default, len(defaulted), len(links)))

    def round_time(self, down: Mapping[Hashable, int], up: Mapping[Hashable, int]) -> float:
        clients = set(down) | set(up)
        return max((self.links[c].time(down.get(c, 0) + up.get(c, 0)) for c in clients), default=0.0)


def describe_links(server: str, default: Mapping[str, Any], n_default: int, n_clients: int) -> str:
    """How comm time is modelled, for the summary line."""
    link = f"{float(default['latency_ms']):g} ms, {float(default['bandwidth_mb_s']):g} MB/s"
    if n_default == n_clients:
        return f"comm time modelled on one default link ({link}; no table sets a region)"
    if n_default:
        return f"comm time modelled on links from {server} (conf/network); {n_default} client(s) without a region on the default link ({link})"
    return f"comm time modelled on links from {server} to each table's region (conf/network)"


@dataclass
class CommMeter:
    """Cumulative rounds, bytes and modelled time; `inner` counts a separate class of rounds (LoU inner loop)."""

    wan: WanModel
    rounds: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    comm_time_s: float = 0.0
    rounds_inner: int = 0  # of the rounds above, the union's coordinator rounds (LoU, Table 6)
    bytes_inner: int = 0
    per_client_down: dict[Hashable, int] = field(default_factory=dict)
    per_client_up: dict[Hashable, int] = field(default_factory=dict)

    def record(self, down: Mapping[Hashable, int], up: Mapping[Hashable, int], inner: bool = False) -> None:
        """Account one round with the payload bytes sent to (down) and received from (up) each client;
        ``inner``: a coordinator round of learning over union, also counted in rounds_inner/bytes_inner."""
        self.rounds += 1
        if inner:
            self.rounds_inner += 1
            self.bytes_inner += sum(down.values()) + sum(up.values())
        self.bytes_down += sum(down.values())
        self.bytes_up += sum(up.values())
        self.comm_time_s += self.wan.round_time(down, up)
        for c, b in down.items():
            self.per_client_down[c] = self.per_client_down.get(c, 0) + b
        for c, b in up.items():
            self.per_client_up[c] = self.per_client_up.get(c, 0) + b

    def snapshot(self) -> dict[str, float]:
        return {
            "rounds": self.rounds,
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "comm_time_s": self.comm_time_s,
            "rounds_inner": self.rounds_inner,
            "bytes_inner": self.bytes_inner,
        }
