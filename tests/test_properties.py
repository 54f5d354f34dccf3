"""Property-based tests of the commands (Hypothesis): random config overrides, command lines, YAML files and
damaged (truncated or bit-flipped) checkpoints and datasets. Whatever the input, a command exits 0, or exits 2
printing one line `loopformer: error: ...` — never a traceback — and leaves no file half-written.

The default run uses 12 fixed examples per property (about 20 s in all); `pytest -m slow` runs the same
properties on many random examples (the `thorough` Hypothesis profile).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import tempfile
from pathlib import Path

import pytest
from conftest import TINY_YAML
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loopformer.cli import main
from loopformer.model.io import checkpoint_step

settings.register_profile("fast", max_examples=12, deadline=None, derandomize=True, database=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", max_examples=150, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FAST, THOROUGH = settings.get_profile("fast"), settings.get_profile("thorough")



def run_cli(argv: list[str]) -> tuple[int, str]:
    """main(argv) in this process: (exit status, stderr). Any exception escaping main is a failure."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    return code, err.getvalue()


def assert_clean_exit(code: int, err: str, argv: list[str]) -> None:
    assert "Traceback" not in err, (argv, err)
    assert code in (0, 2), (argv, code, err)
    if code == 2:
        lines = [x for x in err.replace("\r", "\n").splitlines() if "loopformer: error: " in x]
        assert len(lines) == 1 and err.count("loopformer: error: ") == 1, (argv, err)
        assert lines[0].strip().startswith("loopformer: error: ") or "|" in lines[0], (argv, err)


def assert_nothing_half_written(folder: Path, contents: bool = True) -> None:
    """No temporary or hidden swap leftovers; with `contents`, also every checkpoint complete and the metrics
    strict JSON (skipped where the test itself damaged a file and the command refused it)."""
    if not folder.exists():
        return
    for p in folder.rglob("*"):
        assert ".tmp" not in p.name and ".old-" not in p.name and not p.name.startswith(".prepare-"), p
    if not contents:
        return
    for ck in [p for p in folder.rglob("checkpoint") if p.is_dir()]:
        assert checkpoint_step(ck) is not None, ck
    for m in folder.rglob("metrics.jsonl"):
        for line in m.read_text().splitlines():
            json.loads(line, parse_constant=lambda c: (_ for _ in ()).throw(AssertionError(c)))


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A config, a finished tiny run and a tiny dataset, copied by the examples that damage them."""
    b = tmp_path_factory.mktemp("props")
    (b / "tiny.yaml").write_text(TINY_YAML)
    code, err = run_cli(["train", str(b / "tiny.yaml"), f"out_dir={b / 'run'}", "--quiet"])
    assert code == 0, err
    code, err = run_cli(["data", "gen", "lcs", "--out", str(b / "data"), "--train", "32", "--test", "8",
                         "--opt", "length=3", "alphabet_max=3"])
    assert code == 0, err
    return b


def both(strategies: dict, body):
    """A fast test (default profile) and a slow, thorough one of the same property."""
    fast = settings(FAST)(given(**strategies)(body))
    slow = pytest.mark.slow(settings(THOROUGH)(given(**strategies)(body)))
    return fast, slow


# ------------------------------------------------------------------------------------------------ overrides
def _fmt(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


ODD = st.sampled_from([-1, 0, "x", "", "nan", "[1, 2]", "{a: 1}", None, 1.5])
OVERRIDES = {
    "train.steps": st.sampled_from([1, 2]) | ODD,
    "train.batch_size": st.sampled_from([1, 3, 4, 8, 10 ** 9]) | ODD,
    "train.grad_accum": st.sampled_from([1, 2, 3]) | ODD,
    "train.optim.lr": st.sampled_from([1e-3, 1e30, float("inf"), float("nan"), -1.0]) | ODD,
    "train.eval_every": st.sampled_from([1, 2, 3]) | ODD,
    "train.log_every": st.sampled_from([1, 2, 3]) | ODD,
    "train.optim.schedule": st.sampled_from(["linear", "cosine", "onecycle", "bogus"]),
    "train.losses.loops": st.sampled_from(["last", "all", "window", "x"]),
    "train.losses.window": st.sampled_from([1, 2, 5]) | ODD,
    "train.optim.betas": st.sampled_from(["[0.9, 0.99]", "[0.9]", "[2, 3]", "x"]),
    "train.optim.grad_clip": st.sampled_from([0, 1.0, -1]),
    "train.system.precision": st.sampled_from(["fp32", "bf16", "fp16", "x"]),
    "model.loops": st.sampled_from([1, 2, 3, 10 ** 7, 2 ** 64]) | ODD,
    "model.d_model": st.sampled_from([4, 7, 8, 10 ** 9, 2 ** 70]) | ODD,
    "model.n_layers": st.sampled_from([1, 2, 10 ** 6, 2 ** 64]) | ODD,
    "model.n_heads": st.sampled_from([1, 2, 3]) | ODD,
    "model.timestep": st.sampled_from([True, False, "maybe"]),
    "model.input_injection": st.booleans(),
    "model.dropout": st.sampled_from([0.0, 0.5, 1.5, -0.1]),
    "model.max_len": st.sampled_from([1, 4, 64, 10 ** 12]) | ODD,
    "task.n_train": st.sampled_from([1, 4, 32]) | ODD,
    "task.n_test": st.sampled_from([1, 8]) | ODD,
    "task.options.length": st.sampled_from([1, 2, 3, 4, 10 ** 12]) | ODD,
    "name": st.sampled_from(["run", "x" * 5000]) | st.text(min_size=4097, max_size=5000, alphabet="ab"),
    "task.name": st.sampled_from(["lcs", "edit_distance", "nope", "text"]),
    "task.data_dir": st.sampled_from(["/no/such/folder", "."]),
    "eval.max_loops": st.sampled_from([0, 1, 3, 100000]) | ODD,
    "eval.n": st.sampled_from([0, 4, -5]),
    "seed": st.sampled_from([0, 1, -1, 2 ** 63, 2 ** 70]),
    "task.seed": st.sampled_from([0, 1, -1, 2 ** 70]),
    "threads": st.sampled_from([0, 1, -1]),
    "device": st.sampled_from(["cpu", "auto", "tpu"]),
    "no.such.key": st.just(1),
    "model": st.sampled_from(["[1, 2]", "3"]),
    "task": st.sampled_from(["[lcs]", "lcs"]),
}


def _override_body(base, picks):
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        argv = ["train", str(base / "tiny.yaml"), f"out_dir={out}", "--quiet",
                *[f"{k}={_fmt(v)}" for k, v in picks]]
        code, err = run_cli(argv)
        assert_clean_exit(code, err, argv)
        assert_nothing_half_written(out)


_PICKS = st.lists(st.sampled_from(sorted(OVERRIDES)).flatmap(lambda k: st.tuples(st.just(k), OVERRIDES[k])),
                  min_size=1, max_size=4)
test_random_overrides, test_random_overrides_thorough = both({"picks": _PICKS}, _override_body)


# ------------------------------------------------------------------------------------------------ command lines
NUM = st.sampled_from(["0", "-3", "1", "2", "100000", "nan", "inf", "x", ""])
FLAGS = {
    "eval": ["--loops", "--max-loops", "--n", "--batch-size", "--device", "--json", "--no-loopwise"],
    "info": [],
    "generate": ["--prompt", "--max-new-tokens", "--temperature", "--top-k", "--top-p", "--loops", "--device"],
    "perplexity": ["--data", "--split", "--stride", "--block-size", "--batch-size", "--loops", "--device"],
    "data show": ["-n", "--split", "--verify"],
}
SWITCHES = {"--no-loopwise", "--verify"}


@st.composite
def command_lines(draw):
    cmd = draw(st.sampled_from(sorted(FLAGS)))
    target = draw(st.sampled_from(["run", "run/checkpoint", "data", "missing", "tiny.yaml"]))
    argv = [*cmd.split(), f"{{base}}/{target}"]
    if cmd == "perplexity":
        argv += ["--data", "{base}/" + draw(st.sampled_from(["data", "missing"]))]
    for flag in draw(st.lists(st.sampled_from(FLAGS[cmd]), max_size=3)) if FLAGS[cmd] else []:
        if flag in SWITCHES:
            argv.append(flag)
        elif flag == "--device":
            argv += [flag, draw(st.sampled_from(["cpu", "tpu", "cuda:x", "auto"]))]
        elif flag == "--json":
            argv += [flag, "{tmp}/" + draw(st.sampled_from(["r.json", "no/such/r.json", ""]))]
        else:
            argv += [flag, draw(NUM)]
    return argv


def _cli_body(base, argv):
    with tempfile.TemporaryDirectory() as tmp:
        real = [a.replace("{base}", str(base)).replace("{tmp}", tmp) for a in argv]
        code, err = run_cli(real)
        assert_clean_exit(code, err, real)
        assert_nothing_half_written(Path(tmp))
        assert_nothing_half_written(base / "run")


test_random_command_lines, test_random_command_lines_thorough = both({"argv": command_lines()}, _cli_body)


# ------------------------------------------------------------------------------------------------ damaged files
RUN_FILES = ["checkpoint/model.safetensors", "checkpoint/training_state.pt", "checkpoint/config.json",
             "config.yaml", "metrics.jsonl", "results.json"]
DATA_FILES = ["manifest.json", "train/inputs.npy", "train/targets.npy", "test/inputs.npy"]


def _damage(path: Path, how: str, where: float, bit: int) -> None:
    data = bytearray(path.read_bytes())
    if not data:
        return
    i = min(len(data) - 1, int(where * len(data)))
    if how == "truncate":
        path.write_bytes(bytes(data[:i]))
    else:
        data[i] ^= 1 << bit
        path.write_bytes(bytes(data))


def _damaged_run_body(base, victim, how, where, bit, command):
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        shutil.copytree(base / "run", run)
        _damage(run / victim, how, where, bit)
        argv = {"info": ["info", str(run / "checkpoint")],
                "eval": ["eval", str(run), "--no-loopwise", "--n", "4"],
                "resume": ["train", "--resume", str(run), "train.steps=3", "--quiet"]}[command]
        code, err = run_cli(argv)
        assert_clean_exit(code, err, argv)
        assert_nothing_half_written(run, contents=command == "resume" and code == 0)


test_damaged_run_folder, test_damaged_run_folder_thorough = both(
    {"victim": st.sampled_from(RUN_FILES), "how": st.sampled_from(["truncate", "flip"]),
     "where": st.floats(0, 1), "bit": st.integers(0, 7), "command": st.sampled_from(["info", "eval", "resume"])},
    _damaged_run_body)


def _damaged_data_body(base, victim, how, where, bit):
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        shutil.copytree(base / "data", data)
        _damage(data / victim, how, where, bit)
        argv = ["train", str(base / "tiny.yaml"), f"task.data_dir={data}", f"out_dir={Path(tmp) / 'run'}",
                "--quiet"]
        code, err = run_cli(argv)
        assert_clean_exit(code, err, argv)
        if victim.endswith(".npy"):
            assert code == 2, err                          # a changed array never trains silently
        assert_nothing_half_written(Path(tmp))


test_damaged_dataset, test_damaged_dataset_thorough = both(
    {"victim": st.sampled_from(DATA_FILES), "how": st.sampled_from(["truncate", "flip"]),
     "where": st.floats(0, 1), "bit": st.integers(0, 7)}, _damaged_data_body)


# ------------------------------------------------------------------------------------------------ random YAML
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 4), st.floats(allow_nan=True),
                    st.text(max_size=6), st.sampled_from(["lcs", "last", "linear", "cpu"]))
KEYS = st.sampled_from(["task", "model", "train", "eval", "log", "name", "seed", "name", "options", "loops",
                        "steps", "d_model", "n_train", "batch_size", "lr"]) | st.text(max_size=5)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3),
                      max_leaves=8)


def _yaml_body(base, doc, raw):
    import yaml

    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "c.yaml"
        if raw is not None:
            cfg.write_bytes(raw)
        else:
            cfg.write_text(yaml.safe_dump(doc))
        out = Path(tmp) / "run"
        # keep any run that the YAML leaves valid tiny (the defaults are a 1,000-step run)
        argv = ["train", str(cfg), f"out_dir={out}", "--quiet", "train.steps=1", "task.n_train=8", "task.n_test=4",
                "model.d_model=8", "model.n_heads=2", "eval.max_loops=2", "log.tensorboard=false"]
        code, err = run_cli(argv)
        assert_clean_exit(code, err, argv)
        assert_nothing_half_written(out)


test_random_yaml, test_random_yaml_thorough = both(
    {"doc": VALUES, "raw": st.none() | st.binary(max_size=40)}, _yaml_body)
