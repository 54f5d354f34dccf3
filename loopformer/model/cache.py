"""Key/value caches of a looped model's generation: one slot per (loop, layer), since every loop of the shared
block sees a different hidden state and so writes its own keys and values.

    KVCache       the cache of a batch: keys and values in one buffer [2, R·k, B, H, L, Dh], a slot per (loop,
                  layer), and what a generation prepares once per cache (the loops' modulations, the depth-wise
                  tables)
    RunningKV     the view of the running rows of a batch under per-token exits (the step schedule of adaptive
                  depth): a stopped token's later slots read its deepest computed entries
    DepthwiseKV   the view of one depth-wise tick (rows at different loops of different tokens): keys and values
                  written through to the slots of every later loop, so a stopped token needs no copy

Used by `loopformer.model.layers.Attention` (reads and writes) and `loopformer.model.looped` (makes and advances
them); `loopformer.text.generate` drives them. Shapes: B batch, H heads, L cached length, Dh head width, R loops,
k layers per block.
"""

from __future__ import annotations

import torch


class KVCache:
    """Key/value cache for generation: one slot per (loop, layer), because the hidden state that produces the keys
    differs at every loop. Preallocated to `max_len` positions; `length` is the number of positions filled.

        k, v: [R·k, B, H, max_len, Dh]   (views of one buffer kv [2, R·k, B, H, max_len, Dh])
    """

    def __init__(self, slots: int, batch: int, heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.kv = torch.zeros(2, slots, batch, heads, max_len, head_dim, dtype=dtype, device=device)
        self.k, self.v = self.kv[0], self.kv[1]
        self.max_len = max_len
        self.length = 0
        self.loops = 0  # set by the model on the first call; later calls must use the same loop count
        self.mods = None  # the loop modulations [R,k,4,D]: fixed weights for a cache's lifetime, computed once
        self.prepared = None  # ... and as every layer applies them, [R][k] `Modulation`s
        self.row_mods = None  # ... with α = 1 + s, for rows at loops of their own (depth-wise generation)
        self.rows = torch.arange(batch, device=device)
        self.later = None  # depth-wise generation: the entries a token at loop t writes (`DepthwiseKV.tables`)

    @property
    def slots(self) -> int:
        return self.k.shape[0]

    def update(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B,H,T,Dh] after the filled part; return all keys/values so far [B,H,length+T,Dh]."""
        t = k.shape[2]
        end = self.length + t
        self.k[slot, :, :, self.length:end] = k
        self.v[slot, :, :, self.length:end] = v
        return self.k[slot, :, :, :end], self.v[slot, :, :, :end]


class RunningKV:
    """The running rows of a `KVCache` during per-token halting (`LoopedTransformer` with a causal `HaltRule`).

    A position that has stopped looping keeps the keys/values of its deepest computed loop in every later loop's
    slot ("frozen"); later tokens read those. `update` writes the new keys/values of the running positions only
    (`running` [n,T] bool) and, for the stopped ones, carries the previous loop's entry forward:

        cache[slot][rows, :, new] = running ? k : cache[slot − k][rows, :, new]      (k layers per block)

    Rows that stop entirely leave the batch; `freeze_rows` then copies their deepest loop into every later slot.
    """

    def __init__(self, cache: KVCache, rows: torch.Tensor, running: torch.Tensor | None, layers: int,
                 all_running: bool):
        self.cache, self.rows, self.running, self.layers = cache, rows, running, layers
        self.all_rows = rows.numel() == cache.k.shape[1]                        # rows = 0..B-1 (never reordered)
        self.all_running = all_running                                          # running is all True (or None)

    def update(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c, rows = self.cache, self.rows
        start, end = c.length, c.length + k.shape[2]
        if slot >= self.layers and not self.all_running:                        # stopped positions: carried
            keep = self.running[:, None, :, None]                               # [n,1,T,1]
            k = torch.where(keep, k, c.k[slot - self.layers, rows, :, start:end])
            v = torch.where(keep, v, c.v[slot - self.layers, rows, :, start:end])
        if self.all_rows:                                                       # views, no copies
            return c.update(slot, k, v)
        c.k[slot, rows, :, start:end] = k
        c.v[slot, rows, :, start:end] = v
        return c.k[slot, rows, :, :end], c.v[slot, rows, :, :end]

    def freeze_rows(self, rows: torch.Tensor, loop: int, T: int) -> None:
        """Rows `rows` stopped after loop `loop` (1-based): copy the slots of that loop into all later loops' slots,
        for this call's T new positions."""
        c, k = self.cache, self.layers
        start, end = c.length, c.length + T
        for i in range(k):
            src = (loop - 1) * k + i
            later = torch.arange(loop * k + i, c.slots, k, device=rows.device)
            if later.numel() == 0:
                continue
            for buf in (c.k, c.v):
                val = buf[src, rows, :, start:end]                               # [m,H,T,Dh]
                buf[later[:, None], rows[None, :], :, start:end] = val.unsqueeze(0).expand(len(later), *val.shape)


class DepthwiseKV:
    """The rows of a `KVCache` in depth-wise batched generation: every row b computes one new token, each at its
    own loop t_b and its own column c_b ([B]). `update` writes the token's keys/values into its slot t_b·k + layer
    and into the same layer's slots of every later loop, and returns each row's keys/values of slot t_b·k + layer
    up to column `width` − 1 ([B,H,width,Dh]; the caller's mask hides the columns past c_b).

    Writing through to the later loops leaves the cache as `RunningKV`'s policy does when a token stops: the slots
    of the loops it did not run hold its deepest computed loop's keys/values (the last write), the entries later
    tokens read — with no copy when it stops. A slot of a later loop is read only by the same row's later tokens,
    which start after this one has stopped. Keys and values are written and read together, through indices into
    the cache's combined buffer looked up per (loop, row) in tables made once per cache: a handful of operations
    per loop, which runs once per row and loop of every token."""

    def __init__(self, cache: KVCache, loops: torch.Tensor, cols: torch.Tensor, layers: int, width: int):
        _, S, B, H, L, Dh = cache.kv.shape                                     # S = R·k slots
        self.width, self.layer_rows, self.layer_entries = width, B, B * H * L
        self.slot_rows = cache.kv.view(2 * S * B, H, L, Dh)                    # the (k|v, slot, row) axis
        self.entries = cache.kv.view(-1, Dh)                                   # the (k|v, slot, row, head, col) axis
        later, first = cache.later                                             # made by `prepare_rows`
        at = cache.rows.add(loops, alpha=B)                                    # [B] (loop t_b, row b)
        self.at = first.index_select(1, at).view(-1)                           # [2B] keys then values
        self.through = later.index_select(0, at) + cols.view(B, 1, 1, 1)       # [B,2,R,H]

    @staticmethod
    def tables(R: int, layers: int, B: int, H: int, L: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Per (loop t, row b) = t·B + b: the entries of column 0 its token writes through to, [R·B,2,R,H] (k|v,
        loop max(t, l), head), and its layer-0 slots in the (k|v, slot, row) axis, [2,R·B]."""
        t, b = torch.arange(R, device=device), torch.arange(B, device=device)
        kv = torch.tensor([0, R * layers * B], device=device)                  # the values' offset, in slot rows
        slot_rows = torch.maximum(t[:, None], t[None]) * (layers * B)          # [R,R] (t, l)
        rows = kv[None, :, None] + slot_rows[:, None] + b[:, None, None, None]  # [B,R,2,R] (b, t, k|v, l)
        later = (rows.transpose(0, 1) * (H * L))[..., None] + torch.arange(H, device=device) * L
        first = kv[:, None, None] + (t * (layers * B))[None, :, None] + b      # [2,R,B]
        return later.flatten(0, 1), first.flatten(1, 2)

    def update(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B = k.shape[0]                                                          # k, v: [B,H,1,Dh]
        through, at = (self.through + slot * self.layer_entries, self.at + slot * self.layer_rows) if slot \
            else (self.through, self.at)
        self.entries.index_put_((through,), torch.stack([k, v], 1).transpose(2, 3))   # [B,2,1,H,Dh] -> [B,2,R,H,Dh]
        out = self.slot_rows[:, :, :self.width].index_select(0, at)           # [2B,H,width,Dh]
        return out[:B], out[B:]


__all__ = ["KVCache", "RunningKV", "DepthwiseKV"]
