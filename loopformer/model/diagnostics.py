"""Training-dynamics measurements of a looped model: is the loop used, is the timestep modulation alive?

Pure measurements on a model (and a batch), used by the trainer's periodic log and by `loopformer analyze dynamics`:

    modulation_stats   per loop t: mean |γ1(t)|, |γ2(t)| (residual gates) and |α1(t)|, |α2(t)| (norm scales,
                       α = 1 + s) of the TMLT modulation (paper Eq. 13-15), averaged over width and layers
    loop_dynamics      per loop t: the update size ‖h_t − h_{t−1}‖ / ‖h_{t−1}‖ of the residual stream (h_0 = the
                       read-in embedding), the read-out's loss and accuracy (or squared error), and for every sample
                       the settle loop: the first t after which its answer no longer changes up to the last loop
    grad_norms         the gradient norm of each parameter group (embedding, block, timestep, modulation, head)
    state_grad_norms   per loop t: ‖∂L/∂h_t‖, the gradient of the final read-out's loss with respect to the state
                       after loop t (mean over rows): which loops the gradient reaches (vanishing: small early
                       values; exploding: large ones)
    fixed_modulation   run a TMLT with one modulation for every loop instead of its own per-loop ones (with
                       `modulation_ablations`: the trained loops' average, which keeps the learned scales and
                       drops their dependence on t, or the identity γ = 1, α = 1, the plain looped block): whether
                       the model uses the loop index at all

Shapes: R loops, B batch, T length, D width, C outputs, k layers per block.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from loopformer.model.layers import PARAM_GROUPS, param_group
from loopformer.model.options import LoopOptions


def grad_norms(model: torch.nn.Module,
               reduce: Callable[[list[float]], list[float]] | None = None) -> dict[str, float]:
    """L2 norm of the current gradients per parameter group (groups without parameters are left out). A sharded
    model's gradients are summed over this process's shards and `reduce` adds the squares up over processes."""
    sq: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if p.grad is None or id(p) in seen:   # tied weights count once
            continue
        seen.add(id(p))
        g = param_group(name)
        # a sharded gradient (DTensor) by its local shard; checked by name: torch.distributed.tensor is a heavy import
        grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        s = grad.detach().float().pow(2).sum()
        sq[g] = sq[g] + s if g in sq else s
    groups = [g for g in PARAM_GROUPS if g in sq]
    if reduce is not None:
        total = reduce([float(sq[g]) for g in groups])
        return {g: math.sqrt(v) for g, v in zip(groups, total)}
    return {g: float(sq[g].sqrt()) for g in groups}


@torch.no_grad()
def modulation_stats(model: torch.nn.Module, loops: int) -> dict[str, list[float]] | None:
    """Per loop t = 1..loops: mean |γ1|, |γ2|, |α1|, |α2| over width and layers (None without timestep encoding)."""
    dev = next(model.parameters()).device
    mods = model.modulations(loops, dev)                                              # [R,k,4,D] | None
    if mods is None:
        return None
    mods = mods.float()
    gate_attn, gate_mlp = mods[:, :, 0].abs(), mods[:, :, 1].abs()                    # [R,k,D]
    alpha_attn, alpha_mlp = (1 + mods[:, :, 2]).abs(), (1 + mods[:, :, 3]).abs()
    return {name: v.mean(dim=(1, 2)).tolist() for name, v in
            (("gate_attn", gate_attn), ("gate_mlp", gate_mlp), ("alpha_attn", alpha_attn),
             ("alpha_mlp", alpha_mlp))}


@torch.no_grad()
def loop_dynamics(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, *, loops: int,
                  weight: torch.Tensor | None = None, ignore_index: int = -100,
                  settle_tol: float = 1e-2) -> dict:
    """Per-loop measurements on one batch, in eval mode (no dropout, no RNG drawn).

    inputs [B,T] ids or [B,T,d] reals; targets [B,T] class ids (`ignore_index` unsupervised) or reals with
    `weight` [B,T] (1 = supervised). Returns lists over t = 1..loops — "update" (mean over samples of the relative
    change of the residual stream), "loss" (cross-entropy per supervised token, or squared error), "token_accuracy"
    (token tasks: the share of supervised tokens right) — and "settle": every sample's settle loop [B] (token
    tasks: the answer is the argmax at its supervised positions; vector tasks: it has settled once all later
    read-outs are within `settle_tol` · (1 + |final|) of the final one).
    """
    was_training = model.training
    model.eval()
    try:
        out = model(inputs, loops=loops, return_all=True)
        e = model.embed(inputs)                                                       # h_0: [B,T,D]
    finally:
        model.train(was_training)
    hs = torch.cat([e[None], out.all_hidden], 0).float()                              # [R+1,B,T,D]
    diff = (hs[1:] - hs[:-1]).flatten(2).norm(dim=2)                                  # [R,B]
    base = hs[:-1].flatten(2).norm(dim=2).clamp(min=1e-12)
    update = (diff / base).mean(1)                                                    # [R]
    logits = out.all_logits.float()                                                   # [R,B,T,C]
    res: dict = {"update": update.tolist()}
    if targets.dtype.is_floating_point:
        pred = logits[..., 0]                                                         # [R,B,T]
        w = torch.ones_like(targets) if weight is None else weight.to(pred.dtype)
        err = (pred - targets).pow(2) * w
        res["loss"] = (err.sum(dim=(1, 2)) / w.sum().clamp(min=1)).tolist()
        scale = (1 + pred[-1].abs()) * settle_tol                                     # [B,T]
        changed = (((pred - pred[-1]).abs() > scale) & (w > 0)).any(-1)               # [R,B]
    else:
        mask = targets != ignore_index                                                # [B,T]
        R, C = logits.shape[0], logits.shape[-1]
        flat_t = targets.expand(R, *targets.shape).reshape(-1)
        ce = F.cross_entropy(logits.reshape(-1, C), flat_t, ignore_index=ignore_index, reduction="none")
        ce = ce.view(R, -1).sum(1) / mask.sum().clamp(min=1)
        am = logits.argmax(-1)                                                        # [R,B,T]
        res["loss"] = ce.tolist()
        res["token_accuracy"] = (((am == targets) & mask).sum(dim=(1, 2)) / mask.sum().clamp(min=1)).tolist()
        changed = ((am != am[-1]) & mask).any(-1)                                     # [R,B]
    # settle loop: 1 + the last loop whose answer differs from the final one (1 if it never differs)
    R = changed.shape[0]
    idx = torch.arange(1, R + 1, device=changed.device)[:, None].expand_as(changed)   # [R,B]
    last_diff = torch.where(changed, idx, torch.zeros_like(idx)).max(0).values       # [B]
    res["settle"] = (last_diff + 1).clamp(max=R).cpu().numpy().astype(np.int64).tolist()
    return res


def state_grad_norms(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, *, loops: int,
                     weight: torch.Tensor | None = None, ignore_index: int = -100) -> list[float]:
    """‖∂L/∂h_t‖ for t = 1..loops (per row over T·D, mean over rows), L the loss of the read-out after the last loop
    (cross-entropy per supervised token, or weighted squared error), in eval mode (no dropout, no RNG drawn).

    The loop is run one loop per call from the carried state (`LoopOptions(state=h, loop_offset=t)`, exactly the
    unrolled loop) so that every h_t is a tensor of the graph; the gradients do not touch the parameters'
    `.grad`.  inputs [B,T] ids or [B,T,d] reals, targets [B,T]."""
    was_training = model.training
    model.eval()
    try:
        with torch.enable_grad():
            out = model(inputs, loops=1, opts=LoopOptions(budget=loops))
            hs = [out.hidden]                                                          # h_1: [B,T,D]
            for t in range(1, loops):
                out = model(inputs, loops=1, opts=LoopOptions(state=hs[-1], loop_offset=t, budget=loops))
                hs.append(out.hidden)
            logits = out.logits.float()                                                # [B,T,C]
            if targets.dtype.is_floating_point:
                w = torch.ones_like(targets) if weight is None else weight.to(logits.dtype)
                loss = ((logits[..., 0] - targets).pow(2) * w).sum() / w.sum().clamp(min=1)
            else:
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                       ignore_index=ignore_index)
            grads = torch.autograd.grad(loss, hs, allow_unused=True)
    finally:
        model.train(was_training)
    return [0.0 if g is None else float(g.float().flatten(1).norm(dim=1).mean()) for g in grads]


def summarize_settle(settle: list[int], loops: int) -> dict[str, float | list[int]]:
    """Mean, median and 90th percentile of the settle loops, and their histogram over t = 1..loops."""
    a = np.asarray(settle, dtype=np.int64)
    hist = np.bincount(a, minlength=loops + 1)[1:loops + 1]
    return {"settle_mean": float(a.mean()) if a.size else float("nan"),
            "settle_median": float(np.median(a)) if a.size else float("nan"),
            "settle_p90": float(np.percentile(a, 90)) if a.size else float("nan"),
            "settle_hist": hist.tolist()}


def modulation_ablations(model: torch.nn.Module, loops: int) -> dict[str, torch.Tensor] | None:
    """One modulation [k,4,D] for every loop (None without timestep encoding):

        "averaged over loops"   the mean of [γ1, γ2, s1, s2](t) over the trained loops t = 0..loops-1
        "without modulation"    γ = 1, s = 0 (α = 1): each layer is the plain looped layer
    """
    dev = next(model.parameters()).device
    with torch.no_grad():
        mods = model.modulations(loops, dev)                                          # [R,k,4,D] | None
    if mods is None:
        return None
    ident = torch.zeros_like(mods[0])
    ident[:, :2] = 1.0
    return {"averaged over loops": mods.mean(0), "without modulation": ident}


@contextlib.contextmanager
def fixed_modulation(model: torch.nn.Module, mod: torch.Tensor) -> Iterator[torch.nn.Module]:
    """Within the block, every loop (at any offset) reads `mod` [k,4,D] instead of its own modulation; restored on
    exit. For ablations at inference: the weights are not touched."""
    if getattr(model, "timestep", None) is None:
        raise ValueError("fixed_modulation needs a model with timestep encoding")
    if "modulations" in vars(model):
        raise RuntimeError("fixed_modulation is already active on this model")

    def constant(loops: int, device: torch.device, offset: int = 0, budget=None) -> torch.Tensor:
        return mod.to(device)[None].expand(loops, *mod.shape)                         # [R,k,4,D]

    model.modulations = constant
    try:
        yield model
    finally:
        del model.modulations
