"""Per-process memory, step time and collectives of data-parallel training: DDP against FSDP (`train.system.parallel`)
at world sizes 1 and 2, on CPU with gloo (or on GPUs with NCCL where there are some), in one run.

Every case is a `torchrun` launch of this script's worker, which builds the real `Trainer` of the config (data,
model, optimiser, losses, the DDP or FSDP wrapping), trains `--warmup` steps and then `--steps` timed steps, and
reports per process: the bytes of the parameters it holds (an FSDP process: its shards), of their gradients (the
same shapes), of the AdamW state, its peak resident memory (and the CUDA allocator's peak on a GPU), the step time
(median) and the collectives of a step (FSDP's all-gathers and reduce-scatters counted; DDP's bucketed all-reduce
runs inside its C++ reducer and is not counted). The case `fsdp-default` shards with FSDP's defaults — parameters
resharded after every call of the shared block and after its backward — to show what the loop-aware policy saves.

    python benchmarks/bench_distributed.py                       # the language-model config on the plays, CPU
    python benchmarks/bench_distributed.py --config configs/cpu/lcs.yaml --steps 10 model.loops=8

The language-model corpus is prepared once into a temporary folder (`--data DIR` reuses one). Cases run one at a
time; each process has one thread (`--threads`). The CPU numbers are for memory and collectives; step times on one
machine's cores say little about a cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = {"ddp": ("ddp", True), "fsdp": ("fsdp", True), "fsdp-default": ("fsdp", False)}


# ------------------------------------------------------------------------------------------------- worker
def _count_collectives(counts: dict[str, int]) -> None:
    """Count FSDP's collectives (torch.distributed.all_gather_single / reduce_scatter_single) into `counts`."""
    import torch.distributed as dist
    for name in ("all_gather_single", "reduce_scatter_single"):
        fn = getattr(dist, name, None)
        if fn is None:
            continue

        def counted(*a, _fn=fn, _name=name, **k):
            counts[_name] = counts.get(_name, 0) + 1
            return _fn(*a, **k)
        setattr(dist, name, counted)


def worker(args: argparse.Namespace) -> None:
    import torch

    from loopformer.train import sharding
    from loopformer.train.config import load_run_config
    from loopformer.train.distributed import setup, teardown
    from loopformer.train.trainer import Trainer, peak_memory_mb

    parallel, keep = CASES[args.case]
    if not keep:                                   # FSDP's defaults: reshard after every call and backward
        original = sharding.shard_model

        def default_policy(model, device, precision):
            from torch.distributed.fsdp import fully_shard
            for blk in model.blocks:
                fully_shard(blk)
            fully_shard(model)
        sharding.shard_model = default_policy
        import loopformer.train.trainer as trainer_module
        trainer_module.shard_model = default_policy
        del original
    overrides = [*args.overrides, f"train.system.parallel={parallel}", f"out_dir={args.out}", "log.progress=false",
                 "log.tensorboard=false", "log.dynamics=false", "train.system.compile=false", f"threads={args.threads}",
                 "train.eval_every=0", f"train.steps={args.warmup + args.steps + 1}"]
    cfg = load_run_config(args.config, overrides)
    counts: dict[str, int] = {}
    _count_collectives(counts)
    d = setup(cfg.device, sharded=parallel == "fsdp")
    t = Trainer(cfg, d, resume=False, overwrite=True)
    t.open_log(False)
    t.wrap()
    for s in range(args.warmup):
        t.step(s)
    counts.clear()
    times = []
    for s in range(args.warmup, args.warmup + args.steps):
        if d.device.type == "cuda":
            torch.cuda.synchronize(d.device)
        t0 = time.perf_counter()
        t.step(s)
        if d.device.type == "cuda":
            torch.cuda.synchronize(d.device)
        times.append(time.perf_counter() - t0)
    local = sharding.local
    params = sum(local(p).numel() * local(p).element_size() for p in t.model.parameters())
    optim = sum(local(v).numel() * local(v).element_size() for st in t.optimizer.state.values()
                for v in st.values() if torch.is_tensor(v))
    rec = {"case": args.case, "world": d.world, "rank": d.rank, "params_mb": params / 2**20,
           "grads_mb": params / 2**20, "optim_mb": optim / 2**20, "step_ms": 1e3 * statistics.median(times),
           "all_gathers": counts.get("all_gather_single", 0) / args.steps,
           "reduce_scatters": counts.get("reduce_scatter_single", 0) / args.steps,
           "peak": peak_memory_mb(d.device), "n_params": t.model.num_params(), "loops": cfg.model.loops,
           "blocks": cfg.model.n_layers}
    with open(args.report, "a") as f:
        f.write(json.dumps(rec) + "\n")
    teardown()


# ------------------------------------------------------------------------------------------------- driver
def prepare_plays(folder: Path, vocab: int) -> Path:
    """The plays as a BPE corpus in `folder` (once)."""
    from loopformer.text.corpus import PrepareOptions, prepare_corpus
    prepare_corpus("plays", folder, PrepareOptions(tokenizer="bpe", vocab_size=vocab), progress=False,
                   log=lambda _: None)
    return folder


def launch(case: str, world: int, args: argparse.Namespace, overrides: list[str], report: Path, tmp: Path) -> None:
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--standalone", f"--nproc_per_node={world}", __file__, "--worker", "--case", case,
           "--config", args.config, "--out", str(tmp / f"{case}-{world}"), "--report", str(report),
           "--warmup", str(args.warmup), "--steps", str(args.steps), "--threads", str(args.threads), *overrides]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{case} at world size {world} failed:\n{proc.stderr[-3000:]}")


def table(recs: list[dict]) -> str:
    rows = ["| case | processes | parameters held (MiB) | gradients (MiB) | AdamW state (MiB) | params + AdamW vs "
            "1 process | peak resident (MiB) | step (ms) | all-gathers / step | reduce-scatters / step |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = {}
    for r in recs:
        if r["world"] == 1:
            base[r["case"]] = r["params_mb"] + r["optim_mb"]
    for r in recs:
        held = r["params_mb"] + r["optim_mb"]
        ratio = held / base[r["case"]] if r["case"] in base else float("nan")
        peak = r["peak"].get("cuda", r["peak"].get("host", float("nan")))
        rows.append(f"| {r['case']} | {r['world']} | {r['params_mb']:.3f} | {r['grads_mb']:.3f} | {r['optim_mb']:.3f} "
                    f"| {ratio:.3f} | {peak:.0f} | {r['step_ms']:.1f} | {r['all_gathers']:.1f} | "
                    f"{r['reduce_scatters']:.1f} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="run config overrides (key=value)")
    ap.add_argument("--config", default=str(ROOT / "configs/cpu/shakespeare.yaml"))
    ap.add_argument("--data", help="a prepared corpus for the language-model config (default: the plays, prepared "
                                   "into a temporary folder)")
    ap.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary of the prepared plays")
    ap.add_argument("--cases", default="ddp,fsdp,fsdp-default")
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--report", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        overrides = list(args.overrides)
        if "shakespeare" in Path(args.config).name:
            data = Path(args.data) if args.data else prepare_plays(tmp / "plays", args.vocab)
            overrides.append(f"task.data_dir={data}")
        report = tmp / "report.jsonl"
        for case in args.cases.split(","):
            for world in (int(w) for w in args.worlds.split(",")):
                launch(case, world, args, overrides, report, tmp)
        recs = [json.loads(line) for line in report.read_text().splitlines()]
    recs = [r for r in recs if r["rank"] == 0]
    first = recs[0]
    print(f"{args.config} {' '.join(args.overrides)}: {first['n_params']:,} parameters, {first['loops']} loops of "
          f"{first['blocks']} layer(s); per process (rank 0), {args.steps} timed steps after {args.warmup}")
    print(table(recs))


if __name__ == "__main__":
    main()
