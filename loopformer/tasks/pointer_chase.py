"""Pointer chasing: multi-hop lookup in a function table written in the input (a depth-demanding task).

A sample is a random cyclic permutation f of m symbols, written as a table, and a start symbol s; the answer is
f^k(s), k applications of f (the knob: `hops`). The natural algorithm reads one pointer per loop; pointer doubling
(every table entry i reading f(f(i))) needs about log2(k) + 1 loops. Either way a model needs depth that grows
with k, and one lookup cannot shortcut it: the table is new in every sample.

Layout (bidirectional, T = m + 1): the start symbol sits at the query position, which answers.

    inputs   f(0) f(1) … f(m-1)   s          (position i of the table holds f(i))
    targets  IGNORE …      IGNORE f^k(s)

so one loop can make one hop: the query position attends to the table position its symbol names and reads its
entry. Intermediate states (per-loop targets, `task.loop_targets`): step j supervises the query position with
f^j(s).

f is a uniformly random cyclic permutation (one cycle through all m symbols) and k < m, so f^k(s) is uniform over
the m - 1 symbols other than s: no shorter cycle lets a model guess s, and no guess beats 1/(m - 1) without
following the pointers. Splits are disjoint by a hash of the input row
(`loopformer.tasks.common.in_split`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loopformer.tasks.base import IGNORE, TokenTask, Vocab
from loopformer.tasks.common import check_range, dataclass_options, draw_in_split, exact_match, make_rng


def chase(table: np.ndarray, start: np.ndarray, hops: int) -> np.ndarray:
    """[N, hops] the pointers f^1(s) … f^hops(s) of every row (table [N, m] with values in 0..m-1, start [N])."""
    out = np.empty((len(start), hops), dtype=np.int64)
    x = np.asarray(start, dtype=np.int64)
    rows = np.arange(len(start))
    for j in range(hops):
        x = table[rows, x]
        out[:, j] = x
    return out


@dataclass
class PointerChaseTask(TokenTask):
    """f^k(start) for a random cyclic permutation f written in the input."""

    symbols: int = 16         # m: the table's size (and the alphabet)
    hops: int = 8             # k < m: how often f is applied

    name = "pointer_chase"
    causal = False

    def __post_init__(self) -> None:
        check_range("symbols", self.symbols, 2, 256)
        check_range("hops", self.hops, 1, self.symbols - 1)
        self.vocab = Vocab(["<pad>"] + [f"s{i}" for i in range(self.symbols)])
        self.first = 1                                   # id of symbol 0
        self.seq_len = self.symbols + 1
        self.steps = self.hops                           # intermediate states (per-loop targets)

    def options(self) -> dict:
        return dataclass_options(self)

    def _draw(self, rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
        m = self.symbols
        order = np.argsort(rng.random((n, m)), axis=1)                                   # [n,m] the cycle's order
        table = np.empty_like(order)
        np.put_along_axis(table, order, np.roll(order, -1, axis=1), axis=1)              # f(order[i]) = order[i+1]
        start = rng.integers(0, m, size=n)
        hops = chase(table, start, self.hops)                                            # [n,k]
        inputs = np.concatenate([table, start[:, None]], axis=1) + self.first            # [n,T]
        targets = np.full((n, self.seq_len), IGNORE, dtype=np.int32)
        targets[:, m] = hops[:, -1] + self.first
        steps = np.full((n, self.hops, self.seq_len), IGNORE, dtype=np.int32)           # [n,K,T]
        steps[:, :, m] = hops + self.first
        return {"inputs": inputs, "targets": targets, "step_targets": steps}

    def generate(self, n: int, seed: int, split: str = "train") -> dict[str, np.ndarray]:
        return draw_in_split(self._draw, n, make_rng(seed, split), split)

    def metrics(self, pred: np.ndarray, batch: dict[str, np.ndarray]) -> dict[str, float]:
        """accuracy: f^k(s) right."""
        return {"accuracy": float(exact_match(pred, np.asarray(batch["targets"])).mean()) if len(pred)
                else float("nan")}

    def decode_row(self, batch: dict[str, np.ndarray], i: int) -> str:
        m, toks = self.symbols, self.vocab.decode(batch["inputs"][i])
        return f"f = {' '.join(toks[:m])}   start {toks[m]}   hops {self.hops}   -> " \
               f"{self.vocab.tokens[int(batch['targets'][i, m])]}"

