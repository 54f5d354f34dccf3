"""The elastic-depth study's summary tables (docs/elastic-depth.md) from the compact results that
`bash studies/elastic/elastic_study.sh collect` copies into studies/elastic/ (and the fixed-r pointer runs of
studies/depth/):

    python studies/elastic/elastic_summary.py [FOLDER]   # FOLDER: studies/elastic (default) or the sweeps folder

For every family of runs: the accuracy when run with each budget R (median [min–max] over seeds), then the checks
of an elastic model against models trained at a fixed r — at r (paired by seed with the fixed-r model), at 2r and 4r
(against its own accuracy at r) and at r/2 (paired with the model trained at r/2).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "studies"


def runs(folder: Path) -> dict[int, dict]:
    """seed -> results.json of every run in a sweep's compact copy."""
    return by_seed(folder, "runs/*/results.json")


def by_seed(folder: Path, pattern: str) -> dict[int, dict]:
    """seed -> results.json of the runs matching `pattern` under `folder`."""
    out = {}
    for f in folder.glob(pattern):
        res = json.loads(f.read_text())
        out[int(res.get("seed", 0))] = res
    return out


def at(res: dict, R: int) -> float | None:
    """Accuracy (%) when run with R loops: the run's budgets, else (a model that reads no run length) its
    loop-wise curve."""
    if res.get("budgets"):
        return next((100 * b["metrics"]["accuracy"] for b in res["budgets"]["budgets"] if b["loops"] == R), None)
    for p in res.get("loopwise", []):
        if p["loop"] == R:
            return 100 * p["accuracy"]
    return None


def mr(vals: list[float]) -> str:
    vals = [v for v in vals if v is not None]
    if not vals:
        return "—"
    if len(vals) == 1:
        return f"{vals[0]:.1f}"
    return f"{statistics.median(vals):.1f} [{min(vals):.1f}–{max(vals):.1f}]"


def signed(vals: list[float | None]) -> str:
    return " / ".join("—" if v is None else f"{v:+.1f}" for v in vals) if vals else "—"


def table(title: str, families: dict[str, dict[int, dict]], budgets: list[int]) -> str:
    lines = [f"**{title}** — accuracy (%) when run with R loops, median [min–max] over seeds", "",
             "| model | seeds | " + " | ".join(f"R = {b}" for b in budgets) + " |",
             "|---|---:|" + "---|" * len(budgets)]
    for name, rs in families.items():
        if rs:
            lines.append(f"| {name} | {len(rs)} | " + " | ".join(mr([at(r, b) for r in rs.values()])
                                                               for b in budgets) + " |")
    return "\n".join(lines)


def checks(title: str, elastic: dict[str, dict[int, dict]], fixed_r: dict[int, dict], fixed_half: dict[int, dict],
           r: int) -> str:
    lines = [f"**{title}** — each elastic model against the models trained at a fixed r = {r} and r/2 = {r // 2} "
             "(paired by seed; points)", "",
             "| conditioning | at r: elastic − fixed r (≥ −1?) | at 2r: − its r (≥ 0?) | at 4r: − its r (≥ 0?) | "
             "at r/2: elastic − fixed r/2 (≥ −2?) |", "|---|---|---|---|---|"]
    for name, rs in ((n, x) for n, x in elastic.items() if x):
        seeds = sorted(rs)
        def diff(a: dict, ra: int, b: dict, rb: int) -> float | None:
            x, y = at(a, ra), at(b, rb)
            return None if x is None or y is None else x - y

        d_r = [diff(rs[s], r, fixed_r[s], r) for s in seeds if s in fixed_r]
        d_2 = [diff(rs[s], 2 * r, rs[s], r) for s in seeds]
        d_4 = [diff(rs[s], 4 * r, rs[s], r) for s in seeds]
        d_h = [diff(rs[s], r // 2, fixed_half[s], r // 2) for s in seeds if s in fixed_half]
        lines.append(f"| {name} | {signed(d_r)} | {signed(d_2)} | {signed(d_4)} | {signed(d_h)} |")
    return "\n".join(lines)


def main() -> None:
    import sys
    el = Path(sys.argv[1]) if len(sys.argv) > 1 else DOCS / "elastic"   # a study folder of sweeps, or studies/elastic
    r4, r8 = (by_seed(el / "demo-fixed", f"runs/*_loops={r}/results.json") for r in (4, 8))
    demo = {f"elastic, {c}": runs(el / f"demo-{c}") for c in ("none", "index", "normalized")}
    extra = {"elastic, none + consistency": runs(el / "demo-consistency-none"),
             "elastic, normalized + consistency": runs(el / "demo-consistency-normalized"),
             "elastic, none + fixed point": runs(el / "demo-fixedpoint-none")}
    print(table("LCS-6 (the demo's task), r = 8, budgets drawn from 2..16",
                {"fixed r = 4": r4, "fixed r = 8": r8, **demo, **extra}, [1, 2, 4, 8, 16, 32]))
    print()
    print(checks("LCS-6, r = 8", {**demo, **extra}, r8, r4, 8))
    print()
    p16 = by_seed(DOCS / "depth" / "pointer", "runs/*_loops=16_timestep=false/results.json")
    p8 = {0: json.loads((DOCS / "depth" / "pointer-curve" / "runs" / "loops=8" / "results.json").read_text()),
          **runs(el / "pointer-fixed8")}
    pointer = {f"elastic, {c}": runs(el / f"pointer-{c}") for c in ("none", "index", "normalized")}
    pextra = {"elastic, none + fixed point": runs(el / "pointer-fixedpoint-none")}
    print(table("Pointer chasing (12 hops), r = 16, budgets drawn from 8..24",
                {"fixed r = 8": p8, "fixed r = 16": p16, **pointer, **pextra}, [4, 8, 12, 16, 24, 32, 64]))
    print()
    print(checks("Pointer chasing, r = 16", {**pointer, **pextra}, p16, p8, 16))


if __name__ == "__main__":
    main()
