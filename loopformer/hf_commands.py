"""The `hf` commands (the Hugging Face stack; `loopformer.hf`):

    loopformer hf export RUN --out DIR [--data DIR] [--ema] [--loops N] [--halt RULE] [--quant int8]
    loopformer hf finetune RUN --out DIR [--rank 8 | --full] [--steps 200] [--lr LR] [--batch-size 16] [--seed 0]
    loopformer push RUN --repo ORG/NAME [--private] [--ema] [--loops N] [--halt RULE] [--quant int8]
    loopformer lm-eval RUN --out DIR [--tasks ppl,next_line] [--loops 1,2,4,8] [--baseline RUN] ...

This module imports neither transformers, lm_eval nor `loopformer.hf` until a command runs (the `loopformer`
command starts as fast without them), and names the extra to install where one is missing.
"""

from __future__ import annotations

import importlib.util

from loopformer.commandline import add_group, add_halt
from loopformer.errors import UserError

EXTRA = "pip install 'loopformer[hf]'"
LMEVAL_EXTRA = "pip install 'loopformer[hf,lmeval]'"
LORA_EXTRA = "pip install 'loopformer[hf,lora]'"


def register(subparsers) -> None:
    sub = add_group(subparsers, "hf",
                    "the Hugging Face stack: export a language model for transformers, fine-tune it with LoRA",
                    "Language models for the Hugging Face stack (transformers).")
    p = sub.add_parser(
        "export", help="write a run's language model as a transformers folder",
        description="Write the language model of RUN (a run folder or a checkpoint folder) as a folder that "
                    "AutoModelForCausalLM.from_pretrained(DIR) loads after `import loopformer.hf` (and with "
                    "trust_remote_code=True where loopformer is not installed), with the run's tokenizer for "
                    f"AutoTokenizer. Needs transformers ({EXTRA}). DIR must be new, empty or an earlier export.")
    p.add_argument("run", metavar="RUN")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--data", default=None, metavar="DIR",
                   help="the prepared corpus whose tokenizer to save (default: the one the run was trained on)")
    p.add_argument("--ema", action="store_true", help="export the averaged weights (ema.safetensors)")
    p.add_argument("--loops", type=int, default=None,
                   help="the loop count of a call that names none (default: the trained loops)")
    add_halt(p)
    p.add_argument("--no-memory-check", action="store_true",
                   help="skip the comparison of the model's estimated size with the free memory")
    p.add_argument("--quant", default=None, metavar="int8",
                   help="store the shared block's linear maps int8 weight-only (torchao: pip install "
                        "'loopformer[hf,quant]'); from_pretrained loads them quantized")
    p.set_defaults(func=_export)

    p = sub.add_parser(
        "finetune", help="fine-tune a language model with LoRA adapters on the shared block (or all weights)",
        description="Fine-tune the language model of RUN on its corpus's train split through the transformers "
                    "class: LoRA adapters (peft) on the shared block's linear maps, or every weight (--full). DIR "
                    "gets adapter/ (peft's files), checkpoint/ (the adapters merged: every loopformer command and "
                    "`hf export` read it) and finetune.json (trainable parameters, perplexity before and after). "
                    f"Needs transformers and peft ({LORA_EXTRA}).")
    p.add_argument("run", metavar="RUN", help="a run folder or a checkpoint folder of a causal language model")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank r (default 8)")
    p.add_argument("--alpha", type=float, default=None, help="LoRA scale α: the update is (α/r)·B·A (default 2r)")
    p.add_argument("--full", action="store_true", help="train every weight instead (the reference)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 1e-3 LoRA, 3e-4 --full)")
    p.add_argument("--seed", type=int, default=0, help="seed of the training windows")
    p.add_argument("--data", default=None, metavar="DIR",
                   help="the prepared corpus to train on (default: the one the run was trained on)")
    p.add_argument("--split", default="test", help="the split whose perplexity is measured before and after")
    p.set_defaults(func=_finetune)

    p = subparsers.add_parser(
        "push", help="upload a language model to the Hugging Face Hub with its model card",
        description="Export the language model of RUN as `hf export` does (weights, tokenizer, remote code, the model "
                    "card README.md with the loop profile) and upload it as one commit to the Hub model repository "
                    "ORG/NAME (created if missing) with huggingface_hub; log in first (`hf auth login` or HF_TOKEN). "
                    "loopformer.load('hf:ORG/NAME') loads it back. Needs transformers "
                    f"({EXTRA}).")
    p.add_argument("run", metavar="RUN")
    p.add_argument("--repo", required=True, metavar="ORG/NAME")
    p.add_argument("--private", action="store_true", help="create the repository private")
    p.add_argument("--ema", action="store_true", help="push the averaged weights (ema.safetensors)")
    p.add_argument("--loops", type=int, default=None,
                   help="the loop count of a call that names none (default: the trained loops)")
    add_halt(p)
    p.add_argument("--quant", default=None, metavar="int8",
                   help="store the shared block int8 weight-only (torchao: pip install 'loopformer[hf,quant]')")
    p.set_defaults(func=_push)

    p = subparsers.add_parser(
        "lm-eval", help="evaluate a language model with lm-evaluation-harness at several loop budgets",
        description="Evaluate the language model of RUN with lm-evaluation-harness (lm_eval), offline, through the "
                    "transformers class, on tasks built from its corpus (ppl: perplexity over the documents of a "
                    "split; next_line: a four-way next-line cloze), at each loop budget of --loops; writes "
                    "DIR/results.json, DIR/results.md, DIR/lm_eval.png (score against loops and FLOPs per token) "
                    f"and the lm_eval task folders DIR/tasks. Needs transformers and lm_eval ({LMEVAL_EXTRA}).")
    p.add_argument("run", metavar="RUN", help="a run folder or a checkpoint folder of a causal language model")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--tasks", default="ppl,next_line", help="comma-separated: ppl, next_line (default both)")
    p.add_argument("--loops", default=None, metavar="LIST",
                   help="loop budgets, comma-separated, e.g. 1,2,4,8 (default: 1, r/2, r, 2r)")
    p.add_argument("--data", default=None, metavar="DIR",
                   help="the prepared corpus to build the tasks from (default: the one the run was trained on)")
    p.add_argument("--split", default="test", help="the corpus split (default test)")
    p.add_argument("--items", type=int, default=200, help="next_line: the number of items (default 200)")
    p.add_argument("--seed", type=int, default=0, help="next_line: the seed of the items' draw (default 0)")
    p.add_argument("--limit", type=int, default=None,
                   help="only the first N documents or items of each task (and no perplexity check)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--baseline", action="append", default=[], metavar="RUN",
                   help="also evaluate this run (e.g. a standard transformer) at its trained loops (repeatable)")
    p.add_argument("--ema", action="store_true", help="evaluate the averaged weights (ema.safetensors)")
    p.add_argument("--no-check", action="store_true",
                   help="skip loopformer's own perplexity beside lm_eval's (the agreement check)")
    p.set_defaults(func=_lm_eval)


def _export(args) -> int:
    if importlib.util.find_spec("transformers") is None:
        raise UserError(f"hf export needs transformers, which is not installed: {EXTRA}")
    try:
        from loopformer.hf.export import export
    except ImportError as exc:              # a transformers outside the supported versions
        raise UserError(" ".join(str(exc).split())) from None
    done = export(args.run, args.out, data=args.data, ema=args.ema, loops=args.loops, halt=args.halt,
                  memory_check=not args.no_memory_check, quant=args.quant)
    print(f"wrote {done.folder}: AutoModelForCausalLM.from_pretrained after `import loopformer.hf`"
          + (", or with trust_remote_code=True without loopformer" if done.remote_code is None else
             f"; no remote code (the self-contained modelling file does not run {done.remote_code})"))
    return 0


def _need(module: str, what: str, hint: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise UserError(f"{what} needs {module}, which is not installed: {hint}")


def _push(args) -> int:
    _need("transformers", "push", EXTRA)
    try:
        from loopformer.hf.hub import check_repo, push
    except ImportError as exc:              # a transformers outside the supported versions
        raise UserError(" ".join(str(exc).split())) from None
    check_repo(args.repo)
    url = push(args.run, args.repo, private=args.private, ema=args.ema, loops=args.loops, halt=args.halt,
               quant=args.quant)
    print(f"pushed {args.run} to {args.repo}: {url}")
    return 0


def _finetune(args) -> int:
    _need("transformers", "hf finetune", LORA_EXTRA)
    if not args.full:
        _need("peft", "hf finetune", LORA_EXTRA)
    try:
        from loopformer.hf.finetune import finetune
    except ImportError as exc:              # a transformers outside the supported versions
        raise UserError(" ".join(str(exc).split())) from None
    res = finetune(args.run, args.out, rank=args.rank, alpha=args.alpha, full=args.full, steps=args.steps,
                   batch_size=args.batch_size, lr=args.lr, seed=args.seed, data=args.data, split=args.split)
    print(f"wrote {args.out}: {res['method']}, {res['trainable_parameters']:,} of {res['model_parameters']:,} "
          f"parameters trained; {res['split']} perplexity {res['perplexity_before']:.4g} -> "
          f"{res['perplexity_after']:.4g}")
    return 0


def _lm_eval(args) -> int:
    _need("transformers", "lm-eval", LMEVAL_EXTRA)
    _need("lm_eval", "lm-eval", LMEVAL_EXTRA)
    try:
        from loopformer.hf import lmeval
    except ImportError as exc:              # a transformers outside the supported versions
        raise UserError(" ".join(str(exc).split())) from None
    from loopformer.eval.budgets import parse_budgets
    from loopformer.model.io import read_config, resolve_checkpoint
    tasks = lmeval.parse_tasks(args.tasks)
    cfg, _ = read_config(resolve_checkpoint(args.run))
    r = cfg.loops
    loops = parse_budgets(args.loops if args.loops is not None else f"1,{max(1, r // 2)},{r},{2 * r}", r)
    for flag, value in (("--items", args.items), ("--batch-size", args.batch_size), ("--limit", args.limit)):
        if value is not None and value < 1:
            raise UserError(f"{flag} must be at least 1 (got {value})")
    lmeval.lm_eval_run(args.run, args.out, tasks, loops, data=args.data, split=args.split, items=args.items,
                       seed=args.seed, batch_size=args.batch_size, limit=args.limit, baselines=tuple(args.baseline),
                       ema=args.ema, check=not args.no_check)
    print(f"wrote {args.out}/results.json, results.md, lm_eval.png (lm_eval tasks in {args.out}/tasks)")
    return 0


__all__ = ["register"]
