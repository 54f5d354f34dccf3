"""A model seen as a map of its input embeddings, X -> f(X): what the continuity measurements
(`loopformer.analysis.continuity`) and the theory's moduli estimators (`loopformer.theory.targets`) perturb.

X is the read-in's output (token + position embedding, [B,T,D]; input injection re-adds it at every loop) and f(X)
the residual stream after the last loop (before the final norm and the head), or after the final norm.
"""

from __future__ import annotations

import torch

from loopformer.errors import UserError


class EmbeddingMap:
    """What the measurement needs: `embed(idx [B,T]) -> X [B,T,D]` and `apply(X) -> f(X) [B,T,D']`."""

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def apply(self, X: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def apply_all(self, X: torch.Tensor) -> dict[str, torch.Tensor | None]:
        """{"loops": [R,B,T,D'] the output after every loop (R = 1 for a plain map), "normed": [B,T,D'] the output
        after the final norm, or None where the map has none}."""
        return {"loops": self.apply(X)[None], "normed": None}

    def normed_map(self) -> EmbeddingMap | None:
        """The same map read after the final norm (None where there is none)."""
        return None


class LoopedEmbeddingMap(EmbeddingMap):
    """A `LoopedTransformer` seen as X -> f(X): the read-in's output is replaced by X through a forward hook, so
    input injection and every loop see the perturbed embeddings exactly as they would see real ones."""

    def __init__(self, model, loops: int | None = None, output: str = "hidden"):
        if output not in ("hidden", "normed"):
            raise UserError(f"output must be 'hidden' or 'normed' (got {output!r})")
        self.model = model.eval()
        self.loops = loops
        self.output = output

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model.embed(idx)

    def apply(self, X: torch.Tensor) -> torch.Tensor:
        handle = self.model.embed.register_forward_hook(lambda mod, inp, out: X)
        try:
            dummy = torch.zeros(X.shape[:2], dtype=torch.long, device=X.device)
            kw = {} if self.loops is None else {"loops": self.loops}
            out = self.model(dummy, **kw)
        finally:
            handle.remove()
        return self.model.norm_f(out.hidden) if self.output == "normed" else out.hidden

    def apply_all(self, X: torch.Tensor) -> dict[str, torch.Tensor | None]:
        handle = self.model.embed.register_forward_hook(lambda mod, inp, out: X)
        try:
            dummy = torch.zeros(X.shape[:2], dtype=torch.long, device=X.device)
            kw = {} if self.loops is None else {"loops": self.loops}
            out = self.model(dummy, return_all=True, **kw)
        finally:
            handle.remove()
        if self.output == "normed":                      # f is read after the norm: so is every loop
            return {"loops": self.model.norm_f(out.all_hidden), "normed": None}
        return {"loops": out.all_hidden, "normed": self.model.norm_f(out.hidden)}

    def normed_map(self) -> LoopedEmbeddingMap | None:
        return None if self.output == "normed" else LoopedEmbeddingMap(self.model, self.loops, "normed")


__all__ = ["EmbeddingMap", "LoopedEmbeddingMap"]
