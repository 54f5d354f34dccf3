"""Signals: SIGINT and SIGTERM end a command cleanly — within seconds (also inside a long call into the tokenizer
library), with one line `loopformer: interrupted by SIG...` and exit status 128 + the signal, and with no temporary
folder or partial output left; a process killed outright (kill -9) leaves a temporary folder that the next run into
that folder removes.

The commands run as subprocesses; a signal is sent once the command is at work (its handlers are installed, as
/proc shows, and where it matters once it has reached the phase under test).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_cli_errors import error_line, train_tiny

from loopformer.cli import main
from loopformer.commandline import Interrupted, interrupt_on_signals
from loopformer.text.tokenizers import interruptible

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc to see a command start")

EXIT_BOUND = 20.0          # seconds from the signal to the exit: termination, not speed


@pytest.fixture(autouse=True)
def stop_signals_not_ignored():
    """The tests that signal this very process need its stop signals caught by the command: a test session started
    as a background job of a script (`pytest ... &`) or under `nohup` inherits SIGINT or SIGHUP ignored, and the
    command rightly keeps an ignored signal ignored — it would finish with status 0 instead of ending on the
    signal. Within each test they start at their defaults; the inherited dispositions come back afterwards."""
    defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL,
                signal.SIGHUP: signal.SIG_DFL}
    old = {s: signal.getsignal(s) for s in defaults}
    for s, h in defaults.items():
        if old[s] is signal.SIG_IGN:
            signal.signal(s, h)
    try:
        yield
    finally:
        for s, h in old.items():
            if h is signal.SIG_IGN:
                signal.signal(s, h)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def start(argv: list[str], cwd: Path, group: bool = False) -> tuple[subprocess.Popen, Path]:
    """`loopformer ARGV` in a new process (SIGINT and SIGTERM at their defaults, whatever this process has; with
    `group`, in a process group of its own, as a terminal's foreground job); returns the process and the file its
    stderr goes to."""
    err = cwd / f"stderr-{time.monotonic_ns()}.txt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")

    def defaults():
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        if group:
            os.setsid()

    with open(err, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "loopformer.cli", *argv], cwd=cwd, stdout=subprocess.DEVNULL,
                                stderr=fh, env=env, preexec_fn=defaults)
    STDERR[proc.pid] = err
    return proc, err


STDERR: dict[int, Path] = {}     # a started command's process id → the file its stderr goes to


def wait_for(proc: subprocess.Popen, ready, what: str, timeout: float = 120.0) -> None:
    t0 = time.monotonic()
    while not ready():
        if proc.poll() is not None:
            tail = STDERR[proc.pid].read_text(errors="replace")[-2000:] if proc.pid in STDERR else ""
            pytest.fail(f"the command ended (status {proc.returncode}) before {what}: {tail}")
        assert time.monotonic() - t0 < timeout, f"no {what} after {timeout:.0f} s"
        time.sleep(0.02)


def handling_signals(proc: subprocess.Popen) -> bool:
    """Whether the command catches SIGTERM: its handlers are installed, the command is running."""
    try:
        status = Path(f"/proc/{proc.pid}/status").read_text()
    except OSError:
        return False
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught >> (signal.SIGTERM - 1) & 1)


def interrupt(proc: subprocess.Popen, err: Path, sig: int, group: bool = False) -> float:
    """Send `sig` (with `group`, to the process's whole group, as Ctrl-C at a terminal does); the seconds until the
    process ends, after checking its status and its one line (no traceback from it or its workers)."""
    t0 = time.monotonic()
    if group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"still running 60 s after {signal.Signals(sig).name}")
    took = time.monotonic() - t0
    text = err.read_text(errors="replace")
    assert "Traceback" not in text, text
    assert proc.returncode == 128 + sig, (proc.returncode, text[-2000:])
    lines = [x for x in text.replace("\r", "\n").splitlines() if "loopformer: " in x]
    assert lines == [f"loopformer: interrupted by {signal.Signals(sig).name}"], text[-2000:]
    assert took < EXIT_BOUND, took
    return took


def leftovers(folder: Path) -> list[str]:
    """Temporary names under `folder`: `.prepare-*`, `.NAME.tmp-*`, `.NAME.old-*`."""
    return [str(p) for p in folder.rglob("*")
            if p.name.startswith(".prepare-") or ".tmp-" in p.name or ".old-" in p.name]


# ------------------------------------------------------------------------------------------------ text prepare
def _prepare_temp(out: Path) -> Path | None:
    temps = list(out.glob(".prepare-*")) if out.is_dir() else []
    return temps[0] if temps else None


@pytest.mark.parametrize("sig,phase", [(signal.SIGINT, "merges"), (signal.SIGTERM, "encoding")],
                         ids=["SIGINT-merges", "SIGTERM-encoding"])
def test_text_prepare_ends_on_a_signal_inside_the_tokenizer(tmp_path, sig, phase):
    """Learning the merges and encoding run in the tokenizer library's native code, which does not return to
    Python until done (seconds to minutes); the command still ends at once and removes its folder."""
    out = tmp_path / "corpus"
    proc, err = start(["text", "prepare", "plays", "--out", str(out), "--vocab-size", "30000"], tmp_path)
    if phase == "merges":      # the rows are read: the library learns the merges
        wait_for(proc, lambda: "rows read, learning merges" in err.read_text(errors="replace"), "merges")
    else:                      # the tokenizer is saved: the library encodes the training split
        wait_for(proc, lambda: (t := _prepare_temp(out)) is not None and (t / "tokenizer.json").is_file(),
                 "tokenizer")
    interrupt(proc, err, sig)
    assert not out.exists() and leftovers(tmp_path) == []


def test_a_text_prepare_killed_outright_leaves_a_folder_the_next_run_removes(tmp_path, capsys):
    out = tmp_path / "corpus"
    proc, err = start(["text", "prepare", "plays", "--out", str(out), "--vocab-size", "30000", "--quiet"], tmp_path)
    wait_for(proc, lambda: _prepare_temp(out) is not None, "temporary folder")
    proc.kill()
    proc.wait()
    stale = _prepare_temp(out)
    assert stale is not None and stale.is_dir()
    (tmp_path / "t.txt").write_text("".join(f"to be or not to be {i} that is the question\n" for i in range(60)))
    assert main(["text", "prepare", str(tmp_path / "t.txt"), "--out", str(out), "--vocab-size", "270",
                 "--quiet"]) == 0
    assert not stale.exists() and (out / "manifest.json").is_file() and leftovers(out) == []


@pytest.mark.parametrize("size", ["2147483647", "1048577", str(10 ** 30)])
def test_absurd_vocabulary_sizes_are_refused_before_the_tokenizer_library_is_called(tmp_path, capsys, monkeypatch,
                                                                                     size):
    """The library allocates for the whole vocabulary up front: 2^31 - 1 entries would abort the process."""
    import loopformer.text.tokenizers as tk

    monkeypatch.setattr(tk.HFTokenizer, "train_from_iterator", lambda *a, **k: pytest.fail("the library was called"))
    (tmp_path / "t.txt").write_text("to be or not to be\n" * 50)
    assert main(["text", "prepare", str(tmp_path / "t.txt"), "--out", str(tmp_path / "c"), "--vocab-size", size,
                 "--quiet"]) == 2
    error_line(capsys, "vocab-size must be at most 1,048,576")
    assert not (tmp_path / "c").exists()


def test_the_tokenizer_library_runs_off_the_main_thread(tmp_path, monkeypatch):
    """Learning the merges and encoding run in a helper thread, so the main thread handles a signal at once
    (Python runs signal handlers only there, and only between its own instructions)."""
    import loopformer.text.tokenizers as tk

    threads = []
    for name in ("train_from_iterator", "encode_batch"):
        real = getattr(tk.HFTokenizer, name)

        def record(self, *a, _real=real, _name=name, **k):
            threads.append((_name, threading.current_thread() is threading.main_thread()))
            return _real(self, *a, **k)

        monkeypatch.setattr(tk.HFTokenizer, name, record)
    (tmp_path / "t.txt").write_text("".join(f"to be or not to be {i} that is the question\n" for i in range(60)))
    assert main(["text", "prepare", str(tmp_path / "t.txt"), "--out", str(tmp_path / "c"), "--vocab-size", "270",
                 "--quiet"]) == 0
    assert {n for n, _ in threads} == {"train_from_iterator", "encode_batch"}
    assert not any(on_main for _, on_main in threads), threads


# ------------------------------------------------------------------------------------------------ data gen
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_data_gen_ends_on_a_signal(tmp_path, sig):
    out = tmp_path / "data"
    proc, err = start(["data", "gen", "lcs", "--out", str(out), "--train", "1000000", "--test", "1000"], tmp_path)
    wait_for(proc, lambda: handling_signals(proc) and "lcs train:" in err.read_text(errors="replace"),
             "generation")
    interrupt(proc, err, sig)
    assert not out.exists() and leftovers(tmp_path) == []


def test_ctrl_c_ends_data_gen_with_workers_in_one_line(tmp_path):
    """Ctrl-C at a terminal reaches the worker processes too: they leave it to the main process, which ends the pool
    at once (its SIGTERM ends a worker without the command's handler) — one line, no worker's traceback."""
    out = tmp_path / "data"
    proc, err = start(["data", "gen", "lcs", "--out", str(out), "--train", "3000000", "--test", "1000",
                       "--workers", "2"], tmp_path, group=True)
    wait_for(proc, lambda: handling_signals(proc) and "lcs train:" in err.read_text(errors="replace"), "generation")
    time.sleep(1.0)                                                   # the workers are generating
    interrupt(proc, err, signal.SIGINT, group=True)
    assert not out.exists() and leftovers(tmp_path) == []


def test_data_gen_interrupted_while_writing_leaves_no_temporary_folder(tmp_path, capsys, monkeypatch):
    """SIGTERM between two arrays of the dataset being written: the temporary folder goes, nothing is left."""
    import loopformer.data.dataset as ds

    real = ds.np.save
    calls = []

    def save_then_signal(*a, **k):
        real(*a, **k)
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1.0)              # the handler raises here, in the main thread

    monkeypatch.setattr(ds.np, "save", save_then_signal)
    before = signal.getsignal(signal.SIGTERM)
    assert main(["data", "gen", "lcs", "--out", str(tmp_path / "d"), "--train", "64", "--test", "8", "--quiet"]) == 143
    assert capsys.readouterr().err.strip().splitlines()[-1] == "loopformer: interrupted by SIGTERM"
    assert len(calls) == 2 and list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) is before               # restored after the command


def test_data_gen_removes_the_temporary_folder_of_a_killed_writer(tmp_path, capsys):
    stale = tmp_path / f".d.tmp-{dead_pid()}-abc"
    stale.mkdir()
    (stale / "manifest.json").write_text("{")
    assert main(["data", "gen", "lcs", "--out", str(tmp_path / "d"), "--train", "16", "--test", "4", "--quiet"]) == 0
    assert not stale.exists() and (tmp_path / "d" / "manifest.json").is_file()


# ------------------------------------------------------------------------------------------------ theory, analyze
@pytest.mark.parametrize("argv,sig", [
    (["theory", "rate", "--out", "rate", "--deltas", "2,3,4,5", "--samples", "200000"], signal.SIGTERM),
    (["theory", "modulus", "--delta", "0.1", "--N", "8", "--d", "8", "--samples", "200000", "--steps", "100000",
      "--out", "rate/m.json"], signal.SIGINT)], ids=["rate-SIGTERM", "modulus-SIGINT"])
def test_theory_ends_on_a_signal(tmp_path, argv, sig):
    proc, err = start(argv, tmp_path)
    wait_for(proc, lambda: handling_signals(proc), "signal handlers")
    time.sleep(1.0)                                   # at work: drawing, building, evaluating
    interrupt(proc, err, sig)
    assert not (tmp_path / "rate").exists() and leftovers(tmp_path) == []


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return train_tiny(tmp_path_factory.mktemp("signals"))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_analyze_ends_on_a_signal(run, tmp_path, sig):
    out = tmp_path / "dyn"
    proc, err = start(["analyze", "dynamics", str(run), "--out", str(out), "--max-loops", "1024", "-n", "0",
                       "--batch-size", "1"], tmp_path)
    wait_for(proc, lambda: handling_signals(proc), "signal handlers")
    time.sleep(1.0)                                   # at work: loading the model, measuring loop by loop
    interrupt(proc, err, sig)
    assert not out.exists() and leftovers(tmp_path) == []


def test_analyze_interrupted_while_writing_leaves_no_partial_outputs(run, tmp_path, capsys, monkeypatch):
    import loopformer.analysis.dynamics as dyn

    real = dyn.write_json

    def write_then_signal(*a, **k):
        real(*a, **k)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1.0)

    monkeypatch.setattr(dyn, "write_json", write_then_signal)
    out = tmp_path / "dyn"
    assert main(["analyze", "dynamics", str(run), "--out", str(out)]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "loopformer: interrupted by SIGINT"
    assert not out.exists()


# ------------------------------------------------------------------------------------------------ the mechanism
def test_a_long_call_in_a_helper_thread_does_not_delay_the_signal():
    """`interruptible` waits for a call (here one that takes 30 s) in a way a signal ends at once; the handlers of
    `interrupt_on_signals` are restored afterwards and a signal ignored before stays ignored."""
    before = signal.getsignal(signal.SIGTERM)
    old_hup = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with interrupt_on_signals():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
            t0 = time.monotonic()
            with pytest.raises(Interrupted) as info:
                interruptible(time.sleep, 30)
            assert time.monotonic() - t0 < 5 and info.value.code == 143
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        signal.signal(signal.SIGHUP, old_hup)
    assert interruptible(lambda x: x * 2, 21) == 42
    with pytest.raises(ZeroDivisionError):
        interruptible(lambda: 1 / 0)
