"""Loop counts that grow with the input: a rule T(n) from a row's size n to its number of loops (length
generalisation; Fan et al., ICLR 2025, loop a block T(n) times for an input of size n and train on sizes up to n
to run at 2n and beyond).

`model.loop_rule`:

    fixed          every row runs the call's loops (the model's r unless given): the default
    linear:a,b     T(n) = ⌈a·n + b⌉      e.g. linear:1,0 — one loop per bit (parity, copy, addition)
    log:c,b        T(n) = ⌈c·⌈log2 n⌉ + b⌉   e.g. log:1,1 — a doubling scan's depth plus one

always at least one loop. n is the task's size of the row (`size` of the variable-length tasks and of the word
problem: bits, symbols or group elements; `loopformer.tasks.algorithmic`); a row runs its own T(n) loops and keeps
its state after them (`LoopOptions.row_loops`), so a batch of mixed sizes runs its largest T(n) once.

In training, `train.loops.jitter` J > 0 adds U{0..J} loops to every row (drawn from the run's seed, the step and
the row): the answer must then hold for a few loops past T(n) — random loop counts tied to the rule (Kuo et al.
2606.29983 find loop counts tied to the length alone a shortcut that makes generalisation swing across seeds).
Random loop counts not tied to the size are `train.loops.sample` (elastic depth). A model's r (`model.loops`) must
cover T at the largest training size: it is the depth its metric at r, its loop-wise curve and its timestep
encoding count in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from loopformer.errors import UserError

KINDS = ("fixed", "linear", "log")
MAX_SLOPE = 4096          # a rule's slope a: T(n) of a trained size is at most model.loops (<= 4,096)
MAX_OFFSET = 1 << 24      # |b|: the most positions a model holds; with n <= 2^24 every T(n) stays far inside int64


@dataclass(frozen=True)
class LoopRule:
    kind: str = "fixed"
    a: float = 1.0       # the slope of n (linear) or of ⌈log2 n⌉ (log)
    b: float = 0.0       # the offset

    @classmethod
    def parse(cls, text: str) -> LoopRule:
        """A rule from its text ("fixed", "linear:a,b", "log:c,b"); ValueError naming the problem otherwise."""
        if not isinstance(text, str):
            raise ValueError(f"loop_rule must be a string such as fixed, linear:1,0 or log:1,1 (got {text!r})")
        kind, _, args = text.strip().partition(":")
        if kind not in KINDS:
            raise ValueError(f"loop_rule {text!r}: the rule must be one of fixed, linear:a,b, log:c,b")
        if kind == "fixed":
            if args:
                raise ValueError(f"loop_rule {text!r}: fixed takes no arguments (the loops are model.loops)")
            return cls()
        parts = args.split(",")
        try:
            a, b = (float(p) for p in parts) if len(parts) == 2 else (None, None)
        except ValueError:
            a = b = None
        if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)) or a <= 0:
            raise ValueError(f"loop_rule {text!r}: write {kind}:a,b with a slope a > 0 and an offset b")
        if a > MAX_SLOPE or abs(b) > MAX_OFFSET:       # a·n + b would overflow or exceed every loop cap
            raise ValueError(f"loop_rule {text!r}: the slope a must be in (0, {MAX_SLOPE:,}] and the offset b in "
                             f"[-{MAX_OFFSET:,}, {MAX_OFFSET:,}]")
        return cls(kind, a, b)

    @property
    def fixed(self) -> bool:
        return self.kind == "fixed"

    def loops(self, sizes, fixed: int) -> np.ndarray:
        """T(n) for every size n in `sizes` ([N] ints >= 1; `fixed`: the loops of the rule "fixed")."""
        n = np.asarray(sizes, dtype=np.int64)
        if self.fixed:
            return np.full(n.shape, int(fixed), dtype=np.int64)
        if n.size and int(n.min()) < 1:
            raise ValueError(f"sizes must be >= 1 (got {int(n.min())})")
        x = n.astype(np.float64) if self.kind == "linear" else np.ceil(np.log2(np.maximum(n, 1)))
        t = np.ceil(self.a * x + self.b - 1e-9)   # a·n + b integral stays itself despite rounding
        return np.clip(t, 1, 2.0 ** 62).astype(np.int64)     # a huge size: a huge count, never a wrapped one

    def at(self, size: int, fixed: int) -> int:
        """T(n) of one size."""
        return int(self.loops(np.array([size]), fixed)[0])

    def __str__(self) -> str:
        if self.fixed:
            return "fixed"
        fmt = lambda v: f"{v:g}"   # noqa: E731
        return f"{self.kind}:{fmt(self.a)},{fmt(self.b)}"

    def describe(self) -> str:
        """The rule as a formula of n."""
        if self.fixed:
            return "r (fixed)"
        inner = "n" if self.kind == "linear" else "⌈log2 n⌉"
        return f"⌈{self.a:g}·{inner} {'+' if self.b >= 0 else '−'} {abs(self.b):g}⌉"


def check(cfg) -> None:
    """ModelConfig's check of `loop_rule` (a ValueError naming the field)."""
    LoopRule.parse(cfg.loop_rule)


def jitter(seed: int, step: int, rows: int, most: int) -> np.ndarray:
    """Training's extra loops of a step's `rows` rows (`train.loops.jitter` = most): U{0..most} each, a pure function
    of (seed, step), so resuming stays exact and every process draws the same (zeros when most = 0)."""
    if most <= 0:
        return np.zeros(rows, dtype=np.int64)
    return np.random.default_rng([int(seed), int(step), 0x1E9C7]).integers(0, most + 1, size=rows)


def check_covers(rule: LoopRule, loops: int, largest: int | None) -> None:
    """One-line UserError unless data of sizes up to `largest` (None: rows without sizes) can run under `rule` with a
    model of r = `loops`: every row needs a size, and T(largest) must not exceed r."""
    if rule.fixed:
        return
    if largest is None:
        raise UserError(f"model.loop_rule={rule} reads every row's size n: train on a task whose rows record it "
                        "(parity, copy, addition, binary_sum, column_addition, word_problem)")
    need = rule.at(largest, loops)
    if need > loops:
        raise UserError(f"model.loop_rule={rule} runs T({largest}) = {need} loops at the largest training size: "
                        f"model.loops={loops} must be at least {need}")
