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
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from loopformer.train.rollback import RollbackGuard

FILES = ("results.json", "metrics.jsonl", "run.json", "config.yaml")


def replay(run: Path) -> dict:
    """{"logged", "now"}: the steps of the run's rollbacks and of this guard's."""
    cfg = json.loads((run / "run.json").read_text())["config"]
    sel, final = cfg["train"]["select"], cfg["model"]["loops"]
    guard = RollbackGuard(sel["rollback"], sel["rollback_learned"])
    out: dict[str, list[int]] = {"logged": [], "now": []}
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
    args = ap.parse_args(argv)
    for run in sorted(args.stage.glob("*/runs/*/results.json")):
        run = run.parent
        r = replay(run)
        verdict = "same decisions" if r["now"] == r["logged"] else "different decisions"
        name = f"{run.parent.parent.name}/{run.name}"
        print(f"{name}: logged {r['logged']}, this guard {r['now']}: {verdict}")
        if args.copy_to and verdict == "same decisions":
            dest = args.copy_to / run.parent.parent.name / "runs" / run.name
            if dest.exists():
                continue
            dest.mkdir(parents=True)
            for f in FILES:
                if (run / f).is_file():
                    shutil.copy2(run / f, dest / f)
            print(f"  copied to {dest}")


if __name__ == "__main__":
    main()
