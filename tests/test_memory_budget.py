"""The server's memory budget per algorithm family (simulations/bench/memory.py, docs/results.md): a change that
makes the server keep a per-row array twice, or in float64 where the run is float32, fails here, not at a user's
100 million rows. About 1M joined rows per family (the scale bench measures the same at 10M). SGD and L-BFGS run
with their default validation part: the state model selection keeps (the kept evaluation's test predictions) is
inside their budgets, which fail when it is kept twice (tested)."""

from __future__ import annotations

import numpy as np
import pytest

from simulations.bench.memory import FAMILIES, budget_fit, family_state, over_budget, state_bytes

N = 1_000_000  # joined rows of the scale schema (fanout 2: 125,000 fact rows, 126,200 table rows)
#: every family on the scale schema (mostly per joined row), and on a fact table of N rows (fanout 1: every joined
#: row a table row) the families that a 100M-row fact table runs, where a per-table-row array kept twice fails
CASES = [(family, 2) for family in FAMILIES] + [("pcg_classic", 1), ("admm", 1)]


@pytest.mark.parametrize("family, fanout", CASES, ids=[f"{f}-fanout{k}" for f, k in CASES])
def test_server_state_within_the_family_budget(family, fanout):
    run = family_state(family, N, fanout=fanout)
    doc = FAMILIES[family]
    budget = doc.per_joined * run["n_joined"] + doc.per_table * run["table_rows"]
    per_row = run["state_bytes"] / run["n_joined"]
    assert run["epochs"] == doc.epochs and run["test_metric"] < 1.0  # trained (constant predictor: 1.58)
    assert run["state_bytes"] <= budget, (
        f"{family}: {per_row:.1f} bytes of server state per joined row, over its budget of "
        f"{budget / run['n_joined']:.1f} ({doc.per_joined:g} per joined row + {doc.per_table:g} per table row; "
        f"by attribute: {run['by_attribute']})"
    )


def test_the_kept_models_state_kept_twice_is_over_the_budget(monkeypatch):
    """Model selection's per-row state (the kept evaluation's test predictions) is inside SGD's budget with less
    than its size to spare: a second copy of it fails the budget."""
    from strategies.selection import ModelSelection

    observe = ModelSelection.observe

    def observe_keeping_a_copy(self, record, test_predictions, val_loss):
        observe(self, record, test_predictions, val_loss)
        self.second_copy = np.array(self.best_predictions, copy=True)

    monkeypatch.setattr(ModelSelection, "observe", observe_keeping_a_copy)
    with pytest.raises(AssertionError, match=r"sgd: .* over its budget .*'selection': 2400000"):
        test_server_state_within_the_family_budget("sgd", 2)


def test_state_counts_an_array_and_its_views_once_and_fits_two_terms():
    a = np.zeros(1000)
    msg = bytes(800)
    view = np.frombuffer(msg, dtype=np.float64)
    assert state_bytes({"x": {"a": a, "b": a[10:], "c": [a[::2], view]}, "y": (view[3:], a)}) == {"x": 8800, "y": 0}
    runs = [
        {"n_joined": 100, "table_rows": 10, "state_bytes": 100 * 20 + 10 * 8},
        {"n_joined": 100, "table_rows": 100, "state_bytes": 100 * 20 + 100 * 8},
    ]
    fit = budget_fit(runs)
    assert fit == {"per_joined": 20.0, "per_table": 8.0}
    assert over_budget("sgd", fit) == [
        f"sgd: 8.0 bytes of server state per table row, documented budget {FAMILIES['sgd'].per_table:g}"
    ]
