"""The length-generalisation study's tables (studies/lengths/README.md) from the compact results that
`bash studies/lengths/lengths_study.sh collect` copies: per task, every arm's exact match at each evaluated length
(runs' results.json "lengths": T(n) loops for a looped block, one pass for a standard transformer), per seed, then
per arm the median [min–max] over seeds at the training length n and at 2n and 4n, with the seeds at ≥ 95 %, and at
2n with every row stopped at its most confident loop and read by the vote of its loops T(n)..2·T(n) (runs evaluated
since each stop exists; "—" before).

    python studies/lengths/lengths_summary.py studies/lengths > studies/lengths/summary.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from statistics import median


def runs(sweep: Path) -> list[dict]:
    """Every finished run of a collected sweep: seed, parameters, training time and the metric per length."""
    out = []
    for f in sorted(sweep.glob("runs/*/results.json")):
        r = json.loads(f.read_text())
        if "lengths" not in r:
            continue
        out.append({"seed": r.get("seed"), "params": r.get("params"), "minutes": r.get("train_time_s", 0) / 60,
                    "trained": r["lengths"].get("trained_size"), "formula": r["lengths"].get("formula"),
                    "at": {p["length"]: (p["metric"], p["loops"]) for p in r["lengths"]["lengths"]},
                    "confident": {p["length"]: p.get("confident") for p in r["lengths"]["lengths"]},
                    "vote": {p["length"]: p.get("vote") for p in r["lengths"]["lengths"]}})
    return out


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.1f}"


def _median_range(vals: list[float]) -> str:
    return f"{_pct(median(vals))} [{_pct(min(vals))}–{_pct(max(vals))}]" if vals else "—"


def summary(root: Path) -> str:
    sweeps = sorted(d for d in root.iterdir() if d.is_dir() and (d / "runs").is_dir())
    by_task: dict[str, list[Path]] = {}
    for d in sweeps:
        by_task.setdefault(d.name.split("-")[0], []).append(d)
    lines = []
    for task, ds in by_task.items():
        lines += [f"## {task}", ""]
        found = {d.name: runs(d) for d in ds}
        lengths = sorted({n for rs in found.values() for r in rs for n in r["at"]})
        if not lengths:
            continue
        lines += ["| arm | seed | params | loops | " + " | ".join(f"n = {n}" for n in lengths) + " | train min |",
                  "|---|---:|---:|---|" + "---:|" * len(lengths) + "---:|"]
        for name, rs in found.items():
            for r in rs:
                cells = [_pct(r["at"].get(n, (None, 0))[0]) for n in lengths]
                lines.append(f"| {name} | {r['seed']} | {r['params']:,} | {r['formula']} | " + " | ".join(cells)
                             + f" | {r['minutes']:.1f} |")
        lines += ["", "| arm | seeds | at n | at 2n | at 4n | ≥ 95 % at 2n | at 2n, most confident loop "
                  "| at 2n, vote of loops T(n)..2·T(n) |",
                  "|---|---:|---|---|---|---:|---|---|"]
        for name, rs in found.items():
            if not rs:
                continue
            n = rs[0]["trained"]
            cols = [_median_range([r["at"][m][0] for r in rs if m in r["at"]]) for m in (n, 2 * n, 4 * n)]
            good = sum(1 for r in rs if 2 * n in r["at"] and r["at"][2 * n][0] >= 0.95)
            stops = [_median_range([r[key][2 * n] for r in rs if r[key].get(2 * n) is not None])
                     for key in ("confident", "vote")]
            lines.append(f"| {name} | {len(rs)} | " + " | ".join(cols) + f" | {good}/{len(rs)} | " + " | ".join(stops)
                         + " |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(Path(sys.argv[1] if len(sys.argv) > 1 else "studies/lengths")))
