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

    python benchmarks/bench_data.py --verify-only                  # only the checksum table (1M rows)
    python benchmarks/bench_data.py --verify-rows 200000 --only ED # both, smaller

Checksum verification (what `train` / `eval` do when they open a dataset folder): a dataset of --verify-rows
LCS (L=60) rows (random ids, written by `write_splits`) opened without verification, verified for the first
time (SHA-256 of every array plus the token-id range check), verified again in a new process (the record cached by
size and modification time), and one full read of the training inputs for scale.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from loopformer import checksums  # noqa: E402
from loopformer.data import open_dataset, write_dataset  # noqa: E402
from loopformer.data.dataset import write_splits  # noqa: E402
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


def bench_verify(rows: int, tmp: str) -> None:
    """Time opening a `rows`-row dataset with and without checksum verification; print a table."""
    import numpy as np

    os.environ["LOOPFORMER_CACHE_DIR"] = os.path.join(tmp, "cache")
    task = get_task("lcs", length=60)
    rng = np.random.default_rng(0)
    T = task.seq_len

    def split(n):
        return {"inputs": rng.integers(0, task.vocab_size, (n, T), dtype=np.int16),
                "targets": np.where(rng.random((n, T)) < 0.9, -100,
                                    rng.integers(0, task.vocab_size, (n, T))).astype(np.int16),
                "answer": rng.integers(0, 60, n).astype(np.int64)}

    out = os.path.join(tmp, "verify")
    write_splits(out, task, {"train": split(rows), "test": split(max(1, rows // 100))}, seed=0)
    files = [os.path.join(d, f) for d, _, fs in os.walk(out) for f in fs if f.endswith(".npy")]
    mb = sum(os.path.getsize(f) for f in files) / 1e6
    past = time.time_ns() - 60 * 10**9                 # as if written a minute ago (the record is then trusted)
    for f in files:
        os.utime(f, ns=(past, past))

    def timed(fn):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    t_plain = min(timed(lambda: open_dataset(out, verify=False)) for _ in range(3))
    checksums.forget()
    t_first = timed(lambda: open_dataset(out, verify=True))
    t_again = []
    for _ in range(3):
        checksums.forget()                            # a new process: the record on disk is read
        t_again.append(timed(lambda: open_dataset(out, verify=True)))
    t_memo = min(timed(lambda: open_dataset(out, verify=True)) for _ in range(3))
    t_sha = timed(lambda: [checksums.sha256_file(f) for f in files])
    _, splits = open_dataset(out, verify=False)
    t_read = timed(lambda: np.asarray(splits["train"]["inputs"]).sum())
    shutil.rmtree(out, ignore_errors=True)
    print(f"\nChecksum verification: LCS (L=60), {rows:,} train + {max(1, rows // 100):,} test rows, "
          f"{len(files)} arrays, {mb:,.0f} MB\n")
    print("| open | seconds | vs. no verification |")
    print("|---|---:|---:|")
    print(f"| without verification | {t_plain:.3f} | 1.0× |")
    print(f"| verified, first time (SHA-256 + id range) | {t_first:.2f} | {t_first / t_plain:,.0f}× |")
    print(f"| verified again, new process (cached record) | {min(t_again):.3f} | {min(t_again) / t_plain:.1f}× |")
    print(f"| verified again, same process | {t_memo:.3f} | {t_memo / t_plain:.1f}× |")
    print(f"| (SHA-256 alone: {mb / t_sha:,.0f} MB/s) | {t_sha:.2f} | |")
    print(f"| (one read of the train inputs, for scale) | {t_read:.2f} | |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every sample count")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--only", default=None, help="run only cases whose label contains this text")
    ap.add_argument("--verify-rows", type=int, default=1_000_000, help="rows of the checksum benchmark (0: skip)")
    ap.add_argument("--verify-only", action="store_true", help="only the checksum benchmark")
    args = ap.parse_args()

    rows = []
    tmp = tempfile.mkdtemp(prefix="bench_data_")
    try:
        if args.verify_rows > 0:
            bench_verify(args.verify_rows, tmp)
        if args.verify_only:
            return 0
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
