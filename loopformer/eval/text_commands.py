"""The `loopformer [text] perplexity` command (paper App. C.3): a checkpoint's perplexity over every token of a
split, in non-overlapping or strided windows (`loopformer.sources.text.SplitWindows`), through the evaluation
every other source takes (`loopformer.eval.run.evaluate_all`) — so `--halt RULE` compares adaptive depth with
fixed depth on those windows, as `eval --halt` does on a run's test split — and, with `--estimate`, the authors'
random-batch estimate, labelled (`loopformer.text.perplexity.estimate_perplexity`).

    loopformer [text] perplexity CKPT --data DIR [--split val] [--stride S] [--halt RULE ...] [--estimate]
"""

from __future__ import annotations

import argparse

from loopformer.commandline import HALT_HELP, add_device, add_group, add_quiet
from loopformer.device import pick_device
from loopformer.errors import UserError
from loopformer.eval.config import EvalConfig
from loopformer.eval.evaluate import check_eval_args
from loopformer.eval.halting import format_halting
from loopformer.eval.run import evaluate_all
from loopformer.fileio import write_json
from loopformer.model.io import load
from loopformer.model.memory import check_loops
from loopformer.sources.text import SplitWindows
from loopformer.text.dataset import TokenCorpus
from loopformer.text.perplexity import PerplexityResult, estimate_perplexity


def register(subparsers) -> None:
    # an action of the `text` group, also reachable without `text` (the spelling scripts use)
    text = add_group(subparsers, "text", "language-modelling corpora, perplexity and sampling",
                     "Language-modelling corpora, perplexity and sampling.")
    for parent, help_suffix in ((text, ""), (subparsers, " (also `text perplexity`)")):
        _perplexity_parser(parent, help_suffix)


def _perplexity_parser(parent, help_suffix: str) -> None:
    p = parent.add_parser(
        "perplexity", help="perplexity of a checkpoint over a whole split" + help_suffix,
        description="Perplexity over every token of a split, in non-overlapping windows (default) or strided "
                    "sliding windows (--stride); --halt adds adaptive depth on the same windows next to fixed "
                    "depth; --estimate adds the authors' random-batch estimate, labelled.")
    p.add_argument("checkpoint", metavar="CKPT")
    p.add_argument("--data", required=True, metavar="DIR", help="a corpus made by `loopformer text prepare`")
    p.add_argument("--split", default="val")
    p.add_argument("--stride", type=int, default=None, help="window advance (default: the block size)")
    p.add_argument("--block-size", type=int, default=None, help="window length (default: the model's max_len)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--loops", type=int, default=None,
                   help="loops at inference (default: the trained r, times the supervision steps)")
    p.add_argument("--halt", action="append", metavar="RULE",
                   help=HALT_HELP + " (repeat to compare rules); each token's perplexity at its exit loop")
    p.add_argument("--estimate", action="store_true", help="also the authors' estimate (random batches)")
    p.add_argument("--estimate-iters", type=int, default=200)
    p.add_argument("--seed", type=int, default=0, help="seed of the estimate's batches")
    add_device(p)
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    add_quiet(p)
    p.set_defaults(func=cmd_perplexity)


def perplexity_config(args: argparse.Namespace) -> EvalConfig:
    """The evaluation the `perplexity` flags ask for: the metrics at --loops only (no loop-wise curve), and the
    --halt rules next to fixed depth."""
    check_eval_args(None, None, args.batch_size)
    if args.loops is not None and args.loops < 1:
        check_loops(args.loops, 0, "loops")
    try:                              # EvalConfig parses the halting rules (once)
        return EvalConfig(batch_size=args.batch_size, loops=args.loops or 0, loopwise=False,
                          halt=list(args.halt or []), drift=False)
    except ValueError as exc:
        raise UserError(str(exc)) from None


def _check_vocab(model, corpus) -> None:
    if model.config.vocab_size < corpus.vocab_size:
        raise UserError(f"the model's vocabulary ({model.config.vocab_size}) is smaller than the corpus's "
                        f"({corpus.vocab_size}); was it trained on this corpus?")


def cmd_perplexity(args: argparse.Namespace) -> int:
    cfg = perplexity_config(args)
    device = pick_device(args.device)
    corpus = TokenCorpus(args.data)
    tokens = corpus.tokens(args.split)
    model = load(args.checkpoint, device=device)
    _check_vocab(model, corpus)
    T = args.block_size or model.config.max_len
    if T > model.config.max_len and model.config.pos == "learned":
        raise UserError(f"--block-size {T} exceeds the model's max_len {model.config.max_len}")
    data = SplitWindows(corpus, args.split, T, args.stride)
    found = evaluate_all(model, data, cfg, device=device, progress=not args.quiet)
    m = found["metrics"]
    res = PerplexityResult(method=m["method"], nll=float(m["loss"]), ppl=float(m["ppl"]), tokens=m["tokens"],
                           windows=m["windows"], block_size=m["block_size"], stride=m["stride"],
                           min_context=m["min_context"], description=m["ppl_over"])
    results = {"split": args.split, "data": args.data, "checkpoint": args.checkpoint, "perplexity": res.to_dict()}
    print(f"{args.split} perplexity {res.ppl:.3f}  (nll {res.nll:.4f} nats/token; {res.description})")
    if "halting" in found:
        results["halting"] = found["halting"]
        print(f"\nadaptive depth (at most {found['halting']['loops']} loops; loops per scored token):")
        print(format_halting(found["halting"]))
    if args.estimate:
        est = estimate_perplexity(model, tokens, T, args.batch_size, args.estimate_iters, args.seed,
                                  loops=found["loops"], progress=not args.quiet)
        results["estimate"] = est.to_dict()
        print(f"{args.split} estimate   {est.ppl:.3f}  (nll {est.nll:.4f}; {est.description})")
    if args.json:
        write_json(args.json, results)
    return 0


__all__ = ["register", "cmd_perplexity", "perplexity_config"]
