"""Every flag of every command, and `train`'s config overrides, under random bad values (Hypothesis): wrong types,
negative, huge, NaN and infinite numbers, empty strings, odd unicode, paths that do not exist. Whatever the value,
the command exits 2 with one line `loopformer: error: ...` (or accepts the value), never with a traceback.

The commands and flags are read from the real parser (`loopformer.cli.build_parser`), so a new flag is fuzzed
without a change here. The CLI runs in this process; input paths point at a folder that does not exist and the
functions where long work begins (a training run, a dataset's generation, a theory experiment, a timed model step,
a reproduction plan) are replaced by one that raises `WorkStarted`: an example that gets that far passed the
command's checks, and none starts real work. `pytest -m slow` runs many more examples.
"""

from __future__ import annotations

import argparse
import functools
import io
import os
import sys
import time
from pathlib import Path

import pytest
from conftest import TINY_YAML
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loopformer.cli import build_parser, main
from loopformer.configio import to_dict
from loopformer.train.config import load_run_config

FAST = settings(max_examples=4, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
THOROUGH = settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))


# where the long work of a command begins: replaced by `WorkStarted` in these tests
WORK = ["loopformer.model.commands._time_step",            # presets: a timed training step per preset
        "loopformer.data.commands.write_dataset",          # data gen: drawing the samples
        "loopformer.train.commands.train_run",             # train: the run (one, or a staged one)
        "loopformer.experiments.sweep.run_specs",          # sweep, demo: the runs
        "loopformer.experiments.reproduce.plan",           # reproduce: planning every claim's runs
        "loopformer.theory.commands.run_verify",           # theory verify, rate, modulus: the experiments
        "loopformer.theory.commands.rate_experiment",
        "loopformer.theory.commands.estimate_modulus",
        "loopformer.eval.commands.evaluate_all",           # eval: the evaluation (of a real run)
        "loopformer.analysis.dynamics.dynamics_of"]        # analyze dynamics: the measurement (of a real run)


class WorkStarted(Exception):
    """Raised where a command's long work would begin: its arguments passed every check."""


def _work(*args, **kwargs):
    raise WorkStarted


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    """A working folder (relative paths land here) holding a config file, a finished tiny run and a tiny dataset;
    the work entry points replaced."""
    base = tmp_path_factory.mktemp("fuzz")
    (base / "tiny.yaml").write_text(TINY_YAML)
    assert run_cli(["train", str(base / "tiny.yaml"), f"out_dir={base / 'run'}", "--quiet"])[0] == 0
    assert run_cli(["data", "gen", "lcs", "--out", str(base / "data"), "--train", "16", "--test", "8", "--opt",
                    "length=3", "alphabet_max=3", "--quiet"])[0] == 0
    with pytest.MonkeyPatch.context() as mp:
        for target in WORK:
            mp.setattr(target, _work)
        import loopformer.experiments.reproduce as reproduce

        mp.setattr(reproduce, "load_registry", functools.lru_cache(reproduce.load_registry))   # read once
        mp.chdir(base)
        yield base


def run_cli(argv: list[str]) -> tuple[int | str, str]:
    """main(argv) in this process with stdout and stderr encoded as a terminal's (stdout strict UTF-8, stderr
    backslash-escaped): (exit status or "work", stderr). Any other exception escaping main fails the test."""
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict")
    err = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="backslashreplace")
    real = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        code: int | str = main(argv)
    except WorkStarted:
        code = "work"
    finally:
        sys.stdout, sys.stderr = real
        out.flush()
        err.flush()
    return code, err.buffer.getvalue().decode("utf-8")


def assert_one_line_or_accepted(code: int | str, err: str, argv: list[str]) -> None:
    assert "Traceback" not in err, (argv, err)
    assert code in (0, 2, "work"), (argv, code, err)
    if code == 2:
        lines = [x for x in err.replace("\r", "\n").splitlines() if "loopformer: error: " in x]
        assert len(lines) == 1 and err.count("loopformer: error: ") == 1, (argv, err)
        assert lines[0].startswith("loopformer: error: "), (argv, err)


# ------------------------------------------------------------------------------------------------ the parser
def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command words, its parser) for every runnable command, e.g. (("data", "gen"), parser)."""
    groups = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if path and not groups:
        yield path, parser
    for group in groups:
        for name, sub in group.choices.items():
            yield from commands(sub, (*path, name))


def arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]


def flag_name(action: argparse.Action) -> str:
    longs = [o for o in action.option_strings if o.startswith("--")]
    return (longs or action.option_strings)[0]


MISSING = "no-such-folder/input"       # inside the sandbox, never created
# commands whose inputs are not paths: positionals and options that keep them from failing at once
BASE = {("presets",): (["debug"], []), ("train",): (["tiny.yaml"], []),
        ("sweep",): (["tiny.yaml"], ["--grid", "model.loops=2,3"]), ("reproduce",): ([], ["--dry-run"])}
# commands that read a run or a dataset, given a real one (the sandbox's): their checks after loading are fuzzed too
REAL = {("eval",): (["run"], []), ("info",): (["run"], []), ("analyze", "dynamics"): (["run"], []),
        ("data", "show"): (["data"], []), ("theory", "modulus"): ([], ["--checkpoint", "run"])}


def plain_value(action: argparse.Action) -> str:
    """A harmless value for a required argument: the first choice, a small number, a new output folder or a
    missing input."""
    if action.choices:
        return sorted(action.choices)[0]
    if action.type is float:
        return "0.1"
    if action.type is not None and action.type is not str:
        return "1"
    return "out" if action.dest == "out" else MISSING


def base_argv(path: tuple[str, ...], parser: argparse.ArgumentParser, bad: argparse.Action, value: str,
              base: dict = BASE) -> list[str]:
    """The command with harmless values for what it requires and `value` for the argument `bad`."""
    positionals = [a for a in arguments(parser) if not a.option_strings]
    words, options = base.get(path, ([plain_value(a) for a in positionals], []))
    words, options = list(words), list(options)
    for a in arguments(parser):
        if a.option_strings and a.required and a is not bad:
            options += [flag_name(a), plain_value(a)]
    if not bad.option_strings:                # a positional: the bad value in its place
        i = positionals.index(bad)
        words = [*words[:i], value, *words[i + 1:]]
    elif bad.nargs == 0:                      # a switch
        options.append(flag_name(bad))
    else:
        options.append(f"{flag_name(bad)}={value}")
    return [*path, *words, *options]


PARSER = build_parser()
COMMANDS = dict(commands(PARSER))
CASES = [(path, a.dest if not a.option_strings else flag_name(a))
         for path, p in COMMANDS.items() for a in arguments(p)]
REAL_CASES = [(path, name) for path, name in CASES if path in REAL]


# ------------------------------------------------------------------------------------------------ bad values
def _safe(value: str) -> bool:
    """No value names an existing file or folder, or a place outside the sandbox (a command must not read the
    whole disk or write outside it)."""
    return not value.startswith(("/", "~")) and ".." not in value and not os.path.lexists(value)


SPECIAL = ["", " ", "0", "-1", "-0", "1.5", "1e400", "-1e400", "nan", "NaN", "inf", "-inf", "Infinity", "1e-400",
           str(2 ** 31), str(2 ** 63), str(2 ** 64), str(10 ** 30), "-" + str(10 ** 30), "9" * 5000, "0x10",
           "1_000", "١٢", "１２", "x", "a=b", "=", "key=", "=value", "[1, 2]", "{a: 1}", "null", "true",
           "\u202e", "🙂", "é", "\udcff", "\t", "a\nb", "x" * 5000, MISSING, MISSING + "/x.yaml",
           "no-such-folder/out.json", "no-such-folder/plot.png", "cuda:99", "tpu", "kl:nan", "kl:-1",
           "argmax:0", "latent:1e400,patience=-1", "1,2,x", "0,0", "-1,2", ",", "nan,inf"]
NUMBERS = st.one_of(st.integers(-(2 ** 80), 2 ** 80).map(str),
                    st.floats(allow_nan=True, allow_infinity=True).map(repr))
TEXT = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), max_size=12)
BAD = st.one_of(st.sampled_from(SPECIAL), NUMBERS, TEXT).filter(_safe)


def _flag_body(case, value, base=BASE):
    path, name = case
    parser = COMMANDS[path]
    action = next(a for a in arguments(parser) if (flag_name(a) if a.option_strings else a.dest) == name)
    argv = base_argv(path, parser, action, value, base)
    code, err = run_cli(argv)
    assert_one_line_or_accepted(code, err, argv)


def _ids(cases):
    return [" ".join((*p, n)) for p, n in cases]


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
@settings(FAST)
@given(value=BAD)
def test_every_flag_under_bad_values(sandbox, case, value):
    _flag_body(case, value)


@pytest.mark.parametrize("case", REAL_CASES, ids=_ids(REAL_CASES))
@settings(FAST)
@given(value=BAD)
def test_every_flag_of_a_command_reading_a_real_run(sandbox, case, value):
    _flag_body(case, value, REAL)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
@settings(THOROUGH)
@given(value=BAD)
def test_every_flag_under_bad_values_thorough(sandbox, case, value):
    _flag_body(case, value)


@pytest.mark.slow
@pytest.mark.parametrize("case", REAL_CASES, ids=_ids(REAL_CASES))
@settings(THOROUGH)
@given(value=BAD)
def test_every_flag_of_a_command_reading_a_real_run_thorough(sandbox, case, value):
    _flag_body(case, value, REAL)


# ------------------------------------------------------------------------------------------------ overrides
def _leaves(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        out += _leaves(v, f"{prefix}{k}.") if isinstance(v, dict) and v else [f"{prefix}{k}"]
    return out


def config_keys() -> list[str]:
    """Every key of a run config (read from its schema), and keys that do not exist."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "tiny.yaml").write_text(TINY_YAML)
        keys = _leaves(to_dict(load_run_config(Path(tmp) / "tiny.yaml")))
    return sorted(keys) + ["no.such.key", "model.nope", "train.optim.lr.deeper", "train", "model", "task.options.zzz"]


KEYS = config_keys()
YAML_BAD = st.one_of(st.sampled_from(["nan", ".nan", ".inf", "-.inf", "1e400", "-1", "0", str(2 ** 64), "9" * 5000,
                                      "[1, 2]", "{a: 1}", "null", "", "''", "true", "x" * 5000, "${model.loops}",
                                      "${oc.env:HOME}", "${nope}", "${", "[", "{", ":", "- a", "!!python/object:x",
                                      "&a [*a]", "🙂", "\u202e"]),
                     NUMBERS, TEXT)
OVERRIDES = st.lists(st.tuples(st.sampled_from(KEYS), YAML_BAD), min_size=1, max_size=3)
ODD_ITEMS = st.sampled_from(["=1", ".=1", "a..b=1", "train.=1", "🙂=1", " =1", "model.loops", "-x=1"])


def _override_body(sandbox, picks, odd):
    argv = ["train", "tiny.yaml", *[f"{k}={v}" for k, v in picks], *([odd] if odd else []),
            "out_dir=runs/r", "--quiet"]
    code, err = run_cli(argv)
    assert code in (2, "work"), (argv, code, err)
    assert_one_line_or_accepted(code, err, argv)


@settings(FAST, max_examples=60)
@given(picks=OVERRIDES, odd=st.none() | ODD_ITEMS)
def test_train_overrides_under_bad_values(sandbox, picks, odd):
    _override_body(sandbox, picks, odd)


@pytest.mark.slow
@settings(THOROUGH, max_examples=600)
@given(picks=OVERRIDES, odd=st.none() | ODD_ITEMS)
def test_train_overrides_under_bad_values_thorough(sandbox, picks, odd):
    _override_body(sandbox, picks, odd)


def test_the_fuzz_covers_every_command_and_flag():
    """The cases are read from the parser: every command is there, with every flag it has."""
    names = {" ".join(p) for p in COMMANDS}
    assert {"train", "data gen", "text prepare", "theory modulus", "analyze continuity", "convert"} <= names
    assert ("data gen", "--workers") in {(" ".join(p), n) for p, n in CASES}
    assert len(CASES) == sum(len(arguments(p)) for p in COMMANDS.values())


@pytest.mark.parametrize("argv,needle", [
    (["data", "gen", "lcs", "--out", "d", "--train", "1", "--test", "1", "--chunk-size", str(10 ** 9)],
     "--chunk-size must be in 1..1,048,576"),
    (["data", "gen", "lcs", "--out", "d", "--train", "1", "--test", "1", "--workers", str(10 ** 6)], "--workers"),
    (["data", "gen", "lcs", "--out", "d", "--train", str(10 ** 12), "--test", "1"], "GiB of samples"),
    (["data", "gen", "lcs", "--out", "d", "--train", "1", "--test", "1e400"], "not a non-negative integer: '1e400'"),
    (["theory", "rate", "--out", "r", "--d", str(10 ** 30)], "loops, more than 100,000"),
    (["theory", "rate", "--out", "r", "--deltas", "2,1000"], "loops, more than 100,000"),
    (["theory", "rate", "--out", "r", "--samples", str(10 ** 12)], "lower --samples"),
    (["analyze", "dynamics", "run", "--max-loops", "4096"], "max_loops must be in 1..1024"),
    (["train", "tiny.yaml", "train.optim.lr=\x1f"], "bad override 'train.optim.lr=\\x1f'"),
    (["train", "tiny.yaml", "model.loops=!!python/object:os.system"], "bad override"),
    (["sweep", "tiny.yaml", "--grid", "model.loops=[2,3", "--out", "s"], "bad --grid value"),
    (["sweep", "tiny.yaml", "--grid", "model.loops=2,3", "--out", "\t"], "cannot hold runs"),
    (["demo", "--out", "a: b"], "cannot hold runs")],
    ids=["chunk-size", "workers", "samples-in-memory", "infinite-count", "rate-d", "rate-deltas", "rate-samples",
         "dynamics-loops", "override-control-character", "override-tag", "grid-yaml", "sweep-out", "demo-out"])
def test_values_out_of_reach_are_one_line_before_any_work(sandbox, argv, needle):
    """Values that would give a traceback (YAML a config cannot hold, an infinite count), start work that could not
    end (a network of 2^10^30 loops, a chunk of 10^9 rows, a million worker processes) or be refused only after the
    work (`analyze dynamics --max-loops` past the cap): each is one line, at once."""
    t0 = time.perf_counter()
    code, err = run_cli(argv)
    assert code == 2, (argv, code, err)
    assert_one_line_or_accepted(code, err, argv)
    assert needle in err, err
    assert time.perf_counter() - t0 < 5
