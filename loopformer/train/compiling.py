"""What the training step compiles (`train.system.compile`, `train.system.compile_scope`): the whole step or the
shared block.

    step    the forward and the loss of a supervision step as one `torch.compile` graph (`Trainer._forward_loss`).
            The graph unrolls every loop, so its cold compilation grows with the loop count r (measured on CPUs:
            about a minute at r = 16, 5-9 minutes at r = 32), and each loop count is a graph of its own: steps of a
            loop curriculum below the final r, and drawn loop budgets, run eagerly.
    block   regional compilation: each layer of the shared block (`Layer.forward`, and `Layer.forward_at` for a
            last loop read at the loss's positions) is compiled once and called by the eager loop r times, so the
            compilation does not depend on r, and every loop count (curriculum, budgets) runs the same graphs.
            The read-in, the read-outs and the loss stay eager.
    auto    `block` where the unrolled graph would be large or change — more than BLOCK_FROM_LOOPS loops, a loop
            curriculum or drawn budgets — else `step` (benchmarks/bench_compile.py measures both).

The compiled layer functions are instance attributes of the layers (`forward` / `forward_at` shadowing the class's
methods), so parameters, state dicts and checkpoints are those of the plain model; `eager(model)` removes them for
the duration of a block (evaluation runs the model eagerly, with other shapes and without gradients), and
`uncompile_block` for good.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

COMPILE_SCOPES = ("auto", "step", "block")
BLOCK_FROM_LOOPS = 16        # auto: loop counts above this compile the block (the unrolled step's cold compilation
                             # grows with r; see benchmarks/bench_compile.py)
_ATTRS = ("forward", "forward_at")


def compile_scope(scope: str, loops: int, varying: bool) -> str:
    """"step" or "block" for `train.system.compile_scope`=`scope` and a model of `loops` loops (`varying`: the step's
    loop count changes during training — a loop curriculum or drawn budgets)."""
    if scope != "auto":
        return scope
    return "block" if varying or loops > BLOCK_FROM_LOOPS else "step"


def compile_block(model: torch.nn.Module, mode: str = "default") -> None:
    """Compile each layer of `model`'s shared block in place (regional compilation; see the module docstring)."""
    for blk in model.blocks:
        for name in _ATTRS:
            fn = getattr(type(blk), name).__get__(blk)          # the class's method bound to this layer
            setattr(blk, name, torch.compile(fn, mode=mode))


def uncompile_block(model: torch.nn.Module) -> None:
    """Back to the eager layers."""
    for blk in model.blocks:
        for name in _ATTRS:
            blk.__dict__.pop(name, None)


def block_compiled(model: torch.nn.Module) -> bool:
    return any("forward" in blk.__dict__ for blk in model.blocks)


@contextlib.contextmanager
def eager(model: torch.nn.Module) -> Iterator[None]:
    """Run `model` eagerly inside the block (its compiled layer functions set aside, then restored)."""
    saved = [{n: blk.__dict__.pop(n) for n in _ATTRS if n in blk.__dict__} for blk in model.blocks]
    try:
        yield
    finally:
        for blk, attrs in zip(model.blocks, saved):
            blk.__dict__.update(attrs)


__all__ = ["COMPILE_SCOPES", "BLOCK_FROM_LOOPS", "compile_scope", "compile_block", "uncompile_block",
           "block_compiled", "eager"]
