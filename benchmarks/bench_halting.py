"""Adaptive depth speed: per-row halting against fixed depth, and generation with per-token exits against without.

Per-row halting gathers the rows still running before every loop, so its wall time should fall with the loops
saved. Both paths run side by side in this run (interleaved repetitions, medians); printed per rule: mean loops,
loops saved, wall time of fixed depth and of halting, their ratio (the speed-up) next to the ideal ratio R / mean
loops. Generation: new tokens/s with a halting rule against fixed depth (the same model, cache on), with the mean
loops per token and the loops run per step (a step of a batch lasts as long as its slowest row), for one prompt and
for a batch; with `--compile` also the depth-wise schedule with its tick compiled (`SamplingConfig.compile`; its
first call, the compilation, is timed apart and not counted), and fixed depth through the same compiled tick (the
rule `gate:1`, which never holds: every token runs every loop; the fixed-depth tokens), so that exits are also
compared with a compiled fixed depth.

By default the models are random with an exit gate whose stop probability varies by row / token (the rule is the
gate's, `gate:0.5`); with `--checkpoint RUN` the per-row part uses a trained run's test split and `--halt` rules.

    python benchmarks/bench_halting.py                                   # random models, CPU-sized
    python benchmarks/bench_halting.py --compile                         # ... and the compiled tick
    python benchmarks/bench_halting.py --checkpoint runs/demo-r8 --halt kl:1e-3 --halt argmax:2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from loopformer.configio import from_dict  # noqa: E402
from loopformer.eval.halting import evaluate_halting  # noqa: E402
from loopformer.model import LoopedTransformer, ModelConfig  # noqa: E402
from loopformer.model.io import load, read_config, resolve_checkpoint  # noqa: E402
from loopformer.model.options import LoopOptions
from loopformer.sources import TaskConfig, make_data  # noqa: E402
from loopformer.text.generate import SamplingConfig, generate  # noqa: E402


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str) -> tuple[float, object]:
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t0, out


def random_model(args, causal: bool, max_len: int) -> LoopedTransformer:
    """A random TMLT with an exit gate that says "stop" with a probability varying by row / token."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=args.vocab, max_len=max_len, d_model=args.d_model, n_heads=args.heads,
                      loops=args.loops, causal=causal, timestep=True, input_injection=True, exit_gate=True)
    model = LoopedTransformer(cfg).to(args.device).eval()
    with torch.no_grad():
        for blk in model.blocks:
            torch.nn.init.normal_(blk.modulation.weight, 0, 0.02)
        torch.nn.init.normal_(model.exit_gate.proj.weight, 0, args.gate_scale / args.d_model ** 0.5)
        model.exit_gate.proj.bias.fill_(args.gate_bias)
    return model


def rows_random(args) -> list[tuple[str, float, float, float, float]]:
    """(rule, mean loops, fixed s, halting s, ideal) for a random bidirectional model on random rows."""
    model = random_model(args, causal=False, max_len=args.length)
    x = torch.randint(0, args.vocab, (args.batch, args.length), device=args.device)
    P = torch.zeros_like(x, dtype=torch.bool)
    P[:, -1] = True                                  # each row is judged at one (answer) position, as a task's
    with torch.no_grad():
        model(x), model(x, halt="gate:0.5", opts=LoopOptions(halt_positions=P))                        # warm-up
        fixed, halted = [], []
        for _ in range(args.reps):   # interleaved, so load changes affect both alike
            fixed.append(timed(lambda: model(x), args.device)[0])
            t, out = timed(lambda: model(x, halt="gate:0.5", opts=LoopOptions(halt_positions=P)), args.device)
            halted.append(t)
    mean = float(out.exit_loops.float().mean())
    return [("gate:0.5", mean, statistics.median(fixed), statistics.median(halted), args.loops / mean)]


def rows_checkpoint(args) -> list[tuple[str, float, float, float, float]]:
    """The same for a trained run's test split and the `--halt` rules (`loopformer.eval.halting`)."""
    path = resolve_checkpoint(args.checkpoint)
    _, extra = read_config(path)
    model = load(path, device=args.device)
    data = make_data(from_dict(TaskConfig, extra["run"]["task"]))
    reps = [evaluate_halting(model, data, args.halt, batch_size=args.batch, device=torch.device(args.device))
            for _ in range(args.reps)]
    R = reps[0]["loops"]
    fixed = statistics.median(r["fixed"]["wall_s"] for r in reps)
    out = []
    for i, rule in enumerate(reps[0]["rules"]):
        halted = statistics.median(r["rules"][i]["wall_s"] for r in reps)
        m = data.metric
        name = f"{rule['rule']} ({m} {rule['metrics'][m]:.4f} vs {reps[0]['fixed']['metrics'][m]:.4f})"
        out.append((name, rule["mean_loops"], fixed, halted, R / rule["mean_loops"]))
    return out


def generation(args, batch: int) -> dict:
    """Tokens/s of fixed depth and of per-token exits in both schedules (step: the batch advances token by token,
    a step lasting as long as its slowest row; depthwise: each row at its own loop), the mean loops per token and
    the loops run per step of the step schedule (the slowest row's), for a random causal model generating for
    `batch` prompts. Both schedules must give the same tokens (greedy)."""
    max_len = args.prompt_len + args.new_tokens
    model = random_model(args, causal=True, max_len=max_len)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, args.vocab, (args.prompt_len - 3 * i,), generator=g).tolist() for i in range(batch)]
    cfgs = {"fixed": SamplingConfig(max_new_tokens=args.new_tokens, temperature=0),
            "step": SamplingConfig(max_new_tokens=args.new_tokens, temperature=0, halt=args.rule, schedule="step"),
            "depthwise": SamplingConfig(max_new_tokens=args.new_tokens, temperature=0, halt=args.rule)}
    if args.compile and batch > 1:
        cfgs["compiled"] = SamplingConfig(max_new_tokens=args.new_tokens, temperature=0, halt=args.rule, compile=True)
        cfgs["compiled-fixed"] = SamplingConfig(max_new_tokens=args.new_tokens, temperature=0, halt="gate:1",
                                                compile=True)
    compile_s = None
    for k, c in cfgs.items():                                                      # warm-up (and compilation)
        s, _ = timed(lambda c=c: generate(model, prompts, c), args.device)
        compile_s = s if k == "compiled" else compile_s
    times: dict = {k: [] for k in cfgs}
    res = {}
    for _ in range(args.reps):   # interleaved, so load changes affect all alike
        for k, c in cfgs.items():
            t, res[k] = timed(lambda c=c: generate(model, prompts, c), args.device)
            times[k].append(t)
    assert res["step"].tokens == res["depthwise"].tokens, "the two schedules disagree"
    ops = {k: top_level_ops(lambda c=c: generate(model, prompts, c)) for k, c in cfgs.items()} if args.ops else {}
    assert "compiled" not in res or res["compiled"].tokens == res["depthwise"].tokens, "the compiled tick disagrees"
    assert "compiled" not in res or res["compiled-fixed"].tokens == res["fixed"].tokens, "gate:1 is not fixed depth"
    n = batch * args.new_tokens
    loops = res["step"].exit_loops.float()                                         # [B,N]
    return {**{k: n / statistics.median(v) for k, v in times.items()}, "mean": float(loops.mean()),
            "per_step": float(loops.max(0).values.mean()), "compile_s": compile_s, "ops": ops}


def top_level_ops(fn) -> int:
    """The aten operators `fn` dispatches from Python (not those they call in turn), counted by torch.profiler."""
    from torch.profiler import profile
    with profile() as p:
        fn()
    return sum(1 for e in p.events() if e.name.startswith("aten::")
               and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=None, help="a trained run (token task) for the per-row part")
    ap.add_argument("--halt", action="append", default=None, help="halting rules for --checkpoint (repeat)")
    ap.add_argument("--batch", type=int, default=256, help="rows per forward")
    ap.add_argument("--length", type=int, default=32, help="tokens per row (random model)")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--gate-bias", type=float, default=-0.5, help="random gate: its bias (lower: later exits)")
    ap.add_argument("--gate-scale", type=float, default=3.0, help="random gate: the spread of its logits")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-batch", type=int, default=4)
    ap.add_argument("--rule", default="gate:0.5", help="the halting rule of the generation part")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--compile", action="store_true", help="generation: also the compiled depth-wise tick")
    ap.add_argument("--ops", action="store_true",
                    help="generation: also count the operators dispatched per new token")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (one per process on a shared machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.checkpoint and not args.halt:
        args.halt = ["kl:1e-3"]

    print(f"device {args.device}, threads {torch.get_num_threads()}, {args.reps} interleaved repetitions (medians)")
    rows = rows_checkpoint(args) if args.checkpoint else rows_random(args)
    where = args.checkpoint or f"random TMLT d={args.d_model}, {args.batch} rows x {args.length} tokens"
    print(f"\nper-row halting vs fixed depth ({where}, at most {args.loops if not args.checkpoint else 'r'} loops)")
    print("| rule | mean loops | loops saved | fixed s | halting s | speed-up | ideal (R / mean loops) |")
    print("|---|---|---|---|---|---|---|")
    for name, mean, fixed, halted, ideal in rows:
        R = ideal * mean
        print(f"| {name} | {mean:.2f} | {100 * (1 - mean / R):.0f} % | {fixed:.4f} | {halted:.4f} | "
              f"{fixed / halted:.2f}x | {ideal:.2f}x |")
    print(f"\ngeneration with per-token exits (random causal TMLT d={args.d_model}, {args.loops} loops, "
          f"{args.new_tokens} new tokens, cache on, rule {args.rule}); the schedules give the same tokens")
    comp = " exits, depth-wise compiled (compilation s) | fixed, compiled tick | exits / fixed, both compiled |" \
        if args.compile else ""
    print("| prompts | fixed tok/s | exits, step by step | exits, depth-wise |" + comp + " mean loops / token | "
          "loops run per step (step by step) |")
    print("|---|---|---|---|" + ("---|---|---|" if args.compile else "") + "---|---|")
    for batch in sorted({1, args.gen_batch}):
        r = generation(args, batch)
        c = "" if not args.compile else " . | . | . |" if "compiled" not in r else \
            (f" {r['compiled']:.1f} ({r['compiled'] / r['fixed']:.2f}x; {r['compile_s']:.1f} s) | "
             f"{r['compiled-fixed']:.1f} ({r['compiled-fixed'] / r['fixed']:.2f}x) | "
             f"{r['compiled'] / r['compiled-fixed']:.2f}x |")
        print(f"| {batch} | {r['fixed']:.1f} | {r['step']:.1f} ({r['step'] / r['fixed']:.2f}x) | "
              f"{r['depthwise']:.1f} ({r['depthwise'] / r['fixed']:.2f}x) |{c} {r['mean']:.2f} | "
              f"{r['per_step']:.2f} |")
        if r["ops"]:
            print(f"  operators dispatched per new token ({batch} prompts): " + ", ".join(
                f"{k} {v / (batch * args.new_tokens):.0f}" for k, v in r["ops"].items()))


if __name__ == "__main__":
    main()
