"""Elastic depth: a loop count per row, the budget-aware timestep encoding (normalised time and step), budgets drawn
in training, the fixed-point loss, and evaluation over budgets — each against a reference run
with a fixed loop count or a hand-written computation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from loopformer.cli import main
from loopformer.errors import UserError
from loopformer.eval.budgets import evaluate_budgets, parse_budgets
from loopformer.eval.evaluate import evaluate
from loopformer.model import LoopedTransformer, ModelConfig
from loopformer.model.convert import to_normalized_time
from loopformer.model.options import LoopOptions
from loopformer.sources import TokenData
from loopformer.tasks import IGNORE
from loopformer.train.config import load_run_config
from loopformer.train.distributed import setup, teardown
from loopformer.train.losses import fixed_point_loss
from loopformer.train.optim import loops_at, sample_loops
from loopformer.train.run import load_for_resume, read_metrics, read_results
from loopformer.train.trainer import Trainer, train

TINY = ["task.name=lcs", "task.options={length: 3, alphabet_min: 2, alphabet_max: 3}", "task.n_train=96",
        "task.n_test=40", "model.d_model=16", "model.n_heads=2", "model.loops=3", "model.input_injection=true",
        "train.batch_size=8", "train.optim.lr=3e-3", "train.log_every=1", "eval.batch_size=64", "eval.max_loops=6",
        "log.tensorboard=false", "log.progress=false", "train.system.compile=false"]


def tiny(tmp_path: Path, *extra: str, name: str = "run"):
    return load_run_config(None, [*TINY, f"out_dir={tmp_path / name}", *extra])


def _model(time: str = "index", timestep: bool = True, causal: bool = False, loops: int = 4) -> LoopedTransformer:
    cfg = ModelConfig(vocab_size=16, max_len=12, d_model=32, n_heads=2, loops=loops, timestep=timestep,
                      timestep_time=time if timestep else "index", input_injection=True, causal=causal)
    m = LoopedTransformer(cfg).eval()
    with torch.no_grad():   # modulations that differ from loop to loop (at init they are all alike)
        if m.timestep is not None:
            for p in m.timestep.parameters():
                p.add_(torch.randn_like(p) * 0.3)
            for b in m.blocks:
                b.modulation.weight.normal_(0, 0.1)
    return m


# ------------------------------------------------------------------ the model
@pytest.mark.parametrize("time,timestep", [("index", False), ("index", True), ("normalized", True)])
def test_row_loops_equal_fixed_runs(time, timestep):
    m = _model(time, timestep)
    x = torch.randint(0, 16, (5, 12))
    rows = torch.tensor([1, 3, 4, 2, 6])
    out = m(x, loops=6, return_all=True, opts=LoopOptions(row_loops=rows))
    for b in range(5):
        ref = m(x[b:b + 1], loops=int(rows[b]))
        torch.testing.assert_close(out.logits[b], ref.logits[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.hidden[b], ref.hidden[0], atol=1e-5, rtol=1e-5)
        # after its own loops a row's state stays where it stopped
        torch.testing.assert_close(out.all_hidden[-1, b], out.all_hidden[int(rows[b]) - 1, b])


def test_row_loops_refused_when_malformed():
    m = _model()
    x = torch.randint(0, 16, (2, 12))
    with pytest.raises(UserError, match="one loop count per row"):
        m(x, loops=4, opts=LoopOptions(row_loops=torch.tensor([1, 2, 3])))
    with pytest.raises(UserError, match=r"1\.\.4"):
        m(x, loops=4, opts=LoopOptions(row_loops=torch.tensor([0, 2])))
    with pytest.raises(UserError, match=r"1\.\.4"):
        m(x, loops=4, opts=LoopOptions(row_loops=torch.tensor([5, 2])))


def test_normalized_time_is_the_loop_index_at_r_and_stretches_elsewhere():
    m = _model("normalized", loops=4)
    tau, step = m.loop_times(4, torch.device("cpu"))
    assert torch.equal(tau, torch.arange(4.0)) and torch.equal(step, torch.ones(4))
    tau, step = m.loop_times(8, torch.device("cpu"))             # 8 loops over the same times: half steps
    assert torch.allclose(tau, torch.arange(8.0) / 2) and torch.allclose(step, torch.full((8,), 0.5))
    tau, step = m.loop_times(2, torch.device("cpu"), offset=2, budget=4)   # the second half of a run of 4
    assert torch.equal(tau, torch.tensor([2.0, 3.0]))
    tau, step = m.loop_times(3, torch.device("cpu"), budget=torch.tensor([2, 4]))   # a budget per row: [R,B]
    assert torch.allclose(tau, torch.tensor([[0.0, 0.0], [2.0, 1.0], [4.0, 2.0]]))
    assert torch.allclose(step, torch.tensor([[2.0, 1.0]] * 3))
    # per-row modulations: row b's are those of its own budget
    per_row = m.modulations(3, torch.device("cpu"), budget=torch.tensor([2, 4]))  # [R,k,4,B,1,D]
    assert per_row.shape == (3, 1, 4, 2, 1, 32)
    torch.testing.assert_close(per_row[:, :, :, 1, 0], m.modulations(3, torch.device("cpu"), budget=4))


def test_index_model_converts_exactly_to_normalized_time():
    src = _model("index", loops=4)
    dst = to_normalized_time(src)
    assert dst.config.timestep_time == "normalized" and src.config.timestep_time == "index"
    x = torch.randint(0, 16, (3, 12))
    torch.testing.assert_close(dst(x).logits, src(x).logits, atol=0, rtol=0)        # identical at R = r
    assert not torch.allclose(dst(x, loops=8).logits, src(x, loops=8).logits)       # other budgets: other times
    with pytest.raises(UserError, match="loop index"):
        to_normalized_time(dst)


def test_normalized_run_continues_past_its_budget():
    """forward(loops=R) then m more loops from its state (loop_offset=R, budget=R) == one call of R+m loops timed by
    R (the fixed-point loss's continuation)."""
    m = _model("normalized", loops=4)
    x = torch.randint(0, 16, (2, 12))
    h = m(x, loops=3).hidden
    cont = m(x, loops=2, opts=LoopOptions(state=h, loop_offset=3, budget=3))
    whole = m(x, loops=5, opts=LoopOptions(budget=3))
    torch.testing.assert_close(cont.logits, whole.logits, atol=1e-5, rtol=1e-5)


def test_normalized_cached_generation_matches_full_recompute():
    m = _model("normalized", causal=True, loops=4)
    x = torch.randint(0, 16, (2, 7))
    full = m(x, loops=6).logits                                                     # [B,T,C]
    cache = m.new_cache(2, loops=6)
    steps = [m(x[:, :3], loops=6, cache=cache).logits]
    steps += [m(x[:, t:t + 1], loops=6, cache=cache).logits for t in range(3, 7)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_normalized_config_errors():
    with pytest.raises(ValueError, match="set timestep=true"):
        ModelConfig(vocab_size=4, timestep_time="normalized")
    with pytest.raises(ValueError, match="sinusoid"):
        ModelConfig(vocab_size=4, timestep=True, timestep_time="normalized", timestep_embed="learned")
    with pytest.raises(ValueError, match="timestep_time must be one of"):
        ModelConfig(vocab_size=4, timestep=True, timestep_time="seconds")


# ------------------------------------------------------------------ budgets in training
def test_sample_loops_deterministic_in_range_and_spread():
    cfg = load_run_config(None, [*TINY, "train.loops.sample=uniform", "train.loops.min=2",
                                 "train.loops.max=9"]).train.loops
    a = np.concatenate([sample_loops(cfg, s, 3, seed=0, rows=16) for s in range(500)])
    b = np.concatenate([sample_loops(cfg, s, 3, seed=0, rows=16) for s in range(500)])
    assert np.array_equal(a, b) and a.min() == 2 and a.max() == 9
    counts = np.bincount(a, minlength=10)[2:]
    assert counts.min() > 0.8 * len(a) / 8                                          # uniform over 2..9
    assert not np.array_equal(a, np.concatenate([sample_loops(cfg, s, 3, seed=1, rows=16) for s in range(500)]))
    log = load_run_config(None, [*TINY, "train.loops.sample=loguniform", "train.loops.max=15"]).train.loops
    draws = np.concatenate([sample_loops(log, s, 3, seed=0, rows=16) for s in range(1000)])
    octaves = [((draws >= lo) & (draws < 2 * lo)).mean() for lo in (1, 2, 4, 8)]    # each octave about 1/4
    assert draws.min() >= 1 and draws.max() <= 15 and all(abs(o - 0.25) < 0.03 for o in octaves)
    fixed = load_run_config(None, [*TINY, "train.loops.start=1", "train.loops.every=2"]).train.loops
    assert [int(sample_loops(fixed, s, 3, 0)[0]) for s in range(6)] == [loops_at(fixed, s, 3) for s in range(6)]


def test_a_curriculum_runs_before_the_budgets_are_drawn(tmp_path):
    """With a loop curriculum the drawn budgets start once it has reached the model's loops: its counts 1, 1, 2,
    2 at steps 0-3 (start 1, +1 every 2 steps, r = 3), the draws from step 4 on — here past r, up to 7."""
    cfg = load_run_config(None, [*TINY, "train.loops.start=1", "train.loops.every=2", "train.loops.sample=uniform",
                                 "train.loops.min=3", "train.loops.max=7"]).train.loops
    got = [int(sample_loops(cfg, s, 3, 0)[0]) for s in range(40)]
    assert got[:4] == [1, 1, 2, 2]
    drawn = load_run_config(None, [*TINY, "train.loops.sample=uniform", "train.loops.min=3",
                                   "train.loops.max=7"]).train.loops
    assert got[4:] == [int(sample_loops(drawn, s, 3, 0)[0]) for s in range(4, 40)]   # the same draws as without
    assert set(got[4:]) == {3, 4, 5, 6, 7}
    rows = sample_loops(cfg, 1, 3, 0, rows=5)                                        # per row: the curriculum's
    assert rows.tolist() == [1] * 5
    run = tiny(tmp_path, "train.steps=8", "train.loops.start=1", "train.loops.every=2", "train.loops.sample=uniform",
               "train.loops.min=3", "train.loops.max=7", "train.losses.loops=all")
    train(run)
    logged = [r["loops"] for r in read_metrics(tmp_path / "run") if r["split"] == "train"]
    assert logged == [int(sample_loops(run.train.loops, s, 3, 0)[0]) for s in range(8)]
    assert logged[:4] == [1, 1, 2, 2]


def test_loops_hold_draws_r_to_f_r_after_the_curriculum_and_follows_r(tmp_path):
    """train.loops.hold=f: the curriculum's counts, then uniform draws over r..⌈f·r⌉ — the very draws of
    train.loops.sample=uniform, min=r, max=⌈f·r⌉ — for any r (3..8 at r = 3, 5..12 at r = 5 with f = 2.34)."""
    for r, hi in ((3, 8), (5, 12)):
        hold = load_run_config(None, [*TINY, f"model.loops={r}", "train.loops.start=1", "train.loops.every=2",
                                      "train.loops.hold=2.34"]).train.loops
        same = load_run_config(None, [*TINY, f"model.loops={r}", "train.loops.start=1", "train.loops.every=2",
                                      "train.loops.sample=uniform", f"train.loops.min={r}",
                                      f"train.loops.max={hi}"]).train.loops
        got = np.concatenate([sample_loops(hold, s, r, 0, rows=4) for s in range(300)])
        assert np.array_equal(got, np.concatenate([sample_loops(same, s, r, 0, rows=4) for s in range(300)]))
        assert set(got[4 * 2 * (r - 1):].tolist()) == set(range(r, hi + 1))            # after the curriculum
        assert sample_loops(hold, 0, r, 0).tolist() == [1]                             # the curriculum first
    late = load_run_config(None, [*TINY, "train.loops.hold=2", "train.loops.sample_from=30"]).train.loops
    drawn = [int(sample_loops(late, s, 3, 0)[0]) for s in range(60)]
    assert drawn[:30] == [3] * 30                                                     # r until step 30 ...
    now = load_run_config(None, [*TINY, "train.loops.hold=2"]).train.loops
    assert drawn[30:] == [int(sample_loops(now, s, 3, 0)[0]) for s in range(30, 60)]  # ... then the same draws
    assert set(drawn[30:]) == {3, 4, 5, 6}
    run = tiny(tmp_path, "train.steps=6", "train.loops.hold=2", "train.losses.loops=all")
    res = train(run)
    logged = [r["loops"] for r in read_metrics(tmp_path / "run") if r["split"] == "train"]
    assert logged == [int(sample_loops(run.train.loops, s, 3, 0)[0]) for s in range(6)]
    assert set(logged) <= {3, 4, 5, 6}
    assert res["loops_sample"]["kind"] == "hold" and res["loops_sample"]["range"] == [3, 6]


def test_the_hold_ramp_grows_the_draws_upper_bound_linearly():
    """train.loops.hold_ramp=n: from the first draw (after the curriculum, or at sample_from) the upper bound grows
    from r to ⌈f·r⌉ over n steps — its draws are the plain hold's draws of a range that is the ramp's at that step;
    past the ramp they are the plain hold's."""
    cfg = load_run_config(None, [*TINY, "model.loops=8", "train.loops.start=4", "train.loops.every=10",
                                 "train.loops.increment=2", "train.loops.hold=4", "train.loops.hold_ramp=100"])
    ramp, first = cfg.train.loops, 20                               # the curriculum reaches r = 8 at step 20
    plain = load_run_config(None, [*TINY, "model.loops=8", "train.loops.start=4", "train.loops.every=10",
                                   "train.loops.increment=2", "train.loops.hold=4"]).train.loops
    assert [int(sample_loops(ramp, s, 8, 0)[0]) for s in range(first)] == \
        [int(sample_loops(plain, s, 8, 0)[0]) for s in range(first)]                   # the curriculum alike
    for step in (first, first + 1, first + 50, first + 99, first + 100, first + 400):
        hi = 8 + 24 * min(step - first, 100) // 100                                  # r .. 32 over 100 steps
        got = sample_loops(ramp, step, 8, 0, rows=256)
        assert got.min() >= 8 and got.max() <= hi and (hi == 8 or got.max() > 8)
        rng = np.random.default_rng([0, step, 0x100B5])
        assert np.array_equal(got, rng.integers(8, hi + 1, size=256))                 # the same generator
    with pytest.raises(UserError, match="hold_ramp ramps the hold"):
        load_run_config(None, [*TINY, "train.loops.hold_ramp=10"])


@pytest.mark.parametrize("extra,match", [
    (["train.loops.hold=1"], "loops.hold must be 0"),
    (["train.loops.hold=2", "train.loops.sample_from=-1"], "loops.sample_from must be >= 0"),
    (["train.loops.hold=-2"], "loops.hold must be 0"),
    (["train.loops.hold=2", "train.loops.sample=uniform"], "leave train.loops.sample at fixed"),
    (["train.loops.sample=uniform", "train.loops.min=5"], "exceeds the largest budget"),
    (["train.loops.sample=uniform", "train.loops.sample_per=row", "train.losses.loops=all"], "losses.loops=last"),
    (["train.loops.sample=uniform", "train.loops.sample_per=row", "train.losses.fixed_point=1"],
     "loops.sample_per=batch"),
    (["train.loops.sample=sometimes"], "loops.sample must be one of"),
    (["eval.budgets=[0,2]"], "eval.budgets"),
])
def test_budget_config_errors(extra, match):
    with pytest.raises(UserError, match=match):
        load_run_config(None, [*TINY, *extra])


def test_budget_config_error_is_one_line_exit_2(tmp_path, capsys):
    demo = Path(__file__).resolve().parents[1] / "configs" / "cpu" / "demo.yaml"
    rc = main(["train", str(demo), "--quiet", *TINY, f"out_dir={tmp_path / 'r'}", "train.steps=2",
               "train.loops.sample=uniform", "train.loops.min=9"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "loops.min" in err and not (tmp_path / "r").exists()


def test_training_draws_the_budget_of_each_step(tmp_path):
    cfg = tiny(tmp_path, "train.steps=8", "train.loops.sample=uniform", "train.loops.min=1", "train.loops.max=5",
               "train.losses.loops=all")
    res = train(cfg)
    got = [r["loops"] for r in read_metrics(tmp_path / "run") if r["split"] == "train"]
    assert got == [int(sample_loops(cfg.train.loops, s, 3, 0)[0]) for s in range(8)] and len(set(got)) > 1
    assert res["loops_sample"] == {"kind": "uniform", "per": "batch", "range": [1, 5]}


def test_budgets_compose_with_deep_supervision_and_the_exit_gate(tmp_path):
    """Drawn per batch, the budget is the loops of every supervision step; the exit gate learns on the drawn
    loops."""
    cfg = tiny(tmp_path, "train.steps=4", "train.loops.sample=uniform", "train.loops.max=4",
               "model.supervision_steps=2", "model.exit_gate=true", "eval.budgets=[2,6]")
    res = train(cfg)
    got = [r["loops"] for r in read_metrics(tmp_path / "run") if r["split"] == "train"]
    assert got == [int(sample_loops(cfg.train.loops, s, 3, 0)[0]) for s in range(4)]
    assert res["total_loops"] == 6 and [b["loops"] for b in res["budgets"]["budgets"]] == [2, 6]


def test_resume_with_row_budgets_equals_uninterrupted(tmp_path, train_killed_at):
    extra = ["train.steps=8", "train.eval_every=3", "train.loops.sample=uniform", "train.loops.sample_per=row",
             "train.loops.max=5", "model.timestep=true",
             "model.timestep_time=normalized", "eval.budgets=[1,3,6]"]
    train(tiny(tmp_path, *extra, name="full"))
    train_killed_at(tiny(tmp_path, *extra, name="cut"), 5)
    train(load_for_resume(tmp_path / "cut"), resume=True)
    losses = [[(r["step"], r["loss"]) for r in read_metrics(tmp_path / n) if r["split"] == "train"]
              for n in ("full", "cut")]
    assert losses[0] == losses[1] and len(losses[0]) == 8
    a, b = read_results(tmp_path / "full"), read_results(tmp_path / "cut")
    assert [x["metrics"] for x in a["budgets"]["budgets"]] == [x["metrics"] for x in b["budgets"]["budgets"]]
    assert [x["loops"] for x in a["budgets"]["budgets"]] == [1, 3, 6]


def _step_grads(cfg) -> dict[str, torch.Tensor]:
    """The gradients of one training step (step 0) of `cfg`, before the optimiser uses them."""
    d = setup("cpu")
    try:
        t = Trainer(cfg, d, resume=False, overwrite=True)
        t.open_log(False)
        t.wrap()
        grads: dict[str, torch.Tensor] = {}
        opt_step = t.optimizer.step

        def capture(*a, **k):
            grads.update({n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None})
            return opt_step(*a, **k)

        t.optimizer.step = capture
        state = {k: v.clone() for k, v in t.model.state_dict().items()}
        t.step(0)
        t.log.close()
        t.model.load_state_dict(state)
        return grads, t
    finally:
        teardown()


def test_the_fixed_point_loss_matches_hand_written(tmp_path):
    """One step's gradients equal those of the task loss + the fixed-point loss written out by hand."""
    w = 0.7
    extra = ["train.steps=1", "train.optim.grad_clip=0", f"train.losses.fixed_point={w}",
             "train.losses.fixed_point_loops=2"]
    grads, t = _step_grads(tiny(tmp_path, *extra))
    model, data, R = t.model, t.data, 3
    b = data.fetch(data.plan(0, 8), 0)
    x, y = b["inputs"], b["targets"]
    keep = y != IGNORE
    model.zero_grad()
    out = model(x, loops=R)
    loss = F.cross_entropy(out.logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum") / keep.sum()
    h = out.hidden
    h2 = model(x, loops=R + 2).hidden
    move = ((h2 - h.detach()).square().sum(-1) / h.detach().square().sum(-1)).mean()
    loss = loss + w * move
    loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=2e-6, rtol=2e-4, msg=n)


def test_fixed_point_loss():
    h = torch.randn(2, 3, 4)
    assert fixed_point_loss(h, h).item() == 0.0
    assert fixed_point_loss(2 * h, h).item() == pytest.approx(6.0)                 # ||h||²/||h||² at 6 positions


# ------------------------------------------------------------------ evaluation over budgets
def test_evaluate_budgets_runs_each_budget(tmp_path):
    cfg = tiny(tmp_path, "train.steps=4", "model.timestep=true", "model.timestep_time=normalized")
    train(cfg)
    from loopformer.model.io import load

    model = load(tmp_path / "run")
    data = TokenData(cfg.task)
    res = evaluate_budgets(model, data, [1, 2, 5], halt=["kl:0.01"])
    assert [b["loops"] for b in res["budgets"]] == [1, 2, 5] and res["trained_loops"] == 3
    for b in res["budgets"]:
        fixed = evaluate(model, data, loops=b["loops"], loopwise=False)
        assert b["metrics"] == fixed["metrics"] and b["wall_s"] > 0
        assert b["halting"][0]["mean_loops"] <= b["loops"]
    # the metrics at r of a budget-aware model come from a run of r loops, not from loop r of the loop-wise run
    full = evaluate(model, data, max_loops=6)
    assert full["metrics"] == evaluate(model, data, loops=3, loopwise=False)["metrics"]
    # a budget-aware model's run with 5 loops is not the 5th loop of a longer run: it times its loops by 5
    x = torch.as_tensor(data.test_rows(8)["inputs"])
    assert not torch.allclose(model(x, loops=5).logits, model(x, loops=6, return_all=True).all_logits[4])


def test_eval_budgets_cli_against_and_errors(tmp_path, capsys):
    train(tiny(tmp_path, "train.steps=3", "train.loops.sample=uniform", "train.loops.max=4", name="elastic"))
    train(tiny(tmp_path, "train.steps=3", name="fixed"))
    train(tiny(tmp_path, "train.steps=3", "task.options={length: 4, alphabet_min: 2, alphabet_max: 3}",
               name="other"))
    out_json = tmp_path / "b.json"
    rc = main(["eval", str(tmp_path / "elastic"), "--budgets", "4,1,2,2", "--against", str(tmp_path / "fixed"),
               "--no-loopwise", "--quiet", "--json", str(out_json), "--plot", str(tmp_path / "b.png")])
    printed = capsys.readouterr().out
    assert rc == 0 and (tmp_path / "b.png").is_file()
    res = json.loads(out_json.read_text())["budgets"]
    assert list(res) == ["elastic", "fixed"]
    assert [b["loops"] for b in res["fixed"]["budgets"]] == [1, 2, 4]
    assert "| loops R | elastic (r=3) | fixed (r=3) |" in printed
    for argv, match in [(["--budgets", "1,x"], "comma"), (["--budgets", "0,2"], "budget"),
                        (["--budgets", "2000"], "budget"), (["--against", str(tmp_path / "fixed")], "--budgets"),
                        (["--budgets", "2", "--against", str(tmp_path / "other")], "another task")]:
        rc = main(["eval", str(tmp_path / "elastic"), "--quiet", *argv])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and match in err and "\n" not in err, (argv, err)


def test_parse_budgets():
    assert parse_budgets("8, 1,2,2") == [1, 2, 8]
    for bad in ("", "1,,a", "-1"):
        with pytest.raises(UserError):
            parse_budgets(bad)
    assert parse_budgets("1024") == [1024]


def test_sweep_report_tabulates_budgets_over_seeds(tmp_path):
    from loopformer.experiments.report import write_report
    from loopformer.experiments.sweep import run_sweep

    base = Path(__file__).resolve().parents[1] / "configs" / "cpu" / "demo.yaml"
    run_sweep(str(base), [("seed", ["0", "1", "2"])], [], tmp_path / "sw",
              [*TINY[2:], "train.steps=3", "model.loops=2", "eval.budgets=[1,3]"], progress=False)
    rep = write_report(tmp_path / "sw")
    table = (tmp_path / "sw" / "budgets.md").read_text()
    assert (tmp_path / "sw" / "budgets.png").is_file() and "| R = 1 | R = 3 |" in table
    vals = [json.loads((tmp_path / "sw" / "runs" / f"seed={s}" / "results.json").read_text())["budgets"]["budgets"][1]
            ["metrics"]["accuracy"] * 100 for s in range(3)]
    assert f"{np.median(vals):.1f} [{min(vals):.1f}–{max(vals):.1f}]" in table and "budgets.md" in rep["files"]
