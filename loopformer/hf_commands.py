"""The `hf` commands (the Hugging Face stack; `loopformer.hf`):

    loopformer hf export RUN --out DIR [--data DIR] [--ema] [--loops N] [--halt RULE]

This module imports neither transformers nor `loopformer.hf` until a command runs (the `loopformer` command starts
as fast without them), and names the extra to install where transformers is missing.
"""

from __future__ import annotations

import importlib.util

from loopformer.commandline import add_group, add_halt
from loopformer.errors import UserError

EXTRA = "pip install 'loopformer[hf]'"


def register(subparsers) -> None:
    sub = add_group(subparsers, "hf", "the Hugging Face stack: export a language model for transformers",
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
    p.set_defaults(func=_export)


def _export(args) -> int:
    if importlib.util.find_spec("transformers") is None:
        raise UserError(f"hf export needs transformers, which is not installed: {EXTRA}")
    try:
        from loopformer.hf.export import export
    except ImportError as exc:              # a transformers outside the supported versions
        raise UserError(" ".join(str(exc).split())) from None
    done = export(args.run, args.out, data=args.data, ema=args.ema, loops=args.loops, halt=args.halt,
                  memory_check=not args.no_memory_check)
    print(f"wrote {done.folder}: AutoModelForCausalLM.from_pretrained after `import loopformer.hf`"
          + (", or with trust_remote_code=True without loopformer" if done.remote_code is None else
             f"; no remote code (the self-contained modelling file does not run {done.remote_code})"))
    return 0


__all__ = ["register"]
