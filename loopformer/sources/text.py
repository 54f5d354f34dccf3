"""Language modelling (paper App. C.3): random windows of a prepared token corpus (`loopformer.text`).

Evaluation: summed next-token cross-entropy per loop → loss (nats/token), ppl = exp(loss), next-token accuracy,
over the first `task.eval_windows` non-overlapping windows of the validation split: `windows` /
`windows_in_split`, `tokens` / `tokens_in_split`, `whole_split` and `ppl_over` (a sentence) say which
(`loopformer perplexity` gives the whole split: `SplitWindows`, every target of a split scored once in strided
windows, `loopformer.text.perplexity`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from loopformer.errors import UserError
from loopformer.sources.base import DataSource, TaskConfig, check_dir, eval_rows
from loopformer.text.dataset import RandomWindows, TokenCorpus
from loopformer.text.perplexity import scored_positions, split_result, window_groups, window_plan

NAME = "text"


def _corpus(cfg: TaskConfig) -> TokenCorpus:
    if not cfg.data_dir:
        raise UserError("task text needs task.data_dir (a folder made by `loopformer text prepare`)")
    check_dir(cfg.data_dir)
    return TokenCorpus(cfg.data_dir)


class TextData(DataSource):
    kind = "text"
    metric = "ppl"
    higher_is_better = False

    @classmethod
    def handles(cls, name: str) -> bool:
        return name == NAME

    @classmethod
    def choices(cls) -> list[str]:
        return [NAME]

    @classmethod
    def model_fields(cls, cfg: TaskConfig) -> dict[str, Any]:
        return {"vocab_size": _corpus(cfg).vocab_size, "input_dim": 0, "max_len": cfg.block_size, "causal": True,
                "head": "lm"}

    def __init__(self, cfg: TaskConfig):
        self.corpus = _corpus(cfg)
        self.cfg = cfg
        self.train_tokens = self.corpus.tokens("train")
        self.eval_split = "val" if "val" in self.corpus.splits else "test"
        self.block = cfg.block_size
        self._windows = RandomWindows(self.train_tokens, self.block, 1, seed=cfg.seed, rank=0)

    def plan(self, step: int, batch_size: int) -> np.ndarray:
        self._windows.batch_size = batch_size
        return self._windows.offsets(step)                  # [B] window starts of the global batch

    def fetch(self, keys: np.ndarray, step: int) -> dict[str, torch.Tensor]:
        T = self.block
        win = np.stack([np.asarray(self.train_tokens[o:o + T + 1]) for o in keys]).astype(np.int64)  # [B,T+1]
        w = torch.from_numpy(win)
        return {"inputs": w[:, :-1], "targets": w[:, 1:]}

    def test_batches(self, batch_size: int, limit: int = 0) -> Iterator[dict[str, np.ndarray]]:
        toks = self.corpus.tokens(self.eval_split)
        T = self.block
        n = min(limit or self.cfg.eval_windows, max(0, (len(toks) - 1) // T))
        if n == 0:
            raise UserError(f"the {self.eval_split} split of {self.cfg.data_dir} is shorter than one window")
        for i in range(0, n, batch_size):
            win = np.stack([np.asarray(toks[s * T:s * T + T + 1]) for s in range(i, min(i + batch_size, n))])
            win = win.astype(np.int64)
            yield {"inputs": win[:, :-1], "targets": win[:, 1:]}

    def eval_scope(self, limit: int = 0) -> dict[str, Any]:
        """What `test_batches(…, limit)` covers: the first n non-overlapping windows of the evaluation split, so
        the perplexity computed from them is over those windows only unless `whole_split`."""
        toks = self.corpus.tokens(self.eval_split)
        T = self.block
        total = max(0, (len(toks) - 1) // T)
        n = min(limit or self.cfg.eval_windows, total)
        whole = n == total
        over = (f"{self.eval_split}: all {total:,} non-overlapping {T}-token windows" if whole else
                f"{self.eval_split}: first {n:,} of {total:,} non-overlapping {T}-token windows")
        over += f" ({n * T:,} of {max(0, len(toks) - 1):,} next-token targets)"
        return {"eval_split": self.eval_split, "windows": n, "windows_in_split": total,
                "tokens_in_split": max(0, len(toks) - 1), "whole_split": whole, "ppl_over": over}

    def eval_batches(self, batch_size: int, limit: int, read_outs: int, out_dim: int
                     ) -> Iterator[dict[str, np.ndarray]]:
        for batch in self.test_batches(batch_size, limit):
            T = batch["inputs"].shape[1]
            step = eval_rows(batch_size, read_outs, T, out_dim)
            for i in range(0, len(batch["inputs"]), step):
                yield {k: v[i:i + step] for k, v in batch.items()}

    def score(self, read_outs: torch.Tensor, batch: dict[str, np.ndarray]) -> tuple[list, list, int]:
        logits = read_outs.float()                                                        # [R,b,T,V]
        C = logits.shape[-1]
        y = torch.as_tensor(batch["targets"], device=logits.device)
        nll = [F.cross_entropy(logits[t].reshape(-1, C), y.reshape(-1), reduction="sum").item()
               for t in range(logits.shape[0])]
        correct = [(logits[t].argmax(-1) == y).sum().item() for t in range(logits.shape[0])]
        return nll, correct, y.numel()

    def summarize(self, parts: list, limit: int, trained_loops: int) -> list[dict[str, float]]:
        n_loops = len(parts[0][0])
        nll, correct, count = np.zeros(n_loops), np.zeros(n_loops), 0
        for p_nll, p_correct, p_count in parts:
            for t in range(n_loops):
                nll[t] += p_nll[t]
                correct[t] += p_correct[t]
            count += p_count
        scope = self.eval_scope(limit)   # the windows evaluated (a prefix of the split unless whole_split)
        out = []
        for t in range(n_loops):
            loss = nll[t] / count
            out.append({"loss": loss, "ppl": math.exp(min(loss, 700.0)), "accuracy": correct[t] / count,
                        "tokens": count, **scope})
        return out

    def describe(self) -> dict[str, Any]:
        return {"name": "text", "data_dir": self.cfg.data_dir, "block_size": self.block, "seed": self.cfg.seed,
                "eval_windows": self.cfg.eval_windows, "metric": self.metric,
                "corpus": {k: self.corpus.manifest.get(k) for k in ("source", "tokenizer", "vocab_size")}}


class SplitWindows(TextData):
    """Every token of one split of a prepared corpus, scored once, in windows of `block_size` inputs advancing by
    `stride` (`loopformer.text.perplexity.window_plan`): the perplexity of the split, evaluated like any source
    (fixed depth, adaptive depth). The metrics: loss (nats per scored token), ppl, next-token accuracy, tokens and
    the windows' description (`method`, `windows`, `block_size`, `stride`, `min_context`, `ppl_over`). An
    evaluation source only: nothing trains on it, and `limit` does not apply (the whole split)."""

    def __init__(self, corpus: TokenCorpus, split: str, block_size: int, stride: int | None = None):
        self.corpus = corpus
        self.eval_split = split
        self.tokens = corpus.tokens(split)
        self.block = int(block_size)
        self.stride = stride
        self.windows = window_plan(len(self.tokens), self.block, stride)                  # [(b, s, t)]

    def plan(self, step: int, batch_size: int) -> np.ndarray:
        raise UserError("a split's strided windows are for evaluation; train on the corpus (task.name=text)")

    fetch = plan

    def _batch(self, group: list[tuple[int, int, int]]) -> dict[str, np.ndarray]:
        x = np.stack([np.asarray(self.tokens[b:t - 1], dtype=np.int64) for b, _, t in group])        # [b,L]
        y = np.stack([np.asarray(self.tokens[b + 1:t], dtype=np.int64) for b, _, t in group])        # [b,L]
        return {"inputs": x, "targets": y, "scored": scored_positions(group)}

    def test_batches(self, batch_size: int, limit: int = 0) -> Iterator[dict[str, np.ndarray]]:
        for group in window_groups(self.windows, batch_size):
            yield self._batch(group)

    def eval_batches(self, batch_size: int, limit: int, read_outs: int, out_dim: int
                     ) -> Iterator[dict[str, np.ndarray]]:
        rows = batch_size if read_outs == 1 else eval_rows(batch_size, read_outs, self.block, out_dim)
        return self.test_batches(rows)

    def as_tensors(self, batch: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
        return {**super().as_tensors(batch, device), "scored": torch.as_tensor(batch["scored"], device=device)}

    def counted(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return batch["scored"]

    def score(self, read_outs: torch.Tensor, batch: dict[str, np.ndarray]) -> tuple[list, list, int]:
        logits = read_outs.float()                                                        # [R,b,L,V]
        y = torch.as_tensor(batch["targets"], device=logits.device)
        keep = torch.as_tensor(batch["scored"], device=logits.device)
        nll = [float(F.cross_entropy(logits[t].reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
                     .view(y.shape)[keep].double().sum()) for t in range(logits.shape[0])]
        correct = [int(((logits[t].argmax(-1) == y) & keep).sum()) for t in range(logits.shape[0])]
        return nll, correct, int(keep.sum())

    def summarize(self, parts: list, limit: int, trained_loops: int) -> list[dict[str, float]]:
        count = sum(p[2] for p in parts)
        out = []
        for t in range(len(parts[0][0])):
            total = 0.0
            for p in parts:
                total += p[0][t]
            res = split_result(total, count, self.windows, self.block, self.stride)
            out.append({"loss": res.nll, "ppl": res.ppl, "accuracy": sum(p[1][t] for p in parts) / count,
                        "tokens": count, "eval_split": self.eval_split, "whole_split": True, "method": res.method,
                        "windows": res.windows, "block_size": res.block_size, "stride": res.stride,
                        "min_context": res.min_context, "ppl_over": res.description})
        return out

    def describe(self) -> dict[str, Any]:
        return {"name": "text", "data_dir": str(self.corpus.folder), "split": self.eval_split,
                "block_size": self.block, "stride": self.stride, "metric": self.metric,
                "corpus": {k: self.corpus.manifest.get(k) for k in ("source", "tokenizer", "vocab_size")}}


__all__ = ["TextData", "SplitWindows"]
