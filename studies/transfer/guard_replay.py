"""Replay a stage's training curves through the collapse guard (`loopformer.train.rollback.RollbackGuard`) as this
code has it: which runs would it decide exactly as the guard they ran with did?

    python studies/transfer/guard_replay.py sweeps/transfer/screen-r1 [--copy-to sweeps/transfer/screen-r3]

A run's training is a function of the guard's decisions alone (the guard reads the log windows' accuracies and
changes nothing else: no random draw, no data order), so a run whose rollbacks this guard decides at the same steps
is, step for step, the run this code trains. For every finished run under STAGE/<setting>/runs/ the windows of its
"train" records are fed to the guard (`train.select.rollback` and `rollback_learned` from its config; the window's
loop count: the curriculum's count the record logs until the count first reaches model.loops, model.loops from
then on) and its decisions compared with the "rollback" records the run wrote. Prints one line per run; --copy-to
copies (results.json, metrics.jsonl, run.json, config.yaml; no checkpoint) the runs decided alike into the other
stage, where no run of that name is yet.

    python studies/transfer/guard_replay.py sweeps/transfer/screen-state-norm --rollback 0.5 \
        [--copy-to sweeps/transfer/screen-state-norm-guard]

replays the runs of a stage trained without the guard under `train.select.rollback=0.5`: a run in which that guard
never fires is, step for step, the run with it (the guard changes training only when it fires: the rate's scale
stays 1.0), so the copies carry the guard's setting in their config and its count, 0, in results.json, and name
their source (`replayed_from` in results.json); the runs in which it fires are the ones to train again.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from omegaconf import OmegaConf

from loopformer.fileio import write_json
from loopformer.train.rollback import RollbackGuard

FILES = ("results.json", "metrics.jsonl", "run.json", "config.yaml")


def replay(run: Path, rollback: float | None = None) -> dict:
    """{"logged", "now"}: the steps of the run's rollbacks and of this guard's (at threshold `rollback`; None: the
    run's own). No guard (a threshold of 0) never fires."""
    cfg = json.loads((run / "run.json").read_text())["config"]
    sel, final = cfg["train"]["select"], cfg["model"]["loops"]
    below = sel["rollback"] if rollback is None else rollback
    out: dict[str, list[int]] = {"logged": [], "now": []}
    if not below:
        return out
    guard = RollbackGuard(below, sel.get("rollback_learned", 0.95))   # runs from before the field: its default
    reached = False
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("split") == "rollback":
            out["logged"].append(rec["step"])
        if rec.get("split") != "train" or rec.get("accuracy") is None:
            continue
        reached = reached or rec["loops"] >= final
        if guard.update(rec["accuracy"], rec["step"], dict, loops=final if reached else rec["loops"]):
            out["now"].append(rec["step"])
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stage", type=Path)
    ap.add_argument("--copy-to", type=Path)
    ap.add_argument("--rollback", type=float, help="replay under this train.select.rollback (default: each run's)")
    args = ap.parse_args(argv)
    if args.rollback is not None and not 0 < args.rollback <= 0.95:
        ap.error(f"--rollback must lie in (0, 0.95] (got {args.rollback})")
    for run in sorted(args.stage.glob("*/runs/*/results.json")):
        run = run.parent
        r = replay(run, args.rollback)
        verdict = "same decisions" if r["now"] == r["logged"] else "different decisions"
        name = f"{run.parent.parent.name}/{run.name}"
        print(f"{name}: logged {r['logged']}, this guard {r['now']}: {verdict}")
        if args.copy_to and verdict == "same decisions":
            dest = args.copy_to / run.parent.parent.name / "runs" / run.name
            if dest.exists():
                continue
            dest.mkdir(parents=True)
            rewritten = with_guard(run, dest, args.rollback) if args.rollback is not None else ()
            for f in FILES:
                if f not in rewritten and (run / f).is_file():
                    shutil.copy2(run / f, dest / f)
            print(f"  copied to {dest}")


def with_guard(run: Path, dest: Path, rollback: float) -> tuple[str, ...]:
    """Write into `dest` the run that no guard fired in as the run with the guard at `rollback`: its config's
    train.select.rollback, its results' rollback count (0) and the run it was replayed from. Returns the files
    written (the rest are copied as they are)."""
    info = json.loads((run / "run.json").read_text())
    info["config"]["train"]["select"]["rollback"] = rollback
    write_json(dest / "run.json", info)
    res = json.loads((run / "results.json").read_text())
    write_json(dest / "results.json", {**res, "rollbacks": 0, "replayed_from": str(run)})
    written = ["run.json", "results.json"]
    if (run / "config.yaml").is_file():
        cfg = OmegaConf.load(run / "config.yaml")
        OmegaConf.update(cfg, "train.select.rollback", rollback)
        OmegaConf.save(cfg, dest / "config.yaml")
        written.append("config.yaml")
    return tuple(written)


if __name__ == "__main__":
    main()
