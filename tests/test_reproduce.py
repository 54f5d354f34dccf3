"""`loopformer reproduce`: the claims registry, the verdict rules on hand-made results, and a smoke run of one tiny
claim end to end (plan → runs → report, every number traced to a run folder, finished runs reused), and the compute
per answer beside each verdict (loops × layers and FLOPs per arm, a note where the compared arms differ)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from loopformer.cli import main
from loopformer.configio import shipped_config
from loopformer.errors import UserError
from loopformer.experiments.claims import Rule, compute_note, load_registry, metric_value, select, verdict
from loopformer.experiments.reproduce import plan, reproduce, update_readme
from loopformer.model import ModelConfig
from loopformer.model.flops import format_flops, forward_flops, layer_applications
from loopformer.train.config import load_run_config

TINY = ["train.steps=12", "task.n_train=256", "task.n_test=64", "train.log_every=4", "eval.max_loops=4",
        "model.d_model=16", "train.system.compile=false", "log.dynamics=false"]


def _registry(tmp_path: Path, rule: str = "{kind: paired, a: two loops, b: one loop, margin: -1.0}") -> Path:
    """A registry of one tiny training claim (margin -1: any difference passes) and one theory claim."""
    text = f"""
claims:
  - id: tiny
    statement: a tiny claim
    figure: Table 2
    paper: "66.0 -> 81.8"
    cpu:
      group: tiny
      config: cpu/demo.yaml
      overrides: {json.dumps(TINY)}
      quick: ["train.steps=8"]
      arms:
        - {{name: one loop, overrides: [model.loops=1]}}
        - {{name: two loops, overrides: [model.loops=2]}}
      seeds: 2
    rule: {rule}
  - id: proofs
    statement: constructions
    kind: theory
    metric: fraction_as_expected
    rule: {{kind: at_least, a: verify, value: 1.0}}
"""
    path = tmp_path / "claims.yaml"
    path.write_text(text)
    return path


# ------------------------------------------------------------------ verdict rules on hand-made results
@pytest.mark.parametrize("a,b,margin,hib,expect", [
    ([0.90, 0.92, 0.95], [0.80, 0.85, 0.90], 0.0, True, "reproduced"),          # every seed ahead
    ([0.80, 0.84, 0.85], [0.90, 0.85, 0.90], 0.0, True, "not reproduced"),      # no seed ahead
    ([0.90, 0.80, 0.95], [0.85, 0.85, 0.90], 0.0, True, "inconclusive"),        # the spread covers zero
    ([0.90, 0.92, 0.95], [0.80, 0.85, 0.90], 0.06, True, "inconclusive"),       # ... covers the margin
    ([0.10, 0.20], [0.30, 0.25], 0.0, False, "reproduced"),                    # lower is better: a lower
    ([0.50], [0.40], 0.0, True, "reproduced"),                                 # one seed: one observation
    ([0.94], [0.95], -0.02, True, "reproduced"),                               # "within 2 points of b"
])
def test_paired_verdicts(a, b, margin, hib, expect):
    v = verdict(Rule(kind="paired", a="A", b="B", margin=margin), a, b, higher_is_better=hib)
    assert v.verdict == expect
    sign = 1 if hib else -1
    assert v.diffs == pytest.approx([sign * (x - y) for x, y in zip(a, b)])
    assert v.median == pytest.approx(float(np.median(v.diffs)))


@pytest.mark.parametrize("kind,vals,value,expect", [
    ("at_least", [0.95, 0.97, 0.91], 0.90, "reproduced"),
    ("at_least", [0.85, 0.97, 0.91], 0.90, "inconclusive"),
    ("at_least", [0.85, 0.80, 0.89], 0.90, "not reproduced"),
    ("at_most", [0.01, 0.02], 0.05, "reproduced"),
    ("at_most", [0.06, 0.07], 0.05, "not reproduced"),
])
def test_threshold_verdicts(kind, vals, value, expect):
    assert verdict(Rule(kind=kind, a="A", value=value), vals).verdict == expect


def test_no_runs_is_not_run():
    assert verdict(Rule(kind="paired", a="A", b="B"), [], []).verdict == "not run"
    assert verdict(Rule(kind="at_least", a="A"), []).verdict == "not run"


def test_metric_paths_and_the_derived_halting_metric():
    res = {"test": {"accuracy": 0.9}, "budgets": {"budgets": [{"metrics": {"accuracy": 0.5}}]},
           "halting": {"metric": "accuracy", "higher_is_better": True, "fixed": {"metrics": {"accuracy": 0.90}},
                       "rules": [{"metrics": {"accuracy": 0.897}, "loops_saved": 0.55}]}}
    assert metric_value(res, "test.accuracy") == 0.9
    assert metric_value(res, "budgets.budgets.0.metrics.accuracy") == 0.5
    assert metric_value(res, "halting_saved_at_par") == 0.55                     # 0.3 points below: at par
    res["halting"]["rules"][0]["metrics"]["accuracy"] = 0.89
    assert metric_value(res, "halting_saved_at_par") == 0.0                      # 1 point below: no saving
    with pytest.raises(UserError, match="no 'nope'"):
        metric_value(res, "test.nope")


# ------------------------------------------------------------------ the registry
def test_shipped_registry_is_valid_and_covers_the_paper():
    reg = load_registry()
    ids = [c.id for c in reg.claims]
    figures = {c.figure for c in reg.claims if c.source == "paper"}
    assert {"Table 2", "Table 3", "Table 4"} <= figures
    assert any(c.kind == "theory" for c in reg.claims) and any(c.source == "library" for c in reg.claims)
    quick = [c.id for c in select(reg, quick=True)]
    assert quick and set(quick) < set(ids)
    runs = plan(select(reg, quick=True), Path("/nonexistent"), quick=True)
    assert all(r.seed == 0 for r in runs) and len({r.spec.out_dir for r in runs}) == len(runs)
    # without quick overrides a quick run is the full run's seed 0 (a full reproduction reuses it)
    full = {r.spec.out_dir for r in plan(select(reg), Path("/nonexistent"))}
    assert all(r.spec.out_dir in full for r in runs)
    # claims of one group share runs
    shared = [r for r in plan(reg.claims, Path("/x")) if len(r.claim_ids) > 1]
    assert shared and all(r.group in ("lcs-demo", "dial-labels") for r in shared)


@pytest.mark.parametrize("body,match", [
    ("rule: {kind: paired, a: one loop, b: nobody}", "rule names arm 'nobody'"),
    ("rule: {kind: sometimes, a: one loop}", "rule.kind"),
])
def test_registry_errors(tmp_path, body, match):
    path = _registry(tmp_path, body.split("rule: ", 1)[1])
    with pytest.raises(UserError, match=match):
        load_registry(str(path))


PREPARE = '      prepare: [data, gen, pointer_chase, --out, "{data}/p", --train, "8", --test, "4"]\n'


@pytest.mark.parametrize("edit,match", [
    (("id: tiny", "id: ../elsewhere"), "claim id '../elsewhere'"),
    (("group: tiny", "group: a/b"), "group 'a/b'"),
    (("name: one loop,", "name: .hidden,"), "arm '.hidden'"),
    (("      arms:\n", PREPARE.replace("data, gen", "convert, x.pt") + "      arms:\n"), "may run text prepare or "),
    (("      arms:\n", PREPARE.replace('"{data}/p"', "/tmp/anywhere") + "      arms:\n"), "one --out under {data}"),
    (("      arms:\n", PREPARE.replace('"{data}/p"', '"{data}/../../x"') + "      arms:\n"), "under {data}"),
    (("      arms:\n", PREPARE.replace("]", ", --force]") + "      arms:\n"), "may not pass --force"),
])
def test_registry_names_and_prepare_steps_stay_under_out(tmp_path, capsys, edit, match):
    """Claim ids, groups and arms are one folder name each, and a prepare step writes only under the report's data
    folder: anything else is one line (exit 2) before any work."""
    path = _registry(tmp_path)
    path.write_text(path.read_text().replace(*edit, 1))
    rc = main(["reproduce", "--registry", str(path), "--out", str(tmp_path / "o"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and match in err and "\n" not in err
    assert not (tmp_path / "o").exists()


def test_dry_run_shows_the_prepare_steps(tmp_path, capsys):
    path = _registry(tmp_path)
    path.write_text(path.read_text().replace("      arms:\n", PREPARE + "      arms:\n", 1))
    assert main(["reproduce", "--registry", str(path), "--out", str(tmp_path / "o"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"prepare tiny: loopformer data gen pointer_chase --out {tmp_path / 'o' / 'data'}/p" in out
    assert not (tmp_path / "o").exists()


def test_unknown_claim_and_bad_options_exit_2(tmp_path, capsys):
    reg = str(_registry(tmp_path))
    for argv, match in [(["--claims", "nope"], "unknown claim"), (["--seeds", "0"], "--seeds"),
                        (["--jobs", "0"], "--jobs")]:
        rc = main(["reproduce", "--registry", reg, "--out", str(tmp_path / "o"), "--quiet", *argv])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and match in err and "\n" not in err
    assert not (tmp_path / "o").exists()


def test_scale_paper_without_a_gpu_prints_the_plan(tmp_path, capsys):
    rc = main(["reproduce", "--scale", "paper", "--claims", "loops-help", "--out", str(tmp_path / "p"), "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0 and "no CUDA device" in out and "lcs60.yaml" in out and "model.loops=50" in out
    assert not (tmp_path / "p").exists()


# ------------------------------------------------------------------ end to end
def test_reproduce_one_tiny_claim_end_to_end(tmp_path, capsys):
    reg = str(_registry(tmp_path))
    out = tmp_path / "rep"
    theory = out / "runs" / "theory"
    theory.mkdir(parents=True)   # the theory check is slow (`theory verify`): a finished one is reused
    (theory / "results.json").write_text(json.dumps({"kind": "theory", "rows": 3, "as_expected": 3,
                                                     "fraction_as_expected": 1.0, "failed": []}))
    rc = main(["reproduce", "--registry", reg, "--out", str(out), "--jobs", "1", "--quiet"])
    printed = capsys.readouterr().out
    assert rc == 0 and re.search(r"tiny\s+reproduced", printed) and re.search(r"proofs\s+reproduced", printed)
    report = (out / "report.md").read_text()
    data = json.loads((out / "report.json").read_text())
    tiny = data["claims"][0]
    assert tiny["verdict"] == "reproduced" and len(tiny["values"]) == 2
    # every number traces to a run folder in the output, and the report shows it
    for arm in tiny["arms"]:
        assert arm["seeds"] == [0, 1]
        for run, value in zip(arm["runs"], arm["values"]):
            res = json.loads((out / run / "results.json").read_text())
            assert res["test"]["accuracy"] == value
            assert run in report
        assert f"{arm['values'][0] * 100:.1f}" in report
    a, b = tiny["arms"][1]["values"], tiny["arms"][0]["values"]
    assert tiny["values"] == pytest.approx([x - y for x, y in zip(a, b)])
    assert "## Summary" in report and "66.0 -> 81.8" in report and (out / "tiny.png").is_file()
    # a second call reuses every finished run: nothing trains again
    before = {p: p.stat().st_mtime for p in out.glob("runs/tiny/*/results.json")}
    res = reproduce(["tiny"], registry=reg, out=out, jobs=1, progress=False, export_to=str(tmp_path / "exp"))
    assert res["estimate"]["todo"] == 0
    exported = sorted(str(p.relative_to(tmp_path / "exp")) for p in (tmp_path / "exp").rglob("*") if p.is_file())
    assert "report.md" in exported and "runs/tiny/one-loop_seed=0/results.json" in exported
    assert not any("checkpoint" in p for p in exported)
    assert {p: p.stat().st_mtime for p in out.glob("runs/tiny/*/results.json")} == before
    # the README block is filled from the report
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- reproduce:begin -->\nold\n<!-- reproduce:end -->\nrest\n")
    update_readme(readme, res["judged"], res["files"]["report"], "loopformer reproduce")
    text = readme.read_text()
    assert "old" not in text and "| `tiny`: a tiny claim |" in text and text.endswith("rest\n")
    assert "66.0 -> 81.8" not in text                   # compact: the paper's numbers are in the report
    with pytest.raises(UserError, match="no <!-- reproduce:begin -->"):
        update_readme(tmp_path / "claims.yaml", res["judged"], res["files"]["report"], "x")


def test_run_theory_writes_its_folder(tmp_path, monkeypatch):
    """The theory check writes runs/theory/{results.json, verify.md} into a fresh output (the real `theory verify`
    runs in tests/test_theory.py); a second call reuses it."""
    import loopformer.theory.verify as verify
    from loopformer.experiments.reproduce import run_theory

    rows = [verify.Row("Lemma A.5", "case", "D=1", 1, 0, 0, "repaired", "holds"),
            verify.Row("Lemma A.6", "case", "D=1", 1, 2, 1, "as printed", "holds")]
    monkeypatch.setattr(verify, "run_verify", lambda progress=True: rows)
    res = run_theory(tmp_path / "fresh", progress=False)
    assert res["rows"] == 2 and res["as_expected"] == 1 and res["fraction_as_expected"] == 0.5
    assert res["failed"] == ["Lemma A.6: case"]
    assert (tmp_path / "fresh" / "runs" / "theory" / "verify.md").read_text().count("Lemma") == 2
    monkeypatch.setattr(verify, "run_verify", lambda progress=True: [])
    assert run_theory(tmp_path / "fresh", progress=False)["rows"] == 2


# ------------------------------------------------------------------ compute beside the verdict
def _finish(reg: Path, out: Path, claim: str) -> dict[str, ModelConfig]:
    """Hand-made results.json for every run of `claim` (each arm's accuracy grows with its loops): the report reads
    them as finished runs, nothing trains. Returns each arm's model config."""
    models = {}
    for r in plan(select(load_registry(str(reg)), [claim]), out):
        m = load_run_config(r.spec.config, r.spec.overrides).model
        models[r.arm] = m
        r.spec.out_dir.mkdir(parents=True)
        (r.spec.out_dir / "results.json").write_text(json.dumps({
            "higher_is_better": True, "test": {"accuracy": 0.4 + 0.1 * m.loops + 0.01 * r.seed}, "params": 1234,
            "total_loops": m.total_loops, "n_layers": m.n_layers}))
    return models


def test_compute_note_names_arms_that_differ_by_more_than_5_percent():
    assert compute_note({"a": 100, "b": 104}) is None                                  # within 5 %
    assert compute_note({"a": 100, "b": 106}) == "arms differ in compute: b 1.1× the FLOPs of a"
    assert compute_note({"few": 400, "many": 100}) == "arms differ in compute: few 4.0× the FLOPs of many"
    assert compute_note({"a": 100, "b": None}) is None                                 # unknown: no claim
    assert compute_note({"a": 100}) is None                                            # one arm: nothing to compare


def test_report_shows_compute_per_arm_and_notes_unequal_compute(tmp_path):
    reg, out = _registry(tmp_path), tmp_path / "rep"
    models = _finish(reg, out, "tiny")
    res = reproduce(["tiny"], registry=str(reg), out=out, jobs=1, progress=False)
    assert res["estimate"]["todo"] == 0
    tiny = json.loads((out / "report.json").read_text())["claims"][0]
    assert tiny["verdict"] == "reproduced" and tiny["reason"] == res["judged"][0]["verdict"].reason
    report = (out / "report.md").read_text()
    assert "| loops × layers per answer | FLOPs per answer |" in report
    for arm in tiny["arms"]:
        m = models[arm["name"]]
        assert arm["loops"] == m.loops == layer_applications(m)
        assert arm["seq_len"] == m.max_len and arm["flops"] == forward_flops(m, m.max_len)
        assert f"| {arm['name']} | model.loops={m.loops} | 1,234 | {m.loops} | {format_flops(arm['flops'])} |" \
            in report
    one, two = (a["flops"] for a in tiny["arms"])
    assert 1.05 < two / one < 2                     # twice the block, the same read-out
    note = f"arms differ in compute: two loops {two / one:.1f}× the FLOPs of one loop"
    assert tiny["compute_note"] == note
    assert f"| 2 | **reproduced**; {note} |" in report                           # the summary row, by the verdict
    assert re.search(rf"- Verdict: \*\*reproduced\*\* — .*; {re.escape(note)}\n", report)


def test_equal_compute_gets_no_note(tmp_path, capsys):
    """Arms that differ only in their initialisation cost the same per answer: no note, in the report or the plan."""
    reg, out = _registry(tmp_path), tmp_path / "rep"
    reg.write_text(reg.read_text().replace("[model.loops=1]", "[model.loops=2, model.init_std=0.05]"))
    _finish(reg, out, "tiny")
    reproduce(["tiny"], registry=str(reg), out=out, jobs=1, progress=False)
    tiny = json.loads((out / "report.json").read_text())["claims"][0]
    assert tiny["compute_note"] is None and len({a["flops"] for a in tiny["arms"]}) == 1
    assert "arms differ in compute" not in (out / "report.md").read_text()
    assert main(["reproduce", "--registry", str(reg), "--claims", "tiny", "--out", str(out), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "equal compute (within 5 %)" in printed and "arms differ" not in printed


def test_dry_run_lists_compute_per_arm(tmp_path, capsys):
    reg = _registry(tmp_path)
    assert main(["reproduce", "--registry", str(reg), "--quick", "--out", str(tmp_path / "o"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    cfg = load_run_config(str(shipped_config("cpu/demo.yaml")), TINY).model
    flops = {r: forward_flops(cfg.replace(loops=r), cfg.max_len) for r in (1, 2)}
    for r, name in ((1, "one-loop"), (2, "two-loops")):      # each run's line: loops × layers and FLOPs per answer
        assert re.search(rf"{name}_seed=0: .* — {r} loops × layers, {re.escape(format_flops(flops[r]))} per answer "
                         rf"\(T = {cfg.max_len}\)\n", out)
    assert (f"claim tiny: one loop: 1 loops × layers, {format_flops(flops[1])}; two loops: 2 loops × layers, "
            f"{format_flops(flops[2])} — arms differ in compute: two loops {flops[2] / flops[1]:.1f}× the FLOPs of "
            "one loop") in out
    assert "claim proofs: theory check, no training" in out
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------ the sign test and sequential seeds
@pytest.mark.parametrize("k,n,expect", [
    (3, 3, "reproduced"), (0, 3, "not reproduced"), (2, 3, "inconclusive"), (4, 4, "reproduced"),
    (3, 4, "inconclusive"), (4, 5, "inconclusive"), (5, 6, "reproduced"), (6, 7, "reproduced"),
    (5, 7, "inconclusive"), (1, 7, "not reproduced"), (1, 2, "inconclusive"), (2, 2, "reproduced"),
])
def test_the_sign_test_rule(k, n, expect):
    """Reproduced when P(X >= k) <= 1/8 under Binomial(n, 1/2), written out: 5 of 6 is 7/64, 6 of 7 is 8/128."""
    a = [1.0] * k + [0.0] * (n - k)
    assert verdict(Rule(kind="paired", a="A", b="B"), a, [0.5] * n).verdict == expect


def test_the_median_interval_is_the_sign_tests():
    from loopformer.experiments.claims import median_interval
    assert median_interval([0.3, 0.1]) is None
    assert median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0, 0.75)                  # 1 - 2/8
    assert median_interval([7.0, 1, 2, 3, 4, 5, 6]) == (2, 6, 0.875)             # j = 2: 1 - 2 * 8/128
    v = verdict(Rule(kind="paired", a="A", b="B"), [1, 2, 3, 4], [0, 0, 0, 0])
    assert v.interval == (1, 4, 0.875) and "sign test: p = 0.0625" in v.reason


def _fake_training(monkeypatch, outcome):
    """Replace training by results.json files whose accuracy is outcome(arm folder name, seed)."""
    import loopformer.experiments.reproduce as rep

    def fake_run_specs(specs, *args, **kwargs):
        for spec in specs:
            if not (spec.out_dir / "results.json").is_file():
                spec.out_dir.mkdir(parents=True, exist_ok=True)
                seed = int(spec.name.rsplit("=", 1)[1])
                res = {"test": {"accuracy": outcome(spec.name, seed)}, "higher_is_better": True,
                       "total_loops": 1, "n_layers": 1, "params": 10}
                (spec.out_dir / "results.json").write_text(json.dumps(res))
    monkeypatch.setattr(rep, "run_specs", fake_run_specs)


@pytest.mark.parametrize("pattern,max_seeds,verdict_,seeds,note", [
    ("+-++++", 7, "reproduced", 6, "concluded after 6 seeds"),             # 2/3, 3/4, 4/5, then 5/6
    ("+-+-+-+-", 7, "inconclusive", 7, "still inconclusive at the cap of 7 seeds"),
    ("+++", 7, "reproduced", 3, "concluded with the first 3"),
    ("+-+-", 4, "inconclusive", 4, "still inconclusive at the cap of 4 seeds"),
])
def test_inconclusive_claims_get_seeds_up_to_the_cap(tmp_path, monkeypatch, pattern, max_seeds, verdict_, seeds,
                                                      note):
    reg = _registry(tmp_path, "{kind: paired, a: two loops, b: one loop, margin: 0.0}")
    reg.write_text(reg.read_text().replace("seeds: 2", "seeds: 3"))
    _fake_training(monkeypatch, lambda name, s: (0.9 if pattern[s] == "+" else 0.1) if name.startswith("two")
                   else 0.5)
    out = tmp_path / "rep"
    res = reproduce(["tiny"], registry=str(reg), out=out, jobs=1, progress=False, max_seeds=max_seeds)
    j = res["judged"][0]
    assert j["verdict"].verdict == verdict_ and len(j["verdict"].diffs) == seeds
    assert note in j["sequential"]
    assert sorted(p.name for p in (out / "runs" / "tiny").iterdir()) == sorted(
        f"{arm}_seed={s}" for arm in ("one-loop", "two-loops") for s in range(seeds))
    report = (out / "report.md").read_text()
    assert note in report and "sign-test interval" in report
    assert json.loads((out / "report.json").read_text())["claims"][0]["sequential"] == j["sequential"]


def test_quick_adds_no_seeds_and_bad_caps_exit_2(tmp_path, monkeypatch, capsys):
    reg = _registry(tmp_path, "{kind: paired, a: two loops, b: one loop, margin: 0.0}")
    _fake_training(monkeypatch, lambda name, s: 0.5)              # every difference 0: not above the margin
    res = reproduce(["tiny"], registry=str(reg), out=tmp_path / "q", jobs=1, progress=False, quick=True)
    assert len(res["judged"][0]["verdict"].diffs) == 1 and "no seeds added" in res["judged"][0]["sequential"]
    for bad in (["--max-seeds", "0"], ["--seeds", "5", "--max-seeds", "4"]):
        assert main(["reproduce", "--registry", str(reg), "--out", str(tmp_path / "x"), *bad]) == 2
        assert "--max-seeds must be" in capsys.readouterr().err


# ------------------------------------------------------------------ the iso-depth rule
def test_iso_depth_shares_by_hand():
    rule = Rule(kind="iso_depth", a="looped", b="unique", c="one", value=0.5)
    a, b, c = [0.80, 0.60, 0.70, 0.50], [0.90, 0.90, 0.70, 0.90], [0.50, 0.50, 0.70, 0.10]
    v = verdict(rule, a, b, True, c)
    assert v.diffs == pytest.approx([0.75, 0.25, 0.5])        # (a - c) / (b - c); seed 2 ties: left out
    assert v.verdict == "inconclusive" and "1 seed without φ" in v.reason and "in 1 of 3" in v.reason
    lower = verdict(rule, [1 - x for x in a], [1 - x for x in b], False, [1 - x for x in c])
    assert lower.diffs == pytest.approx(v.diffs)               # lower is better: the same shares
    assert verdict(rule, [0.9] * 3, [0.8] * 3, True, [0.5] * 3).verdict == "reproduced"   # φ = 4/3
    assert verdict(rule, [0.9], [0.5], True, [0.5]).verdict == "not run"


def test_an_iso_depth_claim_is_judged_and_reported(tmp_path, monkeypatch):
    reg = _registry(tmp_path, "{kind: iso_depth, a: two loops, b: two layers, c: one loop, value: 0.5}")
    text = reg.read_text().replace("        - {name: two loops, overrides: [model.loops=2]}\n",
                                   "        - {name: two loops, overrides: [model.loops=2]}\n"
                                   "        - {name: two layers, overrides: [model.n_layers=2, model.loops=1]}\n")
    reg.write_text(text.replace("seeds: 2", "seeds: 3"))
    values = {"one-loop": 0.5, "two-loops": 0.8, "two-layers": 0.9}
    _fake_training(monkeypatch, lambda name, s: values[name.split("_")[0]] - 0.01 * s)
    out = tmp_path / "rep"
    res = reproduce(["tiny"], registry=str(reg), out=out, jobs=1, progress=False)
    j = res["judged"][0]
    assert j["verdict"].verdict == "reproduced" and j["verdict"].diffs == pytest.approx([0.75] * 3)
    assert {a["name"] for a in j["arms"]} == {"one loop", "two loops", "two layers"}
    assert j["compute_note"] is None       # looped and unique match; the one-loop arm is cheaper by design
    report = (out / "report.md").read_text()
    assert "φ = (two loops − one loop) / (two layers − one loop): 0.75" in report
    assert "Shares (φ" in report


def test_a_family_of_claims_is_selected_by_the_start_of_its_ids():
    reg = load_registry()
    ids = [c.id for c in reg.claims]
    assert [c.id for c in select(reg, ["iso-depth"])] == ["iso-depth-lcs", "iso-depth-ed"]
    assert [c.id for c in select(reg, ["continuity-timestep", "iso-depth"])] == \
        [i for i in ids if i in ("continuity-timestep", "iso-depth-lcs", "iso-depth-ed")]
    assert [c.id for c in select(reg, ["timestep"])] == ["timestep-helps", "timestep-holds-deep",
                                                        "timestep-settles-circuit"]
    assert [c.id for c in select(reg, ["iso-depth-lcs", "iso-depth"])] == ["iso-depth-lcs", "iso-depth-ed"]
    for bad in ("iso-dep", "deep", "iso-depth-"):      # a family ends at a dash boundary of the ids
        with pytest.raises(UserError, match="unknown claim"):
            select(reg, [bad])


def test_the_shipped_iso_depth_claims_plan_their_three_arms(tmp_path):
    claims = select(load_registry(), ["iso-depth"])
    runs = plan(claims, tmp_path)
    assert sorted({(r.group, r.arm) for r in runs}) == sorted(
        {("lcs-demo", a) for a in ("looped many", "unique 8", "one layer")}
        | {("ed-iso", a) for a in ("looped r=8", "unique 8", "one layer")})
    assert len(runs) == 18


# ------------------------------------------------------------------ the analysis step
ANALYSIS = ('    analysis: {command: [analyze, continuity, "{run}", --data, "{data}/c", --out, "{out}"]}\n'
            '    higher_is_better: false\n')


def _analysis_registry(tmp_path: Path, analysis: str = ANALYSIS,
                       metric: str = "analysis.models.*.coefficient") -> Path:
    reg = _registry(tmp_path, "{kind: paired, a: two loops, b: one loop, margin: 0.0}")
    head = f"    metric: {metric}\n{analysis}    rule: {{kind: paired"
    text = reg.read_text().replace("    rule: {kind: paired", head, 1).replace("seeds: 2", "seeds: 3")
    reg.write_text(text)
    return reg


@pytest.mark.parametrize("analysis,metric,match", [
    (ANALYSIS.replace("analyze, continuity", "analyze, everything"), "analysis.x", "'analyze everything' is not an "
                                                                               "analysis"),
    (ANALYSIS.replace('--out, "{out}"', "--out, /tmp/x"), "analysis.x", "must write with --out {out}"),
    (ANALYSIS.replace('"{run}", ', ""), "analysis.x", "must name the run as {run}"),
    (ANALYSIS, "test.accuracy", "with an analysis step the metric is analysis."),
    ("", "analysis.x", "reads an analysis, but the claim has none"),
])
def test_a_malformed_analysis_step_is_one_line(tmp_path, capsys, analysis, metric, match):
    reg = _analysis_registry(tmp_path, analysis, metric)
    rc = main(["reproduce", "--registry", str(reg), "--out", str(tmp_path / "o"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and match in err and "\n" not in err
    assert not (tmp_path / "o").exists()


def test_an_analysis_step_is_run_once_per_run_and_judged(tmp_path, monkeypatch):
    """Each finished run of the claim's arms gets its analysis once (filled-in command, output in RUN/analysis/NAME),
    the claim is judged on the output's metric with the claim's direction (lower is better here), and the export
    carries the outputs."""
    import subprocess as sp

    import loopformer.experiments.reproduce as rep

    reg = _analysis_registry(tmp_path)
    _fake_training(monkeypatch, lambda name, s: 0.5)
    calls, real_run = [], sp.run

    def fake_run(cmd, **kw):
        if cmd[1:3] != ["-m", "loopformer.cli"]:                   # git and the rest: as they are
            return real_run(cmd, **kw)
        args = cmd[3:]
        calls.append(args)
        run = Path(args[2])
        out = Path(args[args.index("--out") + 1])
        assert out == run / "analysis" / "continuity" and args[args.index("--data") + 1] == str(tmp_path / "o" /
                                                                                                "data" / "c")
        coefficient = (2.0 if run.name.startswith("one") else 1.0) + 0.1 * int(run.name[-1])   # looped: higher
        out.mkdir(parents=True)
        (out / "continuity.json").write_text(json.dumps({"models": {run.name: {"coefficient": coefficient}}}))
        return sp.CompletedProcess(cmd, 0, "", "")
    monkeypatch.setattr(rep.subprocess, "run", fake_run)
    res = reproduce(["tiny"], registry=str(reg), out=tmp_path / "o", jobs=1, progress=False,
                    export_to=str(tmp_path / "exp"))
    j = res["judged"][0]
    assert len(calls) == 6 and all(c[:2] == ["analyze", "continuity"] for c in calls)
    assert j["verdict"].verdict == "reproduced" and j["verdict"].diffs == pytest.approx([1.0] * 3)   # b − a
    assert not j["higher_is_better"]
    assert (tmp_path / "exp" / "runs" / "tiny" / "two-loops_seed=0" / "analysis" / "continuity" /
            "continuity.json").is_file()
    reproduce(["tiny"], registry=str(reg), out=tmp_path / "o", jobs=1, progress=False)
    assert len(calls) == 6                                           # outputs there: nothing measured again


# ------------------------------------------------------------------ the paper's tables at paper scale
def test_every_row_of_the_paper_tables_is_sized_by_hand(capsys):
    from loopformer.experiments.paper import GPU_FLOPS, cells, load_tables, row_commands, size_cell

    rows = load_tables().rows
    assert [r.table for r in rows] == ["Table 2"] * 6 + ["Table 3", "Table 4"]
    assert [len(cells(r)) for r in rows] == [9, 9, 9, 9, 9, 9, 3, 3]
    lcs = rows[2]
    assert cells(lcs)[0] == ("standard L = 12", ["model.n_layers=12", "model.loops=1"])
    assert cells(lcs)[-1] == ("TMLT r = 100", ["model.loops=100", "model.timestep=true"])
    c = size_cell(lcs, ["model.loops=50", "model.timestep=false"])
    cfg = load_run_config(str(shipped_config("lcs60.yaml")), ["model.loops=50"])
    assert c["flops"] == forward_flops(cfg.model, cfg.model.max_len) and c["loops"] == 50
    assert c["steps"] == 781_250                       # 50 epochs of 1M rows at batch 64
    assert c["gpu_hours"] == pytest.approx(3 * c["flops"] * 64 * 781_250 / GPU_FLOPS / 3600)
    data, sweep = row_commands(lcs, "out")
    assert data == ["data", "gen", "lcs", "--opt", "length=60", "--train", "1e6", "--test", "1e3", "--out",
                    "data/lcs60", "--workers", "8"]
    assert sweep[2:] == ["task.data_dir=data/lcs60", "--grid", "model.loops=5,10,50,100", "model.timestep=false,true",
                         "--baseline", "model.n_layers=12", "model.loops=1", "--out", "out"]
    assert row_commands(rows[6], "o")[0] is None       # ICL: made on the fly
    assert main(["reproduce", "--paper-tables"]) == 0
    out = capsys.readouterr().out
    assert out.count("**row total**") == 8 and "GPU hours** for one seed of every cell" in out
    assert "WikiText-103" in out and "test perplexity: L = 12 20.5" in out
