"""The halting core (loopformer.model.halting): rule parsing, the exit criteria, the exit gate, and its losses
(loopformer.train.losses), against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from loopformer.errors import UserError
from loopformer.model.config import ModelConfig
from loopformer.model.halting import (
    ExitGate,
    HaltRule,
    criterion_holds,
    entropy,
    kl_divergence,
    latent_change,
    row_max,
    row_mean,
    stops,
    update_streak,
)
from loopformer.model.looped import LoopedTransformer
from loopformer.train.losses import exit_distribution, exit_distribution_loss, halting_target_loss


# ------------------------------------------------------------------------------------------------- rules
@pytest.mark.parametrize("text, rule", [
    ("kl:1e-3", HaltRule("kl", 1e-3)),
    ("latent:0.01", HaltRule("latent", 0.01)),
    ("entropy:0.1,patience=2", HaltRule("entropy", 0.1, patience=2)),
    ("argmax:2", HaltRule("argmax", 2.0, patience=2)),
    ("gate:0.5,max=16,min=2", HaltRule("gate", 0.5, max_loops=16, min_loops=2)),
    (" KL : 1e-3 ", HaltRule("kl", 1e-3)),
])
def test_parse(text, rule):
    assert HaltRule.parse(text) == rule
    assert HaltRule.parse(str(rule)) == rule


@pytest.mark.parametrize("text", ["", "kl", "kl:", "foo:1", "kl:abc", "kl:-1", "kl:nan", "kl:1e-3,bogus=2",
                                  "kl:1e-3,patience=x", "kl:1e-3,patience=0", "argmax:1.5", "argmax:0",
                                  "argmax:2,patience=3", "gate:2", "gate:0", "kl:1e-3,max=0", "kl:1e-3,min=0"])
def test_parse_rejects_with_one_line(text):
    with pytest.raises(UserError) as err:
        HaltRule.parse(text)
    assert "\n" not in str(err.value) and str(err.value)


def test_with_threshold_and_bound():
    assert HaltRule.parse("argmax:2").with_threshold(3) == HaltRule("argmax", 3.0, patience=3)
    assert HaltRule.parse("kl:1").with_threshold(0.5).threshold == 0.5
    assert HaltRule("kl", 1.0).bound(8) == 8 and HaltRule("kl", 1.0, max_loops=5).bound(8) == 5


# ------------------------------------------------------------------------------------------------- scores
def test_latent_change_by_hand():
    h_prev = torch.tensor([[[3.0, 4.0], [0.0, 0.0]]])              # [1,2,2]: norms 5 and 0
    h = torch.tensor([[[3.0, 9.0], [0.0, 12.0]]])                  # changes 5 and 12
    assert latent_change(h_prev, h, per_token=False).item() == pytest.approx(13 / 5)
    first = torch.tensor([[True, False]])
    assert latent_change(h_prev, h, first).item() == pytest.approx(1.0)
    per_tok = latent_change(h_prev, h, per_token=True)
    assert per_tok[0, 0].item() == pytest.approx(1.0) and per_tok[0, 1].item() == pytest.approx(12 / 1e-12)


def test_kl_and_entropy_by_hand():
    q = torch.log(torch.tensor([0.5, 0.5]))
    p = torch.log(torch.tensor([0.25, 0.75]))
    assert kl_divergence(q, p).item() == pytest.approx(0.25 * math.log(0.5) + 0.75 * math.log(1.5), abs=1e-7)
    assert kl_divergence(p, p).item() == pytest.approx(0.0, abs=1e-7)
    assert entropy(p).item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), abs=1e-7)
    assert entropy(q + 5.0).item() == pytest.approx(math.log(2), abs=1e-7)    # logits, not probabilities


def test_row_reductions():
    s = torch.tensor([[1.0, 5.0, 2.0], [4.0, 0.0, 3.0]])
    P = torch.tensor([[True, False, True], [False, False, False]])
    assert row_max(s).tolist() == [5.0, 4.0]
    assert row_max(s, P)[0].item() == 2.0 and row_max(s, P)[1].item() == float("-inf")
    assert row_mean(s, P).tolist() == [1.5, 0.0]


def _logits(*rows):   # one position per row, two classes: row value v -> logits [0, v]
    return torch.tensor([[[0.0, v]] for v in rows])                # [N,1,2]


def test_criteria_hold_as_defined():
    h0, h1 = torch.ones(2, 1, 2), torch.ones(2, 1, 2)
    h1[1] = 2.0                                                     # row 1 changed by 100 %
    kw = dict(hidden=h1, hidden_prev=h0)
    assert criterion_holds(HaltRule("latent", 0.5), **kw).tolist() == [True, False]
    assert criterion_holds(HaltRule("latent", 0.5), hidden=h1).tolist() == [False, False]   # first loop
    prev, cur = _logits(0.0, 0.0), _logits(0.0, 3.0)
    assert criterion_holds(HaltRule("kl", 1e-3), hidden=h1, logits=cur, logits_prev=prev).tolist() == [True, False]
    assert criterion_holds(HaltRule("argmax", 1, 1), hidden=h1, logits=cur, logits_prev=prev).tolist() \
        == [True, False]                                            # argmax of [0,0] is class 0; [0,3]: class 1
    H = entropy(torch.tensor([0.0, 3.0])).item()
    assert criterion_holds(HaltRule("entropy", H + 1e-4), hidden=h1, logits=cur).tolist() == [False, True]
    g = torch.tensor([[math.log(3.0)], [0.0]])                     # σ = 0.75, 0.5
    assert criterion_holds(HaltRule("gate", 0.6), hidden=h1, stop_logits=g).tolist() == [True, False]
    with pytest.raises(UserError, match="exit gate"):
        criterion_holds(HaltRule("gate", 0.6), hidden=h1)


def test_criteria_per_row_take_the_worst_counted_position():
    prev = torch.zeros(1, 2, 2)
    cur = torch.tensor([[[0.0, 0.0], [0.0, 5.0]]])                 # position 1 changes its prediction
    h = torch.ones(1, 2, 2)
    args = dict(hidden=h, logits=cur, logits_prev=prev)
    assert criterion_holds(HaltRule("argmax", 1, 1), **args).tolist() == [False]
    assert criterion_holds(HaltRule("argmax", 1, 1), positions=torch.tensor([[True, False]]), **args).tolist() \
        == [True]
    assert criterion_holds(HaltRule("kl", 1e-3), per_token=True, **args).tolist() == [[True, False]]


def test_streak_and_stops():
    rule = HaltRule("argmax", 2, patience=2, min_loops=3)
    streak = torch.zeros(3, dtype=torch.long)
    streak = update_streak(streak, torch.tensor([True, True, False]))
    streak = update_streak(streak, torch.tensor([True, False, True]))
    assert streak.tolist() == [2, 0, 1]
    assert stops(rule, streak, t=2, loops=8).tolist() == [False, False, False]    # before min_loops
    assert stops(rule, streak, t=3, loops=8).tolist() == [True, False, False]
    assert stops(rule, streak, t=8, loops=8).tolist() == [True, True, True]       # the bound
    assert stops(HaltRule("kl", 1.0, max_loops=4), streak, t=4, loops=8).all()


# ------------------------------------------------------------------------------------------------- gate, losses
def test_exit_gate_starts_at_dont_stop_and_draws_nothing():
    state = torch.get_rng_state()
    gate = ExitGate(8)
    assert torch.equal(torch.get_rng_state(), state)
    g = gate(torch.randn(2, 3, 8))
    assert g.shape == (2, 3) and torch.allclose(g, torch.full((2, 3), -4.0))
    assert torch.sigmoid(g).max() < 0.02


def test_exit_gate_is_optional_in_the_model():
    cfg = ModelConfig(vocab_size=16, max_len=8, d_model=16, n_heads=2, loops=3, timestep=True)
    torch.manual_seed(0)
    plain = LoopedTransformer(cfg)
    torch.manual_seed(0)
    gated = LoopedTransformer(cfg.replace(exit_gate=True))
    extra = set(gated.state_dict()) - set(plain.state_dict())
    assert extra == {"exit_gate.proj.weight", "exit_gate.proj.bias"}
    for k, v in plain.state_dict().items():                         # the gate changes no other initial weight
        assert torch.equal(v, gated.state_dict()[k]), k
    assert plain.exit_gate is None


def test_exit_distribution_by_hand():
    g = torch.zeros(3, 1)                                           # λ = 1/2 at every loop
    assert exit_distribution(g)[:, 0].tolist() == pytest.approx([0.5, 0.25, 0.25])
    g = torch.tensor([[math.log(3.0)], [0.0], [5.0]])               # λ = 3/4, 1/2, (last: remainder)
    assert exit_distribution(g)[:, 0].tolist() == pytest.approx([0.75, 0.125, 0.125])
    assert exit_distribution(torch.randn(6, 4, 5)).sum(0) == pytest.approx(torch.ones(4, 5), abs=1e-6)


def test_exit_distribution_loss_by_hand():
    L = torch.tensor([[3.0], [2.0], [1.0]])
    g = torch.zeros(3, 1)                                           # p = 1/2, 1/4, 1/4
    H = 1.5 * math.log(2)
    assert exit_distribution_loss(L, g, 0.0).item() == pytest.approx(2.25)
    assert exit_distribution_loss(L, g, 0.1).item() == pytest.approx(2.25 - 0.1 * H)
    L2 = torch.cat([L, torch.tensor([[0.0], [0.0], [0.0]])], 1)     # a second row of zero loss
    mask = torch.tensor([True, False])
    assert exit_distribution_loss(L2, torch.zeros(3, 2), 0.0, mask).item() == pytest.approx(2.25)
    assert exit_distribution_loss(L2, torch.zeros(3, 2), 0.0).item() == pytest.approx(2.25 / 2)


def test_halting_target_loss_by_hand():
    g = torch.tensor([[math.log(3.0), math.log(3.0)], [0.0, 0.0]])  # σ = 3/4 at loop 1, 1/2 at loop 2
    c = torch.tensor([[True, False], [True, True]])
    want = (-math.log(0.75) - math.log(0.25) + 2 * math.log(2)) / 4
    assert halting_target_loss(g, c).item() == pytest.approx(want)
    mask = torch.tensor([True, False])
    assert halting_target_loss(g, c, mask).item() == pytest.approx((-math.log(0.75) + math.log(2)) / 2)


# ------------------------------------------------------------------------------------------------- past the trained r
def random_tmlt(cfg: ModelConfig) -> LoopedTransformer:
    """A TMLT of `cfg` whose timestep embedder and modulations are random (so every loop index modulates apart)."""
    torch.manual_seed(0)
    model = LoopedTransformer(cfg)
    with torch.no_grad():
        for p in model.timestep.parameters():
            p.normal_()
        for blk in model.blocks:
            blk.modulation.weight.normal_()
    return model


def _tmlt_with_random_modulations() -> tuple[ModelConfig, LoopedTransformer]:
    """A 3-loop TMLT with random timestep parameters (`random_tmlt`)."""
    cfg = ModelConfig(vocab_size=16, max_len=8, d_model=16, n_heads=2, loops=3, timestep=True)
    return cfg, random_tmlt(cfg)


def test_timestep_past_clamp_repeats_the_last_trained_loop():
    cfg, model = _tmlt_with_random_modulations()
    cont = model.modulations(6, torch.device("cpu"))
    model.config = cfg.replace(timestep_past="clamp")
    clamp = model.modulations(6, torch.device("cpu"))
    assert torch.equal(cont[:3], clamp[:3])                        # the trained loops are unchanged
    assert all(torch.equal(clamp[t], clamp[2]) for t in range(3, 6))
    assert not torch.equal(cont[3], cont[2])
    with pytest.raises(ValueError, match="timestep_past"):
        cfg.replace(timestep_past="wrap")


def test_model_returns_the_gate_logits_of_every_loop():
    cfg = ModelConfig(vocab_size=16, max_len=8, d_model=16, n_heads=2, loops=3, exit_gate=True)
    model = LoopedTransformer(cfg)
    with torch.no_grad():
        model.exit_gate.proj.weight.normal_()
    out = model(torch.randint(0, 16, (2, 5)), return_all=True)
    assert out.all_stop_logits.shape == (3, 2, 5) and out.stop_logits.shape == (2, 5)
    assert torch.allclose(out.all_stop_logits[-1], out.stop_logits)
    assert torch.allclose(out.all_stop_logits, model.exit_gate(out.all_hidden))


# ------------------------------------------------------------------------------------------------- training the gate
def test_per_loop_losses_and_correct_by_hand():
    from loopformer.tasks import IGNORE
    from loopformer.train.losses import per_loop_correct, per_loop_losses
    logits = torch.tensor([[[[2.0, 0.0], [0.0, 1.0]]], [[[0.0, 2.0], [0.0, 3.0]]]])   # [R=2,B=1,T=2,C=2]
    targets = torch.tensor([[1, IGNORE]])
    assert per_loop_correct(logits, targets).tolist() == [[False], [True]]
    assert per_loop_correct(logits, targets, per_token=True)[:, 0, 0].tolist() == [False, True]
    want = [math.log(1 + math.exp(2.0)), math.log(1 + math.exp(-2.0))]               # CE of class 1
    assert per_loop_losses(logits, targets)[:, 0].tolist() == pytest.approx(want)


def _copy_task(steps: int, exit_loss: str) -> tuple[list[float], torch.Tensor]:
    """A bidirectional model learns to copy its input (right after one loop) while its gate learns when to stop:
    (gate loss per step, the mean stop probability after each loop on fresh data)."""
    from loopformer.train.config import LossConfig
    from loopformer.train.losses import exit_loss as gate_loss
    torch.manual_seed(0)
    model = LoopedTransformer(ModelConfig(vocab_size=8, max_len=4, d_model=32, n_heads=2, loops=3, causal=False,
                                          exit_gate=True, input_injection=True))
    tc = LossConfig(exit_loss=exit_loss, exit_entropy_weight=0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    history = []
    for _ in range(steps):
        x = torch.randint(0, 8, (32, 4))
        out = model(x, return_all=True)
        task = F.cross_entropy(out.all_logits.flatten(0, 2), x.expand(3, -1, -1).reshape(-1))
        g = gate_loss(tc, out.all_logits, out.all_stop_logits, x)
        (task + g).backward()
        opt.step()
        opt.zero_grad()
        history.append(float(g.detach()))
    with torch.no_grad():
        out = model(torch.randint(0, 8, (256, 4)), return_all=True)
    return history, torch.sigmoid(out.all_stop_logits).mean((1, 2))


def test_the_gate_learns_when_the_read_out_is_right():
    history, p_stop = _copy_task(120, "target")
    # at first nothing is right and the gate says "don't stop" (σ = 0.018); once the copy is learned every read-out
    # is right, the loss jumps, and the gate learns to stop
    assert max(history) > 1.0 and sum(history[-10:]) / 10 < 0.05 * max(history)
    assert p_stop.min() > 0.9


def test_the_exit_distribution_moves_exits_earlier():
    history, p_stop = _copy_task(120, "distribution")
    assert history[-1] < 0.01 * history[0]
    lam = p_stop[:, None]
    exit_p = exit_distribution(torch.log(lam / (1 - lam)))[:, 0]   # the mean row's exit distribution
    expected_loop = float((exit_p * torch.arange(1, 4)).sum())
    assert expected_loop < 2.5                                      # untrained: 2.96 (σ = 0.018 at every loop)


def test_training_with_an_exit_gate(tmp_path):
    from loopformer.model.io import load
    from loopformer.train.config import load_run_config
    from loopformer.train.trainer import train
    for loss in ("target", "distribution"):
        cfg = load_run_config(None, [
            "task.name=lcs", "task.options={length: 3, alphabet_min: 2, alphabet_max: 3}", "task.n_train=32",
            "task.n_test=16", "task.answer_only=true", "model.d_model=16", "model.n_heads=2", "model.loops=2",
            "model.exit_gate=true", f"train.losses.exit_loss={loss}", "train.steps=3", "train.batch_size=8",
            "eval.max_loops=3", "log.tensorboard=false", "log.progress=false", f"out_dir={tmp_path / loss}"])
        res = train(cfg)
        assert math.isfinite(res["test"]["accuracy"])
        assert load(tmp_path / loss / "checkpoint").exit_gate is not None


def test_timestep_past_hold_reads_one_index_of_its_own_past_r():
    cfg, model = _tmlt_with_random_modulations()
    cont = model.modulations(7, torch.device("cpu"))
    model.config = cfg.replace(timestep_past="hold")
    assert model.loop_indices(7, torch.device("cpu")).tolist() == [0, 1, 2, 3, 3, 3, 3]
    hold = model.modulations(7, torch.device("cpu"))
    assert torch.equal(cont[:4], hold[:4])                         # loops 0..r-1 and the hold index r itself
    assert all(torch.equal(hold[t], cont[3]) for t in range(4, 7))  # every later loop reads index r
    assert not torch.equal(hold[3], hold[2])                       # not the last trained loop's (clamp's) index
    tau, _ = model.loop_times(5, torch.device("cpu"), budget=3)    # the budget-aware time stops at the budget
    assert tau.tolist() == [0.0, 1.0, 2.0, 3.0, 3.0]
    with pytest.raises(ValueError, match="learned table"):
        cfg.replace(timestep_past="hold", timestep_embed="learned")
