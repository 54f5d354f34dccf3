"""Training-step speed: loopformer vs a plain re-statement of the published looped-GPT forward, same weights.

Both sides run the same math (`compat="authors"` reproduces their forwards exactly). Printed per case: tokens/s of a
full training step (forward, backward, AdamW), the ratio ours / theirs measured side by side in this run
(interleaved repetitions, median), the share of this machine's measured matmul peak (FLOPs counted by
`torch.utils.flop_counter`), and the number of aten operations one step dispatches (each one at least a kernel
launch on a GPU, where small looped models are launch-bound).

    python benchmarks/bench_train.py [--compile] [--device cuda] [--dtype bfloat16] [--reps 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from loopformer.model.convert import from_authors
from loopformer.model.reference import authors_forward, random_authors_state_dict


class AuthorsModule(nn.Module):
    """Their parameters as a module, running `authors_forward` (tied lm_head, as in their code)."""

    def __init__(self, sd: dict, model_type: str, n_loop: int, n_head: int):
        super().__init__()
        self.keys = [k for k in sd if k != "lm_head.weight"]
        self.params = nn.ParameterList(nn.Parameter(sd[k].clone()) for k in self.keys)
        self.model_type, self.n_loop, self.n_head = model_type, n_loop, n_head

    def forward(self, idx):
        sd = dict(zip(self.keys, self.params))
        sd["lm_head.weight"] = sd["transformer.wte.weight"]
        return authors_forward(sd, idx, self.model_type, self.n_loop, self.n_head)


def matmul_peak(device: str, dtype: torch.dtype, n: int = 1024, reps: int = 10) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    best = float("inf")
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def make_step(fwd, params, idx, targets, device, dtype):
    opt = torch.optim.AdamW(params, lr=1e-4)

    def step():
        with torch.autocast(device_type=device, dtype=dtype, enabled=dtype != torch.float32):
            logits = fwd(idx)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
    return step


def count_flops(fwd, idx, targets) -> int:
    with FlopCounterMode(display=False) as fc:
        loss = nn.functional.cross_entropy(fwd(idx).flatten(0, 1), targets.flatten())
        loss.backward()
    return fc.get_total_flops()


class _OpCounter(TorchDispatchMode):
    """Counts the aten operations a step dispatches (on a GPU each is at least one kernel launch)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def count_ops(fwd, idx, targets) -> int:
    with _OpCounter() as oc:
        loss = nn.functional.cross_entropy(fwd(idx).flatten(0, 1), targets.flatten())
        loss.backward()
    return oc.n


def run_case(name, model_type, vocab, d, heads, loops, batch, length, args) -> dict:
    dev, dtype = args.device, getattr(torch, args.dtype)
    sd = random_authors_state_dict(model_type, vocab, length, d, seed=0)
    ckpt = {"model": sd, "model_args": dict(n_loop=loops, n_layer=1, n_head=heads, n_embd=d, block_size=length,
                                            bias=False, vocab_size=vocab, dropout=0.0),
            "config": {"model_type": model_type}}
    ours, _ = from_authors(ckpt)
    ours = ours.to(dev).train()
    theirs = AuthorsModule(sd, model_type, loops, heads).to(dev).train()
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, vocab, (batch, length), generator=g).to(dev)
    targets = torch.randint(0, vocab, (batch, length), generator=g).to(dev)
    with torch.no_grad():  # same math before timing
        diff = (ours(idx).logits - theirs(idx)).abs().max().item()
    flops = count_flops(lambda x: ours(x).logits, idx, targets)
    ops = (count_ops(lambda x: ours(x).logits, idx, targets), count_ops(theirs, idx, targets))
    ours_fwd = (lambda x: ours(x).logits)
    if args.compile:
        compiled = torch.compile(ours)
        ours_fwd = (lambda x: compiled(x).logits)
    steps = {"ours": make_step(ours_fwd, ours.parameters(), idx, targets, dev, dtype),
             "theirs": make_step(theirs, theirs.parameters(), idx, targets, dev, dtype)}
    for s in steps.values():  # warm-up (and compilation)
        s()
        s()
    times = {k: [] for k in steps}
    for _ in range(args.reps):
        for k, s in steps.items():
            t0 = time.perf_counter()
            s()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"case": name, "tokens": batch * length, "flops": flops, "diff": diff, "ops": ops, **med}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--compile", action="store_true", help="torch.compile our model (theirs stays eager)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--scale", choices=["cpu", "paper"], default="cpu")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.scale == "cpu":
        cases = [("reasoning TMLT d=256 r=8", "tmlt", 64, 256, 4, 8, 16, 64),
                 ("reasoning LT d=256 r=8", "lt", 64, 256, 4, 8, 16, 64),
                 ("small TMLT d=128 r=16", "tmlt", 64, 128, 4, 16, 32, 32),
                 ("LM TMLT d=384 r=6", "tmlt", 4096, 384, 6, 6, 4, 128)]
    else:
        cases = [("reasoning TMLT d=256 r=32", "tmlt", 64, 256, 4, 32, 64, 128),
                 ("LM TMLT d=768 r=24", "tmlt", 50304, 768, 12, 24, 8, 1024),
                 ("LM LT d=768 r=24", "lt", 50304, 768, 12, 24, 8, 1024)]
    peak = matmul_peak(args.device, getattr(torch, args.dtype))
    print(f"device {args.device}, {args.dtype}, threads {torch.get_num_threads()}, compile={args.compile}, "
          f"measured matmul peak {peak / 1e9:.1f} GFLOP/s\n")
    print("| case | max abs logit diff | ours tok/s | theirs tok/s | speed-up (ours/theirs) | ours % of peak "
          "| aten ops per step (ours / theirs) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for case in cases:
        r = run_case(*case, args)
        ours_tps, theirs_tps = r["tokens"] / r["ours"], r["tokens"] / r["theirs"]
        util = r["flops"] / r["ours"] / peak * 100
        print(f"| {r['case']} | {r['diff']:.1e} | {ours_tps:,.0f} | {theirs_tps:,.0f} | "
              f"{r['theirs'] / r['ours']:.2f}x | {util:.0f}% | {r['ops'][0]} / {r['ops'][1]} |", flush=True)


if __name__ == "__main__":
    main()
