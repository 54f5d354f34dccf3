"""The dials study's compact results: one record per finished run, the error at r per cell (median and range over
seeds) and least-squares fits of the error against r and against the dial.

    python studies/dials/dial_summary.py sweeps/dials studies/dials

reads every finished run under SWEEPS/<family>/<setting>-r<r>/<arm>/runs/<run>/results.json (the map's standard
transformer, which has no r: <setting>-std), merges the records into OUT/results.json (records of runs no longer on
disk are kept, so the file grows over sessions) and writes OUT/summary.md and one plot per family,
OUT/<family>.png: the error against r, one panel per dial setting, every arm's median over seeds with its range,
and the shape the theory predicts (labels: Lemma 4.1's bound ε = J, flat in r, and Theorem 4.2's 0 for η(t); the
map: Theorem 3.6's rate ((r − N)/2)^(−1/((N+1)d+1)), N = 6, d = 1, scaled through the looped model's median at
the largest r; period: no shape in r).

The error of a run (lower is better), per family:
    labels        the per-loop label error: |ŷ_t − y_{t−1}| in label units averaged over the positions and over the
                  loops t = 1..r (`loops_step_label_error`); a model of one pass (the standard transformer) is read
                  once, against the last label (`label_error`)
    map-*         the bin error at r (`bin_error`, mean |b̂ − b| in bins)
    period        the per-loop state error: 1 − the exact match of loop t's read-out with layer t's state, averaged
                  over the loops t = 1..r (`loopwise` step_accuracy); one pass: 1 − accuracy
The dial of a run: labels the largest jump J, map-token α, map-context β, period the number of distinct layers
(p, or K when every layer is distinct). The fits, per (family, arm), over the runs (every seed a point):
error ≈ c0 + c1·log2 r + c2·dial, and per (family, setting, arm) error ≈ c0 + c1·log2 r; a regressor that does
not vary among the points is left out (its slope: none).
"""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
from pathlib import Path

import numpy as np

from loopformer.fileio import write_figure

DIAL = {"labels": "jump", "map-token": "token_lipschitz", "map-context": "context_lipschitz", "period": "period"}
CELL = re.compile(r"^(?P<setting>.+)-(?:r(?P<r>\d+)|std)$")


def fail(message: str) -> None:
    """One line on stderr and exit status 2 (bad input)."""
    print(f"dial_summary.py: {message}", file=sys.stderr)
    raise SystemExit(2)


def dial_value(family: str, options: dict) -> float:
    """The dial of a run from its task options (period: distinct layers, K when every layer is distinct)."""
    if family == "period":
        return float(options.get("period") or options.get("layers"))
    return float(options[DIAL[family]])


def run_error(family: str, res: dict) -> tuple[float, str]:
    """(the run's error, how it was read) — see the module docstring."""
    test = res["test"]
    if family == "labels":
        if "loops_step_label_error" in test:
            return float(test["loops_step_label_error"]), "per loop"
        return float(test["label_error"]), "last label"
    if family.startswith("map"):
        return float(test["bin_error"]), "at r"
    r = int(res["loops"])
    curve = [p for p in res.get("loopwise") or [] if p["loop"] <= r and "step_accuracy" in p]
    if r > 1 and len(curve) == r:
        return float(statistics.fmean(1 - p["step_accuracy"] for p in curve)), "per loop"
    return 1 - float(test["accuracy"]), "at r"


def record(family: str, cell: str, arm: str, run: Path) -> dict:
    res = json.loads((run / "results.json").read_text())
    m = CELL.match(cell)
    if m is None:
        fail(f"{run}: the cell {cell!r} is not <setting>-r<r> or <setting>-std")
    error, read = run_error(family, res)
    opts = res["task"].get("options", {})
    test = res["test"]
    return {"family": family, "setting": m["setting"], "cell": cell, "arm": arm, "run": run.name,
            "r": int(m["r"]) if m["r"] else None, "loops": res["loops"], "seed": res["seed"],
            "dial": dial_value(family, opts), "error": error, "read": read,
            "final_error": test.get("label_error", test.get("bin_error", 1 - test.get("token_accuracy", 0.0))),
            "accuracy": test.get("accuracy"), "token_accuracy": test.get("token_accuracy"),
            "params": res.get("params"), "steps": res.get("steps")}


def collect(sweeps: Path, out: Path) -> list[dict]:
    path = out / "results.json"
    old = json.loads(path.read_text())["records"] if path.is_file() else []
    recs = {(c["family"], c["cell"], c["arm"], c["run"]): c for c in old}
    for res in sorted(sweeps.glob("*/*/*/runs/*/results.json")):
        run = res.parent
        family, cell, arm = run.parts[-5], run.parts[-4], run.parts[-3]
        if family in DIAL:
            recs[(family, cell, arm, run.name)] = record(family, cell, arm, run)
    return sorted(recs.values(), key=lambda c: (c["family"], c["dial"], c["setting"], c["r"] or 0, c["arm"],
                                                c["seed"]))


def cells(rows: list[dict]) -> list[dict]:
    """Per (family, setting, r, arm): the error's median and range over seeds."""
    groups: dict[tuple, list[dict]] = {}
    for c in rows:
        groups.setdefault((c["family"], c["setting"], c["r"], c["arm"]), []).append(c)
    out = []
    for (family, setting, r, arm), cs in groups.items():
        errs = sorted(c["error"] for c in cs)
        out.append({"family": family, "setting": setting, "dial": cs[0]["dial"], "r": r, "arm": arm,
                    "seeds": sorted(c["seed"] for c in cs), "read": cs[0]["read"],
                    "error": {"median": statistics.median(errs), "range": [errs[0], errs[-1]]}})
    return sorted(out, key=lambda c: (c["family"], c["dial"], c["r"] or 0, c["arm"]))


def fit(log2_r: list[float] | None, dial: list[float] | None, y: list[float]) -> dict | None:
    """Least squares y ≈ c0 + c1·log2 r + c2·dial (a regressor given as None, or constant over the points, is left
    out: its slope None). None when the points do not outnumber the coefficients."""
    cols, names = [np.ones(len(y))], ["intercept"]
    for name, x in (("slope_log2_r", log2_r), ("slope_dial", dial)):
        if x is not None and len(set(x)) > 1:
            cols.append(np.asarray(x, dtype=float))
            names.append(name)
    if len(y) <= len(cols):
        return None
    a, yv = np.column_stack(cols), np.asarray(y, dtype=float)
    coef, *_ = np.linalg.lstsq(a, yv, rcond=None)
    resid = yv - a @ coef
    total = float(((yv - yv.mean()) ** 2).sum())
    out = {"slope_log2_r": None, "slope_dial": None, **{k: float(v) for k, v in zip(names, coef)}}
    out["r2"] = 1 - float((resid ** 2).sum()) / total if total > 0 else 1.0
    out["n"] = len(y)
    return out


def fits(rows: list[dict]) -> list[dict]:
    out = []
    by_arm: dict[tuple, list[dict]] = {}
    by_setting: dict[tuple, list[dict]] = {}
    for c in rows:
        by_arm.setdefault((c["family"], c["arm"]), []).append(c)
        by_setting.setdefault((c["family"], c["setting"], c["arm"]), []).append(c)
    for (family, arm), cs in sorted(by_arm.items()):
        rs = [math.log2(c["r"]) for c in cs] if all(c["r"] for c in cs) else None
        f = fit(rs, [c["dial"] for c in cs], [c["error"] for c in cs])
        if f:
            out.append({"family": family, "arm": arm, "setting": "all", **f})
    for (family, setting, arm), cs in sorted(by_setting.items()):
        if not all(c["r"] for c in cs):
            continue
        f = fit([math.log2(c["r"]) for c in cs], None, [c["error"] for c in cs])
        if f:
            out.append({"family": family, "arm": arm, "setting": setting, **f})
    return out


# The predictions of studies/dials/README.md ("Predictions", written before the runs), each as a rule on the runs:
# (id, family, what it says, kind, arms). Each kind is judged at every r the family has runs of both arms at, and
# on every seed: a seed's runs give their own slope, compared with the looped model's of the same seed (paired by
# seed, the registry's sign-test rule: at 3 seeds all three must agree). Kinds:
#   grows      the arm's least-squares slope of error against the dial is > 0
#   less       the arm's slope is below the looped model's
#   below_top  the arm's error at the largest dial setting is below the looped model's
#   flat_r     the arm's slope against log2 r is <= 0 at every dial setting (the error does not rise with r)
#   control    the arm's slope is at most a quarter of the looped model's in size (0 where the looped one is 0)
PREDICTIONS = [
    ("1", "labels", "the looped model's per-loop label error grows with the jump J", "grows", ("looped",)),
    ("2a", "labels", "the η(t) model's error grows less with J than the looped model's", "less", ("eta",)),
    ("2b", "labels", "at the largest J the η(t) model's error is below the looped model's", "below_top", ("eta",)),
    ("2c", "labels", "the TMLT's error grows less with J than the looped model's", "less", ("tmlt",)),
    ("3a", "map-token", "the looped model's bin error grows with the token modulus α", "grows", ("looped",)),
    ("3b", "map-token", "the TMLT's and the η(t) model's grow less with α", "less", ("tmlt", "eta")),
    ("3c", "map-context", "the looped model's bin error grows with the contextual modulus β", "grows", ("looped",)),
    ("3d", "map-context", "the TMLT's and the η(t) model's grow less with β", "less", ("tmlt", "eta")),
    ("3e", "map-token", "the looped model's error does not rise with r", "flat_r", ("looped",)),
    ("4a", "period", "the looped model's per-loop state error grows with the distinct layers p", "grows", ("looped",)),
    ("4b", "period", "the TMLT's and the η(t) model's grow less with p", "less", ("tmlt", "eta")),
    ("5", "labels", "the standard transformer's error (one read-out, the last label) does not move with J", "control",
     ("standard",)),
]


def dial_slope(rows: list[dict], family: str, arm: str, r: int, seed: int | None = None) -> float | None:
    """The least-squares slope of the error against the dial over the runs of (family, arm, r) — of one seed's
    runs, or of every seed's (each run a point); None: fewer than 2 dial settings."""
    cs = [c for c in rows if c["family"] == family and c["arm"] == arm and c["r"] == r and
          (seed is None or c["seed"] == seed)]
    return slope([c["dial"] for c in cs], [c["error"] for c in cs])


def slope(x: list[float], y: list[float]) -> float | None:
    """The least-squares slope of y against x (with an intercept; two points: the line through them); None when x
    takes fewer than 2 values."""
    if len(set(x)) < 2:
        return None
    xv, yv = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    return float(((xv - xv.mean()) * (yv - yv.mean())).sum() / ((xv - xv.mean()) ** 2).sum())


def seed_checks(rows: list[dict], family: str, kind: str, arm: str, r: int) -> tuple[list[bool], str]:
    """One r's check on every seed (paired with the looped model's seed), and its numbers: the slopes over every
    seed's runs (or the medians at the top dial) and how many seeds held."""
    seeds = sorted({c["seed"] for c in rows if c["family"] == family and c["arm"] == arm and c["r"] == r})
    ok, label = [], ""
    if kind == "below_top":
        top = max(c["dial"] for c in rows if c["family"] == family)
        at = {(c["arm"], c["seed"]): c["error"] for c in rows if c["family"] == family and c["r"] == r and
              c["dial"] == top}
        ok = [at[(arm, s)] < at[("looped", s)] for s in seeds if (arm, s) in at and ("looped", s) in at]
        mine = [at[(arm, s)] for s in seeds if (arm, s) in at]
        theirs = [e for (a, _), e in at.items() if a == "looped"]
        if ok:
            label = f"r={r}: {statistics.median(mine):.3g} vs {statistics.median(theirs):.3g}"
    else:
        for s in seeds:
            mine, looped = dial_slope(rows, family, arm, r, s), dial_slope(rows, family, "looped", r, s)
            if kind == "grows" and mine is not None:
                ok.append(mine > 0)
            elif kind in ("less", "control") and mine is not None and looped is not None:
                ok.append(mine < looped if kind == "less" else abs(mine) <= abs(looped) / 4)
        mine, looped = dial_slope(rows, family, arm, r), dial_slope(rows, family, "looped", r)
        if ok:
            label = f"r={r}: {mine:+.3g}" if kind == "grows" else f"{arm} r={r}: {mine:+.3g} vs {looped:+.3g}"
    return ok, f"{label} ({sum(ok)}/{len(ok)} seeds)" if ok else ""


def judge(rows: list[dict], cs: list[dict], pred: tuple) -> dict:
    """One prediction's verdict over the runs: "met" (it held at every r, on every seed), "not met" or "not run",
    with the numbers it rests on; "held" counts the r (and settings) at which it held on every seed."""
    pid, family, text, kind, arms = pred
    rs = sorted({c["r"] for c in rows if c["family"] == family and c["r"]})
    checks, numbers = [], []
    for arm in arms:
        if kind != "flat_r":
            for r in rs:
                ok, label = seed_checks(rows, family, kind, arm, r)
                if ok:
                    checks.append(all(ok))
                    numbers.append(label)
            continue
        for setting in sorted({c["setting"] for c in rows if c["family"] == family and c["arm"] == arm}):
            pts = [c for c in rows if c["family"] == family and c["arm"] == arm and c["setting"] == setting]
            ok = []
            for s in sorted({c["seed"] for c in pts}):
                mine = [c for c in pts if c["seed"] == s]
                k = slope([math.log2(c["r"]) for c in mine], [c["error"] for c in mine])
                if k is not None:
                    ok.append(k <= 0)
            k = slope([math.log2(c["r"]) for c in pts], [c["error"] for c in pts])
            if ok and k is not None:
                checks.append(all(ok))
                numbers.append(f"{setting}: {k:+.3g} per doubling ({sum(ok)}/{len(ok)} seeds)")
    verdict = "not run" if not checks else "met" if all(checks) else "not met"
    return {"id": pid, "family": family, "prediction": text, "verdict": verdict,
            "held": f"{sum(checks)}/{len(checks)}", "numbers": numbers}


def num(v, digits: int = 4) -> str:
    return "—" if v is None else f"{v:.{digits}g}"


def markdown(cs: list[dict], fs: list[dict], n_runs: int, vs: list[dict]) -> str:
    lines = ["# The dials study: error against r and the dial", "",
             f"{n_runs} finished runs (`python studies/dials/dial_summary.py SWEEPS OUT`). The error is lower-is-"
             "better (labels: per-loop label error; map: bin error; period: per-loop state error; the module "
             "docstring of dial_summary.py says how each is read). Predictions: studies/dials/README.md.", "",
             "## The predictions, judged", "",
             "Each at every r with runs and on every seed, paired by seed (slopes: least squares of the error "
             "against the dial; the slope shown is over every seed's runs; "
             "`PREDICTIONS` in dial_summary.py states each rule).", "",
             "| # | family | prediction | verdict | held | numbers |", "|---|---|---|---|---:|---|"]
    for v in vs:
        lines.append(f"| {v['id']} | {v['family']} | {v['prediction']} | {v['verdict']} | {v['held']} | "
                     f"{'; '.join(v['numbers']) or '—'} |")
    lines += ["", "## Error at r per cell (median and range over seeds)", "",
             "| family | setting | r | arm | seeds | read | median | range |", "|---|---|---:|---|---:|---|---:|---|"]
    for c in cs:
        e = c["error"]
        lines.append(f"| {c['family']} | {c['setting']} | {c['r'] if c['r'] else '—'} | {c['arm']} | "
                     f"{len(c['seeds'])} | {c['read']} | {num(e['median'])} | {num(e['range'][0])} – "
                     f"{num(e['range'][1])} |")
    lines += ["", "## Least-squares fits: error ≈ c0 + c1·log2 r + c2·dial", "",
              "Per (family, arm) over every run (setting `all`), and per setting against log2 r alone; a slope "
              "of — : the regressor did not vary.", "",
              "| family | arm | setting | runs | c0 | c1 (per doubling of r) | c2 (per dial unit) | R² |",
              "|---|---|---|---:|---:|---:|---:|---:|"]
    if not fs:
        lines.append("| (too few runs for a fit) | | | | | | | |")
    for f in fs:
        lines.append(f"| {f['family']} | {f['arm']} | {f['setting']} | {f['n']} | {num(f['intercept'])} | "
                     f"{num(f['slope_log2_r'])} | {num(f['slope_dial'])} | {num(f['r2'], 3)} |")
    return "\n".join(lines) + "\n"


ARMS = ("looped", "tmlt", "eta", "standard")
COLOURS = {"looped": "tab:blue", "tmlt": "tab:orange", "eta": "tab:green", "standard": "tab:gray"}


def predicted(family: str, dial: float, rs: list[int], looped: dict[int, float]) -> list[tuple[str, list, list]]:
    """The theory's shapes in r for one dial setting: (label, r values, errors) lines."""
    if family == "labels":
        return [(f"Lemma 4.1: error <= ε = J = {dial:g}", rs, [dial] * len(rs)),
                ("Theorem 4.2 (η(t)): 0", rs, [0.0] * len(rs))]
    if family.startswith("map"):
        N, d = 6, 1
        big = [r for r in rs if r > N]
        if not big or max(big) not in looped:
            return []
        shape = {r: ((r - N) / 2) ** (-1 / ((N + 1) * d + 1)) for r in big}
        scale = looped[max(big)] / shape[max(big)]
        return [("Theorem 3.6: ((r - N)/2)^(-1/8), scaled", big, [scale * shape[r] for r in big])]
    return []


def plot(cs: list[dict], out: Path) -> list[Path]:
    """OUT/<family>.png per family with runs at several r (see the module docstring)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    written = []
    for family in sorted({c["family"] for c in cs}):
        fam = [c for c in cs if c["family"] == family and c["r"]]
        dials = {}                                   # setting -> its dial values (period's p = K follows r)
        for c in fam:
            dials.setdefault(c["setting"], set()).add(c["dial"])
        settings = sorted((min(v), k) for k, v in dials.items())
        if not settings:
            continue
        fig, axes = plt.subplots(1, len(settings), figsize=(4 * len(settings), 3.4), squeeze=False)
        for ax, (dial, setting) in zip(axes[0], settings):
            here = [c for c in fam if c["setting"] == setting]
            rs = sorted({c["r"] for c in here})
            for arm in [a for a in ARMS if any(c["arm"] == a for c in here)]:
                pts = sorted((c["r"], c["error"]) for c in here if c["arm"] == arm)
                x = [r for r, _ in pts]
                med = [e["median"] for _, e in pts]
                lo = [m - e["range"][0] for m, (_, e) in zip(med, pts)]
                hi = [e["range"][1] - m for m, (_, e) in zip(med, pts)]
                ax.errorbar(x, med, yerr=[lo, hi], marker="o", capsize=3, label=arm, color=COLOURS[arm])
            looped = {c["r"]: c["error"]["median"] for c in here if c["arm"] == "looped"}
            top = max(c["error"]["range"][1] for c in here)
            for i, (label, x, y) in enumerate(predicted(family, dial, rs, looped)):
                ax.plot(x, y, ls=("--", ":")[i % 2], color="black", lw=1, label=label)
                top = max(top, *y)
            ax.set_xscale("log", base=2)
            ax.set_yscale("symlog", linthresh=0.01)
            ax.set_ylim(0, 2 * top if top > 0 else 1)
            ax.set_xticks(rs, [str(r) for r in rs])
            ax.set_title(f"{family} {setting} (dial {', '.join(f'{v:g}' for v in sorted(dials[setting]))})")
            ax.set_xlabel("r")
            ax.legend(fontsize=7)
        axes[0][0].set_ylabel("error (median, range over seeds)")   # symlog: linear below 0.01
        fig.tight_layout()
        written.append(write_figure(fig, out / f"{family}.png"))
        plt.close(fig)
    return written


def main(argv: list[str]) -> list[dict]:
    if len(argv) != 2:
        fail("usage: dial_summary.py SWEEPS OUT")
    sweeps, out = Path(argv[0]), Path(argv[1])
    if not sweeps.is_dir():
        fail(f"no folder {sweeps}")
    rows = collect(sweeps, out)
    cs, fs = cells(rows), fits(rows)
    vs = [judge(rows, cs, p) for p in PREDICTIONS]
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("results.json", json.dumps({"records": rows, "cells": cs, "fits": fs, "predictions": vs},
                                                   indent=1) + "\n"),
                       ("summary.md", markdown(cs, fs, len(rows), vs))):
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        tmp.replace(out / name)
    plot(cs, out)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
    print(f"wrote {sys.argv[2]}/results.json, summary.md and a plot per family")
