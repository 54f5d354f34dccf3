"""Language modelling (paper App. C.3): random windows of a prepared token corpus (`loopformer.text`).

Evaluation: summed next-token cross-entropy per loop → loss (nats/token), ppl = exp(loss), next-token accuracy,
over the first `task.eval_windows` non-overlapping windows of the validation split: `windows` /
`windows_in_split`, `tokens` / `tokens_in_split`, `whole_split` and `ppl_over` (a sentence) say which
(`loopformer perplexity` gives the whole split).
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from loopformer.errors import UserError
from loopformer.sources.base import DataSource, TaskConfig, check_dir, eval_rows
from loopformer.text.dataset import RandomWindows, TokenCorpus

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


__all__ = ["TextData"]
