"""Runs trained with other settings than a sweep or a reproduction asks for now: found key by key (against a hand
edit of config.yaml), and stopped, retrained (the old folder moved aside, never deleted) or kept as the caller
says; sweeps, `reproduce` and the CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_reproduce import _registry
from test_train import TINY

from loopformer.cli import main
from loopformer.errors import UserError
from loopformer.experiments.report import find_runs
from loopformer.experiments.reproduce import reproduce
from loopformer.experiments.stale import STALE_DIR, _same, config_changes, flatten, moved_aside, resolve_stale
from loopformer.experiments.sweep import parse_grid, run_sweep
from loopformer.train.config import load_run_config
from loopformer.train.run import CONFIG_FILE, RunLock, config_yaml


def _run_folder(tmp_path: Path, *extra: str) -> tuple[Path, object]:
    cfg = load_run_config(None, [*TINY, f"out_dir={tmp_path / 'run'}", *extra])
    run = tmp_path / "run"
    run.mkdir()
    (run / CONFIG_FILE).write_text(config_yaml(cfg))
    return run, cfg


def test_config_changes_key_by_key(tmp_path):
    run, cfg = _run_folder(tmp_path)
    assert config_changes(run, cfg) == []
    # where the run lives, threads, logging and compilation do not change what it learns
    same = load_run_config(None, [*TINY, f"out_dir={tmp_path / 'elsewhere'}", "name=other", "threads=3",
                                  "log.progress=true", "train.log_every=7", "train.system.compile=false",
                                  "model.checkpoint=true", "eval.batch_size=5"])
    assert config_changes(run, same) == []
    # a changed value and a changed default are named with both values
    other = load_run_config(None, [*TINY, f"out_dir={run}", "train.optim.lr=1e-3", "train.loops.hold=4"])
    assert config_changes(run, other) == [("train.loops.hold", 0.0, 4.0), ("train.optim.lr", 3e-3, 1e-3)]
    # a hand edit of the stored config is seen the same way
    text = (run / CONFIG_FILE).read_text()
    (run / CONFIG_FILE).write_text(text.replace("d_model: 16", "d_model: 24"))
    assert config_changes(run, cfg) == [("model.d_model", 24, 16)]
    # a stored config this version cannot load is one change; a folder without one cannot be compared
    (run / CONFIG_FILE).write_text(text.replace("d_model: 16", "d_model: 16\n  no_such_key: 1"))
    [(key, why, now)] = config_changes(run, cfg)
    assert key == CONFIG_FILE and "no_such_key" in why and now == "loads"
    assert config_changes(tmp_path / "none", cfg) is None


def test_paths_compare_as_the_files_they_name(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    assert _same(str(data), f"{data}/../data") and not _same(str(data), str(tmp_path))
    assert not _same("data", "data2") and _same(3, 3) and not _same(3, 4)
    assert flatten({"a": {"b": 1, "c": {}}, "d": [1]}) == {"a.b": 1, "a.c": {}, "d": [1]}


def test_policies(tmp_path, capsys):
    run, cfg = _run_folder(tmp_path)
    now = load_run_config(None, [*TINY, f"out_dir={run}", "train.optim.lr=1e-3"])
    with pytest.raises(UserError, match=r"1 run folder\(s\) under .* \(run: train.optim.lr 0.003 → 0.001\); "
                                        r"--stale retrain"):
        resolve_stale([(run, now)], tmp_path, "stop")
    assert (run / CONFIG_FILE).is_file()
    assert resolve_stale([(run, now)], tmp_path, "keep") == [run]
    assert "used as they are" in capsys.readouterr().err and (run / CONFIG_FILE).is_file()
    with pytest.raises(UserError, match="--stale must be one of"):
        resolve_stale([(run, now)], tmp_path, "drop")
    # a run training there now is not moved
    lock = RunLock(run).acquire()
    try:
        with pytest.raises(UserError, match="in use"):
            resolve_stale([(run, now)], tmp_path, "retrain")
        assert (run / CONFIG_FILE).is_file()
    finally:
        lock.release()
    assert resolve_stale([(run, now)], tmp_path, "retrain", progress=False) == [run]
    [moved] = (tmp_path / STALE_DIR).glob("*/run")
    assert not run.exists() and (moved / CONFIG_FILE).is_file() and moved_aside(moved.relative_to(tmp_path))
    assert resolve_stale([(run, now)], tmp_path, "stop") == []          # nothing there any more
    # a run folder outside OUT moves beside itself
    out = tmp_path / "elsewhere"
    run2, _ = _run_folder(tmp_path)
    resolve_stale([(run2, now)], out, "retrain", progress=False)
    [beside] = tmp_path.glob(f"run{STALE_DIR}-*")
    assert (beside / CONFIG_FILE).is_file() and not run2.exists() and moved_aside(beside)


def test_a_sweep_stops_retrains_or_keeps_stale_runs(tmp_path, capsys):
    from omegaconf import OmegaConf
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(OmegaConf.to_yaml(OmegaConf.from_dotlist(TINY + ["train.steps=3"])))
    out, grid = tmp_path / "sw", parse_grid(["model.loops=2,3"])
    specs = run_sweep(str(cfg), grid, [], out, progress=False)
    stamps = {s.name: (s.out_dir / "results.json").stat().st_mtime_ns for s in specs}
    # the config changes under the finished runs (a default moves): the sweep stops before anything runs
    cfg.write_text(OmegaConf.to_yaml(OmegaConf.from_dotlist(TINY + ["train.steps=4"])))
    with pytest.raises(UserError, match=r"2 run folder\(s\) .*train.steps 3 → 4"):
        run_sweep(str(cfg), grid, [], out, progress=False)
    assert main(["sweep", str(cfg), "--grid", "model.loops=2,3", "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.steps 3 → 4" in err[0] and "--stale retrain" in err[0]
    # keep: reused as they are
    run_sweep(str(cfg), grid, [], out, progress=False, stale="keep")
    assert stamps == {s.name: (s.out_dir / "results.json").stat().st_mtime_ns for s in specs}
    # retrain: moved aside whole, trained again on the new config; the report reads the new runs only
    assert main(["sweep", str(cfg), "--grid", "model.loops=2,3", "--out", str(out), "--quiet", "--stale",
                 "retrain"]) == 0
    moved = sorted(p.name for p in (out / STALE_DIR).glob("*/runs/*"))
    assert moved == [s.name for s in specs]
    for s in specs:
        old = next((out / STALE_DIR).glob(f"*/runs/{s.name}"))
        assert json.loads((old / "results.json").read_text())["steps"] == 3
        assert json.loads((s.out_dir / "results.json").read_text())["steps"] == 4
    assert sorted(r["steps"] for r in find_runs(out)) == [4, 4]
    # an interrupted run is checked too (config.yaml, no results)
    import shutil
    (specs[0].out_dir / "results.json").unlink()
    shutil.rmtree(specs[1].out_dir)
    with pytest.raises(UserError, match=r"1 run folder\(s\) .*\(runs/loops=2: train.optim.lr 0.003 → 0.001\)"):
        run_sweep(str(cfg), grid, [], out, ["train.optim.lr=1e-3"], progress=False)


def test_reproduce_stops_on_runs_its_claims_no_longer_ask_for(tmp_path, capsys):
    reg = _registry(tmp_path)
    out = tmp_path / "rep"
    theory = out / "runs" / "theory"
    theory.mkdir(parents=True)
    (theory / "results.json").write_text(json.dumps({"kind": "theory", "rows": 3, "as_expected": 3,
                                                     "fraction_as_expected": 1.0, "failed": []}))
    reproduce(["tiny"], registry=str(reg), out=out, jobs=1, progress=False)
    # the claim's overrides change: its four finished runs no longer answer it
    reg.write_text(reg.read_text().replace('"train.steps=12"', '"train.steps=10"'))
    rc = main(["reproduce", "--registry", str(reg), "--claims", "tiny", "--out", str(out), "--jobs", "1", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and re.search(r"4 run folder\(s\) .*train.steps 12 → 10", err[0])
    res = reproduce(["tiny"], registry=str(reg), out=out, jobs=1, progress=False, stale="retrain")
    assert res["estimate"]["todo"] == 4 and len(list((out / STALE_DIR).glob("*/runs/tiny/*"))) == 4
    for arm in res["judged"][0]["arms"]:
        for run in arm["runs"]:
            assert json.loads((out / run / "results.json").read_text())["steps"] == 10
    # --dry-run checks nothing and moves nothing
    assert main(["reproduce", "--registry", str(reg), "--claims", "tiny", "--out", str(out), "--dry-run",
                 "--stale", "retrain"]) == 0
    assert len(list((out / STALE_DIR).glob("*/runs/tiny/*"))) == 4
