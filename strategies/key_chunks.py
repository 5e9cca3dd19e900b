"""Keys replies and re-blinding lists in bounded chunks, server side (docs/algorithms.md, Table mapping and
Blinded keys; clients: tpflower.phases.setup).

:func:`gather_chunks`: a client with more rows than the run's chunk size c (``mapping.keys_chunk_rows``)
answers the keys round (``keys``, or a prediction's ``predict_keys``) with chunk 0 and counts of what the
whole reply holds; the server asks for chunks 1, 2, ... (``keys_chunk``), one round each, and writes them
into arrays it allocates once. What it allocates is bounded by what it asked for, before anything is
allocated (:func:`announced`): a chunk of at most c rows, as many chunks as the announced rows make, at
most as many listed values and labels as rows, digests of 2 x 64 bits and blinded values of 32 bytes, one
vector per row array; every later chunk exactly the rows and values of its position, in the dtype of chunk
0. The whole arrays are allocated from chunk 0's counts, but their pages are only taken as chunks are
written: the server's memory grows with what a client actually sends, a chunk of at most c rows at a time
(a count beyond what the server could ever hold is refused at once). Anything else stops the run with one
line naming the table and shard, before any training.

:func:`reblind_chunks`: keys=blind, the lists a client re-blinds in one hop, sent in chunks of c values (one
round per chunk; config ``chunk``, ``chunk_rows`` and ``n.<list>``: each list's length), put back together
in order. The server allocates what it sent.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from strategies.replies import ReplyError, check_keys, whole_number
from strategies.transport import ClientKey, Reply

Send = Callable[..., dict[ClientKey, Reply]]


@dataclass(frozen=True)
class Signed:
    """A re-blinding list's provenance (tpflower.signing): its origin node, the node that signed it last
    (``table/shard``) and that node's signature of each chunk."""

    origin: str
    signer: str
    signatures: list[str]


#: the per-value width of a list array: keyed digests (hmac) and blinded values (blind)
LIST_SHAPES = {"digest": ((2,), np.dtype(np.uint64)), "blind": ((32,), np.dtype(np.uint8))}
#: arrays with one entry per row (labels: per row, or per training row under label DP)
ROW_ARRAYS = ("row_ids", "is_test", "y")
MAX_COUNT = 1 << 48  # no table has more rows: a count beyond it is not a count


def _who(key: ClientKey) -> str:
    return f"table {key[0]!r} shard {key[1]}"


def _count(key: ClientKey, metrics: Mapping[str, Any], name: str) -> int:
    """A non-negative whole number the client announced in its metrics."""
    value = metrics.get(name)
    if not whole_number(value, 0, MAX_COUNT):
        raise ReplyError(f"{_who(key)}: its keys reply announces {name}={value!r}, not a count of entries")
    return int(value)  # type: ignore[arg-type]


def _expected_shape(key: ClientKey, name: str, a: np.ndarray) -> tuple[tuple[int, ...], np.dtype | None]:
    """The shape of one entry of a keys array and the dtype it must have (None: any integer or float)."""
    kind = name.split(".", 1)[0]
    if kind in LIST_SHAPES:
        return LIST_SHAPES[kind]
    if name in ROW_ARRAYS or kind == "code":
        return (), None
    raise ReplyError(f"{_who(key)}: its keys reply holds array {name!r}, not an array of a keys reply")


def check_entry(key: ClientKey, name: str, a: np.ndarray) -> None:
    """One keys array (any chunk): entries of the width its kind has (a vector per row; digests (n, 2)
    uint64, blinded values (n, 32) uint8), integers where integers belong, at most 8 bytes per number."""
    shape, dtype = _expected_shape(key, name, a)
    integer = name in ("row_ids", "is_test") or name.startswith("code.")
    bad = a.shape[1:] != shape or (dtype is not None and a.dtype != dtype)
    bad |= a.dtype.kind not in ("iu" if integer else "iubf") or a.dtype.itemsize > 8
    if bad:
        want = f"{dtype} {('n',) + shape}" if dtype is not None else ("integers" if integer else "numbers") + " (n,)"
        raise ReplyError(f"{_who(key)}: keys array {name!r} is {a.dtype} {a.shape}; it must be {want}")


def announced(
    key: ClientKey, arrays: Mapping[str, np.ndarray], metrics: Mapping[str, Any], chunk_rows: int
) -> dict[str, int]:
    """Chunk 0 of a chunked keys reply, checked against what the server asked (``chunk_rows``): the entries
    each whole array will hold (module docstring), before anything is allocated."""
    n_rows, n_chunks = _count(key, metrics, "n_rows"), _count(key, metrics, "n_chunks")
    if n_chunks != -(-n_rows // chunk_rows) or n_chunks < 2:
        raise ReplyError(
            f"{_who(key)}: its keys reply announces {n_rows} rows in {n_chunks} chunks; the round asked for "
            f"chunks of {chunk_rows} rows ({max(1, -(-n_rows // chunk_rows))} chunk(s))"
        )
    totals: dict[str, int] = {}
    for name, a in arrays.items():
        a = np.asarray(a)
        check_entry(key, name, a)
        kind = name.split(".", 1)[0]
        if kind in LIST_SHAPES:
            totals[name] = _count(key, metrics, f"n_values.{name.split('.', 1)[1]}")
        elif name == "y":
            totals[name] = _count(key, metrics, "n_y")
        else:
            totals[name] = n_rows
        if totals[name] > n_rows:
            raise ReplyError(
                f"{_who(key)}: its keys reply announces {totals[name]} entries of {name!r} for its {n_rows} rows"
            )
    if "row_ids" not in totals:
        raise ReplyError(f"{_who(key)}: its keys reply lacks 'row_ids'")
    return totals


def gather_chunks(send: Send, replies: Mapping[ClientKey, Reply], chunk_rows: int) -> None:
    """Keys replies in chunks (metrics ``n_chunks`` > 1): check chunk 0 (:func:`announced`), ask each such
    client for chunk 1, 2, ... in successive rounds (only the clients with that many chunks), write every
    chunk into the whole arrays, allocated once, then check the whole reply as a one-message reply is checked
    (strategies.replies.check_keys) and put it in place of chunk 0. A one-message reply holds at most
    ``chunk_rows`` rows."""
    n_chunks: dict[ClientKey, int] = {}
    for key, (arrays, metrics) in replies.items():
        n_chunks[key] = _count(key, metrics, "n_chunks") if "n_chunks" in metrics else 1
        if n_chunks[key] == 1 and len(np.asarray(arrays.get("row_ids", ()))) > chunk_rows:
            raise ReplyError(
                f"{_who(key)}: its keys reply holds {len(arrays['row_ids'])} rows in one message; the round "
                f"asked for chunks of {chunk_rows} rows"
            )
    chunked = [k for k, n in n_chunks.items() if n > 1]
    whole: dict[ClientKey, dict[str, np.ndarray]] = {}
    filled: dict[ClientKey, dict[str, int]] = {}
    for key in chunked:
        arrays, metrics = replies[key]
        totals = announced(key, arrays, metrics, chunk_rows)
        whole[key] = {}
        for name, a in arrays.items():
            a = np.asarray(a)
            try:  # pages are taken as chunks are written: an honest count costs what the client then sends
                whole[key][name] = np.empty((totals[name],) + a.shape[1:], dtype=a.dtype)
            except MemoryError:
                raise ReplyError(
                    f"{_who(key)}: its keys reply announces {totals[name]} entries of {name!r} "
                    f"({totals[name] * a.itemsize * max(1, a[:1].size) / 1e9:.1f} GB), more than this server can hold"
                ) from None
        filled[key] = dict.fromkeys(whole[key], 0)
        _fill(key, whole[key], filled[key], arrays, 0, chunk_rows)
    for j in range(1, max(n_chunks.values(), default=1)):
        back = send({k: ({}, {"phase": "keys_chunk", "chunk": j}) for k in chunked if n_chunks[k] > j})
        for key, (arrays, metrics) in back.items():
            _fill(key, whole[key], filled[key], arrays, j, chunk_rows)
            arrays.clear()
            for name in [n for n in metrics if n.startswith("sig.")]:  # keys=blind: each chunk's list signatures
                replies[key][1][name] = f"{replies[key][1].get(name, '')},{metrics[name]}"
    for key in chunked:
        short = [n for n, a in whole[key].items() if filled[key][n] != len(a)]
        if short:
            raise ReplyError(
                f"{_who(key)}: its keys chunks hold {filled[key][short[0]]} of the "
                f"{len(whole[key][short[0]])} entries of {short[0]!r} it announced"
            )
        check_keys(key, whole[key])
        replies[key][0].clear()
        replies[key][0].update(whole[key])


def _fill(
    key: ClientKey,
    whole: dict[str, np.ndarray],
    filled: dict[str, int],
    arrays: Mapping[str, Any],
    j: int,
    chunk_rows: int,
) -> None:
    """Write chunk ``j`` after the entries received before it: the arrays of chunk 0, each in its dtype and
    width, exactly the entries of position j (labels under label DP: at most the chunk's rows)."""
    if set(arrays) != set(whole):
        raise ReplyError(f"{_who(key)}: keys chunk {j} holds {sorted(arrays)}, not {sorted(whole)}")
    rows = max(0, min(chunk_rows, len(whole["row_ids"]) - j * chunk_rows))
    for name, a in arrays.items():
        at, a, total = filled[name], np.asarray(a), len(whole[name])
        want: int | None = rows
        if name.split(".", 1)[0] in LIST_SHAPES:
            want = max(0, min(chunk_rows, total - j * chunk_rows))
        elif name == "y" and total != len(whole["row_ids"]):
            want = None  # label DP: the training rows among the chunk's rows
        fits = a.shape[1:] == whole[name].shape[1:] and a.dtype == whole[name].dtype and a.ndim >= 1
        fits = fits and (len(a) == want if want is not None else len(a) <= rows) and at + len(a) <= len(whole[name])
        if not fits:
            expect = f"{want} entries" if want is not None else f"at most {rows} entries"
            raise ReplyError(
                f"{_who(key)}: keys chunk {j} array {name!r} ({a.dtype} {a.shape}) does not fit the "
                f"{whole[name].dtype} {whole[name].shape} it announced ({expect} after {at})"
            )
        whole[name][at : at + len(a)] = a
        filled[name] = at + len(a)


def reblind_chunks(
    send: Send,
    lists: Mapping[ClientKey, Mapping[str, np.ndarray]],
    chunk_rows: int,
    signed: Mapping[ClientKey, Mapping[str, Signed]] | None = None,
) -> tuple[dict[ClientKey, dict[str, np.ndarray]], dict[ClientKey, dict[str, list[str]]]]:
    """One re-blinding hop: each client's ``lists`` (``pts.<join>.<origin>``) raised to its scalar, sent in
    chunks of ``chunk_rows`` values (one round per chunk; a list of no values goes once, empty) and put back
    together in order (each reply checked by strategies.replies.check_reply: the values sent, one each).
    ``signed``: per list its origin, its signer and the signer's signature of each chunk (tpflower.signing),
    sent with the chunk; returned with the lists: the re-blinder's signatures of its chunks, for the next hop."""
    out = {c: {n: np.empty_like(np.asarray(p)) for n, p in arrays.items()} for c, arrays in lists.items()}
    sigs: dict[ClientKey, dict[str, list[str]]] = {c: {n: [] for n in arrays} for c, arrays in lists.items()}
    longest = max((len(p) for arrays in lists.values() for p in arrays.values()), default=0)
    for j in range(max(1, -(-longest // chunk_rows))):
        lo = j * chunk_rows
        messages = {}
        for c, arrays in lists.items():
            part = {n: np.asarray(p)[lo : lo + chunk_rows] for n, p in arrays.items() if j == 0 or lo < len(p)}
            if part:
                config = {"phase": "reblind", "chunk": j, "chunk_rows": chunk_rows}
                config.update({f"n.{n}": len(arrays[n]) for n in part})
                for n in part:
                    s = (signed or {}).get(c, {}).get(n)
                    if s is not None:
                        config.update({f"origin.{n}": s.origin, f"signer.{n}": s.signer})
                        if j < len(s.signatures):
                            config[f"sig.{n}"] = s.signatures[j]
                messages[c] = (part, config)
        for c, (arrays, metrics) in send(messages).items():
            for name, points in arrays.items():
                out[c][name][lo : lo + len(points)] = points
                sigs[c][name].append(str(metrics.get(f"sig.{name}", "")))
    return out, sigs
