"""The transfer study's compact results: one record per finished run of the grid, and the table that judges a
recipe by its share of cells.

    python studies/transfer/transfer_summary.py sweeps/transfer studies/transfer

reads every finished run under SWEEPS/<stage>/<setting>/runs/<run>/ (results.json and the training curve in
metrics.jsonl), merges the records into OUT/results.json (records of runs no longer on disk are kept, so the file
grows over sessions) and writes OUT/summary.md. A cell is one (stage, setting, variant, seed). Per cell: exact
match at r, 2r and 4r, the drift verdict past r, and `lost_steps`: the longest stretch of training, in steps, in
which the training accuracy stayed below 90 % after it had first reached 95 % (a task learned, then lost).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

LEARNED, LOST = 0.95, 0.90


def lost_steps(metrics: Path) -> int:
    """The longest stretch (steps) of training accuracy below LOST after it first reached LEARNED."""
    learned, start, worst = False, None, 0
    with metrics.open() as f:
        for line in f:
            if '"split": "train"' not in line:
                continue
            rec = json.loads(line)
            acc, step = rec.get("accuracy"), rec["step"]
            if acc is None:
                continue
            if acc >= LEARNED:
                learned = True
            if learned and acc < LOST:
                start = step if start is None else start
                worst = max(worst, step - start)
            elif start is not None:
                worst = max(worst, step - start)
                start = None
    return worst


def record(stage: str, setting: str, run: Path) -> dict:
    res = json.loads((run / "results.json").read_text())
    at = (res.get("drift") or {}).get("at", {})
    return {"stage": stage, "setting": setting, "run": run.name, "task": res["task"]["name"],
            "variant": res["variant"], "seed": res["seed"], "loops": res["loops"], "steps": res["steps"],
            "r": res["test"]["accuracy"], "2r": at.get("2r"), "4r": at.get("4r"),
            "verdict": (res.get("drift") or {}).get("verdict"),
            "lost_steps": lost_steps(run / "metrics.jsonl") if (run / "metrics.jsonl").is_file() else None,
            "rollbacks": res.get("rollbacks"),          # the collapse guard's count (None: no guard)
            "train_time_s": round(res.get("train_time_s", 0))}


def collect(sweeps: Path, out: Path) -> list[dict]:
    path = out / "results.json"
    cells = {(c["stage"], c["setting"], c["run"]): c for c in json.loads(path.read_text())} if path.is_file() else {}
    for run in sorted(sweeps.glob("*/*/runs/*/results.json")):
        run = run.parent
        stage, setting = run.parts[-4], run.parts[-3]
        cells[(stage, setting, run.name)] = record(stage, setting, run)
    rows = sorted(cells.values(), key=lambda c: (c["stage"], c["task"], c["setting"], c["variant"], c["seed"]))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(rows, indent=1) + "\n")
    tmp.replace(path)
    return rows


def pct(v) -> str:
    return "—" if v is None else f"{100 * v:.1f}"


def shares(rows: list[dict], by: str) -> list[str]:
    """One line per (stage, `by`, variant): the share of its cells at >= 95 % at r, the median and the worst at r,
    the share at >= 95 % at r and 4r, the share that lost a learned task for more than 100 steps."""
    out = [f"| stage | {by} | variant | cells | ≥ 95 % at r | median at r | worst at r | ≥ 95 % at r and 4r "
           "| lost > 100 steps |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    groups: dict[tuple, list[dict]] = {}
    for c in rows:
        groups.setdefault((c["stage"], c[by], c["variant"]), []).append(c)
    for (stage, key, variant), cs in sorted(groups.items()):
        at_r = [c["r"] for c in cs]
        ok = sum(v >= 0.95 for v in at_r)
        settle = sum(c["r"] >= 0.95 and (c["4r"] or 0) >= 0.95 for c in cs)   # learned, and held to 4r
        lost = sum((c["lost_steps"] or 0) > 100 for c in cs)
        out.append(f"| {stage} | {key} | {variant} | {len(cs)} | {ok}/{len(cs)} | {pct(statistics.median(at_r))} | "
                   f"{pct(min(at_r))} | {settle}/{len(cs)} | {lost}/{len(cs)} |")
    return out


def table(rows: list[dict]) -> str:
    out = shares(rows, "task")
    out += ["", "By setting (seeds pooled):", "", *shares(rows, "setting")]
    out += ["", "Every cell (exact match, %; rollbacks: the collapse guard's, — without it):", "",
            "| stage | setting | variant | seed | r | 2r | 4r | verdict | lost steps | rollbacks | minutes |",
            "|---|---|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    for c in rows:
        rb = "—" if c.get("rollbacks") is None else c["rollbacks"]
        out.append(f"| {c['stage']} | {c['setting']} | {c['variant']} | {c['seed']} | {pct(c['r'])} | {pct(c['2r'])} | "
                   f"{pct(c['4r'])} | {c['verdict']} | {c['lost_steps']} | {rb} | {c['train_time_s'] / 60:.0f} |")
    return "\n".join(out) + "\n"


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit("usage: transfer_summary.py SWEEPS OUT")
    sweeps, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    rows = collect(sweeps, out)
    (out / "summary.md").write_text("# The transfer grid: finished cells\n\n"
                                    "`python studies/transfer/transfer_summary.py sweeps/transfer studies/transfer`"
                                    " (from the runs of `bash studies/transfer/transfer_study.sh`).\n\n" + table(rows))
    print(f"{len(rows)} cells -> {out / 'results.json'}, {out / 'summary.md'}")


if __name__ == "__main__":
    main()
