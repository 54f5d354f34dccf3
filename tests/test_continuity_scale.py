"""Scale-invariant continuity measures (relative ratios, after the final norm, per loop, TMLT gates) against maps
whose values are known in closed form."""

import numpy as np
import pytest
import torch
import torch.nn as nn

from loopformer.analysis.continuity import (
    ContinuityConfig,
    EmbeddingMap,
    LoopedEmbeddingMap,
    continuity_of_checkpoint,
    measure_continuity,
    scale_free_ratios,
    to_markdown,
)
from loopformer.model import LoopedTransformer, ModelConfig


class Linear(EmbeddingMap):
    """f(X)_n = c · Q X_n, Q orthogonal: raw ratios c, relative ratios exactly 1."""

    def __init__(self, V, D, c, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.randn(V, D, generator=g, dtype=torch.float64)
        q, _ = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))
        self.W = c * q

    def embed(self, idx):
        return self.emb[idx]

    def apply(self, X):
        return X @ self.W.T


class Scaled(EmbeddingMap):
    """c · f for a looped model's map: raw measures scale by c, relative ones do not."""

    def __init__(self, inner, c):
        self.inner, self.c = inner, c

    def embed(self, idx):
        return self.inner.embed(idx)

    def apply(self, X):
        return self.c * self.inner.apply(X)

    def apply_all(self, X):
        out = self.inner.apply_all(X)
        return {"loops": self.c * out["loops"], "normed": out["normed"]}


def _model(timestep=False, injection=False, loops=3, seed=0, **kw):
    torch.manual_seed(seed)
    return LoopedTransformer(ModelConfig(vocab_size=25, max_len=16, d_model=16, n_heads=2, loops=loops,
                                         timestep=timestep, input_injection=injection, **kw)).double()


def test_linear_map_relative_is_one():
    V, D, T, c = 30, 8, 6, 2.5
    idx = torch.as_tensor(np.random.default_rng(0).integers(0, V, size=(4, T)))
    rep = measure_continuity(Linear(V, D, c), idx, V,
                             ContinuityConfig(samples=4, length=T, scales=(1e-2,), power_iters=10), progress=False)
    assert rep.loopwise["raw"][0].mean == pytest.approx(c, rel=1e-12)
    assert rep.relative["sequence"].mean == pytest.approx(1.0, rel=1e-12)
    assert rep.relative["sequence"].max == pytest.approx(1.0, rel=1e-12)
    assert rep.relative["jacobian"].mean == pytest.approx(1.0, rel=1e-9)
    assert rep.relative_coefficient == pytest.approx(1.0, rel=1e-9)
    assert rep.coefficient == pytest.approx(c, rel=1e-9)
    assert rep.output_rms == pytest.approx(c * rep.input_rms, rel=1e-12)
    assert rep.normed == {}                                     # no final norm on this map


@pytest.mark.parametrize("injection", [False, True])
def test_identity_tmlt_per_loop(injection):
    """adaLN-Zero TMLT at init: h_t = X (no injection) or t·X (injection) — raw ratio 1 or t, relative 1, RMS(h_t)
    = RMS(X) or t·RMS(X); the gates are exactly 0."""
    m = _model(timestep=True, injection=injection, loops=3, timestep_gate_init=0.0)
    idx = torch.as_tensor(np.random.default_rng(0).integers(0, 25, size=(3, 10)))
    rep = continuity_of_checkpoint(m, idx.flatten().numpy(), 25,
                                   ContinuityConfig(samples=3, length=10, scales=(1e-2,), power_iters=3),
                                   progress=False)
    for t in range(3):
        c = (t + 1) if injection else 1
        assert rep.loopwise["raw"][t].mean == pytest.approx(c, rel=1e-9)
        assert rep.loopwise["relative"][t].mean == pytest.approx(1.0, rel=1e-9)
        assert rep.loopwise["rms"][t] == pytest.approx(c * rep.input_rms, rel=0.05)
    assert rep.gates["gate_attn"] == [0.0, 0.0, 0.0] and rep.gates["gate_mlp"] == [0.0, 0.0, 0.0]
    assert rep.relative_coefficient == pytest.approx(1.0, rel=1e-6)
    table = to_markdown({"tmlt": rep})
    assert "| 3 | " in table and "tmlt \\|γ1\\| / \\|γ2\\|" in table
    assert "relative local Lipschitz" in table


def test_relative_measures_ignore_output_scale():
    m = _model(loops=3, seed=1)
    fmap = LoopedEmbeddingMap(m)
    idx = torch.as_tensor(np.random.default_rng(2).integers(0, 25, size=(3, 9)))
    cfg = ContinuityConfig(samples=3, length=9, scales=(1e-2,), power_iters=8)
    a = measure_continuity(fmap, idx, 25, cfg, progress=False)
    b = measure_continuity(Scaled(fmap, 10.0), idx, 25, cfg, progress=False)
    assert b.coefficient == pytest.approx(10 * a.coefficient, rel=1e-9)
    assert b.relative_coefficient == pytest.approx(a.relative_coefficient, rel=1e-9)
    assert b.relative["sequence"].mean == pytest.approx(a.relative["sequence"].mean, rel=1e-9)
    for t in range(3):
        assert b.loopwise["raw"][t].mean == pytest.approx(10 * a.loopwise["raw"][t].mean, rel=1e-9)
        assert b.loopwise["relative"][t].mean == pytest.approx(a.loopwise["relative"][t].mean, rel=1e-9)
    assert a.gates == {} and "γ1" not in to_markdown({"looped": a})


def test_scale_free_ratios_against_a_direct_computation():
    m = _model(loops=2, seed=3, timestep=True)
    for blk in m.blocks:                                          # a trained-looking modulation
        nn.init.normal_(blk.modulation.weight, 0, 0.3)
    fmap = LoopedEmbeddingMap(m)
    idx = torch.as_tensor(np.random.default_rng(3).integers(0, 25, size=(2, 7)))
    X = fmap.embed(idx).detach()
    rho = 1e-3
    r = scale_free_ratios(fmap, X, rho, torch.Generator().manual_seed(5))
    d = torch.randn(X.shape, generator=torch.Generator().manual_seed(5), dtype=X.dtype) * rho
    with torch.no_grad():
        h0, h1 = fmap.apply_all(X), fmap.apply_all(X + d)
    for b in range(2):
        dx, nx = d[b].norm().item(), X[b].norm().item()
        for t in range(2):
            dh = (h1["loops"][t, b] - h0["loops"][t, b]).norm().item()
            assert r["raw"][t, b] == pytest.approx(dh / dx, rel=1e-9)
            assert r["relative"][t, b] == pytest.approx((dh / h0["loops"][t, b].norm().item()) / (dx / nx), rel=1e-9)
        n0, n1 = m.norm_f(h0["loops"][-1, b]), m.norm_f(h1["loops"][-1, b])
        assert r["normed raw"][b] == pytest.approx((n1 - n0).norm().item() / dx, rel=1e-9)
        assert r["normed relative"][b] == pytest.approx(((n1 - n0).norm() / n0.norm()).item() / (dx / nx), rel=1e-9)


def test_cli_reports_relative_and_per_loop_measures(tmp_path, capsys, monkeypatch):
    import json

    import loopformer.analysis.continuity as cont
    from loopformer.cli import main
    from loopformer.model.io import save_checkpoint
    from loopformer.text.corpus import PrepareOptions, prepare_corpus

    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "omega"]
    (tmp_path / "t.txt").write_text("".join(" ".join(rng.choice(words, 6)) + "\n" for _ in range(120)))
    prepare_corpus(str(tmp_path / "t.txt"), tmp_path / "data", PrepareOptions(vocab_size=270), progress=False,
                   log=lambda s: None)
    vocab = json.loads((tmp_path / "data" / "manifest.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "tmlt", LoopedTransformer(ModelConfig(vocab_size=vocab, max_len=16, d_model=16,
                                                                     n_heads=2, loops=2, timestep=True,
                                                                     timestep_gate_init=0.0)))
    monkeypatch.setattr(cont, "plot", lambda reports, path: None)
    args = ["analyze", "continuity", str(tmp_path / "tmlt"), "--data", str(tmp_path / "data"), "--samples", "2",
            "--length", "12", "--scales", "0.1", "--power-iters", "2", "--quiet", "--out", str(tmp_path / "o")]
    assert main(args + ["--loopwise-scale", "0.05"]) == 0
    printed = capsys.readouterr().out
    assert "| 2 | " in printed and "relative local Lipschitz" in printed
    data = json.loads((tmp_path / "o" / "continuity.json").read_text())["models"]["tmlt"]
    assert data["relative_coefficient"] == pytest.approx(1.0, rel=1e-4)        # the identity at init
    assert data["gates"]["gate_attn"] == [0.0, 0.0] and data["loopwise_scale"] == 0.05
    assert len(data["loopwise"]["relative"]) == 2
    assert main(args + ["--loopwise-scale", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("loopformer: error:")
