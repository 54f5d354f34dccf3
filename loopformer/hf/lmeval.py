"""`loopformer lm-eval RUN --tasks ppl,next_line --loops 1,2,4,8 --out DIR`: a loopformer language model evaluated
by lm-evaluation-harness (`lm_eval`) through the transformers class (`LoopformerForCausalLM`), offline, on tasks
built from a prepared corpus, at several loop budgets in one command.

The tasks are written as lm_eval task folders (YAML, a JSON-lines data file, a small `loopformer_tasks.py`) under
DIR/tasks, so `lm_eval --include_path DIR/tasks` runs them too (docs/ecosystem.md):

    loopformer_ppl        perplexity (`loglikelihood_rolling`) over the documents of a split (default test) of the
                          corpus: every document of the split (the text between two end-of-text tokens) is one
                          lm_eval document, scored from the end-of-text token in windows of the model's context;
                          metrics token_perplexity (per token of the model's tokenizer), word_perplexity,
                          byte_perplexity, bits_per_byte
    loopformer_next_line  multiple choice (cloze): the preceding lines of a document as context, the true next line
                          among four lines of the split (three drawn at random); metrics acc, acc_norm (chance 0.25)

For each loop budget R, lm_eval runs the model with `config.inference_loops = R`. The check: lm_eval's token
perplexity against loopformer's own `loopformer.text.perplexity.perplexity` on the same documents and windows
(equal up to float rounding), and against the split's perplexity as `loopformer perplexity` measures it (the split
as one stream in non-overlapping windows: documents share windows and the end-of-text tokens are scored, so it
differs a little). FLOPs per token: `loopformer.model.flops.forward_flops` at R loops over a window of the model's
context, divided by its length.

    DIR/results.json   the budgets, metrics per task and budget, FLOPs per token, the check, the baselines
    DIR/results.md     the same as a markdown table
    DIR/lm_eval.png    each task's metric against loops and against FLOPs per token
    DIR/tasks/         the task folders lm_eval read

Needs the extras `hf` and `lmeval` (`pip install 'loopformer[hf,lmeval]'`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
from pathlib import Path

import numpy as np

from loopformer.errors import UserError
from loopformer.fileio import check_owned_folder, write_figure, write_json, write_text
from loopformer.hf.model import LoopformerForCausalLM, hf_config
from loopformer.hf.tokenizer import fast_tokenizer
from loopformer.model.flops import forward_flops
from loopformer.model.io import load, read_config, resolve_checkpoint
from loopformer.text.commands import checkpoint_data_dir
from loopformer.text.dataset import TokenCorpus
from loopformer.text.perplexity import perplexity

PPL, NEXT_LINE = "loopformer_ppl", "loopformer_next_line"
TASKS = {"ppl": PPL, "next_line": NEXT_LINE}             # short name -> lm_eval task name
PRIMARY = {PPL: ("token_perplexity", "token perplexity"), NEXT_LINE: ("acc", "next-line accuracy")}
WRITTEN = ("results.json", "results.md", "lm_eval.png", "tasks")
MARKER = "loopformer_lm_eval"
CHOICES = 4                          # the next-line task's choices per item
CONTEXT_CHARS = 300                  # the next-line task's context: at most this many characters of whole lines
UTILS = '''"""process_results of the loopformer_ppl task (written by `loopformer lm-eval`): lm_eval's word and byte
perplexities and the perplexity per token of the model's tokenizer (the count stored with each document)."""
import re


def process_ppl(doc, results):
    (loglikelihood,) = results
    text = doc["text"]
    words = len(re.split(r"\\s+", text))
    nbytes = len(text.encode("utf-8"))
    return {"token_perplexity": (loglikelihood, doc["tokens"]), "word_perplexity": (loglikelihood, words),
            "byte_perplexity": (loglikelihood, nbytes), "bits_per_byte": (loglikelihood, nbytes)}
'''


def parse_tasks(text: str) -> list[str]:
    """"ppl,next_line" -> the lm_eval task names; a one-line UserError for an unknown name."""
    names = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name = TASKS.get(part, part)
        if name not in TASKS.values():
            raise UserError(f"--tasks: unknown task {part!r}; the local tasks are {', '.join(TASKS)} "
                            f"(other lm_eval tasks: run lm_eval on the exported folder, docs/ecosystem.md)")
        if name not in names:
            names.append(name)
    if not names:
        raise UserError("--tasks: give at least one task, e.g. ppl,next_line")
    return names


def documents(tokens: np.ndarray, eot: int) -> list[np.ndarray]:
    """The documents of a split: the token runs between end-of-text tokens (empty runs left out)."""
    out, start = [], 0
    for cut in [*np.flatnonzero(tokens == eot).tolist(), len(tokens)]:
        if cut > start:
            out.append(tokens[start:cut])
        start = cut + 1
    return out


def next_line_items(texts: list[str], n: int, seed: int) -> list[dict]:
    """`n` multiple-choice items from the documents' lines: a line of 20..100 characters (not a speaker's name
    ending in ':') after at least 100 characters of its document; context: the preceding whole lines, at most
    CONTEXT_CHARS characters; choices: the line and CHOICES - 1 other lines of the pool, in random order."""
    pool, spots = [], []
    for d, text in enumerate(texts):
        lines = text.split("\n")
        start = 0
        for i, line in enumerate(lines):
            body = line.strip()
            if 20 <= len(body) <= 100 and not body.endswith(":"):
                pool.append(line)
                if start >= 100:
                    spots.append((d, i))
            start += len(line) + 1
    if len(spots) < 1 or len(set(pool)) < CHOICES:
        raise UserError("the split has too few lines of 20..100 characters for the next-line task")
    rng = np.random.default_rng(seed)
    chosen = rng.choice(len(spots), size=min(n, len(spots)), replace=False)
    items = []
    for k in sorted(int(c) for c in chosen):
        d, i = spots[k]
        lines = texts[d].split("\n")
        context, j = "", i
        while j > 0 and len(lines[j - 1]) + 1 + len(context) <= CONTEXT_CHARS:
            context = lines[j - 1] + "\n" + context
            j -= 1
        answer = lines[i]
        others: list[str] = []
        while len(others) < CHOICES - 1:
            cand = pool[int(rng.integers(len(pool)))]
            if cand != answer and cand not in others:
                others.append(cand)
        label = int(rng.integers(CHOICES))
        choices = others[:label] + [answer] + others[label:]
        items.append({"context": context, "choices": choices, "label": label})
    return items


def _yaml(task: str, data: Path, body: str) -> str:
    return (f"# written by `loopformer lm-eval`; run with `lm_eval --include_path {data.parent} --tasks {task}`\n"
            f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data))}\n"
            f"test_split: test\n{body}metadata:\n  version: 1.0\n")


def write_tasks(folder: Path, texts: list[str], counts: list[int], items: int, seed: int) -> None:
    """The lm_eval task folder: the two tasks' YAML files, their data (JSON lines) and loopformer_tasks.py."""
    folder.mkdir(parents=True, exist_ok=True)
    folder = folder.resolve()
    ppl = folder / "ppl.jsonl"
    write_text(ppl, "".join(json.dumps({"text": t, "tokens": c}) + "\n" for t, c in zip(texts, counts)))
    write_text(folder / "loopformer_tasks.py", UTILS)
    metrics = "".join(f"  - metric: {m}\n    aggregation: {a}\n    higher_is_better: false\n" for m, a in (
        ("token_perplexity", "weighted_perplexity"), ("word_perplexity", "weighted_perplexity"),
        ("byte_perplexity", "weighted_perplexity"), ("bits_per_byte", "bits_per_byte")))
    write_text(folder / f"{PPL}.yaml", _yaml(PPL, ppl, (
        "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: text\n"
        "process_results: !function loopformer_tasks.process_ppl\nmetric_list:\n" + metrics)))
    cloze = folder / "next_line.jsonl"
    write_text(cloze, "".join(json.dumps(it) + "\n" for it in next_line_items(texts, items, seed)))
    write_text(folder / f"{NEXT_LINE}.yaml", _yaml(NEXT_LINE, cloze, (
        "output_type: multiple_choice\ndoc_to_text: context\ndoc_to_choice: choices\ndoc_to_target: label\n"
        "target_delimiter: \"\"\nmetric_list:\n"
        "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
        "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n")))


def check_out(out: str | Path) -> None:
    """A UserError unless `out` is missing, empty or a folder this command wrote (its results.json says so)."""
    hint = "choose a new folder for the evaluation"
    check_owned_folder(out, WRITTEN, "results.json", "lm-eval", hint=hint)
    res = Path(out) / "results.json"
    if res.is_file():
        try:
            ours = MARKER in json.loads(res.read_text())
        except (ValueError, OSError, TypeError):
            ours = False
        if not ours:
            raise UserError(f"{out} holds a results.json that lm-eval did not write; {hint}")


TQDM_USERS = ("lm_eval.models.huggingface", "lm_eval.api.model", "lm_eval.api.task", "lm_eval.models.utils")


@contextlib.contextmanager
def quiet():
    """lm_eval's, datasets' and transformers' logs at ERROR and their progress bars off for the block (lm_eval
    draws a bar per batch of windows; the command prints one line per loop budget instead)."""
    import importlib

    import datasets
    names = ("lm_eval", "datasets", "transformers", "evaluate", "accelerate")
    levels = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.ERROR)
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    patched = {}
    for name in TQDM_USERS:
        with contextlib.suppress(ImportError):
            mod = importlib.import_module(name)
            if hasattr(mod, "tqdm"):
                patched[mod] = mod.tqdm
                mod.tqdm = _silent(mod.tqdm)
    try:
        yield
    finally:
        for mod, bar in patched.items():
            mod.tqdm = bar
        for n, lvl in levels.items():
            logging.getLogger(n).setLevel(lvl)
        if bars:
            datasets.enable_progress_bars()


def _silent(bar):
    def silent(*args, **kwargs):
        kwargs["disable"] = True
        return bar(*args, **kwargs)
    return silent


def flops_per_token(cfg, loops: int, window: int) -> float:
    """FLOPs per token of a forward pass at `loops` loops over a window of `window` tokens."""
    return forward_flops(dataclasses.replace(cfg, loops=loops), window) / window


def docs_perplexity(model, docs: list[list[int]], eot: int, window: int, loops: int, batch_size: int) -> float:
    """loopformer's perplexity over each document scored from end-of-text in windows of `window` tokens (the
    windows lm_eval's loglikelihood_rolling uses), pooled over the documents' tokens."""
    total, count = 0.0, 0
    for doc in docs:
        seq = np.asarray([eot, *doc], dtype=np.int64)
        res = perplexity(model, seq, block_size=window, batch_size=batch_size, loops=loops, progress=False)
        total += res.nll * res.tokens
        count += res.tokens
    return math.exp(total / count)


class _Evaluator:
    """One model (a LoopformerForCausalLM) behind lm_eval's HFLM, evaluated at loop budgets."""

    def __init__(self, hf: LoopformerForCausalLM, tok, window: int, batch_size: int, tasks_dir: Path):
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
        self.hf = hf
        with quiet():
            self.lm = HFLM(pretrained=hf, tokenizer=tok, batch_size=batch_size, max_length=window)
            self.tm = TaskManager(include_path=str(tasks_dir), include_defaults=False)

    def __call__(self, tasks: list[str], loops: int, limit: int | None) -> dict[str, dict[str, float]]:
        from lm_eval import simple_evaluate
        self.hf.config.inference_loops = loops
        with quiet():
            out = simple_evaluate(model=self.lm, tasks=tasks, task_manager=self.tm, limit=limit, log_samples=False,
                                  bootstrap_iters=0, verbosity="ERROR")
        res = {}
        for task in tasks:
            got = out["results"][task]
            res[task] = {k.split(",")[0]: float(v) for k, v in got.items()
                         if k.endswith(",none") and isinstance(v, (int, float)) and "stderr" not in k}
        return res


def wrap(model, tokenizer) -> LoopformerForCausalLM:
    hf = LoopformerForCausalLM.from_loopformer(model, eos_token_id=tokenizer.eot_id, pad_token_id=tokenizer.eot_id)
    hf.config.use_cache = False          # lm_eval scores whole windows: no key/value cache
    return hf.eval()


def lm_eval_run(run: str | Path, out: str | Path, tasks: list[str], loops: list[int], *, data: str | None = None,
                split: str = "test", items: int = 200, seed: int = 0, batch_size: int = 16, limit: int | None = None,
                baselines: tuple[str, ...] = (), ema: bool = False, check: bool = True,
                progress=print) -> dict:
    """Evaluate the language model of `run` with lm_eval at each loop budget (module docstring); returns and writes
    the results."""
    ckpt = resolve_checkpoint(run)
    cfg, _ = read_config(ckpt)
    hf_config(cfg)                                  # refuses a model that is no causal language model
    check_out(out)
    corpus = data if data is not None else checkpoint_data_dir(str(ckpt))
    if corpus is None:
        raise UserError(f"cannot tell which corpus {ckpt} was trained on; pass --data DIR (a prepared corpus)")
    tc = TokenCorpus(corpus)
    if split not in tc.splits:
        raise UserError(f"{corpus} has no split {split!r} (it has {', '.join(tc.splits)})")
    tokenizer = tc.tokenizer()
    window = cfg.max_len
    tok = fast_tokenizer(tokenizer, window)
    out = Path(out)
    docs = documents(np.asarray(tc.tokens(split)), tokenizer.eot_id)
    texts = [tokenizer.decode(d.tolist()) for d in docs]
    encoded = [tok(t, add_special_tokens=False, verbose=False)["input_ids"] for t in texts]
    same = sum(list(e) == d.tolist() for e, d in zip(encoded, docs))
    write_tasks(out / "tasks", texts, [len(e) for e in encoded], items, seed)

    model = load(ckpt, ema=ema)
    hf = wrap(model, tokenizer)
    evaluator = _Evaluator(hf, tok, window, batch_size, out / "tasks")
    rows = []
    split_tokens = np.asarray(tc.tokens(split), dtype=np.int64)
    for R in loops:
        metrics = evaluator(tasks, R, limit)
        row = {"loops": R, "flops_per_token": flops_per_token(cfg, R, window), "metrics": metrics}
        if check and PPL in tasks and limit is None:
            lib = docs_perplexity(model, encoded, tokenizer.eot_id, window, R, batch_size)
            whole = perplexity(model, split_tokens, block_size=window, batch_size=batch_size, loops=R,
                               progress=False)
            got = metrics[PPL]["token_perplexity"]
            row["check"] = {"loopformer_docs_perplexity": lib, "rel_diff_docs": got / lib - 1,
                            "loopformer_split_perplexity": whole.ppl, "rel_diff_split": got / whole.ppl - 1}
        rows.append(row)
        progress(format_row(row, tasks))
    base = []
    for b in baselines:
        bckpt = resolve_checkpoint(b)
        bcfg, _ = read_config(bckpt)
        bmodel = load(bckpt)
        if bmodel.config.vocab_size < tokenizer.vocab_size or bcfg.max_len < window:
            raise UserError(f"the baseline {b} does not read the corpus of {run} at its context {window}")
        ev = _Evaluator(wrap(bmodel, tokenizer), tok, window, batch_size, out / "tasks")
        brow = {"run": str(b), "loops": bcfg.loops, "n_layers": bcfg.n_layers,
                "parameters": sum(p.numel() for p in bmodel.parameters()),
                "flops_per_token": flops_per_token(bcfg, bcfg.loops, window), "metrics": ev(tasks, bcfg.loops, limit)}
        base.append(brow)
        progress(f"baseline {b}: " + format_row(brow, tasks))
    result = {MARKER: {"run": str(run), "checkpoint": str(ckpt), "corpus": str(corpus), "split": split,
                       "documents": len(docs), "documents_same_tokens": same, "window": window, "items": items,
                       "seed": seed, "limit": limit, "ema": ema, "trained_loops": cfg.loops,
                       "parameters": sum(p.numel() for p in model.parameters())},
              "tasks": tasks, "budgets": rows, "baselines": base}
    write_json(out / "results.json", result)
    write_text(out / "results.md", markdown(result))
    plot(result, out / "lm_eval.png")
    return result


def _metric_columns(tasks: list[str]) -> list[tuple[str, str]]:
    cols = []
    for t in tasks:
        cols += [(t, "token_perplexity"), (t, "bits_per_byte")] if t == PPL else [(t, "acc"), (t, "acc_norm")]
    return cols


def format_row(row: dict, tasks: list[str]) -> str:
    parts = [f"loops {row['loops']}", f"{row['flops_per_token'] / 1e6:.3g} MFLOPs/token"]
    for t, m in _metric_columns(tasks):
        v = row["metrics"].get(t, {}).get(m)
        if v is not None:
            parts.append(f"{t.replace('loopformer_', '')} {m} {v:.4g}")
    if "check" in row:
        parts.append(f"loopformer perplexity {row['check']['loopformer_docs_perplexity']:.4g} "
                     f"({100 * row['check']['rel_diff_docs']:+.4f} %)")
    return ", ".join(parts)


def markdown(result: dict) -> str:
    tasks = result["tasks"]
    cols = _metric_columns(tasks)
    meta = result[MARKER]
    head = ["loops", "MFLOPs/token"] + [f"{t.replace('loopformer_', '')} {m}" for t, m in cols]
    checked = any("check" in r for r in result["budgets"])
    if checked:
        head += ["loopformer ppl (same docs)", "Δ", "loopformer ppl (split)", "Δ"]
    lines = [f"lm_eval on {meta['corpus']} ({meta['split']} split, {meta['documents']} documents, window "
             f"{meta['window']}) for {meta['run']} (trained at {meta['trained_loops']} loops, "
             f"{meta['parameters']:,} parameters)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def cells(r, name=None):
        c = [name or str(r["loops"]), f"{r['flops_per_token'] / 1e6:.3g}"]
        c += [f"{r['metrics'].get(t, {}).get(m, float('nan')):.4g}" for t, m in cols]
        if checked:
            ch = r.get("check")
            c += ([f"{ch['loopformer_docs_perplexity']:.4g}", f"{100 * ch['rel_diff_docs']:+.4f} %",
                   f"{ch['loopformer_split_perplexity']:.4g}", f"{100 * ch['rel_diff_split']:+.3f} %"]
                  if ch else [""] * 4)
        return "| " + " | ".join(c) + " |"
    lines += [cells(r) for r in result["budgets"]]
    lines += [cells(b, f"{b['loops']} ({os.path.basename(b['run'].rstrip('/'))}, {b['n_layers']} layers, "
                       f"{b['parameters']:,} parameters)") for b in result["baselines"]]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tasks = result["tasks"]
    fig, axes = plt.subplots(len(tasks), 2, figsize=(10, 3.6 * len(tasks)), squeeze=False)
    rows = result["budgets"]
    for i, task in enumerate(tasks):
        metric, label = PRIMARY[task]
        ys = [r["metrics"][task][metric] for r in rows]
        for j, (key, xlabel) in enumerate((("loops", "loops"), ("flops_per_token", "FLOPs per token"))):
            ax = axes[i][j]
            ax.plot([r[key] for r in rows], ys, "o-", label=f"looped ({result[MARKER]['trained_loops']} trained)")
            for b in result["baselines"]:
                ax.plot([b[key]], [b["metrics"][task][metric]], "*", markersize=12,
                        label=f"{os.path.basename(b['run'].rstrip('/'))} ({b['n_layers']} layers)")
            ax.set_xscale("log", base=2)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            if i == 0 and j == 0:
                ax.legend(fontsize=8)
    fig.suptitle(f"lm_eval: {os.path.basename(str(result[MARKER]['run']).rstrip('/'))}")
    fig.tight_layout()
    write_figure(fig, path)
    plt.close(fig)


__all__ = ["lm_eval_run", "parse_tasks", "documents", "next_line_items", "write_tasks", "docs_perplexity",
           "flops_per_token", "TASKS", "PPL", "NEXT_LINE"]
