"""The stability study's tables (studies/stability/README.md) from the compact results that
`bash studies/stability/stability_study.sh collect` copies: per stage, every run's exact-match accuracy at r, 2r and
4r, its best loop, the drift verdict (loopformer.eval.drift: from results.json's "drift" where the run recorded it,
with the state change at 4r and the spectral radius of the loop map; else from the accuracy alone; "not learned"
below 50 % at r), the averaged weights' accuracy at r (runs with train.ema_decay), the steps spike skipping left out
(train.skip_spikes), its training time and peak memory; then per variant the median [min–max] over seeds and the seeds
reaching 95 % at r.

    python studies/stability/stability_summary.py studies/stability       # prints markdown
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from statistics import median

from loopformer.eval.drift import THRESHOLDS


def _verdict(acc: dict[str, float]) -> str:
    """The accuracy half of the drift verdict (the state change is not in these records)."""
    lost = 100 * (acc["r"] - min(acc["2r"], acc["4r"]))
    lost_4r = 100 * (acc["r"] - acc["4r"])
    if lost_4r > THRESHOLDS["drift_points"]:
        return "drifting"
    return "settling" if lost <= THRESHOLDS["settle_points"] else "marginal"


def _grid_label(run: str) -> str:
    """The run folder's grid values other than the seed and timestep encoding ("seed=0_lr=1e-3" -> "lr=1e-3"); a
    part without "=" belongs to the next key (keys may hold underscores: "loops_hold=4")."""
    parts, pending = [], ""
    for tok in run.split("_"):
        if "=" not in tok:
            pending += tok + "_"
            continue
        parts.append(pending + tok)
        pending = ""
    return " ".join(p for p in parts if not p.startswith(("seed=", "timestep=")))


def rows(stage: Path) -> list[dict]:
    out = []
    for f in sorted(stage.glob("runs/*/results.json")):
        d = json.loads(f.read_text())
        r = d["loops"]
        curve = [p["accuracy"] for p in d["loopwise"]]
        if len(curve) < 4 * r:
            continue
        acc = {"r": curve[r - 1], "2r": curve[2 * r - 1], "4r": curve[4 * r - 1]}
        best = max(range(len(curve)), key=curve.__getitem__)
        drift = d.get("drift") or {}
        verdict = drift.get("verdict") or _verdict(acc)
        variant = " ".join(filter(None, [d["variant"], _grid_label(f.parent.name)]))
        out.append({"run": f.parent.name, "variant": variant, "seed": d["seed"], "r": r, **acc,
                    "best": curve[best], "best_t": best + 1, "time_min": d["train_time_s"] / 60,
                    "change_4r": drift["state_change"][4 * r - 1] if drift else None,
                    "rho": drift["spectral_radius"]["median"] if drift else None,
                    "mem_mb": (d.get("peak_memory_mb") or {}).get("host"),
                    "ema": (d.get("test_ema") or {}).get("accuracy"), "skipped": d.get("skipped_steps"),
                    "verdict": verdict if acc["r"] >= 0.5 else "not learned"})
    return out


def table(stage: Path) -> str:
    rs = rows(stage)
    if not rs:
        return f"## {stage.name}\n\n(no finished runs)\n"
    def num(v, fmt):
        return "—" if v is None else format(v, fmt)

    lines = [f"## {stage.name}", "", "| variant | seed | at r | at 2r | at 4r | best (t) | verdict "
             "| state change at 4r | ρ at r | averaged weights at r | skipped steps | train min | peak MiB |",
             "|---|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for x in sorted(rs, key=lambda x: (x["variant"], x["seed"])):
        lines.append(f"| {x['variant']} | {x['seed']} | {100 * x['r']:.1f} | {100 * x['2r']:.1f} | "
                     f"{100 * x['4r']:.1f} | {100 * x['best']:.1f} ({x['best_t']}) | {x['verdict']} | "
                     f"{num(x['change_4r'], '.2g')} | {num(x['rho'], '.3f')} | "
                     f"{num(None if x['ema'] is None else 100 * x['ema'], '.1f')} | {num(x['skipped'], 'd')} | "
                     f"{x['time_min']:.1f} | {num(x['mem_mb'], '.0f')} |")
    lines += ["", "| variant | seeds | at r: median [min–max] | at 4r: median [min–max] | ≥ 95 % at r | settling |",
              "|---|---:|---|---|---:|---:|"]
    for v in sorted({x["variant"] for x in rs}):
        g = [x for x in rs if x["variant"] == v]
        at_r, at_4r = [100 * x["r"] for x in g], [100 * x["4r"] for x in g]
        lines.append(f"| {v} | {len(g)} | {median(at_r):.1f} [{min(at_r):.1f}–{max(at_r):.1f}] | "
                     f"{median(at_4r):.1f} [{min(at_4r):.1f}–{max(at_4r):.1f}] | "
                     f"{sum(a >= 95 for a in at_r)}/{len(g)} | {sum(x['verdict'] == 'settling' for x in g)}/{len(g)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "studies/stability")
    print("\n".join(table(s) for s in sorted(p for p in root.iterdir() if (p / "runs").is_dir())))


if __name__ == "__main__":
    main()
