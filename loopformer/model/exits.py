"""Exits: adaptive depth at inference, every row — in a causal model every token — looping until a halting rule
(`loopformer.model.halting`) says it is done, at most R loops. `LoopedTransformer.forward(x, halt=rule)` runs
`halting_forward`, which starts from the same `begin` as the fixed-depth loop (checks, read-in, mask).

Per row: the rows still running are gathered into a smaller batch before each loop; a row that stops leaves it,
its hidden state is scattered back, and the read-out is taken once at the end. A row's output is exactly that of
a fixed-depth run with its exit loop (no row sees another).

Per token (causal models; the only mode with a key/value cache): a token that stops keeps its hidden state, and in
every later loop its keys/values are those of its deepest computed loop (the policy later tokens and later
generation steps read: `RunningKV`); a row leaves the batch when all its tokens have stopped. Without a cache the
call uses a temporary one, so a full recomputation and cached generation follow the same policy.

Shapes: B batch, n running rows, T length, D width, R loops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loopformer.errors import UserError
from loopformer.model.cache import KVCache, RunningKV
from loopformer.model.halting import HaltRule, criterion_holds, stops, update_streak
from loopformer.model.options import LoopOptions, LoopOutput


@dataclass
class Running:
    """The rows still looping (n of the B rows) and what each carries from loop to loop."""
    run: torch.Tensor                 # [n] their indices in the batch
    h: torch.Tensor                   # [n,T,D] their hidden states
    e: torch.Tensor                   # [n,T,D] their read-ins
    mask: torch.Tensor | None         # their attention mask ([1,...] when shared by all rows)
    positions: torch.Tensor | None    # [n,T] the positions their criterion is taken over (None: all)
    streak: torch.Tensor              # [n] | [n,T] loops in a row the criterion has held
    exits: torch.Tensor               # [n] | [n,T] per token: the loop each stopped token stopped after
    going: torch.Tensor | None        # [n,T] per token: the tokens not stopped yet
    logits: torch.Tensor | None = None   # [n,T,C] the last loop's read-out (criteria comparing loops)
    kv: RunningKV | None = None          # the last loop's view of the cache (per token)
    rope: tuple | None = None            # their rotary tables (pos="rope"; [1,...] when shared by all rows)
    rope_all: tuple | None = None        # the whole batch's

    def keep(self, stay: torch.Tensor, e: torch.Tensor, mask: torch.Tensor | None,
             positions: torch.Tensor | None) -> None:
        """Only the rows `stay` [n] go on (e, mask, positions: those of the whole batch)."""
        self.run, self.h, self.streak = self.run[stay], self.h[stay], self.streak[stay]
        self.logits = None if self.logits is None else self.logits[stay]
        self.e, self.positions = e[self.run], None if positions is None else positions[self.run]
        self.mask = mask if mask is None or mask.shape[0] == 1 else mask[self.run]
        if self.rope is not None and self.rope[0].shape[0] > 1:
            self.rope = (self.rope_all[0][self.run], self.rope_all[1][self.run])
        if self.going is not None:
            self.going, self.exits = self.going[stay], self.exits[stay]


@torch.no_grad()
def halting_forward(model: torch.nn.Module, x: torch.Tensor, halt: HaltRule | str, loops: int | None,
                    attn_mask: torch.Tensor | None, positions: torch.Tensor | None, cache: KVCache | None,
                    opts: LoopOptions) -> LoopOutput:
    """Adaptive depth for `model(x, halt=...)` (the module's docstring says how): at most R loops — `loops`,
    else the cache's, else the rule's max, else the model's; `opts.halt_positions` [B,T], the positions a
    row's criterion is taken over (default: every real token), `opts.per_token` (default: causal models).
    Returns `exit_loops` [B] (per token [B,T]); `loops` is the most loops any row ran."""
    cfg = model.config
    rule = HaltRule.parse(halt) if isinstance(halt, str) else halt
    per_token = cfg.causal if opts.per_token is None else opts.per_token
    if per_token and not cfg.causal:
        raise UserError("per-token halting needs a causal model (a token may not see later tokens)")
    if cache is not None and not per_token:
        raise UserError("halting with a key/value cache is per token (per_token=True)")
    if loops is None:
        loops = cache.loops if cache is not None else (rule.max_loops or cfg.loops)
    start = model.begin(x, loops, attn_mask, positions, cache)                     # R, e [B,T,D], mask
    R, e, mask, past = start.loops, start.e, start.mask, start.past
    B, T = x.shape[:2]
    if per_token and cache is None:   # a temporary cache holds the frozen keys/values of stopped tokens
        cache = model.new_cache(B, max_len=T, loops=R)
    mods = model.loop_modulations(R, x.device, cache, prepared=True)              # [R,k,4,D] | None
    P = opts.halt_positions if opts.halt_positions is not None else \
        (attn_mask[:, past:].bool() if attn_mask is not None and T > 1 else None)  # [B,T] | None: all
    tokenwise = per_token and T > 1              # one new token per row (generation): its row is its token
    bound = min(rule.bound(R), R)
    exits = torch.full((B, T) if tokenwise else (B,), bound, dtype=torch.long, device=x.device)
    rows = Running(run=torch.arange(B, device=x.device), h=e, e=e, mask=mask, positions=P,
                   streak=torch.zeros_like(exits), exits=exits,
                   going=torch.ones(B, T, dtype=torch.bool, device=x.device) if tokenwise else None,
                   rope=start.rope, rope_all=start.rope)
    h_out = torch.empty_like(e)                                                    # [B,T,D]
    for t in range(bound):                      # ---- the loop over the running rows:  h <- TF(h (+ e), t) ----
        done = _loop(model, rule, rows, mods, cache if per_token else None, t, R, attn_mask)   # [n] | [n,T]
        if tokenwise:
            rows.exits = torch.where(done & rows.going, t + 1, rows.exits)
            rows.going = rows.going & ~done
            left = ~(rows.going if rows.positions is None else rows.going & rows.positions).any(-1)   # [n]
        else:
            left = done
        if bool(left.any()):                     # rows that stopped leave the batch
            gone = rows.run[left]
            h_out[gone] = rows.h[left]
            exits[gone] = rows.exits[left] if tokenwise else t + 1
            if per_token and t + 1 < R:
                rows.kv.freeze_rows(gone, t + 1, T)
            rows.keep(~left, e, mask, P)
        if rows.run.numel() == 0:
            break
    if rows.run.numel():
        h_out[rows.run] = rows.h
        exits[rows.run] = rows.exits if tokenwise else bound
    if per_token and not tokenwise:
        exits = exits[:, None]                                                     # [B,1]
    if cache is not None:
        cache.length += T
    out = model.read_out(h_out, None, attn_mask, int(exits.max()))                # L2
    out.exit_loops = exits
    return out


def _loop(model: torch.nn.Module, rule: HaltRule, rows: Running, mods, cache: KVCache | None, t: int, R: int,
          attn_mask: torch.Tensor | None) -> torch.Tensor:
    """Loop t of the running rows: their new states (stopped tokens keep theirs; with a cache, their keys and values
    through `RunningKV`, kept as `rows.kv`), the criterion and the streak; returns which stop now [n] | [n,T]."""
    cfg = model.config
    going = rows.going
    all_going = going is None or bool(going.all())
    rows.kv = RunningKV(cache, rows.run, going, len(model.blocks), all_going) if cache is not None else None
    h_new = model.step(rows.h, rows.e if (t > 0 and cfg.input_injection) else None, t,    # h <- TF(h + e, t)
                       None if mods is None else mods[t], rows.mask, rows.kv, rows.rope)
    if not all_going:                                # stopped tokens keep their state
        h_new = torch.where(going[..., None], h_new, rows.h)
    logits = model.head(model.norm_f(h_new), None if attn_mask is None else attn_mask[rows.run]) \
        if rule.needs_read_out else None
    holds = criterion_holds(rule, hidden=h_new, hidden_prev=rows.h if t > 0 else None, logits=logits,
                            logits_prev=rows.logits, positions=rows.positions,
                            stop_logits=None if model.exit_gate is None else model.exit_gate(h_new),
                            per_token=going is not None)
    rows.streak = update_streak(rows.streak, holds)
    rows.h, rows.logits = h_new, logits
    return stops(rule, rows.streak, t + 1, R)
