"""The data-source registry: a token task defined here, outside the package, and registered in
`loopformer.tasks.TASKS` (the only step a new token task needs) is generated, written as a dataset, trained and
evaluated through the same paths as the paper's tasks; every task name reaches the right kind of source."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from loopformer.cli import main
from loopformer.errors import UserError
from loopformer.sources import TaskConfig, TextData, TokenData, VectorData, make_data, model_fields, source_class
from loopformer.tasks import TASKS, TokenTask, Vocab
from loopformer.tasks.common import (
    causal_targets,
    check_range,
    dataclass_options,
    exact_match,
    make_rng,
    token_accuracy,
)
from loopformer.train.config import load_run_config
from loopformer.train.run import read_results
from loopformer.train.trainer import train


@dataclass
class ReverseTask(TokenTask):
    """`d1 … dL <sep> dL … d1 <eos>`: write the digits backwards (causal; the answer is the reversed digits)."""

    length: int = 3

    name = "reverse"
    causal = True

    def __post_init__(self) -> None:
        check_range("length", self.length, 1, 32)
        self.vocab = Vocab(["<pad>", "<sep>", "<eos>"] + [str(d) for d in range(10)])
        self.seq_len = 2 * self.length + 2

    def options(self) -> dict:
        return dataclass_options(self)

    def generate(self, n: int, seed: int, split: str = "train") -> dict[str, np.ndarray]:
        digits = make_rng(seed, split).integers(0, 10, size=(int(n), self.length)) + 3       # ids of '0'..'9'
        n = len(digits)
        inputs = np.concatenate([digits, np.full((n, 1), 1), digits[:, ::-1], np.full((n, 1), 2)], axis=1)
        answer_start = np.full(n, self.length + 1, dtype=np.int32)
        length = np.full(n, self.seq_len, dtype=np.int32)
        return {"inputs": inputs.astype(np.int32), "targets": causal_targets(inputs, answer_start, length),
                "answer_start": answer_start, "length": length}

    def metrics(self, pred: np.ndarray, batch: dict[str, np.ndarray]) -> dict[str, float]:
        return {"accuracy": float(exact_match(pred, batch["targets"]).mean()),
                "token_accuracy": token_accuracy(pred, batch["targets"])}

    def decode_row(self, batch: dict[str, np.ndarray], i: int) -> str:
        return " ".join(self.vocab.decode(batch["inputs"][i]))


TINY = ["task.name=reverse", "task.options={length: 3}", "task.n_train=200", "task.n_test=40", "model.d_model=16",
        "model.n_heads=2", "model.loops=2", "model.input_injection=true", "train.steps=12", "train.batch_size=16",
        "train.optim.lr=3e-3", "train.log_every=4", "eval.batch_size=64", "eval.max_loops=3", "log.tensorboard=false",
        "log.progress=false"]


@pytest.fixture()
def reverse_task(monkeypatch):
    monkeypatch.setitem(TASKS, "reverse", ReverseTask)


def test_a_token_task_defined_outside_the_package_trains_and_evaluates(reverse_task, tmp_path, capsys):
    cfg = load_run_config(None, [*TINY, f"out_dir={tmp_path / 'run'}"])
    assert (cfg.model.vocab_size, cfg.model.max_len, cfg.model.causal, cfg.model.head) == (13, 8, True, "lm")
    assert source_class(cfg.task) is TokenData and source_class(cfg.task).epoch_rows(cfg.task) == 200
    res = train(cfg)
    assert res["task"]["name"] == "reverse" and res["task"]["options"] == {"length": 3}
    assert res["metric"] == "accuracy" and 0.0 <= res["test"]["accuracy"] <= 1.0
    assert [p["loop"] for p in res["loopwise"]] == [1, 2, 3]
    assert read_results(tmp_path / "run") == res
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "run"), "--no-loopwise"]) == 0        # rebuilt from the checkpoint's task
    assert f"accuracy={res['test']['accuracy']:.4g}" in capsys.readouterr().out


def test_a_token_task_defined_outside_the_package_as_a_dataset(reverse_task, tmp_path, capsys):
    out = tmp_path / "data"
    assert main(["data", "gen", "reverse", "--out", str(out), "--train", "150", "--test", "30", "--opt", "length=4",
                 "--quiet"]) == 0
    assert main(["data", "show", str(out), "-n", "1"]) == 0
    assert "<sep>" in capsys.readouterr().out
    cfg = load_run_config(None, [*TINY, f"task.data_dir={out}", f"out_dir={tmp_path / 'run'}"])
    assert cfg.model.max_len == 10                                         # from the manifest's options
    data = make_data(cfg.task)
    assert isinstance(data, TokenData) and data.task.name == "reverse" and data.n_train == 150
    assert train(cfg)["task"]["data_dir"] == str(out)


def test_task_names_reach_their_kind_of_source(tmp_path):
    assert source_class(TaskConfig(name="lcs")) is TokenData
    assert source_class(TaskConfig(name="icl")) is VectorData
    assert source_class(TaskConfig(name="text")) is TextData
    assert model_fields(TaskConfig(name="icl", options={"n_dims": 5}, points=11))["input_dim"] == 6
    with pytest.raises(UserError, match="unknown task 'nope'.*edit_distance.*icl, text"):
        source_class(TaskConfig(name="nope"))
    with pytest.raises(UserError, match="data directory not found"):
        model_fields(TaskConfig(name="text", data_dir=str(tmp_path / "none")))
