"""Memory of `loopformer text prepare` and of training on the result, against the size of the corpus.

    OMP_NUM_THREADS=1 python benchmarks/bench_corpus.py                 # ~20 MB and ~80 MB folders + one 80 MB file
    OMP_NUM_THREADS=1 python benchmarks/bench_corpus.py --sizes 5 20 --no-single-file

Each corpus is synthetic and deterministic (pseudo-words of random syllables at Zipf frequencies, lines of 4-20
words, paragraphs of 1-12 lines), written to a temporary folder as files of about --file-mb MB; with
--single-file the largest size is also written as one file (one document larger than `_WHOLE_FILE_BYTES`, read
line by line). Every command runs in a child process (one thread: OMP_NUM_THREADS, RAYON_NUM_THREADS) and its peak
resident memory is the child's `ru_maxrss` (`os.wait4`; it counts the file pages the child maps, such as the
pages of the token files that training reads, which are page cache, shared and reclaimable) and, in brackets, its
peak anonymous memory (RssAnon, sampled every 20 ms: what the process itself holds); its time is the wall clock:

    prepare   loopformer text prepare DIR --out CORPUS --vocab-size --vocab (byte-level BPE learned on the train
              split, every split tokenised and written, --perturb 0.1 unless --no-perturb)
    train     loopformer train configs/cpu/shakespeare.yaml on CORPUS for --steps steps (the token files memory-mapped:
              each step reads its windows only) with the final evaluation on --eval-windows windows (at the trained
              depth: the loop-wise curve and the drift measurement, which do not read the corpus, are left out)

The table ends with the ratio of the largest to the smallest corpus's peaks: bounded memory shows as a ratio near 1
while the corpus grows several times.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
CONFIG = os.path.join(ROOT, "configs", "cpu", "shakespeare.yaml")
SYLLABLES = ["ka", "ri", "to", "ne", "sha", "lo", "mi", "dor", "an", "el", "th", "qu", "is", "ve", "ur", "ba",
             "o", "e", "st", "wy", "ng", "pe", "ra", "ch", "il"]


def vocabulary(n_words: int, rng: np.random.Generator) -> np.ndarray:
    """n_words distinct pseudo-words of 1-4 syllables."""
    words: dict[str, None] = {}
    while len(words) < n_words:
        k = int(rng.integers(1, 5))
        words["".join(rng.choice(SYLLABLES, size=k))] = None
    return np.array(list(words))


def write_corpus(folder: str, total_mb: float, file_mb: float, seed: int) -> tuple[int, int]:
    """Files of about file_mb MB of text, total_mb in all; returns (files, bytes)."""
    rng = np.random.default_rng(seed)
    words = vocabulary(20000, rng)
    p = 1.0 / np.arange(1, len(words) + 1) ** 1.1
    p /= p.sum()
    os.makedirs(folder, exist_ok=True)
    target = int(total_mb * 1e6)
    written = files = 0
    while target - written > 1000:
        size = min(int(file_mb * 1e6), target - written)
        parts: list[str] = []
        n = 0
        while n < size:
            idx = rng.choice(len(words), size=4096, p=p)
            cuts = np.cumsum(rng.integers(4, 21, size=400))
            cuts = cuts[cuts < idx.size]
            lines = [" ".join(words[seg]) for seg in np.split(idx, cuts)]
            para = rng.integers(1, 13, size=len(lines))
            text = "".join(line.capitalize() + (".\n\n" if b == 1 else ".\n") for line, b in zip(lines, para))
            parts.append(text)
            n += len(text)
        data = "".join(parts)[:size]
        data = data[:data.rfind("\n") + 1] or data
        sub = os.path.join(folder, f"part{files // 100:03d}")
        os.makedirs(sub, exist_ok=True)
        with open(os.path.join(sub, f"doc{files:05d}.txt"), "w", encoding="utf-8") as f:
            f.write(data)
        written += len(data.encode())
        files += 1
    return files, written


def rss_anon_mb(pid: int) -> float | None:
    """The process's resident anonymous memory (heap, not file pages), from /proc; None where there is none."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def run_child(cmd: list[str], log: str) -> tuple[float, float, float | None, int]:
    """(wall seconds, peak RSS in MB, peak anonymous RSS in MB sampled every 20 ms, exit status) of `cmd` in a child
    process with one thread. The peak RSS (`ru_maxrss`) also counts the file pages the child has mapped (the token
    files' memory maps: page cache, shared and reclaimable); the anonymous part is the memory the child holds."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", RAYON_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    anon: float | None = None
    with open(log, "w") as out:
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        while True:
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            a = rss_anon_mb(p.pid)
            if a is not None:
                anon = a if anon is None else max(anon, a)
            time.sleep(0.02)
    p.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        with open(log) as f:
            sys.stderr.write(f.read()[-3000:])
    return wall, usage.ru_maxrss / 1024.0, anon, p.returncode      # ru_maxrss is in KiB on Linux


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=float, nargs="+", default=[20, 80], help="corpus sizes in MB")
    ap.add_argument("--file-mb", type=float, default=0.25, help="size of each file of a folder corpus (MB)")
    ap.add_argument("--single-file", action=argparse.BooleanOptionalAction, default=True,
                    help="also prepare the largest size written as one file")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--no-perturb", action="store_true")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eval-windows", type=int, default=16)
    ap.add_argument("--keep", default=None, metavar="DIR", help="work in DIR and keep it (default: a temporary one)")
    args = ap.parse_args()

    work = args.keep or tempfile.mkdtemp(prefix="bench-corpus-")
    os.makedirs(work, exist_ok=True)
    cli = [sys.executable, "-m", "loopformer.cli"]
    cases = [(f"folder {mb:g} MB", mb, args.file_mb) for mb in args.sizes]
    if args.single_file:
        cases.append((f"one file {max(args.sizes):g} MB", max(args.sizes), max(args.sizes)))
    rows = []
    try:
        for i, (label, mb, file_mb) in enumerate(cases):
            src = os.path.join(work, f"src{i}")
            files, nbytes = write_corpus(src, mb, file_mb, seed=0)
            out = os.path.join(work, f"corpus{i}")
            prep = cli + ["text", "prepare", src, "--out", out, "--vocab-size", str(args.vocab), "--quiet"]
            if not args.no_perturb:
                prep += ["--perturb", "0.1"]
            p_wall, p_rss, p_anon, rc = run_child(prep, os.path.join(work, f"prepare{i}.log"))
            if rc != 0:
                raise SystemExit(f"prepare failed on {label} (exit {rc})")
            with open(os.path.join(out, "manifest.json")) as f:
                tokens = sum(s["tokens"] for s in json.load(f)["splits"].values())
            train = cli + ["train", CONFIG, f"task.data_dir={out}", f"out_dir={os.path.join(work, f'run{i}')}",
                           "threads=1", f"train.steps={args.steps}", f"train.log_every={args.steps}",
                           f"train.eval_every={args.steps}", "train.optim.warmup_steps=2",
                           f"task.eval_windows={args.eval_windows}", "eval.loopwise=false", "eval.drift=false",
                           "--overwrite", "--quiet"]
            t_wall, t_rss, t_anon, rc = run_child(train, os.path.join(work, f"train{i}.log"))
            if rc != 0:
                raise SystemExit(f"train failed on {label} (exit {rc})")
            rows.append((label, files, nbytes, tokens, p_wall, p_rss, p_anon, t_wall, t_rss, t_anon))
            print(f"{label}: prepare {p_wall:.1f} s, {p_rss:.0f} MB; train {t_wall:.1f} s, {t_rss:.0f} MB",
                  file=sys.stderr)
            shutil.rmtree(src)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    def mb(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.0f}"

    print(f"| corpus | files | text MB | tokens | prepare s | prepare peak RSS MB (anon) | train {args.steps} steps s "
          "| train peak RSS MB (anon) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for label, files, nbytes, tokens, p_wall, p_rss, p_anon, t_wall, t_rss, t_anon in rows:
        print(f"| {label} | {files:,} | {nbytes / 1e6:.1f} | {tokens:,} | {p_wall:.1f} | {p_rss:.0f} ({mb(p_anon)}) "
              f"| {t_wall:.1f} | {t_rss:.0f} ({mb(t_anon)}) |")
    folders = [r for r in rows if r[0].startswith("folder")]
    if len(folders) >= 2:
        small, large = folders[0], folders[-1]
        ratio = [large[i] / small[i] if large[i] and small[i] else float("nan") for i in (2, 5, 6, 8, 9)]
        print(f"\nlargest / smallest folder: text {ratio[0]:.1f}x; peak RSS: prepare {ratio[1]:.2f}x (anon "
              f"{ratio[2]:.2f}x), train {ratio[3]:.2f}x (anon {ratio[4]:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
