"""The documentation: the config reference is generated from every field of every config section, and every link
in the README points at a file that exists."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_config_reference_lists_every_field_with_its_comment():
    hooks = _hooks()
    page = hooks.config_reference()
    import importlib

    classes = [getattr(importlib.import_module(module), name) for _section, module, name in hooks.SECTIONS]
    for cls in classes:
        for f in dataclasses.fields(cls):
            section = f.default_factory() if callable(f.default_factory) else None
            if dataclasses.is_dataclass(section) and cls.__name__ != "RunConfig":
                classes.append(type(section))                  # a section's sections: a table each
            elif f.init and not dataclasses.is_dataclass(section):
                assert f"| `{f.name}` |" in page, (cls.__name__, f.name)
    assert "| `loop_targets` | `bool` | `False` | tasks with intermediate states" in page
    assert "| `memory_check` | `bool` | `True` |" in page
    for heading in ("### `train.optim.*` — `OptimConfig`", "### `train.loops.*` — `LoopSampling`",
                    "### `train.losses.*` — `LossConfig`", "### `train.select.*` — `SelectConfig`",
                    "### `train.system.*` — `SystemConfig`", "| `train.loops_hold` | `train.loops.hold` |"):
        assert heading in page
    config = importlib.import_module("loopformer.train.config")
    from loopformer.configdoc import field_comments  # what the page and `loopformer config` print

    notes = field_comments(config.LossConfig)
    assert notes["loops"].startswith("last | all") and "window" not in notes.get("kind", "")
    assert field_comments(config.SystemConfig)["compile"].startswith("torch.compile the training step")


def test_readme_links_point_at_files():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)\)", text)
    assert links
    for link in links:
        if not link.startswith("http"):
            assert (ROOT / link).exists(), link
    assert len(text.splitlines()) <= 200
    assert text.splitlines()[3] == "bash scripts/demo.sh    # set up .venv and run the main job"


def _readme_block(lang: str, after: str) -> str:
    """The first ```lang block of the README after the heading line `after`."""
    text = (ROOT / "README.md").read_text()
    start = text.index(after)
    m = re.search(rf"```{lang}\n(.*?)```", text[start:], flags=re.S)
    assert m, (lang, after)
    return m.group(1)


def test_readme_python_block_runs(tmp_path, monkeypatch):
    """The README's Python block as written (in a temporary folder: it writes a checkpoint), and its shapes."""
    monkeypatch.chdir(tmp_path)
    code = _readme_block("python", "## Python")
    ns: dict = {}
    exec(compile(code, "README.md", "exec"), ns)                     # noqa: S102 - the README's own code
    assert tuple(ns["out"].logits.shape) == (4, 20, 32) and tuple(ns["out"].all_logits.shape) == (8, 4, 20, 32)
    assert "[4, 20, 32], [8, 4, 20, 32]" in code                     # the shapes the README states
    assert (tmp_path / "ckpt" / "model.safetensors").is_file() and not ns["model"].training


TINY_RUN = ["train.steps=2", "task.n_train=64", "task.n_test=16", "train.system.compile=false", "log.tensorboard=false",
            "eval.batch_size=16"]


def test_readme_quick_start_runs_at_tiny_scale(tmp_path, monkeypatch, capsys):
    """Every command of the README's quick start, in order, with the training runs cut to two steps on a few rows
    and the reproduction as a dry run (the commands, configs and flags as the README gives them)."""
    import shlex

    from loopformer.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    block = _readme_block("bash", "## Quick start").replace("\\\n", " ")
    commands = [c.split("#")[0].strip() for line in block.splitlines() for c in line.split("&&")]
    commands = [c for c in commands if c]
    assert [c.split()[1] for c in commands] == ["train", "eval", "reproduce", "text", "train", "generate"]
    for cmd in commands:
        argv = shlex.split(cmd)[1:]
        if argv[0] == "train":
            argv += TINY_RUN
        elif argv[0] == "reproduce":
            argv += ["--dry-run"]
        elif argv[0] == "text":
            argv += ["--quiet"]
        elif argv[0] == "generate":
            argv += ["--seed", "0"]
        assert main(argv) == 0, cmd
    out = capsys.readouterr().out
    assert "loop-wise" in out and (tmp_path / "runs" / "lm" / "results.json").is_file()
