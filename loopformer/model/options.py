"""What one call of `LoopedTransformer.forward` is given and gives back: the options deep supervision, training's
read-out, elastic depth and the exits ask of it beyond a plain fixed-depth run (`LoopOptions`), what every run of
the block starts from (`Begin`, made by `LoopedTransformer.begin` for the loop and the exits alike), and the output
(`LoopOutput`).

Shapes: B batch, T length, S = cached + T keys, D width, C outputs, N read positions, R loops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoopOptions:
    """A call's options beyond a plain fixed-depth run, grouped by the feature that sets them (none by default):
    `model(x, opts=LoopOptions(state=h, loop_offset=t))`."""
    # deep supervision (`loopformer.model.recursion`): continue a run from a carried state
    state: torch.Tensor | None = None       # [B,T,D] the state to start from (+ e with injection; default: e)
    loop_offset: int = 0                      # the index of the first loop for the timestep encoding
                                              # (`loop_indices`): loops=R, loop_offset=o continues a call with o
                                              # loops exactly where it left off (its `hidden`)
    # training's read-out (`loopformer.train.losses`)
    read_at: torch.Tensor | None = None     # [N] indices into the B·T flattened positions: L2 reads out only there
                                              # (logits [N,C], all_logits and all_hidden [R',N,·]; hidden [B,T,D])
    read_loops: int | None = None             # with return_all: the read-out of the last R' = read_loops loops only
    read_only: bool = False                   # with read_at, only its read-outs are wanted: the last layer of the
                                              # last loop computes those positions only (`Layer.forward_at`; keys
                                              # and values from every position) and `hidden` is [N,D]; ignored
                                              # where it cannot apply (a cache, row_loops, dropout, per-row budgets)
    # elastic depth (`loopformer.eval.budgets`, the elastic losses)
    budget: int | None = None                 # the run's loop count a budget-aware model (timestep_time=
                                              # "normalized") times its loops by (default loop_offset + loops)
    row_loops: torch.Tensor | None = None   # [B] int, a loop count per row (1..loops): row b's state, and so its
                                              # read-out, is that of a run with row_loops[b] loops (and budget)
    # exits (`loopformer.model.exits`)
    halt_positions: torch.Tensor | None = None   # [B,T] bool: the positions a row's criterion is taken over
                                                   # (default: every real token)
    per_token: bool | None = None             # halt per token (default: for causal models) or per row


PLAIN = LoopOptions()


@dataclass
class Begin:
    """What every run of the block starts from (`LoopedTransformer.begin`)."""
    loops: int                                # R
    e: torch.Tensor                           # [B,T,D] the read-in L1(x)
    mask: torch.Tensor | None                 # [B|1,1,T,S] the attention mask (None: the fused causal/full path)
    past: int                                 # tokens already in the cache
    rope: tuple | None = None                 # (cos, sin) [B|1,1,T,Dh/2] of rotary positions (pos="rope"), else None
    # what `forward`'s unrolled loop reads (`LoopedTransformer.begin` with the call's options)
    rows: torch.Tensor | None = None          # [B] a loop count per row (`LoopOptions.row_loops`), else None
    mods: torch.Tensor | list | None = None   # [R,k,4,D] the loops' modulations (prepared per layer with a cache)
    h0: torch.Tensor | None = None            # [B,T,D] the state the first loop starts from
    injected_first: bool = False              # whether e is injected before the first loop too (a start state)
    grad: bool = False                        # gradients recorded
    grad_from: int = 0                        # the first loop with gradients (truncated backpropagation)
    checkpoint: bool = False                  # each loop's activations recomputed in the backward
    read_at: torch.Tensor | None = None       # [N] the positions the last loop's last layer computes, else None
    offset: int = 0                           # the loop index of the first loop (`LoopOptions.loop_offset`)
    cache: object | None = None               # the key/value cache (`KVCache`), else None


@dataclass
class LoopOutput:
    logits: torch.Tensor                         # [B,T,C] ([B,C] for a sequence head)
    hidden: torch.Tensor                         # [B,T,D] residual stream after the last loop (before norm/head)
    all_logits: torch.Tensor | None = None    # [R,B,T,C]: the read-out applied after every loop
    all_hidden: torch.Tensor | None = None    # [R,B,T,D]
    loops: int = 0                               # loops actually run (fewer than asked when halting early)
    stop_logits: torch.Tensor | None = None      # [B,T] the exit gate's stop logits after the last loop
    exit_loops: torch.Tensor | None = None       # with a halting rule: the loop each row [B] (per token: [B,T])
                                                    # stopped after, 1..R
    all_stop_logits: torch.Tensor | None = None  # [R,B,T] ... after every loop (with return_all)
