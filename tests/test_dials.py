"""The dials study's pieces: the η(t) arm (`loopformer.lab.loop_scales`) against the loop written out, the label
sequences' per-loop label error against a brute-force count."""

import math

import numpy as np
import pytest
import torch

from loopformer.model import LoopedTransformer, ModelConfig
from loopformer.tasks.label_sequence import LabelSequenceTask


def _cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=11, d_model=16, n_heads=2, loops=4, max_len=16, input_injection=True, causal=False)
    return ModelConfig(**{**base, **kw})


# ------------------------------------------------------------------ η(t): Theorem 4.2's model
def test_loop_scales_against_the_loop_written_out():
    torch.manual_seed(0)
    m = LoopedTransformer(_cfg(extensions={"loop_scales": {}})).eval()
    ext = m.extensions[0]
    assert len(ext.eta) == 4 and all(torch.equal(p, torch.ones(16)) for p in ext.eta)
    assert m.num_params() == LoopedTransformer(_cfg()).num_params() + 4 * 16      # r·D parameters more
    x = torch.randint(0, 11, (2, 6))
    # at init (η = 1) it is the looped model of the same weights, loop for loop
    plain = LoopedTransformer(_cfg()).eval()
    plain.load_state_dict({k: v for k, v in m.state_dict().items() if not k.startswith("extensions.")})
    torch.testing.assert_close(m(x, return_all=True).all_hidden, plain(x, return_all=True).all_hidden)
    with torch.no_grad():
        for p in ext.eta:
            p.uniform_(-1.0, 2.0)
    eta = [p.detach().clone() for p in ext.eta]
    e = m.embed(x)
    h, states = e, []
    for t in range(6):                                    # two loops past r: η(r-1) again
        z = m.blocks[0](h + e if t > 0 else h)
        h = h + eta[min(t, 3)] * (z - h)
        states.append(h)
    out = m(x, loops=6, return_all=True)
    torch.testing.assert_close(out.all_hidden, torch.stack(states))
    # a loop per row: row b's η(t_b), past r the last
    t = torch.tensor([0, 2, 9])
    torch.testing.assert_close(ext.scales(t), torch.stack([eta[0], eta[2], eta[3]])[:, None])
    # every η(t) a loop reads is trained, and nothing else changes where η(t) is not read
    m.train()
    m(x, loops=2).logits.square().mean().backward()
    assert [p.grad is not None and p.grad.abs().sum() > 0 for p in ext.eta] == [True, True, False, False]


def test_loop_scales_options_are_checked():
    m = LoopedTransformer(_cfg(extensions={"loop_scales": {"init": 0.5}}))
    assert all(torch.equal(p, torch.full((16,), 0.5)) for p in m.extensions[0].eta)
    for bad in (math.nan, 1e6, "1", True):
        with pytest.raises(ValueError, match="loop_scales.init must be a number"):
            _cfg(extensions={"loop_scales": {"init": bad}})


# ------------------------------------------------------------------ the per-loop label error
def test_step_label_error_against_a_brute_force_count():
    task = LabelSequenceTask(keys=4, length=3, labels=5, jump=2, width=3)
    rng = np.random.default_rng(0)
    state = rng.integers(task.first_label, task.first_label + 5, size=(7, 3))          # [N,T] label tokens
    pred = state.copy()
    pred[0, 1] = task.first_label + (state[0, 1] - task.first_label + 2) % 5           # a label off by 2 or 3
    pred[3, 2] = 0                                                                      # not a label: L - 1
    errs = [abs(int(p) - int(s)) if task.first_label <= p < task.first_label + 5 else 4
            for p, s in zip(pred.ravel(), state.ravel())]
    got = task.step_metrics(pred, state)
    assert got == {"step_label_error": pytest.approx(sum(errs) / len(errs)), "step_max_label_error": max(errs)}


def test_loop_wise_evaluation_reads_every_loop_against_its_label():
    """The token source's summary: loop t's step metrics against label t-1, their mean over loops 1..r at r."""
    from loopformer.sources import TokenData
    from loopformer.sources.base import TaskConfig

    cfg = TaskConfig(name="label_sequence", options={"keys": 4, "length": 3, "labels": 6, "jump": 5, "width": 4},
                     n_train=64, n_test=40, loop_targets=True)
    data = TokenData(cfg)
    rows = data.test_rows(0)
    steps = rows["step_targets"]                                                        # [N,K,T]
    # predictions: loop 1 right, loop 2 every label +1 (or L-1 for the last label), loop 3 the first label
    pred = np.stack([steps[:, 0], np.where(steps[:, 1] < data.task.first_label + 5, steps[:, 1] + 1, 0),
                     steps[:, 0]])
    out = data.summarize([(pred, rows)], 0, 3)
    want = [float(data.task.label_errors(pred[t], steps[:, t]).mean()) for t in range(3)]
    assert [m["step_label_error"] for m in out] == pytest.approx(want)
    assert out[0]["step_label_error"] == 0 and out[0]["step_accuracy"] == 1
    assert out[2]["loops_step_label_error"] == pytest.approx(sum(want) / 3)
    assert out[2]["loops_step_max_label_error"] == pytest.approx(np.mean([m["step_max_label_error"] for m in out]))
    assert "loops_step_label_error" not in out[1]
