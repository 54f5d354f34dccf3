"""In-context learning: function classes against direct evaluation, curriculum, layout, metric and baselines."""

import numpy as np
import pytest

from loopformer.errors import UserError
from loopformer.tasks.icl import (
    Curriculum,
    ICLTask,
    baseline_curves,
    decision_tree_baseline,
    interleave,
    knn_baseline,
    least_squares_baseline,
    prediction_positions,
    squared_error_curve,
)


def tree_value(coords, values, x, depth):
    node = 0
    for _ in range(depth):
        node = 2 * node + (2 if x[coords[node]] > 0 else 1)
    return values[node]


def test_decision_tree_matches_walk():
    task = ICLTask("decision_tree", n_dims=20, depth=4)
    rng = np.random.default_rng(0)
    params = task.sample_functions(5, rng)
    assert params["coords"].shape == (5, 31) and params["coords"].max() < 20
    xs = task.sample_xs(5, rng, None, 30)
    ys = task.evaluate(params, xs)
    for b in range(5):
        for i in range(30):
            assert ys[b, i] == tree_value(params["coords"][b], params["values"][b], xs[b, i], 4)
    assert len(np.unique(ys[0])) <= 16


def test_linear_classes_and_truncation():
    rng = np.random.default_rng(1)
    lin = ICLTask("linear", n_dims=8)
    out = lin.sample(4, rng, n_dims_active=3, n_points=10)
    assert out["xs"].dtype == np.float32 and out["xs"].shape == (4, 10, 8) and out["ys"].shape == (4, 10)
    assert (out["xs"][:, :, 3:] == 0).all() and (out["xs"][:, :, :3] != 0).all()
    p = lin.sample_functions(4, rng)
    xs = lin.sample_xs(4, rng, None, 6)
    assert np.allclose(lin.evaluate(p, xs), np.stack([xs[b] @ p["w"][b] for b in range(4)]))
    sp = ICLTask("sparse_linear", n_dims=10, sparsity=3)
    w = sp.sample_functions(50, rng, n_dims_active=6)["w"]
    assert ((w != 0).sum(axis=1) == 3).all() and (w[:, 6:] == 0).all()
    nn = ICLTask("relu2nn", n_dims=5, hidden=7)
    p = nn.sample_functions(2, rng)
    xs = nn.sample_xs(2, rng, None, 4)
    want = np.stack([np.maximum(xs[b] @ p["u"][b], 0) @ p["v"][b] * np.sqrt(2 / 7) for b in range(2)])
    assert np.allclose(nn.evaluate(p, xs), want)


def test_sampling_is_seeded():
    task = ICLTask()
    a = task.sample(3, np.random.default_rng(5), 7, 11)
    b = task.sample(3, np.random.default_rng(5), 7, 11)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    with pytest.raises(UserError):
        ICLTask("quadratic")
    with pytest.raises(UserError):
        task.sample(1, np.random.default_rng(0), n_dims_active=21)


def test_curriculum_matches_stepwise_updates():
    cur = Curriculum()                          # the paper's: dims 5->20 by 1, points 26->101 by 5, every 5000
    dims, points = cur.dims_start, cur.points_start
    for step in range(0, 120_000):
        if step and step % 5000 == 0:
            dims = min(dims + 1, 20)
            points = min(points + 5, 101)
        if step % 2500 == 0:
            assert cur.at(step) == (dims, points)
    assert cur.at(0) == (5, 26) and cur.at(75_000) == (20, 101) and cur.at(10**7) == (20, 101)


def test_interleave_layout_numpy_and_torch():
    xs = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    ys = -np.arange(6, dtype=np.float32).reshape(2, 3) - 1
    zs, pos = interleave(xs, ys)
    assert zs.shape == (2, 6, 5)
    assert np.array_equal(zs[:, 0::2, :4], xs) and (zs[:, 0::2, 4] == 0).all()
    assert np.array_equal(zs[:, 1::2, 4], ys) and (zs[:, 1::2, :4] == 0).all()
    assert pos.tolist() == [0, 2, 4] == prediction_positions(3).tolist()
    torch = pytest.importorskip("torch")
    tz, tpos = interleave(torch.from_numpy(xs), torch.from_numpy(ys))
    assert torch.equal(tz, torch.from_numpy(zs)) and tpos.tolist() == [0, 2, 4]


def test_squared_error_curve_hand_made():
    ys = np.array([[1.0, 2.0], [3.0, 4.0]])
    pred = np.array([[1.0, 0.0], [1.0, 4.0]])
    assert np.allclose(squared_error_curve(pred, ys, n_dims=2), [(0 + 4) / 2 / 2, (4 + 0) / 2 / 2])


def test_baselines():
    rng = np.random.default_rng(0)
    task = ICLTask("linear", n_dims=5)
    out = task.sample(16, rng, n_points=12)
    ls = least_squares_baseline(out["xs"], out["ys"])
    err = squared_error_curve(ls, out["ys"], 5)
    assert err[0] == pytest.approx(float((out["ys"][:, 0] ** 2).mean()) / 5, rel=1e-5)
    assert err[6:].max() < 1e-6                 # noiseless and at least d examples: exact recovery
    assert err[2] > 0.05
    knn = knn_baseline(out["xs"], out["ys"], k=3)
    b, i = 3, 7                                 # direct check of one prediction
    d = ((out["xs"][b, :i] - out["xs"][b, i]) ** 2).sum(1)
    assert knn[b, i] == pytest.approx(out["ys"][b, np.argsort(d)[:3]].mean(), rel=1e-5)
    tree_task = ICLTask("decision_tree", n_dims=4, depth=2)
    tr = tree_task.sample(4, rng, n_points=40)
    dt_err = squared_error_curve(decision_tree_baseline(tr["xs"], tr["ys"]), tr["ys"], 4)
    assert dt_err[-15:].mean() < dt_err[:3].mean()
    curves = baseline_curves(tr["xs"][:, :10], tr["ys"][:, :10], 4, names=["zero", "knn"])
    assert set(curves) == {"zero", "knn"} and curves["zero"].shape == (10,)


def test_reference_predictors_are_scored_like_the_model():
    """references() on the test prompts: predicting 0 scores what a model that outputs 0 scores in evaluation, least
    squares is exact once the prompt holds d examples."""
    import torch

    from loopformer.eval.evaluate import loop_metrics
    from loopformer.model.looped import LoopOutput
    from loopformer.sources import TaskConfig, make_data

    cfg = TaskConfig(name="icl", options={"function_class": "linear", "n_dims": 3}, n_test=64, points=9)
    data = make_data(cfg)
    refs = data.references()
    assert set(refs) == {"zero", "least_squares", "knn"}

    class Zero(torch.nn.Module):
        config = type("C", (), {"loops": 1, "out_dim": 1})()

        def forward(self, x, loops, return_all=False):
            z = torch.zeros(*x.shape[:2], 1)
            return LoopOutput(logits=z, hidden=z, all_logits=z[None].expand(loops, *z.shape))

    got = loop_metrics(Zero(), data, 1, False, 16, 0, torch.device("cpu"), torch.no_grad, False)[0]
    assert got["mse"] == pytest.approx(refs["zero"]["mse"], rel=1e-5)
    assert got["mse_last"] == pytest.approx(refs["zero"]["mse_last"], rel=1e-5)
    assert refs["least_squares"]["mse_last"] < 1e-8 < refs["knn"]["mse_last"] < refs["zero"]["mse_last"] * 2
