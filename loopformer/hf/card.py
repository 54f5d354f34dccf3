"""The model card (README.md in the Hugging Face Hub's format) that `loopformer hf export` writes into every folder:
YAML front matter (library, pipeline, tags, and a `loopformer` section with the loops, the drift verdict and the
FLOPs per token at r), then the loop profile, the metrics, the training command, the data and the config — read
from the run folder the checkpoint belongs to:

    RUN/results.json    the test metrics, the metric after every loop (`loopwise`) and the drift diagnostics to 4r
                        (`drift`: metric per loop, verdict, spectral radius), adaptive depth (`halting`) if measured
    RUN/run.json        the command that trained it, steps, seed, device, versions
    RUN/finetune.json   a run `hf finetune` wrote: its method, trainable parameters, perplexity before and after
    checkpoint config   the model config and the task (the corpus, its tokenizer)

The loop profile is the metric at t = 1..4r (drift's curve, else the loop-wise curve as far as it goes) with the
FLOPs per token of a forward pass at t loops (`loopformer.model.flops`, a window of the model's context). What the
run folder does not hold (a bare checkpoint, a run trained without `eval.drift`) the card says is not measured and
names the command that measures it.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path
from typing import Any

import yaml

from loopformer.configio import to_dict
from loopformer.eval.halting import format_halting
from loopformer.model.config import ModelConfig
from loopformer.model.flops import forward_flops
from loopformer.model.io import RUN_CHECKPOINT


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def flops_per_token(cfg: ModelConfig, loops: int) -> float:
    return forward_flops(dataclasses.replace(cfg, loops=loops), cfg.max_len) / cfg.max_len


def _num(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def model_card(ckpt: Path, cfg: ModelConfig, extra: dict, *, name: str, remote_code: bool,
               quant: str | None = None, inference_loops: int | None = None, halt: str | None = None) -> str:
    """README.md for the export of the checkpoint folder `ckpt` (module docstring)."""
    run_dir = ckpt.parent if ckpt.name == RUN_CHECKPOINT else None
    results = _read(run_dir / "results.json") if run_dir else {}
    run = _read(run_dir / "run.json") if run_dir else {}
    finetune = _read(run_dir / "finetune.json") if run_dir else {}
    r = cfg.total_loops
    drift = results.get("drift") if isinstance(results.get("drift"), dict) else {}
    metric = results.get("metric") or drift.get("metric") or "metric"
    curve = drift.get("metric_per_loop") or [row.get(metric) for row in results.get("loopwise") or []]
    front = {"library_name": "transformers", "pipeline_tag": "text-generation",
             "tags": ["loopformer", "looped-transformer", "text-generation"] + (["custom_code"] if remote_code else [])
             + ([f"torchao-{quant}"] if quant else []),
             "loopformer": {"loops": r, "layers": cfg.n_layers, "timestep": cfg.timestep, "d_model": cfg.d_model,
                            "parameters": results.get("params") or run.get("params"),
                            "drift_verdict": drift.get("verdict", "not measured"),
                            "flops_per_token_at_r": round(flops_per_token(cfg, r)),
                            **({"quantization": f"{quant} weight-only (shared block)"} if quant else {})}}
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "", f"# {name}", ""]
    lines += _usage(cfg, name, remote_code, quant, inference_loops, halt)
    lines += _loop_profile(cfg, metric, curve, drift, results)
    lines += _metrics(results, finetune)
    lines += _training(run)
    lines += _data(extra.get("task") or {})
    lines += ["## Config", "", "```json", json.dumps(to_dict(cfg), indent=1), "```", ""]
    return "\n".join(lines)


def _usage(cfg: ModelConfig, name: str, remote_code: bool, quant: str | None, inference_loops: int | None,
           halt: str | None) -> list[str]:
    """What the model is, and how transformers loads and runs it."""
    r = cfg.total_loops
    kind = "standard transformer" if r == 1 else f"looped transformer ({cfg.n_layers} layer(s) applied {r} times" + \
        (", timestep-modulated (TMLT)" if cfg.timestep else "") + ")"
    return [f"A {kind} language model trained with loopformer: "
            f"d_model {cfg.d_model}, {cfg.n_heads} heads, context {cfg.max_len}, vocabulary {cfg.vocab_size}."
            + (f" The shared block's linear maps are stored {quant} weight-only (torchao)." if quant else ""), "",
            "## Usage", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
            f'model = AutoModelForCausalLM.from_pretrained("{name}"'
            + (", trust_remote_code=True" if remote_code else "") + ")   # or `import loopformer.hf` first",
            f'tok = AutoTokenizer.from_pretrained("{name}")',
            f'out = model.generate(**tok("To be", return_tensors="pt"), max_new_tokens=40, loops={r})',
            "```", "",
            f"`loops=` sets the loop count of a call (trained: r = {r}"
            + (f"; this export's default: {inference_loops}" if inference_loops else "")
            + (f"; halting rule by default: `{halt}`" if halt else "") + ").", ""]


def _loop_profile(cfg: ModelConfig, metric: str, curve: list, drift: dict, results: dict) -> list[str]:
    """The metric after every loop with its FLOPs per token, the drift verdict and the halting savings."""
    r = cfg.total_loops
    lines = ["## Loop profile", ""]
    if curve:
        lines += [f"The {metric} after every loop t = 1..{len(curve)} (r = {r}), with the FLOPs per token of a "
                  f"forward pass at t loops over a window of {cfg.max_len} tokens:", "",
                  f"| loop t | {metric} | FLOPs per token |", "|---:|---:|---:|"]
        lines += [f"| {t}{' (r)' if t == r else ''} | {_num(v)} | {flops_per_token(cfg, t):,.0f} |"
                  for t, v in enumerate(curve, 1) if v is not None]
        lines.append("")
    else:
        lines += ["Not measured: `loopformer eval RUN --drift` gives the metric after every loop to 4r.", ""]
    if drift:
        sr = drift.get("spectral_radius") or {}
        lines += [f"**Drift verdict past r: {drift.get('verdict')}** (the metric at r, 2r, 4r: "
                  + ", ".join(f"{_num(v)}" for v in (drift.get("at") or {}).values())
                  + (f"; spectral radius of the next loop's map at r: median {sr['median']:.3f}" if "median" in sr
                     else "") + "). Settling: the metric holds to 4r and the state stops changing; drifting: it "
                  "does not — run at the trained r.", ""]
    else:
        lines += ["Drift verdict: not measured (`loopformer eval RUN --drift`).", ""]
    if isinstance(results.get("halting"), dict):
        lines += ["Adaptive depth (halting rules against fixed depth):", "", format_halting(results["halting"]), ""]
    else:
        lines += ["Halting savings: not measured (`loopformer eval RUN --halt kl:1e-3`).", ""]
    return lines


def _metrics(results: dict, finetune: dict) -> list[str]:
    """results.json's test metrics, and a fine-tuning's perplexity before and after."""
    lines = ["## Metrics", ""]
    test = results.get("test") or {}
    if test:
        lines += ["| metric | value |", "|---|---:|"]
        lines += [f"| {k} | {_num(v)} |" for k, v in test.items() if isinstance(v, (int, float))]
        if test.get("ppl_over"):
            lines += ["", f"Measured over {test['ppl_over']}."]
        lines.append("")
    else:
        lines += ["No results.json beside the checkpoint.", ""]
    if finetune:
        lines += [f"Fine-tuned from {finetune.get('run')} ({finetune.get('method')}, "
                  f"{finetune.get('trainable_parameters'):,} trainable parameters, {finetune.get('steps')} steps): "
                  f"{finetune.get('split')} perplexity {_num(finetune.get('perplexity_before'))} → "
                  f"{_num(finetune.get('perplexity_after'))}.", ""]
    return lines


def _training(run: dict) -> list[str]:
    """The command that trained the model (run.json), its facts and versions."""
    lines = ["## Training", ""]
    if not run.get("command"):
        return lines + ["No run.json beside the checkpoint (the command that trained it is not recorded).", ""]
    argv = list(run["command"])
    argv[0] = Path(argv[0]).name
    lines += ["```bash", shlex.join(argv), "```", ""]
    facts = {k: run.get(k) for k in ("total_steps", "seed", "device", "world_size", "started")}
    lines += [", ".join(f"{k}: {v}" for k, v in facts.items() if v is not None), ""]
    if run.get("versions"):
        lines += ["Versions: " + ", ".join(f"{k} {v}" for k, v in run["versions"].items()), ""]
    return lines


def _data(task: dict) -> list[str]:
    """The task, the corpus and its tokenizer, as the checkpoint records them."""
    if not task:
        return ["## Data", "", "Not recorded in the checkpoint.", ""]
    corpus = task.get("corpus") or {}
    src = corpus.get("source") or {}
    tok = corpus.get("tokenizer") or {}
    return ["## Data", "", f"Task {task.get('name')}"
            + (f", corpus {task.get('data_dir')} (source {src.get('name')}"
               + (f", {src.get('package')}" if src.get("package") else "") + ")" if task.get("data_dir") else "")
            + (f", tokenizer {tok.get('kind')} with {tok.get('vocab_size')} tokens" if tok else "") + ".", ""]


__all__ = ["model_card", "flops_per_token"]
