"""The looped transformer family in one class:  y = L2( TF^r( L1(x) ) )   (paper Sec. 2.2, Eq. 3).

    standard      n_layers = L, loops = 1
    looped        a block of n_layers = k layers (usually 1) applied r = loops times, weights shared
    TMLT          the block also receives the loop index t (timestep modulation, Sec. 4.2)
    injection     the read-in embedding e is added to the hidden state before every loop after the first
    carried state forward(x, opts=LoopOptions(state=h)) starts the loops from a given hidden state h (+ e with
                  injection) instead of e: one supervision step of deep supervision (`loopformer.model.recursion`)
    the step      `step`: h <- TF(h + e, t), written once — forward and the exits call it
    stabilisers   the start state and state noise in training (`loopformer.model.stability`): off by default
    extensions    experiments on the loop (`loopformer.model.extensions`: a start state, a change of the state after
                  each loop, a module on the branches' outputs), named in `ModelConfig.extensions`: none by default
    budgets       timestep_time="normalized": the block reads the time t / R of a run of R loops and its step 1 / R
                  (a budget-aware model); LoopOptions(row_loops=[B]) runs every row with a loop count of its own
    exits         forward(x, halt="kl:1e-3"): every row (or token) loops until a halting rule says it is done
                  (`loopformer.model.exits`)

A call's options beyond a plain fixed-depth run (a carried state, training's read positions, budgets, the exits'
positions) come grouped in one `LoopOptions` (`loopformer.model.options`), so the loop below stays readable.

Shapes: B batch, T length, D width, R loops, k layers per block, C outputs, V vocabulary.
The timestep modulations depend on t only, so they are computed once per forward for all R loops.

Annotations here are evaluated (no `from __future__ import annotations`): the Hugging Face mixin reads
`config: ModelConfig` from `__init__` to rebuild the config from a checkpoint's config.json in `from_pretrained`.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from huggingface_hub import PyTorchModelHubMixin
from torch.utils.checkpoint import checkpoint

from loopformer.errors import UserError
from loopformer.model.cache import DepthwiseKV, KVCache
from loopformer.model.config import ModelConfig
from loopformer.model.exits import halting_forward
from loopformer.model.extensions import build as build_extensions
from loopformer.model.extensions import changes_state
from loopformer.model.halting import ExitGate, HaltRule
from loopformer.model.heads import Embed, Head
from loopformer.model.layers import (
    Modulation,
    RMSNorm,
    TimestepEmbedder,
    is_timestep_param,
    make_layer,
    param_group,
    rope_tables,
)
from loopformer.model.options import PLAIN, Begin, LoopOptions, LoopOutput
from loopformer.model.stability import perturb, start_state


def unwrap(model: torch.nn.Module) -> "LoopedTransformer":
    """The raw module inside DDP / FSDP / torch.compile wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
            model = model.module
        else:
            return model  # type: ignore[return-value]


class LoopedTransformer(nn.Module, PyTorchModelHubMixin):   # the mixin: from_pretrained / push_to_hub
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = cfg = config
        self.embed = Embed(cfg)                                                     # L1
        self.blocks = nn.ModuleList(make_layer(cfg) for _ in range(cfg.n_layers))   # TF (shared across loops)
        with torch.random.fork_rng(devices=[]):   # drawing nothing here keeps the RNG stream of the common weights
            self.timestep = TimestepEmbedder(cfg) if cfg.timestep else None
        self.norm_f = RMSNorm(cfg.d_model, True, cfg.norm_eps) if cfg.final_norm else nn.Identity()
        self.head = Head(cfg)                                                       # L2
        self.exit_gate = ExitGate(cfg.d_model, eps=cfg.norm_eps) if cfg.exit_gate else None   # stop logits
        self.extensions = build_extensions(cfg)   # experiments on the loop (`loopformer.model.extensions`)
        # timestep_past="own" with input injection: the loops past r add β ⊙ e (β learned, starts at 1)
        self.past_injection = nn.Parameter(torch.ones(cfg.d_model)) \
            if cfg.timestep and cfg.timestep_past == "own" and cfg.input_injection else None
        self.reset_parameters()
        if cfg.tie_embeddings:
            self.head.proj.weight = self.embed.tok.weight

    # ------------------------------------------------------------------ init
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 initialisation; residual projections scaled by 1/sqrt(2k); adaLN-Zero for the modulations (gates at
        `timestep_gate_init`).

        The timestep parameters (embedder, modulations) are built without drawing random numbers and drawn here
        after all others, so a TMLT and a looped model made with the same seed share the same read-in, block and
        read-out weights (the looped model's are those of earlier versions): with the gates at 1 the untrained TMLT
        is exactly the untrained looped model of that seed (paired comparisons).
        """
        std = self.config.init_std
        named = [(n, p) for n, p in self.named_parameters()     # the gate draws nothing, nor the loops past r's
                 if not n.startswith(("exit_gate.", "extensions.")) and param_group(n) != "past"]   # own parameters
        for name, p in [*((n, p) for n, p in named if not is_timestep_param(n)),
                        *((n, p) for n, p in named if is_timestep_param(n))]:
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() >= 2:
                s = std / (2 * self.config.n_layers) ** 0.5 if name.endswith("proj.weight") and "blocks" in name \
                    else std
                nn.init.normal_(p, 0.0, s)
            else:
                p.fill_(1.0)  # norm gains
        if self.timestep is not None and self.timestep.table is not None:
            nn.init.normal_(self.timestep.table.weight, 0.0, 1.0)   # the sinusoid's scale: entries of size ~1
        if self.timestep is not None and self.timestep.step_mlp is not None:
            self.timestep.step_mlp[2].weight.zero_()   # MLP_Δ starts at zero: the paper's TE(t) at R = r
        for blk in self.blocks:
            blk.reset_modulation(self.config.timestep_gate_init)
        if self.past_injection is not None:
            self.past_injection.fill_(1.0)
        if self.exit_gate is not None:
            self.exit_gate.reset_parameters()
        for ext in self.extensions:
            ext.reset_parameters()

    # ------------------------------------------------------------------ helpers
    def num_params(self, exclude_positions: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())  # tied weights are counted once
        if exclude_positions:
            n -= sum(p.numel() for name, p in self.embed.named_parameters() if name.startswith(("pos.", "factors.")))
        return n

    def new_cache(self, batch_size: int, max_len: int | None = None, loops: int | None = None) -> KVCache:
        """An empty key/value cache with one slot per (loop, layer) for `loops` loops (default: config.loops)."""
        cfg = self.config
        if not cfg.causal:
            raise UserError("a key/value cache needs a causal model")
        p = next(self.parameters())
        cache = KVCache((loops or cfg.loops) * cfg.n_layers, batch_size, cfg.n_heads, max_len or cfg.max_len,
                        cfg.hd, p.dtype, p.device)
        cache.loops = loops or cfg.loops
        return cache

    def loop_indices(self, loops: int, device: torch.device, offset: int = 0) -> torch.Tensor:
        """The loop index fed to the timestep encoding at loops offset..offset+R-1 (loop t counted from the first
        loop of the first supervision step): t itself; with `step_timestep="restart"` t mod r, the loop within its
        supervision step (a step is r = `loops` loops); past the trained loops (t >= r) with
        `timestep_past="clamp"` the last trained index r - 1, with `"hold"` the index r (one index for every loop
        past r); with `"own"` r - 1 (those loops' modulation is a parameter of its own: `modulations`).  [R] int64."""
        cfg = self.config
        t = torch.arange(offset, offset + loops, device=device)
        if cfg.step_timestep == "restart":
            t = t % cfg.loops
        past = {"clamp": cfg.loops - 1, "hold": cfg.loops, "own": cfg.loops - 1}.get(cfg.timestep_past)
        return t if past is None else t.clamp(max=past)

    def loop_times(self, loops: int, device: torch.device, offset: int = 0,
                   budget: int | torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A budget-aware model's (`timestep_time="normalized"`) sinusoid arguments at loops offset..offset+R-1 of a
        run of `budget` loops (default offset + R; a tensor [B]: a budget per row): (r·t / budget, r / budget) —
        the time τ = t / budget and step Δt = 1 / budget in units of the trained r, so that at budget r the time is
        the paper's loop index t. With `timestep_past="clamp"`, t stops at budget − 1 (`"hold"`: at budget).
        [R] each ([R,B] per row)."""
        r = float(self.config.loops)
        n = torch.as_tensor(offset + loops if budget is None else budget, device=device, dtype=torch.float32)
        t = torch.arange(offset, offset + loops, device=device, dtype=torch.float32)
        if n.dim():                                                                     # a budget per row
            t, n = t[:, None], n[None]
        if self.config.timestep_past in ("clamp", "hold"):
            t = torch.minimum(t, n - int(self.config.timestep_past == "clamp"))
        tau = r * t / n
        return tau, (r / n).expand_as(tau)

    def modulations(self, loops: int, device: torch.device, offset: int = 0,
                    budget: int | torch.Tensor | None = None) -> torch.Tensor | None:
        """[γ1, γ2, s1, s2] for every loop and layer at once: [R, k, 4, D] (None without timestep encoding);
        loops offset..offset+R-1 (see `loop_indices`). A budget-aware model reads its times in a run of `budget`
        loops (`loop_times`); with a budget per row ([B]) the modulations are per row: [R, k, 4, B, 1, D]."""
        if self.timestep is None:
            return None
        if self.config.timestep_time == "normalized":
            te = F.silu(self.timestep(*self.loop_times(loops, device, offset, budget)))  # [R,D] | [R,B,D]
        else:
            te = F.silu(self.timestep(self.loop_indices(loops, device, offset)))       # SiLU(TE(t)): [R,D]
        mods = torch.stack([blk.loop_modulation(te) for blk in self.blocks], dim=1)   # [R,k,4,D] | [R,k,B,4,D]
        if self.config.timestep_past == "own":      # the loops past r: their own modulation, [k,4,D]
            past = self._is_past(torch.arange(offset, offset + loops, device=device))             # [R]
            mods = torch.where(past[:, None, None, None], torch.stack([b.past_modulation for b in self.blocks]), mods)
        return mods if te.dim() == 2 else mods.transpose(2, 3).unsqueeze(-2)           # ... | [R,k,4,B,1,D]

    def _is_past(self, t: int | torch.Tensor) -> bool | torch.Tensor:
        """Whether loop t (0-based; an int or a tensor of them) lies past the trained r: t >= r, never with
        `step_timestep="restart"`, whose index starts again every r loops."""
        return (t >= self.config.loops) & (self.config.step_timestep != "restart")

    def injection(self, e: torch.Tensor, t: int | torch.Tensor) -> torch.Tensor:
        """What input injection adds to the state before loop t (0-based, counted as `loop_indices` counts; an int,
        or [B] for a loop per row): the read-in e; with `timestep_past="own"` the loops past r add β ⊙ e, β the
        learned `past_injection` (starts at 1), so that those loops can learn to stop adding the input."""
        if self.past_injection is None:
            return e
        past = self._is_past(t)
        if isinstance(past, bool):
            return e * self.past_injection if past else e
        return torch.where(past.view(-1, *([1] * (e.dim() - 1))), e * self.past_injection, e)   # [B,1,..]

    @torch.no_grad()
    def start_past_modulation(self) -> None:
        """`timestep_past="own"`: set every layer's own modulation of the loops past r to what the hold index t = r
        gives (W5·SiLU(TE(r)) + b5; a learned table's last vector) and the injection's β to 1, so that a model whose
        weights lacked them starts as it ran with `timestep_past="hold"`."""
        if self.config.timestep_past != "own":
            return
        p = next(self.parameters())
        te = F.silu(self.timestep(torch.tensor([self.config.loops], device=p.device)))   # [1,D]
        for blk in self.blocks:
            blk.past_modulation.copy_(blk.loop_modulation(te)[0])
        if self.past_injection is not None:
            self.past_injection.fill_(1.0)

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, *, loops: int | None = None, attn_mask: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, cache: KVCache | None = None, return_all: bool = False,
                halt: HaltRule | str | None = None, opts: LoopOptions = PLAIN) -> LoopOutput:
        """Run L1, then the block `loops` times, then L2.

        x: [B,T] token ids or [B,T,input_dim] reals.  attn_mask: [B,S] key-padding mask (True = real token),
        S = cached + T.  positions: learned positions of the tokens (default: counted from the first real one).
        cache: from `new_cache` (generation; each loop reads its own slot).
        return_all: also return every loop's hidden state and read-out.
        halt: adaptive depth per row, or per token, by a `HaltRule` (or its text, e.g. "kl:1e-3"): the exits of
        `loopformer.model.exits`.
        opts: the options of deep supervision (a carried state), training's read-out, elastic depth and exits
        (`LoopOptions`; none by default).
        """
        if halt is not None:
            if opts.state is not None or opts.loop_offset:
                raise UserError("halting runs from the read-in: state and loop_offset cannot be combined with it")
            return halting_forward(self, x, halt, loops, attn_mask, positions, cache, opts)
        run = self.begin(x, loops, attn_mask, positions, cache, opts)                 # R, e [B,T,D], mask
        h, states = run.h0, []                                                         # [B,T,D]
        for t in range(run.loops):                  # ---- the loop (Eq. 3):  h <- TF(h + e, t),  [B,T,D] ----
            with torch.set_grad_enabled(run.grad and t >= run.grad_from):    # a no-grad prefix: truncated backprop
                h = self._loop(h, t, run)
            if return_all:
                states.append(h)
        if cache is not None:
            cache.length += x.shape[1]
        return self.read_out(h, states if return_all else None, attn_mask, run.loops, opts.read_at,
                             opts.read_loops)                                          # L2

    def start(self, e: torch.Tensor) -> torch.Tensor | None:
        """The state the first loop starts from for read-in e [B,T,D]: `start_state` ("input": None, the loop starts
        from e itself; "zeros": 0, with e injected before the first loop), then each extension's `start`."""
        h0 = start_state(e, self.config)
        for ext in self.extensions:
            h0 = ext.start(e, h0, self.training)
        return h0

    def step(self, h: torch.Tensor, e: torch.Tensor | None, t: int | torch.Tensor, mods_t=None,
             mask: torch.Tensor | None = None, cache=None, rope=None, at: torch.Tensor | None = None,
             slot: int | None = None) -> torch.Tensor:
        """One loop, the paper's step h <- TF(h + e, t) (Eq. 3): the read-in e injected (None: nothing injected, the
        first loop from the read-in itself; past r with `timestep_past="own"` β ⊙ e), the block's k layers at loop
        t (modulations `mods_t`, [k,4,D] or prepared; cache slot `slot`, default t), then the extensions' change of
        the state (`LoopExtension.after_loop`; none: the block's output). Every path that runs the block calls this:
        `forward` and the exits.
        h, e: [B,T,D] -> [B,T,D] ([N,D] with `at`, the flattened positions the last layer computes)."""
        x = h if e is None else h + self.injection(e, t)                                # input injection
        out = self.block(x, mods_t, mask, cache, t if slot is None else slot, at, rope)   # TF(x, t)
        for ext in self.extensions:                  # an experiment's change of the state (none by default)
            out = ext.after_loop(h, out, t)
        return out

    def _loop(self, h: torch.Tensor, t: int, run: Begin) -> torch.Tensor:
        """Loop t of `forward`: the step (checkpointed when asked), state noise in training, and rows past their
        own loop count keeping their state.  [B,T,D] -> [B,T,D]."""
        cfg = self.config
        e = run.e if (t > 0 or run.injected_first) and cfg.input_injection else None
        mods_t = None if run.mods is None else run.mods[t]
        at = run.read_at if t == run.loops - 1 else None                               # -> h: [N,D]
        if run.checkpoint and torch.is_grad_enabled():
            out = checkpoint(self.step, h, e, run.offset + t, mods_t, run.mask, None, run.rope, at, t,
                             use_reentrant=False)
        else:
            out = self.step(h, e, run.offset + t, mods_t, run.mask, run.cache, run.rope, at, t)
        out = perturb(out, cfg, self.training)       # state noise (training only; `loopformer.model.stability`)
        if run.rows is not None:                     # rows past their own loop count keep their state
            out = torch.where((run.rows > t)[:, None, None], out, h)
        return out

    def begin(self, x: torch.Tensor, loops: int | None, attn_mask: torch.Tensor | None,
              positions: torch.Tensor | None, cache: KVCache | None, opts: LoopOptions | None = None) -> Begin:
        """What every run of the block starts from, for `forward`'s loop and the exits alike: the call checked,
        its loop count R (`loops`, default the model's), the read-in e = L1(x) and the attention mask; with `opts`
        (`forward`'s unrolled loop) also what its loops read: modulations, start state, loop counts per row,
        the truncated-backpropagation prefix, checkpointing and the last loop's read positions."""
        cfg = self.config
        R = self._check_call(x, loops, cache)
        past = cache.length if cache is not None else 0
        mask = self._mask(attn_mask, x.shape[1], past, x.device)                      # [B|1,1,T,S] | None
        e = self.embed(x, self._positions(x, positions, attn_mask, past))              # L1: [B,T,D]
        rope = None if cfg.pos != "rope" else \
            rope_tables(self._token_positions(x, positions, attn_mask, past), cfg.hd, cfg.rope_base)
        run = Begin(R, e, mask, past, rope)
        if opts is None:
            return run
        run.rows = None if opts.row_loops is None else self._check_rows(x, opts.row_loops, R, cache)   # [B]
        run.mods = self.loop_modulations(R, x.device, cache, opts.loop_offset,         # [R,k,4,D] | None
                                         run.rows if run.rows is not None and opts.budget is None else opts.budget,
                                         prepared=True)
        run.grad = torch.is_grad_enabled()
        run.grad_from = R - cfg.grad_loops if (run.grad and cfg.grad_loops is not None) else 0
        run.checkpoint = cfg.checkpoint and run.grad and cache is None
        sparse = opts.read_only and opts.read_at is not None and cache is None and run.rows is None \
            and cfg.dropout == 0 and (run.mods is None or run.mods.dim() == 4) and not changes_state(self.extensions)
        run.read_at = opts.read_at if sparse else None                                # the last loop's positions
        h0 = self.start(e) if opts.state is None else opts.state                      # None: start from e itself
        run.h0, run.injected_first = (e if h0 is None else h0), h0 is not None
        run.offset, run.cache = opts.loop_offset, cache
        return run

    @torch.no_grad()
    def loop_rows(self, h: torch.Tensor, e: torch.Tensor, starts: torch.Tensor, t: torch.Tensor, cache: KVCache,
                  cols: torch.Tensor, seen: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        """One loop for every row of `cache`, each at a loop of its own (depth-wise batched generation,
        `loopformer.text.generate`): row i computes its token at column cols_i in loop t_i (0-based), attending to
        the columns `seen` marks in that loop's slot — the step h <- TF(h + e, t) per row, a row at its token's
        first loop (`starts`) running the block on its read-in e.

        h, e: [B,1,D] the rows' states and read-ins; starts: [B,1,1] bool; t, cols: [B]; seen: [B,W] bool, the
        columns row i's token attends to (its real columns up to cols_i; W = the widest row's cols_i + 1); pos: [B]
        the tokens' positions for rotary encoding (default cols; left-padded rows count from their first real
        token). Returns the hidden states after the loop [B,1,D]."""
        if changes_state(self.extensions):
            raise UserError("depth-wise batched generation carries the block's inputs, not the state an extension "
                            "changes after each loop: use the step schedule (schedule=step)")
        mods = self.prepare_rows(cache)                                                # [R,k·4,1,D] | None
        if mods is not None:
            m = mods.index_select(0, t).unbind(1)                                      # k·4 × [B,1,D]
            mods = [Modulation(*m[4 * i:4 * i + 4], folded=False) for i in range(len(self.blocks))]
        kv = DepthwiseKV(cache, t, cols, len(self.blocks), seen.shape[1])
        rope = None if self.config.pos != "rope" else \
            rope_tables((cols if pos is None else pos)[:, None], self.config.hd, self.config.rope_base)
        x = torch.where(starts, e, h + self.injection(e, t) if self.config.input_injection else h)   # [B,1,D]
        return self.block(x, mods, seen[:, None, None], kv, 0, rope=rope)

    def prepare_rows(self, cache: KVCache) -> torch.Tensor | None:
        """What `loop_rows` looks up, made once per cache: the cache entries per (loop, row)
        (`DepthwiseKV.tables`) and [γ1, γ2, α1, α2] (α = 1 + s) of every loop and layer, [R,k·4,1,D], which it
        returns (None without timestep encoding)."""
        if cache.later is None:
            _, _, B, H, L, _ = cache.kv.shape                                  # [2,R·k,B,H,L,Dh]
            cache.later = DepthwiseKV.tables(cache.loops, len(self.blocks), B, H, L, cache.kv.device)
        mods = self.loop_modulations(cache.loops, cache.k.device, cache)              # [R,k,4,D] | None
        if mods is None:
            return None
        if cache.row_mods is None:
            cache.row_mods = torch.cat([mods[:, :, :2], 1 + mods[:, :, 2:]], dim=2).flatten(1, 2).unsqueeze(2)
        return cache.row_mods

    # ------------------------------------------------------------------ forward's parts
    def _check_call(self, x: torch.Tensor, loops: int | None, cache: KVCache | None) -> int:
        """The loop count R of a call, after checking the call's arguments against each other and the model."""
        cfg = self.config
        R = cfg.loops if loops is None else int(loops)
        if R < 1:
            raise UserError(f"loops must be >= 1 (got {R})")
        past = cache.length if cache is not None else 0
        if cfg.indexed_positions and past + x.shape[1] > cfg.max_len:
            raise UserError(f"sequence length {past + x.shape[1]} exceeds the model's max_len {cfg.max_len}")
        if cache is not None:
            if cache.loops != R:
                raise UserError(f"this cache was made for {cache.loops} loops, not {R}")
        return R

    @staticmethod
    def _check_rows(x: torch.Tensor, row_loops: torch.Tensor, R: int, cache: KVCache | None) -> torch.Tensor:
        """`row_loops` as a [B] int64 tensor on x's device, after checking it against the call."""
        if cache is not None:
            raise UserError("row_loops (a loop count per row) cannot be combined with a key/value cache")
        rows = torch.as_tensor(row_loops, device=x.device).long()
        if rows.shape != (x.shape[0],):
            raise UserError(f"row_loops needs one loop count per row: shape ({x.shape[0]},), got {tuple(rows.shape)}")
        if rows.numel() and (int(rows.min()) < 1 or int(rows.max()) > R):
            raise UserError(f"row_loops must lie in 1..{R} (the call's loops)")
        return rows

    def _positions(self, x: torch.Tensor, positions: torch.Tensor | None, attn_mask: torch.Tensor | None,
                   past: int) -> torch.Tensor | None:
        """Learned positions of the new tokens: given, counted from the first real token under left padding, or
        after the cached ones (None: 0..T-1)."""
        if positions is not None or not self.config.indexed_positions:
            return positions
        if attn_mask is None and not past:
            return None
        return self._token_positions(x, None, attn_mask, past)

    def _token_positions(self, x: torch.Tensor, positions: torch.Tensor | None, attn_mask: torch.Tensor | None,
                         past: int) -> torch.Tensor:
        """The positions of the new tokens, [B|1,T]: given, counted from the first real token under left padding
        (the first real token is position 0), else past..past+T-1 (learned positions and rotary encoding alike)."""
        if positions is not None:
            return positions if positions.dim() == 2 else positions[None]
        T = x.shape[1]
        if attn_mask is not None:
            return (attn_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past:past + T]
        return torch.arange(past, past + T, device=x.device)[None]

    def _mask(self, attn_mask: torch.Tensor | None, T: int, past: int, device) -> torch.Tensor | None:
        """Boolean attention mask [B|1, 1, T, S] (True = may attend), or None for the fused causal/full path."""
        w = self.config.attn_window
        if attn_mask is None and past == 0 and not w:
            return None
        S = past + T
        q = torch.arange(past, S, device=device)[:, None]
        k = torch.arange(S, device=device)[None, :]
        allowed = (k <= q) if self.config.causal else torch.ones(T, S, dtype=torch.bool, device=device)
        if w:                                                                          # the sliding window
            allowed = allowed & ((q - k) < w) & ((k - q) < w)
        allowed = allowed[None, None]                                                  # [1,1,T,S]
        if attn_mask is not None:
            if attn_mask.shape[-1] != S:
                raise ValueError(f"attn_mask covers {attn_mask.shape[-1]} positions, expected {S}")
            allowed = allowed & attn_mask.bool()[:, None, None, :]
        return allowed | (k == q)[None, None]   # a padded query still sees itself, so no row is empty

    def loop_modulations(self, loops: int, device: torch.device, cache: KVCache | None, offset: int = 0,
                          budget: int | torch.Tensor | None = None, prepared: bool = False):
        """`modulations` of this call; in generation (a cache, no gradients) computed once per cache, and with
        `prepared` as every layer applies them (`Layer.prepare`, `[R][k]`: no per-token work on the modulations)."""
        if cache is not None and not torch.is_grad_enabled():   # generation: same modulations for every token
            if cache.mods is None:
                cache.mods = self.modulations(loops, device, offset, budget)
            if not prepared or cache.mods is None:
                return cache.mods
            if cache.prepared is None:
                cache.prepared = [[blk.prepare(m) for blk, m in zip(self.blocks, mods_t)] for mods_t in cache.mods]
            return cache.prepared
        return self.modulations(loops, device, offset, budget)

    def block(self, h: torch.Tensor, mods_t, mask: torch.Tensor | None,
               cache: KVCache | None, t: int, at: torch.Tensor | None = None, rope=None) -> torch.Tensor:
        """TF(h, t): the block's k layers at loop t (layer i of loop t uses cache slot t·k + i); mods_t: [k,4,D] or
        the k layers' prepared `Modulation`s; rope: the rotary tables of the positions (`Begin.rope`). With `at`
        [N] the last layer computes only those of the flattened B·T positions: [B,T,D] -> [N,D]."""
        k = len(self.blocks)
        for i, blk in enumerate(self.blocks):
            mod = None if mods_t is None else mods_t[i]
            if at is not None and i == k - 1:
                return blk.forward_at(h, at, mod, mask, rope)
            h = blk(h, mod, mask, cache, t * k + i if cache is not None else 0, rope)   # the slot: a cache's only
        return h

    def read_out(self, h: torch.Tensor, states: list[torch.Tensor] | None, attn_mask: torch.Tensor | None,
                  ran: int, read_at: torch.Tensor | None = None, read_loops: int | None = None) -> LoopOutput:
        """L2 after the last loop (and after each of the last `read_loops` loops when `states` holds them — all of
        them by default), at the positions `read_at` only when given; the final logits are the last loop's
        read-out. The exit gate's stop logits likewise when the model has one (per loop: not with `read_at`)."""
        if read_at is not None and self.head.kind == "sequence":
            raise UserError("read_at selects positions of a token-wise read-out, not of a pooled sequence head")
        at = (lambda z: z if z.dim() == 2 else z.flatten(-3, -2).index_select(-2, read_at)) \
            if read_at is not None else (lambda z: z)                # a read_only last loop is at read_at already
        if states is None:
            out = LoopOutput(logits=self.head(self.norm_f(at(h)), attn_mask), hidden=h, loops=ran)
        else:
            read = states[-read_loops:] if read_loops else states
            hidden = torch.stack([at(s) for s in read]) if read_at is not None else torch.stack(read)  # [R',B,T,D]
            all_logits = self.head(self.norm_f(hidden), attn_mask)                             # [R',B,T,C]
            out = LoopOutput(logits=all_logits[-1], hidden=h, all_logits=all_logits, all_hidden=hidden, loops=ran)
        if self.exit_gate is not None:
            out.stop_logits = self.exit_gate(h)                                        # [B,T]
            if states is not None and read_at is None:
                out.all_stop_logits = self.exit_gate(out.all_hidden)                   # [R',B,T]
        return out
