"""Reference runs: tiny training and evaluation runs whose every number must stay the same across a behaviour-
preserving change of the code (a restructuring). Each run is a `loopformer` command at a few steps, eager, one
thread; the record keeps every metric of results.json and of the evaluations (timings and paths dropped) and the
SHA-256 of the final weights.

    python scripts/reference_runs.py --out /tmp/ref-before.json            # on the code before the change
    python scripts/reference_runs.py --out /tmp/ref-after.json             # ... and after it
    python scripts/reference_runs.py --compare /tmp/ref-before.json /tmp/ref-after.json   # exit 1 on a difference

Runs: edit distance, in-context linear regression, the Sudoku recipe (deep supervision, weight average, voting,
the halting head), a Shakespeare language model (eval with per-token exits), an exit-gate model's halting
evaluation (rules and a sweep), an elastic (budget-aware) model's budgets, pointer chasing's TMLT through its loop
curriculum to r = 32 and the draws past it, the circuit's recipe (state noise, spike skipping, the best weights).
About 4 minutes on one core.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

LF = [sys.executable, "-m", "loopformer.cli"]
EAGER = ["train.system.compile=false", "threads=1", "log.tensorboard=false"]
DROP = ("time", "_s", "wall", "path", "dir", "speedup", "checkpoint", "device", "compiled", "memory")


def _clean(obj):
    """The record without timings, paths and the device: what must be identical across runs of one code."""
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items() if not any(d in k for d in DROP)}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    return obj


def _run(args: list[str], cwd: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    p = subprocess.run(LF + args, cwd=cwd, env=env, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"failed: loopformer {' '.join(args)}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")


def _weights(run: Path) -> str:
    files = sorted(run.rglob("model.safetensors"))
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()


def _train(name: str, config: str, overrides: list[str], tmp: Path, rec: dict) -> Path:
    out = tmp / name
    _run(["train", config, *EAGER, *overrides, f"out_dir={out}"], tmp)
    rec[name] = {"results": _clean(json.loads((out / "results.json").read_text())), "weights": _weights(out)}
    return out


def _eval(name: str, run: Path, flags: list[str], tmp: Path, rec: dict) -> None:
    js = tmp / f"{name}.json"
    _run(["eval", str(run), *flags, "--json", str(js), "--quiet"], tmp)
    rec[name] = _clean(json.loads(js.read_text()))


def reference(tmp: Path) -> dict:
    cfg = Path(__file__).resolve().parents[1] / "loopformer" / "configs" / "cpu"
    rec: dict = {}
    small = ["task.n_train=2000", "task.n_test=100"]
    _train("ed", str(cfg / "ed.yaml"), ["train.steps=40", *small, "model.loops=4", "model.timestep=true"], tmp, rec)
    _train("icl", str(cfg / "icl-linear.yaml"), ["train.steps=40", "task.n_train=2000", "task.n_test=100"], tmp, rec)
    sdk = _train("sudoku", str(cfg / "sudoku-recipe.yaml"),
                 ["train.steps=20", "task.n_train=500", "task.n_test=50", "eval.votes=2"], tmp, rec)
    _eval("sudoku-eval", sdk, ["--ema", "--votes", "2"], tmp, rec)
    _run(["text", "prepare", "plays", "--out", str(tmp / "text"), "--tokenizer", "bpe", "--vocab-size", "300"], tmp)
    lm = _train("lm", str(cfg / "shakespeare.yaml"),
                [f"task.data_dir={tmp / 'text'}", "train.steps=20", "model.loops=2", "model.exit_gate=true"],
                tmp, rec)
    _eval("lm-halt", lm, ["--halt", "entropy:2", "--halt", "gate:0.5", "-n", "8"], tmp, rec)
    gate = _train("gate", str(cfg / "demo.yaml"),
                  ["train.steps=40", *small, "model.loops=4", "model.exit_gate=true"], tmp, rec)
    _eval("gate-halt", gate, ["--halt", "kl:1e-2", "--halt", "gate:0.5", "--halt-sweep", "kl,argmax"], tmp, rec)
    el = _train("elastic", str(cfg / "demo.yaml"),
                ["train.steps=40", *small, "model.loops=4", "model.timestep=true", "model.timestep_time=normalized",
                 "train.loops.sample=uniform", "train.loops.min=2", "train.loops.max=8", "eval.budgets=[1,2,4,8]"],
                tmp, rec)
    _eval("elastic-budgets", el, ["--budgets", "1,2,4,8", "--halt", "kl:1e-2"], tmp, rec)
    _train("pointer", str(cfg / "pointer.yaml"),            # the loop curriculum to r = 32, then draws r..4r
           ["train.steps=100", *small, "model.loops=32", "model.timestep=true", "train.loops.every=8",
            "eval.max_loops=64"], tmp, rec)
    _train("circuit", str(cfg / "schedule.yaml"),           # state noise, spike skipping, the best weights kept
           ["train.steps=60", *small, "task.n_val=50", "train.eval_every=20", "model.loops=8",
            "task.options.layers=8", "model.timestep=true"], tmp, rec)
    return rec


def _diff(a, b, path="") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}/{k}: only in one" for k in sorted(set(a) ^ set(b))]
        for k in sorted(set(a) & set(b)):
            out += _diff(a[k], b[k], f"{path}/{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {str(a)[:80]} != {str(b)[:80]}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the record here (JSON)")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two records")
    a = ap.parse_args()
    if a.compare:
        diffs = _diff(*(_clean(json.loads(Path(p).read_text())) for p in a.compare))
        print("\n".join(diffs) if diffs else "identical")
        sys.exit(1 if diffs else 0)
    if not a.out:
        ap.error("give --out or --compare")
    with tempfile.TemporaryDirectory() as tmp:
        rec = reference(Path(tmp))
    Path(a.out).write_text(json.dumps(rec, indent=1, sort_keys=True))
    print(f"{len(rec)} records -> {a.out}")


if __name__ == "__main__":
    main()
