"""Label sequences of dialled variation: Lemma 4.1's setting as a token task (one label per loop).

A table of label sequences is drawn once from `table_seed` (an option, so it is recorded with the data and the
run): for every key k = 0..keys-1 a sequence y_0(k), …, y_{K-1}(k) of K = `length` labels over 0..L-1
(L = `labels`). The dial is `jump` J, the largest allowed step between consecutive labels. Every key draws K
independent uniform labels z_0(k), …, z_{K-1}(k), and its sequence pursues them with steps of at most J:

    y_0(k)      = z_0(k)
    y_{t+1}(k)  = y_t(k) + clip(z_{t+1}(k) - y_t(k), -J, J)

so J = 0 gives constant sequences, a small J a slow walk that lags behind the draws, and J = L-1 the independent
uniform labels themselves (y = z). The draws z do not depend on J: the tables of one seed at different J are the
same draws followed more or less closely, and every sequence's largest step and total variation rise with J (for
all sequences of 5-7 labels over 5-8 values, checked exhaustively in the tests). `variation()` measures the
drawn table: max_jump = max |y_{t+1}(k) - y_t(k)| over keys and steps (≤ J; Lemma 4.1's ε in label units),
total_variation = Σ_t |y_{t+1}(k) - y_t(k)| averaged over the keys, and mean_jump.

Why this is Lemma 4.1's setting. The lemma maps an index k to labels y_0..y_{K-1} with a weight-tied residual map
(id + FF)^{K-1} and errs by up to the largest neighbour difference ε = max |y_k - y_{k-1}|; Theorem 4.2's per-loop
scaling η(t) (timestep encoding is its parameter-cheap version) makes it exact. Both constructions walk through
the labels one per loop: in Lemma 4.1's proof the read-out after l loops is ε·a_min(l,k) ≈ y_min(l,k), in
Theorem 4.2's the state holds y_l after loop l. Here every key has a sequence of its own and loop t (t = 1..K)
of a looped model is read against y_{t-1}(k): with `task.loop_targets=true` the same block must produce a new
label at every loop, and the dial sets how far consecutive labels lie apart. Read at the end only (the default),
the answer y_{K-1}(k) is a lookup of the key that needs no depth: the control in which the dial should not
matter.

Layout (bidirectional, T = `width`): every position holds a key and answers with its own key's label, so a row is
`width` independent lookups (rows are many, every key occurs in every split, and splits are disjoint by a hash
of the input row):

    inputs        k_1 … k_w                          (key tokens)
    targets       y_{K-1}(k_1) … y_{K-1}(k_w)         (label tokens: the sequence's last label)
    step_targets  [N, K, w]: step t holds y_{t-1}(k_i) at position i (the per-loop targets, loop t → y_{t-1})

Metrics: accuracy (the whole row right), token_accuracy, label_error (mean |ŷ - y| in label units over the
positions; a prediction that is not a label counts as L - 1) and max_label_error (its largest value: the
sup-norm error of Lemma 4.1). With `task.loop_targets=true` the loop-wise evaluation also reads every loop t
against y_{t-1} (`step_metrics`): step_label_error and step_max_label_error per loop, and at r their means over
loops 1..r, loops_step_label_error and loops_step_max_label_error (the per-loop error the dials study reports).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loopformer.tasks.base import TokenTask, Vocab
from loopformer.tasks.common import check_range, dataclass_options, draw_in_split, exact_match, make_rng, token_accuracy


def draw_table(seed: int, keys: int, length: int, labels: int, jump: int) -> np.ndarray:
    """[keys, length] int: the label sequences of `seed` (values 0..labels-1, consecutive labels at most `jump`
    apart), each pursuing `length` uniform draws with steps of at most `jump`. The draws do not depend on `jump`."""
    rng = np.random.default_rng([int(seed), 0x1AB5E9])
    z = rng.integers(0, labels, size=(keys, length))                                # [keys,K] the draws pursued
    table = np.empty((keys, length), dtype=np.int64)
    table[:, 0] = z[:, 0]
    for t in range(length - 1):
        table[:, t + 1] = table[:, t] + np.clip(z[:, t + 1] - table[:, t], -jump, jump)
    table.flags.writeable = False
    return table


def table_variation(table: np.ndarray) -> dict[str, float]:
    """The variation of label sequences [keys, K]: max_jump (the largest |y_{t+1} - y_t|), total_variation (Σ_t
    |y_{t+1} - y_t| per sequence, averaged over the sequences) and mean_jump (per step)."""
    steps = np.abs(np.diff(np.asarray(table, dtype=np.int64), axis=1))
    if not steps.size:
        return {"max_jump": 0, "total_variation": 0.0, "mean_jump": 0.0}
    return {"max_jump": int(steps.max()), "total_variation": float(steps.sum(axis=1).mean()),
            "mean_jump": float(steps.mean())}


@dataclass
class LabelSequenceTask(TokenTask):
    """Each position's key → the last label of its sequence; loop t reads the sequence's label t-1."""

    keys: int = 16            # distinct keys (input tokens), one label sequence each
    length: int = 8           # K: labels per sequence (the steps read one per loop)
    labels: int = 16          # L: the label alphabet 0..L-1
    jump: int = 1             # J (the dial): the largest allowed |y_{t+1} - y_t| in label units; 0: constant
                              # sequences, L-1: independent uniform labels
    width: int = 8            # keys per row (independent lookups; >= 2, so that every key occurs in every split)
    table_seed: int = 0       # which table (one per seed; the same for every sample and split)

    name = "label_sequence"
    causal = False

    def __post_init__(self) -> None:
        check_range("keys", self.keys, 2, 4096)
        check_range("length", self.length, 1, 1024)
        check_range("labels", self.labels, 2, 4096)
        check_range("jump", self.jump, 0, self.labels - 1)
        check_range("width", self.width, 2, 1024)     # one key per row would split the keys
        check_range("table_seed", self.table_seed, 0, 2 ** 63 - 1)
        self.vocab = Vocab(["<pad>"] + [f"k{i}" for i in range(self.keys)] + [f"y{j}" for j in range(self.labels)])
        self.first_label = 1 + self.keys                 # token id of label 0 (key i is id 1 + i)
        self.seq_len = self.width
        self.steps = self.length
        self.table = draw_table(self.table_seed, self.keys, self.length, self.labels, self.jump)

    def options(self) -> dict:
        return dataclass_options(self)

    def variation(self) -> dict[str, float]:
        """The measured variation of the drawn table (`table_variation`)."""
        return table_variation(self.table)

    def describe(self) -> str:
        """One line: the table's size, its dial and the variation it measures."""
        v = self.variation()
        return (f"{self.keys} keys x {self.length} labels over {self.labels}, jump <= {self.jump} (table seed "
                f"{self.table_seed}): max jump {v['max_jump']}, total variation {v['total_variation']:.2f} per "
                f"sequence, mean jump {v['mean_jump']:.3f}")

    def _draw(self, rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
        k = rng.integers(0, self.keys, size=(n, self.width))                              # [n,w] keys
        states = self.table[k].transpose(0, 2, 1) + self.first_label                      # [n,K,w] label ids
        return {"inputs": (k + 1).astype(np.int32), "targets": states[:, -1].astype(np.int32),
                "step_targets": states.astype(np.int32)}

    def generate(self, n: int, seed: int, split: str = "train") -> dict[str, np.ndarray]:
        return draw_in_split(self._draw, n, make_rng(seed, split), split)

    def label_errors(self, pred: np.ndarray, targets: np.ndarray) -> np.ndarray:
        """|ŷ - y| in label units at every position (a prediction that is not a label: L - 1)."""
        y = np.asarray(targets, dtype=np.int64) - self.first_label
        p = np.asarray(pred, dtype=np.int64) - self.first_label
        return np.where((p >= 0) & (p < self.labels), np.abs(p - y), self.labels - 1)

    def metrics(self, pred: np.ndarray, batch: dict[str, np.ndarray]) -> dict[str, float]:
        """accuracy: every position's label right; token_accuracy; label_error (mean |ŷ - y|, label units) and
        max_label_error (the largest)."""
        targets = np.asarray(batch["targets"])
        if not len(pred):
            return {k: float("nan") for k in ("accuracy", "token_accuracy", "label_error", "max_label_error")}
        err = self.label_errors(pred, targets)
        return {"accuracy": float(exact_match(pred, targets).mean()), "token_accuracy": token_accuracy(pred, targets),
                "label_error": float(err.mean()), "max_label_error": float(err.max())}

    def step_metrics(self, pred: np.ndarray, state: np.ndarray) -> dict[str, float]:
        """One loop's read-out against the label it learns (loop t → y_{t-1}): step_label_error (mean |ŷ - y_{t-1}|)
        and step_max_label_error (the largest) — Lemma 4.1's per-loop error in label units."""
        if not len(pred):
            return {"step_label_error": float("nan"), "step_max_label_error": float("nan")}
        err = self.label_errors(pred, state)
        return {"step_label_error": float(err.mean()), "step_max_label_error": float(err.max())}

    def decode_row(self, batch: dict[str, np.ndarray], i: int) -> str:
        keys = [int(v) - 1 for v in batch["inputs"][i]]
        last = " ".join(str(int(v) - self.first_label) for v in batch["targets"][i])
        walk = " ".join(str(int(v)) for v in self.table[keys[0]])
        v = self.variation()
        return (f"keys {' '.join(map(str, keys))}  -> labels {last}   |  y(k{keys[0]}) = {walk}   "
                f"(jump <= {self.jump}: max {v['max_jump']}, total variation {v['total_variation']:.2f})")
