"""The train section in small typed sections (`train.optim`, `train.loops`, `train.losses`, `train.select`,
`train.system`): each checks its own fields naming the full key, unknown keys under a section are errors, and the
flat keys of the earlier release (`train.lr`, `train.loops_hold`, `train.compile`, ...) give the very same config on
every path — a YAML file, an override, a stage's `set`, a sweep's grid, a registry's overrides and an old run
folder's stored config (resumed, evaluated, recognised as the same by the stale-run check) — with one line on stderr
per old key (once per process; none for a stored config)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from test_train import TINY

from loopformer.cli import main
from loopformer.configio import to_dict
from loopformer.errors import UserError
from loopformer.experiments.claims import load_registry, select
from loopformer.experiments.reproduce import plan
from loopformer.experiments.stale import config_changes, resolve_stale
from loopformer.experiments.sweep import _config_of, expand, parse_grid, prepare_specs, run_name
from loopformer.train import config as config_mod
from loopformer.train.config import RENAMED, TRAIN_REMOVED, LoopSampling, OptimConfig, SystemConfig, load_run_config
from loopformer.train.run import CONFIG_FILE, load_for_resume
from loopformer.train.stages import stage_configs
from loopformer.train.trainer import train

BASE = [*TINY, "train.steps=2", "log.dynamics=false", "eval.drift=false", "train.system.compile=false"]
OLD = ["train.lr=0.01", "train.loops_hold=4", "train.compile=false", "train.loss=stablemax", "train.ema_decay=0.5",
       "train.betas=[0.8,0.9]"]
NEW = ["train.optim.lr=0.01", "train.loops.hold=4", "train.system.compile=false", "train.losses.kind=stablemax",
       "train.select.ema_decay=0.5", "train.optim.betas=[0.8,0.9]"]


@pytest.fixture(autouse=True)
def _fresh_notices(monkeypatch):
    """Every test starts with no old key named yet (the notices are once per process)."""
    monkeypatch.setattr(config_mod, "_NOTICED", set())


def _notices(err: str) -> list[str]:
    return [line for line in err.splitlines() if "(the old key works until the next release)" in line]


def _old_layout(cfg) -> dict:
    """The config as the earlier release stored it: the train sections' fields flat under train."""
    d = to_dict(cfg)
    train = d["train"]
    for old, new in RENAMED.items():
        section, name = new.split(".")
        train[old] = train[section][name] if name in train[section] else TRAIN_REMOVED[new]   # since left the core
    for section in {new.split(".")[0] for new in RENAMED.values()}:
        del train[section]
    for st in d["stages"]:
        inverse = {f"train.{new}": f"train.{old}" for old, new in RENAMED.items()}
        st["set"] = {inverse.get(k, k): v for k, v in st["set"].items()}
    return d


def _same(a, b) -> None:
    da, db = to_dict(a), to_dict(b)
    assert da == db


# ------------------------------------------------------------------ the sections
def test_each_section_checks_its_fields_naming_the_full_key():
    with pytest.raises(ValueError, match=r"train\.optim\.lr > 0"):
        OptimConfig(lr=0)
    with pytest.raises(ValueError, match=r"train\.loops\.hold must be 0 \(off\)"):
        LoopSampling(hold=0.5)
    with pytest.raises(ValueError, match=r"train\.system\.compile must be one of"):
        SystemConfig(compile="sometimes")
    for override, key in [("train.optim.lr=-1", "train.optim.lr"), ("train.loops.jitter=-1", "train.loops.jitter"),
                          ("train.losses.kind=hinge", "train.losses.kind"),
                          ("train.select.spike_window=1", "train.select.spike_window"),
                          ("train.system.precision=fp8", "train.system.precision")]:
        with pytest.raises(UserError, match=key.replace(".", r"\.")):
            load_run_config(None, [*BASE, override])
    assert LoopSampling(hold=2).budget_range(5) == (5, 10) and LoopSampling(hold=2).samples_budgets
    assert LoopSampling(sample="uniform", min=2, max=7).budget_range(5) == (2, 7)
    assert not LoopSampling().samples_budgets


@pytest.mark.parametrize("override,needle", [
    ("train.optim.lrr=1", "lrr"),                    # under a section
    ("train.loops.holds=2", "holds"),
    ("train.system.compile_everything=true", "compile_everything"),
    ("train.lrr=1", "lrr"),                          # a flat key that never existed
    ("train.optim=3", "OptimConfig"),                # a value where a section is
])
def test_unknown_keys_are_errors_naming_them(override, needle):
    with pytest.raises(UserError) as info:
        load_run_config(None, [*BASE, override])
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_an_unknown_key_in_a_yaml_section_is_an_error(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  steps: 2\n  optim:\n    lr: 0.01\n    warmup: 3\n")
    with pytest.raises(UserError, match="warmup"):
        load_run_config(f, BASE)


# ------------------------------------------------------------------ the old flat keys, path by path
def test_old_keys_in_overrides_give_the_same_config_with_one_notice_each(capsys):
    new = load_run_config(None, [*BASE, *NEW])
    assert _notices(capsys.readouterr().err) == []
    old = load_run_config(None, [*BASE, *OLD])
    _same(old, new)
    assert (old.train.optim.lr, old.train.loops.hold, old.train.system.compile, old.train.losses.kind) == \
        (0.01, 4.0, "false", "stablemax")
    notes = _notices(capsys.readouterr().err)
    assert notes[0] == "config: train.lr is now train.optim.lr (the old key works until the next release)"
    assert len(notes) == len(OLD) and "train.loss is now train.losses.kind" in notes[3]
    load_run_config(None, [*BASE, *OLD])                                  # named once per process
    assert _notices(capsys.readouterr().err) == []
    # in one list of overrides the later of an old and a new key wins, whichever is old
    assert load_run_config(None, [*BASE, "train.lr=0.1", "train.optim.lr=0.2"]).train.optim.lr == 0.2
    assert load_run_config(None, [*BASE, "train.optim.lr=0.2", "train.lr=0.1"]).train.optim.lr == 0.1


def test_old_keys_in_a_yaml_file_give_the_same_config(tmp_path, capsys):
    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old.write_text("train:\n  steps: 3\n  lr: 2.0e-3\n  schedule: onecycle\n  loss_loops: all\n  loops_start: 1\n"
                   "  compile: false\n  keep_best_depth: r\n  precision: fp32\n")
    new.write_text("train:\n  steps: 3\n  optim: {lr: 2.0e-3, schedule: onecycle}\n  losses: {loops: all}\n"
                   "  loops: {start: 1}\n  system: {compile: false, precision: fp32}\n  select: {keep_best_depth: r}\n")
    a = load_run_config(new, BASE[:-1])
    assert _notices(capsys.readouterr().err) == []
    b = load_run_config(old, BASE[:-1])
    _same(a, b)
    assert b.train.system.compile == "false" and b.train.losses.loops == "all"   # a YAML boolean, as before
    notes = _notices(capsys.readouterr().err)
    assert len(notes) == 7 and "config: train.compile is now train.system.compile" in notes[4]
    # an override of the new key goes over the file's old one
    assert load_run_config(old, [*BASE[:-1], "train.optim.lr=0.5"]).train.optim.lr == 0.5
    both = tmp_path / "both.yaml"
    both.write_text("train:\n  lr: 1.0e-3\n  optim: {lr: 2.0e-3}\n")
    with pytest.raises(UserError, match=r"train\.lr and train\.optim\.lr are both given"):
        load_run_config(both, BASE)


def test_old_keys_in_a_stage_set_give_the_same_stages(tmp_path, capsys):
    def staged(sets: str):
        stages = f"stages=[{{name: learn, set: {{train.steps: 2}}}}, {{name: hold, set: {sets}}}]"
        return load_run_config(None, [*BASE, f"out_dir={tmp_path / 'run'}", stages])

    new = staged("{train.optim.lr: 0.001, train.loops.hold: 2, train.select.keep_best_depth: trained}")
    assert _notices(capsys.readouterr().err) == []
    old = staged("{train.lr: 0.001, train.loops_hold: 2, train.keep_best_depth: trained}")
    assert old.stages == new.stages and old.stages[1].set["train.loops.hold"] == 2
    for a, b in zip(stage_configs(old), stage_configs(new)):
        _same(a, b)
    assert len(_notices(capsys.readouterr().err)) == 3
    with pytest.raises(UserError, match=r"stages\[2\]\.set gives both train\.lr and train\.optim\.lr"):
        staged("{train.lr: 0.1, train.optim.lr: 0.2}")


def test_an_old_run_folder_resumes_evaluates_and_is_not_stale(tmp_path, capsys):
    """A run folder written by the earlier release (config.yaml and the checkpoint's config.json with flat train
    keys) resumes, evaluates and compares equal to the same config asked for with either key, without a notice."""
    run = tmp_path / "run"
    cfg = load_run_config(None, [*BASE, *NEW, "train.loops.hold=0", "train.steps=2", f"out_dir={run}"])
    train(cfg)
    (run / CONFIG_FILE).write_text(yaml.safe_dump(_old_layout(cfg), sort_keys=False))
    ckpt = json.loads((run / "checkpoint" / "config.json").read_text())
    ckpt["run"] = _old_layout(cfg)
    (run / "checkpoint" / "config.json").write_text(json.dumps(ckpt))
    assert "lr: 0.01" in (run / CONFIG_FILE).read_text() and "optim" not in (run / CONFIG_FILE).read_text()
    capsys.readouterr()
    stored = load_for_resume(run)
    _same(stored, cfg)
    assert config_changes(run, cfg) == []
    assert config_changes(run, load_run_config(None, [*BASE, *OLD, "train.loops_hold=0", f"out_dir={run}"])) == []
    assert len(_notices(capsys.readouterr().err)) == len(OLD)         # the overrides' old keys, not the stored ones
    assert main(["train", "--resume", str(run), "train.steps=3", "--quiet"]) == 0
    assert json.loads((run / "results.json").read_text())["steps"] == 3
    assert main(["eval", str(run), "--quiet", "--json", str(tmp_path / "e.json")]) == 0
    assert "accuracy" in json.loads((tmp_path / "e.json").read_text())["metrics"]
    assert _notices(capsys.readouterr().err) == []


def test_old_keys_in_a_sweep_grid_name_the_same_folders_and_configs(tmp_path, capsys):
    """A grid over an old key loads the same configs as over the new one (named once for the whole sweep), keeps
    its runs' folder names, and finds an earlier release's runs there up to date."""
    out = tmp_path / "sweep"
    old = expand(parse_grid(["train.lr=0.01,0.02", "train.loops_hold=0,2"]), [], out)
    new = expand(parse_grid(["train.optim.lr=0.01,0.02", "train.loops.hold=0,2"]), [], out)
    assert [s.name for s in old][:2] == ["lr=0.01_loops_hold=0", "lr=0.01_loops_hold=2"]
    assert run_name(["train.loops.hold=2"]) == "hold=2"
    prepare_specs(None, old, BASE)
    assert len(_notices(capsys.readouterr().err)) == 2                # not once per run
    for a, b in zip(old, new):
        ca, cb = _config_of(None, a, BASE), _config_of(None, b, BASE)
        ca.name, ca.out_dir = cb.name, cb.out_dir
        _same(ca, cb)
    for s in old:                                                     # the earlier release's runs in the folders
        s.out_dir.mkdir(parents=True)
        (s.out_dir / CONFIG_FILE).write_text(yaml.safe_dump(_old_layout(_config_of(None, s, BASE))))
    assert resolve_stale([(s.out_dir, _config_of(None, s, BASE)) for s in old], out, "stop") == []


def test_old_keys_in_a_registry_load_the_same_runs(tmp_path, capsys):
    def registry(arm: str) -> Path:
        path = tmp_path / "claims.yaml"
        path.write_text(f"""
claims:
  - id: tiny
    statement: a tiny claim
    cpu:
      group: tiny
      config: cpu/demo.yaml
      overrides: {json.dumps(BASE)}
      arms:
        - {{name: one loop, overrides: [model.loops=1]}}
        - {{name: two loops, overrides: [model.loops=2, {arm}]}}
      seeds: 1
    rule: {{kind: paired, a: two loops, b: one loop, margin: -1.0}}
""")
        return path

    def configs(arm: str) -> list:
        runs = plan(select(load_registry(str(registry(arm))), ["tiny"]), tmp_path / "o")
        return [load_run_config(r.spec.config, r.spec.overrides) for r in runs]

    new = configs("train.optim.lr=0.01")
    old = configs("train.lr=0.01")
    for a, b in zip(old, new):
        _same(a, b)
    assert old[1].train.optim.lr == 0.01
    assert len(_notices(capsys.readouterr().err)) == 1


def test_training_switches_that_left_the_core_are_dropped_at_their_defaults_and_refused_when_set(tmp_path):
    old = tmp_path / "old.yaml"            # a YAML (or a run's stored config) that still holds them
    old.write_text(yaml.safe_dump({"train": {"jacobian": 0.0, "consistency": 0.0, "consistency_budget": "double",
                                             "curriculum_targets": "spread", "losses": {}}}))
    assert load_run_config(old, BASE) == load_run_config(None, BASE)
    assert load_run_config(None, [*BASE, "train.losses.jacobian=0", "train.loops.curriculum_targets=spread"]) \
        == load_run_config(None, BASE)
    for bad in ("train.jacobian=0.1", "train.losses.consistency=0.5", "train.curriculum_targets=prefix",
                "train.losses.consistency_budget=max"):
        with pytest.raises(UserError, match="has left loopformer.*before-core-split"):
            load_run_config(None, [*BASE, bad])
    old.write_text(yaml.safe_dump({"train": {"losses": {"jacobian": 0.1}}}))
    with pytest.raises(UserError, match="train.losses.jacobian has left loopformer"):
        load_run_config(old, BASE)


def test_config_command_prints_each_field_with_its_type_default_and_meaning(capsys):
    """`loopformer config KEY` prints the fields of a section (or one field) with the comment the reference page
    shows (read from the source), and with --config the value a config sets where it differs from the default."""
    from loopformer.configdoc import field_comments

    assert main(["config", "train.optim.grad_clip"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "train.optim.grad_clip: float = 1.0"
    assert " ".join(line.strip() for line in out[1:]) == field_comments(OptimConfig)["grad_clip"]
    assert field_comments(OptimConfig)["grad_clip"].startswith("max global gradient norm")

    shipped = Path(__file__).resolve().parents[1] / "configs" / "cpu" / "pointer.yaml"
    hold = yaml.safe_load(shipped.read_text())["train"]["loops"]["hold"]
    assert main(["config", "train.loops", "--config", str(shipped), "train.loops.min=3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("[train.loops] LoopSampling — ")
    heads = [line for line in out.splitlines() if line.startswith("train.loops.")]
    assert [h.split(":")[0].rsplit(".", 1)[1] for h in heads] == [f for f in LoopSampling.__dataclass_fields__]
    assert f"train.loops.hold: float = 0.0   (this config: {float(hold)})" in heads
    assert "train.loops.min: int = 1   (this config: 3)" in heads
    assert "train.loops.jitter: int = 0" in heads                      # the default: no value beside it

    assert main(["config", "train"]) == 0                              # a section prints its sections too
    out = capsys.readouterr().out
    assert all(f"[train.{s}]" in out for s in ("optim", "loops", "losses", "select", "system"))


@pytest.mark.parametrize("key, code, needle", [
    ("train.lr", 0, "train.lr is now train.optim.lr"),
    ("train.bogus", 2, "train has no field 'bogus'"),
    ("train.optim.lr.x", 2, "train.optim.lr is a field, not a section"),
    ("model.forget_gate", 2, "model.forget_gate left the library"),
    ("train.losses.jacobian", 2, "train.losses.jacobian left the library"),
])
def test_config_command_names_renamed_unknown_and_removed_keys(key, code, needle, capsys):
    assert main(["config", key]) == code
    cap = capsys.readouterr()
    assert needle in (cap.out if code == 0 else cap.err)
    if code:
        assert cap.err.count("\n") == 1 and cap.out == ""
