"""Generation speed: the per-loop key/value cache against recomputing the whole sequence for every new token.

For each model (standard, looped, TMLT at the same width) both paths generate the same greedy continuation of a
batch of prompts; printed per case: new tokens/s with the cache, without it, their ratio (medians of repetitions
interleaved over models and paths, measured in this run), and whether the two produced the same tokens; then the
TMLT's cached decoding speed against the looped model's (the median of the per-repetition ratios).

    python benchmarks/bench_generate.py                       # CPU-sized models, 256 new tokens
    python benchmarks/bench_generate.py --device cuda --d-model 768 --heads 12 --loops 24 --batch 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from loopformer.model import LoopedTransformer, ModelConfig  # noqa: E402
from loopformer.text.generate import SamplingConfig, generate  # noqa: E402


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_generation(model, prompts, cfg, use_cache: bool, device: str) -> tuple[float, list[list[int]]]:
    _sync(device)
    t0 = time.perf_counter()
    res = generate(model, prompts, cfg, use_cache=use_cache)
    _sync(device)
    return time.perf_counter() - t0, res.tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--loops", type=int, default=8, help="loops of the looped / TMLT models")
    ap.add_argument("--layers", type=int, default=6, help="layers of the standard model")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (one per process on a shared machine)")
    ap.add_argument("--no-recompute", action="store_true", help="time the cached path only")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    dtype = getattr(torch, args.dtype)
    max_len = args.prompt_len + args.new_tokens
    base = dict(vocab_size=args.vocab, max_len=max_len, d_model=args.d_model, n_heads=args.heads)
    cases = [
        (f"standard ({args.layers} layers)", dict(n_layers=args.layers, loops=1)),
        (f"looped (1 layer x {args.loops})", dict(n_layers=1, loops=args.loops)),
        (f"TMLT (1 layer x {args.loops})", dict(n_layers=1, loops=args.loops, timestep=True)),
    ]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, args.vocab, (args.prompt_len - 3 * i,), generator=g).tolist()
               for i in range(args.batch)]                                   # different lengths: left padding
    cfg = SamplingConfig(max_new_tokens=args.new_tokens, temperature=0)
    print(f"device {args.device}, {args.dtype}, batch {args.batch}, prompts {args.prompt_len - 3 * (args.batch - 1)}"
          f"-{args.prompt_len} tokens, {args.new_tokens} new tokens, threads {torch.get_num_threads()}")
    print("| model | params | cache tok/s | recompute tok/s | speed-up | same tokens |")
    print("|---|---|---|---|---|---|")
    models = {}
    for name, kw in cases:
        torch.manual_seed(0)
        model = LoopedTransformer(ModelConfig(**base, **kw)).to(args.device, dtype).eval()
        if kw.get("timestep"):  # leave the identity initialisation so the modulation does work
            for blk in model.blocks:
                torch.nn.init.normal_(blk.modulation.weight, 0, 0.02)
        warm = SamplingConfig(max_new_tokens=4, temperature=0)
        generate(model, prompts, warm), generate(model, prompts, warm, use_cache=False)
        models[name] = model
    cached = {name: [] for name in models}
    full = {name: [] for name in models}
    toks = {}
    for _ in range(args.reps):  # interleaved over models and paths, so load changes affect all alike
        for name, model in models.items():
            t, toks_c = time_generation(model, prompts, cfg, True, args.device)
            cached[name].append(t)
            if not args.no_recompute:
                t, toks_f = time_generation(model, prompts, cfg, False, args.device)
                full[name].append(t)
                toks[name] = (toks_c, toks_f)
    n_new = args.batch * args.new_tokens
    for name, model in models.items():
        tc = statistics.median(cached[name])
        if args.no_recompute:
            print(f"| {name} | {model.num_params() / 1e6:.2f}M | {n_new / tc:,.0f} | - | - | - |")
            continue
        tf = statistics.median(full[name])
        same = sum(a == b for a, b in zip(*toks[name]))
        print(f"| {name} | {model.num_params() / 1e6:.2f}M | {n_new / tc:,.0f} | {n_new / tf:,.0f} | "
              f"{tf / tc:.1f}x | {same}/{args.batch} rows |")
    looped, tmlt = (cases[1][0], cases[2][0])
    per_rep = [a / b for a, b in zip(cached[looped], cached[tmlt])]
    print(f"\nTMLT / looped cached tokens/s: {statistics.median(per_rep):.2f}x (median of the {args.reps} "
          f"repetitions' ratios, range {min(per_rep):.2f}-{max(per_rep):.2f})")

if __name__ == "__main__":
    main()
