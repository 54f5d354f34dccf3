"""Every shipped config loads, validates and builds its model; `configs/` in a clone is the package's configs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from loopformer.configio import CONFIG_DIR
from loopformer.model import LoopedTransformer
from loopformer.train.config import load_run_config

ROOT = Path(__file__).resolve().parents[1]
# run configs (claims.yaml is the registry, paper_tables.yaml the paper's rows: test_reproduce checks both)
CONFIGS = sorted(p for p in CONFIG_DIR.rglob("*.yaml") if p.name not in ("claims.yaml", "paper_tables.yaml"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A tiny prepared token corpus standing in for the text configs' data folders."""
    from loopformer.text.corpus import PrepareOptions, prepare_corpus

    d = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    (d / "t.txt").write_text("\n".join(" ".join(rng.choice(["to", "be", "or", "not"], 10)) for _ in range(200)))
    prepare_corpus(str(d / "t.txt"), d / "c", PrepareOptions(tokenizer="bpe", vocab_size=280), progress=False)
    return d / "c"


def test_configs_are_shipped():
    names = {p.relative_to(CONFIG_DIR).as_posix() for p in CONFIGS}
    for must in ("sudoku.yaml", "countdown.yaml", "lcs60.yaml", "lcs100.yaml", "ed40.yaml", "ed60.yaml",
                 "icl_decision_tree.yaml", "wikitext103.yaml", "cpu/demo.yaml", "cpu/lcs.yaml", "cpu/ed.yaml",
                 "cpu/sudoku.yaml", "cpu/countdown.yaml", "cpu/icl.yaml", "cpu/shakespeare.yaml"):
        assert must in names, must


def test_the_clone_s_configs_folder_is_the_package_s():
    assert (ROOT / "configs").resolve() == CONFIG_DIR
    assert (ROOT / "configs" / "cpu" / "demo.yaml").read_bytes() == (CONFIG_DIR / "cpu" / "demo.yaml").read_bytes()


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.relative_to(CONFIG_DIR).as_posix())
def test_config_loads_and_builds(path, corpus):
    raw = OmegaConf.to_container(OmegaConf.load(path))
    overrides = []
    if raw.get("task", {}).get("name") == "text":
        overrides.append(f"task.data_dir={corpus}")
    elif raw.get("task", {}).get("data_dir"):
        overrides.append("task.data_dir=null")        # the prepared folder stands in for the task generator
    cfg = load_run_config(path, overrides)
    assert cfg.model.loops >= 1 and (cfg.train.steps > 0 or cfg.train.epochs > 0)
    model = LoopedTransformer(cfg.model)
    assert model.num_params() > 0
    if "cpu" not in path.parts:   # paper scale: the sizes of App. C (Sudoku-Extreme: TRM's attention model)
        want = {"wikitext103.yaml": (768, 12, 24), "icl_decision_tree.yaml": (256, 8, 12),
                "sudoku-extreme.yaml": (512, 8, None)}.get(path.name, (256, 4, None))
        assert cfg.model.d_model == want[0] and cfg.model.n_heads == want[1]
        if want[2]:
            assert cfg.model.loops == want[2]


def test_paper_recipes():
    raw = OmegaConf.load(CONFIG_DIR / "wikitext103.yaml")
    t, o = raw.train, raw.train.optim
    assert (o.lr, o.min_lr, o.warmup_steps, t.steps, t.batch_size, o.schedule) == (2e-4, 6e-5, 2000, 100000, 48,
                                                                                   "cosine")
    assert list(o.betas) == [0.9, 0.95] and o.weight_decay == 1e-4 and raw.task.block_size == 1024
    for name in ("sudoku", "countdown", "lcs60", "lcs100", "ed40", "ed60"):
        r = OmegaConf.load(CONFIG_DIR / f"{name}.yaml")
        o = r.train.optim
        assert (o.lr, r.train.batch_size, r.train.epochs, o.warmup_steps, o.weight_decay) == (1e-4, 64, 50, 5, 0.01)
        assert r.model.input_injection is True
    assert OmegaConf.load(CONFIG_DIR / "sudoku.yaml").train.losses.loops == "all"
