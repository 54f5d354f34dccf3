"""`loopformer theory verify`, `theory rate` and `theory modulus` (paper Sec. 3–4, App. A–B made executable).

    loopformer theory modulus --target default|identity|sum|pkg.module:function --delta 0.1 [--kind all] [--N 2]
    loopformer theory modulus --checkpoint DIR --N 8 --delta 0.5          # a trained model, input → output embeddings
    loopformer theory rate --out DIR [--target pkg.module:function]
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from loopformer.commandline import add_group, add_quiet
from loopformer.errors import UserError
from loopformer.fileio import removed_on_failure, write_json, write_text
from loopformer.model.memory import available_bytes
from loopformer.theory.moduli import KINDS, estimate_modulus
from loopformer.theory.rate import rate_experiment, write_rate
from loopformer.theory.targets import check_target, checkpoint_target, load_target
from loopformer.theory.verify import SECTIONS, format_table, run_verify


def _ints(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"expected a comma-separated list of integers, got {text!r}") from None
    if not vals or any(v < 2 for v in vals):
        raise UserError(f"δ^-1 values must be integers >= 2 (got {text!r})")
    return vals


def _verify(args: argparse.Namespace) -> int:
    names = [s[0] for s in SECTIONS]
    if args.section:
        unknown = [s for s in args.section if s not in names]
        if unknown:
            raise UserError(f"unknown section {unknown[0]!r}; choose from: {', '.join(names)}")
    rows = run_verify(args.section or None, progress=not args.quiet)
    table = format_table(rows)
    print(table)
    failed = [r for r in rows if not r.passed]
    print(f"\n{len(rows) - len(failed)}/{len(rows)} cases as expected"
          + ("" if not failed else f"; {len(failed)} FAILED"), file=sys.stderr)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        write_text(args.out, table + "\n")
    return 1 if failed else 0


MAX_RATE_LOOPS = 100_000        # the most loops of a network `theory rate` builds (δ^-1 + N + 2δ^-(N+1)d)
MAX_RATE_CELLS = 1_000_000      # the most input cells (δ^-dN) it evaluates exactly
MAX_RATE_VALUES = 10 ** 8       # the most Monte Carlo input values (samples × d × N)


def check_rate_size(deltas: list[int], N: int, d: int, samples: int) -> None:
    """One-line UserErrors, before anything is built, for a `theory rate` out of reach: its networks' loops, the
    cells evaluated exactly, the Monte Carlo values (the exponents are checked on a log scale first, so that a huge
    d or N is refused without computing δ^-(N+1)d)."""
    for m in deltas:
        if (N + 1) * d * math.log2(m) > 40 or m + N + 2 * m ** ((N + 1) * d) > MAX_RATE_LOOPS:
            raise UserError(f"theory rate at δ^-1 = {m}, N = {N}, d = {d} would build a network of δ^-1 + N + "
                            f"2δ^-(N+1)d loops, more than {MAX_RATE_LOOPS:,}; lower --deltas, --N or --d")
        if d * N * math.log2(m) > 40 or m ** (d * N) > MAX_RATE_CELLS:
            raise UserError(f"theory rate at δ^-1 = {m}, N = {N}, d = {d} would evaluate δ^-dN cells exactly, more "
                            f"than {MAX_RATE_CELLS:,}; lower --deltas, --N or --d")
    if samples * d * N > MAX_RATE_VALUES:
        raise UserError(f"theory rate would draw {samples:,} samples of {d}×{N} inputs, more than "
                        f"{MAX_RATE_VALUES:,} values; lower --samples")


def _rate(args: argparse.Namespace) -> int:
    if args.N < 1 or args.d < 1:
        raise UserError("N and d must be >= 1")
    deltas = _ints(args.deltas)
    if args.samples < 1:
        raise UserError("--samples must be >= 1")
    check_rate_size(deltas, args.N, args.d, args.samples)
    if any(m ** args.d < args.N for m in deltas):
        raise UserError(f"every δ^-1 needs δ^-d >= N = {args.N} distinct token cells")
    if not args.p >= 1:
        raise UserError(f"--p must be >= 1 (got {args.p})")
    f = load_target(args.target)
    check_target(f, args.d, args.N, f"target {args.target!r}")
    points = rate_experiment(deltas, args.N, args.d, f=f, p=args.p, samples=args.samples, seed=args.seed,
                             progress=not args.quiet)
    with removed_on_failure(args.out):
        csv_path, png_path = write_rate(points, args.out)
    print("| δ⁻¹ | loops r | bits | L^p error (distinct) | L^p error (all) | bound (δ=1/δ⁻¹) | δ(r) | bound at δ(r) |")
    print("|---|---|---|---|---|---|---|---|")
    for pt in points:
        print(f"| {pt.delta_inv} | {pt.loops} | {pt.max_bits} | {pt.lp_error_distinct:.4f} | {pt.lp_error_all:.4f} | "
              f"{pt.bound:.4f} | {pt.delta_r:.4f} | {pt.bound_r:.4f} |")
    print(f"wrote {csv_path} and {png_path}", file=sys.stderr)
    return 0


MAX_MODULUS_VALUES = 10 ** 10    # the most input values (samples × d × N) one `theory modulus` draws


def check_modulus_size(N: int, d: int, samples: int, restarts: int) -> None:
    """One-line UserErrors, before anything is drawn, for a `theory modulus` whose work (samples × d × N values) or
    memory (a batch of up to 1,024 pairs and the kept restarts, float64) is out of reach."""
    values = samples * d * N
    if values > MAX_MODULUS_VALUES:
        raise UserError(f"theory modulus would draw {samples:,} pairs of {d}×{N} inputs ({values:,} values, about "
                        f"{16 * values / 2**30:,.0f} GiB of float64 in all), more than {MAX_MODULUS_VALUES:,}; "
                        f"lower --samples, N or d")
    need = 8 * 8 * min(samples, 1024) * d * N + 2 * 8 * restarts * -(-samples // 1024) * d * N
    if need > available_bytes("cpu"):
        raise UserError(f"theory modulus needs about {need / 2**30:,.1f} GiB but {available_bytes('cpu') / 2**30:,.1f} "
                        f"GiB are available; lower --samples, --restarts, N or d")


def _modulus(args: argparse.Namespace) -> int:
    kinds = list(KINDS) if args.kind == "all" else [args.kind]
    if args.N < 1 or args.d < 1:
        raise UserError("N and d must be >= 1")
    if not (args.delta > 0 and math.isfinite(args.delta)):
        raise UserError(f"--delta must be a positive number (got {args.delta})")
    if not args.p >= 1:
        raise UserError(f"--p must be >= 1 (got {args.p})")
    if args.samples < 1 or args.steps < 0 or args.restarts < 1:
        raise UserError("--samples and --restarts must be >= 1, --steps >= 0")
    if args.checkpoint:
        if args.target is not None:
            raise UserError("give either --target or --checkpoint, not both")
        f, d, lo, hi = checkpoint_target(args.checkpoint, args.N, args.loops)
        check_modulus_size(args.N, d, args.samples, args.restarts)
        name = f"checkpoint {args.checkpoint}"
    else:
        spec = args.target or "default"
        f, d = load_target(spec), args.d
        lo, hi = 0.0, 1.0
        name = f"target {spec!r}"
        check_modulus_size(args.N, d, args.samples, args.restarts)     # before the target is tried
        check_target(f, d, args.N, name)
    lo = lo if args.lo is None else args.lo
    hi = hi if args.hi is None else args.hi
    if not lo < hi:
        raise UserError(f"the box needs lo < hi (got lo={lo}, hi={hi})")
    rows, found = [], {}
    for kind in kinds:
        est = estimate_modulus(f, args.delta, kind, d, args.N, args.p, samples=args.samples, steps=args.steps,
                               restarts=args.restarts, seed=args.seed, lo=lo, hi=hi, batch=min(args.samples, 1024))
        found[kind] = est
        rows.append(f"| {kind} | {args.delta:g} | {est.value:.6g} | {est.value / args.delta:.6g} | {est.evaluations} |")
    print(f"Moduli of continuity of {name} (d={d}, N={args.N}, p={args.p:g}, box [{lo:.4g}, {hi:.4g}]); every "
          "value is attained by a feasible pair, so it is a lower bound of the supremum:")
    print("| modulus | δ | ω(δ) ≥ | ω(δ)/δ | evaluations |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))
    if args.out:
        data = {"target": name, "d": d, "N": args.N, "p": args.p, "lo": lo, "hi": hi, "delta": args.delta,
                "moduli": {k: {"value": e.value, "evaluations": e.evaluations, "n": e.n, "X": e.X.tolist(),
                               "X_prime": e.Xp.tolist()} for k, e in found.items()}}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        write_json(args.out, data)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def register(subparsers) -> None:
    sub = add_group(subparsers, "theory", "run the paper's constructions exactly; the approximation-rate bound")
    v = sub.add_parser("verify", help="every construction on a table of cases, as printed and repaired")
    v.add_argument("--section", action="append", help="run only this section (repeatable), e.g. 'Lemma A.9'")
    v.add_argument("--out", help="also write the markdown table to this file")
    add_quiet(v)
    v.set_defaults(func=_verify)
    r = sub.add_parser("rate", help="Theorem 3.6: measured L^p error and bound against loops (PNG + CSV)")
    r.add_argument("--out", required=True, help="output directory for rate.csv and rate.png")
    r.add_argument("--deltas", default="2,3,4", help="comma-separated δ^-1 values (default 2,3,4)")
    r.add_argument("--N", type=int, default=2, help="sequence length N (default 2)")
    r.add_argument("--d", type=int, default=1, help="token dimension d (default 1)")
    r.add_argument("--p", type=float, default=2.0, help="the p of the L^p error (default 2)")
    r.add_argument("--samples", type=int, default=20000, help="Monte Carlo samples (default 20000)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--target", default="default",
                   help="the function f to approximate: default (sin(2x_n + Σx)/2), identity, sum, or "
                        "package.module:function mapping an array [..., d, N] to the same shape")
    add_quiet(r)
    r.set_defaults(func=_rate)
    m = sub.add_parser("modulus", help="Definitions 3.3–3.5: lower-bound the moduli of continuity of a target or "
                                       "a trained checkpoint")
    m.add_argument("--target", default=None,
                   help="default, identity, sum, or package.module:function mapping [..., d, N] to the same shape "
                        "(numpy; torch too for gradient ascent), or package.module:factory(key=value, ...) returning "
                        "one; default: default")
    m.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="a trained model instead: input embeddings [D, N] -> the residual stream after the last loop")
    m.add_argument("--kind", default="all", choices=["all", "seq", "cont", "tok"],
                   help="sequence (Def. 3.3), contextual (3.4), token (3.5) or all (default)")
    m.add_argument("--delta", type=float, required=True, help="the radius δ")
    m.add_argument("--N", type=int, default=2, help="sequence length N (default 2)")
    m.add_argument("--d", type=int, default=1, help="token dimension d (default 1; a checkpoint sets its width)")
    m.add_argument("--p", type=float, default=2.0, help="the p of the output norm (default 2)")
    m.add_argument("--lo", type=float, default=None, help="box lower edge (default 0, or the embeddings' minimum)")
    m.add_argument("--hi", type=float, default=None, help="box upper edge (default 1, or the embeddings' maximum)")
    m.add_argument("--loops", type=int, default=None, help="a checkpoint's loop count (default: as trained)")
    m.add_argument("--samples", type=int, default=4096, help="random feasible pairs (default 4096)")
    m.add_argument("--steps", type=int, default=200, help="projected gradient-ascent steps (default 200)")
    m.add_argument("--restarts", type=int, default=16, help="best pairs refined by gradient ascent (default 16)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--out", default=None, help="also write the estimates and attaining pairs as JSON")
    m.set_defaults(func=_modulus)
