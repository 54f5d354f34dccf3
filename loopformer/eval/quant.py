"""Weight-only quantization of the shared block, checked over loops (`loopformer eval --quant int8`).

A looped model applies one block r times, so an error in its weights acts at every loop: where the loop map
contracts the error stays bounded, where it does not it compounds. `quantize_block` replaces the weights of the
block's linear maps — attention's qkv and output projections, the MLP's two (`BLOCK_MAPS`) — by torchao's
weight-only quantized tensors; activations stay in floating point, and so do the embedding, the head, the norms and
the timestep modulation (the per-loop scales and gates: a few numbers per loop).

    int8   torchao `Int8WeightOnlyConfig`: one int8 per weight and one scale per output channel (symmetric); on CPU
           the matmul dequantizes on the fly. Half the bytes of bf16, a quarter of fp32.
    int4   torchao `IntxWeightOnlyConfig(int4, groups of 32)`: the int4 grid with a scale per 32 weights of a row.
           In torchao 0.18 on CPU its tensors hold the int4 values unpacked in int8 (no saving on disk beyond
           int8): it measures the error of 4-bit weights, not their size. (`Int4WeightOnlyConfig` needs GPU kernels.)

`eval --quant KIND` evaluates the model as it is and quantized, to 4r loops with the drift diagnostics
(`loopformer.eval.drift`), and prints the metric after every loop t = 1..4r side by side with the verdict of each.
Needs the extra `quant` (`pip install 'loopformer[quant]'`: torchao).
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import re
import warnings

import torch

from loopformer.errors import UserError

KINDS = ("int8", "int4")
BLOCK_MAPS = r"blocks\.\d+\.(attn\.(qkv|proj)|mlp\.(fc|proj))"      # the shared block's linear maps (fqn)
EXTRA = "pip install 'loopformer[quant]'"
INT4_GROUP = 32


def check_kind(kind: str) -> None:
    """A one-line UserError for an unknown kind or a missing torchao (with the install hint)."""
    if kind not in KINDS:
        raise UserError(f"--quant takes one of {', '.join(KINDS)} (got {kind!r})")
    if importlib.util.find_spec("torchao") is None:
        raise UserError(f"--quant needs torchao, which is not installed: {EXTRA}")


def _torchao():
    """torchao, imported quietly (its import warns about kernels built for GPUs and other Python versions)."""
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torchao.quantization as q
    return q


def config(kind: str):
    """The torchao quantization config of `kind`."""
    q = _torchao()
    if kind == "int8":
        return q.Int8WeightOnlyConfig()
    from torchao.quantization.granularity import PerGroup
    return q.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(INT4_GROUP))


def block_maps(model: torch.nn.Module, prefix: str = "") -> list[str]:
    """The names of the shared block's linear maps in `model` (under `prefix`, e.g. "model." in the transformers
    class)."""
    pat = re.compile(re.escape(prefix) + BLOCK_MAPS)
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and pat.fullmatch(n)]


def quantize_block(model: torch.nn.Module, kind: str, prefix: str = "", inplace: bool = False) -> torch.nn.Module:
    """`model` (a copy unless `inplace`) with the shared block's linear maps quantized weight-only (`kind`); the
    rest is left as it is. A model whose block reads its weights directly (`compat: authors`) is refused."""
    check_kind(kind)
    cfg = getattr(model, "config", None)
    if getattr(cfg, "compat", None) == "authors":
        raise UserError("--quant: the published code's layer (compat: authors) slices its qkv weight itself; "
                        "quantization of its block is not supported")
    names = set(block_maps(model, prefix))
    if not names:
        raise UserError("--quant: the model has no shared block of linear maps to quantize")
    out = model if inplace else copy.deepcopy(model)
    q = _torchao()
    with torch.no_grad():
        q.quantize_(out, config(kind), filter_fn=lambda mod, fqn: fqn in names)
    return out


def quantized_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's weights as stored: a quantized tensor counts its integer data and scales."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        inner = [getattr(t, a) for a in getattr(t, "tensor_data_names", ())] + \
                [getattr(t, a) for a in getattr(t, "optional_tensor_data_names", ()) if getattr(t, a, None) is not None]
        parts = inner or [t]
        total += sum(p.numel() * p.element_size() for p in parts)
    return total


def loop_profile(fp: dict, quant: dict) -> list[dict]:
    """The metric after every loop t = 1..4r of the full-precision and the quantized evaluation (`drift` results)
    with their difference."""
    a, b = fp["metric_per_loop"], quant["metric_per_loop"]
    return [{"loop": t + 1, "full": x, "quant": y, "diff": y - x} for t, (x, y) in enumerate(zip(a, b))]


def profile_table(kind: str, fp: dict, quant: dict) -> str:
    """A markdown table of `loop_profile` (rows 1..4r) and the verdict of each."""
    r, m = fp["loops"], fp["metric"]
    rows = [f"| {p['loop']}{' (r)' if p['loop'] == r else ''} | {p['full']:.4g} | {p['quant']:.4g} | "
            f"{p['diff']:+.4g} |" for p in loop_profile(fp, quant)]
    return "\n".join([
        f"{kind} weight-only quantization of the shared block, loop by loop (r = {r}):", "",
        f"| loop | {m}, full precision | {m}, {kind} | {kind} − full |", "|---|---:|---:|---:|", *rows, "",
        f"drift verdict: full precision **{fp['verdict']}**, {kind} **{quant['verdict']}** (spectral radius at r: "
        f"median {fp['spectral_radius']['median']:.3f} → {quant['spectral_radius']['median']:.3f})"])


__all__ = ["KINDS", "BLOCK_MAPS", "check_kind", "config", "block_maps", "quantize_block", "quantized_bytes",
           "loop_profile", "profile_table"]
