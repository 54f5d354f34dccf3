"""Command-line front-end of the measurements on trained models:

    loopformer analyze dynamics RUN|CHECKPOINT [--out DIR] [--max-loops R] [-n ROWS]

prints the per-loop dynamics table (`loopformer.analysis.dynamics`) and writes dynamics.md / .json / .png;

    loopformer analyze continuity CKPT [CKPT ...] --data DIR [--out DIR] [--split val] [--samples 16]
                                  [--length 128] [--scales 1e-3,1e-2,1e-1,1] [--power-iters 20]
                                  [--loopwise-scale 1e-2]

prints the continuity table (paper Sec. 3.2 moduli, App. D continuity coefficients; `loopformer.analysis.continuity`)
and writes DIR/continuity.md, continuity.json and continuity.png: raw ratios ‖Δf‖/‖ΔX‖, scale-invariant ones
(relative to ‖f(X)‖ and ‖X‖, and after the final norm), per loop, with a TMLT model's gate magnitudes. Several
checkpoints (e.g. looped vs TMLT trained on the perturbed corpus) are measured on the same windows and shown side
by side.
"""

from __future__ import annotations

import os

from loopformer.analysis import continuity
from loopformer.analysis.dynamics import analyze_dynamics
from loopformer.commandline import add_device, add_group, add_quiet, add_rows
from loopformer.device import pick_device
from loopformer.errors import UserError
from loopformer.fileio import removed_on_failure
from loopformer.model.io import load
from loopformer.text.dataset import TokenCorpus


def register(subparsers) -> None:
    sub = add_group(subparsers, "analyze", "measurements on trained models", metavar="ANALYSIS")
    p = sub.add_parser("continuity", help="continuity coefficients of output vs input embeddings",
                       description="How far the output embeddings move per unit of input perturbation (Gaussian "
                                   "noise on the input embeddings, single-token substitutions, local Lipschitz "
                                   "constant), as a markdown table and a PNG plot.")
    p.add_argument("checkpoints", nargs="+", metavar="CKPT")
    p.add_argument("--data", required=True, metavar="DIR", help="a corpus made by `loopformer text prepare`")
    p.add_argument("--out", default="continuity_out", metavar="DIR", help="where the table, JSON and plot go")
    p.add_argument("--split", default="val")
    p.add_argument("--samples", type=int, default=16, help="windows measured")
    p.add_argument("--length", type=int, default=128, help="tokens per window (capped at the model's max_len)")
    p.add_argument("--scales", default="1e-3,1e-2,1e-1,1", help="relative noise scales, comma-separated")
    p.add_argument("--power-iters", type=int, default=20, help="power-iteration steps for ||J||_2 (0: skip)")
    p.add_argument("--loopwise-scale", type=float, default=1e-2,
                   help="relative noise scale of the scale-invariant and per-loop measures (default 1e-2)")
    p.add_argument("--moduli-samples", type=int, default=0,
                   help="also estimate the worst-case moduli (loopformer.theory.moduli) from this many random "
                        "pairs plus gradient ascent (0: skip)")
    p.add_argument("--output", choices=["hidden", "normed"], default="hidden",
                   help="output embeddings: the last residual stream (hidden) or after the final norm")
    p.add_argument("--loops", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    add_device(p)
    add_quiet(p)
    p.set_defaults(func=_continuity)
    q = sub.add_parser("dynamics", help="per-loop gates, update sizes, read-outs and settle loops of a model",
                       description="Whether the loop is used and the timestep modulation alive: per loop t the "
                                   "TMLT gates |γ| and scales |α|, the update size ||h_t - h_t-1|| / ||h_t-1||, "
                                   "the read-out's loss and accuracy and the settle loop of each test sample; for "
                                   "a run folder also the training-time gradient norms per parameter group. "
                                   "Writes dynamics.md, dynamics.json and PNG plots.")
    q.add_argument("path", metavar="RUN|CHECKPOINT")
    q.add_argument("--out", default=None, metavar="DIR", help="where the outputs go (default: PATH/dynamics)")
    q.add_argument("--max-loops", type=int, default=0, help="loops measured (0: twice the trained loops)")
    add_rows(q, 500, "test rows measured (0: all)")
    q.add_argument("--batch-size", type=int, default=250)
    add_device(q)
    q.set_defaults(func=_dynamics)


def _parse_scales(text: str) -> tuple[float, ...]:
    try:
        scales = tuple(float(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise UserError(f"--scales must be comma-separated numbers (got {text!r})") from None
    if not scales or any(s <= 0 for s in scales):
        raise UserError(f"--scales must be positive numbers (got {text!r})")
    return scales


def _names(paths: list[str]) -> list[str]:
    names = []
    for p in paths:
        norm = os.path.normpath(p)
        base = os.path.basename(norm) or p
        if base == "checkpoint":   # a run folder's checkpoint: name it after the run
            base = os.path.basename(os.path.dirname(norm)) or base
        name, k = base, 2
        while name in names:
            name, k = f"{base}#{k}", k + 1
        names.append(name)
    return names


def _continuity(args) -> int:
    for c in args.checkpoints:
        if not os.path.isdir(c):
            raise UserError(f"checkpoint not found: {c}")
    corpus = TokenCorpus(args.data)
    tokens = corpus.tokens(args.split)
    cfg = continuity.ContinuityConfig(samples=args.samples, length=args.length, scales=_parse_scales(args.scales),
                                      power_iters=args.power_iters, moduli_samples=args.moduli_samples,
                                      seed=args.seed, protect=corpus.eot_id, loopwise_scale=args.loopwise_scale)
    device = pick_device(args.device)
    reports = {}
    for name, path in zip(_names(args.checkpoints), args.checkpoints):
        model = load(path, device=device)
        if model.config.vocab_size < corpus.vocab_size:
            raise UserError(f"{path}: vocabulary {model.config.vocab_size} is smaller than the corpus's "
                            f"{corpus.vocab_size}; was it trained on {args.data}?")
        reports[name] = continuity.continuity_of_checkpoint(model, tokens, corpus.vocab_size, cfg,
                                                            loops=args.loops, output=args.output,
                                                            progress=not args.quiet)
    table = continuity.to_markdown(reports)
    print(table, end="")
    with removed_on_failure(args.out):          # interrupted while writing: no partial set of outputs
        os.makedirs(args.out, exist_ok=True)
        continuity.write_text(table, os.path.join(args.out, "continuity.md"))
        continuity.write_json(reports, os.path.join(args.out, "continuity.json"),
                              extra={"checkpoints": dict(zip(reports, args.checkpoints)), "data": args.data,
                                     "split": args.split, "output": args.output, "loops": args.loops,
                                     "seed": args.seed})
        continuity.plot(reports, os.path.join(args.out, "continuity.png"))
    print(f"wrote {os.path.join(args.out, 'continuity.md')}, continuity.json, continuity.png")
    return 0


def _dynamics(args) -> int:
    if args.max_loops < 0 or args.max_loops > 4096:
        raise UserError(f"max_loops must be between 0 and 4096 (got {args.max_loops})")
    out = args.out or os.path.join(args.path, "dynamics")
    with removed_on_failure(out):
        report = analyze_dynamics(args.path, out, max_loops=args.max_loops, limit=args.n,
                                  batch_size=args.batch_size, device=args.device)
    print(report["table"], end="")
    print(f"wrote {out}/dynamics.md, dynamics.json, dynamics_loops.png"
          + (", dynamics_train.png" if "training" in report else ""))
    return 0
