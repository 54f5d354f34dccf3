"""Training-dynamics diagnostics: per-loop modulation magnitudes, update sizes, read-outs and settle loops against
direct computations; per-group gradient norms against the global norm; the trainer's records and the
`analyze dynamics` command on a tiny run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from loopformer.cli import main
from loopformer.model import LoopedTransformer
from loopformer.model.config import ModelConfig
from loopformer.model.diagnostics import (
    fixed_modulation,
    grad_norms,
    loop_dynamics,
    modulation_ablations,
    modulation_stats,
    summarize_settle,
)
from loopformer.model.layers import PARAM_GROUPS, is_timestep_param, param_group
from loopformer.train.config import load_run_config
from loopformer.train.optim import make_optimizer
from loopformer.train.run import read_metrics
from loopformer.train.trainer import train

TINY = ["task.name=lcs", "task.options={length: 3, alphabet_min: 2, alphabet_max: 3}", "task.n_train=96",
        "task.n_test=40", "model.d_model=16", "model.n_heads=2", "model.loops=3", "model.input_injection=true",
        "train.batch_size=8", "train.optim.lr=3e-3", "train.log_every=2", "eval.batch_size=64", "eval.max_loops=4",
        "log.tensorboard=false", "log.progress=false"]


def _model(**kw) -> LoopedTransformer:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=11, max_len=16, d_model=16, n_heads=2, loops=3, causal=False,
                      input_injection=True, **kw)
    return LoopedTransformer(cfg)


@pytest.mark.parametrize("gate", [0.0, 1.0, 0.5])
def test_modulation_stats_at_init(gate):
    model = _model(timestep=True, timestep_gate_init=gate)
    st = modulation_stats(model, 5)
    assert st["gate_attn"] == pytest.approx([gate] * 5) and st["gate_mlp"] == pytest.approx([gate] * 5)
    assert st["alpha_attn"] == pytest.approx([1.0] * 5) and st["alpha_mlp"] == pytest.approx([1.0] * 5)
    assert modulation_stats(_model(), 5) is None


def test_modulation_stats_match_modulations():
    model = _model(timestep=True, timestep_gate_init=1.0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    with torch.no_grad():
        mods = model.modulations(4, torch.device("cpu"))                           # [R,k,4,D]
    st = modulation_stats(model, 4)
    for t in range(4):
        assert st["gate_attn"][t] == pytest.approx(float(mods[t, :, 0].abs().mean()), rel=1e-6)
        assert st["alpha_mlp"][t] == pytest.approx(float((1 + mods[t, :, 3]).abs().mean()), rel=1e-6)


def test_fixed_modulation_ablations_against_references():
    model = _model(timestep=True, timestep_gate_init=1.0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.eval()
    x = torch.randint(0, 11, (3, 7))
    own, own1 = model(x, loops=4).logits, model(x, loops=1).logits
    ab = modulation_ablations(model, 3)
    with torch.no_grad():
        mods = model.modulations(3, torch.device("cpu"))                              # [R,k,4,D]
    assert torch.allclose(ab["averaged over loops"], mods.mean(0))
    # without modulation: the looped model with the same shared weights
    plain = LoopedTransformer(ModelConfig(**{**model.config.__dict__, "timestep": False}))
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    assert not missing and unexpected and all(is_timestep_param(n) for n in unexpected)
    plain.eval()
    with fixed_modulation(model, ab["without modulation"]):
        assert torch.allclose(model(x, loops=4).logits, plain(x, loops=4).logits, atol=1e-6)
        with pytest.raises(RuntimeError, match="already active"):
            with fixed_modulation(model, mods[0]):
                pass
    # one loop's own modulation for every loop: loop 1's output is unchanged (up to float rounding: the fixed
    # modulation is computed once for all loops, the model's own per call), later loops differ
    with fixed_modulation(model, mods[0]):
        assert torch.allclose(model(x, loops=1).logits, own1, rtol=0, atol=1e-6)
        fixed = model(x, loops=4).logits
    assert not torch.allclose(fixed, own)
    assert torch.equal(model(x, loops=4).logits, own)                                # restored on exit
    assert "modulations" not in vars(model)
    assert modulation_ablations(_model(), 3) is None
    with pytest.raises(ValueError, match="timestep"):
        with fixed_modulation(_model(), mods[0]):
            pass


def _settle_reference(answers: list[list[tuple]]) -> list[int]:
    """answers[t][b]: sample b's answer after loop t+1 -> first loop after which it never changes."""
    R, B = len(answers), len(answers[0])
    out = []
    for b in range(B):
        s = 1
        for t in range(R):
            if answers[t][b] != answers[-1][b]:
                s = t + 2
        out.append(s)
    return out


def test_loop_dynamics_tokens_against_direct_computation():
    model = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 11, (6, 7), generator=g)
    y = torch.full((6, 7), -100)
    y[:, 5:] = torch.randint(0, 11, (6, 2), generator=g)
    R = 6
    res = loop_dynamics(model, x, y, loops=R)
    with torch.no_grad():
        out = model(x, loops=R, return_all=True)
        hs = [model.embed(x)] + list(out.all_hidden)
    for t in range(R):
        upd = [float((hs[t + 1][b] - hs[t][b]).norm() / hs[t][b].norm()) for b in range(6)]
        assert res["update"][t] == pytest.approx(np.mean(upd), rel=1e-5)
        assert res["update"][t] >= 0 and np.isfinite(res["update"][t])
        lg = out.all_logits[t]
        ce = F.cross_entropy(lg.reshape(-1, 11), y.reshape(-1), ignore_index=-100)
        assert res["loss"][t] == pytest.approx(float(ce), rel=1e-5)
        m = y != -100
        acc = float(((lg.argmax(-1) == y) & m).sum() / m.sum())
        assert res["token_accuracy"][t] == pytest.approx(acc)
    am = out.all_logits.argmax(-1)
    answers = [[tuple(am[t, b, 5:].tolist()) for b in range(6)] for t in range(R)]
    assert res["settle"] == _settle_reference(answers)
    assert len(set(res["settle"])) > 1 or max(res["settle"]) > 1   # the weights were perturbed enough to move


def test_loop_dynamics_vectors_settle_and_squared_error():
    torch.manual_seed(0)
    cfg = ModelConfig(input_dim=3, max_len=8, d_model=16, n_heads=2, loops=3, head="regression",
                      input_injection=True)
    model = LoopedTransformer(cfg)
    x, y = torch.randn(4, 6, 3), torch.randn(4, 6)
    w = torch.zeros(4, 6)
    w[:, 1::2] = 1
    res = loop_dynamics(model, x, y, loops=5, weight=w, settle_tol=1e-2)
    with torch.no_grad():
        pred = model(x, loops=5, return_all=True).all_logits[..., 0]             # [R,B,T]
    for t in range(5):
        assert res["loss"][t] == pytest.approx(float(((pred[t] - y) ** 2 * w).sum() / w.sum()), rel=1e-5)
    answers = [[tuple(((pred[t, b] - pred[-1, b]).abs() > 1e-2 * (1 + pred[-1, b].abs()))[w[b] > 0].tolist())
                for b in range(4)] for t in range(5)]
    moved = [[any(a) for a in row] for row in answers]
    ref = [1 + max([t + 1 for t in range(5) if moved[t][b]], default=0) for b in range(4)]
    assert res["settle"] == ref
    assert "token_accuracy" not in res


def test_summarize_settle():
    s = summarize_settle([1, 1, 2, 4, 4], 4)
    assert s["settle_hist"] == [2, 1, 0, 2] and s["settle_mean"] == pytest.approx(2.4)
    assert s["settle_median"] == 2.0


def test_param_groups_and_grad_norms():
    model = _model(timestep=True, timestep_gate_init=1.0, timestep_past="own")
    names = {n: param_group(n) for n, _ in model.named_parameters()}
    assert set(names.values()) == set(PARAM_GROUPS)
    assert names["blocks.0.past_modulation"] == names["past_injection"] == "past"
    assert is_timestep_param("past_injection")
    assert names["timestep.mlp.0.weight"] == "timestep" and names["blocks.0.modulation.weight"] == "modulation"
    assert names["blocks.0.attn.qkv.weight"] == "block" and names["embed.tok.weight"] == "embedding"
    assert names["head.proj.weight"] == "head" and names["norm_f.weight"] == "head"
    assert is_timestep_param("blocks.0.modulation.bias") and not is_timestep_param("blocks.0.mlp.fc.weight")
    x = torch.randint(0, 11, (3, 5))
    model(x).logits.square().mean().backward()
    gn = grad_norms(model)
    total = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).norm()
    assert sum(v ** 2 for v in gn.values()) == pytest.approx(float(total) ** 2, rel=1e-5)


def test_optimizer_timestep_groups(tmp_path):
    cfg = load_run_config(None, [*TINY, "model.timestep=true", "train.steps=1", "train.optim.timestep_lr_mult=0.1",
                                 "train.optim.timestep_weight_decay=0.0", f"out_dir={tmp_path}"])
    model = LoopedTransformer(cfg.model)
    opt = make_optimizer(model, cfg.train.optim)
    by_id = {id(p): n for n, p in model.named_parameters()}
    for g in opt.param_groups:
        ts = {is_timestep_param(by_id[id(p)]) for p in g["params"]}
        assert len(ts) == 1
        assert g["lr_mult"] == (0.1 if ts.pop() else 1.0)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    assert all(g["weight_decay"] == 0.0 for g in opt.param_groups if g["lr_mult"] == 0.1)
    # without timestep encoding: the two plain groups only
    assert len(make_optimizer(LoopedTransformer(cfg.model.replace(timestep=False)), cfg.train.optim).param_groups) == 2


def test_timestep_lr_mult_scales_the_step(tmp_path):
    """With lr_mult the timestep parameters move by exactly the multiplier's share of an Adam step."""
    base = [*TINY, "model.timestep=true", "model.timestep_gate_init=1.0", "train.steps=1",
            "train.optim.schedule=constant", "train.optim.warmup_steps=0", "train.optim.grad_clip=0",
            "train.optim.weight_decay=0"]
    deltas = {}
    for mult in (1.0, 0.25):
        cfg = load_run_config(None, [*base, f"train.optim.timestep_lr_mult={mult}", f"out_dir={tmp_path / str(mult)}"])
        torch.manual_seed(0)
        model = LoopedTransformer(cfg.model)
        before = model.blocks[0].modulation.bias.detach().clone()
        train(cfg)
        from safetensors.torch import load_file

        after = load_file(str(tmp_path / str(mult) / "checkpoint" / "model.safetensors"))["blocks.0.modulation.bias"]
        deltas[mult] = (after - before).abs().max().item()
    assert deltas[0.25] == pytest.approx(0.25 * deltas[1.0], rel=1e-3)


def test_trainer_logs_dynamics_without_changing_training(tmp_path):
    common = [*TINY, "model.timestep=true", "model.timestep_gate_init=1.0", "model.dropout=0.1", "train.steps=4"]
    on = load_run_config(None, [*common, f"out_dir={tmp_path / 'on'}"])
    off = load_run_config(None, [*common, "log.dynamics=false", f"out_dir={tmp_path / 'off'}"])
    train(on)
    train(off)
    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "on" / "checkpoint" / "model.safetensors"))
    b = load_file(str(tmp_path / "off" / "checkpoint" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)            # the diagnostics draw no random numbers
    recs = [r for r in read_metrics(tmp_path / "on") if r["split"] == "dynamics"]
    assert [r["step"] for r in recs] == [2, 4]
    assert not [r for r in read_metrics(tmp_path / "off") if r["split"] == "dynamics"]
    for r in recs:
        for k in ("gate_attn", "gate_mlp", "alpha_attn", "alpha_mlp", "update", "loop_loss", "loop_token_accuracy"):
            assert len(r[k]) == 3 and all(np.isfinite(r[k]))
        assert all(u >= 0 for u in r["update"])
        assert {f"grad_norm_{g}" for g in PARAM_GROUPS if g != "past"} <= set(r)   # past: timestep_past=own only
        assert 1 <= r["settle_mean"] <= 3


def test_analyze_dynamics_command(tmp_path, capsys):
    run = tmp_path / "run"
    train(load_run_config(None, [*TINY, "model.timestep=true", "train.steps=4", f"out_dir={run}"]))
    assert main(["analyze", "dynamics", str(run), "--max-loops", "6", "-n", "20", "--out", str(tmp_path / "d")]) == 0
    printed = capsys.readouterr().out
    assert "| 3 (r) |" in printed and "settle loop over 20 test rows" in printed
    rep = json.loads((tmp_path / "d" / "dynamics.json").read_text())
    per = rep["per_loop"]
    assert per["loops"] == 6 and len(per["gate_attn"]) == 6 and per["gate_attn"][0] >= 0
    assert sum(per["settle_hist"]) == 20 and all(u >= 0 for u in per["update"])
    ev = main(["eval", str(run), "--max-loops", "6", "--n", "20", "--json", str(tmp_path / "ev.json")])
    assert ev == 0
    curve = json.loads((tmp_path / "ev.json").read_text())["loopwise"]
    assert per["accuracy"] == pytest.approx([c["accuracy"] for c in curve])   # the task's exact-match per loop
    assert [s for s in rep["training"]["step"]] == [2, 4]
    ab = rep["ablation"]   # the TMLT at r as trained, with the loops' average modulation, without modulation
    assert ab["metric"] == "accuracy" and ab["as trained"] == pytest.approx(per["accuracy"][2])
    assert all(0 <= ab[k] <= 1 for k in ("averaged over loops", "without modulation"))
    assert "accuracy at r = 3: as trained" in printed
    dr = rep["drift"]   # past r: the metric up to 4r (the same scoring as eval's curve), a verdict
    assert dr["loops"] == 3 and len(dr["metric_per_loop"]) == 12 and len(dr["state_change"]) == 12
    assert dr["metric_per_loop"][:6] == pytest.approx([c["accuracy"] for c in curve])
    assert dr["verdict"] in ("settling", "marginal", "drifting") and "Drift past r" in printed
    for f in ("dynamics.md", "dynamics_loops.png", "dynamics_train.png", "dynamics_drift.png"):
        assert (tmp_path / "d" / f).stat().st_size > 0
    # a checkpoint folder alone: per-loop view only
    assert main(["analyze", "dynamics", str(run / "checkpoint"), "--out", str(tmp_path / "c")]) == 0
    assert (tmp_path / "c" / "dynamics_loops.png").is_file()


def test_analyze_dynamics_bad_input(tmp_path, capsys):
    assert main(["analyze", "dynamics", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not found" in err[0]
    (tmp_path / "empty").mkdir()
    assert main(["analyze", "dynamics", str(tmp_path / "empty")]) == 2


def test_training_curves_read_null_as_nan():
    from loopformer.analysis.dynamics import training_curves

    recs = [{"split": "dynamics", "step": 2, "grad_norm_block": None, "update": [0.5, None], "settle_mean": None},
            {"split": "train", "step": 2, "loss": 1.0},
            {"split": "dynamics", "step": 4, "grad_norm_block": 0.25, "update": [0.1, 0.3], "settle_mean": 1.5}]
    c = training_curves(recs)
    assert c["step"] == [2, 4]
    assert np.isnan(c["grad_norm_block"][0]) and c["grad_norm_block"][1] == 0.25
    assert c["mean_update"] == pytest.approx([0.5, 0.2]) and np.isnan(c["settle_mean"][0])
