"""Task-generation speed at the paper's sizes (Sec. 5.1.1): samples per second, one process and end to end.

    python benchmarks/bench_data.py                 # all tasks, default sample counts
    python benchmarks/bench_data.py --scale 0.2     # fewer samples (quicker, noisier)
    python benchmarks/bench_data.py --workers 4

Columns: `generate/s` — `task.generate` in one process (kernels already compiled), by wall clock and by the
process's CPU time (the latter does not drop when other programs share the cores); `dataset/s` — `write_dataset`
with --workers processes, including de-duplication, train/test disjointness and writing .npy files; `target` —
the rate that makes a paper-size set a matter of minutes (1M ED/LCS, 3M Sudoku, 5M Countdown samples);
`one free core meets target` compares the CPU-time rate (what one unshared core does) with the target;
`paper set` — the estimated time for the paper-size training set at the measured end-to-end rate.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from loopformer.data import write_dataset  # noqa: E402
from loopformer.tasks import get_task  # noqa: E402

CASES = [
    # label, task, options, samples to time, target rate, paper training-set size
    ("ED (L=40)", "edit_distance", {"length": 40}, 40_000, 20_000, 1_000_000),
    ("ED (L=60)", "edit_distance", {"length": 60}, 40_000, 20_000, 1_000_000),
    ("LCS (L=60)", "lcs", {"length": 60}, 40_000, 20_000, 1_000_000),
    ("LCS (L=100)", "lcs", {"length": 100}, 20_000, None, 1_000_000),
    ("Sudoku (minimal, unique)", "sudoku", {}, 1_000, 200, 3_000_000),
    ("Sudoku (45 blanks)", "sudoku", {"blanks": 45}, 4_000, 200, 3_000_000),
    ("Countdown", "countdown", {}, 40_000, 5_000, 5_000_000),
    ("ED (L=8, CPU demo)", "edit_distance", {"length": 8, "alphabet_max": 5}, 100_000, None, 100_000),
    ("LCS (L=8, CPU demo)", "lcs", {"length": 8, "alphabet_max": 5}, 100_000, None, 100_000),
]


def _fmt_time(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every sample count")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--only", default=None, help="run only cases whose label contains this text")
    args = ap.parse_args()

    rows = []
    tmp = tempfile.mkdtemp(prefix="bench_data_")
    try:
        for label, name, opts, n, target, paper_n in CASES:
            if args.only and args.only.lower() not in label.lower():
                continue
            n = max(10, int(n * args.scale))
            task = get_task(name, **opts)
            task.generate(4, 0)                                   # compile / load the kernels
            t0, c0 = time.perf_counter(), time.process_time()
            task.generate(n, 1)
            gen_rate = n / (time.perf_counter() - t0)
            cpu_rate = n / max(time.process_time() - c0, 1e-9)
            out = os.path.join(tmp, name)
            t0 = time.perf_counter()
            write_dataset(out, task, n, max(1, n // 100), seed=0, workers=args.workers, progress=False,
                          overwrite=True)
            ds_rate = (n + max(1, n // 100)) / (time.perf_counter() - t0)
            shutil.rmtree(out, ignore_errors=True)
            ok = "" if target is None else ("yes" if cpu_rate >= target else "NO")   # one free core
            rows.append((label, n, gen_rate, cpu_rate, ds_rate, target, ok, _fmt_time(paper_n / ds_rate), paper_n))
            print(f"  {label}: {gen_rate:,.0f}/s generate ({cpu_rate:,.0f}/s CPU), {ds_rate:,.0f}/s dataset",
                  file=sys.stderr)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\nTask generation speed ({os.cpu_count()} CPU cores, load average {load:.1f}; dataset writing with "
          f"{args.workers} workers)\n")
    print("| task | samples | generate/s (1 proc) | generate/s (CPU time) | dataset/s | target/s "
          "| one free core meets target | paper set at dataset/s (size) |")
    print("|---|---:|---:|---:|---:|---:|:---:|---:|")
    for label, n, g, c, d, target, ok, eta, paper_n in rows:
        tgt = f"{target:,}" if target else "-"
        print(f"| {label} | {n:,} | {g:,.0f} | {c:,.0f} | {d:,.0f} | {tgt} | {ok or '-'} | {eta} ({paper_n:,}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
