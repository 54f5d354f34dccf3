"""The contract every task follows, so training, evaluation and the CLI treat all tasks alike.

A *token task* (edit distance, LCS, Sudoku, Countdown) produces fixed-length integer arrays:

    inputs  [N, T] int   token ids fed to the model (padded with `pad_id` to T)
    targets [N, T] int   the token the model must output at each position, or IGNORE (-100) where no loss is taken

For causal tasks `targets` is `inputs` shifted left by one, with every position outside the answer set to IGNORE,
so teacher-forced exact match over the answer equals greedy-decoding exact match. For Sudoku (non-causal)
`targets` holds the solution digit at every cell (metrics separate blanks from givens).

A *vector task* (in-context learning) samples real-valued batches on the fly; see `loopformer.tasks.icl`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loopformer.errors import UserError

IGNORE = -100


@dataclass
class Vocab:
    """A list of token strings; ids are positions. `pad` is always id 0."""

    tokens: list[str]
    index: dict[str, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if len(set(self.tokens)) != len(self.tokens):
            raise ValueError("vocabulary tokens must be unique")
        self.index = {t: i for i, t in enumerate(self.tokens)}

    def __len__(self) -> int:
        return len(self.tokens)

    def encode(self, toks: list[str]) -> list[int]:
        try:
            return [self.index[t] for t in toks]
        except KeyError as exc:
            raise UserError(f"token {exc.args[0]!r} is not in the vocabulary") from None

    def decode(self, ids) -> list[str]:
        return [self.tokens[int(i)] for i in ids]


class TokenTask:
    """Base class of the token tasks. Subclasses set the attributes and implement the methods below."""

    name: str = ""
    causal: bool = True
    vocab: Vocab
    seq_len: int          # T: length of every `inputs` row
    pad_id: int = 0
    steps: int = 0        # K > 0: `generate` also returns `step_targets` [N, K, T], the targets after each of the K
                          # sequential steps of the answer, for per-loop targets; the last one equals `targets`
                          # wherever `targets` supervises, and may supervise more (parity's `scan_every`: the
                          # prefix parity at every bit)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def row_bytes(self, drawing: bool = False) -> int:
        """About how many bytes one generated row takes: 16 per position for its inputs and targets (drawn, then
        gathered into its split) and 8 per cell of its intermediate states (K × T as int32, gathered); while it is
        being drawn (`drawing`) 40 per cell, the states being computed as int64 and shifted and masked in copies.
        What the size checks before generating (`tasks.common.check_draw`, `data gen`) multiply by the rows."""
        T = max(int(self.seq_len), 1)
        return 16 * T + (40 if drawing else 8) * max(int(self.steps), 0) * T

    def options(self) -> dict[str, Any]:
        """The generator options (recorded in manifests and run folders)."""
        raise NotImplementedError

    def generate(self, n: int, seed: int, split: str = "train") -> dict[str, np.ndarray]:
        """`n` samples as {'inputs', 'targets', ...extra arrays}; deterministic in (seed, split)."""
        raise NotImplementedError

    def metrics(self, pred: np.ndarray, batch: dict[str, np.ndarray]) -> dict[str, float]:
        """Metrics from argmax predictions `pred` [N, T] (aligned with `targets`). Always includes 'accuracy'
        (the task's headline metric in [0, 1], e.g. exact match)."""
        raise NotImplementedError

    def decode_row(self, batch: dict[str, np.ndarray], i: int) -> str:
        """A human-readable rendering of sample i."""
        raise NotImplementedError

    # optional: metrics of a loop's read-out against the intermediate state it learns (`task.loop_targets`)
    def step_metrics(self, pred: np.ndarray, state: np.ndarray) -> dict[str, float]:
        """Metrics of one loop's predictions `pred` [N, T] against the state `state` [N, T] it is read against,
        beside the exact match `step_accuracy` the source computes (none by default). The loop-wise evaluation adds
        them to every loop and their means over loops 1..r at r (`loops_` prefix)."""
        return {}

    # optional: symmetries of the task (training augmentation, test-time voting); see `augments` / `votes`
    def augment(self, batch: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
        """`batch` under random answer-preserving symmetries drawn from `rng` (inputs and targets alike)."""
        raise NotImplementedError

    def views(self, inputs: np.ndarray, copies: int, seed: int = 0) -> tuple[np.ndarray, Any]:
        """Test-time augmentation: `inputs` [N,T] and `copies` symmetric copies, [1+copies, N, T] (copy 0 the
        input), and what `unview` needs to map predictions back."""
        raise NotImplementedError

    def unview(self, preds: np.ndarray, symmetries: Any, scores: np.ndarray | None = None) -> np.ndarray:
        """Predictions [1+copies, N, T] on the `views` mapped back and combined into one [N, T] (a vote)."""
        raise NotImplementedError

    def position_factors(self) -> list[list[int]] | None:
        """Optional: a factorisation of the positions, one list per factor giving each position's index in it (a
        grid task: row, column, box). With `task.position_factors` the model adds a learned embedding per factor
        to every position's (`ModelConfig.pos_factors`). None: the task has none."""
        return None

    @property
    def augments(self) -> bool:
        """Whether the task defines training augmentation (`augment`)."""
        return type(self).augment is not TokenTask.augment

    @property
    def votes(self) -> bool:
        """Whether the task defines test-time augmentation with voting (`views` / `unview`)."""
        return type(self).views is not TokenTask.views
