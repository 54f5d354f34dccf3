"""Attention over short rows: the fused kernel (`scaled_dot_product_attention`) against matmul-softmax-matmul, the
path `loopformer.model.layers.Attention` takes under `torch.compile` for bidirectional rows of at most
`MATH_ATTENTION_MAX_T` tokens.

For each row length T (about B·T = 1,152 tokens per batch, as the CPU studies' 64 × 18), a forward and backward of
both, eager and compiled, side by side in one process (interleaved repetitions, medians); printed: µs per forward
and backward, the speed-up of the matmul path, and the largest difference of the outputs.

    python benchmarks/bench_attention.py --lengths 18 40 64 81 128 256
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[18, 40, 64, 81, 128, 256])
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=1152, help="B·T per batch")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-compile", action="store_true", help="eager only")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    H, Dh = args.heads, args.head_dim
    print(f"{H} heads x {Dh}, about {args.tokens} tokens per batch, {args.threads} thread(s), {args.reps} "
          "interleaved repetitions of forward + backward\n")
    print("| T | batch | mode | fused kernel (µs) | matmul (µs) | speed-up | max abs diff |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for T in args.lengths:
        B = max(1, args.tokens // T)
        torch.manual_seed(0)
        qkv = torch.randn(B, T, 3 * H * Dh, requires_grad=True)
        grad = torch.randn(B, T, H * Dh)

        def heads(z: torch.Tensor, B: int = B, T: int = T) -> tuple[torch.Tensor, ...]:
            return tuple(p.view(B, T, H, Dh).transpose(1, 2) for p in z.split(H * Dh, dim=-1))

        def fused(z: torch.Tensor, B: int = B, T: int = T) -> torch.Tensor:
            q, k, v = heads(z)
            return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, H * Dh)

        def matmul(z: torch.Tensor, B: int = B, T: int = T) -> torch.Tensor:
            q, k, v = heads(z)
            y = torch.softmax((q @ k.transpose(-1, -2)) * Dh ** -0.5, dim=-1) @ v
            return y.transpose(1, 2).reshape(B, T, H * Dh)

        with torch.no_grad():
            diff = float((fused(qkv) - matmul(qkv)).abs().max())
        for mode in ("eager",) + (() if args.no_compile else ("compiled",)):
            fs = {"fused": fused, "matmul": matmul}
            if mode == "compiled":
                fs = {k: torch.compile(f) for k, f in fs.items()}
            for f in fs.values():                                               # warm-up (compilation)
                for _ in range(3):
                    f(qkv).backward(grad)
            times: dict[str, list[float]] = {k: [] for k in fs}
            for _ in range(args.reps):
                for k, f in fs.items():
                    t0 = time.perf_counter()
                    f(qkv).backward(grad)
                    times[k].append(time.perf_counter() - t0)
            a, b = statistics.median(times["fused"]), statistics.median(times["matmul"])
            print(f"| {T} | {B} | {mode} | {a * 1e6:,.0f} | {b * 1e6:,.0f} | {a / b:.2f}x | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
