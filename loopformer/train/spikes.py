"""Skipping gradient spikes (`train.select.skip_spikes`): an optimiser step whose gradient is far larger than usual is
dropped instead of taken.

Deep loops fail in a recognisable way (docs/stability.md): a run learns, then the loop map turns expanding, the
gradient norm jumps by three to five orders of magnitude within a few steps, and clipping keeps the step's size but
not its direction, which is the spike's. Large language-model training meets the same spikes and skips the steps
that carry them. Here, with g_s the gradient norm of step s before clipping (the trunk's, the quantity
`train.optim.grad_clip` clips) and m the running mean of log g over recent steps:

    skip step s   if  log g_s > m + log(factor)      (g_s more than `factor` times the running geometric mean)
    m ← β·m + (1 − β)·min(log g_s, m + log(factor)), β = 1 − 1/window   (bias-corrected, as Adam's moments)

A skipped step leaves the weights, the optimiser's moments and the weight average as they were (its gradient is
discarded); a non-finite norm is always skipped. The mean takes in a skipped step's norm capped at the threshold,
so a lasting rise of the gradient scale is absorbed within about `window` steps rather than skipped forever. The
first `window // 10` steps (at least 10) only feed the mean. The guard's state is part of the checkpoint: a resumed
run skips exactly the steps the uninterrupted one would. The decision reads the norm on the host (one
synchronisation per step).
"""

from __future__ import annotations

import math
from typing import Any

from loopformer.errors import UserError


class SpikeGuard:
    """The running statistic of gradient norms and the skip decision (see the module docstring)."""

    def __init__(self, factor: float, window: int):
        if not factor > 1.0:
            raise ValueError(f"the spike factor must be > 1 (got {factor})")
        if window < 2:
            raise ValueError(f"the spike window must be >= 2 (got {window})")
        self.factor, self.window = float(factor), int(window)
        self.beta = 1.0 - 1.0 / window
        self.warmup = max(10, window // 10)
        self.acc = 0.0            # Σ (1 − β) β^(n−i) log g_i: the uncorrected running mean
        self.seen = 0             # steps folded into the mean
        self.skipped = 0          # steps skipped so far (the run's total)

    @property
    def mean_log(self) -> float:
        """The bias-corrected running mean of log g (0 before any step)."""
        return self.acc / (1.0 - self.beta ** self.seen) if self.seen else 0.0

    def threshold(self) -> float:
        """The largest norm the next step may have without being skipped (inf while warming up)."""
        return math.inf if self.seen < self.warmup else math.exp(self.mean_log) * self.factor

    def check(self, norm: float) -> bool:
        """Fold the step's gradient norm into the mean; True when the step is to be skipped."""
        if not math.isfinite(norm):
            self.skipped += 1
            return True
        log_g = math.log(max(norm, 1e-30))
        limit = self.threshold()
        skip = norm > limit
        if skip:
            log_g = math.log(limit)
            self.skipped += 1
        self.acc = self.beta * self.acc + (1.0 - self.beta) * log_g
        self.seen += 1
        return skip

    def state_dict(self) -> dict:
        return {"acc": self.acc, "seen": self.seen, "skipped": self.skipped}

    def load_state_dict(self, state: Any) -> None:
        """The guard's state from a checkpoint's training state; anything but its own record (finite numbers: the
        running mean of log g, negative whenever the norms are below 1, and the steps seen and skipped, whole and
        non-negative) is a one-line UserError."""
        ok = isinstance(state, dict) and all(
            isinstance(state.get(k), (int, float)) and not isinstance(state.get(k), bool)
            and math.isfinite(state[k]) for k in ("acc", "seen", "skipped")) \
            and all(float(state[k]).is_integer() and state[k] >= 0 for k in ("seen", "skipped"))
        if not ok:
            raise UserError(f"the training state's spike guard (train.select.skip_spikes) is not its record: "
                            f"{str(state)[:80]}")
        self.acc, self.seen, self.skipped = float(state["acc"]), int(state["seen"]), int(state["skipped"])


__all__ = ["SpikeGuard"]
