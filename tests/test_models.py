"""Local models f_i, the joined (centralized) model, the L2 penalty and dtypes."""

from __future__ import annotations

import zlib

import pytest
import torch
from torch import nn

from tpflower.models import JoinedModel, l2_penalty, local_model, model_seed, torch_dtype


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_local_model_is_deterministic_and_leaves_global_rng_alone(kind: str) -> None:
    state = torch.random.get_rng_state()
    a = _params(local_model(4, 3, kind=kind, hidden=(8, 5), seed=7))
    b = _params(local_model(4, 3, kind=kind, hidden=(8, 5), seed=7))
    c = _params(local_model(4, 3, kind=kind, hidden=(8, 5), seed=8))
    assert torch.equal(state, torch.random.get_rng_state())
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))
    # torch's default bound 1/sqrt(fan_in) on the first layer
    assert a[0].abs().max() <= 0.5 and a[0].abs().max() > 0


def test_model_seed_is_stable_and_per_table() -> None:
    assert model_seed(3, "movies") == (3 * 1000003 + zlib.crc32(b"movies")) % 2**31
    assert model_seed(3, "movies") != model_seed(3, "ratings")
    assert model_seed(3, "movies") != model_seed(4, "movies")
    assert 0 <= model_seed(10**12, "x") < 2**31


def test_zeros_init_and_mlp_refuses_it() -> None:
    model = local_model(5, 2, init="zeros")
    assert all(torch.count_nonzero(p) == 0 for p in model.parameters())
    with pytest.raises(ValueError, match="MLP degenerate"):
        local_model(5, 2, kind="mlp", init="zeros")
    with pytest.raises(ValueError, match="'conv'"):
        local_model(5, 2, kind="conv")
    with pytest.raises(ValueError, match="hidden"):
        local_model(5, 2, kind="mlp", hidden=())


def test_mlp_has_no_output_activation() -> None:
    model = local_model(3, 2, kind="mlp", hidden=(16, 8), seed=1)
    assert isinstance(model, nn.Sequential)
    assert [type(m) for m in model] == [nn.Linear, nn.ReLU, nn.Linear, nn.ReLU, nn.Linear]
    out = model(torch.randn(200, 3, generator=torch.Generator().manual_seed(0)))
    assert out.shape == (200, 2) and bool((out < 0).any()) and bool((out > 0).any())


def test_linear_without_features() -> None:
    model = local_model(0, 3, seed=5)
    with torch.no_grad():
        model.bias.copy_(torch.tensor([1.0, -2.0, 0.5]))
    out = model(torch.zeros(4, 0))
    assert torch.equal(out, torch.tensor([[1.0, -2.0, 0.5]]).expand(4, 3))
    out.sum().backward()
    assert torch.equal(model.bias.grad, torch.full((3,), 4.0))
    no_bias = local_model(0, 1, bias=False)
    assert torch.equal(no_bias(torch.zeros(2, 0)), torch.zeros(2, 1))


def test_joined_model_is_the_sum_and_shares_parameters() -> None:
    torch.manual_seed(0)
    local = {
        "a": local_model(3, 2, seed=1),
        "b": local_model(0, 2, seed=2),
        "c": local_model(2, 2, kind="mlp", hidden=(4,), seed=3),
    }
    joined = JoinedModel(local, {"a": 3, "b": 0, "c": 2})
    X = torch.randn(6, 5)
    expected = local["a"](X[:, :3]) + local["b"](X[:, 3:3]) + local["c"](X[:, 3:5])
    torch.testing.assert_close(joined(X), expected, rtol=0, atol=0)
    assert list(joined.local) == ["a", "b", "c"]
    for name, model in local.items():
        assert all(p is q for p, q in zip(model.parameters(), joined.local[name].parameters(), strict=True))

    before = {name: _params(m) for name, m in local.items()}
    opt = torch.optim.SGD(joined.parameters(), lr=0.1)
    joined(X).pow(2).mean().backward()
    opt.step()
    for name, model in local.items():
        changed = [not torch.equal(p, q) for p, q in zip(before[name], _params(model), strict=True)]
        assert any(changed), name


def test_joined_model_takes_tables_named_as_module_dict_attributes() -> None:
    """A user's tables named items, keys or values (orders <- items -> pizzas): the centralized baseline's model
    on their join builds and sums their local models (an nn.ModuleDict keyed by table names refused them)."""
    local = {name: local_model(2, 1, seed=i) for i, name in enumerate(["orders", "items", "keys", "values"])}
    joined = JoinedModel(local, dict.fromkeys(local, 2))
    X = torch.randn(5, 8)
    expected = sum(local[name](X[:, 2 * i : 2 * i + 2]) for i, name in enumerate(local))
    torch.testing.assert_close(joined(X), expected, rtol=0, atol=0)
    assert list(joined.local) == list(local) and joined.local["items"] is local["items"]
    assert len(list(joined.parameters())) == sum(len(list(m.parameters())) for m in local.values())


def test_joined_model_validates_widths() -> None:
    with pytest.raises(ValueError, match="'a'.*width 4"):
        JoinedModel({"a": local_model(3, 1)}, {"a": 4})
    with pytest.raises(ValueError, match="widths has tables"):
        JoinedModel({"a": local_model(3, 1)}, {"b": 3})
    joined = JoinedModel({"a": local_model(3, 1)}, {"a": 3})
    with pytest.raises(ValueError, match=r"\(n, 3\)"):
        joined(torch.zeros(2, 4))


def test_l2_penalty_and_float64() -> None:
    model = local_model(4, 2, kind="mlp", hidden=(3,), dtype=torch.float64, seed=4)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    assert model(torch.randn(5, 4, dtype=torch.float64)).dtype == torch.float64
    manual = 0.5 * sum(float((p.detach() ** 2).sum()) for p in model.parameters())
    assert float(l2_penalty(model).detach()) == pytest.approx(manual, rel=1e-14)
    assert torch_dtype("float64") is torch.float64 and torch_dtype("float32") is torch.float32
    with pytest.raises(ValueError, match="'half'"):
        torch_dtype("half")
