"""The training step of a run config, side by side: this checkout against a given commit, and/or variants of the
config (e.g. the TMLT, compilation, bf16), each in its own process, measured in one run.

Every (source, case) pair is a worker process that builds the real `Trainer` of the config (data, model, optimiser,
losses) and waits; the workers then take turns — one runs `--chunk` steps while the others sleep — for `--reps`
rounds, so all share the machine's state alike. Printed per case: the steady-state step time (median over every
timed step), its ratio to the first source's and to the first case's, the first steps' time (compilation included;
with `--cold` from an empty compiler cache) and the largest relative difference of the first steps' losses from the
first source's (the same math gives float-level differences).

    python benchmarks/bench_step.py configs/cpu/ed.yaml model.loops=16 --against HEAD~3 \
        --case looped= --case tmlt=model.timestep=true --reps 5
    python benchmarks/bench_step.py configs/cpu/pointer.yaml model.loops=64 train.loops.start=0 \
        train.system.compile=true --case step=train.system.compile_scope=step \
        --case block=train.system.compile_scope=block --cold --warmup 2

A source is this checkout (`.`) or a commit (extracted with `git archive` into a temporary folder). Workers run
with one thread each (`--threads`), one at a time. With `--device cuda` each timed step ends with a synchronisation;
`benchmarks/gpu.sh` is the GPU set (compilation, CUDA graphs of the step, bf16).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------- worker
def worker(config: str, overrides: list[str], threads: int, warmup: int, device: str) -> None:
    """Build the config's trainer, run `warmup` steps (reporting their losses and time), then run steps on
    request: a line "N" on stdin → N steps, their times as one JSON line on stdout."""
    import torch

    from loopformer.train.config import load_run_config
    from loopformer.train.distributed import setup
    from loopformer.train.trainer import Trainer

    torch.set_num_threads(threads)
    out = tempfile.mkdtemp(prefix="bench-step-")
    try:
        cfg = load_run_config(config, [*overrides, f"out_dir={out}/run", f"threads={threads}", f"device={device}"])
        t = Trainer(cfg, setup(device), resume=False)
        t.open_log(False)
        t.wrap()
        sync = torch.cuda.synchronize if t.d.device.type == "cuda" else (lambda: None)
        step, losses, t0 = 0, [], time.perf_counter()
        for _ in range(warmup):
            before = float(t.acc_loss)
            t.step(step)
            losses.append(float(t.acc_loss) - before)                        # (a host sync on a GPU)
            step += 1
        print(json.dumps({"warmup_s": time.perf_counter() - t0, "losses": losses,
                          "params": sum(p.numel() for p in t.model.parameters())}), flush=True)
        for line in sys.stdin:
            n, times = int(line), []
            for _ in range(n):
                sync()
                s0 = time.perf_counter()
                t.step(step)
                sync()
                times.append(time.perf_counter() - s0)
                step = (step + 1) % t.total
            print(json.dumps(times), flush=True)
    finally:
        shutil.rmtree(out, ignore_errors=True)


# ------------------------------------------------------------------------------------------------- coordinator
def source_dir(src: str, tmp: Path) -> Path:
    if src == ".":
        return ROOT
    dest = tmp / src.replace("/", "_")
    dest.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", src], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def start(src: Path, config: str, overrides: list[str], args, cache: str | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": str(args.threads)}
    if cache:                                   # an empty compiler cache of its own: a cold compilation
        env.update(TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=cache)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", config, *overrides,
           "--threads", str(args.threads), "--warmup", str(args.warmup), "--device", args.device]
    return subprocess.Popen(cmd, cwd=src, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", help="run config (path inside each source), then key=value overrides for all cases")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--against", action="append", default=[], metavar="COMMIT",
                    help="also measure this commit (first source: the first --against, else this checkout)")
    ap.add_argument("--no-current", action="store_true", help="leave this checkout out")
    ap.add_argument("--case", action="append", default=[], metavar="NAME=OVERRIDES",
                    help="a variant: NAME=key=value[,key=value...] (default: one case, the config as given)")
    ap.add_argument("--reps", type=int, default=5, help="rounds of turns")
    ap.add_argument("--chunk", type=int, default=10, help="steps per turn")
    ap.add_argument("--warmup", type=int, default=5, help="steps before timing (compilation happens here)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cold", action="store_true",
                    help="every worker compiles with an empty compiler cache of its own (the first steps' time is "
                         "then a cold compilation, as on a fresh machine)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N (the run config's device choices)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.config, args.overrides, args.threads, args.warmup, args.device)

    cases = [c.split("=", 1) for c in args.case] or [["config", ""]]
    sources = [*args.against, *([] if args.no_current else ["."])]
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {s: source_dir(s, Path(tmp)) for s in sources}
        workers, info = {}, {}
        for name, ov in cases:
            extra = [o for o in ov.split(",") if o]
            for s in sources:
                cache = tempfile.mkdtemp(prefix="inductor-", dir=tmp) if args.cold else None
                w = start(dirs[s], args.config, args.overrides + extra, args, cache)
                info[name, s] = json.loads(w.stdout.readline())   # built and warmed up, one at a time
                workers[name, s] = w
        times: dict = {k: [] for k in workers}
        for _ in range(args.reps):
            for k, w in workers.items():
                w.stdin.write(f"{args.chunk}\n")
                w.stdin.flush()
                times[k] += json.loads(w.stdout.readline())
        for w in workers.values():
            w.stdin.close()
            w.wait()

    print(f"{args.config} {' '.join(args.overrides)}: {args.reps} rounds x {args.chunk} steps on {args.device}, "
          f"{args.threads} thread(s); speed-up = the first source's step time / this one's, per case\n")
    print("| case | source | params | ms/step (median) | [p10-p90] | speed-up | vs first case | first "
          f"{args.warmup} steps (s) | max rel. loss diff |")
    print("|---|---|---:|---:|---|---:|---:|---:|---:|")
    first_case = {s: statistics.median(times[cases[0][0], s]) for s in sources}
    for name, _ in cases:
        base = statistics.median(times[name, sources[0]])
        ref = info[name, sources[0]]["losses"]
        for s in sources:
            ts = sorted(times[name, s])
            med = statistics.median(ts)
            p10, p90 = ts[len(ts) // 10], ts[(9 * len(ts)) // 10]
            diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(info[name, s]["losses"], ref))
            print(f"| {name} | {s} | {info[name, s]['params']:,} | {med * 1e3:.1f} | {p10 * 1e3:.1f}-{p90 * 1e3:.1f} "
                  f"| {base / med:.2f}x | {first_case[s] / med:.2f}x | {info[name, s]['warmup_s']:.1f} | {diff:.1e} |",
                  flush=True)


if __name__ == "__main__":
    main()
