"""Command-line front-end of the language-modelling code (paper App. C.3):

    loopformer text prepare {wikitext103,plays,plays:NAME,...,hf:NAME[:CONFIG][@REV],FILE_OR_DIR} --out DIR
                            [--tokenizer gpt2|bpe] [--vocab-size N] [--perturb 0.1] [--seed S]
                            [--text-column COL] [--force]
    loopformer [text] perplexity CKPT --data DIR [--split val] [--stride S] [--halt RULE] [--estimate]
                                 (`loopformer.eval.text_commands`: through the evaluation)
    loopformer [text] generate CKPT --prompt TEXT [--prompt TEXT ...] [--max-new-tokens N] [--temperature T]
                               [--top-k K] [--top-p P] [--seed S]
"""

from __future__ import annotations

import os
import sys

from loopformer.commandline import add_device, add_group, add_halt, add_quiet
from loopformer.device import pick_device
from loopformer.errors import UserError
from loopformer.model.io import load, read_config, resolve_checkpoint
from loopformer.text.corpus import PrepareOptions, prepare_corpus
from loopformer.text.dataset import TokenCorpus
from loopformer.text.generate import SamplingConfig, generate_text


def register(subparsers) -> None:
    sub = add_group(subparsers, "text", "language-modelling corpora, perplexity and sampling",
                    "Language-modelling corpora, perplexity and sampling.")
    p = sub.add_parser(
        "prepare", help="tokenise a corpus into train/val/test token files",
        description="Tokenise a corpus into DIR/{train,val,test}.bin with a manifest (re-running is a no-op). "
                    "SOURCE: wikitext103 (needs `pip install loopformer[text]`), plays (the Shakespeare plays "
                    "shipped offline; plays:macbeth,hamlet for some), hf:NAME[:CONFIG][@REVISION] (a Hugging Face "
                    "dataset, streamed; needs `pip install loopformer[text]`), or a text file / folder. Memory "
                    "stays bounded whatever the corpus size.")
    p.add_argument("source", metavar="SOURCE")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--tokenizer", choices=["gpt2", "bpe"], default=None,
                   help="gpt2: GPT-2 BPE via tiktoken (default for wikitext103); bpe: byte-level BPE trained on "
                        "the train split (default otherwise)")
    p.add_argument("--vocab-size", type=int, default=8192, help="bpe vocabulary size (default 8192)")
    p.add_argument("--perturb", type=float, default=0.0, metavar="RATE",
                   help="replace this fraction of tokens at random (App. D: 0.1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the perturbation")
    p.add_argument("--val-fraction", type=float, default=0.05,
                   help="file sources: share of each document for val; hf: share of train rows carved out for val "
                        "when the dataset has no validation split")
    p.add_argument("--test-fraction", type=float, default=0.05, help="file sources: share for test (hf: likewise)")
    p.add_argument("--text-column", default=None, metavar="COL",
                   help="hf: sources: the column holding the text (default: text)")
    p.add_argument("--force", action="store_true", help="rebuild even if DIR holds a different corpus")
    add_quiet(p)
    p.set_defaults(func=_prepare)
    # `generate` is a text action, also reachable without `text` (the spelling scripts use); so is `perplexity`,
    # which runs through the evaluation (`loopformer.eval.text_commands`)
    for parent, help_suffix in ((sub, ""), (subparsers, " (also `text generate`)")):
        _generate_parser(parent, help_suffix)


def _generate_parser(parent, help_suffix: str) -> None:
    p = parent.add_parser("generate", help="sample text from a checkpoint" + help_suffix,
                          description="Continue one or more prompts (batched, key/value cache per loop).")
    p.add_argument("checkpoint", metavar="CKPT")
    p.add_argument("--prompt", action="append", required=True, metavar="TEXT", help="repeat for a batch")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0, help="0 for greedy decoding")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loops", type=int, default=None)
    p.add_argument("--data", default=None, metavar="DIR",
                   help="the prepared corpus whose tokenizer to use (default: the one the checkpoint was trained on)")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence for every token")
    p.add_argument("--no-memory-check", action="store_true",
                   help="skip the comparison of the model's and the cache's estimated size with the free memory")
    add_halt(p)
    p.add_argument("--schedule", choices=["depthwise", "step"], default="depthwise",
                   help="with --halt and several prompts: each prompt at a loop of its own (depthwise) or all "
                        "advancing token by token (step); the same tokens under greedy decoding")
    p.add_argument("--compile", action="store_true",
                   help="with the depthwise schedule: compile its tick (torch.compile; seconds to compile, "
                        "repaid over long outputs; a C++ compiler on a CPU)")
    add_device(p)
    p.set_defaults(func=_generate)


def _prepare(args) -> int:
    opts = PrepareOptions(tokenizer=args.tokenizer or "auto", vocab_size=args.vocab_size,
                          val_fraction=args.val_fraction, test_fraction=args.test_fraction,
                          perturb=args.perturb, seed=args.seed, text_column=args.text_column)
    prepare_corpus(args.source, args.out, opts, force=args.force, progress=not args.quiet)
    return 0


def checkpoint_data_dir(path: str) -> str | None:
    """The corpus folder a text checkpoint was trained on (recorded under "task" in its config.json)."""
    _, extra = read_config(path)
    task = extra.get("task") or {}
    d = task.get("data_dir") if isinstance(task, dict) else None
    return d if d and os.path.isfile(os.path.join(d, "manifest.json")) else None


def _generate(args) -> int:
    cfg = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                         top_p=args.top_p, seed=args.seed, loops=args.loops, halt=args.halt,
                         schedule=args.schedule, compile=args.compile)
    device = pick_device(args.device)
    if not os.path.isdir(args.checkpoint):
        raise UserError(f"checkpoint not found: {args.checkpoint}")
    args.checkpoint = str(resolve_checkpoint(args.checkpoint))        # a run folder names its checkpoint
    data = args.data or checkpoint_data_dir(args.checkpoint)
    if data is None:
        raise UserError("cannot tell which tokenizer this checkpoint uses; pass --data DIR (its prepared corpus)")
    tokenizer = TokenCorpus(data).tokenizer()
    model = load(args.checkpoint, device=device, memory_check=not args.no_memory_check)
    texts = generate_text(model, tokenizer, args.prompt, cfg, use_cache=not args.no_cache,
                          memory_check=not args.no_memory_check)
    for prompt, text in zip(args.prompt, texts):
        if len(args.prompt) > 1:
            print(f"--- {prompt!r}")
        sys.stdout.write(prompt + text + "\n")
    return 0


__all__ = ["register", "checkpoint_data_dir"]
