"""Adaptive depth: when a row (or, in a causal model, a token) stops looping, and the learned exit gate.

A looped model computes h_t = TF(h_{t-1} (+ e), t) for t = 1..R and reads out p_t = softmax(L2(h_t)). Adaptive
depth stops each row at the first loop t at which an exit criterion has held for `patience` consecutive loops, and
never later than `max_loops`. The criteria (threshold θ; a row's score is taken over its counted positions P, e.g.
the answer positions, or over every position):

    latent   ‖h_t − h_{t−1}‖ / ‖h_{t−1}‖ < θ                (norms over the row's positions in P; t ≥ 2)
    kl       max_{i∈P} KL(p_t,i ‖ p_{t−1},i) < θ             (nats; t ≥ 2)
    entropy  max_{i∈P} H(p_t,i) < θ                          (nats)
    argmax   argmax p_t,i = argmax p_{t−1},i for every i∈P   (t ≥ 2); `argmax:K` asks this for K loops in a row,
             i.e. the prediction has not changed for K loops (patience K; θ is K)
    gate     σ(g_t) ≥ θ, g_t the exit gate's stop logit      (a row's logit is the mean over P, see `ExitGate`)

Per token (causal models): the same scores per position i instead of the max over P.

A rule is written `CRITERION:THRESHOLD[,patience=K][,max=M][,min=N]`, e.g. `kl:1e-3`, `argmax:2`,
`gate:0.5,max=32` (`HaltRule.parse`). `min` is the earliest loop at which a row may stop.

The exit gate (`ExitGate`) is a linear map of the normalised hidden state to one stop logit per position. Two
losses train it, the halting target (as TRM's halting head) and the exit distribution (as Ouro):
`loopformer.train.losses`, chosen by `TrainConfig.exit_loss`.

Shapes: R loops, N rows (B batch, or the running rows of it), T length, D width, C classes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from loopformer.errors import UserError

CRITERIA = ("latent", "kl", "entropy", "argmax", "gate")
NEEDS_PREVIOUS = ("latent", "kl", "argmax")          # compare loop t with loop t-1: can hold from t = 2
NEEDS_READ_OUT = ("kl", "entropy", "argmax")          # read the class probabilities after every loop


# ------------------------------------------------------------------------------------------------- the rule
@dataclass(frozen=True)
class HaltRule:
    """When a row stops looping: `criterion` below `threshold` (gate: at or above it) for `patience` consecutive
    loops, at loop `min_loops` at the earliest and `max_loops` at the latest (None: the call's loop count)."""

    criterion: str
    threshold: float
    patience: int = 1
    max_loops: int | None = None
    min_loops: int = 1

    def __post_init__(self) -> None:
        if self.criterion not in CRITERIA:
            raise UserError(f"halting criterion must be one of {', '.join(CRITERIA)} (got {self.criterion!r})")
        if not math.isfinite(self.threshold) or self.threshold < 0:
            raise UserError(f"halting threshold must be a finite number >= 0 (got {self.threshold})")
        if self.criterion == "gate" and not 0 < self.threshold <= 1:
            raise UserError(f"the gate's threshold is a stop probability in (0, 1] (got {self.threshold})")
        if self.patience < 1:
            raise UserError(f"halting patience must be >= 1 (got {self.patience})")
        if self.max_loops is not None and self.max_loops < 1:
            raise UserError(f"halting max_loops must be >= 1 (got {self.max_loops})")
        if self.min_loops < 1:
            raise UserError(f"halting min_loops must be >= 1 (got {self.min_loops})")
        if self.max_loops is not None and self.min_loops > self.max_loops:
            raise UserError(f"halting min_loops={self.min_loops} exceeds max_loops={self.max_loops}: no loop "
                            "count satisfies both")
        for name in ("patience", "max_loops", "min_loops"):
            v = getattr(self, name)
            if v is not None and v > 1 << 20:
                raise UserError(f"halting {name}={v} is beyond any loop count (at most {1 << 20:,})")

    @classmethod
    def parse(cls, text: str) -> HaltRule:
        """`CRITERION:THRESHOLD[,patience=K][,max=M][,min=N]`; `argmax:K` means patience K. Bad text: UserError."""
        s = str(text).strip()
        head, *opts = [p.strip() for p in s.split(",")]
        name, sep, value = head.partition(":")
        name = name.strip().lower()
        if not sep or not value.strip():
            raise UserError(f"halting rule {s!r} is not CRITERION:THRESHOLD (e.g. kl:1e-3, argmax:2, gate:0.5; "
                            f"criteria: {', '.join(CRITERIA)})")
        if name not in CRITERIA:
            raise UserError(f"halting rule {s!r}: unknown criterion {name!r} (choose from {', '.join(CRITERIA)})")
        try:
            threshold = float(value)
        except ValueError:
            raise UserError(f"halting rule {s!r}: threshold {value.strip()!r} is not a number") from None
        fields: dict[str, int] = {}
        keys = {"patience": "patience", "max": "max_loops", "min": "min_loops"}
        for opt in opts:
            k, eq, v = opt.partition("=")
            if not eq or k.strip() not in keys:
                raise UserError(f"halting rule {s!r}: option {opt!r} is not patience=K, max=M or min=N")
            try:
                fields[keys[k.strip()]] = int(v)
            except ValueError:
                raise UserError(f"halting rule {s!r}: {k.strip()} must be a whole number (got {v.strip()!r})") from None
        if name == "argmax":
            if threshold != int(threshold) or threshold < 1:
                raise UserError(f"halting rule {s!r}: argmax takes a whole number of unchanged loops K >= 1")
            if "patience" in fields and fields["patience"] != int(threshold):
                raise UserError(f"halting rule {s!r}: argmax:K already sets the patience to K")
            fields["patience"] = int(threshold)
        return cls(name, threshold, **fields)

    def __str__(self) -> str:
        head = f"{self.criterion}:{int(self.threshold) if self.criterion == 'argmax' else format(self.threshold, 'g')}"
        opts = [] if self.patience == 1 or self.criterion == "argmax" else [f"patience={self.patience}"]
        opts += [] if self.max_loops is None else [f"max={self.max_loops}"]
        opts += [] if self.min_loops == 1 else [f"min={self.min_loops}"]
        return ",".join([head, *opts])

    def with_threshold(self, threshold: float) -> HaltRule:
        """The same rule at another threshold (argmax: another K)."""
        if self.criterion == "argmax":
            return replace(self, threshold=float(threshold), patience=int(threshold))
        return replace(self, threshold=float(threshold))

    def bound(self, loops: int) -> int:
        """The last loop a row may run: `max_loops`, or the call's `loops` when unset."""
        return loops if self.max_loops is None else self.max_loops

    @property
    def needs_read_out(self) -> bool:
        return self.criterion in NEEDS_READ_OUT


# ------------------------------------------------------------------------------------------------- the scores
def latent_change(h_prev: torch.Tensor, h: torch.Tensor, positions: torch.Tensor | None = None,
                  per_token: bool = False) -> torch.Tensor:
    """‖h − h_prev‖ / ‖h_prev‖: per row over the positions in `positions` ([N,T] bool; None: all) -> [N], or per
    position (`per_token`) -> [N,T].  h_prev, h: [N,T,D]."""
    d2 = (h - h_prev).float().pow(2).sum(-1)                                     # [N,T]
    n2 = h_prev.float().pow(2).sum(-1)
    if not per_token:
        w = torch.ones_like(d2) if positions is None else positions.to(d2.dtype)
        d2, n2 = (d2 * w).sum(-1), (n2 * w).sum(-1)                              # [N]
    return d2.sqrt() / n2.sqrt().clamp(min=1e-12)


def kl_divergence(logits_prev: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ p_prev) = Σ_c p_c (log p_c − log p_prev,c) per position, p = softmax(logits).  [...,C] -> [...]."""
    logp, logq = F.log_softmax(logits.float(), -1), F.log_softmax(logits_prev.float(), -1)
    return (logp.exp() * (logp - logq)).sum(-1)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """H(p) = −Σ_c p_c log p_c per position (nats), p = softmax(logits).  [...,C] -> [...]."""
    logp = F.log_softmax(logits.float(), -1)
    return -(logp.exp() * logp).sum(-1)


def argmax_changed(logits_prev: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """1.0 where the predicted class changed between the two read-outs, else 0.0.  [...,C] -> [...]."""
    return (logits.argmax(-1) != logits_prev.argmax(-1)).float()


def row_max(score: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """max_{i∈P} score_i per row (P: `positions` [N,T] bool, None: all; a row without positions scores −inf,
    i.e. it is done).  [N,T] -> [N]."""
    if positions is None:
        return score.amax(-1)
    return score.masked_fill(~positions, float("-inf")).amax(-1)


def row_mean(score: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """mean_{i∈P} score_i per row (P as in `row_max`; a row without positions gives 0).  [..., N,T] -> [..., N]."""
    if positions is None:
        return score.mean(-1)
    w = positions.to(score.dtype)
    return (score * w).sum(-1) / w.sum(-1).clamp(min=1)


def as_positions(logits: torch.Tensor) -> torch.Tensor:
    """Read-outs with a position axis: a sequence head's [N,C] as [N,1,C]; [N,T,C] unchanged."""
    return logits[:, None] if logits.dim() == 2 else logits


def criterion_holds(rule: HaltRule, *, hidden: torch.Tensor, hidden_prev: torch.Tensor | None = None,
                    logits: torch.Tensor | None = None, logits_prev: torch.Tensor | None = None,
                    stop_logits: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                    per_token: bool = False) -> torch.Tensor:
    """Whether `rule`'s criterion holds after this loop: [N] bool per row, [N,T] per position (`per_token`).

    hidden, hidden_prev: [N,T,D] this and the previous loop's hidden state (hidden_prev None at the first loop: the
    comparing criteria do not hold).  logits, logits_prev: [N,T,C] (or [N,C]) read-outs.  stop_logits: [N,T] the
    exit gate's.  positions: [N,T] bool, the positions a row's score is taken over (None: all).
    """
    c = rule.criterion
    if c in NEEDS_PREVIOUS and (hidden_prev if c == "latent" else logits_prev) is None:
        shape = hidden.shape[:2] if per_token else hidden.shape[:1]
        return torch.zeros(shape, dtype=torch.bool, device=hidden.device)
    if c == "latent":
        return latent_change(hidden_prev, hidden, positions, per_token) < rule.threshold
    if c == "gate":
        if stop_logits is None:
            raise UserError("halting criterion 'gate' needs a model with an exit gate (exit_gate=true)")
        g = stop_logits if per_token else row_mean(stop_logits, positions)
        return g >= logit(rule.threshold)                                       # σ(g) ≥ θ  ⇔  g ≥ log(θ / (1 − θ))
    if logits is None:
        raise UserError(f"halting criterion {c!r} needs the model's read-out after every loop")
    if c == "entropy":
        score = entropy(as_positions(logits))                                    # [N,T]
    elif c == "kl":
        score = kl_divergence(as_positions(logits_prev), as_positions(logits))
    else:                                                                        # argmax: changed = 1
        score = argmax_changed(as_positions(logits_prev), as_positions(logits))
    if per_token:
        return score < rule.threshold if c != "argmax" else score < 0.5
    P = positions if logits.dim() == 3 else None
    return row_max(score, P) < (rule.threshold if c != "argmax" else 0.5)


def logit(p: float) -> float:
    """log(p / (1 − p)), the stop logit of probability p (+inf at p = 1)."""
    return math.inf if p >= 1 else math.log(p / (1 - p))


def update_streak(streak: torch.Tensor, holds: torch.Tensor) -> torch.Tensor:
    """Consecutive loops the criterion has held: streak + 1 where it holds, 0 where not.  [N] or [N,T] int."""
    return (streak + 1) * holds


def stops(rule: HaltRule, streak: torch.Tensor, t: int | torch.Tensor, loops: int) -> torch.Tensor:
    """Which rows stop after loop t (1-based) of a call of `loops` loops: the criterion has held `patience` loops
    in a row and t ≥ min_loops, or t is the last allowed loop (`rule.bound(loops)`).  streak [N] -> [N] bool;
    t: one loop for all rows, or each row's own [N] (depth-wise batching)."""
    if isinstance(t, int):
        if t >= rule.bound(loops):
            return torch.ones_like(streak, dtype=torch.bool)
        return (streak >= rule.patience) & (t >= rule.min_loops)
    return (t >= rule.bound(loops)) | ((streak >= rule.patience) & (t >= rule.min_loops))


# ------------------------------------------------------------------------------------------------- the exit gate
class ExitGate(nn.Module):
    """g = w · RMSN(h) + b: one stop logit per position from the hidden state after a loop.  [..., T, D] -> [..., T].

    A row's logit is the mean over its counted positions (the answer positions, or all real tokens; `row_mean`);
    a causal model's tokens each use their own. w starts at 0 and b at `init_bias` (−4: σ ≈ 0.018, "don't stop"),
    so the untrained gate exits only at the loop bound and draws no random numbers (models without and with a gate
    share their other initial weights).
    """

    def __init__(self, d_model: int, init_bias: float = -4.0, eps: float | None = None):
        super().__init__()
        with torch.random.fork_rng(devices=[]):   # nn.Linear's own initialisation draws; reset_parameters does not
            self.proj = nn.Linear(d_model, 1)
        self.init_bias, self.eps = init_bias, eps
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.proj.weight.zero_()
        self.proj.bias.fill_(self.init_bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(F.rms_norm(h, (h.shape[-1],), None, self.eps)).squeeze(-1)


__all__ = ["CRITERIA", "HaltRule", "latent_change", "kl_divergence", "entropy", "argmax_changed", "row_max",
           "row_mean", "as_positions", "criterion_holds", "update_streak", "stops", "ExitGate"]
