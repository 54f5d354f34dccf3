"""Data sources: every kind of task the trainer and the evaluation run, behind one interface
(`loopformer.sources.base.DataSource`), chosen by `task.name` through one registry:

    TokenData   token tasks, `loopformer.tasks.TASKS` (edit distance, LCS, Sudoku, Countdown; Sec. 5.1.1)
    VectorData  in-context learning, real-valued prompts sampled on the fly (Sec. 5.1.2, App. C.2)
    TextData    language modelling on a prepared token corpus (App. C.3)

Training, evaluation and sweeps ask the source (`source_class(cfg)`, `make_data(cfg)`, `model_fields(cfg)`)
instead of looking at task names. A new token task is a `TokenTask` registered in `loopformer.tasks.TASKS`; a new
kind of data is a `DataSource` subclass added to `SOURCES`.
"""

from __future__ import annotations

from typing import Any

from loopformer.errors import UserError
from loopformer.sources.base import DataSource, TaskConfig, stream_indices
from loopformer.sources.text import TextData
from loopformer.sources.tokens import TokenData, hide_answers
from loopformer.sources.vectors import VectorData

SOURCES: tuple[type[DataSource], ...] = (TokenData, VectorData, TextData)


def source_class(cfg: TaskConfig) -> type[DataSource]:
    """The kind of data source that serves `cfg` (a data folder of a token task whatever its `name`)."""
    for cls in SOURCES:
        if cls.handles(cfg.name):
            return cls
    if cfg.data_dir:
        return TokenData
    names = [n for cls in SOURCES for n in cls.choices()]
    raise UserError(f"unknown task {cfg.name!r} (expected one of: {', '.join(names)})")


def make_data(cfg: TaskConfig) -> DataSource:
    """The data source of a run's task section."""
    return source_class(cfg)(cfg)


def model_fields(cfg: TaskConfig) -> dict[str, Any]:
    """The ModelConfig fields the task fixes: read-in (vocab_size / input_dim), max_len, causal, read-out (and the
    position factors of a grid task, with `task.position_factors`)."""
    cls = source_class(cfg)
    if cfg.position_factors and cls is not TokenData:
        raise UserError(f"task.position_factors: the {cfg.name} task has no position factors (Sudoku has: row, "
                        "column, box)")
    if cfg.loop_targets and cls is not TokenData:
        raise UserError(f"task.loop_targets: the {cfg.name} task has no intermediate states (step_targets; e.g. "
                        "word_problem, pointer_chase, schedule)")
    return cls.model_fields(cfg)


def check_data_fits(data, task_cfg: TaskConfig, model_cfg) -> None:
    """One-line refusal when other data does not fit the model: another read-in width, causality or read-out,
    rows longer than its learned positions, or input token ids outside its vocabulary (answers the model cannot
    write are allowed: they count as wrong)."""
    fields = model_fields(task_cfg)
    for key in ("input_dim", "causal", "head"):
        if fields[key] != getattr(model_cfg, key):
            raise UserError(f"the data does not fit the model: its {key} is {fields[key]}, the model's "
                            f"{getattr(model_cfg, key)}")
    if model_cfg.indexed_positions and fields["max_len"] > model_cfg.max_len:
        raise UserError(f"the data's rows hold {fields['max_len']} positions, the model learned {model_cfg.max_len} "
                        f"(train with model.max_len={fields['max_len']} to test longer inputs)")
    top = data.max_input_id()
    if top is not None and top >= model_cfg.vocab_size:
        raise UserError(f"the data's inputs use token id {top}, outside the model's vocabulary of "
                        f"{model_cfg.vocab_size}")


__all__ = ["SOURCES", "DataSource", "TaskConfig", "TokenData", "VectorData", "TextData", "source_class",
           "make_data", "model_fields", "check_data_fits", "hide_answers", "stream_indices"]
