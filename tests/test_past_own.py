"""timestep_past="own" (the loops past r read a modulation and an injection scale of their own) and train.optim.freeze
(parameter groups that keep their values): loops 1..r never read the own parameters, a model started from weights
without them runs exactly as with the hold index, and a frozen fine-tuning run changes only what it trains."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from test_halting import random_tmlt
from test_train import TINY

from loopformer.cli import main
from loopformer.model.config import ModelConfig
from loopformer.model.io import load_weights, save_checkpoint
from loopformer.model.layers import param_group
from loopformer.model.looped import LoopedTransformer
from loopformer.train.config import load_run_config
from loopformer.train.trainer import train

CFG = ModelConfig(vocab_size=16, max_len=8, d_model=16, n_heads=2, loops=3, timestep=True, input_injection=True)


def _random_tmlt(cfg: ModelConfig) -> LoopedTransformer:
    return random_tmlt(cfg).eval()


def _states(model: LoopedTransformer, x: torch.Tensor, loops: int) -> list[torch.Tensor]:
    return model(x, loops=loops, return_all=True).all_hidden.unbind(0)


def test_own_parameters_are_read_only_past_r():
    model = _random_tmlt(CFG.replace(timestep_past="own"))
    assert sorted(n for n, _ in model.named_parameters() if param_group(n) == "past") == \
        ["blocks.0.past_modulation", "past_injection"]
    x = torch.randint(0, 16, (2, 8))
    before = _states(model, x, 6)
    with torch.no_grad():
        model.blocks[0].past_modulation.normal_()
        model.past_injection.mul_(-2.0)
    after = _states(model, x, 6)
    assert all(torch.equal(a, b) for a, b in zip(before[:3], after[:3]))       # loops 1..r: untouched
    assert all(not torch.allclose(a, b) for a, b in zip(before[3:], after[3:]))  # every loop past r: its own


def test_started_from_hold_weights_it_runs_as_the_hold_index(tmp_path):
    hold = _random_tmlt(CFG.replace(timestep_past="hold"))
    save_checkpoint(tmp_path / "ckpt", hold)
    own = LoopedTransformer(CFG.replace(timestep_past="own")).eval()
    with pytest.raises(Exception, match="missing"):      # a plain load stays strict
        load_weights(own, tmp_path / "ckpt")
    load_weights(own, tmp_path / "ckpt", start_past=True)
    mods = hold.modulations(1, torch.device("cpu"), offset=3)[0]   # the hold index r's modulation, [k,4,D]
    assert torch.allclose(own.blocks[0].past_modulation, mods[0])
    assert torch.equal(own.past_injection, torch.ones(16))
    x = torch.randint(0, 16, (3, 8))
    for a, b in zip(_states(hold, x, 9), _states(own, x, 9)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)   # the same map, its modulation computed apart


def test_gates_and_injection_at_zero_make_the_loops_past_r_the_identity():
    """Hand computation: with γ1 = γ2 = 0 the layer returns its input, and with β = 0 the input is h itself, so
    h_{t+1} = h_t for every t >= r (and one step of the block at a loop index past r is the identity too)."""
    model = _random_tmlt(CFG.replace(timestep_past="own"))
    with torch.no_grad():
        model.blocks[0].past_modulation[:2].zero_()
        model.past_injection.zero_()
    x = torch.randint(0, 16, (2, 8))
    hs = _states(model, x, 8)
    assert not torch.allclose(hs[2], hs[1])                         # loops up to r move the state
    assert all(torch.equal(h, hs[2]) for h in hs[3:])               # every loop past r holds it
    run = model.begin(x, None, None, None, None)
    mods = model.modulations(1, x.device, offset=CFG.loops)                      # loop index r: [1,k,4,D]
    assert torch.equal(model.step(hs[2], run.e, CFG.loops, mods[0], run.mask, slot=0), hs[2])


def test_injection_by_loop_and_by_row():
    model = _random_tmlt(CFG.replace(timestep_past="own"))
    with torch.no_grad():
        model.past_injection.fill_(0.5)
    e = torch.randn(3, 1, 16)
    assert torch.equal(model.injection(e, 2), e) and torch.equal(model.injection(e, 3), 0.5 * e)
    per_row = model.injection(e, torch.tensor([0, 3, 7]))
    assert torch.equal(per_row[0], e[0]) and torch.equal(per_row[1:], 0.5 * e[1:])
    plain = _random_tmlt(CFG)
    assert plain.injection(e, 5) is e


@pytest.mark.parametrize("bad,needle", [
    (dict(timestep=False), "needs timestep=true"),
    (dict(timestep_time="normalized"), "timestep_time='index'"),
])
def test_own_refusals(bad, needle):
    with pytest.raises(ValueError, match=needle):
        CFG.replace(timestep_past="own", **bad)


FT = [*TINY, "train.steps=4", "log.dynamics=false", "eval.drift=false", "model.timestep=true"]


def test_a_frozen_fine_tuning_run_trains_only_the_loops_past_r(tmp_path):
    src = tmp_path / "src"
    train(load_run_config(None, [*FT, f"out_dir={src}", "model.timestep_past=hold"]))
    ft = tmp_path / "ft"
    train(load_run_config(None, [*FT, f"out_dir={ft}", f"train.init_from={src}", "model.timestep_past=own",
                                 "train.loops.hold=3", "train.optim.lr=1e-2",
                                 "train.optim.freeze=[embedding,block,timestep,modulation,head]"]))
    want, got = load_file(str(src / "checkpoint" / "model.safetensors")), \
        load_file(str(ft / "checkpoint" / "model.safetensors"))
    assert set(got) - set(want) == {"blocks.0.past_modulation", "past_injection"}
    assert all(torch.equal(got[k], want[k]) for k in want)           # every other weight exactly as it started
    assert not torch.equal(got["past_injection"], torch.ones_like(got["past_injection"]))   # and it trained


@pytest.mark.parametrize("freeze,needle", [
    ("[block,bogus]", "train.optim.freeze lists parameter groups"),
    ("[embedding,block,head]", "leaves no parameter to train"),
])
def test_freeze_refusals(tmp_path, capsys, freeze, needle):
    (tmp_path / "c.yaml").write_text("name: f\n")
    out = tmp_path / "f"
    assert main(["train", str(tmp_path / "c.yaml"), "--quiet", *TINY, "train.steps=2", f"train.optim.freeze={freeze}",
                 f"out_dir={out}"]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1
