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

from loopformer.configio import one_line
from loopformer.errors import UserError
from loopformer.model.config import ModelConfig
from loopformer.model.io import check_checkpoint_out, save_checkpoint
from loopformer.model.looped import LoopedTransformer
from loopformer.model.memory import check_fits, param_count

SUPPORTED = ("lt", "tmlt")
_ARGS = ("n_loop", "n_head", "n_embd", "block_size", "vocab_size")


def _int_arg(model_args: dict, name: str) -> int:
    v = model_args[name]
    if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_floating_point():
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, int):
        raise UserError(f"checkpoint model_args.{name} must be an integer (got {type(v).__name__} {str(v)[:40]!r})")
    return v


def config_from_args(model_args: dict, model_type: str) -> ModelConfig:
    """The ModelConfig of the authors' `model_args`; a missing, non-integer or out-of-range value is a UserError."""
    if not isinstance(model_args, dict):
        raise UserError(f"checkpoint model_args must be a dict (got {type(model_args).__name__})")
    missing = [a for a in _ARGS if a not in model_args]
    if missing:
        raise UserError(f"checkpoint model_args lack {', '.join(missing)}")
    args = {a: _int_arg(model_args, a) for a in _ARGS}
    bias, dropout = model_args.get("bias", False), model_args.get("dropout", 0.0)
    if not isinstance(bias, bool) or isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
        raise UserError("checkpoint model_args.bias must be a boolean and model_args.dropout a number")
    try:
        return ModelConfig(
            vocab_size=args["vocab_size"], max_len=args["block_size"], d_model=args["n_embd"],
            n_heads=args["n_head"], n_layers=1, loops=args["n_loop"], bias=bias, dropout=float(dropout), causal=True,
            tie_embeddings=True, norm_gain=False, norm_eps=None, activation="gelu", timestep=model_type == "tmlt",
            compat="authors",
            timestep_gate_init=0.0,   # their parametrisation (adaLN-Zero); initialisation only, the weights are loaded
        )
    except (ValueError, TypeError) as exc:
        raise UserError(f"checkpoint model_args do not describe a model loopformer builds: {one_line(exc)}") from None


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
    weights = ckpt["model"]
    if not isinstance(weights, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                for k, v in weights.items()):
        raise UserError("not a looped-GPT checkpoint: its 'model' entry must map weight names to tensors (got "
                        f"{type(weights).__name__})")
    run = ckpt.get("config") or {}
    if not isinstance(run, dict):
        raise UserError(f"not a looped-GPT checkpoint: its 'config' entry must be a dict (got {type(run).__name__})")
    model_type = str(run.get("model_type", "tmlt" if any(k.startswith("adaLN") for k in weights) else "lt"))
    if model_type not in SUPPORTED:
        raise UserError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED)}")
    cfg = config_from_args(ckpt["model_args"], model_type)
    check_fits({"parameters": 4 * param_count(cfg)}, "cpu", "the converted model", skip=None)   # before building
    with torch.device("meta"):             # the shapes the weights must have, nothing allocated
        want = {k: tuple(v.shape) for k, v in LoopedTransformer(cfg).state_dict().items()}
    sd = convert_state_dict(weights, model_type, cfg.bias)
    for name, w in sd.items():
        if name in want and tuple(w.shape) != want[name]:
            raise UserError(f"checkpoint does not fit its model_args: {name} has shape {list(w.shape)}, model_args "
                            f"ask for {list(want[name])}")
        if w.is_floating_point() and not bool(torch.isfinite(w).all()):
            raise UserError(f"checkpoint weight {name} holds NaN or infinite values; refusing to convert it")
    model = LoopedTransformer(cfg)
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


def check_convert_out(out: str | os.PathLike) -> None:
    """A UserError unless `out` is missing, empty or a checkpoint folder written by `convert` (its config.json
    records `run.converted_from`)."""
    check_checkpoint_out(out, "convert", "converted_from", "choose a new folder for the converted checkpoint")


def convert_file(path: str | os.PathLike, out: str | os.PathLike, trust_pickle: bool = False) -> Path:
    """`loopformer convert ckpt.pt --out DIR`: write a loopformer checkpoint folder. DIR must be new, empty or an
    earlier conversion (`check_convert_out`): anything else in it is the user's and is never replaced."""
    check_convert_out(out)
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
