"""The fast training step: read-outs only where the loss looks, the step compiled at the final loop count, the
fused optimiser — each checked against the plain computation it replaces."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from loopformer import device
from loopformer.errors import UserError
from loopformer.model import LoopedTransformer
from loopformer.model.config import ModelConfig
from loopformer.model.options import LoopOptions
from loopformer.tasks import IGNORE
from loopformer.train import trainer as trainer_mod
from loopformer.train.compiling import block_compiled, eager
from loopformer.train.config import OptimConfig, SystemConfig, load_run_config
from loopformer.train.distributed import setup
from loopformer.train.losses import loop_targets, read_positions, summed_loss
from loopformer.train.optim import make_optimizer
from loopformer.train.run import read_metrics
from loopformer.train.trainer import Trainer, compiles, step_scope, train

BASE = ["task.n_train=128", "task.n_test=32", "model.d_model=16", "model.n_heads=2", "model.loops=3",
        "model.input_injection=true", "train.steps=4", "train.batch_size=16", "train.optim.lr=3e-3",
        "train.log_every=1", "eval.batch_size=32", "eval.max_loops=4", "log.tensorboard=false", "log.progress=false"]
TASKS = {   # answer-only token task, per-loop targets, regression with weights
    "ed": ["task.name=edit_distance", "task.options={length: 4, alphabet_min: 2, alphabet_max: 3}",
           "task.answer_only=true", "train.losses.loops=all"],
    "pointer": ["task.name=pointer_chase", "task.options={symbols: 6, hops: 3}", "task.loop_targets=true",
                "train.losses.loops=all"],
    "icl": ["task.name=icl", "task.options={function_class: linear, n_dims: 3}", "task.points=5",
            "train.losses.loops=window", "train.losses.window=2"],
}


def _trainer(tmp_path, *extra: str) -> Trainer:
    cfg = load_run_config(None, [*BASE, f"out_dir={tmp_path / 'run'}", *extra])
    t = Trainer(cfg, setup("cpu"), resume=False)
    t.open_log(False)
    t.wrap()
    return t


# ------------------------------------------------------------------------------------------------ read positions
def test_read_at_equals_the_full_read_out_at_those_positions():
    cfg = ModelConfig(vocab_size=11, n_out=7, d_model=16, n_heads=2, loops=5, max_len=9, timestep=True)
    m = LoopedTransformer(cfg).eval()
    x = torch.randint(0, 11, (4, 9))
    at = torch.tensor([0, 5, 17, 30, 35])                                      # flattened B·T positions
    with torch.no_grad():
        full = m(x, return_all=True)
        part = m(x, return_all=True, opts=LoopOptions(read_at=at, read_loops=2))
        last = m(x, opts=LoopOptions(read_at=at))
    flat = full.all_logits.flatten(1, 2)                                       # [R,B·T,C]
    assert part.all_logits.shape == (2, 5, 7) and last.logits.shape == (5, 7)
    torch.testing.assert_close(part.all_logits, flat[-2:, at], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(part.all_hidden, full.all_hidden.flatten(1, 2)[-2:, at])
    torch.testing.assert_close(part.logits, flat[-1, at], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(last.logits, flat[-1, at], rtol=1e-6, atol=1e-6)
    assert torch.equal(part.hidden, full.hidden)                               # the carried state stays whole
    torch.testing.assert_close(full.logits, full.all_logits[-1])               # final logits: the last read-out


READ_ONLY_MODELS = {   # bidirectional looped, TMLT, two layers per block, causal with padding, the authors' layer
    "looped": dict(causal=False),
    "tmlt": dict(causal=False, timestep=True),
    "two-layers": dict(causal=False, n_layers=2, timestep=True),
    "causal": dict(causal=True),
    "authors": dict(causal=False, compat="authors"),
}


@pytest.mark.parametrize("kind", sorted(READ_ONLY_MODELS))
def test_read_only_last_loop_equals_the_full_loop_at_the_read_positions(kind):
    """The last loop computed at the read positions only gives the read-outs, the last hidden state there and the
    gradients of the full computation (float rounding)."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=11, n_out=7, d_model=16, n_heads=2, loops=4, max_len=9, input_injection=True,
                      **READ_ONLY_MODELS[kind])
    m = LoopedTransformer(cfg)
    if cfg.timestep:                                                           # modulations that do something
        for blk in m.blocks:
            torch.nn.init.normal_(blk.modulation.weight, 0, 0.3)
    x = torch.randint(0, 11, (4, 9))
    pad = torch.ones(4, 9, dtype=torch.bool)
    pad[1, :3] = False                                                         # left padding in one row
    kw = dict(attn_mask=pad) if cfg.causal else {}
    at = torch.tensor([0, 5, 17, 30, 35])
    y = torch.randn(3, 5, 7)

    def run(read_only):
        m.zero_grad()
        out = m(x, return_all=True, **kw, opts=LoopOptions(read_at=at, read_loops=3, read_only=read_only))
        (out.all_logits * y).sum().backward()
        return out, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    full, g_full = run(False)
    part, g_part = run(True)
    assert part.hidden.shape == (5, 16) and full.hidden.shape == (4, 9, 16)
    torch.testing.assert_close(part.all_logits, full.all_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(part.hidden, full.hidden.flatten(0, 1)[at], rtol=1e-5, atol=1e-5)
    assert g_part.keys() == g_full.keys()
    for name in g_full:
        torch.testing.assert_close(g_part[name], g_full[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.skipif(not shutil.which("g++") and not shutil.which("c++"), reason="no C++ compiler for torch.compile")
def test_compiled_short_bidirectional_attention_equals_the_fused_kernel():
    """Under torch.compile, short bidirectional rows attend by matmul-softmax-matmul: outputs and gradients equal
    the eager fused kernel's to float rounding; longer rows keep the kernel."""
    from loopformer.model import layers

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=11, n_out=7, d_model=16, n_heads=2, loops=3, max_len=9, causal=False)
    m = LoopedTransformer(cfg)
    x = torch.randint(0, 11, (4, 9))
    seen = []
    real = layers.F.scaled_dot_product_attention

    def spy(*a, **k):
        seen.append(torch.compiler.is_compiling())
        return real(*a, **k)

    def grads(fn):
        m.zero_grad()
        out = fn(x).logits
        out.square().sum().backward()
        return out.detach(), [p.grad.clone() for p in m.parameters() if p.grad is not None]

    eager_out, eager_g = grads(m)
    torch._dynamo.reset()
    layers.F.scaled_dot_product_attention = spy
    try:
        comp_out, comp_g = grads(torch.compile(m))
    finally:
        layers.F.scaled_dot_product_attention = real
    assert True not in seen                                        # no fused kernel in the compiled graph
    torch.testing.assert_close(comp_out, eager_out, rtol=1e-5, atol=1e-5)
    for a, b in zip(comp_g, eager_g):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert 9 <= layers.MATH_ATTENTION_MAX_T


def test_read_only_is_ignored_where_it_cannot_apply():
    m = LoopedTransformer(ModelConfig(vocab_size=11, n_out=7, d_model=16, n_heads=2, loops=3, max_len=9,
                                      causal=False, dropout=0.1)).eval()
    x, at = torch.randint(0, 11, (2, 9)), torch.tensor([1, 10])
    with torch.no_grad():
        sparse = LoopOptions(read_at=at, read_only=True)
        assert m(x, opts=sparse).hidden.shape == (2, 9, 16)              # dropout in the model
        m2 = LoopedTransformer(ModelConfig(vocab_size=11, n_out=7, d_model=16, n_heads=2, loops=3, max_len=9,
                                           causal=False)).eval()
        rows = torch.tensor([2, 3])
        assert m2(x, opts=replace(sparse, row_loops=rows)).hidden.shape == (2, 9, 16)   # a loop count per row
        assert m2(x, opts=sparse).hidden.shape == (2, 16)


def test_read_at_is_refused_for_a_pooled_sequence_head():
    m = LoopedTransformer(ModelConfig(vocab_size=5, n_out=3, d_model=8, n_heads=2, max_len=4, head="sequence",
                                      causal=False))
    with pytest.raises(UserError, match="read_at"):
        m(torch.zeros(2, 4, dtype=torch.long), opts=LoopOptions(read_at=torch.tensor([1])))


def test_read_positions():
    t = torch.full((2, 4), IGNORE)
    t[0, 3], t[1, 2] = 1, 0
    assert read_positions({"targets": t}).tolist() == [3, 6]
    steps = torch.full((2, 3, 4), IGNORE)
    steps[1, 0, 1] = 2                                                         # a loop's target elsewhere
    assert read_positions({"targets": t, "step_targets": steps}).tolist() == [3, 5, 6]
    assert read_positions({"targets": torch.zeros(2, 4, dtype=torch.long)}) is None   # every position
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    assert read_positions({"targets": torch.zeros(2, 2), "weight": w}).tolist() == [0, 3]
    assert read_positions({"targets": torch.zeros(2, 2)}) is None


@pytest.mark.parametrize("task", sorted(TASKS))
def test_loss_at_read_positions_equals_the_loss_over_every_position(tmp_path, task):
    t = _trainer(tmp_path, *TASKS[task], "train.system.compile=false")
    t.step(0)
    mb = t.last_micro
    at, R = mb.get("read_at"), t.cfg.model.loops
    assert at is not None and at.numel() < mb["inputs"].shape[0] * mb["inputs"].shape[1]
    n_read = {"ed": R, "pointer": R, "icl": 2}[task]
    targets = loop_targets(mb["step_targets"], R, n_read) if "step_targets" in mb else mb["targets"]
    with torch.no_grad():
        fast, out = t._forward_loss(mb["inputs"], None, 0, at, targets, mb.get("weight"), R, True, n_read, n_read)
        ref = t.model(mb["inputs"], return_all=True)                           # every loop, every position
        want, _ = summed_loss(ref.all_logits[-n_read:], targets, mb.get("weight"))
    torch.testing.assert_close(fast, want, rtol=1e-5, atol=1e-5)
    assert out.all_logits.shape[:2] == (n_read, at.numel())


# ------------------------------------------------------------------------------------------------ compilation
def test_compile_setting_and_the_auto_rule(monkeypatch):
    assert SystemConfig(compile=True).compile == "true"                       # a YAML boolean
    assert SystemConfig(compile="False").compile == "false"
    with pytest.raises(ValueError, match="train.system.compile"):
        SystemConfig(compile="sometimes")
    cpu, mps = torch.device("cpu"), torch.device("mps")

    def cfg(*extra):
        return load_run_config(None, [*BASE, *TASKS["ed"], *extra])

    monkeypatch.setattr(device.shutil, "which", lambda name: "/usr/bin/" + name)
    assert not compiles(cfg("train.system.compile=auto"), cpu, 999)                   # too short to repay compiling
    assert compiles(cfg("train.system.compile=auto"), cpu, 1000)
    assert not compiles(cfg("train.system.compile=auto"), mps, 5000)
    assert compiles(cfg("train.system.compile=true"), cpu, 4)
    assert not compiles(cfg("train.system.compile=false"), cpu, 5000)
    # a loop curriculum: only the steps at the final loop count run compiled, and count
    cur = cfg("model.loops=8", "train.loops.start=2", "train.loops.every=100", "train.loops.increment=2",
              "train.system.compile_scope=step")
    assert not compiles(cur, cpu, 1299) and compiles(cur, cpu, 1300)          # 8 loops from step 300 on
    # ... unless the block is compiled (auto with a curriculum): one graph for every loop count, every step counts
    cur_auto = cfg("model.loops=8", "train.loops.start=2", "train.loops.every=100", "train.loops.increment=2")
    assert step_scope(cur_auto) == "block" and compiles(cur_auto, cpu, 1000)
    assert step_scope(cfg("model.loops=16")) == "step" and step_scope(cfg("model.loops=17")) == "block"
    assert step_scope(cfg("model.loops=64", "train.system.compile_scope=step")) == "step"
    assert step_scope(cfg("model.loops=4", "train.loops.sample=uniform", "train.loops.min=2")) == "block"
    with pytest.raises(ValueError, match="train.system.compile_scope"):
        SystemConfig(compile_scope="layer")
    monkeypatch.setattr(device.shutil, "which", lambda name: None)        # no C++ compiler
    assert not compiles(cfg("train.system.compile=auto"), cpu, 5000)


def _losses(run_dir):
    return [r["loss"] for r in read_metrics(run_dir) if r["split"] == "train"]


@pytest.mark.skipif(not shutil.which("g++") and not shutil.which("c++"), reason="no C++ compiler for torch.compile")
def test_compiled_step_trains_like_the_eager_step(tmp_path):
    over = [*BASE, *TASKS["pointer"], "train.steps=4", "model.loops=3", "train.loops.start=2",
            "train.loops.every=2", "train.loops.increment=1",                 # 2 loops (eager), then 3 (compiled)
            "train.system.compile_scope=step"]
    eager = train(load_run_config(None, [*over, "train.system.compile=false", f"out_dir={tmp_path / 'e'}"]))
    comp = train(load_run_config(None, [*over, "train.system.compile=true", f"out_dir={tmp_path / 'c'}"]))
    assert comp["compiled"] and comp["compile_s"] > 0 and not eager["compiled"] and eager["compile_s"] == 0
    events = [(r["step"], r["event"]) for r in read_metrics(tmp_path / "c") if r["split"] == "event"]
    assert events == [(2, "compiling"), (2, "compiled")]                      # said while it compiles (sweeps' bar)
    assert not [r for r in read_metrics(tmp_path / "e") if r["split"] == "event"]
    le, lc = _losses(tmp_path / "e"), _losses(tmp_path / "c")
    assert le[:2] == lc[:2]                                                   # curriculum steps: the same eager code
    assert lc[2:] == pytest.approx(le[2:], rel=1e-4)                          # compiled: the same math
    assert comp["test"]["accuracy"] == pytest.approx(eager["test"]["accuracy"], abs=1 / 32 + 1e-9)


@pytest.mark.skipif(not shutil.which("g++") and not shutil.which("c++"), reason="no C++ compiler for torch.compile")
def test_compiled_block_trains_like_the_eager_step(tmp_path):
    """Regional compilation: each layer of the block compiled once, run by every loop of every loop count (a
    curriculum from 2 to 3 loops, a TMLT); the same losses as eager to float rounding, the same checkpoint."""
    over = [*BASE, *TASKS["pointer"], "train.steps=4", "model.loops=3", "train.loops.start=2", "model.timestep=true",
            "train.loops.every=2", "train.loops.increment=1", "train.system.compile_scope=block"]
    eager_ = train(load_run_config(None, [*over, "train.system.compile=false", f"out_dir={tmp_path / 'e'}"]))
    comp = train(load_run_config(None, [*over, "train.system.compile=true", f"out_dir={tmp_path / 'c'}"]))
    assert comp["compiled"] and comp["compile_scope"] == "block" and comp["compile_s"] > 0
    assert not eager_["compiled"] and eager_["compile_scope"] is None
    assert _losses(tmp_path / "c") == pytest.approx(_losses(tmp_path / "e"), rel=1e-4)   # every step compiled
    assert comp["test"]["accuracy"] == pytest.approx(eager_["test"]["accuracy"], abs=1 / 32 + 1e-9)
    a, b = (load_file(str(tmp_path / n / "checkpoint" / "model.safetensors")) for n in ("e", "c"))
    assert a.keys() == b.keys()                                              # the plain model's state dict
    t = _trainer(tmp_path / "t", *TASKS["pointer"], "model.loops=3", "train.system.compile=true",
                 "train.system.compile_scope=block")
    assert t.regional and block_compiled(t.model)
    with eager(t.model):
        assert not block_compiled(t.model)
    assert block_compiled(t.model)


def test_auto_falls_back_to_eager_when_compiling_fails(tmp_path, monkeypatch, capsys):
    def broken(fn, **kw):
        def call(*args):
            raise RuntimeError("no compiler here\nsecond line")
        return call
    monkeypatch.setattr(trainer_mod.torch, "compile", broken)
    monkeypatch.setattr(trainer_mod, "COMPILE_MIN_STEPS", 1)
    monkeypatch.setattr(device.shutil, "which", lambda name: "/usr/bin/" + name)
    res = train(load_run_config(None, [*BASE, *TASKS["ed"], "train.system.compile=auto", f"out_dir={tmp_path / 'a'}"]))
    err = capsys.readouterr().err
    assert "compiling the training step failed, training eagerly (no compiler here)" in err
    assert err.count("compiling the training step failed") == 1 and not res["compiled"]
    ref = train(load_run_config(None, [*BASE, *TASKS["ed"], "train.system.compile=false", f"out_dir={tmp_path / 'b'}"]))
    assert _losses(tmp_path / "a") == _losses(tmp_path / "b")
    with pytest.raises(RuntimeError, match="no compiler"):                     # asked for explicitly: no fallback
        train(load_run_config(None, [*BASE, *TASKS["ed"], "train.system.compile=true", f"out_dir={tmp_path / 'c'}"]))
    assert json.loads((tmp_path / "b" / "results.json").read_text())["compiled"] is False and ref


# ------------------------------------------------------------------------------------------------ optimiser
def test_fused_optimizer_updates_like_the_reference_adamw():
    cfg = ModelConfig(vocab_size=7, d_model=16, n_heads=2, loops=3, max_len=6, timestep=True)
    a, b = LoopedTransformer(cfg), LoopedTransformer(cfg)
    b.load_state_dict(a.state_dict())
    tc = OptimConfig(lr=1e-2, weight_decay=0.1, timestep_weight_decay=0.0)
    fast = make_optimizer(a, tc)
    assert all(g["fused"] for g in fast.param_groups) and len(fast.param_groups) == 4
    ref = torch.optim.AdamW([{k: v for k, v in g.items() if k != "fused"} for g in make_optimizer(b, tc).param_groups],
                            foreach=False)
    x = torch.randint(0, 7, (3, 6))
    for _ in range(3):
        for m, opt in ((a, fast), (b, ref)):
            opt.zero_grad()
            m(x).logits.square().mean().backward()
            opt.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)
