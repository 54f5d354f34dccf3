"""`loopformer hf finetune RUN --out DIR`: fine-tune a language model with LoRA adapters (peft) on the shared
block — or all its weights (`--full`), the reference — through the transformers class, and save the run with its
adapters and the merged weights.

    DIR/adapter/           the adapters as peft writes them (adapter_config.json, adapter_model.safetensors):
                           `PeftModel.from_pretrained(base, DIR/adapter)` on `LoopformerForCausalLM` of RUN (or of
                           its export) gives the fine-tuned model (LoRA only)
    DIR/checkpoint/        a loopformer checkpoint of the fine-tuned model, the adapters merged into the block's
                           weights: every loopformer command (perplexity, eval, generate, `hf export`) reads it
    DIR/finetune.json      the trainable parameters and the model's own, the options, the loss, and the split's
                           perplexity before and after

LoRA (Hu et al., 2021): a frozen weight W of the shared block gets W + (α/r)·B·A, A [r,in] and B [out,r] trained, B
starting at 0 (the start is the model of RUN). The targets are the block's linear maps — attention in (qkv) and out
(proj), the MLP's fc and proj — of every layer of the block; the block runs R times, so one adapter acts at every
loop. The embedding, the head, the norms and the timestep modulation stay frozen. `--full` trains every weight
with the same data, steps and schedule.

Training: random windows of the corpus's train split (the model's context; `loopformer.text.dataset.RandomWindows`,
seeded), next-token cross-entropy at the run's loops, AdamW, linear warm-up then cosine decay to lr/10.
Needs the extras `hf` and `lora` (`pip install 'loopformer[hf,lora]'`).
"""

from __future__ import annotations

import json
import math
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import loopformer.hf  # noqa: F401  (quiets torchao's import before peft imports it)
from loopformer.errors import UserError
from loopformer.fileio import check_owned_folder, new_folder
from loopformer.hf.model import LoopformerForCausalLM, hf_config
from loopformer.model.io import load, read_config, resolve_checkpoint, save_checkpoint
from loopformer.text.commands import checkpoint_data_dir
from loopformer.text.dataset import RandomWindows, TokenCorpus
from loopformer.text.perplexity import perplexity

TARGETS = r".*blocks\.\d+\.(attn\.(qkv|proj)|mlp\.(fc|proj))"      # the shared block's linear maps
WRITTEN = ("adapter", "checkpoint", "finetune.json")
MARKER = "finetune.json"
WARMUP = 10


def check_out(out: str | Path) -> None:
    check_owned_folder(out, WRITTEN, MARKER, "hf finetune", hint="choose a new folder for the fine-tuned run")


def count(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def lora_model(hf: LoopformerForCausalLM, rank: int, alpha: float, dropout: float = 0.0):
    """`hf` with LoRA adapters of rank `rank` on the shared block's linear maps (peft; everything else frozen)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        from peft import LoraConfig, get_peft_model
        config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=TARGETS, bias="none")
        return get_peft_model(hf, config)


def lr_at(step: int, steps: int, lr: float) -> float:
    """Linear warm-up over WARMUP steps, then cosine decay to lr/10 at the last step."""
    if step < WARMUP:
        return lr * (step + 1) / WARMUP
    frac = (step - WARMUP) / max(1, steps - WARMUP - 1)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def finetune(run: str | Path, out: str | Path, *, rank: int = 8, alpha: float | None = None, full: bool = False,
             steps: int = 200, batch_size: int = 16, lr: float | None = None, seed: int = 0,
             data: str | None = None, split: str = "test", progress=print) -> dict:
    """Fine-tune the language model of `run` (module docstring) into the run folder `out`; returns finetune.json."""
    ckpt = resolve_checkpoint(run)
    cfg, extra = read_config(ckpt)
    hf_config(cfg)                                  # refuses a model that is no causal language model
    if not full and cfg.compat == "authors":
        raise UserError("LoRA needs the block's linear maps called as modules; a compat: authors layer reads its "
                        "qkv weight directly: use --full")
    if steps < 1 or batch_size < 1 or rank < 1:
        raise UserError("--steps, --batch-size and --rank must be at least 1")
    for flag, v in (("--lr", lr), ("--alpha", alpha)):
        if v is not None and not (math.isfinite(v) and v > 0):
            raise UserError(f"{flag} must be a positive number (got {v})")
    check_out(out)
    corpus = data if data is not None else checkpoint_data_dir(str(ckpt))
    if corpus is None:
        raise UserError(f"cannot tell which corpus {ckpt} was trained on; pass --data DIR (a prepared corpus)")
    tc = TokenCorpus(corpus)
    for s in ("train", split):
        if s not in tc.splits:
            raise UserError(f"{corpus} has no split {s!r} (it has {', '.join(tc.splits)})")
    if tc.vocab_size > cfg.vocab_size:
        raise UserError(f"{corpus} has {tc.vocab_size} tokens, more than the model's vocabulary of {cfg.vocab_size}")
    lr = lr if lr is not None else (1e-3 if not full else 3e-4)
    alpha = alpha if alpha is not None else 2.0 * rank
    T = cfg.max_len
    test = np.asarray(tc.tokens(split))
    model = load(ckpt)
    total = sum(p.numel() for p in model.parameters())              # the model's own, without adapters
    before = perplexity(model, test, block_size=T, batch_size=32, progress=False).ppl
    torch.manual_seed(seed)
    hf = LoopformerForCausalLM.from_loopformer(model)
    hf.config.use_cache = False
    net = hf if full else lora_model(hf, rank, alpha)
    for p in (hf.parameters() if full else ()):
        p.requires_grad_(True)
    trainable, _ = count(net)
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=lr, weight_decay=0.0,
                            betas=(0.9, 0.95))
    windows = RandomWindows(np.asarray(tc.tokens("train")), T, batch_size, seed=seed)
    net.train()
    losses, start = [], time.perf_counter()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr)
        x, y = windows.batch(step)
        logits = net(input_ids=x, use_cache=False).logits                          # [B,T,V]
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if (step + 1) % max(1, steps // 4) == 0 or step + 1 == steps:
            progress(f"step {step + 1}/{steps}: loss {np.mean(losses[-max(1, steps // 4):]):.4f}")
    seconds = time.perf_counter() - start
    net.eval()
    adapter_state = None if full else adapter_weights(net)
    merged = hf.model if full else net.merge_and_unload().model       # W + (α/r)·B·A written into the block
    for p in merged.parameters():
        p.requires_grad_(False)
    after = perplexity(merged, test, block_size=T, batch_size=32, progress=False).ppl
    result = {"run": str(run), "checkpoint": str(ckpt), "corpus": str(corpus), "method": "full" if full else "lora",
              "rank": None if full else rank, "alpha": None if full else alpha, "targets": None if full else TARGETS,
              "trainable_parameters": trainable, "model_parameters": total, "steps": steps,
              "batch_size": batch_size, "lr": lr, "seed": seed, "window": T, "train_seconds": seconds,
              "loss_first": float(np.mean(losses[:max(1, steps // 10)])),
              "loss_last": float(np.mean(losses[-max(1, steps // 10):])),
              "split": split, "perplexity_before": before, "perplexity_after": after}
    out = Path(out)
    with new_folder(out) as tmp:
        if not full:
            net.peft_config["default"].save_pretrained(str(tmp / "adapter"))    # adapter_config.json
            save_file(adapter_state, str(tmp / "adapter" / "adapter_model.safetensors"), metadata={"format": "pt"})
        save_checkpoint(tmp / "checkpoint", merged, run=extra.get("run") or {}, task=extra.get("task") or {})
        (tmp / MARKER).write_text(json.dumps(result, indent=2) + "\n")
    return result


def adapter_weights(net) -> dict[str, torch.Tensor]:
    """The adapters' weights as peft's `save_pretrained` writes them (adapter_model.safetensors), taken before the
    adapters are merged into the block."""
    from peft.utils import get_peft_model_state_dict
    return {k: v.detach().contiguous().clone() for k, v in get_peft_model_state_dict(net).items()}


def load_adapter(base: LoopformerForCausalLM, adapter: str | Path):
    """`base` with the adapters saved by `hf finetune` in `adapter` (peft's `PeftModel.from_pretrained`)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        from peft import PeftModel
        if not (Path(adapter) / "adapter_config.json").is_file():
            raise UserError(f"{adapter} holds no adapter_config.json (a folder `hf finetune` wrote: DIR/adapter)")
        return PeftModel.from_pretrained(base, str(adapter))


__all__ = ["finetune", "lora_model", "load_adapter", "adapter_weights", "count", "TARGETS", "WRITTEN"]
