"""Local models f_i and their centralized equivalent (torch).

docs/algorithms.md, Notation: ``f_i(theta_i; x)`` in R^{d_c} is the local model of table i (linear or MLP) and the
joined prediction is ``H_j = sum_i f_i(theta_i; T_{i,p_i(j)})``. On the materialized join (the centralized
baseline, Sec. 6) the same prediction is one model on the concatenated features: :class:`JoinedModel`, which
holds the *same* parameter objects as the local models, so training it trains them.

The regulariser is ``R_i(theta_i) = 1/2 ||theta_i||^2`` over all parameters, bias included (Eq. 2).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import warnings
import zlib
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

MODEL_KINDS: tuple[str, ...] = ("linear", "mlp")
INITS: tuple[str, ...] = ("default", "zeros")
PRECISIONS: dict[str, torch.dtype] = {"float32": torch.float32, "float64": torch.float64}


def torch_dtype(precision: str) -> torch.dtype:
    """The torch dtype of a precision name: ``"float32"`` or ``"float64"``."""
    try:
        return PRECISIONS[precision]
    except (KeyError, TypeError):
        raise ValueError(f"unknown precision {precision!r}; expected one of {sorted(PRECISIONS)}") from None


def model_seed(seed: int, table: str) -> int:
    """A stable per-table seed in [0, 2**31): ``(seed * 1000003 + crc32(table)) mod 2**31``.

    Stable across processes and Python versions (unlike ``hash``), so every shard of a table (LoU, Eq. 17-19:
    "all shards of table i hold the same theta_i (same seed)") and the centralized baseline build the same
    initial weights.
    """
    return (int(seed) * 1000003 + zlib.crc32(str(table).encode("utf-8"))) % 2**31


def init_seed(secret: bytes, seed: int, table: str, nonce: str = "") -> int:
    """The seed of table i's initial theta_i: HMAC-SHA256 keyed by the node's own secret over the run seed, the
    table and ``nonce`` (a deployed node: the run id), in [0, 2**63).

    A server without the secret cannot recompute theta_i^0, so no reply pairs outputs with a model it knows
    (docs/threat-model.md). Every shard of a table holds the same secret and sees the same run id (same
    theta_i^0, Eq. 17-19). A deployed node's; a simulation keeps :func:`model_seed` (tpflower.relation).
    """
    message = f"tpflower init\x1f{int(seed)}\x1f{table}\x1f{nonce}".encode()
    return int.from_bytes(hmac.digest(bytes(secret), message, hashlib.sha256)[:8], "big") % 2**63


def local_model(
    d_in: int,
    d_out: int,
    kind: str = "linear",
    hidden: Sequence[int] = (16,),
    bias: bool = True,
    init: str = "default",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> nn.Module:
    """The local model f_i: ``R^{d_in} -> R^{d_out}``.

    * ``kind="linear"``: ``nn.Linear(d_in, d_out, bias)``. ``d_in = 0`` is allowed (a table without
      features): the model outputs its bias (zeros without bias) for any number of rows.
    * ``kind="mlp"``: ``Linear + ReLU`` per size in ``hidden``, then a final ``Linear`` with no activation
      (outputs are logits / real values, negative ones included).

    ``init="default"`` is torch's ``nn.Linear`` initialisation (uniform in +-1/sqrt(fan_in)), drawn from a
    local generator seeded with ``seed``: the result depends only on the arguments and the global RNG state
    is left untouched. ``init="zeros"`` zeroes every parameter; it is refused for an MLP, whose hidden units
    would then stay identical (zero gradients for all but the last bias).
    """
    d_in, d_out = int(d_in), int(d_out)
    if d_in < 0:
        raise ValueError(f"d_in must be >= 0, got {d_in}")
    if d_out < 1:
        raise ValueError(f"d_out must be >= 1, got {d_out}")
    if kind not in MODEL_KINDS:
        raise ValueError(f"unknown model kind {kind!r}; expected one of {list(MODEL_KINDS)}")
    if init not in INITS:
        raise ValueError(f"unknown init {init!r}; expected one of {list(INITS)}")
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch dtype, got {dtype!r}")
    sizes = [int(h) for h in hidden] if kind == "mlp" else []
    if kind == "mlp":
        if not sizes:
            raise ValueError("an mlp needs at least one hidden layer (hidden=()); use kind='linear' instead")
        if any(h < 1 for h in sizes):
            raise ValueError(f"hidden layer sizes must be >= 1, got {list(hidden)}")
        if init == "zeros":
            raise ValueError(
                "init='zeros' makes an MLP degenerate (all hidden units identical, zero gradients "
                "through them); use init='default' for kind='mlp'"
            )

    dims = [d_in, *sizes, d_out]
    # Build on the meta device (no memory, no draw from the global RNG), then materialise and initialise
    # from a local generator.
    layers: list[nn.Module] = []
    for k in range(len(dims) - 1):
        with warnings.catch_warnings():  # d_in = 0: "Initializing zero-element tensors is a no-op"
            warnings.filterwarnings("ignore", message="Initializing zero-element tensors")
            layers.append(nn.Linear(dims[k], dims[k + 1], bias=bias, device="meta", dtype=dtype))
        if k < len(dims) - 2:
            layers.append(nn.ReLU())
    model: nn.Module = layers[0] if len(layers) == 1 else nn.Sequential(*layers)
    model = model.to_empty(device="cpu")

    generator = torch.Generator(device="cpu")
    generator.manual_seed(int(seed) % 2**63)
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, nn.Linear):
                _init_linear(layer, init, generator)
    return model


def _init_linear(layer: nn.Linear, init: str, generator: torch.Generator) -> None:
    """torch's default ``nn.Linear.reset_parameters`` (or zeros), drawn from ``generator``."""
    if init == "zeros":
        layer.weight.zero_()
        if layer.bias is not None:
            layer.bias.zero_()
        return
    fan_in = layer.in_features
    if fan_in == 0:  # no inputs: torch's bound would be 0, i.e. a zero bias (and an empty weight)
        layer.weight.zero_()
        if layer.bias is not None:
            layer.bias.zero_()
        return
    # kaiming_uniform_(a=sqrt(5)) has bound gain * sqrt(3 / fan_in) = 1 / sqrt(fan_in); the bias the same.
    bound = 1.0 / math.sqrt(fan_in)
    layer.weight.uniform_(-bound, bound, generator=generator)
    if layer.bias is not None:
        layer.bias.uniform_(-bound, bound, generator=generator)


def l2_penalty(module: nn.Module) -> Tensor:
    """``R(theta) = 1/2 * sum of squared parameters`` over all parameters of ``module`` (bias included)."""
    params = list(module.parameters())
    if not params:
        return torch.zeros(())
    return 0.5 * sum((p * p).sum() for p in params)  # type: ignore[return-value]


def _first_linear(module: nn.Module) -> nn.Linear | None:
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            return sub
    return None


def used_parameters(module: nn.Module, column_used: Tensor) -> Tensor:
    """Which entries of the flat parameter vector (``parameters_to_vector`` order) the data loss can depend on,
    given which input columns hold a non-zero value (``column_used``, bool of length d_in): the first Linear
    layer's weights of an all-zero column never receive a data gradient; every other parameter may. The
    general-form consensus of TP-UCQ-ADMM (Boyd et al. 2011, Sec. 7.2) averages a weight only over the shards
    that use it."""
    first = _first_linear(module)
    masks = []
    for p in module.parameters():
        if first is not None and p is first.weight:
            masks.append(column_used.to(torch.bool).expand_as(p))
        else:
            masks.append(torch.ones_like(p, dtype=torch.bool))
    return torch.cat([m.reshape(-1) for m in masks]) if masks else torch.zeros(0, dtype=torch.bool)


class JoinedModel(nn.Module):
    """The centralized model on the materialized join: ``H = sum_i f_i(X[:, cols_i])``.

    ``local`` maps table names to local models, in the column order of the concatenated feature matrix X;
    ``widths[name]`` is the number of feature columns of that table (0 allowed). The local modules are held
    as they are (``self.local``, table name -> module, registered as ``self.parts``), so the parameters are the
    same objects: a step on the joined model is a step on the local models.
    """

    def __init__(self, local: Mapping[str, nn.Module], widths: Mapping[str, int]) -> None:
        super().__init__()
        names = list(local)
        if not names:
            raise ValueError("JoinedModel needs at least one local model")
        if set(widths) != set(names):
            raise ValueError(f"widths has tables {sorted(widths)}, local models have tables {sorted(names)}")
        for name in names:
            if not isinstance(name, str) or not name or "." in name:
                raise ValueError(f"table name {name!r} cannot name a torch submodule (empty or contains '.')")
        # registered by position, looked up by name: a table may be named as any attribute of an nn.ModuleDict
        # ("items", "keys", "values", "update"), which a ModuleDict keyed by table names refuses
        self.parts = nn.ModuleList([local[name] for name in names])
        self.local: dict[str, nn.Module] = dict(zip(names, self.parts, strict=True))
        self.slices: dict[str, slice] = {}
        start = 0
        for name in names:
            width = int(widths[name])
            if width < 0:
                raise ValueError(f"table {name!r}: width must be >= 0, got {width}")
            first = _first_linear(local[name])
            if first is not None and first.in_features != width:
                raise ValueError(
                    f"table {name!r}: width {width} does not match the local model's input size {first.in_features}"
                )
            self.slices[name] = slice(start, start + width)
            start += width
        self.d_in = start

    def forward(self, X: Tensor) -> Tensor:
        """``sum_i f_i(theta_i; X[:, cols_i])`` for the rows of X (shape ``(n, sum of widths)``)."""
        if X.dim() != 2 or X.shape[1] != self.d_in:
            raise ValueError(f"JoinedModel expects X of shape (n, {self.d_in}), got {tuple(X.shape)}")
        out: Tensor | None = None
        for name, model in self.local.items():
            h = model(X[:, self.slices[name]])
            out = h if out is None else out + h
        assert out is not None
        return out
