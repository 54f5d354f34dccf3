"""Sizes before allocation: what a model, its training step, an evaluation or a key/value cache will take, estimated
from the config alone, and a one-line refusal when it cannot fit in the machine's memory.

Estimates in bytes (fp32 unless the parameter says otherwise), all closed-form so an absurd config (d_model = 1e9,
n_layers = 1e6) is refused without building anything:

    parameters    the exact parameter count of `LoopedTransformer(cfg)` × 4
    optimiser     training: gradients and AdamW's two moments, 3 × parameters
    activations   training: per token, layer and loop in the graph about 12·D + 2·F saved values (block input
                  and norms, q/k/v, attention output, MLP hidden before and after the activation; the fused
                  attention kernels keep no T × T probabilities, the compiled matmul attention of short
                  bidirectional rows keeps H·T per token), at
                  `act_bytes` each (2 under bf16 / fp16 autocast); with activation checkpointing one loop's worth
                  plus D per loop; inference: one layer's working set and one T × T score matrix per head
    read-outs     the logits of every read-out the loss or the evaluation keeps: R × B × T × C (× 2 in training:
                  their gradient)
    cache         generation: 2 × loops × layers × B × H × S × head_dim (keys and values of every loop)

The budget is the memory available now (psutil on CPU, `torch.cuda.mem_get_info` on CUDA). `check_fits` raises a
UserError naming the estimate and the budget, and the switch that skips the check where the command has one
(`generate --no-memory-check`; runs: `memory_check=false`) for users who know better: the command line sets it for
the command it runs (`skip_hint`), and a command without one (`convert`, `info`, `eval`) names none.
Shapes: B batch, T length, D width, F MLP width, H heads, C outputs, R loops, S cache length.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

from loopformer.errors import UserError
from loopformer.model.config import ModelConfig
from loopformer.model.layers import MATH_ATTENTION_MAX_T

GiB = 1024 ** 3
MAX_LOOPS = 1024   # the most loops an evaluation or generation runs, or twice the trained loops if that is more


def loop_cap(trained: int) -> int:
    """The most loops a model trained with `trained` loops may be run with (config sizes are bounded, so this is)."""
    return max(MAX_LOOPS, 2 * int(trained))


def check_loops(loops: int | None, trained: int, name: str = "loops") -> None:
    """A one-line UserError unless 1 <= loops <= loop_cap(trained) (None: the default, accepted)."""
    cap = loop_cap(trained)
    if loops is not None and not 1 <= loops <= cap:
        raise UserError(f"{name} must be in 1..{cap} (got {loops})")


def param_count(cfg: ModelConfig) -> int:
    """The number of parameters of `LoopedTransformer(cfg)` (tied embeddings counted once), in closed form."""
    D, F, L = cfg.d_model, cfg.ffn, cfg.n_layers
    inner = cfg.n_heads * cfg.hd
    b = int(cfg.bias)
    n = cfg.vocab_size * D + (cfg.input_dim * D + D if cfg.input_dim else 0)
    n += cfg.max_len * D if cfg.pos == "learned" else 0
    n += sum((max(f) + 1) * D for f in (cfg.pos_factors or []))
    per_layer = D * 3 * inner + 3 * inner * b + inner * D + D * b + D * F + F * b + F * D + D * b
    norms = 1 if cfg.compat == "authors" else 2          # the published code's layer has no MLP pre-norm
    per_layer += norms * D if (cfg.norm == "rms" and cfg.norm_gain) else 0
    per_layer += (D * 4 * D + 4 * D) if cfg.timestep else 0
    n += L * per_layer
    if cfg.timestep:
        n += cfg.timestep_freq_dim * D + D + D * D + D
        n += cfg.loops * cfg.timestep_freq_dim if cfg.timestep_embed == "learned" else 0
    n += D if cfg.final_norm else 0
    if not cfg.tie_embeddings:
        n += D * cfg.out_dim + (cfg.out_dim if cfg.head != "lm" else 0)
    n += D + 1 if cfg.exit_gate else 0
    return int(n)


def estimate(cfg: ModelConfig, *, batch: int, seq_len: int | None = None, loops: int | None = None,
             training: bool = False, read_outs: int = 1, cache_len: int = 0, ema: bool = False,
             act_bytes: int = 4) -> dict[str, int]:
    """Bytes per part (see the module docstring) for one forward (and backward, `training`) of `batch` rows of
    `seq_len` tokens (default max_len) through `loops` loops (default cfg.loops), keeping `read_outs` read-outs;
    `cache_len` > 0: a key/value cache of that length for every loop."""
    T = int(seq_len or cfg.max_len)
    R = int(loops or cfg.loops)
    B, D, F, H, L = int(batch), cfg.d_model, cfg.ffn, cfg.n_heads, cfg.n_layers
    params = param_count(cfg)
    out = {"parameters": 4 * params}
    per_token_layer = 12 * D + 2 * F
    if training:
        if not cfg.causal and T <= MATH_ATTENTION_MAX_T:                # compiled matmul attention: probabilities
            per_token_layer += H * T
        out["optimiser"] = 4 * params * 3 + (4 * params if ema else 0)
        graph = R if cfg.grad_loops is None else min(R, cfg.grad_loops)
        stored = (L * per_token_layer + graph * D) if cfg.checkpoint else graph * L * per_token_layer
        out["activations"] = act_bytes * B * T * stored
    else:
        out["activations"] = act_bytes * B * T * (per_token_layer + H * T)
    out["read-outs"] = 4 * max(1, read_outs) * B * T * cfg.out_dim * (2 if training else 1)
    if cache_len:
        out["cache"] = 4 * 2 * R * L * B * H * int(cache_len) * cfg.hd
    return out


def available_bytes(device: torch.device | str = "cpu") -> int:
    """Memory that can be allocated now on `device`."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    import psutil  # light, but only needed here

    return int(psutil.virtual_memory().available)


SKIP_SWITCHES = "--no-memory-check / memory_check=false"     # what skips the check, outside the command line
_skip = contextvars.ContextVar("memory_check_skip", default=SKIP_SWITCHES)
_UNSET = object()


@contextlib.contextmanager
def skip_hint(switch: str | None) -> Iterator[None]:
    """While the block runs, `check_fits` names `switch` (e.g. `--no-memory-check`) as the way to skip the check,
    or nothing when it is None: the running command's own switch, never one it does not have."""
    token = _skip.set(switch)
    try:
        yield
    finally:
        _skip.reset(token)


def check_fits(parts: dict[str, int], device: torch.device | str = "cpu", what: str = "this run",
               hint: str = "", budget: int | None = None, skip: str | None | object = _UNSET) -> int:
    """Raise a one-line UserError when the parts' sum exceeds the memory available on `device` (or `budget`);
    returns the sum. The message names `skip`, the switch that turns the check off (default: the running
    command's, `skip_hint`; None: there is none)."""
    total = sum(parts.values())
    avail = available_bytes(device) if budget is None else int(budget)
    if total > avail:
        big = max(parts, key=parts.get)
        switch = _skip.get() if skip is _UNSET else skip
        raise UserError(f"{what} needs about {total / GiB:,.1f} GiB ({big} {parts[big] / GiB:,.1f} GiB) but "
                        f"{avail / GiB:,.1f} GiB are available on {torch.device(device).type}"
                        f"{'; ' + hint if hint else ''}{f' (or pass {switch})' if switch else ''}")
    return total


__all__ = ["param_count", "estimate", "available_bytes", "check_fits", "skip_hint", "check_loops", "loop_cap", "GiB",
           "MAX_LOOPS"]
