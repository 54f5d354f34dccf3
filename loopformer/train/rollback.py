"""Rolling back a collapse (`train.select.rollback`): a run that has learned its task and then loses it goes back to
the last weights that had it, with a smaller learning rate, instead of spending hundreds of steps learning it again.

Deep loops fail in a recognisable way (studies/transfer): the training accuracy reaches 100 %, then within a few
steps falls to chance (the loop map turned expanding, or the loop-count draws began), and the run either learns the
task again hundreds of steps later or never does. With a_w the training accuracy of log window w (the "train"
record's accuracy over `train.log_every` steps):

    good window    a_w >= learned          the weights, the optimiser's state, the weight average and the spike
                                           guard at the end of w become the snapshot (the last good state)
    collapse       a_w < below, after a good window, for `patience` windows in a row
                   -> every tensor of the snapshot is put back, the learning rate's factor c <- c · lr_factor
                      (the schedule's rate times c from then on), and the event is logged ("rollback" record)

A snapshot belongs to the loop count it was learned at: the loop curriculum's count of the window (`loops`, the
model's loops once the curriculum is over, drawn budgets or not). When the count rises right after a good window,
a fall at the new count is the new depth not yet learned, which the snapshot's weights cannot undo (they were
trained at fewer loops, and rolled back the run would meet the same count again): the snapshot is dropped, and the
next good window at the new count takes a new one. When the count rises while a fall is under way (a window below
`learned` after the snapshot, at its count), the fall is the snapshot's task being lost: the snapshot stands for the
new count, and a collapse there rolls back to it.

The data stream is not rewound: the steps after a rollback draw new batches, so the run does not replay the
batches that preceded the collapse. At most `max_rollbacks` rollbacks (after that, a collapse stays); with
patience 1 and `train.log_every` = 50 a collapse is undone at most 50 steps after its window began, and the curve
never shows the task lost for more than (patience + 1) windows. The snapshot, the factor and the counters are part
of the checkpoint (`state_dict`): a resumed run rolls back exactly where the uninterrupted one would.

The accuracy is the one every process sees (summed over processes), so under DDP all processes decide alike. A
sharded model (`train.system.parallel=fsdp`) is refused: its snapshot would be sharded too.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch

from loopformer.errors import UserError


def _cpu(tree: Any) -> Any:
    """A deep copy of a state (nested dicts / lists of tensors and numbers) with every tensor cloned to the CPU."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: _cpu(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_cpu(v) for v in tree)
    return copy.deepcopy(tree)


class RollbackGuard:
    """The decision and the snapshot (see the module docstring)."""

    def __init__(self, below: float, learned: float = 0.95, patience: int = 1, lr_factor: float = 0.5,
                 max_rollbacks: int = 3):
        if not 0 < below <= learned <= 1:
            raise ValueError(f"need 0 < below <= learned <= 1 (got below={below}, learned={learned})")
        if patience < 1 or max_rollbacks < 0 or not 0 < lr_factor <= 1:
            raise ValueError(f"need patience >= 1, max_rollbacks >= 0 and 0 < lr_factor <= 1 (got {patience}, "
                             f"{max_rollbacks}, {lr_factor})")
        self.below, self.learned, self.patience = float(below), float(learned), int(patience)
        self.lr_factor, self.max_rollbacks = float(lr_factor), int(max_rollbacks)
        self.lr_scale = 1.0        # c: the schedule's rate is multiplied by this
        self.count = 0             # rollbacks so far
        self.low = 0               # windows in a row below `below` since the last good one
        self.snapshot: dict | None = None   # {"step", "loops", "model", "optimizer", "ema", "spikes"}: the last good
                                            # state and the training loop count it stands for
        self.last_step: int | None = None   # the step the last window ended at

    def update(self, accuracy: float, step: int, capture, loops: int | None = None) -> bool:
        """Take window accuracy `accuracy` ending at `step`, trained at the curriculum's loop count `loops` (None:
        no curriculum); `capture()` returns the trainer's state to keep. True when the run must roll back now (to
        `self.snapshot`)."""
        if not math.isfinite(accuracy):
            accuracy = 0.0
        previous, self.last_step = self.last_step, int(step)
        if self.snapshot is not None and self.snapshot.get("loops", loops) != loops:
            if self.snapshot["step"] == previous:   # the count rose from a good window: a new task
                self.snapshot, self.low = None, 0
            else:                                    # ... during a fall: the snapshot's task is being lost
                self.snapshot["loops"] = loops
        if accuracy >= self.learned:
            self.snapshot = {"step": int(step), "loops": loops, **_cpu(capture())}
            self.low = 0
            return False
        if self.snapshot is None or accuracy >= self.below:
            self.low = 0
            return False
        self.low += 1
        if self.low < self.patience or self.count >= self.max_rollbacks:
            return False
        self.low = 0
        self.count += 1
        self.lr_scale *= self.lr_factor
        return True

    def state_dict(self) -> dict:
        return {"lr_scale": self.lr_scale, "count": self.count, "low": self.low, "snapshot": self.snapshot,
                "last_step": self.last_step}

    def load_state_dict(self, state: Any) -> None:
        """The guard's state from a checkpoint's training state; anything but its own record is one line."""
        ok = isinstance(state, dict) and isinstance(state.get("lr_scale"), float) and 0 < state["lr_scale"] <= 1 \
            and all(isinstance(state.get(k), int) and state[k] >= 0 for k in ("count", "low"))
        snap = state.get("snapshot") if isinstance(state, dict) else None
        ok = ok and (snap is None or (isinstance(snap, dict) and isinstance(snap.get("step"), int)
                                      and (snap.get("loops") is None or isinstance(snap["loops"], int))
                                      and isinstance(snap.get("model"), dict)
                                      and all(isinstance(v, torch.Tensor) for v in snap["model"].values())))
        last = state.get("last_step") if isinstance(state, dict) else None
        ok = ok and (last is None or isinstance(last, int))
        if not ok:
            raise UserError("cannot resume: the checkpoint's rollback record (train.select.rollback) is damaged")
        self.lr_scale, self.count, self.low, self.snapshot = state["lr_scale"], state["count"], state["low"], snap
        self.last_step = last


__all__ = ["RollbackGuard"]
