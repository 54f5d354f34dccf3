"""Load checkpoints of the published looped-GPT code (a nanoGPT fork) into loopformer.

Their `ckpt.pt` is a dict: `model` (state dict), `model_args` (n_loop, n_layer, n_head, n_embd, block_size, bias,
vocab_size, dropout), `config` (run settings, with `model_type` 'lt' | 'tmlt' | 'gpt'), `optimizer`, `iter_num`,
`best_val_loss`. Key mapping (theirs -> ours):

    transformer.wte / wpe                     embed.tok / embed.pos           (lm_head tied to wte)
    transformer.attn.{q,k,v}                  blocks.0.attn.qkv   (rows stacked q | k | v)
    transformer.attn.c_proj                   blocks.0.attn.proj
    transformer.mlp.c_fc / c_proj             blocks.0.mlp.fc / proj
    transformer.ln_f                          norm_f
    timestep_embedder.mlp.{0,2}               timestep.mlp.{0,2}
    adaLN_modulation.1                        blocks.0.modulation   (chunks: gate_attn, gate_mlp, scale_attn, scale_mlp)

Their block norms have no gain and the plain looped model has a quirk (values from the un-normalised x, no
pre-norm before the MLP); `compat="authors"` in the config reproduces both forwards exactly.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from loopformer.errors import UserError
from loopformer.model.config import ModelConfig
from loopformer.model.io import save_checkpoint
from loopformer.model.looped import LoopedTransformer

SUPPORTED = ("lt", "tmlt")
_ARGS = ("n_loop", "n_head", "n_embd", "block_size", "vocab_size")


def config_from_args(model_args: dict, model_type: str) -> ModelConfig:
    missing = [a for a in _ARGS if a not in model_args]
    if missing:
        raise UserError(f"checkpoint model_args lack {', '.join(missing)}")
    return ModelConfig(
        vocab_size=int(model_args["vocab_size"]), max_len=int(model_args["block_size"]),
        d_model=int(model_args["n_embd"]), n_heads=int(model_args["n_head"]), n_layers=1,
        loops=int(model_args["n_loop"]), bias=bool(model_args.get("bias", False)),
        dropout=float(model_args.get("dropout", 0.0)), causal=True, tie_embeddings=True, norm_gain=False,
        norm_eps=None, activation="gelu", timestep=model_type == "tmlt", compat="authors",
        timestep_gate_init=0.0,   # their parametrisation (adaLN-Zero); initialisation only, the weights are loaded
    )


def convert_state_dict(sd: dict[str, torch.Tensor], model_type: str, bias: bool) -> dict[str, torch.Tensor]:
    """Map the authors' keys to ours; raises UserError naming the first missing key."""
    sd = {k.removeprefix("_orig_mod."): v for k, v in sd.items()}  # saved from a torch.compile'd module

    def get(key: str) -> torch.Tensor:
        if key not in sd:
            raise UserError(f"checkpoint is missing weight {key!r} (model_type {model_type!r})")
        return sd[key]

    out = {
        "embed.tok.weight": get("transformer.wte.weight"),
        "embed.pos.weight": get("transformer.wpe.weight"),
        "blocks.0.attn.qkv.weight": torch.cat([get(f"transformer.attn.{n}.weight") for n in "qkv"]),
        "blocks.0.attn.proj.weight": get("transformer.attn.c_proj.weight"),
        "blocks.0.mlp.fc.weight": get("transformer.mlp.c_fc.weight"),
        "blocks.0.mlp.proj.weight": get("transformer.mlp.c_proj.weight"),
        "norm_f.weight": get("transformer.ln_f.weight"),
    }
    if bias:
        out["blocks.0.attn.qkv.bias"] = torch.cat([get(f"transformer.attn.{n}.bias") for n in "qkv"])
        out["blocks.0.attn.proj.bias"] = get("transformer.attn.c_proj.bias")
        out["blocks.0.mlp.fc.bias"] = get("transformer.mlp.c_fc.bias")
        out["blocks.0.mlp.proj.bias"] = get("transformer.mlp.c_proj.bias")
    if "lm_head.weight" in sd and not torch.equal(sd["lm_head.weight"], out["embed.tok.weight"]):
        raise UserError("checkpoint's lm_head.weight is not tied to transformer.wte.weight")
    if model_type == "tmlt":
        for i in (0, 2):
            out[f"timestep.mlp.{i}.weight"] = get(f"timestep_embedder.mlp.{i}.weight")
            out[f"timestep.mlp.{i}.bias"] = get(f"timestep_embedder.mlp.{i}.bias")
        out["blocks.0.modulation.weight"] = get("adaLN_modulation.1.weight")
        out["blocks.0.modulation.bias"] = get("adaLN_modulation.1.bias")
    return out


def from_authors(ckpt: dict[str, Any]) -> tuple[LoopedTransformer, dict]:
    """Build a loopformer model from the authors' checkpoint dict; returns (model, provenance info)."""
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_args" not in ckpt:
        raise UserError("not a looped-GPT checkpoint: expected a dict with 'model' and 'model_args'")
    run = ckpt.get("config") or {}
    model_type = str(run.get("model_type", "tmlt" if any(k.startswith("adaLN") for k in ckpt["model"]) else "lt"))
    if model_type not in SUPPORTED:
        raise UserError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED)}")
    cfg = config_from_args(ckpt["model_args"], model_type)
    model = LoopedTransformer(cfg)
    sd = convert_state_dict(ckpt["model"], model_type, cfg.bias)
    sd["head.proj.weight"] = sd["embed.tok.weight"]
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise UserError(f"checkpoint does not fit: missing {missing[:3]}, unexpected {unexpected[:3]}")
    info = {"model_type": model_type, "iter_num": ckpt.get("iter_num"), "best_val_loss":
            float(ckpt["best_val_loss"]) if ckpt.get("best_val_loss") is not None else None}
    return model.eval(), info


def read_authors_checkpoint(path: str | os.PathLike, trust_pickle: bool = False) -> dict:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"checkpoint file not found: {p}")
    try:
        return torch.load(p, map_location="cpu", weights_only=not trust_pickle)
    except Exception as exc:  # unpickling errors, truncated files
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        hint = "" if trust_pickle else " (if you trust the file, retry with trust_pickle)"
        raise UserError(f"cannot read {p}: {first[:200]}{hint}") from None


def convert_file(path: str | os.PathLike, out: str | os.PathLike, trust_pickle: bool = False) -> Path:
    """`loopformer convert ckpt.pt --out DIR`: write a loopformer checkpoint folder."""
    ckpt = read_authors_checkpoint(path, trust_pickle)
    model, info = from_authors(ckpt)
    run = {k: v for k, v in (ckpt.get("config") or {}).items() if isinstance(v, (int, float, str, bool, type(None)))}
    run["converted_from"] = {"file": str(Path(path).resolve()), **info}
    return save_checkpoint(out, model, run=run, task={"name": "text"})


def to_normalized_time(model: LoopedTransformer) -> LoopedTransformer:
    """A TMLT of the paper's parametrisation (the loop index t) as a budget-aware model (`timestep_time=
    "normalized"`) computing the same function at its trained r.

    The budget-aware model reads PE(r·t/R) + the step embedder of PE(r/R) in a run of R loops; with the step
    embedder's output layer at zero (as it starts) and R = r this is TE(t) of the original, so every output at r
    loops is identical; at other budgets its loops are spread over the same times. The original is left as it is."""
    cfg = model.config
    if not cfg.timestep or cfg.timestep_time != "index":
        raise UserError("to_normalized_time converts a TMLT that reads the loop index (timestep_time='index')")
    if cfg.timestep_embed != "sinusoid" or cfg.supervision_steps != 1:
        raise UserError("to_normalized_time needs the sinusoid loop encoding and supervision_steps = 1")
    p = next(model.parameters())
    out = LoopedTransformer(cfg.replace(timestep_time="normalized")).to(device=p.device, dtype=p.dtype)
    missing, unexpected = out.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("timestep.step_mlp.") for k in missing), (missing, unexpected)
    return out
