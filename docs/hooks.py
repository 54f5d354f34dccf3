"""MkDocs hooks: writes `reference/configs.md`, the reference of every config field, from the dataclasses themselves
(names, types, defaults and the comment next to each field, read by `loopformer.configdoc`, which `loopformer config`
prints too), so the page cannot drift from the code; and serves the studies' compact results and their READMEs
(`studies/`, beside `docs/`) under `studies/` on the site, so that a page's link `../studies/...`, and a study page's
link `../../docs/...`, work both in the repository and on the site (and a broken one fails the strict build)."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

from mkdocs.structure.files import File

from loopformer.configdoc import class_summary, fields_of

SECTIONS = [("run", "loopformer.train.config", "RunConfig"), ("model", "loopformer.model.config", "ModelConfig"),
            ("task", "loopformer.sources.base", "TaskConfig"), ("train", "loopformer.train.config", "TrainConfig"),
            ("eval", "loopformer.eval.config", "EvalConfig"), ("log", "loopformer.train.config", "LogConfig")]


def _section(lines: list[str], key: str, cls, level: str = "##") -> None:
    """The heading, the class's first doc paragraph and the table of one section (`key`: its dotted prefix, "" at the
    top level), then a table of its own for each section it holds (e.g. `train.optim`)."""
    title = "top level" if not key else f"`{key}.*`"
    lines += [f"{level} {title} — `{cls.__name__}`", "", class_summary(cls), "",
              "| field | type | default | meaning |", "|---|---|---|---|"]
    nested = []
    for row in fields_of(cls):
        if row.section is not None:
            nested.append((row.key, row.section))                  # a section: a table of its own
            if key:                                                # (the run's sections: SECTIONS)
                lines.append(f"| `{row.key}` | section | | see `{key}.{row.key}.*` below |")
            continue
        note = row.meaning.replace("|", "\\|")
        lines.append(f"| `{row.key}` | `{row.kind}` | `{row.default}` | {note} |")
    lines.append("")
    if key:
        for field, sub in nested:
            _section(lines, f"{key}.{field}", sub, level + "#")


def config_reference() -> str:
    """The markdown page."""
    import importlib

    lines = ["# Config reference", "",
             "Every field of a run config, generated from the dataclasses (`loopformer.train.config.RunConfig` and the "
             "sections it holds). In YAML a field is `section: {field: value}`; on the command line a dotted "
             "override `section.field=value` (in a section of a section, `train.optim.lr=3e-4`). Unknown keys and bad "
             "values are one-line errors naming the key. `loopformer config KEY` prints the same text for a section or "
             "a field on the command line (with `--config FILE`, the values that config sets).", ""]
    for section, module, name in SECTIONS:
        cls = getattr(importlib.import_module(module), name)
        _section(lines, "" if section == "run" else section, cls)
    renamed = importlib.import_module("loopformer.train.config").RENAMED
    lines += ["## Renamed keys", "",
              "The flat keys of the train section's earlier release still load until the next release — in a YAML "
              "file, an override, a stage's `set`, a sweep's grid and a run folder's stored config — each named once "
              "on stderr with its new key.", "", "| earlier key | key now |", "|---|---|"]
    lines += [f"| `train.{old}` | `train.{new}` |" for old, new in renamed.items()]
    return "\n".join(lines) + "\n"


def on_pre_build(config, **kwargs) -> None:
    path = Path(config["docs_dir"]) / "reference" / "configs.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = config_reference()
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)


STUDIES = Path(__file__).resolve().parents[1] / "studies"
STUDY_EXCLUDE = ("*.csv", "*.json", "*.jsonl", "*.gz", "*.sh", "*.py")   # data and scripts: read in the repository


def on_files(files, config, **kwargs):
    """Every study file (pages, tables, plots) as a site file under `studies/`."""
    for path in sorted(STUDIES.rglob("*")):
        rel = path.relative_to(STUDIES.parent).as_posix()
        if path.is_file() and not any(fnmatch.fnmatch(path.name, p) for p in STUDY_EXCLUDE):
            files.append(File(rel, str(STUDIES.parent), config["site_dir"], config["use_directory_urls"]))
    return files


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    """A page's links into `../studies/` (from docs/, as the repository has it) point at the served copies, and a
    study page's links into `../../docs/` (from studies/NAME/) at the pages, which the site serves from its root."""
    uri = page.file.src_uri
    up = "../" * (uri.count("/") + 1)                          # from a page in docs/ to the repository root
    here = "../" * uri.count("/")                              # from this page to the site root
    markdown = re.sub(r"\]\(" + re.escape(up) + "studies/", "](" + here + "studies/", markdown)
    if uri.startswith("studies/"):                             # here is also the way to the repository root
        markdown = re.sub(r"\]\(" + re.escape(here) + "docs/", "](" + here, markdown)
    return markdown
