"""Sweeps and reports: grid expansion, finished runs skipped, interrupted runs completed, the Table-2 layout of
the markdown / CSV tables (values checked against each run's results.json) and the plots."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from test_train import TINY

from loopformer.cli import main
from loopformer.errors import UserError
from loopformer.experiments.report import find_runs, table, write_report
from loopformer.experiments.sweep import expand, parse_grid, run_name, run_sweep


def _config(tmp_path: Path) -> Path:
    from omegaconf import OmegaConf

    cfg = tmp_path / "tiny.yaml"

    cfg.write_text(OmegaConf.to_yaml(OmegaConf.from_dotlist(TINY + ["train.steps=3"])))
    return cfg


def test_grid_expansion_and_names(tmp_path):
    grid = parse_grid(["model.loops=2,4", "model.timestep=false,true"])
    assert grid == [("model.loops", ["2", "4"]), ("model.timestep", ["false", "true"])]
    specs = expand(grid, ["model.n_layers=3", "model.loops=1"], tmp_path)
    assert [s.name for s in specs] == ["baseline_n_layers=3_loops=1", "loops=2_timestep=false",
                                       "loops=2_timestep=true", "loops=4_timestep=false", "loops=4_timestep=true"]
    assert specs[0].baseline and specs[3].overrides == ["model.loops=4", "model.timestep=false"]
    assert run_name(["a.b=1"]) == "b=1"
    with pytest.raises(UserError):
        parse_grid(["model.loops"])


def test_sweep_report_skip_and_complete(tmp_path, capsys):
    cfg = _config(tmp_path)
    out = tmp_path / "sw"
    specs = run_sweep(str(cfg), parse_grid(["model.loops=2,3", "model.timestep=false,true"]),
                      ["model.n_layers=2", "model.loops=1"], out, progress=False)
    assert len(specs) == 5 and all((s.out_dir / "results.json").is_file() for s in specs)
    rep = write_report(out)
    for f in ("table.md", "table.csv", "runs.csv", "loops.png", "loopwise.png"):
        assert (out / f).is_file() and (out / f).stat().st_size > 0, f
    assert (out / "loops.png").read_bytes()[:4] == b"\x89PNG"

    # Table 2 layout: one task row, the standard column first, then Looped r=..., then w/ Timestep r=...
    md = rep["markdown"].splitlines()
    assert md[0] == "| Task | Standard L=2 | Looped r=2 | r=3 | w/ Timestep r=2 | r=3 |"
    row = [c.strip() for c in md[2].strip("|").split("|")]
    assert row[0] == "LCS (3)"
    by_cell = {}
    for r in find_runs(out):
        key = ("standard", r["n_layers"]) if r["variant"] == "standard" else (r["variant"], r["loops"])
        by_cell[key] = 100 * r["test"]["accuracy"]
    want = [by_cell[("standard", 2)], by_cell[("looped", 2)], by_cell[("looped", 3)], by_cell[("tmlt", 2)],
            by_cell[("tmlt", 3)]]
    assert [float(v) for v in row[1:]] == pytest.approx(want, abs=0.051)
    rows = list(csv.reader(io.StringIO((out / "table.csv").read_text())))
    assert rows[0][:3] == ["task", "metric", "Standard L=2"] and rows[1][0] == "LCS (3)"
    assert [100 * float(v) for v in rows[1][2:]] == pytest.approx(want, abs=1e-3)

    # finished runs are skipped: a second call trains nothing
    stamps = {s.name: (s.out_dir / "results.json").stat().st_mtime_ns for s in specs}
    run_sweep(str(cfg), parse_grid(["model.loops=2,3", "model.timestep=false,true"]),
              ["model.n_layers=2", "model.loops=1"], out, progress=False)
    assert stamps == {s.name: (s.out_dir / "results.json").stat().st_mtime_ns for s in specs}

    # an interrupted run (checkpoint, no results) is resumed, not restarted
    victim = specs[1].out_dir
    (victim / "results.json").unlink()
    metrics = (victim / "metrics.jsonl").read_text().splitlines()
    before = [json.loads(x) for x in metrics if '"train"' in x]
    run_sweep(str(cfg), parse_grid(["model.loops=2,3", "model.timestep=false,true"]),
              ["model.n_layers=2", "model.loops=1"], out, progress=False)
    assert (victim / "results.json").is_file()
    after = [json.loads(x) for x in (victim / "metrics.jsonl").read_text().splitlines() if '"train"' in x]
    assert [r["loss"] for r in after] == [r["loss"] for r in before]

    # `loopformer report DIR` rebuilds the same table
    (out / "table.md").unlink()
    assert main(["report", str(out)]) == 0
    assert (out / "table.md").read_text() == rep["markdown"]
    assert "Standard L=2" in capsys.readouterr().out


def test_report_errors(tmp_path):
    with pytest.raises(UserError, match="no finished runs"):
        table([])
    assert main(["report", str(tmp_path / "none")]) == 2
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2


def test_sweep_rejects_bad_config_before_running(tmp_path):
    cfg = _config(tmp_path)
    with pytest.raises(UserError, match="loops"):
        run_sweep(str(cfg), parse_grid(["model.loops=2,0"]), [], tmp_path / "bad", progress=False)
    assert not (tmp_path / "bad" / "runs").exists()


@pytest.mark.slow
def test_parallel_sweep_cli(tmp_path):
    cfg = _config(tmp_path)
    out = tmp_path / "par"
    assert main(["sweep", str(cfg), "--grid", "model.loops=2,3", "--out", str(out), "--jobs", "2", "--threads", "1",
                 "--quiet"]) == 0
    assert len(find_runs(out)) == 2 and (out / "table.md").is_file()


def test_configs_table_groups_seeds_by_configuration():
    from loopformer.experiments.report import config_key, configs_table

    def run(name, seed, acc, last):
        return {"_dir": f"/s/runs/{name}", "seed": seed, "metric": "accuracy", "variant": "tmlt", "loops": 4,
                "params": 100, "task": {"name": "lcs", "options": {"length": 6}}, "test": {"accuracy": acc},
                "loopwise": [{"loop": 1, "accuracy": 0.1}, {"loop": 8, "accuracy": last}]}

    assert config_key("/x/runs/loops=4_seed=2_timestep=true") == "loops=4_timestep=true"
    runs = [run("loops=4_seed=0", 0, 0.5, 0.4), run("loops=4_seed=1", 1, 0.7, 0.6), run("loops=4_seed=2", 2, 0.6, 0.9),
            run("loops=8_seed=0", 0, 0.8, 0.8)]
    md = configs_table(runs).splitlines()
    assert len(md) == 4
    assert "| loops=4 |" in md[2]
    assert "| 3 | 60.0 [50.0–70.0] | 0: 50.0, 1: 70.0, 2: 60.0 | t=8: 60.0 [40.0–90.0] |" in md[2]
    assert "| loops=8 |" in md[3] and "| 1 | 80.0 [80.0–80.0] |" in md[3]


def test_paired_table_pairs_looped_and_tmlt_by_seed():
    from loopformer.experiments.report import paired_table

    def run(name, seed, variant, value, metric="accuracy", higher=True, loops=16, task="lcs"):
        return {"_dir": f"/s/runs/{name}", "seed": seed, "metric": metric, "higher_is_better": higher,
                "variant": variant, "loops": loops, "task": {"name": task, "options": {"length": 8}},
                "test": {metric: value}}

    runs = [run(f"seed={s}_timestep={str(v == 'tmlt').lower()}", s, v, acc)
            for s, v, acc in [(0, "looped", 0.70), (0, "tmlt", 0.75), (1, "looped", 0.80), (1, "tmlt", 0.78),
                              (2, "looped", 0.60), (2, "tmlt", 0.66), (3, "looped", 0.5)]]   # seed 3 has no twin
    runs.append(run("seed=0_timestep=true_lr=1", 0, "tmlt", 0.9))                             # another configuration
    runs.append(run("baseline_n_layers=4_loops=1", 0, "standard", 0.99))
    md = paired_table(runs).splitlines()
    assert len(md) == 3
    assert md[2] == ("| LCS (8) | default | 16 | 3 | 70.0 [60.0–80.0] | 75.0 [66.0–78.0] | "
                     "0: +5.0, 1: -2.0, 2: +6.0 | +5.0 | 2 of 3 |")
    # an error metric: lower is better, so a negative difference is a lead
    mse = [run("seed=0_timestep=false", 0, "looped", 0.2, "mse", False, 4, "icl"),
           run("seed=0_timestep=true", 0, "tmlt", 0.1, "mse", False, 4, "icl")]
    row = paired_table(mse).splitlines()[2]
    assert "0: -0.1000" in row and row.endswith("| 1 of 1 |")
    assert paired_table([runs[0], runs[-1]]) is None
