"""The paper's tasks (Sec. 5, App. C): seeded generators, loaders for the public formats, and metrics.

Token tasks follow the contract in `loopformer.tasks.base` and are built by name:

    >>> from loopformer.tasks import get_task
    >>> task = get_task("edit_distance", length=12, alphabet_max=5)
    >>> batch = task.generate(4, seed=0)
    >>> batch["inputs"].shape == (4, task.seq_len)
    True

    edit_distance  s1 | s2 <sep> cost <eos>            (causal; Feng et al. 2023's generator)
    lcs            s1 | s2 <sep> length <eos>          (causal)
    sudoku         81 cells -> 81 solution digits       (non-causal; unique-solution puzzles, public CSV loaders)
    countdown      n1 n2 n3 n4 target a op b = c ×3 .   (causal; held-out targets for the test split)

Tasks that need depth (the answer takes a number of sequential steps set by one option, and every sample carries
the state after every step, `step_targets` [N, K, T], for per-loop targets: `task.loop_targets`):

    word_problem   g1 … gn -> prefix products           (non-causal; S5 / A5 / Zk; knob: length)
    pointer_chase  f(0) … f(m-1) s ? -> f^k(s)          (non-causal; knob: hops)
    schedule       x1 … xn -> a fixed hidden circuit's output after K layers   (non-causal; knob: layers)

Tasks whose continuity is set by a dial (the moduli of Theorem 3.6 and the label variation of Lemma 4.1):

    label_sequence k1 … kw -> each key's last label; loop t reads label t-1 of its sequence (dial: jump)
    dial_map       x1 … xN -> bins of tri(α·u_i + β·Σ_{j≠i} u_j / √(N-1))   (dials: token_lipschitz, context_lipschitz)

Tasks of variable size for length generalisation (`loopformer.tasks.algorithmic`; every row has its own size n in
min_length..length, recorded in `size`; causal, padded at the end):

    parity         <bos> b1 … bn = p <eos>
    copy           <bos> x1 … xn = x1 … xn <eos>              (reverse: xn … x1)
    addition       <bos> a1 … an + c1 … cn = s1 … sn+1 <eos>  (binary, least significant bit first)
    binary_sum     <bos> b1 … bn = (b1 + … + bn in binary) <eos>
    column_addition  <bos> (a1 c1) … (an cn) (0 0) -> s1 … sn+1 under the columns  (`loopformer.tasks.column_addition`)

In-context learning (real-valued prompts sampled on the fly) lives in `loopformer.tasks.icl`.

A new token task is a module here holding a dataclass subclass of `TokenTask` (its init fields are its options)
and its entry in `TASKS`; generation, data folders, training, evaluation, sweeps and the `data` command then serve
it through `loopformer.sources` without further changes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from loopformer.errors import UserError
from loopformer.tasks.algorithmic import AdditionTask, BinarySumTask, CopyTask, ParityTask
from loopformer.tasks.base import IGNORE, TokenTask, Vocab
from loopformer.tasks.column_addition import ColumnAdditionTask
from loopformer.tasks.countdown import CountdownTask
from loopformer.tasks.dial_map import DialMapTask
from loopformer.tasks.edit_distance import EditDistanceTask
from loopformer.tasks.label_sequence import LabelSequenceTask
from loopformer.tasks.lcs import LCSTask
from loopformer.tasks.pointer_chase import PointerChaseTask
from loopformer.tasks.schedule import ScheduleTask
from loopformer.tasks.sudoku import SudokuTask
from loopformer.tasks.word_problem import WordProblemTask

TASKS: dict[str, type[TokenTask]] = {
    "edit_distance": EditDistanceTask,
    "lcs": LCSTask,
    "sudoku": SudokuTask,
    "countdown": CountdownTask,
    "word_problem": WordProblemTask,
    "pointer_chase": PointerChaseTask,
    "schedule": ScheduleTask,
    "parity": ParityTask,
    "copy": CopyTask,
    "addition": AdditionTask,
    "binary_sum": BinarySumTask,
    "column_addition": ColumnAdditionTask,
    "label_sequence": LabelSequenceTask,
    "dial_map": DialMapTask,
}


def task_options(name: str) -> dict[str, Any]:
    """The options of a task with their defaults."""
    cls = _task_class(name)
    return {f.name: f.default for f in dataclasses.fields(cls) if f.init}


def _task_class(name: str) -> type[TokenTask]:
    try:
        return TASKS[name]
    except KeyError:
        raise UserError(f"unknown task {name!r} (expected one of: {', '.join(TASKS)})") from None


def get_task(name: str, **options: Any) -> TokenTask:
    """Build a token task by name; unknown names or options are one-line UserErrors."""
    cls = _task_class(name)
    known = task_options(name)
    for key in options:
        if key not in known:
            raise UserError(f"unknown option {key!r} for task {name} (options: {', '.join(known)})")
    return cls(**options)


__all__ = ["TASKS", "get_task", "task_options", "TokenTask", "Vocab", "IGNORE", "EditDistanceTask", "LCSTask",
           "SudokuTask", "CountdownTask",
           "WordProblemTask", "PointerChaseTask", "ScheduleTask", "ParityTask", "CopyTask", "AdditionTask",
           "BinarySumTask", "ColumnAdditionTask", "LabelSequenceTask", "DialMapTask"]
