"""Evaluation on a task's test split, and loop-wise evaluation (paper Sec. 5, Table 2; the metric after each loop).

One forward pass with `return_all=True` and R_max loops gives the read-out after every loop t = 1..R_max, so the
metric at the trained loop count r and at every other t — also beyond r (extrapolation) — comes from one run:

    token tasks   argmax predictions [R,N,T] → the task's metrics per loop (headline: exact-match 'accuracy')
    text          summed next-token cross-entropy per loop → loss (nats/token), ppl = exp(loss), next-token accuracy,
                  over the first `task.eval_windows` windows of the split: `windows` / `windows_in_split`, `tokens` /
                  `tokens_in_split`, `whole_split` and `ppl_over` (a sentence) say which
    vector (ICL)  squared error of the read-out at the supervised positions per loop → 'mse'

Shapes: R loops, B batch, N test rows, T length, C classes.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from loopformer.errors import UserError
from loopformer.model.io import unwrap

MAX_LOOPS = 1024   # the most loops an evaluation runs (loops, max_loops), or twice the trained r if that is more


def check_eval_args(loops: Optional[int] = None, max_loops: Optional[int] = None, batch_size: int = 1,
                    limit: int = 0, trained: int = 0) -> None:
    """One-line UserErrors for evaluation arguments out of range (None: the default). `trained`: the model's
    trained loop count (raises the cap to 2 × trained when that exceeds MAX_LOOPS)."""
    cap = max(MAX_LOOPS, 2 * trained)
    for name, v in (("loops", loops), ("max_loops", max_loops)):
        if v is not None and not 1 <= v <= cap:
            raise UserError(f"{name} must be in 1..{cap} (got {v})")
    if batch_size < 1:
        raise UserError(f"batch_size must be >= 1 (got {batch_size})")
    if limit < 0:
        raise UserError(f"the number of test rows must be >= 0 (0: all; got {limit})")


def _eval_batch_size(requested: int, loops: int, T: int, C: int, budget: float = 1.5e8) -> int:
    """Rows per forward so the per-loop logits [R,B,T,C] stay within `budget` elements."""
    return int(max(1, min(requested, budget // max(1, loops * T * C))))


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: Any, *, loops: Optional[int] = None, max_loops: Optional[int] = None,
             batch_size: int = 256, limit: int = 0, loopwise: bool = True, device: Optional[torch.device] = None,
             autocast: Callable[[], Any] = contextlib.nullcontext, progress: bool = False) -> dict[str, Any]:
    """Metrics of `model` on `data`'s test split at `loops` (default: the model's), plus the loop-wise curve.

    Returns {"loops": r, "max_loops": R, "metric": name, "metrics": {...at r}, "loopwise": [{"loop": t, ...}]}.
    `loops` and `max_loops` are at most MAX_LOOPS; max_loops 0 / None means the default.
    """
    raw = unwrap(model)
    cfg = raw.config
    check_eval_args(loops or None, max_loops or None, batch_size, limit, trained=cfg.loops)
    r = int(loops or cfg.loops)
    R = max(r, int(max_loops or 0)) if loopwise else r
    device = device or next(raw.parameters()).device
    was_training = raw.training
    raw.eval()
    try:
        fn = {"text": _eval_text, "vector": _eval_vector}.get(data.kind, _eval_tokens)
        per_loop = fn(raw, data, R, loopwise and R > 1, batch_size, limit, device, autocast, progress)
    finally:
        raw.train(was_training)
    # per_loop: a list of metric dicts, loop 1..R (only loop R when not loop-wise)
    if loopwise and R > 1:
        curve = [{"loop": t + 1, **m} for t, m in enumerate(per_loop)]
        at_r = per_loop[r - 1]
    else:
        curve, at_r = [], per_loop[-1]
    return {"loops": r, "max_loops": R, "metric": data.metric, "higher_is_better": data.higher_is_better,
            "metrics": at_r, "loopwise": curve}


def _forward(model, x, R, all_loops: bool, autocast):
    with autocast():
        out = model(x, loops=R, return_all=all_loops)
    return out.all_logits if all_loops else out.logits[None]                             # [R|1,B,T,C]


def _eval_tokens(model, data, R, all_loops, batch_size, limit, device, autocast, progress) -> list[dict[str, float]]:
    preds: list[np.ndarray] = []
    rows: list[dict[str, np.ndarray]] = []
    C = model.config.out_dim
    for batch in tqdm(list(data.test_batches(10 ** 9, limit)), desc="eval", disable=not progress, leave=False):
        T = batch["inputs"].shape[1]
        step = _eval_batch_size(batch_size, R if all_loops else 1, T, C)
        for i in range(0, len(batch["inputs"]), step):
            x = torch.as_tensor(np.asarray(batch["inputs"][i:i + step], dtype=np.int64), device=device)
            logits = _forward(model, x, R, all_loops, autocast)
            preds.append(logits.argmax(-1).cpu().numpy())                                 # [R,b,T]
        rows.append(batch)
    pred = np.concatenate(preds, axis=1)                                                  # [R,N,T]
    full = {k: np.concatenate([b[k] for b in rows]) for k in rows[0]}
    if not all_loops:
        return [data.metrics(pred[0], full)]
    return [data.metrics(pred[t], full) for t in range(pred.shape[0])]


def _eval_text(model, data, R, all_loops, batch_size, limit, device, autocast, progress) -> list[dict[str, float]]:
    n_loops = R if all_loops else 1
    nll = np.zeros(n_loops)
    correct = np.zeros(n_loops)
    count = 0
    C = model.config.out_dim
    for batch in tqdm(list(data.test_batches(batch_size, limit)), desc="eval", disable=not progress, leave=False):
        T = batch["inputs"].shape[1]
        step = _eval_batch_size(batch_size, n_loops, T, C)
        for i in range(0, len(batch["inputs"]), step):
            x = torch.as_tensor(batch["inputs"][i:i + step], device=device)
            y = torch.as_tensor(batch["targets"][i:i + step], device=device)
            logits = _forward(model, x, R, all_loops, autocast).float()                   # [R,b,T,V]
            for t in range(n_loops):
                nll[t] += F.cross_entropy(logits[t].reshape(-1, C), y.reshape(-1), reduction="sum").item()
                correct[t] += (logits[t].argmax(-1) == y).sum().item()
            count += y.numel()
    # the windows evaluated (a prefix of the split unless whole_split): named next to the perplexity
    scope = data.eval_scope(limit) if hasattr(data, "eval_scope") else {}
    out = []
    for t in range(n_loops):
        loss = nll[t] / count
        out.append({"loss": loss, "ppl": math.exp(min(loss, 700.0)), "accuracy": correct[t] / count,
                    "tokens": count, **scope})
    return out


def _eval_vector(model, data, R, all_loops, batch_size, limit, device, autocast, progress
                 ) -> list[dict[str, float]]:
    """Squared error / d at the prediction positions: 'mse' (mean over positions), 'mse_last' (last position)."""
    n_loops = R if all_loops else 1
    sq, last, rows, count = np.zeros(n_loops), np.zeros(n_loops), 0, 0.0
    for batch in tqdm(list(data.test_batches(batch_size, limit)), desc="eval", disable=not progress, leave=False):
        x = torch.as_tensor(batch["inputs"], dtype=torch.float32, device=device)
        y = torch.as_tensor(batch["targets"], dtype=torch.float32, device=device)          # [b,T]
        w = torch.as_tensor(batch["weight"], dtype=torch.float32, device=device)           # [b,T]
        outs = _forward(model, x, R, all_loops, autocast).float()[..., 0]                 # [R,b,T]
        err = (outs - y) ** 2 * w                                                         # [R,b,T]
        last_pos = int(torch.nonzero(w[0]).max())
        sq += err.sum(dim=(1, 2)).cpu().numpy()
        last += err[:, :, last_pos].sum(1).cpu().numpy()
        count += float(w.sum())
        rows += x.shape[0]
    scale = getattr(data, "error_scale", 1.0)
    return [{"mse": sq[t] / max(count, 1.0) / scale, "mse_last": last[t] / max(rows, 1) / scale}
            for t in range(n_loops)]


def headline(result: dict[str, Any]) -> float:
    """The headline metric's value at the trained loop count."""
    return float(result["metrics"][result["metric"]])


def format_results(metric: str, metrics: dict, loopwise: list[dict], trained: int) -> str:
    """The test metrics on one line, then the headline metric after every loop with the trained r marked."""
    lines = ["test: " + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if isinstance(v, (int, float)))]
    if loopwise:
        lines += [f"loop-wise {metric} (trained r = {trained}):", "  loop  " + metric]
        for p in loopwise:
            mark = "  <- trained r" if p["loop"] == trained else ""
            lines.append(f"  {p['loop']:>4}  {p[metric]:.4f}{mark}")
    return "\n".join(lines)


__all__ = ["evaluate", "headline", "format_results", "check_eval_args", "MAX_LOOPS"]
