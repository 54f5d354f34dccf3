"""What one evaluation runs: the `eval` section of a run config, and what the `eval` / `perplexity` commands map
their flags onto (`loopformer.eval.run.evaluate_all` runs it, for the trainer and the commands alike).

Loop counts of 0 mean the model's: `loops` the trained r times the supervision steps (N·r, what fixed depth,
halting rules and the sweep run by default), `max_loops` twice that (the loop-wise curve). Ranges that depend on
the model (at most `loopformer.model.memory.loop_cap` of its trained loops) are checked where it is known.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loopformer.errors import UserError
from loopformer.model.halting import CRITERIA, HaltRule


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclass
class EvalConfig:
    batch_size: int = 256
    n: int = 0                        # evaluate on the first n test samples (0: all)
    loops: int = 0                    # loops to evaluate at (0: the trained r times the supervision steps)
    max_loops: int = 0                # loop-wise evaluation up to this many loops (0: 2 × the trained loops)
    loopwise: bool = True             # record the metric after every loop t = 1..max_loops
    halt: list[str] = field(default_factory=list)   # halting rules (e.g. [kl:1e-3, entropy:0.2]) evaluated at the
                                      # end next to fixed depth: results.json "halting"
    halt_sweep: list[str] = field(default_factory=list)   # halting criteria (e.g. [kl, entropy]) swept over their
                                      # thresholds next to the fixed-depth curve: results.json "halting_sweep"
    budgets: list[int] = field(default_factory=list)   # loop budgets the final model is also run with (e.g.
                                      # [1, 2, 4, 8, 16, 32]): results.json "budgets" (loopformer.eval.budgets)
    votes: int = 0                    # test-time augmentation for tasks that define it (Sudoku): predict this many
                                      # augmented copies besides the puzzle, map them back and vote per cell;
                                      # reported next to the plain metrics as voted_* (0: off)
    drift: bool = True                # the drift diagnostics up to 4r at the end (results.json "drift":
                                      # loopformer.eval.drift): metric, state change, spectral radius, verdict
    lengths: list[int] = field(default_factory=list)   # also the metric at each of these input lengths with the
                                      # model's loops T(n) (e.g. [8, 16, 32, 64]): results.json "lengths"
                                      # (loopformer.eval.lengths; tasks with a length option)
    step_halt: float = 0.5            # halting across supervision steps (exit gate, supervision_steps > 1): a row
                                      # stops at the first step whose stop probability reaches this (halted_*)

    def __post_init__(self) -> None:
        _need(self.batch_size >= 1, f"eval.batch_size must be >= 1 (got {self.batch_size})")
        _need(self.n >= 0, f"eval.n, the number of test rows, must be >= 0 (0: all; got {self.n})")
        _need(self.loops >= 0 and self.max_loops >= 0,
              f"eval.loops and eval.max_loops must be >= 0 (0: the model's; got {self.loops}, {self.max_loops})")
        try:                          # parsed once, here: `rules` is what every evaluation reads
            self.rules: list[HaltRule] = [HaltRule.parse(rule) for rule in self.halt]
        except UserError as exc:
            raise ValueError(f"eval.halt: {exc}") from None
        for c in self.halt_sweep:
            _need(c in CRITERIA, f"eval.halt_sweep: unknown halting criterion {c!r} (choose from "
                                 f"{', '.join(CRITERIA)})")
        _need(all(b >= 1 for b in self.budgets), f"eval.budgets must be >= 1 (got {self.budgets})")
        _need(all(isinstance(n, int) and n >= 1 for n in self.lengths),
              f"eval.lengths must be whole numbers >= 1 (got {self.lengths})")
        _need(0 <= self.votes <= 1000, f"eval.votes must be in 0..1000 (got {self.votes})")
        _need(0 < self.step_halt <= 1,
              f"eval.step_halt, the step-halting threshold, must be in (0, 1] (got {self.step_halt})")


__all__ = ["EvalConfig"]
