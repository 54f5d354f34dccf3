"""The last loop at the read positions only: a training forward and backward of a looped model whose loss reads a
few positions (edit distance: the 2 answer tokens of 18), with the last loop computed everywhere against computed
at those positions only (`LoopOptions(read_only=True)`), side by side in one process (interleaved
repetitions, medians), for several loop counts. Printed: ms per forward+backward of each, their ratio, and the
largest difference of the read-outs.

    python benchmarks/bench_last_loop.py --loops 4 8 16 --reps 15
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from loopformer.model import LoopedTransformer  # noqa: E402
from loopformer.model.config import ModelConfig  # noqa: E402
from loopformer.model.options import LoopOptions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loops", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--length", type=int, default=18, help="tokens per row; the last 2 are read")
    ap.add_argument("--timestep", action="store_true", help="a TMLT")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    B, T = args.batch, args.length
    at = (torch.arange(B) * T + T - 2).repeat_interleave(2) + torch.tensor([0, 1] * B)   # 2 answer tokens per row
    print(f"d = {args.d_model}, batch {B} x {T} tokens, {at.numel()} read positions, every loop's read-out in the "
          f"loss, {'TMLT' if args.timestep else 'looped'}, {args.threads} thread(s), {args.reps} interleaved "
          "repetitions\n")
    print("| loops | last loop everywhere (ms) | at the read positions (ms) | speed-up | max abs diff of read-outs |")
    print("|---:|---:|---:|---:|---:|")
    for R in args.loops:
        torch.manual_seed(0)
        cfg = ModelConfig(vocab_size=8, n_out=8, d_model=args.d_model, n_heads=args.heads, loops=R, max_len=T,
                          causal=False, input_injection=True, timestep=args.timestep)
        model = LoopedTransformer(cfg)
        x = torch.randint(0, 8, (B, T))

        def step(read_only: bool, model: LoopedTransformer = model, x: torch.Tensor = x) -> torch.Tensor:
            model.zero_grad(set_to_none=True)
            out = model(x, return_all=True, opts=LoopOptions(read_at=at, read_only=read_only))
            out.all_logits.square().mean().backward()
            return out.all_logits.detach()

        diff = float((step(False) - step(True)).abs().max())                  # also the warm-up
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.reps):
            for ro in (False, True):
                t0 = time.perf_counter()
                step(ro)
                times[ro].append(time.perf_counter() - t0)
        full, part = statistics.median(times[False]), statistics.median(times[True])
        print(f"| {R} | {full * 1e3:.1f} | {part * 1e3:.1f} | {full / part:.2f}x | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
