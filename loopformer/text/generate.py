"""Text generation from a looped language model: temperature / top-k / top-p sampling, batched prompts of different
lengths, a key/value cache per loop step.

A looped model recomputes every position at every loop, so the keys and values that loop t attends to come from the
hidden state after loop t-1: a cache needs one slot per (loop, layer) — `LoopedTransformer.new_cache` — and each
loop's attention reads and extends its own slot. With it, each new token costs one position through R loops instead
of the whole sequence through R loops.

Batching: prompts are left-padded to a common length P with an attention mask (True = real token); the model derives
positions from the mask, so each row sees exactly what it would see alone. Row i's new tokens are appended after
column P-1 for every row, so all rows advance together; a row that has emitted EOS keeps being fed (its later tokens
are discarded).

Adaptive depth (`SamplingConfig.halt`, e.g. "kl:1e-3"): every token loops until the rule says it is done (at most
R loops). A token that stops at loop t computes no keys/values for loops t+1..R; its cache slots for those loops hold
its deepest computed loop's keys/values (the policy of Huginn's per-token exits), and later tokens read them there
(`loopformer.model.cache.RunningKV`). A recomputation without the cache follows the same policy, so cached and
recomputed generation agree. Rows whose new token has stopped leave the batch for the remaining loops.

Depth-wise batching (`SamplingConfig.schedule="depthwise"`, the default with a halting rule and the cache): after
the prompts, rows no longer advance together. Each row computes its current token one loop per tick, each at a loop
of its own; a row whose token stops samples its next token at once and starts it at loop 1 in the next tick, so the
batch stays full and a token costs its own loops, not the slowest row's (`LoopedTransformer.loop_rows`). Every
token sees the same keys and values as in the step-by-step schedule ("step"), so greedy decoding gives the same
tokens; with sampling the rows draw from the generator in another order. A token's keys and values are written
through to the slots of every later loop as it computes them, so when it stops those slots already hold its deepest
loop's (`loopformer.model.cache.DepthwiseKV`). A single prompt (nothing to regroup) and `return_logits` use the
step schedule. A tick is a few dozen small operations whatever the width, so on a CPU with narrow models its
per-operation cost can outweigh the loops the exits save; `SamplingConfig.compile` runs the tick's model part
(`_tick`) under torch.compile (one graph per batch size and cache length, compiled in seconds on first use, the
attention then reading every column of the cache under its mask).

Sampling (`sample_next`): logits / temperature (0 = greedy), then top-k (keep the k largest), then top-p (keep the
smallest set of tokens whose probability reaches p), then one draw from a seeded `torch.Generator` — the same seed
gives the same text.
Shapes: B batch (prompts), P padded prompt length, V vocabulary, N new tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from loopformer.device import can_compile
from loopformer.errors import UserError
from loopformer.model.halting import NEEDS_PREVIOUS, HaltRule, criterion_holds, stops, update_streak
from loopformer.model.memory import check_fits, check_loops, estimate


@dataclass
class SamplingConfig:
    max_new_tokens: int = 64
    temperature: float = 1.0        # 0: greedy (argmax)
    top_k: int | None = None     # keep the k most likely tokens
    top_p: float | None = None   # nucleus: keep the most likely tokens up to total probability p
    seed: int = 0
    stop_at_eos: bool = True
    loops: int | None = None     # loops at inference (default: the model's)
    halt: str | None = None      # adaptive depth per token, a halting rule such as "kl:1e-3" (None: fixed depth)
    schedule: str = "depthwise"     # with `halt` and the cache: "depthwise" (each row at its own loop) | "step"
    compile: bool = False           # the depth-wise schedule's tick under torch.compile (pays for long outputs)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be >= 1 (got {self.max_new_tokens})")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise UserError(f"temperature must be a finite number >= 0 (got {self.temperature})")
        if not 0 <= self.seed < 2 ** 63:
            raise UserError(f"seed must be in [0, 2^63) (got {self.seed})")
        if self.top_k is not None and self.top_k < 1:
            raise UserError(f"top_k must be >= 1 (got {self.top_k})")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise UserError(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.loops is not None and self.loops < 1:
            raise UserError(f"loops must be >= 1 (got {self.loops})")
        if self.halt is not None:
            HaltRule.parse(self.halt)
        if self.schedule not in ("depthwise", "step"):
            raise UserError(f"schedule must be 'depthwise' or 'step' (got {self.schedule!r})")


def filter_logits(logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """Set the logits outside the top-k / top-p set to -inf. logits [B,V] -> [B,V]."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]                      # [B,1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)            # [B,V]
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs            # probability of the strictly more likely tokens
        drop_sorted = before >= top_p
        drop_sorted[..., 0] = False                   # the most likely token always stays (also for a p below
                                                      # the dtype's smallest number)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row from logits [B,V] -> [B] int64."""
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(-1)
    # the largest logit at 0 and the temperature at least float32's smallest normal number: a tiny temperature
    # gives -inf elsewhere, never inf - inf or 0 / 0 (NaN)
    logits = logits - logits.max(-1, keepdim=True).values
    logits = filter_logits(logits / max(temperature, torch.finfo(logits.dtype).tiny), top_k, top_p)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (idx [B,P], mask [B,P] bool, True = real token), padded on the left."""
    if not prompts:
        raise UserError("no prompt given")
    if any(len(p) == 0 for p in prompts):
        raise UserError("empty prompt: give at least one token of text")
    P = max(len(p) for p in prompts)
    idx = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), P, dtype=torch.bool)
    for i, p in enumerate(prompts):
        idx[i, P - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
        mask[i, P - len(p):] = True
    return idx, mask


@dataclass
class Generation:
    tokens: list[list[int]]              # new tokens per prompt, up to and including EOS when stopped by it
    logits: torch.Tensor | None       # [B,N,V] the logits each new token was sampled from (if asked)
    finished: list[bool]                 # stopped by EOS
    exit_loops: torch.Tensor | None = None   # [B,N] with a halting rule: the loops each new token's logits took


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _runs_depthwise(cfg: SamplingConfig, B: int, use_cache: bool, return_logits: bool) -> bool:
    """Whether generation runs the depth-wise schedule (module docstring): a halting rule, the cache, the depthwise
    schedule and more than one prompt, without returned logits."""
    return use_cache and cfg.halt is not None and cfg.schedule == "depthwise" and B > 1 and not return_logits


def _check_request(model, cfg: SamplingConfig, device: torch.device, B: int, P: int, max_len: int | None,
                   use_cache: bool, return_logits: bool, memory_check: bool) -> None:
    """Refuse, before anything is allocated, a generation that cannot run: past the model's context with the cache,
    too many loops, `compile` where the depth-wise tick would not run or cannot be compiled, a cache larger than the
    memory available (`memory_check`)."""
    N = cfg.max_new_tokens
    if use_cache and max_len is not None and P + N > max_len:
        raise UserError(f"prompt ({P} tokens) + {N} new tokens exceed the model's context of {max_len}; "
                        "shorten them or generate without the cache")
    check_loops(cfg.loops, model.config.loops)
    # what `compile` compiles, the depth-wise tick, runs nowhere else: refused where it would not run, never ignored
    if cfg.compile and not _runs_depthwise(cfg, B, use_cache, return_logits):
        raise UserError("compile applies to the depth-wise tick of exits in batched generation: a halting rule, "
                        "the cache, the depthwise schedule and more than one prompt, without returned logits")
    if cfg.compile and not can_compile(device):
        raise UserError(f"compile needs torch.compile's code generation on {device.type} (a C++ compiler on a "
                        "CPU, Triton on CUDA)")
    if use_cache and memory_check:   # every loop keeps its own keys and values: refuse before allocating them
        R = cfg.loops or (HaltRule.parse(cfg.halt).max_loops if cfg.halt is not None else None) or model.config.loops
        check_fits(estimate(model.config, batch=B, seq_len=P + N, loops=R, cache_len=P + N), device,
                   "generation", hint="fewer prompts, loops or new tokens")


def _last(out, exit_loops: list) -> torch.Tensor:
    """The logits of the last position [B,V] of a model output; its exit loop [B] (with a halting rule) is appended
    to `exit_loops`."""
    if out.exit_loops is not None:
        exit_loops.append(out.exit_loops[:, -1])
    return out.logits[:, -1]


def _feed(model, idx: torch.Tensor, mask: torch.Tensor, nxt: torch.Tensor, cache, kw: dict, max_len: int | None,
          exit_loops: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Feed the new tokens nxt [B] (mask [B,P+n] already extended for them): one position through the cache, or
    without one (cache None) the whole sequence recomputed, cropped to the last `max_len` columns. Returns the
    tokens so far idx [B,P+n] (grown only without the cache) and the logits of the next position [B,V]."""
    if cache is not None:
        return idx, _last(model(nxt[:, None], attn_mask=mask, cache=cache, **kw), exit_loops)
    idx = torch.cat([idx, nxt[:, None]], dim=1)
    x, m = idx, mask
    if max_len is not None and x.shape[1] > max_len:
        x, m = x[:, -max_len:], m[:, -max_len:]
    return idx, _last(model(x, attn_mask=m, **kw), exit_loops)


def _step_result(out_tokens: torch.Tensor, finished: torch.Tensor, all_logits: list, exit_loops: list,
                 cfg: SamplingConfig, eos_id: int | None, return_logits: bool) -> Generation:
    """The Generation of the step schedule from its new tokens [B,n], EOS flags [B], logits ([B,V] per step, if
    asked) and exit loops ([B] per forward, with a halting rule): each row cut after its first EOS when stopping
    there."""
    toks = out_tokens.tolist()
    if cfg.stop_at_eos and eos_id is not None:
        toks = [t[:t.index(eos_id) + 1] if eos_id in t else t for t in toks]
    return Generation(tokens=toks, logits=torch.stack(all_logits, 1) if return_logits else None,
                      finished=[bool(f) for f in finished.tolist()],
                      exit_loops=torch.stack(exit_loops[:len(out_tokens[0])], 1).cpu() if exit_loops else None)


@torch.no_grad()
def generate(model, prompts: Sequence[Sequence[int]], cfg: SamplingConfig | None = None,
             eos_id: int | None = None, pad_id: int = 0, use_cache: bool = True, return_logits: bool = False,
             progress: bool = False, memory_check: bool = True) -> Generation:
    """Continue each token list in `prompts`; see the module docstring.

    `use_cache=False` recomputes the whole (left-padded) sequence for every new token — the reference the cache is
    checked against, and the only way past the model's `max_len` (the context is then cropped to the last
    `max_len` columns). The loop count is capped (`loopformer.model.memory.check_loops`) and the key/value cache's
    size compared with the memory available before it is allocated (`memory_check`).
    """
    cfg = cfg or SamplingConfig()
    device = _device(model)
    max_len = model.config.max_len if getattr(model.config, "pos", "learned") == "learned" else None
    idx, mask = left_pad(prompts, pad_id)
    B, P = idx.shape
    idx, mask = idx.to(device), mask.to(device)
    N = cfg.max_new_tokens
    _check_request(model, cfg, device, B, P, max_len, use_cache, return_logits, memory_check)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    kw: dict = {} if cfg.loops is None else {"loops": cfg.loops}
    if cfg.halt is not None:
        kw["halt"] = HaltRule.parse(cfg.halt)
    was_training = model.training
    model.eval()
    out_tokens = torch.zeros(B, 0, dtype=torch.long, device=device)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    all_logits, exit_loops = [], []
    try:
        if use_cache:
            loops = cfg.loops or (kw["halt"].max_loops if cfg.halt is not None else None)
            cache = model.new_cache(B, max_len=P + N, loops=loops)
            logits = _last(model(idx, attn_mask=mask, cache=cache, **kw), exit_loops)    # [B,V]
            if _runs_depthwise(cfg, B, use_cache, return_logits):
                nxt = sample_next(logits, cfg.temperature, cfg.top_k, cfg.top_p, gen)     # [B]
                toks, exits = depthwise_decode(model, cache, mask, nxt, exit_loops[0], kw["halt"], N, cfg, gen,
                                               eos_id, progress)
                return Generation(tokens=toks, logits=None, finished=[eos_id is not None and eos_id in t
                                                                      for t in toks], exit_loops=exits.cpu())
        else:
            cache = None
            logits = _last(model(idx, attn_mask=mask, **kw), exit_loops)
        for step in tqdm(range(N), desc="generating", unit="tok", disable=not progress):
            if return_logits:
                all_logits.append(logits.float())
            nxt = sample_next(logits, cfg.temperature, cfg.top_k, cfg.top_p, gen)         # [B]
            out_tokens = torch.cat([out_tokens, nxt[:, None]], dim=1)
            if eos_id is not None:
                finished |= nxt == eos_id
            if step == N - 1 or (cfg.stop_at_eos and eos_id is not None and bool(finished.all())):
                break
            mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.bool, device=device)], dim=1)
            idx, logits = _feed(model, idx, mask, nxt, cache, kw, max_len, exit_loops)
    finally:
        if was_training:
            model.train()
    return _step_result(out_tokens, finished, all_logits, exit_loops, cfg, eos_id, return_logits)


def _tick(model, cache, rule: HaltRule, bound: int, h: torch.Tensor, e: torch.Tensor, starts: torch.Tensor,
          h_prev: torch.Tensor, logits_prev: torch.Tensor | None, t: torch.Tensor, live: torch.Tensor,
          cols: torch.Tensor, seen: torch.Tensor, pos: torch.Tensor | None = None):
    """The model's part of a depth-wise tick: one loop for every row (`LoopedTransformer.loop_rows`: h, e the rows'
    states and read-ins [B,1,D], `starts` [B,1,1] the rows at their token's first loop), the read-out where the rule
    reads one, whether the criterion holds [B], the loops done t + live [B], and for a rule that stops where its
    criterion holds once, the rows that stop [B] (None for the others). pos: the tokens' positions [B] (rotary
    encoding)."""
    h = model.loop_rows(h, e, starts, t, cache, cols, seen, pos)                       # [B,1,D]
    logits = model.head(model.norm_f(h)) if rule.needs_read_out else None               # [B,1,V]
    holds = criterion_holds(rule, hidden=h, hidden_prev=h_prev, logits=logits, logits_prev=logits_prev,
                            stop_logits=None if model.exit_gate is None else model.exit_gate(h))
    t = t + live                                                                        # done rows idle at loop 1
    return h, logits, holds, t, (holds | (t >= bound)) & live if _first_hold(rule) else None


def _first_hold(rule: HaltRule) -> bool:
    """Whether `rule` stops a row at the first loop its criterion holds (no patience, no earliest loop, nothing to
    compare with the previous loop): no streak to keep."""
    return rule.patience == 1 and rule.min_loops <= 1 and rule.criterion not in NEEDS_PREVIOUS


_compiled_tick = None


def compiled_tick():
    """`_tick` under torch.compile, made once per process (static shapes: a graph per batch size and cache length,
    up to torch's recompilation limit, after which it runs eagerly)."""
    global _compiled_tick
    if _compiled_tick is None:
        _compiled_tick = torch.compile(_tick, dynamic=False)
    return _compiled_tick


@torch.no_grad()
def depthwise_decode(model, cache, mask: torch.Tensor, first: torch.Tensor, first_exits: torch.Tensor,
                     rule: HaltRule, N: int, cfg: SamplingConfig, gen: torch.Generator, eos_id: int | None = None,
                     progress: bool = False) -> tuple[list[list[int]], torch.Tensor]:
    """Depth-wise batched decoding with per-token exits (module docstring) after the prompts are in `cache`
    (mask [B,P]): each row starts from its first new token `first` [B] (sampled after `first_exits` [B] loops).
    Returns each row's new tokens (up to N, and up to and including EOS when `cfg.stop_at_eos`) and the loops
    each one's logits took [B,N] (0 where a row stopped early)."""
    B, P = mask.shape
    dev, R = mask.device, cache.loops
    bound = min(rule.bound(R), R)
    positions = model.config.indexed_positions
    greedy = cfg.temperature == 0
    seen = torch.cat([mask, torch.zeros(B, N, dtype=torch.bool, device=dev)], dim=1)   # [B,P+N] the columns the
    seen[:, P] = True                                                   # rows' current tokens attend to
    width = P + 1                                                       # ... up to the widest row's column
    plen = mask.sum(1)                                                                  # [B] real prompt tokens
    rows, true = cache.rows, torch.ones(B, dtype=torch.bool, device=dev)
    tok, n = first.clone(), torch.zeros(B, dtype=torch.long, device=dev)               # current token, its index
    t, streak = torch.zeros_like(n), torch.zeros_like(n)                               # its loops so far
    out = torch.zeros(B, N, dtype=torch.long, device=dev)
    exits = torch.zeros(B, N, dtype=torch.long, device=dev)
    out[:, 0], exits[:, 0] = first, first_exits
    h = torch.zeros(B, 1, model.config.d_model, device=dev, dtype=cache.k.dtype)       # [B,1,D]
    e, prev_logits = torch.zeros_like(h), None
    stop_eos = cfg.stop_at_eos and eos_id is not None
    live = ~(torch.full((B,), N == 1, dtype=torch.bool, device=dev) | (stop_eos & (first == eos_id)))  # not done
    going_on = torch.zeros(B, 1, 1, dtype=torch.bool, device=dev)                      # no row starts a token
    model.prepare_rows(cache)
    tick = compiled_tick() if cfg.compile else _tick
    first_hold = _first_hold(rule)
    cols, fresh = P + n, True           # the rows' current columns; some row starts a token this tick
    bar = tqdm(total=B * (N - 1), desc="generating", unit="tok", disable=not progress)
    while True:                        # one tick: every row one loop further (rows that are done idle along)
        h_prev = h
        if fresh:                      # rows starting a token: its read-in (the other rows keep theirs)
            if not bool(live.any()):
                break
            starts = (t == 0).view(B, 1, 1)
            pos = (plen + n).view(B, 1) if positions else None                         # as the left-padded path
            e = torch.where(starts, model.embed(tok.view(B, 1), pos), e)
        else:
            starts = going_on                                                           # no row starts a token
        attend = seen if cfg.compile else seen[:, :width]   # compiled: every column (one shape, one graph)
        h, logits, holds, t, stop = tick(model, cache, rule, bound, h, e, starts, h_prev, prev_logits, t, live,
                                         cols, attend, plen + n)  # keys/values written through to the later loops
        if stop is None:               # a rule with patience, a first loop or a comparison with the previous one
            if rule.criterion in NEEDS_PREVIOUS:
                holds = holds & (t > 1)                                                 # nothing to compare yet
            prev_logits = logits
            streak = update_streak(streak, holds)
            stop = stops(rule, streak, t, bound) & live
        fresh = bool(stop.any())
        if not fresh:
            continue
        # each stopped row samples its next token and starts it in the next tick; the other rows' entries below
        # are rewritten unchanged (whole-batch operations: fewer of them than gathering the stopped rows)
        read = model.head(model.norm_f(h)) if logits is None else logits                # [B,1,V]
        if greedy:
            nxt = torch.where(stop, read[:, -1].argmax(-1), tok)                        # [B]
        else:                          # draws for the stopped rows only, in row order
            fin = stop.nonzero().squeeze(1)
            nxt = tok.index_copy(0, fin, sample_next(read[:, -1].index_select(0, fin), cfg.temperature,
                                                     cfg.top_k, cfg.top_p, gen))
        n = n + stop
        cols = P + n
        out.index_put_((rows, n), nxt)
        exits.index_put_((rows, n), t * stop, accumulate=True)                          # + 0 where not stopped
        seen.index_put_((rows, cols), true)
        tok = nxt
        t = t.masked_fill(stop, 0)
        if not first_hold:
            streak = streak.masked_fill(stop, 0)
        live = live & (n < N - 1)
        if stop_eos:
            live = live & ~(stop & (nxt == eos_id))
        if not cfg.compile:            # (the compiled tick attends to every column)
            width = int(cols.max()) + 1
        if progress:
            bar.update(int(stop.sum()))
    bar.close()
    count = (n + 1).tolist()
    return [row[:c] for row, c in zip(out.tolist(), count)], exits


def generate_text(model, tokenizer, prompts: Sequence[str], cfg: SamplingConfig | None = None,
                  use_cache: bool = True, progress: bool = False, memory_check: bool = True) -> list[str]:
    """Continue each prompt string; returns the generated continuations (without the prompts, without EOS)."""
    for p in prompts:
        try:
            p.encode("utf-8")
        except UnicodeEncodeError:     # undecodable bytes from the command line arrive as lone surrogates
            raise UserError(f"prompt {p.encode('utf-8', 'backslashreplace').decode()!r} is not valid UTF-8 "
                            "text") from None
    encoded = [tokenizer.encode(p) for p in prompts]
    for p, e in zip(prompts, encoded):
        if not e:
            raise UserError(f"prompt {p!r} encodes to no tokens")
        if max(e) >= model.config.vocab_size:
            raise UserError(f"prompt {p!r} has token id {max(e)} outside the model's vocabulary "
                            f"({model.config.vocab_size}); was the model trained with this tokenizer?")
    res = generate(model, encoded, cfg, eos_id=tokenizer.eot_id, pad_id=tokenizer.eot_id, use_cache=use_cache,
                   progress=progress, memory_check=memory_check)
    out = []
    for toks in res.tokens:
        if toks and toks[-1] == tokenizer.eot_id:
            toks = toks[:-1]
        out.append(tokenizer.decode(toks))
    return out
