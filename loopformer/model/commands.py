"""CLI: `loopformer presets` (build, count and time every preset), `loopformer convert`, `loopformer info`."""

from __future__ import annotations

import argparse
import json
import time

import torch

from loopformer.configio import to_dict
from loopformer.errors import UserError
from loopformer.model.config import PRESETS
from loopformer.model.convert import convert_file
from loopformer.model.io import load
from loopformer.model.looped import LoopedTransformer


def _time_step(model: torch.nn.Module, cfg, batch: int, length: int, steps: int = 2) -> float:
    """Seconds per forward+backward+AdamW step on random input of shape [batch, length]."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    if cfg.vocab_size:
        x = torch.randint(0, cfg.vocab_size, (batch, length), generator=g)
    else:
        x = torch.randn(batch, length, cfg.input_dim, generator=g)
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        out = model(x)
        loss = out.logits.float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return min(times[1:])


PRESET_MAX_BATCH, PRESET_MAX_LENGTH = 256, 4096   # the timed step's input: a measurement, not a workload


def cmd_presets(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    if not 1 <= args.batch <= PRESET_MAX_BATCH:
        raise UserError(f"--batch must lie in 1..{PRESET_MAX_BATCH} (got {args.batch})")
    if not 1 <= args.length <= PRESET_MAX_LENGTH:
        raise UserError(f"--length must lie in 1..{PRESET_MAX_LENGTH} (got {args.length})")
    names = args.names or list(PRESETS)
    rows = []
    for name in names:
        if name not in PRESETS:
            raise UserError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
        cfg = PRESETS[name]
        if cfg.indexed_positions and args.length > cfg.max_len:
            raise UserError(f"--length {args.length} exceeds preset {name}'s max_len {cfg.max_len}")
        model = LoopedTransformer(cfg)
        sec = _time_step(model, cfg, args.batch, args.length)
        rows.append((name, cfg.variant, cfg.n_layers, cfg.loops, cfg.d_model, model.num_params(), sec))
        print(f"{name:<15} built, one train step on [{args.batch}, {args.length}] in {sec * 1e3:.0f} ms", flush=True)
    print()
    print("| preset | variant | layers/block | loops | d | parameters | fwd+bwd+AdamW step (ms) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5]:,} | {r[6] * 1e3:.0f} |")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    out = convert_file(args.checkpoint, args.out, trust_pickle=args.trust_pickle)
    print(f"wrote {out}")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    model = load(args.checkpoint)
    print(json.dumps({"variant": model.config.variant, "parameters": model.num_params(),
                      "config": to_dict(model.config)}, indent=2))
    return 0


def register(sub) -> None:
    p = sub.add_parser("presets", help="build every model preset, print parameter counts and a timed train step")
    p.add_argument("names", nargs="*", help="presets to run (default: all)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--length", type=int, default=64)
    p.set_defaults(func=cmd_presets)

    p = sub.add_parser("convert", help="convert a checkpoint of the published looped-GPT code (ckpt.pt)")
    p.add_argument("checkpoint")
    p.add_argument("--out", required=True, help="loopformer checkpoint folder to write")
    p.add_argument("--trust-pickle", action="store_true", help="allow arbitrary pickled objects in the file")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("info", help="print the configuration and size of a checkpoint folder")
    p.add_argument("checkpoint")
    p.set_defaults(func=cmd_info)
