"""Adaptive depth in the model and in generation: every row that halts returns exactly what a fixed-depth run with
its exit loop returns; per-token exits in one forward equal token-by-token processing with the cache; cached
generation with exits equals its recomputation."""

from __future__ import annotations

import shutil

import pytest
import torch

from loopformer import device
from loopformer.errors import UserError
from loopformer.model.config import ModelConfig
from loopformer.model.halting import HaltRule, criterion_holds
from loopformer.model.looped import LoopedTransformer
from loopformer.model.options import LoopOptions
from loopformer.text.generate import SamplingConfig, generate

RULES = ["latent:0.3", "kl:0.05", "entropy:2.5", "argmax:1", "argmax:2", "gate:0.5", "kl:0.2,min=3",
         "latent:0.5,max=4"]


def model(causal: bool, loops: int = 6, seed: int = 0, **over) -> LoopedTransformer:
    """A small TMLT with an exit gate and perturbed weights, in float64 (exact comparisons); `over`: other config
    fields."""
    torch.manual_seed(seed)
    cfg = ModelConfig(**{**dict(vocab_size=17, max_len=24, d_model=24, n_heads=2, loops=loops, causal=causal,
                                timestep=True, input_injection=True, exit_gate=True), **over})
    m = LoopedTransformer(cfg).double().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))
        m.exit_gate.proj.bias.zero_()                               # a gate that stops about half the time
    return m


def reference_exits(m: LoopedTransformer, x: torch.Tensor, rule: HaltRule, loops: int) -> torch.Tensor:
    """The exit loop of every row from the full fixed-depth trajectory, the criterion checked loop by loop."""
    with torch.no_grad():
        full = m(x, loops=loops, return_all=True)
        gates = m.exit_gate(full.all_hidden)
    B = x.shape[0]
    exits, streak = torch.full((B,), rule.bound(loops)), torch.zeros(B, dtype=torch.long)
    for t in range(rule.bound(loops)):
        holds = criterion_holds(rule, hidden=full.all_hidden[t], hidden_prev=full.all_hidden[t - 1] if t else None,
                                logits=full.all_logits[t], logits_prev=full.all_logits[t - 1] if t else None,
                                stop_logits=gates[t])
        streak = (streak + 1) * holds
        newly = (streak >= rule.patience) & (t + 1 >= rule.min_loops) & (exits == rule.bound(loops))
        exits[newly & (t + 1 < rule.bound(loops))] = t + 1
    return exits


@pytest.mark.parametrize("causal,pos", [(False, "learned"), (True, "learned"), (True, "rope")])
def test_each_row_returns_the_fixed_depth_run_at_its_exit_loop(causal, pos):
    m = model(causal, pos=pos)
    x = torch.randint(0, 17, (7, 9))
    seen = set()
    for text in RULES:
        rule = HaltRule.parse(text)
        out = m(x, halt=rule, opts=LoopOptions(per_token=False))
        assert out.exit_loops.tolist() == reference_exits(m, x, rule, 6).tolist(), text
        seen.update(out.exit_loops.tolist())
        for b in range(x.shape[0]):
            with torch.no_grad():
                ref = m(x[b:b + 1], loops=int(out.exit_loops[b]))
            torch.testing.assert_close(out.logits[b], ref.logits[0], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(out.hidden[b], ref.hidden[0], rtol=1e-12, atol=1e-12)
        assert out.loops == int(out.exit_loops.max())
    assert len(seen) >= 4                                           # the rules really stop rows at different loops


def test_rows_leave_the_batch():
    m = model(False)
    x = torch.randint(0, 17, (6, 9))
    sizes = []
    first = m.blocks[0]
    hook = first.register_forward_pre_hook(lambda mod, args: sizes.append(args[0].shape[0]))
    out = m(x, halt="entropy:2.5")
    hook.remove()
    assert sizes == [sum(int(e) > t for e in out.exit_loops) for t in range(int(out.exit_loops.max()))]
    assert sizes[-1] < sizes[0]


def test_halt_positions_choose_what_a_row_is_judged_on():
    m = model(False)
    x = torch.randint(0, 17, (5, 9))
    P = torch.zeros(5, 9, dtype=torch.bool)
    P[:, 3] = True
    out = m(x, halt="argmax:1", opts=LoopOptions(halt_positions=P))
    with torch.no_grad():
        full = m(x, loops=6, return_all=True)
    pred = full.all_logits[:, :, 3].argmax(-1)                      # [R,B]: the judged position's prediction
    for b, e in enumerate(out.exit_loops.tolist()):
        changed = (pred[1:, b] != pred[:-1, b]).tolist()           # changed between loop t and t+1
        want = next((t + 2 for t, c in enumerate(changed) if not c), 6)
        assert e == want


def test_per_token_exits_equal_token_by_token_processing():
    m = model(True)
    x = torch.randint(0, 17, (3, 10))
    for text in ("kl:0.05", "entropy:2.5", "gate:0.5", "latent:0.4,max=5"):
        out = m(x, halt=text)
        assert out.exit_loops.shape == (3, 10)
        assert len(set(out.exit_loops.flatten().tolist())) >= 2, text   # tokens stop at different loops
        cache = m.new_cache(3)
        steps = [m(x[:, i:i + 1], halt=text, cache=cache) for i in range(10)]
        logits = torch.cat([s.logits for s in steps], 1)
        exits = torch.cat([s.exit_loops for s in steps], 1)
        assert exits.tolist() == out.exit_loops.tolist(), text
        torch.testing.assert_close(logits, out.logits, rtol=0, atol=1e-10)
    # the first token sees only itself: it is the fixed-depth run at its exit loop
    with torch.no_grad():
        full = m(x, loops=6, return_all=True).all_logits
    out = m(x, halt="kl:0.05")
    torch.testing.assert_close(out.logits[:, 0], full[out.exit_loops[:, 0] - 1, torch.arange(3), 0],
                               rtol=1e-12, atol=1e-12)


def test_per_token_with_no_exit_is_the_fixed_depth_run():
    m = model(True)
    x = torch.randint(0, 17, (3, 10))
    out = m(x, halt="kl:0")                                         # KL < 0 never holds
    with torch.no_grad():
        torch.testing.assert_close(out.logits, m(x).logits, rtol=1e-12, atol=1e-12)
    assert (out.exit_loops == 6).all()


@pytest.mark.parametrize("rule", ["kl:0.05", "entropy:2.0", "gate:0.5", "argmax:1"])
def test_generation_with_exits_equals_recomputation(rule):
    m = model(True, seed=1)
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8], [9, 10, 11]]
    cfg = SamplingConfig(max_new_tokens=8, temperature=0, halt=rule)
    cached = generate(m, prompts, cfg, return_logits=True)
    full = generate(m, prompts, cfg, use_cache=False, return_logits=True)
    assert cached.tokens == full.tokens
    assert cached.exit_loops.tolist() == full.exit_loops.tolist()
    torch.testing.assert_close(cached.logits, full.logits, rtol=0, atol=1e-9)
    assert cached.exit_loops.shape == (3, 8) and len(set(cached.exit_loops.flatten().tolist())) >= 2


def test_generation_exits_save_loops_and_fixed_depth_is_unchanged():
    m = model(True, seed=1)
    prompts = [[1, 2, 3], [4, 5]]
    plain = generate(m, prompts, SamplingConfig(max_new_tokens=6, temperature=0), return_logits=True)
    never = generate(m, prompts, SamplingConfig(max_new_tokens=6, temperature=0, halt="kl:0"), return_logits=True)
    assert plain.tokens == never.tokens and (never.exit_loops == 6).all()
    torch.testing.assert_close(plain.logits, never.logits, rtol=0, atol=1e-10)
    early = generate(m, prompts, SamplingConfig(max_new_tokens=6, temperature=0, halt="entropy:2.3"))
    assert early.exit_loops.float().mean() < 6


@pytest.mark.parametrize("rule,pos", [("kl:0.05", "learned"), ("entropy:2.0", "learned"), ("gate:0.5", "learned"),
                                      ("argmax:1", "learned"), ("latent:0.8,max=5", "learned"), ("kl:0.05", "rope")])
def test_depthwise_batched_generation_gives_the_tokens_of_the_step_schedule(rule, pos):
    m = model(True, seed=1, pos=pos)
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8], [9, 10, 11], [12]]
    step = generate(m, prompts, SamplingConfig(max_new_tokens=9, temperature=0, halt=rule, schedule="step"))
    deep = generate(m, prompts, SamplingConfig(max_new_tokens=9, temperature=0, halt=rule))     # depth-wise
    full = generate(m, prompts, SamplingConfig(max_new_tokens=9, temperature=0, halt=rule), use_cache=False)
    assert deep.tokens == step.tokens == full.tokens
    assert deep.exit_loops.tolist() == step.exit_loops.tolist()
    assert len(set(deep.exit_loops.flatten().tolist())) >= 2                      # rows at different loops
    # with fewer loops than trained, and an end-of-sequence token that stops one row early
    eos = step.tokens[1][3]
    few = [generate(m, prompts, SamplingConfig(max_new_tokens=9, temperature=0, halt=rule, loops=4, schedule=s),
                    eos_id=eos) for s in ("step", "depthwise")]
    assert few[0].tokens == few[1].tokens and few[0].finished == few[1].finished and any(few[1].finished)
    for a, b, toks in zip(few[0].exit_loops.tolist(), few[1].exit_loops.tolist(), few[1].tokens):
        assert a[:len(toks)] == b[:len(toks)] and max(b) <= 4 and all(x == 0 for x in b[len(toks):])


@pytest.mark.parametrize("over", [{"n_layers": 2}, {"timestep": False, "input_injection": False},
                                  {"pos": "none", "n_layers": 2}])
def test_depthwise_writes_through_the_cache_the_step_schedule_leaves(over):
    """Every token's keys/values, written through to the slots of the loops after its own as it computes them,
    leave the cache as the step schedule does (each stopped token's deepest loop copied into the later slots), for
    blocks of two layers, models without timestep encoding or input injection, and without learned positions."""
    m = model(True, loops=5, seed=2, **over)
    caches, new_cache = [], m.new_cache
    m.new_cache = lambda *a, **k: caches.append(new_cache(*a, **k)) or caches[-1]
    prompts, N = [[1, 2, 3, 4], [5, 6], [7, 8, 9]], 8
    step = generate(m, prompts, SamplingConfig(max_new_tokens=N, temperature=0, halt="gate:0.5", schedule="step"))
    deep = generate(m, prompts, SamplingConfig(max_new_tokens=N, temperature=0, halt="gate:0.5"))
    assert deep.tokens == step.tokens and deep.exit_loops.tolist() == step.exit_loops.tolist()
    assert len(set(deep.exit_loops[:, 1:].flatten().tolist())) >= 2                 # tokens stopped at different loops
    P = 4                                       # the last token is sampled, never fed: its column is not compared
    torch.testing.assert_close(caches[1].kv[..., :P + N - 1, :], caches[0].kv[..., :P + N - 1, :], rtol=0,
                               atol=1e-12)


@pytest.mark.skipif(not shutil.which("g++") and not shutil.which("c++"), reason="no C++ compiler for torch.compile")
def test_compiled_tick_decodes_as_the_eager_tick():
    m = model(True, seed=1).float()
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8], [9, 10, 11], [12]]
    for rule in ("gate:0.5", "kl:0.05"):
        eager = generate(m, prompts, SamplingConfig(max_new_tokens=9, temperature=0, halt=rule))
        comp = generate(m, prompts, SamplingConfig(max_new_tokens=9, temperature=0, halt=rule, compile=True))
        assert comp.tokens == eager.tokens and comp.exit_loops.tolist() == eager.exit_loops.tolist()
        assert len(set(comp.exit_loops.flatten().tolist())) >= 2


def test_compile_without_a_compiler_is_refused(monkeypatch):
    monkeypatch.setattr(device.shutil, "which", lambda name: None)
    with pytest.raises(UserError, match="C\\+\\+ compiler"):
        generate(model(True), [[1, 2], [3]], SamplingConfig(max_new_tokens=3, halt="gate:0.5", compile=True))


@pytest.mark.parametrize("case", ["no halting", "one prompt", "step schedule", "no cache", "logits"])
def test_compile_where_nothing_would_run_compiled_is_refused(case):
    """`compile` compiles the depth-wise tick; where generation would not run it, it is refused, never ignored."""
    prompts = [[1, 2]] if case == "one prompt" else [[1, 2], [3]]
    cfg = SamplingConfig(max_new_tokens=3, compile=True, halt=None if case == "no halting" else "gate:0.5",
                         schedule="step" if case == "step schedule" else "depthwise")
    with pytest.raises(UserError, match="depth-wise tick"):
        generate(model(True), prompts, cfg, use_cache=case != "no cache", return_logits=case == "logits")


def test_depthwise_generation_samples_reproducibly():
    m = model(True, seed=1)
    prompts = [[1, 2, 3], [4, 5], [6]]
    cfg = SamplingConfig(max_new_tokens=7, temperature=1.0, top_k=5, seed=3, halt="gate:0.5")
    a, b = generate(m, prompts, cfg), generate(m, prompts, cfg)
    assert a.tokens == b.tokens and all(len(t) == 7 and all(0 <= x < 17 for x in t) for t in a.tokens)
    with pytest.raises(UserError, match="schedule"):
        SamplingConfig(halt="gate:0.5", schedule="sideways")


def test_bad_halting_arguments():
    with pytest.raises(UserError, match="halting"):
        SamplingConfig(halt="kl")
    with pytest.raises(UserError, match="causal"):
        model(False)(torch.randint(0, 17, (2, 4)), halt="kl:1", opts=LoopOptions(per_token=True))
    m = model(True)
    with pytest.raises(UserError, match="exit gate"):
        LoopedTransformer(m.config.replace(exit_gate=False))(torch.randint(0, 17, (2, 4)), halt="gate:0.5")
