"""int8 weight-only quantization of the shared block: size on disk and CPU decoding speed against full precision.

The language model of RUN is exported twice with `loopformer hf export` — as it is and with `--quant int8` (the
block's linear maps int8 weight-only through transformers' torchao quantizer) — both folders are loaded back with
`AutoModelForCausalLM.from_pretrained`, and both decode the same prompts greedily with the per-(loop, layer) cache
(`generate(..., use_cache=True)`). Printed as one markdown table: the weights file and the block's weights in
bytes, decoding tokens/s (median of repetitions interleaved over the two models), each as int8 / full; then the
share of generated tokens the two models agree on.

    python benchmarks/bench_quant.py runs/plays                      # 100 new tokens, batch 1, one thread
    python benchmarks/bench_quant.py runs/plays --batch 8 --new-tokens 64 --reps 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import loopformer.hf  # noqa: E402,F401  (registers the Auto classes, quiets torchao's import)
from loopformer.hf.export import export  # noqa: E402
from loopformer.text.commands import checkpoint_data_dir  # noqa: E402
from loopformer.text.dataset import TokenCorpus  # noqa: E402


def block_bytes(path: Path) -> int:
    """Bytes of the shared block's tensors (model.blocks.*) in a safetensors file."""
    from safetensors import safe_open
    total = 0
    with safe_open(str(path), "pt") as f:
        for k in f.keys():
            if k.startswith("model.blocks."):
                t = f.get_tensor(k)
                total += t.numel() * t.element_size()
    return total


def decode(model, prompts: torch.Tensor, new: int) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, use_cache=True)
    return time.perf_counter() - t0, out[:, prompts.shape[1]:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="a run folder or checkpoint folder of a causal language model")
    ap.add_argument("--new-tokens", type=int, default=100, help="at most the context less the prompt")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (one per process on a shared machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()

    with tempfile.TemporaryDirectory() as tmp:
        folders = {"full": Path(tmp) / "full", "int8": Path(tmp) / "int8"}
        export(args.run, folders["full"])
        export(args.run, folders["int8"], quant="int8")
        models = {k: AutoModelForCausalLM.from_pretrained(f).eval() for k, f in folders.items()}
        files = {k: (f / "model.safetensors").stat().st_size for k, f in folders.items()}
        blocks = {k: block_bytes(f / "model.safetensors") for k, f in folders.items()}
    corpus = TokenCorpus(checkpoint_data_dir(str(args.run)) or "")
    test = torch.as_tensor(corpus.tokens("test")[: args.batch * args.prompt_len].astype("int64"))
    prompts = test.view(args.batch, args.prompt_len)
    ctx = models["full"].config.max_len
    if args.prompt_len + args.new_tokens > ctx:
        sys.exit(f"bench_quant: --prompt-len + --new-tokens must fit the model's context of {ctx}")
    times: dict[str, list[float]] = {k: [] for k in models}
    outs = {}
    decode(models["full"], prompts, 4)                                  # warm-up
    for _ in range(args.reps):
        for k, m in models.items():
            dt, outs[k] = decode(m, prompts, args.new_tokens)
            times[k].append(dt)
    speed = {k: args.batch * args.new_tokens / statistics.median(v) for k, v in times.items()}
    same = float((outs["full"] == outs["int8"]).float().mean())
    print(f"{args.run}: batch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new tokens, "
          f"{args.threads} thread(s), median of {args.reps}\n")
    print("| | full (fp32) | int8 block | int8 / full |\n|---|---:|---:|---:|")
    print(f"| model.safetensors (bytes) | {files['full']:,} | {files['int8']:,} | "
          f"{files['int8'] / files['full']:.3f} |")
    print(f"| the block's weights (bytes) | {blocks['full']:,} | {blocks['int8']:,} | "
          f"{blocks['int8'] / blocks['full']:.3f} |")
    print(f"| decoding (tokens/s) | {speed['full']:.1f} | {speed['int8']:.1f} | {speed['int8'] / speed['full']:.3f} |")
    print(f"\ngreedy tokens the two agree on: {100 * same:.1f} %")


if __name__ == "__main__":
    main()
