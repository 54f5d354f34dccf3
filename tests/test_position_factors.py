"""Position factors: a grid task's row / column / box indices, the read-in against a hand-written sum of tables,
the option through a run config, a training run and a checkpoint, and the one-line refusal for tasks without."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from loopformer.cli import main
from loopformer.errors import UserError
from loopformer.model import LoopedTransformer
from loopformer.model.config import ModelConfig
from loopformer.model.io import load, resolve_checkpoint
from loopformer.tasks.sudoku import SudokuTask
from loopformer.train.config import load_run_config
from loopformer.train.trainer import train


def test_sudoku_factors_are_rows_columns_and_boxes():
    rows, cols, boxes = SudokuTask(blanks=30).position_factors()
    grid = np.arange(81).reshape(9, 9)
    for cell in range(81):
        r, c = np.argwhere(grid == cell)[0]
        assert (rows[cell], cols[cell]) == (r, c)
        same_box = grid[r // 3 * 3:r // 3 * 3 + 3, c // 3 * 3:c // 3 * 3 + 3].ravel()
        assert {boxes[i] for i in same_box} == {boxes[cell]}
    for factor in (rows, cols, boxes):   # nine groups of nine cells each
        assert sorted(np.bincount(factor).tolist()) == [9] * 9


def test_read_in_adds_one_table_per_factor():
    factors = [[0, 0, 1, 1, 2], [3, 2, 1, 0, 0]]
    torch.manual_seed(0)
    m = LoopedTransformer(ModelConfig(vocab_size=7, max_len=5, d_model=8, n_heads=2, causal=False,
                                      pos_factors=factors))
    assert [t.num_embeddings for t in m.embed.factors] == [3, 4]
    x = torch.randint(0, 7, (2, 5))
    e = m.embed(x)
    for b in range(2):
        for p in range(5):
            want = m.embed.tok.weight[x[b, p]] + m.embed.pos.weight[p] + \
                m.embed.factors[0].weight[factors[0][p]] + m.embed.factors[1].weight[factors[1][p]]
            torch.testing.assert_close(e[b, p], want, rtol=0, atol=0)
    # given positions (left padding) index the factors too; without learned positions only the factors remain
    pos = torch.tensor([[0, 0, 1, 2, 3]])
    torch.testing.assert_close(m.embed(x[:1], pos)[0, 4], m.embed.tok.weight[x[0, 4]] + m.embed.pos.weight[3]
                               + m.embed.factors[0].weight[1] + m.embed.factors[1].weight[0])
    bare = LoopedTransformer(ModelConfig(vocab_size=7, max_len=5, d_model=8, n_heads=2, pos="none",
                                         pos_factors=factors))
    torch.testing.assert_close(bare.embed(x)[0, 1], bare.embed.tok.weight[x[0, 1]] + bare.embed.factors[0].weight[0]
                               + bare.embed.factors[1].weight[2])
    assert m.num_params() - m.num_params(exclude_positions=True) == (5 + 3 + 4) * 8


def test_factors_must_cover_every_position():
    with pytest.raises(ValueError, match="pos_factors"):
        ModelConfig(vocab_size=7, max_len=5, pos_factors=[[0, 1, 2]])
    with pytest.raises(ValueError, match="pos_factors"):
        ModelConfig(vocab_size=7, max_len=3, pos_factors=[[0, -1, 2]])


TINY = ["task.name=sudoku", "task.options={blanks: 30}", "task.n_train=32", "task.n_test=8",
        "task.position_factors=true", "model.d_model=16", "model.n_heads=2", "model.loops=2", "train.steps=3",
        "train.batch_size=8", "eval.batch_size=8", "log.tensorboard=false", "log.progress=false",
        "log.dynamics=false"]


def test_a_run_with_factors_trains_and_its_checkpoint_loads(tmp_path):
    cfg = load_run_config(None, [*TINY, f"out_dir={tmp_path / 'run'}"])
    assert cfg.model.pos_factors == SudokuTask(blanks=30).position_factors()
    assert load_run_config(None, [t for t in TINY if "position_factors" not in t]
                           + [f"out_dir={tmp_path}"]).model.pos_factors is None
    train(cfg)
    model = load(resolve_checkpoint(tmp_path / "run"))
    assert len(model.embed.factors) == 3 and model.config.pos_factors == cfg.model.pos_factors
    x = torch.randint(0, 11, (2, 81))
    rows = model.embed(x) - model.embed.tok(x) - model.embed.pos.weight - \
        model.embed.factors[1].weight[model.embed.factor_index[1]] - \
        model.embed.factors[2].weight[model.embed.factor_index[2]]
    torch.testing.assert_close(rows[0, :9], model.embed.factors[0].weight[0].expand(9, -1))   # row 0 shares one
    assert not torch.equal(model.embed.factors[0].weight[0], model.embed.factors[0].weight[1])


def test_a_task_without_factors_is_refused(tmp_path, capsys):
    with pytest.raises(UserError, match="no position factors"):
        load_run_config(None, ["task.name=lcs", "task.position_factors=true", f"out_dir={tmp_path}"])
    with pytest.raises(UserError, match="no position factors"):
        load_run_config(None, ["task.name=icl", "task.position_factors=true", f"out_dir={tmp_path}"])
    assert main(["train", str(Path(__file__).parents[1] / "configs/cpu/lcs.yaml"), "task.position_factors=true",
                 f"out_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("loopformer: error: ") == 1 and "no position factors" in err and "Traceback" not in err
    assert not (tmp_path / "r").exists()
