"""Drift diagnostics (loopformer.eval.drift): state change, read-out change, the spectral radius of the loop map and
the verdict against direct computations and constructed models."""

from __future__ import annotations

import json

import torch

from loopformer.eval.drift import THRESHOLDS, drift_report, drift_table, spectral_radius, trajectory, verdict
from loopformer.model import LoopedTransformer
from loopformer.model.config import ModelConfig
from loopformer.model.diagnostics import state_grad_norms
from loopformer.model.options import LoopOptions
from loopformer.sources import make_data
from loopformer.train.config import load_run_config

TINY = ["task.name=pointer_chase", "task.options={symbols: 6, hops: 2}", "task.n_train=64", "task.n_test=24",
        "model.d_model=16", "model.n_heads=2", "model.loops=3", "model.input_injection=true"]


def _model(**kw) -> LoopedTransformer:
    torch.manual_seed(0)
    return LoopedTransformer(ModelConfig(vocab_size=11, max_len=16, d_model=16, n_heads=2, loops=3, causal=False,
                                         input_injection=True, **kw)).eval()


def test_state_change_against_direct_computation():
    m = _model()
    x = torch.randint(0, 11, (4, 6))
    y = torch.randint(0, 11, (4, 6))
    got = trajectory(m, x, y, loops=5)
    with torch.no_grad():
        hs = [m.embed(x)] + [m(x, loops=t).hidden for t in range(1, 6)]
        logits = [m(x, loops=t).logits for t in range(1, 6)]
    want = [float(((hs[t] - hs[t - 1]).flatten(1).norm(dim=1) / hs[t - 1].flatten(1).norm(dim=1)).mean())
            for t in range(1, 6)]
    assert torch.allclose(torch.tensor(got["state_change"]), torch.tensor(want), rtol=1e-5)
    flips = [float((logits[t].argmax(-1) != logits[t - 1].argmax(-1)).float().mean()) for t in range(1, 5)]
    assert torch.allclose(torch.tensor(got["readout_change"]), torch.tensor([0.0] + flips))


def test_spectral_radius_against_exact_eigenvalues_and_the_identity():
    m = _model()
    x = torch.randint(0, 11, (3, 5))
    rho = spectral_radius(m, x, loops=3, iters=200)
    with torch.no_grad():
        h = m(x, loops=3).hidden
    exact = []
    for b in range(3):            # rows are independent: row b's Jacobian [T·D, T·D], its eigenvalues
        f = lambda s, b=b: m(x[b:b + 1], loops=1,  # noqa: E731
                             opts=LoopOptions(state=s.view(1, 5, 16), loop_offset=3)).hidden.flatten()
        J = torch.autograd.functional.jacobian(f, h[b].flatten())
        exact.append(float(torch.linalg.eigvals(J).abs().max()))
    assert torch.allclose(torch.tensor(rho), torch.tensor(exact), rtol=3e-2)
    # with both branches' output projections zeroed the loop map is h -> h + e: the Jacobian is I, ρ = 1
    with torch.no_grad():
        m.blocks[0].attn.proj.weight.zero_()
        m.blocks[0].mlp.proj.weight.zero_()
    assert torch.allclose(torch.tensor(spectral_radius(m, x, loops=3)), torch.ones(3), atol=1e-5)


def test_verdict_thresholds():
    r = 4
    assert verdict({4: 0.99, 8: 0.985, 16: 0.98}, 1e-3, r, True) == "settling"
    assert verdict({4: 0.99, 8: 0.95, 16: 0.95}, 1e-3, r, True) == "marginal"       # 4 points lost
    assert verdict({4: 0.99, 8: 0.90, 16: 0.80}, 1e-3, r, True) == "drifting"       # 19 points lost
    assert verdict({4: 0.99, 8: 0.99, 16: 0.99}, 0.5, r, True) == "drifting"        # the state still moves
    assert verdict({4: 0.99, 8: 0.99, 16: 0.99}, 0.05, r, True) == "marginal"
    assert verdict({4: 0.10, 8: 0.101, 16: 0.1015}, 1e-3, r, False) == "settling"   # MSE within 2 %
    assert verdict({4: 0.10, 8: 0.2, 16: 0.3}, 1e-3, r, False) == "drifting"
    assert THRESHOLDS["settle_points"] < THRESHOLDS["drift_points"]


def test_drift_report_on_a_task():
    cfg = load_run_config(None, TINY)
    data = make_data(cfg.task)
    m = LoopedTransformer(ModelConfig(**{**cfg.model.__dict__})).eval()
    rep = drift_report(m, data, batch_size=8, rows=8)
    assert rep["loops"] == 3 and rep["max_loops"] == 12
    assert len(rep["metric_per_loop"]) == 12 and len(rep["state_change"]) == 12
    assert rep["at"]["1r"] == rep["metric_per_loop"][2] and rep["at"]["4r"] == rep["metric_per_loop"][11]
    assert rep["verdict"] in ("settling", "marginal", "drifting")
    assert rep["spectral_radius"]["rows"] == 8 and rep["spectral_radius"]["max"] >= rep["spectral_radius"]["median"]
    assert "| 4r |" in drift_table(rep)


def test_state_grad_norms_against_the_remaining_loops_run_at_once():
    """‖∂L/∂h_t‖ from the one-loop-per-call chain equals the gradient through a single call running loops t+1..R
    from h_t (the carried-state path), for a TMLT whose loops differ."""
    m = _model(timestep=True, timestep_gate_init=0.5)
    x = torch.randint(0, 11, (3, 6))
    y = torch.randint(0, 11, (3, 6))
    y[:, :2] = -100                                                   # unsupervised positions
    R = 4
    got = state_grad_norms(m, x, y, loops=R, ignore_index=-100)
    want = []
    for t in range(1, R + 1):
        h = m(x, loops=t).hidden.detach().requires_grad_(True)
        logits = m(x, loops=R - t, opts=LoopOptions(state=h, loop_offset=t)).logits if t < R else m.head(m.norm_f(h))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), y.reshape(-1), ignore_index=-100)
        (g,) = torch.autograd.grad(loss, h)
        want.append(float(g.flatten(1).norm(dim=1).mean()))
    assert len(got) == R
    assert torch.allclose(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-8)
    assert all(p.grad is None for p in m.parameters())               # the parameters' gradients untouched


def test_runs_record_drift_and_per_loop_state_gradients(tmp_path):
    from loopformer.train.trainer import train
    run = tmp_path / "r"
    res = train(load_run_config(None, [*TINY, "train.steps=4", "train.log_every=2", "train.system.compile=false",
                                       f"out_dir={run}"]))
    d = res["drift"]
    assert d["loops"] == 3 and len(d["metric_per_loop"]) == 12 and d["verdict"] in ("settling", "marginal", "drifting")
    assert d["at"]["2r"] == res["loopwise"][5][d["metric"]]          # the loop-wise curve, reused up to 2r
    on_disk = json.loads((run / "results.json").read_text())
    assert on_disk["drift"]["verdict"] == d["verdict"]
    assert on_disk["peak_memory_mb"]["host"] > 10                   # this process's peak resident set (MiB)
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    dyn = [r for r in recs if r["split"] == "dynamics"]
    assert dyn and all(len(r["state_grad"]) == 3 and all(g >= 0 for g in r["state_grad"]) for r in dyn)
    assert any(g > 0 for g in dyn[-1]["state_grad"])
    off = train(load_run_config(None, [*TINY, "train.steps=1", "eval.drift=false", "train.system.compile=false",
                                       f"out_dir={tmp_path / 'off'}"]))
    assert "drift" not in off


def test_eval_drift_flag_prints_the_verdict(tmp_path, capsys):
    from loopformer.cli import main
    from loopformer.train.trainer import train
    run = tmp_path / "r"
    train(load_run_config(None, [*TINY, "train.steps=2", "train.system.compile=false", f"out_dir={run}"]))
    js = tmp_path / "e.json"
    assert main(["eval", str(run), "--drift", "--quiet", "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "drift past r" in out and "| 4r |" in out
    assert json.loads(js.read_text())["drift"]["max_loops"] == 12
    assert main(["eval", str(run), "--quiet", "--json", str(js)]) == 0
    assert "drift" not in json.loads(js.read_text())
