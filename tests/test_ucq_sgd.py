"""TP-UCQ-SGD (TablePuppet Eq. 17-19): learning over the union with SGD reproduces TP-Join-SGD on the same
rows."""

from __future__ import annotations

import numpy as np

from tests.test_ucq_admm import history, run


def test_tp_ucq_sgd_reproduces_tp_join_sgd():
    common = (
        "algorithm=sgd",
        "dataset=synthetic",
        "precision=float64",
        "epochs=2",
        "algorithm.batch_size=700",
        "algorithm.min_steps=0",
    )
    join, ucq = run(*common), run(*common, "scenario=ucq")
    assert len(ucq.strategy.clients) == 6  # fact and d1 in 2 shards each
    np.testing.assert_allclose(history(ucq), history(join), rtol=1e-9)
    np.testing.assert_allclose(history(ucq, "train_loss"), history(join, "train_loss"), rtol=1e-9)
    for t in ("fact", "d1", "d2", "d3"):
        for shard in [k for k in ucq.strategy.clients if k[0] == t]:  # every shard holds the same model
            for name, value in join.theta((t, 0)).items():
                np.testing.assert_allclose(ucq.theta(shard)[name], value, rtol=1e-9, atol=1e-12)
    h = ucq.strategy.results.history
    n_batches = -(-ucq.strategy.train.N // 700)
    assert h[-1].rounds_inner - h[0].rounds_inner == n_batches  # one coordinator round per batch
    assert h[-1].rounds - h[0].rounds == 2 * n_batches  # two round trips per batch


def test_tp_ucq_sgd_reproduces_tp_join_sgd_on_movielens():
    """ratings and users in 2 shards each; users' one-hot ids come from federated preprocessing (digest order),
    so the columns are permuted: from zero weights the trajectory is the same."""
    common = (
        "algorithm=sgd",
        "dataset=movielens",
        "precision=float64",
        "epochs=2",
        "model.init=zeros",
        "algorithm.batch_size=20000",
    )
    join, ucq = run(*common), run(*common, "scenario=ucq")
    np.testing.assert_allclose(history(ucq), history(join), rtol=1e-9)
    np.testing.assert_allclose(history(ucq, "train_loss"), history(join, "train_loss"), rtol=1e-9)
