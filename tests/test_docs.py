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

    for section, module, name in hooks.SECTIONS:
        cls = getattr(importlib.import_module(module), name)
        for f in dataclasses.fields(cls):
            if f.init and not dataclasses.is_dataclass(f.default_factory() if callable(f.default_factory) else None):
                assert f"| `{f.name}` |" in page, (name, f.name)
    assert "| `loop_targets` | `bool` | `False` | tasks with intermediate states" in page
    assert "| `memory_check` | `bool` | `True` |" in page
    notes = hooks.field_comments(importlib.import_module("loopformer.train.config").TrainConfig)
    assert notes["loss_loops"].startswith("last | all") and "loss_window" not in notes.get("lr", "")


def test_readme_links_point_at_files():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)\)", text)
    assert links
    for link in links:
        if not link.startswith("http"):
            assert (ROOT / link).exists(), link
    assert len(text.splitlines()) <= 200
    assert text.splitlines()[3] == "bash scripts/demo.sh    # set up .venv and run the main job"
