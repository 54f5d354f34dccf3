"""Training memory and step time of the fixed-point mode against full backpropagation through the unrolled loop.

One training step (forward, cross-entropy on random targets at every position, backward) of a looped model with
input injection, at several iteration counts, for: the unrolled loop with backpropagation through every loop
(`model.solver=unroll`), and a solver (`--solver`, Anderson by default) with the implicit gradient and with the
phantom gradient of `--phantom` steps. The solvers run with `solver_tol=0`, so every case applies the block exactly
the stated number of times in its forward (the implicit backward's adjoint solve likewise).

Memory is what the autograd graph holds: the bytes of the distinct tensors saved for the backward (through
`torch.autograd.graph.saved_tensors_hooks`; parameters and tensors saved twice counted once), which is the
activation memory the iterations add. Time: the median over `--reps` rounds, the cases interleaved within each
round so all share the machine's state alike. Ratios are to the unrolled loop at the same iteration count.

    python benchmarks/bench_fixedpoint.py                       # d_model 64, length 30, batch 64, 16/32/64 iterations
    python benchmarks/bench_fixedpoint.py --solver broyden --phantom 2 --iters 8,64
    python benchmarks/bench_fixedpoint.py --phantom 5:0.5 --state-norm   # the formulation that trains (the state
                                                                          # normalised, studies/transfer)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from loopformer.model import LoopedTransformer, ModelConfig  # noqa: E402


def model_for(args, solver: str, backward: str) -> LoopedTransformer:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=args.vocab, max_len=args.len, d_model=args.d_model, n_heads=args.heads,
                      loops=max(args.iters), input_injection=True, solver=solver, solver_backward=backward,
                      solver_tol=0.0, extensions={"state_norm": {}} if args.state_norm else {})
    return LoopedTransformer(cfg).train()


def step(model: LoopedTransformer, x: torch.Tensor, y: torch.Tensor, iters: int) -> tuple[float, int, float]:
    """One training step: (seconds, bytes of the distinct saved activations, adjoint / phantom iterations)."""
    seen: dict[tuple[int, int], int] = {}
    params = {p.data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in params:
            seen[(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())] = t.untyped_storage().nbytes()
        return t

    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    with saved_tensors_hooks(pack, lambda t: t):
        out = model(x, loops=iters)
        loss = F.cross_entropy(out.logits.flatten(0, 1), y.flatten())
    loss.backward()
    dt = time.perf_counter() - t0
    back = out.solve.backward_iters if out.solve is not None else iters
    return dt, sum(seen.values()), back


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--len", type=int, default=30, help="sequence length T")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--vocab", type=int, default=16)
    p.add_argument("--iters", default="16,32,64", help="iteration (loop) counts, comma-separated")
    p.add_argument("--solver", default="anderson", choices=["anderson", "broyden"])
    p.add_argument("--phantom", default="4", help="the phantom gradient's k, or k:λ (damping λ)")
    p.add_argument("--state-norm", action="store_true", help="the state normalised after every loop (lab extension)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    args.iters = [int(v) for v in args.iters.split(",")]
    torch.set_num_threads(args.threads)

    cases = {"unroll, bptt": ("unroll", "bptt"), f"{args.solver}, implicit": (args.solver, "implicit"),
             f"{args.solver}, phantom:{args.phantom}": (args.solver, f"phantom:{args.phantom}")}
    models = {name: model_for(args, *c) for name, c in cases.items()}
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, args.vocab, (args.batch, args.len), generator=g)
    y = torch.randint(0, args.vocab, (args.batch, args.len), generator=g)
    for m in models.values():                                        # warm-up
        step(m, x, y, min(args.iters))
    times: dict[tuple[str, int], list[float]] = {k: [] for k in ((n, r) for n in cases for r in args.iters)}
    mem: dict[tuple[str, int], int] = {}
    back: dict[tuple[str, int], float] = {}
    for _ in range(args.reps):
        for r in args.iters:
            for name, m in models.items():
                dt, b, k = step(m, x, y, r)
                times[(name, r)].append(dt)
                mem[(name, r)], back[(name, r)] = b, k

    print(f"one training step: d_model {args.d_model}, {args.heads} heads, T = {args.len}, batch {args.batch}, "
          f"{args.threads} thread(s), median of {args.reps}{', the state normalised' if args.state_norm else ''}; "
          "memory = distinct saved activations of the graph\n")
    print("| mode | iterations | backward iterations | saved activations (MiB) | × unroll | step (ms) | × unroll |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in args.iters:
        base_m, base_t = mem[("unroll, bptt", r)], statistics.median(times[("unroll, bptt", r)])
        for name in cases:
            t = statistics.median(times[(name, r)])
            print(f"| {name} | {r} | {back[(name, r)]} | {mem[(name, r)] / 2 ** 20:.2f} | "
                  f"{mem[(name, r)] / base_m:.3f} | {1e3 * t:.0f} | {t / base_t:.2f} |")


if __name__ == "__main__":
    main()
