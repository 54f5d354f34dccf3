"""`loopformer theory verify` and `loopformer theory rate` (paper Sec. 3–4, App. A–B made executable)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from loopformer.errors import UserError


def _ints(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"expected a comma-separated list of integers, got {text!r}") from None
    if not vals or any(v < 2 for v in vals):
        raise UserError(f"δ^-1 values must be integers >= 2 (got {text!r})")
    return vals


def _verify(args: argparse.Namespace) -> int:
    from loopformer.theory.verify import SECTIONS, format_table, run_verify
    names = [s[0] for s in SECTIONS]
    if args.section:
        unknown = [s for s in args.section if s not in names]
        if unknown:
            raise UserError(f"unknown section {unknown[0]!r}; choose from: {', '.join(names)}")
    rows = run_verify(args.section or None, progress=not args.no_progress)
    table = format_table(rows)
    print(table)
    failed = [r for r in rows if not r.passed]
    print(f"\n{len(rows) - len(failed)}/{len(rows)} cases as expected"
          + ("" if not failed else f"; {len(failed)} FAILED"), file=sys.stderr)
    if args.out:
        d = os.path.dirname(os.path.abspath(args.out))
        os.makedirs(d, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, suffix=".tmp")
        with os.fdopen(fd, "w") as fh:
            fh.write(table + "\n")
        os.replace(tmp, args.out)
    return 1 if failed else 0


def _rate(args: argparse.Namespace) -> int:
    from loopformer.theory.rate import rate_experiment, write_rate
    if args.N < 1 or args.d < 1:
        raise UserError("N and d must be >= 1")
    deltas = _ints(args.deltas)
    if any(m ** args.d < args.N for m in deltas):
        raise UserError(f"every δ^-1 needs δ^-d >= N = {args.N} distinct token cells")
    if args.samples < 1:
        raise UserError("--samples must be >= 1")
    points = rate_experiment(deltas, args.N, args.d, p=args.p, samples=args.samples, seed=args.seed,
                             progress=not args.no_progress)
    csv_path, png_path = write_rate(points, args.out)
    print("| δ⁻¹ | loops r | bits | L^p error (distinct) | L^p error (all) | bound (δ=1/δ⁻¹) | δ(r) | bound at δ(r) |")
    print("|---|---|---|---|---|---|---|---|")
    for pt in points:
        print(f"| {pt.delta_inv} | {pt.loops} | {pt.max_bits} | {pt.lp_error_distinct:.4f} | {pt.lp_error_all:.4f} | "
              f"{pt.bound:.4f} | {pt.delta_r:.4f} | {pt.bound_r:.4f} |")
    print(f"wrote {csv_path} and {png_path}", file=sys.stderr)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("theory", help="run the paper's constructions exactly; the approximation-rate bound")
    sub = p.add_subparsers(dest="theory_command", metavar="SUBCOMMAND")
    v = sub.add_parser("verify", help="every construction on a table of cases, as printed and repaired")
    v.add_argument("--section", action="append", help="run only this section (repeatable), e.g. 'Lemma A.9'")
    v.add_argument("--out", help="also write the markdown table to this file")
    v.add_argument("--no-progress", action="store_true", help="no progress bar")
    v.set_defaults(func=_verify)
    r = sub.add_parser("rate", help="Theorem 3.6: measured L^p error and bound against loops (PNG + CSV)")
    r.add_argument("--out", required=True, help="output directory for rate.csv and rate.png")
    r.add_argument("--deltas", default="2,3,4", help="comma-separated δ^-1 values (default 2,3,4)")
    r.add_argument("--N", type=int, default=2, help="sequence length N (default 2)")
    r.add_argument("--d", type=int, default=1, help="token dimension d (default 1)")
    r.add_argument("--p", type=float, default=2.0, help="the p of the L^p error (default 2)")
    r.add_argument("--samples", type=int, default=20000, help="Monte Carlo samples (default 20000)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.set_defaults(func=_rate)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
