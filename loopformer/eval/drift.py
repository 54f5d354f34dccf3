"""Drift diagnostics: does a looped model settle once it has its answer, or drift when run past its trained r?

A model trained at r loops is run to 4r on the test split and measured per loop t = 1..4r:

    state change     ‖h_t − h_{t−1}‖ / ‖h_{t−1}‖ (per row over T·D, mean over rows; h_0 the loop's start)
    read-out change  token tasks: the share of supervised positions whose argmax differs from loop t − 1;
                     regression: mean |y_t − y_{t−1}| / (1 + |y_{t−1}|) over supervised positions
    metric           the task's metric (exact match, MSE, …) after every loop, from the source's own scoring
    spectral radius  of the loop map F(h) = TF(h (+ e), t) at the state after r loops (the map of the next loop,
                     index r), by power iteration on Jacobian-vector products (forward-mode AD with the math attention
                     kernel): ρ < 1 means the state after r is an attracting fixed point of the next loop's map

and judged by fixed thresholds (THRESHOLDS): **settling** when the metric at 2r and at 4r is within 2 points of the
metric at r (lower-is-better metrics: within 2 % of it) and the state change at 4r is at most 0.01; **drifting** when
the metric at 4r has lost more than 10 points (10 %) or the state change at 4r exceeds 0.1; **marginal** otherwise.

Shapes: B batch, T length, D width, R loops.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from loopformer.eval.evaluate import loop_metrics
from loopformer.model.looped import unwrap
from loopformer.model.options import LoopOptions
from loopformer.sources import DataSource
from loopformer.tasks import IGNORE

THRESHOLDS = {"settle_points": 2.0, "drift_points": 10.0, "settle_change": 1e-2, "drift_change": 1e-1}
MAX_ELEMENTS = 5e7            # the per-loop states of one trajectory batch: rows × 4r × T × D at most


def trajectory(model: torch.nn.Module, x: torch.Tensor, targets: torch.Tensor, *, loops: int,
               weight: torch.Tensor | None = None) -> dict[str, list[float]]:
    """Per-loop state change and read-out change (t = 1..loops) on one batch, in eval mode, no gradients."""
    net = unwrap(model)
    with torch.no_grad():
        out = net(x, loops=loops, return_all=True)
        h0 = net.embed(x) if net.config.start_state == "input" else None
    hs = out.all_hidden.float()                                                          # [R,B,T,D]
    prev = torch.cat([h0.float()[None] if h0 is not None else torch.zeros_like(hs[:1]), hs[:-1]])
    base = prev.flatten(2).norm(dim=2)
    change = (hs - prev).flatten(2).norm(dim=2) / base.clamp(min=1e-12)                   # [R,B]
    if h0 is None:                       # a start at 0: the first loop's change is measured against h_1 itself
        change[0] = 1.0
    logits = out.all_logits.float()                                                      # [R,B,T,C]
    if targets.dtype.is_floating_point:
        w = torch.ones_like(targets) if weight is None else weight.float()
        y = logits[..., 0]
        rel = (y[1:] - y[:-1]).abs() / (1 + y[:-1].abs())                                 # [R-1,B,T]
        read = (rel * w).sum((1, 2)) / w.sum().clamp(min=1)
    else:
        mask = (targets != IGNORE).float()
        am = logits.argmax(-1)                                                           # [R,B,T]
        read = ((am[1:] != am[:-1]).float() * mask).sum((1, 2)) / mask.sum().clamp(min=1)
    return {"state_change": change.mean(1).tolist(), "readout_change": [0.0] + read.tolist()}


def spectral_radius(model: torch.nn.Module, x: torch.Tensor, *, loops: int, iters: int = 50,
                    seed: int = 0) -> list[float]:
    """|λ_max| of the Jacobian of the next loop's map at the state after `loops` loops, per row [B]: power
    iteration v <- J v / ‖J v‖ (per row, over T·D), the estimate the geometric mean of the last 10 growth factors."""
    net = unwrap(model)
    was = net.training
    net.eval()
    try:
        with torch.no_grad():
            h = net(x, loops=loops).hidden.float()                                       # [B,T,D]

        def step(s: torch.Tensor) -> torch.Tensor:                                       # F(s) = TF(s (+ e), loops)
            return net(x, loops=1, opts=LoopOptions(state=s, loop_offset=loops)).hidden

        g = torch.Generator(device="cpu").manual_seed(seed)
        v = torch.randn(h.shape, generator=g).to(h.device)
        v = v / v.flatten(1).norm(dim=1).clamp(min=1e-30)[:, None, None]
        logs = []
        with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]):
            for _ in range(iters):
                _, jv = torch.func.jvp(step, (h,), (v,))
                n = jv.flatten(1).norm(dim=1)                                            # [B]
                logs.append(torch.log(n.clamp(min=1e-30)))
                v = jv / n.clamp(min=1e-30)[:, None, None]
    finally:
        net.train(was)
    return torch.stack(logs[-10:]).mean(0).exp().tolist()


def _points(value: float, ref: float, higher: bool) -> float:
    """How much worse `value` is than `ref`: points of a [0, 1] metric (higher is better), else percent of ref."""
    if higher:
        return 100.0 * (ref - value)
    return 100.0 * (value - ref) / max(abs(ref), 1e-12)


def verdict(metric_at: dict[int, float], change_last: float, r: int, higher: bool) -> str:
    """settling | marginal | drifting from the metric at r, 2r, 4r and the state change at 4r (THRESHOLDS)."""
    loss_2r, loss_4r = (_points(metric_at[k * r], metric_at[r], higher) for k in (2, 4))
    th = THRESHOLDS
    if not math.isfinite(change_last) or loss_4r > th["drift_points"] or change_last > th["drift_change"]:
        return "drifting"
    if max(loss_2r, loss_4r) <= th["settle_points"] and change_last <= th["settle_change"]:
        return "settling"
    return "marginal"


def drift_report(model: torch.nn.Module, data: DataSource, *, loops: int | None = None, batch_size: int = 256,
                 limit: int = 0, device: torch.device | None = None, rows: int = 64,
                 autocast: Callable[[], Any] = contextlib.nullcontext,
                 curve: list[float] | None = None) -> dict[str, Any]:
    """The drift diagnostics of `model` at r = `loops` (default: its trained loops × supervision steps) on `data`'s
    test split (the first `limit` rows; 0: all): the metric after every loop up to 4r, the state and read-out change
    per loop and the spectral radius (on the first `rows` test rows), the verdict. results.json's "drift".
    `curve`: the metric after every loop 1..≥4r when the caller has it already (the loop-wise evaluation)."""
    net = unwrap(model)
    r = int(loops or net.config.total_loops)
    R = 4 * r
    device = device or next(net.parameters()).device
    was = net.training
    net.eval()
    try:
        if curve is None or len(curve) < R:
            with torch.no_grad():
                curve = [float(m[data.metric]) for m in
                         loop_metrics(net, data, R, True, batch_size, limit, device, autocast, False)]
        batch = data.as_tensors(next(iter(data.test_batches(rows, rows))), device)
        x, y, w = batch["inputs"], batch["targets"], batch.get("weight")
        per_row = R * x.shape[1] * net.config.d_model
        n = max(1, min(x.shape[0], int(MAX_ELEMENTS // per_row)))
        traj = trajectory(net, x[:n], y[:n], loops=R, weight=None if w is None else w[:n])
        rho = spectral_radius(net, x[:n], loops=r)
    finally:
        net.train(was)
    metric = data.metric
    higher = data.higher_is_better
    values = [float(v) for v in curve[:R]]
    at = {k * r: values[k * r - 1] for k in (1, 2, 4)}
    best = int(np.argmax(values) if higher else np.argmin(values))
    return {
        "loops": r, "max_loops": R, "metric": metric,
        "at": {f"{k}r": at[k * r] for k in (1, 2, 4)},
        "best": {"loop": best + 1, "value": values[best]},
        "metric_per_loop": values,
        "state_change": traj["state_change"], "readout_change": traj["readout_change"],
        "spectral_radius": {"median": float(np.median(rho)), "max": float(np.max(rho)), "rows": len(rho)},
        "verdict": verdict(at, traj["state_change"][-1], r, higher),
        "thresholds": THRESHOLDS,
    }


def drift_table(rep: dict[str, Any]) -> str:
    """A markdown summary of `drift_report`'s result."""
    r, m = rep["loops"], rep["metric"]
    sc = rep["state_change"]
    rows = [f"| {k} | {rep['at'][k]:.4g} | {sc[int(k[0]) * r - 1]:.3g} |" for k in ("1r", "2r", "4r")]
    return "\n".join([
        f"**{rep['verdict']}** (r = {r}; spectral radius of the next loop's map at r: median "
        f"{rep['spectral_radius']['median']:.3f}, max {rep['spectral_radius']['max']:.3f}; best {m} "
        f"{rep['best']['value']:.4g} at t = {rep['best']['loop']})", "",
        f"| loops | {m} | state change |", "|---|---:|---:|", *rows])
