"""The fixed-point mode (loopformer.model.fixedpoint): the solvers against closed forms, the model's solution and
gradients against long unrolled loops on a block that is a contraction, memory that does not grow with the
iterations, the refusals, and a tiny run through the trainer."""

import math

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

from loopformer.errors import UserError
from loopformer.model import LoopedTransformer, ModelConfig
from loopformer.model.fixedpoint import Backward, anderson, broyden, loop_map
from loopformer.model.options import LoopOptions

D = 8


def _linear_problem(seed: int = 0, B: int = 3, N: int = 12, rho: float = 0.9):
    """f(x) = A x + b per row with ‖A‖₂ = rho < 1, and its fixed point (I − A)⁻¹ b."""
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(B, N, N, generator=g, dtype=torch.float64)
    A = rho * A / torch.linalg.matrix_norm(A, ord=2)[:, None, None]
    b = torch.randn(B, N, generator=g, dtype=torch.float64)
    want = torch.linalg.solve(torch.eye(N, dtype=torch.float64) - A, b[..., None])[..., 0]
    return (lambda x: (A @ x[..., None])[..., 0] + b), want


@pytest.mark.parametrize("solver", [anderson, broyden])
def test_solvers_reach_the_fixed_point_of_a_linear_contraction(solver):
    f, want = _linear_problem()
    x, n, res = solver(f, torch.zeros_like(want), max_iter=200, tol=1e-10)
    torch.testing.assert_close(x, want, rtol=1e-8, atol=1e-8)
    assert res <= 1e-10 and n < 200
    # the plain iteration needs far more applications for the same tolerance (ρ = 0.9)
    assert n < math.log(1e-10) / math.log(0.9)
    # max_iter caps the applications; the trajectory holds the estimate after each
    trace: list[torch.Tensor] = []
    _, n3, res3 = solver(f, torch.zeros_like(want), max_iter=3, tol=0.0, trace=trace)
    assert n3 == 3 and len(trace) == 3 and res3 > 1e-10


def _contraction(solver: str = "anderson", backward: str = "implicit", c: float = 0.5, **kw) -> LoopedTransformer:
    """A tiny model whose block is a contraction: no pre-norm, the FF branch W2·relu(W1·y) = −c·y exactly
    (W1 = [I; −I], W2 = [−cI, cI]) plus small noise, small attention weights — so F(h) = TF(h + e) ≈ (1 − c)(h + e),
    Lipschitz ≈ |1 − c|. Float64."""
    base = dict(vocab_size=11, max_len=16, d_model=D, n_heads=2, ffn_dim=2 * D, loops=4, norm="none",
                activation="relu", input_injection=True, causal=False, init_std=0.2, solver=solver,
                solver_backward=backward, solver_tol=1e-12 if solver != "unroll" else 1e-3)
    torch.manual_seed(0)
    m = LoopedTransformer(ModelConfig(**{**base, **kw})).double()
    eye = torch.eye(D, dtype=torch.float64)
    with torch.no_grad():
        for blk in m.blocks:
            blk.mlp.fc.weight.copy_(torch.cat([eye, -eye]))
            blk.mlp.proj.weight.copy_(torch.cat([-c * eye, c * eye], 1) + 0.02 * torch.randn(D, 2 * D))
            blk.attn.qkv.weight.mul_(0.5)
            blk.attn.proj.weight.mul_(0.5)
            if blk.modulation is not None:    # TMLT: modulations that differ from loop to loop
                blk.modulation.weight.normal_(0.0, 0.05)
    return m


def _same_weights(src: LoopedTransformer, **changes) -> LoopedTransformer:
    m = LoopedTransformer(src.config.replace(**changes)).double()
    m.load_state_dict(src.state_dict())
    return m


X = torch.tensor([[1, 4, 2, 7, 3, 9], [5, 5, 0, 1, 8, 2]])


@pytest.mark.parametrize("solver", ["anderson", "broyden"])
def test_solution_is_the_long_unrolled_state(solver):
    m = _contraction(solver).eval()
    unrolled = _same_weights(m, solver="unroll", solver_backward="bptt").eval()
    with torch.no_grad():
        out = m(X, loops=60)
        ref = unrolled(X, loops=200)
    torch.testing.assert_close(out.hidden, ref.hidden, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-9, atol=1e-9)
    assert out.solve.iters == out.loops < 60 and out.solve.residual <= 1e-12
    assert m.last_solve is out.solve


@pytest.mark.parametrize("past", ["clamp", "hold"])
def test_tmlt_solves_the_map_of_the_loop_index_past_r(past):
    """t* = r − 1 (clamp) or r (hold): the limit of the unrolled TMLT with that index past r, which differs from the
    fixed point of F(·, 0)."""
    m = _contraction(timestep=True, timestep_past=past).eval()
    unrolled = _same_weights(m, solver="unroll", solver_backward="bptt").eval()
    with torch.no_grad():
        h = m(X, loops=60).hidden
        torch.testing.assert_close(h, unrolled(X, loops=200).hidden, rtol=1e-9, atol=1e-9)
        e = m.embed(X)
        mods0 = m.modulations(1, X.device, offset=0)[0]
        h0, _, _ = anderson(lambda z: m.block(z + e, mods0, None, None, 0), torch.zeros_like(e), max_iter=60,
                            tol=1e-12)
    assert (h - h0).abs().max() > 1e-6


def _grads(m: LoopedTransformer, loops: int) -> dict[str, torch.Tensor]:
    m.zero_grad(set_to_none=True)
    w = torch.linspace(-1, 1, m.config.out_dim, dtype=torch.float64)
    out = m(X, loops=loops)
    (out.logits * w).sum().backward()
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("solver", ["anderson", "broyden"])
def test_implicit_gradients_are_those_of_a_long_unrolled_loop(solver):
    m = _contraction(solver, "implicit", timestep=True, timestep_past="clamp").train()
    unrolled = _same_weights(m, solver="unroll", solver_backward="bptt").train()
    got, want = _grads(m, 60), _grads(unrolled, 200)
    assert set(got) == set(want) and any(n.startswith("timestep.") for n in got)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-7, atol=1e-9, msg=n)
    info = m.last_solve
    assert info.backward_iters is not None and info.backward_residual <= 1e-12


@pytest.mark.parametrize("spec", ["phantom:1", "phantom:3:0.5"])
def test_phantom_gradients_are_those_of_k_steps_from_the_detached_solution(spec):
    m = _contraction("anderson", spec).train()
    back = Backward.parse(spec)
    got = _grads(m, 40)
    m.zero_grad(set_to_none=True)
    e = m.embed(X)
    F = loop_map(m, e, None)
    with torch.no_grad():
        x, _, _ = anderson(F, torch.zeros_like(e), max_iter=40, tol=m.config.solver_tol)
    h = x
    for _ in range(back.steps):
        h = back.damping * F(h) + (1 - back.damping) * h
    w = torch.linspace(-1, 1, m.config.out_dim, dtype=torch.float64)
    (m.head(m.norm_f(h), None) * w).sum().backward()
    for n, p in m.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(got[n], p.grad, rtol=1e-10, atol=1e-12, msg=n)
    assert m.last_solve.backward_iters == back.steps
    # with checkpointing: the same gradients
    ck = _same_weights(m, checkpoint=True).train()
    for n, g in _grads(ck, 40).items():
        torch.testing.assert_close(g, got[n], rtol=1e-10, atol=1e-12)


def _saved(m: LoopedTransformer, iters: int) -> tuple[int, int]:
    """(count, bytes) of the tensors autograd saves in one training forward of `iters` solver iterations."""
    n, size = 0, 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal n, size
        n += 1
        size += t.numel() * t.element_size()
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        out = m(X, loops=iters)
    out.logits.sum().backward()
    return n, size


@pytest.mark.parametrize("backward", ["implicit", "phantom:2"])
def test_training_memory_does_not_grow_with_the_iterations(backward):
    m = _contraction("anderson", backward, solver_tol=0.0).train()        # tol 0: every iteration runs
    a, b = _saved(m, 16), _saved(m, 64)
    assert a == b and a[0] > 0
    assert m.last_solve.iters == 64
    unrolled = _same_weights(m, solver="unroll", solver_backward="bptt", solver_tol=1e-3).train()
    assert _saved(unrolled, 64)[1] > 3 * _saved(unrolled, 16)[1]         # full backpropagation grows


def test_evaluation_read_outs_per_iteration_end_with_the_solution():
    m = _contraction(solver_tol=1e-6).eval()
    with torch.no_grad():
        out = m(X, loops=30, return_all=True)
    n = out.solve.iters
    assert out.all_logits.shape[0] == 30 and n < 30
    torch.testing.assert_close(out.all_logits[-1], out.logits)
    assert all(torch.equal(out.all_hidden[t], out.hidden) for t in range(n - 1, 30))
    assert not torch.equal(out.all_hidden[0], out.hidden)


def test_defaults_are_the_unrolled_loop():
    cfg = ModelConfig(vocab_size=11)
    assert (cfg.solver, cfg.solver_backward, cfg.solver_max_iter) == ("unroll", "bptt", 0)
    m = LoopedTransformer(ModelConfig(vocab_size=11, d_model=16, n_heads=2, loops=3)).eval()
    assert m(X).solve is None


def test_max_iter_field_caps_every_call():
    m = _contraction(solver_tol=0.0, solver_max_iter=7).eval()
    with torch.no_grad():
        assert m(X, loops=30).solve.iters == 7
        assert m(X, loops=2).solve.iters == 7


@pytest.mark.parametrize("bad, msg", [
    (dict(solver="newton"), "solver must be one of"),
    (dict(solver_tol=-1e-3), "solver_tol must lie in"),
    (dict(solver_tol=math.nan), "solver_tol must lie in"),
    (dict(solver_max_iter=-1), "solver_max_iter must lie in"),
    (dict(solver_backward="adjoint"), "solver_backward must be"),
    (dict(solver_backward="phantom:0"), "solver_backward must be"),
    (dict(solver_backward="phantom:2:1.5"), "solver_backward must be"),
    (dict(solver="unroll", solver_backward="implicit"), "needs a solver"),
    (dict(solver_backward="bptt"), "needs solver_backward=implicit or phantom"),
    (dict(input_injection=False), "needs input_injection=true"),
    (dict(timestep=True, timestep_time="normalized"), "timestep_time='normalized'"),
    (dict(exit_gate=True), "exit_gate"),
    (dict(supervision_steps=2), "supervision_steps must be 1"),
    (dict(grad_loops=2), "grad_loops must be null"),
    (dict(state_noise=0.1), "state_noise"),
    (dict(dropout=0.1), "dropout"),
])
def test_bad_fixed_point_values_are_refused(bad, msg):
    base = dict(vocab_size=11, d_model=16, n_heads=2, loops=4, input_injection=True, solver="anderson",
                solver_backward="implicit")
    with pytest.raises(ValueError, match=msg):
        ModelConfig(**{**base, **bad})


def test_calls_that_need_the_unrolled_loop_are_refused():
    m = _contraction().train()
    with pytest.raises(UserError, match="per-loop read-outs in training"):
        m(X, return_all=True)
    with pytest.raises(UserError, match="row_loops"):
        m(X, opts=LoopOptions(row_loops=torch.tensor([1, 2])))
    m.eval()
    with pytest.raises(UserError, match="halting"):
        m(X, halt="kl:1e-3", opts=LoopOptions(per_token=False))
    causal = LoopedTransformer(ModelConfig(vocab_size=11, d_model=16, n_heads=2, loops=4, input_injection=True,
                                           solver="broyden", solver_backward="phantom:1"))
    with pytest.raises(UserError, match="key/value cache"):
        causal.new_cache(2)


def test_bad_solver_override_is_one_line(tmp_path):
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-m", "loopformer.cli", "train", "configs/cpu/pointer.yaml",
                        "model.solver=anderson", f"out_dir={tmp_path / 'r'}"], capture_output=True, text=True)
    assert p.returncode == 2
    assert "needs solver_backward=implicit or phantom" in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


def test_solver_model_trains_checkpoints_loads_and_evaluates(tmp_path):
    """Anderson with implicit gradients through the trainer (eager): a checkpoint that loads and evaluates, the
    solve's iterations in the training log."""
    import json

    from loopformer.model.io import load
    from loopformer.train.config import load_run_config
    from loopformer.train.trainer import compiles, train
    ov = ["task.name=pointer_chase", "task.options={symbols: 6, hops: 2}", "task.n_train=64", "task.n_test=16",
          "model.d_model=16", "model.n_heads=2", "model.loops=3", "model.input_injection=true",
          "model.solver=anderson", "model.solver_backward=implicit", "model.solver_max_iter=6",
          "train.steps=3", "train.batch_size=8", "train.log_every=1", "train.compile=false",
          "eval.max_loops=6", "log.tensorboard=false", "log.progress=false", f"out_dir={tmp_path / 'r'}"]
    cfg = load_run_config(None, ov)
    assert not compiles(load_run_config(None, [*ov, "train.compile=true"]), torch.device("cpu"), 10 ** 6)
    res = train(cfg)
    assert 0 <= res["test"]["accuracy"] <= 1
    logs = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    train_recs = [r for r in logs if r.get("split") == "train"]
    assert train_recs and all(1 <= r["solver_iters"] <= 6 and r["solver_backward_iters"] >= 1 for r in train_recs)
    m = load(tmp_path / "r")
    assert (m.config.solver, m.config.solver_backward) == ("anderson", "implicit")
    x = torch.randint(0, 6, (4, 5))
    with torch.no_grad():
        out = m.eval()(x)
    assert torch.isfinite(out.logits).all() and 1 <= out.solve.iters <= 6


def test_the_headline_of_a_solver_with_its_own_cap_is_its_answer_at_r():
    """A solver with solver_max_iter answers a call of r loops after that many iterations: the evaluation's metric
    at r is that answer (the metric without the loop-wise curve), not the r-th iterate of the curve."""
    from loopformer.eval.evaluate import evaluate
    from loopformer.sources import make_data
    from loopformer.train.config import load_run_config

    cfg = load_run_config(None, ["task.name=pointer_chase", "task.options={symbols: 6, hops: 2}", "task.n_train=16",
                                 "task.n_test=200", "model.d_model=16", "model.n_heads=2", "model.loops=2",
                                 "model.input_injection=true", "model.solver=anderson", "model.init_std=1.0",
                                 "model.solver_backward=implicit", "model.solver_tol=0", "model.solver_max_iter=9"])
    torch.manual_seed(0)
    m = LoopedTransformer(cfg.model).eval()
    data = make_data(cfg.task)
    res = evaluate(m, data, max_loops=12)
    plain = evaluate(m, data, loopwise=False)
    curve = [p["accuracy"] for p in res["loopwise"]]
    assert res["metrics"]["accuracy"] == plain["metrics"]["accuracy"] == curve[8]   # the 9th iterate: the answer
    assert curve[1] != curve[8]                                   # the 2nd iterate differs: the check can fail
