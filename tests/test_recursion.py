"""The recursive-reasoning recipe: deep supervision against steps run by hand from the model's parts, the weight
average against its formula, training augmentation (valid pairs, reproducible per (seed, step), independent of the
batch split), test-time voting mapped back through the symmetries, and exact resume with everything on."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from loopformer.errors import UserError
from loopformer.model import LoopedTransformer
from loopformer.model.config import ModelConfig
from loopformer.model.io import load
from loopformer.model.recursion import step_exits, supervision_steps
from loopformer.sources import TaskConfig, TokenData
from loopformer.tasks.sudoku import (
    SudokuTask,
    apply_symmetries,
    digits_to_ids,
    draw_symmetries,
    ids_to_digits,
    invert_symmetries,
    is_valid_solution,
    vote,
)
from loopformer.train.config import load_run_config
from loopformer.train.ema import EMA
from loopformer.train.run import read_metrics, read_results
from loopformer.train.trainer import train


def _model(timestep: bool, step_timestep: str = "continue", injection: bool = True, seed: int = 0):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=11, max_len=12, d_model=16, n_heads=2, loops=2, causal=False, timestep=timestep,
                      timestep_gate_init=0.5, input_injection=injection, supervision_steps=3,
                      step_timestep=step_timestep)
    return LoopedTransformer(cfg)


def _by_hand(model: LoopedTransformer, x: torch.Tensor, steps: int, restart: bool) -> list[torch.Tensor]:
    """Every step's logits, from the model's parts: h ← TF(h + e, t) with the state detached between steps."""
    cfg = model.config
    e = model.embed(x)
    h, out = None, []
    for s in range(steps):
        for t in range(cfg.loops):
            first = s == 0 and t == 0
            h = e if first else (h + e if cfg.input_injection else h)
            idx = t if restart else s * cfg.loops + t
            mods = None
            if model.timestep is not None:
                te = F.silu(model.timestep(torch.tensor([idx])))
                mods = torch.stack([blk.loop_modulation(te) for blk in model.blocks], dim=1)[0]   # [k,4,D]
            for i, blk in enumerate(model.blocks):
                h = blk(h, None if mods is None else mods[i], None, None, 0)
        out.append(model.head(model.norm_f(h)))
        h = h.detach()
    return out


@pytest.mark.parametrize("timestep,mode,injection", [(False, "continue", True), (True, "continue", True),
                                                     (True, "restart", True), (False, "continue", False)])
def test_deep_supervision_equals_steps_by_hand(timestep, mode, injection):
    x = torch.randint(0, 11, (3, 12))
    y = torch.randint(0, 11, (3, 12))
    grads = []
    for run in ("library", "hand"):
        model = _model(timestep, mode, injection)
        if run == "library":
            logits = []
            for out in supervision_steps(model, x, 3):
                F.cross_entropy(out.logits.flatten(0, 1), y.flatten()).backward()   # one step in memory at a time
                logits.append(out.logits.detach())
        else:
            logits = _by_hand(model, x, 3, restart=mode == "restart")
            sum(F.cross_entropy(lg.flatten(0, 1), y.flatten()) for lg in logits).backward()
            logits = [lg.detach() for lg in logits]
        grads.append(({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, logits))
    (ga, la), (gb, lb) = grads
    for a, b in zip(la, lb):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert ga.keys() == gb.keys()
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], rtol=1e-4, atol=1e-6, msg=n)
    # the detach: step 2's loss sends no gradient back into step 1's hidden state
    model = _model(timestep, mode, injection)
    steps = supervision_steps(model, x, 2)
    first = next(steps)
    first.hidden.retain_grad()
    next(steps).logits.sum().backward()
    assert first.hidden.grad is None


@pytest.mark.parametrize("mode", ["continue", "restart"])
def test_inference_steps_are_one_pass_of_n_times_r_loops(mode):
    model = _model(True, mode).eval()
    x = torch.randint(0, 11, (2, 12))
    with torch.no_grad():
        outs = list(supervision_steps(model, x, 3))
        full = model(x, loops=6, return_all=True)
    for s, out in enumerate(outs):
        torch.testing.assert_close(out.logits, full.all_logits[2 * s + 1], rtol=1e-5, atol=1e-6)
    if mode == "restart":   # the loop index restarts: loops 3..4 read t = 0..1 again
        assert model.loop_indices(6, torch.device("cpu")).tolist() == [0, 1, 0, 1, 0, 1]


def test_ema_update_is_exact():
    model = _model(False)
    ema = EMA(model, 0.75)
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    for _k in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ema.update(model)
        for n, p in model.named_parameters():
            ref[n] = ref[n] * 0.75 + p.detach() * (1 - 0.75)
    got = dict(ema.module.named_parameters())
    for n in ref:
        assert torch.equal(got[n], ref[n]), n
    assert not any(p.requires_grad for p in ema.module.parameters())
    with pytest.raises(ValueError, match="decay"):
        EMA(model, 1.0)


def _sudoku(augment: bool = True) -> TokenData:
    return TokenData(TaskConfig(name="sudoku", options={"blanks": 30}, n_train=24, n_test=6, seed=3,
                                augment=augment))


def test_augmented_batches_are_valid_and_reproducible_per_seed_and_step():
    data = _sudoku()
    keys = data.plan(5, 8)
    a, b = data.fetch(keys, 5), data.fetch(keys, 5)
    assert all(torch.equal(a[k], b[k]) for k in a)                            # same (seed, step): same bytes
    halves = [data.fetch(k, 5) for k in np.array_split(keys, 2)]              # any split into processes / micro
    assert torch.equal(torch.cat([h["inputs"] for h in halves]), a["inputs"])
    assert not torch.equal(data.fetch(keys, 6)["inputs"], a["inputs"])       # another step: other symmetries
    p, s = ids_to_digits(a["inputs"].numpy()), ids_to_digits(a["targets"].numpy())
    assert is_valid_solution(p, s).all()
    plain = _sudoku(augment=False).fetch(keys, 5)
    assert not torch.equal(plain["inputs"], a["inputs"])
    assert ((p != 0).sum(1) == (ids_to_digits(plain["inputs"].numpy()) != 0).sum(1)).all()   # same clue counts
    with pytest.raises(UserError, match="no augmentation"):
        TokenData(TaskConfig(name="lcs", options={"length": 3}, n_train=4, n_test=2, augment=True))


def test_voting_maps_predictions_back():
    task = SudokuTask(blanks=30)
    b = task.generate(5, seed=1)
    cells, relabel = draw_symmetries(5, np.random.default_rng(0))
    sol = ids_to_digits(b["targets"])
    assert (invert_symmetries(apply_symmetries(sol, cells, relabel), cells, relabel) == sol).all()
    views, sym = task.views(b["inputs"], 4)
    assert views.shape == (5, 5, 81) and (views[0] == b["inputs"]).all()
    # a perfect solver on every view: the vote is the solution
    right = digits_to_ids(apply_symmetries(np.tile(sol, (5, 1)), *sym)).reshape(5, 5, 81)
    assert is_valid_solution(ids_to_digits(views.reshape(25, 81)), ids_to_digits(right.reshape(25, 81))).all()
    assert (task.unview(right, sym) == b["targets"]).all()
    # two of five copies wrong at a cell (the plain one among them): the majority wins
    wrong = right.copy()
    wrong[:2, :, 0] = np.where(wrong[:2, :, 0] == 10, 2, wrong[:2, :, 0] + 1)
    assert (task.unview(wrong, sym) == b["targets"]).all()
    # a tie goes to the larger summed score, then to copy 0
    preds = np.array([[[3]], [[4]]])
    assert vote(preds)[0, 0] == 3
    assert vote(preds, np.array([[[0.1]], [[0.9]]]))[0, 0] == 4


TINY = ["task.name=sudoku", "task.options={blanks: 30}", "task.n_train=32", "task.n_test=8", "task.augment=true",
        "task.position_factors=true",
        "model.d_model=16", "model.n_heads=2", "model.loops=2", "model.supervision_steps=2",
        "model.input_injection=true", "model.timestep=true", "model.exit_gate=true", "model.dropout=0.1",
        "train.batch_size=8", "train.optim.lr=3e-3", "train.log_every=1", "train.select.ema_decay=0.9",
        "train.losses.loops=all", "eval.batch_size=64", "eval.max_loops=6", "eval.votes=2", "log.tensorboard=false",
        "log.progress=false", "log.dynamics=false"]


def test_resume_with_the_whole_recipe_is_exact(tmp_path, train_killed_at):
    def cfg(name):
        return load_run_config(None, [*TINY, f"out_dir={tmp_path / name}", "train.steps=6", "train.eval_every=3"])

    res = train(cfg("full"))
    assert res["supervision_steps"] == 2 and res["total_loops"] == 4 and res["test_ema"]
    assert [p["step"] for p in res["stepwise"]] == [1, 2, 3] and "voted_accuracy" in res["test"]
    assert 1 <= res["test"]["halted_steps"] <= 2 and "halted_accuracy" in res["test"]

    train_killed_at(cfg("cut"), 5)
    from loopformer.train.run import load_for_resume

    train(load_for_resume(tmp_path / "cut"), resume=True)
    la = [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "full") if r["split"] == "train"]
    lb = [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "cut") if r["split"] == "train"]
    assert la == lb and len(la) == 6
    ra, rb = read_results(tmp_path / "full"), read_results(tmp_path / "cut")
    assert ra["test"] == rb["test"] and ra["test_ema"] == rb["test_ema"]
    from safetensors.torch import load_file

    for f in ("model.safetensors", "ema.safetensors"):
        wa = load_file(str(tmp_path / "full" / "checkpoint" / f))
        wb = load_file(str(tmp_path / "cut" / "checkpoint" / f))
        assert all(torch.equal(wa[k], wb[k]) for k in wa), f
    ema = load(tmp_path / "full" / "checkpoint", ema=True)
    raw = load(tmp_path / "full" / "checkpoint")
    assert not torch.equal(ema.embed.tok.weight, raw.embed.tok.weight)
    assert json.loads((tmp_path / "full" / "checkpoint" / "config.json").read_text())["supervision_steps"] == 2


def test_exit_gate_across_steps_needs_the_target_loss(tmp_path):
    with pytest.raises(UserError, match="exit_loss must be 'target'"):
        load_run_config(None, [*TINY, f"out_dir={tmp_path}", "train.steps=2", "train.losses.exit_loss=distribution"])


def test_step_exits_stop_at_the_first_confident_step():
    logits = torch.tensor([[-3.0, 3.0, -1.0], [1.0, -2.0, -1.0], [0.0, 0.0, -5.0]])   # [N=3 steps, B=3 rows]
    assert step_exits(logits).tolist() == [1, 0, 2]                                     # never later than N
    assert step_exits(logits, threshold=0.9).tolist() == [2, 0, 2]


def test_step_halting_threshold_runs_from_one_step_to_all(tmp_path, capsys):
    """The threshold of halting across steps: at 1 no row stops early (the plain N-step metrics), just above 0 every
    row stops after step 1 (the step-1 metrics of the curve); a bad threshold is one line."""
    from loopformer.cli import main
    from loopformer.eval.commands import evaluate_checkpoint
    from loopformer.eval.config import EvalConfig

    train(load_run_config(None, [*TINY, f"out_dir={tmp_path / 'r'}", "train.steps=2", "eval.votes=0"]))
    everyone = evaluate_checkpoint(str(tmp_path / "r"), EvalConfig(step_halt=1.0), progress=False)
    at_once = evaluate_checkpoint(str(tmp_path / "r"), EvalConfig(step_halt=1e-12), progress=False)
    m, first = everyone["metrics"], everyone["stepwise"][0]
    assert m["halted_steps"] == 2 and m["halted_cell_accuracy"] == m["cell_accuracy"]
    assert at_once["metrics"]["halted_steps"] == 1
    assert at_once["metrics"]["halted_cell_accuracy"] == pytest.approx(first["cell_accuracy"], abs=1e-12)
    assert main(["eval", str(tmp_path / "r"), "--step-halt", "0"]) == 2
    assert "step-halting threshold" in capsys.readouterr().err
    with pytest.raises(UserError, match="step_halt"):
        load_run_config(None, [*TINY, f"out_dir={tmp_path / 's'}", "eval.step_halt=1.5"])
