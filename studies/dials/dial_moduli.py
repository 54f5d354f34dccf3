"""The trained models' own moduli beside their errors: what the dials study's label-sequence models learned to do
from one loop to the next.

    python studies/dials/dial_moduli.py sweeps/dials studies/dials [--seeds 0,1,2] [--delta 0.1]

For every finished run of the labels family (SWEEPS/labels/<setting>-r<r>/<arm>/runs/<run>, seeds in --seeds) it
loads the checkpoint, rebuilds the run's test split and runs the r loops once, keeping every loop's read-out and
residual stream. Measured per run (label units; loop t reads y_{t-1}, so loops 2..r hold the r - 1 steps):

    model_jump      mean |ŷ_t − ŷ_{t−1}| over the positions and the loops t = 2..r: how far the trained map moves
                    its answer from one loop to the next (Lemma 4.1's ε, measured on the model)
    target_jump     mean |y_{t−1} − y_{t−2}| over the same positions and steps: the ε the dial asks for
    model_max_jump  the largest |ŷ_t − ŷ_{t−1}|; target_max_jump the table's largest step on the same keys
    tracking        model_jump / target_jump (1: the model's steps are as large as the labels' on average)
    update          the residual stream's relative change per loop, ‖h_t − h_{t−1}‖ / ‖h_{t−1}‖, averaged over
                    the rows and the loops 1..r (h_0 the input embeddings)
    omega_tok,      `theory modulus --checkpoint`'s lower bounds ω^tok(δ) and ω^cont(δ) (Definitions 3.5, 3.4) of
    omega_cont      the map from the input embeddings at the row's `width` positions to the residual stream after
                    loop r, searched over the box of the model's embeddings (1,024 samples, 50 ascent steps from
                    the best 4; δ = --delta)

Results merge into OUT/moduli.json (one record per run, the run's error from its results.json beside them; records
of runs measured before are kept and not measured again) and OUT/moduli.md (per cell: medians over seeds).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

from loopformer.configio import from_dict
from loopformer.errors import UserError
from loopformer.model.diagnostics import loop_dynamics
from loopformer.model.io import load, read_config, resolve_checkpoint
from loopformer.sources import make_data
from loopformer.sources.base import TaskConfig
from loopformer.theory.moduli import estimate_modulus
from loopformer.theory.targets import checkpoint_target

CELL = re.compile(r"^(?P<setting>.+)-r(?P<r>\d+)$")
ROWS = 2000                   # test rows read (every run's whole test split at the study's n_test)


def fail(message: str) -> None:
    print(f"dial_moduli.py: {message}", file=sys.stderr)
    raise SystemExit(2)


def loop_outputs(ckpt: Path) -> tuple[np.ndarray, np.ndarray, float, int]:
    """(pred [r,N,w] and step targets [N,K,w] in label units, the mean relative update per loop, the row width w)."""
    _, extra = read_config(ckpt)
    data = make_data(from_dict(TaskConfig, extra["run"]["task"]))
    model = load(ckpt, device="cpu").eval()
    task, r = data.task, model.config.loops
    rows = data.test_rows(ROWS)
    preds, updates = [], []
    for i in range(0, len(rows["inputs"]), 500):
        x = torch.as_tensor(rows["inputs"][i:i + 500], dtype=torch.long)                  # [b,w] key ids
        y = torch.as_tensor(rows["targets"][i:i + 500], dtype=torch.long)
        with torch.no_grad():
            preds.append(model(x, loops=r, return_all=True).all_logits.argmax(-1).numpy())  # [r,b,w]
            updates += [u * len(x) for u in loop_dynamics(model, x, y, loops=r)["update"]]  # per loop, by rows
    pred = np.concatenate(preds, axis=1).astype(np.int64) - task.first_label              # [r,N,w]
    pred = np.clip(pred, 0, task.labels - 1)          # a non-label answer counts as the nearest label
    steps = np.asarray(rows["step_targets"], dtype=np.int64) - task.first_label           # [N,K,w]
    return pred, steps, sum(updates) / (r * len(rows["inputs"])), task.width


def measure(run: Path, delta: float) -> dict:
    ckpt = resolve_checkpoint(str(run / "checkpoint"))
    pred, steps, update, width = loop_outputs(ckpt)
    r = pred.shape[0]
    out = {"update": update}
    if r >= 2:
        mj = np.abs(np.diff(pred, axis=0))                                                 # [r-1,N,w]
        tj = np.abs(np.diff(steps[:, :r], axis=1))                                         # [N,r-1,w]
        out.update(model_jump=float(mj.mean()), target_jump=float(tj.mean()), model_max_jump=int(mj.max()),
                   target_max_jump=int(tj.max()))
        out["tracking"] = out["model_jump"] / out["target_jump"] if out["target_jump"] > 0 else None
    f, d, lo, hi = checkpoint_target(str(ckpt), width)
    for kind in ("tok", "cont"):
        est = estimate_modulus(f, delta, kind, d=d, N=width, samples=1024, steps=50, restarts=4, lo=lo, hi=hi)
        out[f"omega_{kind}"] = float(est.value)
    out["delta"] = delta
    return out


def runs(sweeps: Path, seeds: set[int]) -> list[tuple[str, str, Path]]:
    found = []
    for res in sorted(sweeps.glob("labels/*/*/runs/*/results.json")):
        run = res.parent
        cell, arm = run.parts[-4], run.parts[-3]
        if CELL.match(cell) and json.loads(res.read_text())["seed"] in seeds and (run / "checkpoint").is_dir():
            found.append((cell, arm, run))
    return found


def table(recs: list[dict]) -> str:
    groups: dict[tuple, list[dict]] = {}
    for c in recs:
        groups.setdefault((c["dial"], c["r"], c["arm"]), []).append(c)

    def med(cs, k, digits=3):
        v = [c[k] for c in cs if c.get(k) is not None]
        return f"{statistics.median(v):.{digits}g}" if v else "—"

    lines = ["# The trained models' moduli beside their errors (labels family)", "",
             "`python studies/dials/dial_moduli.py SWEEPS OUT`; medians over the seeds measured. Label units; the "
             "module docstring of dial_moduli.py defines every column.", "",
             "| J | r | arm | seeds | per-loop label error | model's mean jump | target's mean jump | tracking | "
             "model's largest jump | update per loop | ω^tok(δ) | ω^cont(δ) |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (dial, r, arm), cs in sorted(groups.items()):
        lines.append(f"| {dial:g} | {r} | {arm} | {len(cs)} | {med(cs, 'error')} | {med(cs, 'model_jump')} | "
                     f"{med(cs, 'target_jump')} | {med(cs, 'tracking')} | {med(cs, 'model_max_jump')} | "
                     f"{med(cs, 'update')} | {med(cs, 'omega_tok')} | {med(cs, 'omega_cont')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweeps", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--seeds", default="0,1,2", help="seeds measured, comma-separated (default 0,1,2)")
    ap.add_argument("--delta", type=float, default=0.1, help="δ of the moduli (default 0.1)")
    args = ap.parse_args(argv)
    if not args.sweeps.is_dir():
        fail(f"no folder {args.sweeps}")
    try:
        seeds = {int(s) for s in args.seeds.split(",")}
    except ValueError:
        fail(f"--seeds takes integers separated by commas (got {args.seeds!r})")
    if not args.delta > 0:
        fail(f"--delta must be > 0 (got {args.delta})")
    path = args.out / "moduli.json"
    old = json.loads(path.read_text())["records"] if path.is_file() else []
    recs = {(c["cell"], c["arm"], c["run"]): c for c in old}
    torch.set_num_threads(1)
    for cell, arm, run in runs(args.sweeps, seeds):
        if (cell, arm, run.name) in recs and recs[(cell, arm, run.name)].get("delta") == args.delta:
            continue
        res = json.loads((run / "results.json").read_text())
        m = CELL.match(cell)
        try:
            got = measure(run, args.delta)
        except UserError as exc:
            fail(f"{run}: {exc}")
        recs[(cell, arm, run.name)] = {
            "cell": cell, "setting": m["setting"], "r": int(m["r"]), "arm": arm, "run": run.name,
            "seed": res["seed"], "dial": float(res["task"]["options"]["jump"]),
            "error": res["test"].get("loops_step_label_error", res["test"].get("label_error")), **got}
        print(f"{cell} {arm} {run.name}: jump {got.get('model_jump', float('nan')):.3f} "
              f"(target {got.get('target_jump', float('nan')):.3f}), ω^tok {got['omega_tok']:.3g}", flush=True)
        write(args.out, sorted(recs.values(), key=lambda c: (c["dial"], c["r"], c["arm"], c["seed"])))
    write(args.out, sorted(recs.values(), key=lambda c: (c["dial"], c["r"], c["arm"], c["seed"])))


def write(out: Path, recs: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("moduli.json", json.dumps({"records": recs}, indent=1) + "\n"), ("moduli.md", table(recs))):
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        tmp.replace(out / name)


if __name__ == "__main__":
    main(sys.argv[1:])
