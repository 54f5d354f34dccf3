"""`loopformer reproduce`: every registered claim (`loopformer.experiments.claims`) tested in one command, with a
verdict per claim.

    plan       the runs the selected claims need: one per (experiment group, arm, seed), shared between claims of
               a group, in OUT/runs/<group>/<arm>_seed=<s> (`--quick`: one seed, and for an experiment with quick
               overrides OUT/runs/<group>-quick/...; without them the quick runs are the full run's seed 0)
    estimate   a rough time for the runs still missing, printed before anything starts
    run        the missing runs through the sweep engine (finished runs are reused, interrupted ones resumed,
               `jobs` at a time); a theory claim runs `theory verify` once
    report     OUT/report.md (a summary table first, then per claim: the paper's numbers, each arm's median
               [min–max] over seeds with its parameters and compute per answer — loops × layers and FLOPs of one
               forward pass, `loopformer.model.flops` — the paired differences, the verdict (with a note where
               the compared arms differ in compute by more than 5 %) and the run folders every number comes from),
               OUT/report.json and one plot per claim

`--scale paper` reads each claim's paper-scale experiment (`gpu`); without a CUDA device it prints the plan and
its estimated cost instead of starting. Shapes: none (orchestration only).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from loopformer.configio import shipped_config
from loopformer.errors import UserError
from loopformer.experiments.claims import (
    MAX_SEEDS,
    Claim,
    Experiment,
    compute_note,
    compute_ratio,
    diff_label,
    load_registry,
    median_range,
    metric_value,
    select,
    verdict,
)
from loopformer.experiments.stale import POLICIES, resolve_stale
from loopformer.experiments.sweep import RunSpec, run_size, run_specs
from loopformer.fileio import check_owned_folder, write_figure, write_json, write_text, write_with
from loopformer.model.flops import format_flops, forward_flops, layer_applications
from loopformer.train.config import load_run_config
from loopformer.train.run import git_commit, read_results, stored_config

SECONDS_PER_UNIT = 1.2e-10   # one thread of a 2-core machine: a demo run (LCS-6, r = 8, 3,000 steps) took 144 s
GPU_UNITS_PER_S = 1.0e14     # assumed sustained rate on one modern GPU (bf16), for --scale paper estimates
THEORY_S = 60.0
DEFAULT_MAX_SEEDS = 7        # the sequential rule's cap (`--max-seeds`)
EXPORTED = ("report.md", "report.json", "*.png", "runs")   # what `export` writes into its folder
README_BEGIN, README_END = "<!-- reproduce:begin -->", "<!-- reproduce:end -->"


@dataclass
class PlannedRun:
    claim_ids: list[str]
    group: str
    arm: str
    seed: int
    spec: RunSpec
    units: float = 0.0                # steps × batch × T × loops × layers × (12 d² + 2 T d): a compute measure
    prepared_later: bool = False      # its data comes from the experiment's `prepare` step
    compute: dict[str, int] | None = None   # per answer: {"seq_len" T, "loops" (× layers), "flops"}; set by sizing


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9=.,_-]+", "-", text).strip("-")


def experiment_of(claim: Claim, scale: str) -> Experiment | None:
    return claim.cpu if scale == "cpu" else claim.gpu


def _expand(items: list[str], data: Path) -> list[str]:
    return [s.replace("{data}", str(data)) for s in items]


def plan(claims: list[Claim], out: Path, scale: str = "cpu", quick: bool = False,
         seeds: int | None = None, extra: dict[str, int] | None = None) -> list[PlannedRun]:
    """The training runs the claims need — the arms each claim's rule compares, for each seed (theory claims need
    none) — each once. `extra`: {claim id: seeds added by the sequential rule}."""
    runs: dict[Path, PlannedRun] = {}
    data = out / "data"
    for c in claims:
        exp = experiment_of(c, scale)
        if c.kind != "train" or exp is None:
            continue
        n = 1 if quick else (seeds or exp.seeds) + (extra or {}).get(c.id, 0)
        folder = out / "runs" / (exp.group + ("-quick" if quick and exp.quick else ""))   # same settings: shared
        used = set(c.rule.arms())
        for arm in (a for a in exp.arms if a.name in used):      # the arms its rule compares
            for s in range(n):
                name = f"{_slug(arm.name)}_seed={s}"
                path = folder / name
                if path in runs:
                    runs[path].claim_ids.append(c.id)
                    continue
                overrides = [*_expand(exp.overrides, data), *(exp.quick if quick else []), *arm.overrides,
                             f"seed={s}"]
                spec = RunSpec(name, overrides, path, config=str(shipped_config(exp.config)))
                runs[path] = PlannedRun([c.id], exp.group, arm.name, s, spec, prepared_later=bool(exp.prepare))
    return list(runs.values())


def _size(run: PlannedRun) -> None:
    """Check the run's config (a bad one fails before anything runs) and set its steps, its cost for the sweep's
    progress bar, its compute `units` and its `compute` per answer."""
    cfg = load_run_config(run.spec.config, [*run.spec.overrides, f"out_dir={run.spec.out_dir}"])
    run.spec.steps, cost = run_size(cfg)
    m, T = cfg.model, cfg.model.max_len
    run.spec.cost = cost * m.supervision_steps
    run.units = run.spec.cost * cfg.train.batch_size * T * (12 * m.d_model ** 2 + 2 * T * m.d_model)
    run.compute = {"seq_len": T, "loops": layer_applications(m), "flops": forward_flops(m, T)}


def run_compute(run: PlannedRun) -> dict[str, int] | None:
    """The run's compute per answer (`PlannedRun.compute`), sizing it first if need be; None while its data is not
    prepared."""
    if run.compute is None:
        try:
            _size(run)
        except UserError:
            if not run.prepared_later:
                raise
    return run.compute


def arm_compute(claim: Claim, runs: list[PlannedRun]) -> dict[str, dict[str, int] | None]:
    """{arm: compute per answer} for the arms the claim compares, in the experiment's order (the seeds of an arm
    share its config: the first run's)."""
    out: dict[str, dict[str, int] | None] = {}
    for r in runs:
        if claim.id in r.claim_ids and r.arm not in out:
            out[r.arm] = run_compute(r)
    return out


def _compute_text(c: dict[str, int] | None) -> str:
    return "not sized until its data is prepared" if c is None else \
        f"{c['loops']} loops × layers, {format_flops(c['flops'])} per answer (T = {c['seq_len']})"


def plan_compute_line(claim: Claim, runs: list[PlannedRun]) -> str:
    """One line of the plan per claim: each compared arm's loops × layers and FLOPs per answer, and the note where
    they differ in compute."""
    if claim.kind == "theory":
        return f"claim {claim.id}: theory check, no training"
    compute = arm_compute(claim, runs)
    flops = {a: c and c["flops"] for a, c in compute.items()}
    note = compute_note(flops) or ("equal compute (within 5 %)" if compute_ratio(flops) else "")
    arms = "; ".join(f"{a}: not sized until its data is prepared" if c is None else
                     f"{a}: {c['loops']} loops × layers, {format_flops(c['flops'])}" for a, c in compute.items())
    return f"claim {claim.id}: {arms}" + (f" — {note}" if note else "")


def estimate(runs: list[PlannedRun], theory: int, jobs: int, gpu: bool = False) -> dict[str, float]:
    """Seconds for the runs not yet finished (and the theory claims), spread over `jobs` processes: rough (within
    about 2× on CPUs; a GPU's by an assumed sustained rate)."""
    unsized = 0
    for r in runs:
        try:
            _size(r)
        except UserError:          # its data is prepared by the experiment's `prepare` step, not yet run
            if not r.prepared_later:
                raise
            unsized += 1
    todo = [r for r in runs if not (r.spec.out_dir / "results.json").is_file()]
    units = sum(r.units for r in todo)
    secs = units / GPU_UNITS_PER_S * 3 if gpu else units * SECONDS_PER_UNIT
    return {"runs": len(runs), "todo": len(todo), "units": units, "unsized": unsized,
            "seconds": secs / max(1, min(jobs, len(todo) or 1)) + theory * THEORY_S}


def prepare_commands(claims: list[Claim], out: Path, scale: str) -> list[tuple[str, list[str]]]:
    """(group, the `loopformer` arguments of its `prepare` step) for each experiment that has one, once per group
    (each writes under OUT/data: `claims.check_prepare`)."""
    done: dict[str, list[str]] = {}
    for c in claims:
        exp = experiment_of(c, scale)
        if exp is not None and exp.prepare and exp.group not in done:
            done[exp.group] = _expand(exp.prepare, out / "data")
    return list(done.items())


def prepare_data(claims: list[Claim], out: Path, scale: str, progress: bool) -> None:
    """Run each experiment's `prepare` command once (e.g. tokenising a corpus into OUT/data)."""
    for group, args in prepare_commands(claims, out, scale):
        cmd = [sys.executable, "-m", "loopformer.cli", *args]
        if progress:
            print(f"reproduce: preparing data for {group}: loopformer {' '.join(args)}", file=sys.stderr)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["(no message)"])[-1]
            raise UserError(f"preparing data for {group} failed: {last}")


def run_theory(out: Path, progress: bool) -> dict[str, Any]:
    """`theory verify` once into OUT/runs/theory/results.json (reused when present)."""
    path = out / "runs" / "theory" / "results.json"
    if path.is_file():
        return read_results(path.parent)
    from loopformer.theory.verify import format_table, run_verify  # heavy: only when a theory claim is asked

    t0 = time.perf_counter()
    rows = run_verify(progress=progress)
    ok = sum(r.passed for r in rows)
    res = {"kind": "theory", "rows": len(rows), "as_expected": ok, "fraction_as_expected": ok / max(len(rows), 1),
           "failed": [f"{r.construction}: {r.case}" for r in rows if not r.passed],
           "seconds": time.perf_counter() - t0}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path.parent / "verify.md", format_table(rows) + "\n")
    write_json(path, res)
    return res


def analysis_folder(run: PlannedRun, claim: Claim) -> Path:
    """Where a claim's analysis of one run writes: RUN/analysis/<name>/."""
    return run.spec.out_dir / "analysis" / claim.analysis.name


def analysis_command(run: PlannedRun, claim: Claim, out: Path) -> list[str]:
    """The `loopformer` arguments of a claim's analysis of one run ({run}, {out}, {data} filled in)."""
    fill = {"{run}": str(run.spec.out_dir), "{out}": str(analysis_folder(run, claim)), "{data}": str(out / "data")}
    args = []
    for a in claim.analysis.command:
        for k, v in fill.items():
            a = a.replace(k, v)
        args.append(a)
    return args


def check_no_links(base: Path, path: Path) -> None:
    """A one-line UserError if a folder from below `base` down to `path` is a symbolic link or not a folder: the
    report writes under its `--out` only, never through a link it did not make."""
    here = Path(base)
    for part in Path(path).relative_to(base).parts:
        here = here / part
        if here.is_symlink() or (os.path.lexists(here) and not here.is_dir()):
            raise UserError(f"{here} is a symbolic link or a file, not a folder reproduce made; refusing to write "
                            f"through it (remove it)")


def run_analyses(claims: list[Claim], runs: list[PlannedRun], out: Path, progress: bool) -> None:
    """Each claim's analysis on each of its finished runs, once (an output already there is reused)."""
    for c in claims:
        if c.analysis is None:
            continue
        for r in runs:
            if c.id not in r.claim_ids or not (r.spec.out_dir / "results.json").is_file():
                continue
            check_no_links(out, analysis_folder(r, c))
            if (analysis_folder(r, c) / c.analysis.output()).is_file():
                continue
            args = analysis_command(r, c, out)
            if progress:
                print(f"reproduce: {c.id}: loopformer {' '.join(args)}", file=sys.stderr)
            proc = subprocess.run([sys.executable, "-m", "loopformer.cli", *args], capture_output=True, text=True)
            if proc.returncode != 0:
                last = (proc.stderr.strip().splitlines() or ["(no message)"])[-1]
                raise UserError(f"the {c.analysis.name} analysis of {r.spec.out_dir} failed: {last}")


def claim_value(claim: Claim, run: PlannedRun, res: dict[str, Any]) -> float:
    """A run's value of the claim's metric: from its results.json, or from its analysis output."""
    if claim.analysis is None:
        return metric_value(res, claim.metric)
    f = analysis_folder(run, claim) / claim.analysis.output()
    try:
        data = json.loads(f.read_text())
    except (OSError, ValueError):
        raise UserError(f"{f} is missing or not valid JSON; remove its folder to measure again") from None
    return metric_value(data, claim.metric[len("analysis."):])


# ------------------------------------------------------------------ collecting and judging
def _fmt(v: float, claim: Claim, signed: bool = False) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    x = v * claim.scale
    if claim.unit == "%":
        return f"{x:+.1f}" if signed else f"{x:.1f}"
    return f"{x:+.3g}" if signed else f"{x:.3g}"


def _fmt_judged(v: float, claim: Claim) -> str:
    """A judged value: a paired difference (signed, in the metric's units), an iso-depth share φ (unitless) or an
    arm's value."""
    if claim.rule.kind == "iso_depth":
        return "—" if v is None or math.isnan(v) else f"{v:.2f}"
    return _fmt(v, claim, signed=claim.rule.kind == "paired")


def _mr(vals: list[float], claim: Claim, signed: bool = False, judged: bool = False) -> str:
    if not vals:
        return "—"
    f = (lambda x: _fmt_judged(x, claim)) if judged else (lambda x: _fmt(x, claim, signed))
    med, lo, hi = median_range(vals)
    if len(vals) == 1:
        return f(med)
    return f"{f(med)} [{f(lo)} – {f(hi)}]"


def judge(claim: Claim, runs: list[PlannedRun], out: Path, scale: str, theory: dict | None) -> dict[str, Any]:
    """One claim's numbers and verdict from its finished runs (a run not finished counts as missing)."""
    if claim.kind == "theory":
        vals = [] if theory is None else [metric_value(theory, claim.metric)]
        v = verdict(claim.rule, vals)
        return {"claim": claim, "arms": [{"name": "verify", "values": vals, "seeds": [0] if vals else [],
                                          "runs": ["runs/theory"], "params": None, "loops": None,
                                          "flops": None, "seq_len": None}],
                "verdict": v, "higher_is_better": True, "theory": theory, "compute_note": None}
    exp = experiment_of(claim, scale)
    mine = [r for r in runs if claim.id in r.claim_ids]
    compute = arm_compute(claim, mine)
    arms, hib = [], True
    for arm in (x for x in exp.arms if x.name in {r.arm for r in mine}):
        rows = []
        for r in sorted((r for r in mine if r.arm == arm.name), key=lambda r: r.seed):
            if (r.spec.out_dir / "results.json").is_file() and (
                    claim.analysis is None or (analysis_folder(r, claim) / claim.analysis.output()).is_file()):
                res = read_results(r.spec.out_dir)
                hib = bool(res.get("higher_is_better", True)) if claim.higher_is_better is None \
                    else claim.higher_is_better
                rows.append((r.seed, claim_value(claim, r, res), res, r.spec.out_dir))
        params = rows[0][2].get("params") if rows else None
        c = compute.get(arm.name)
        loops = rows[0][2]["total_loops"] * rows[0][2]["n_layers"] if rows else (c and c["loops"])
        arms.append({"name": arm.name, "overrides": arm.overrides, "seeds": [s for s, *_ in rows],
                     "values": [v for _, v, *_ in rows], "params": params, "loops": loops,
                     "flops": c and c["flops"], "seq_len": c and c["seq_len"],
                     "runs": [str(p.relative_to(out)) for *_, p in rows]})
    by = {a["name"]: a for a in arms}
    a = by[claim.rule.a]
    if claim.rule.kind in ("paired", "iso_depth"):
        compared = [by[name] for name in claim.rule.arms()]
        common = sorted(set.intersection(*(set(x["seeds"]) for x in compared)))
        vs = [[x["values"][x["seeds"].index(s)] for s in common] for x in compared]
        v = verdict(claim.rule, vs[0], vs[1], hib, vs[2] if len(vs) > 2 else None)
    else:
        v = verdict(claim.rule, a["values"])
    # iso-depth compares the looped and the unique arms at matched depth; the one-layer arm is cheaper by design
    same = (claim.rule.a, claim.rule.b) if claim.rule.kind == "iso_depth" else tuple(x["name"] for x in arms)
    note = compute_note({x["name"]: x["flops"] for x in arms if x["name"] in same})
    return {"claim": claim, "arms": arms, "verdict": v, "higher_is_better": hib, "compute_note": note}


def _diff_label(j: dict) -> str:
    return diff_label(j["claim"].rule, j["higher_is_better"], j["claim"].metric)


def _ours(j: dict) -> str:
    c, v = j["claim"], j["verdict"]
    if not v.diffs:
        return "—"
    if c.rule.kind == "iso_depth":
        return f"{_diff_label(j)}: {_mr(v.diffs, c, judged=True)}"
    if c.rule.kind == "paired":
        unit = " points" if c.unit == "%" else ""
        return f"{_diff_label(j)}: {_mr(v.diffs, c, signed=True)}{unit}"
    return f"{c.rule.a}: {_mr(v.diffs, c)}{c.unit if c.unit == '%' else ''}"


def summary_table(judged: list[dict], compact: bool = False) -> str:
    """Markdown, one row per claim: the claim, where it comes from, the paper's numbers, ours (median [min – max]
    over seeds), the number of seeds and the verdict, with a note where the compared arms differ in compute
    (`compact`: without the source and the paper's numbers)."""
    head = ["claim", "source", "the paper", "ours: median [min – max]", "seeds", "verdict"]
    if compact:
        head = [head[0], head[3], head[4], head[5]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for j in judged:
        c, v = j["claim"], j["verdict"]
        src = f"paper, {c.figure}" if c.source == "paper" else f"library ({c.figure})"
        verdict_ = f"**{v.verdict}**" + (" (one seed)" if len(v.diffs) == 1 and c.kind == "train" else "") \
            + (f"; {j['compute_note']}" if j.get("compute_note") else "")
        cells = [f"`{c.id}`: {c.statement}", src, c.paper or "—", _ours(j), str(len(v.diffs)), verdict_]
        if compact:
            cells = [cells[0], cells[3], cells[4], cells[5]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def claim_section(j: dict, scale: str) -> str:
    c, v = j["claim"], j["verdict"]
    out = [f"## `{c.id}` — {v.verdict}", "", c.statement, ""]
    out.append(f"- Where: {'the paper, ' + c.figure if c.source == 'paper' else 'this library, ' + c.figure}"
               + (f"; docs/{c.docs}" if c.docs else ""))
    if c.paper:
        out.append(f"- The paper's numbers: {c.paper}")
    if c.kind == "train":
        exp = experiment_of(c, scale)
        common = " ".join(exp.overrides) or "(none)"
        out.append(f"- Experiment: `{exp.config}`, common overrides {common}; metric `{c.metric}`"
                   f" ({'higher' if j['higher_is_better'] else 'lower'} is better)")
    else:
        out.append(f"- Experiment: `loopformer theory verify`; metric `{c.metric}`")
    rule = c.rule
    out.append(f"- Rule: {rule.kind}" + (f" ({rule.a} − {rule.b} > {rule.margin:g}, paired by seed)"
                                          if rule.kind == "paired" else
                                          f" ({diff_label(rule, True)} > {rule.value:g}, per seed)"
                                          if rule.kind == "iso_depth" else f" ({rule.a}, threshold {rule.value:g})"))
    out.append(f"- Verdict: **{v.verdict}** — {v.reason}" + (" (one seed: a single observation)"
                                                             if len(v.diffs) == 1 and c.kind == "train" else "")
               + (f"; {j['compute_note']}" if j.get("compute_note") else ""))
    if v.interval is not None:
        lo, hi, cover = v.interval
        what = _diff_label(j) if c.rule.kind in ("paired", "iso_depth") else c.rule.a
        out.append(f"- Interval: the median of {what} lies in [{_fmt_judged(lo, c)}, {_fmt_judged(hi, c)}] with "
                   f"{cover:.1%} confidence (sign-test interval, distribution-free)")
    if j.get("sequential"):
        out.append(f"- Seeds: {j['sequential']}")
    lengths = sorted({a["seq_len"] for a in j["arms"] if a.get("seq_len")})
    if lengths:
        out.append(f"- Compute per answer: one forward pass over one sequence of T = {' / '.join(map(str, lengths))} "
                   "tokens (`loopformer.model.flops`: matmul FLOPs, timestep terms once per sequence)")
    out += ["", "| arm | overrides | parameters | loops × layers per answer | FLOPs per answer | median [min – max] "
            "| per seed | runs |", "|---|---|---|---|---|---|---|---|"]
    for a in j["arms"]:
        per = " / ".join(f"{s}: {_fmt(x, c)}" for s, x in zip(a["seeds"], a["values"])) or "not run"
        cells = [a["name"], " ".join(a.get("overrides") or []) or "—",
                 "—" if a["params"] is None else f"{a['params']:,}", "—" if a["loops"] is None else str(a["loops"]),
                 "—" if a.get("flops") is None else format_flops(a["flops"]), _mr(a["values"], c), per,
                 ", ".join(a["runs"]) or "—"]
        out.append("| " + " | ".join(cells) + " |")
    if c.rule.kind in ("paired", "iso_depth") and v.diffs:
        what = "Shares" if c.rule.kind == "iso_depth" else "Paired differences"
        out += ["", f"{what} ({_diff_label(j)}, per seed): "
                + " / ".join(_fmt_judged(d, c) for d in v.diffs)]
    if j.get("theory") and j["theory"].get("failed"):
        out += ["", "Constructions not as expected: " + "; ".join(j["theory"]["failed"])]
    if j.get("plot"):
        out += ["", f"![{c.id}]({j['plot']})"]
    return "\n".join(out)


def plot_claim(j: dict, path: Path) -> Path | None:
    """Each arm's per-seed values (dots) and median (bar)."""
    c = j["claim"]
    arms = [a for a in j["arms"] if a["values"]]
    if not arms or c.kind != "train":
        return None
    import matplotlib  # heavy: only for plots
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(arms), 3.2))
    for i, a in enumerate(arms):
        vals = [x * c.scale for x in a["values"]]
        ax.bar(i, median_range(vals)[0], color="#c8d6e5", width=0.6)
        ax.plot([i] * len(vals), vals, "o", color="#222f3e", ms=4)
    ax.set_xticks(range(len(arms)), [a["name"] for a in arms], fontsize=8)
    ax.set_ylabel(f"{c.metric} {c.unit}".strip())
    ax.set_title(f"{c.id}: {j['verdict'].verdict}", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    write_figure(fig, path)
    plt.close(fig)
    return path


def write_reproduce_report(judged: list[dict], out: Path, command: str, scale: str, quick: bool) -> dict[str, Path]:
    for j in judged:
        p = plot_claim(j, out / f"{j['claim'].id}.png")
        j["plot"] = p.name if p else None
    commit = git_commit() or {}
    head = ["# Reproduction report", "",
            f"Command: `{command}` — scale {scale}{', quick (one seed, smallest settings)' if quick else ''}; "
            f"loopformer at {commit.get('commit', 'an installed copy')[:12]}"
            f"{' (uncommitted changes)' if commit.get('dirty') else ''}; written "
            f"{datetime.now(timezone.utc).isoformat(timespec='minutes')}.", "",
            "Every number below is read from a run folder under this report's folder (the `runs` column); "
            "medians and ranges are over model seeds on the same data; paired differences pair the arms of one seed "
            "(same data and, for looped / TMLT arms, the same initial shared weights).", "", "## Summary", "",
            summary_table(judged), ""]
    text = "\n".join(head + [claim_section(j, scale) + "\n" for j in judged])
    md = write_text(out / "report.md", text)
    js = write_json(out / "report.json", {
        "command": command, "scale": scale, "quick": quick, "git": commit,
        "claims": [{"id": j["claim"].id, "statement": j["claim"].statement, "source": j["claim"].source,
                    "figure": j["claim"].figure, "paper": j["claim"].paper, "metric": j["claim"].metric,
                    "verdict": j["verdict"].verdict, "reason": j["verdict"].reason,
                    "interval": j["verdict"].interval, "sequential": j.get("sequential"),
                    "values": j["verdict"].diffs, "median": j["verdict"].median,
                    "compute_note": j.get("compute_note"),
                    "arms": [{k: a.get(k) for k in ("name", "seeds", "values", "params", "loops", "flops", "seq_len",
                                                    "runs")} for a in j["arms"]]} for j in judged]})
    return {"report": md, "json": js}


def readme_block(readme: Path) -> tuple[str, int, int]:
    """The README's text and where its reproduce block starts and ends — checked before any run: a README that is
    missing, a link, not UTF-8, or without exactly one begin marker followed by one end marker is a one-line
    UserError (a block between reversed markers would be written twice)."""
    readme = Path(readme)
    if readme.is_symlink() or not readme.is_file():
        raise UserError(f"--readme {readme}: no such file" if not os.path.lexists(readme) else
                        f"--readme {readme} is not a regular file (a folder or a link); give the file itself")
    try:
        text = readme.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"--readme {readme} is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise UserError(f"--readme {readme}: {exc.strerror or exc}") from None
    begins, ends = text.count(README_BEGIN), text.count(README_END)
    if not begins or not ends:
        raise UserError(f"{readme} has no {README_BEGIN} … {README_END} block to fill")
    if begins != 1 or ends != 1:
        raise UserError(f"--readme {readme} must hold one {README_BEGIN} and one {README_END} marker (it holds "
                        f"{begins} and {ends})")
    start, end = text.index(README_BEGIN), text.index(README_END)
    if end < start:
        raise UserError(f"--readme {readme}: the {README_END} marker comes before {README_BEGIN}")
    return text, start, end + len(README_END)


def update_readme(readme: Path, judged: list[dict], report: Path, command: str) -> None:
    """Replace the README's block between the reproduce markers with the summary table (the one source of the
    README's claim table); the README is checked again (`readme_block`) and written atomically."""
    text, start, end = readme_block(readme)
    rel = os.path.relpath(report, readme.parent)
    block = f"{README_BEGIN}\n`{command}` ([report]({rel})):\n\n{summary_table(judged, compact=True)}\n{README_END}"
    new = text[:start] + block + text[end:]
    write_with(readme, lambda tmp: tmp.write_bytes(new.encode("utf-8")))


def export(out: Path, dest: Path) -> Path:
    """A compact copy of a reproduction for version control: the report, its plots, and each run's results.json
    (and the theory check's table) at the same relative paths — no checkpoints. Copying `dest`/runs into an output
    folder later makes those runs count as finished."""
    import shutil

    check_owned_folder(dest, EXPORTED, "report.json", "reproduce --export")
    dest.mkdir(parents=True, exist_ok=True)
    for f in [out / "report.json", out / "report.md", *out.glob("*.png"), *out.glob("runs/*/*/results.json"),
              *out.glob("runs/*/*/analysis/*/*.json"), *out.glob("runs/*/*/analysis/*/*.md"),
              *out.glob("runs/theory/*")]:
        if f.is_file():
            target = dest / f.relative_to(out)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, target)
    return dest


def check_stale(runs: list[PlannedRun], out: Path, stale: str, progress: bool, checked: set[Path]) -> None:
    """`resolve_stale` on the planned runs not in `checked` (each run folder is compared once), then adds them."""
    new = [r for r in runs if r.spec.out_dir not in checked]
    resolve_stale([(r.spec.out_dir, load_run_config(r.spec.config, [*r.spec.overrides, f"out_dir={r.spec.out_dir}"]))
                   for r in new if stored_config(r.spec.out_dir).is_file()], out, stale, progress, "reproduce")
    checked.update(r.spec.out_dir for r in new)


# ------------------------------------------------------------------ the sequential rule
def sequential(claims: list[Claim], runs: list[PlannedRun], out: Path, key: str, theory: dict | None, *,
               quick: bool, seeds: int | None, max_seeds: int, jobs: int, threads: int,
               progress: bool, stale: str = "stop", checked: set[Path] | None = None) -> list[dict]:
    """Run the planned runs and judge every claim; while a training claim is inconclusive and has fewer than
    `max_seeds` seeds, plan one more seed of its arms, run it and judge it again on all of its seeds. Each judged
    claim records how its seeds were chosen (`sequential`). Under `quick` (one seed) nothing is added. Run folders
    not in `checked` are compared with their configs first (`check_stale`, policy `stale`)."""
    checked = set() if checked is None else checked
    extra: dict[str, int] = {}
    while True:
        if runs:
            check_stale(runs, out, stale, progress, checked)
            run_specs([r.spec for r in runs], None, [], jobs=jobs, threads=threads, progress=progress,
                      desc="reproduce", out=out, stale=None)
        run_analyses(claims, runs, out, progress)
        judged = [judge(c, runs, out, key, theory) for c in claims]
        more = [] if quick else [j for j in judged if _wants_seed(j, key, seeds, extra, max_seeds)]
        if not more:
            break
        for j in more:
            extra[j["claim"].id] = extra.get(j["claim"].id, 0) + 1
            if progress:
                n = len(j["verdict"].diffs)
                print(f"reproduce: {j['claim'].id} is inconclusive after {n} seeds: adding seed {n}", file=sys.stderr)
        runs = plan(claims, out, key, quick, seeds, extra)
    for j in judged:
        j["sequential"] = _seeds_note(j, key, seeds, extra, max_seeds, quick)
    return judged


def _start_seeds(claim: Claim, key: str, seeds: int | None) -> int:
    exp = experiment_of(claim, key)
    return seeds or (exp.seeds if exp is not None else 1)


def _wants_seed(j: dict, key: str, seeds: int | None, extra: dict[str, int], max_seeds: int) -> bool:
    """Whether a judged claim gets one more seed: a training claim, inconclusive, below the cap, and judged on
    every seed planned so far (a claim whose runs did not all finish is not extended)."""
    c = j["claim"]
    if c.kind != "train" or j["verdict"].verdict != "inconclusive":
        return False
    planned = _start_seeds(c, key, seeds) + extra.get(c.id, 0)
    return planned < max_seeds and len(j["verdict"].diffs) == planned


def _seeds_note(j: dict, key: str, seeds: int | None, extra: dict[str, int], max_seeds: int, quick: bool) -> str | None:
    """How a training claim's seeds were chosen, for the report."""
    c = j["claim"]
    if c.kind != "train":
        return None
    start, n = _start_seeds(c, key, seeds), len(j["verdict"].diffs)
    if quick:
        return "one seed (--quick): no seeds added"
    rule = f"sequential: {start} seeds, one more at a time while inconclusive, at most {max_seeds}"
    if j["verdict"].verdict == "inconclusive" and n >= max_seeds:
        return f"{rule}; still inconclusive at the cap of {max_seeds} seeds"
    if extra.get(c.id):
        return f"{rule}; concluded after {n} seeds"
    return f"{rule}; concluded with the first {n}" if j["verdict"].verdict != "inconclusive" else \
        f"{rule}; {n} seeds judged"


# ------------------------------------------------------------------ the command
def print_plan(claims: list[Claim], runs: list[PlannedRun], out: Path, key: str) -> None:
    """The dry run's listing: prepare steps, every run with its compute, each claim's compute line and analysis."""
    for group, cmd in prepare_commands(claims, out, key):
        print(f"  prepare {group}: loopformer {' '.join(cmd)}")
    for r in runs:
        print(f"  {r.spec.out_dir}: {r.spec.config} {' '.join(r.spec.overrides)} — {_compute_text(r.compute)}")
    for c in claims:
        print(f"  {plan_compute_line(c, runs)}")
        if c.analysis is not None:
            print(f"  claim {c.id}: then on each run: loopformer {' '.join(c.analysis.command)}")


def reproduce(claim_ids: list[str] | None = None, *, quick: bool = False, seeds: int | None = None,
              jobs: int = 2, threads: int = 1, out: str | os.PathLike = "reproduce", scale: str = "cpu",
              registry: str | None = None, progress: bool = True, dry_run: bool = False,
              readme: str | None = None, command: str = "loopformer reproduce",
              export_to: str | None = None, max_seeds: int = DEFAULT_MAX_SEEDS,
              stale: str = "stop") -> dict[str, Any]:
    """Plan, estimate, run what is missing, judge and report (see the module docstring); a claim still
    inconclusive gets one more seed at a time up to `max_seeds` (`sequential`). Run folders trained with other
    settings than their claims ask for now are handled by `stale` before anything runs ("stop" | "retrain" |
    "keep", `loopformer.experiments.stale`). Returns {"judged", "files", "estimate", "ran"}; with `dry_run` (or
    --scale paper without CUDA) only the plan and estimate."""
    if scale not in ("cpu", "paper"):
        raise UserError(f"--scale must be cpu or paper (got {scale!r})")
    if seeds is not None and not 1 <= seeds <= MAX_SEEDS:
        raise UserError(f"--seeds must be in 1..{MAX_SEEDS} (got {seeds})")
    if not 1 <= max_seeds <= MAX_SEEDS or (seeds is not None and max_seeds < seeds):
        raise UserError(f"--max-seeds must be in 1..{MAX_SEEDS} and at least --seeds (got {max_seeds})")
    if export_to:    # before any run: the export folder must be new, empty or an earlier export
        check_owned_folder(export_to, EXPORTED, "report.json", "reproduce --export")
    if readme:       # before any run: a README that cannot be filled is known now
        readme_block(Path(readme))
    if jobs < 1 or threads < 0:
        raise UserError("--jobs must be >= 1 and --threads >= 0")
    reg = load_registry(registry)
    key = "cpu" if scale == "cpu" else "gpu"
    claims = [c for c in select(reg, claim_ids, quick) if c.kind == "theory" or experiment_of(c, key) is not None]
    if not claims:
        raise UserError(f"no registered claim has a {scale}-scale experiment among those asked")
    out = Path(out)
    runs = plan(claims, out, key, quick, seeds)
    checked: set[Path] = set()                 # run folders already compared with their configs
    n_theory = sum(c.kind == "theory" and not (out / "runs" / "theory" / "results.json").is_file() for c in claims)
    gpu_plan = scale == "paper"
    start = not dry_run and (not gpu_plan or torch.cuda.is_available())
    if start:
        out.mkdir(parents=True, exist_ok=True)
        prepare_data(claims, out, key, progress)
        check_stale(runs, out, stale, progress, checked)
    elif stale not in POLICIES:
        raise UserError(f"--stale must be one of {', '.join(POLICIES)} (got {stale!r})")
    est = estimate(runs, n_theory, jobs, gpu=gpu_plan)
    where = f"{jobs} process{'es' if jobs > 1 else ''} × {threads} thread{'s' if threads != 1 else ''}"
    line = (f"reproduce: {len(claims)} claims, {est['runs']} training runs ({est['runs'] - est['todo']} finished, "
            f"reused), {n_theory} theory check(s); estimated {est['seconds'] / 60:.0f} min on {where} "
            f"({'assumed GPU rate' if gpu_plan else 'rough, within about 2×'})"
            + (f"; {est['unsized']} run(s) not sized until their data is prepared" if est["unsized"] else ""))
    print(line, file=sys.stderr if progress else sys.stdout)
    if not start:
        if gpu_plan and not torch.cuda.is_available():
            print("--scale paper: no CUDA device here — the runs it would make:")
        print_plan(claims, runs, out, key)
        return {"judged": [], "files": {}, "estimate": est, "ran": False}
    theory = run_theory(out, progress) if any(c.kind == "theory" for c in claims) else None
    judged = sequential(claims, runs, out, key, theory, quick=quick, seeds=seeds, max_seeds=max_seeds,
                        jobs=jobs, threads=threads, progress=progress, stale=stale, checked=checked)
    files = write_reproduce_report(judged, out, command, scale, quick)
    if export_to:
        files["export"] = export(out, Path(export_to))
    if readme:
        update_readme(Path(readme), judged, Path(export_to or out) / "report.md", command)
    return {"judged": judged, "files": files, "estimate": est, "ran": True}


__all__ = ["reproduce", "plan", "estimate", "judge", "summary_table", "update_readme", "readme_block", "export",
           "PlannedRun", "arm_compute", "plan_compute_line"]
