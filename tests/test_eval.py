"""Evaluation and loop-wise evaluation: every loop's metric equals a separate run of the model with that many
loops scored by the task's own metric; the `eval` command on a checkpoint; text and vector evaluation."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_train import TINY

from loopformer.cli import main
from loopformer.eval.evaluate import evaluate
from loopformer.model import LoopedTransformer
from loopformer.sources import make_data
from loopformer.train.config import load_run_config


def _model_and_data(*extra):
    cfg = load_run_config(None, [*TINY, *extra])
    torch.manual_seed(1)
    model = LoopedTransformer(cfg.model)
    with torch.no_grad():   # a random but not degenerate model: scale the read-out so argmaxes differ per loop
        model.head.proj.weight.mul_(20)
    return cfg, model, make_data(cfg.task)


def test_loopwise_equals_separate_runs_beyond_trained_loops():
    cfg, model, data = _model_and_data("model.loops=2", "model.timestep=true")
    with torch.no_grad():
        for blk in model.blocks:   # non-zero modulation so the loop index matters
            blk.modulation.weight.normal_(0, 0.5)
    res = evaluate(model, data, loops=2, max_loops=5, batch_size=7)
    assert res["loops"] == 2 and res["max_loops"] == 5 and [p["loop"] for p in res["loopwise"]] == [1, 2, 3, 4, 5]
    x = torch.as_tensor(np.asarray(data.test["inputs"], dtype=np.int64))
    accs = []
    for t in range(1, 6):
        with torch.no_grad():
            pred = model(x, loops=t).logits.argmax(-1).numpy()
        ref = data.task.metrics(pred, data.test)
        accs.append(ref["accuracy"])
        assert res["loopwise"][t - 1] == pytest.approx({"loop": t, **ref}, nan_ok=True)
    assert res["metrics"] == pytest.approx(data.task.metrics(
        model(x, loops=2).logits.argmax(-1).detach().numpy(), data.test), nan_ok=True)
    # exact match by hand for one loop: every supervised position right
    with torch.no_grad():
        pred = model(x, loops=3).logits.argmax(-1).numpy()
    tgt = data.test["targets"]
    by_hand = np.mean([(pred[i][tgt[i] != -100] == tgt[i][tgt[i] != -100]).all() for i in range(len(tgt))])
    assert accs[2] == pytest.approx(by_hand)


def test_eval_without_loopwise_and_limit():
    cfg, model, data = _model_and_data()
    res = evaluate(model, data, loopwise=False, limit=10)
    assert res["loopwise"] == [] and res["max_loops"] == 2
    x = torch.as_tensor(np.asarray(data.test["inputs"][:10], dtype=np.int64))
    pred = model(x).logits.argmax(-1).detach().numpy()
    assert res["metrics"]["accuracy"] == pytest.approx(
        data.task.metrics(pred, {k: v[:10] for k, v in data.test.items()})["accuracy"])


def test_eval_command_on_checkpoint(tmp_path, capsys):
    from loopformer.train.trainer import train

    cfg = load_run_config(None, [*TINY, "train.steps=3", f"out_dir={tmp_path / 'r'}"])
    res = train(cfg)
    out_json = tmp_path / "e.json"
    assert main(["eval", str(tmp_path / "r"), "--max-loops", "6", "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert "loop-wise accuracy" in printed and "<- trained r" in printed
    ev = json.loads(out_json.read_text())
    assert [p["loop"] for p in ev["loopwise"]] == list(range(1, 7))
    assert ev["metrics"] == pytest.approx(res["test"])             # the same number the training run recorded
    for a, b in zip(ev["loopwise"][:4], res["loopwise"]):
        assert a == pytest.approx(b)
    assert main(["eval", str(tmp_path / "r" / "checkpoint"), "--loops", "4", "--no-loopwise"]) == 0
    assert main(["eval", str(tmp_path / "nothing")]) == 2


def test_text_eval_matches_cross_entropy(tmp_path):
    """Perplexity per loop from windows of a token corpus equals exp(mean cross-entropy) computed by hand."""
    from loopformer.text.corpus import PrepareOptions, prepare_corpus

    src = tmp_path / "text.txt"
    rng = np.random.default_rng(0)
    words = ["the", "loop", "model", "learns", "a", "task", "and", "then", "stops"]
    src.write_text("\n".join(" ".join(rng.choice(words, 12)) for _ in range(300)))
    corpus = tmp_path / "corpus"
    prepare_corpus(str(src), corpus, PrepareOptions(tokenizer="bpe", vocab_size=300), progress=False)
    cfg = load_run_config(None, ["task.name=text", f"task.data_dir={corpus}", "task.block_size=16",
                                 "task.eval_windows=5", "model.d_model=16", "model.n_heads=2", "model.loops=2"])
    torch.manual_seed(0)
    model = LoopedTransformer(cfg.model)
    data = make_data(cfg.task)
    res = evaluate(model, data, loops=2, max_loops=3, batch_size=2)
    toks = np.asarray(data.corpus.tokens("val"), dtype=np.int64)
    win = torch.as_tensor(np.stack([toks[i * 16:i * 16 + 17] for i in range(5)]))
    for t in (1, 2, 3):
        with torch.no_grad():
            logits = model(win[:, :-1], loops=t).logits
        ce = F.cross_entropy(logits.flatten(0, 1), win[:, 1:].flatten()).item()
        assert res["loopwise"][t - 1]["loss"] == pytest.approx(ce, rel=1e-5)
        assert res["loopwise"][t - 1]["ppl"] == pytest.approx(math.exp(ce), rel=1e-5)
    assert res["metric"] == "ppl" and not res["higher_is_better"]
    # the perplexity says what it covers: the first 5 windows of the split, not all of it
    total = (len(toks) - 1) // 16
    m = res["metrics"]
    assert (m["windows"], m["windows_in_split"], m["tokens"], m["tokens_in_split"]) == (5, total, 80, len(toks) - 1)
    assert m["eval_split"] == "val" and m["whole_split"] is False
    assert m["ppl_over"] == f"val: first 5 of {total:,} non-overlapping 16-token windows (80 of {len(toks) - 1:,} " \
                            f"next-token targets)"
    whole = evaluate(model, data, loops=2, loopwise=False, limit=10 ** 6)["metrics"]
    assert whole["whole_split"] is True and whole["windows"] == total and whole["tokens"] == total * 16


def test_vector_eval_matches_squared_error():
    cfg = load_run_config(None, ["task.name=icl", "task.options={function_class: linear, n_dims: 3}", "task.points=4",
                                 "task.n_test=9", "model.d_model=16", "model.n_heads=2", "model.loops=2"])
    torch.manual_seed(0)
    model = LoopedTransformer(cfg.model)
    data = make_data(cfg.task)
    res = evaluate(model, data, loops=2, max_loops=2, batch_size=4)
    x = torch.as_tensor(data.test["inputs"])
    with torch.no_grad():
        out = model(x).logits[..., 0].numpy()
    ys = data.test["inputs"][:, 1::2, 3]
    err = (out[:, 0::2] - ys) ** 2 / 3
    assert res["metrics"]["mse"] == pytest.approx(err.mean(), rel=1e-5)
    assert res["metrics"]["mse_last"] == pytest.approx(err[:, -1].mean(), rel=1e-5)


def test_eval_on_other_data_longer_strings_and_another_folder(tmp_path, capsys):
    """A model trained on ED-6 (with room for longer rows: model.max_len=22) evaluated on ED-8 from the command line,
    on a dataset folder of another seed, and refused with one line where the data cannot fit."""
    from loopformer.cli import main

    yaml = tmp_path / "ed.yaml"
    yaml.write_text("task: {name: edit_distance, options: {length: 6, alphabet_min: 3, alphabet_max: 4, "
                    "alphabet_pool: 4}, n_train: 128, n_test: 32, answer_only: true}\n"
                    "model: {d_model: 16, n_heads: 2, loops: 2, input_injection: true}\n"
                    "train: {steps: 3, batch_size: 16, log_every: 1}\neval: {max_loops: 2}\n"
                    "log: {tensorboard: false, progress: false}\n")
    for name, extra in (("wide", ["model.max_len=22"]), ("narrow", [])):
        assert main(["train", str(yaml), f"out_dir={tmp_path / name}", "--quiet", *extra]) == 0
        assert capsys.readouterr().out.startswith("test: accuracy=")        # --quiet keeps the metrics line
    out = tmp_path / "ed8.json"
    assert main(["eval", str(tmp_path / "wide"), "--task-opt", "length=8", "--no-loopwise", "--quiet",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["data"]["options"]["length"] == 8 and res["data"]["n_test"] == 32 and "length': 8" in printed
    acc8 = res["metrics"]["accuracy"]
    own = json.loads((tmp_path / "wide" / "results.json").read_text())
    assert own["task"]["options"]["length"] == 6
    assert main(["eval", str(tmp_path / "narrow"), "--task-opt", "length=8", "--no-loopwise"]) == 2
    assert "model.max_len=22" in capsys.readouterr().err
    data = tmp_path / "ed6-seed5"
    assert main(["data", "gen", "edit_distance", "--out", str(data), "--train", "40", "--test", "24", "--seed", "5",
                 "--opt", "length=6", "alphabet_min=3", "alphabet_max=4", "alphabet_pool=4"]) == 0
    assert main(["eval", str(tmp_path / "wide"), "--data", str(data), "--no-loopwise", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["data"]["data_dir"] == str(data) and res["data"]["n_test"] == 24
    other = tmp_path / "lcs"
    assert main(["data", "gen", "lcs", "--out", str(other), "--train", "8", "--test", "8", "--opt", "length=6"]) == 0
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "wide"), "--data", str(other)]) == 2
    assert "holds the lcs task" in capsys.readouterr().err
    assert main(["eval", str(tmp_path / "wide"), "--data", str(data), "--task-opt", "length=8"]) == 2
    assert "exclude each other" in capsys.readouterr().err
    assert main(["eval", str(tmp_path / "wide"), "--task-opt", "length=-3"]) == 2
    assert "length" in capsys.readouterr().err
    # the same across a folder of runs: loopformer report --task-opt writes generalisation.md
    assert main(["report", str(tmp_path), "--task-opt", "length=8", "--out", str(tmp_path / "rep")]) == 0
    gen = (tmp_path / "rep" / "generalisation.md").read_text()
    assert "length=8" in gen and gen.count("| ED (6) |") == 2
    wide = next(line for line in gen.splitlines() if "| wide |" in line)
    assert f"→ {100 * acc8:.1f}" in wide                                 # the same number as `eval --task-opt`
    assert "does not fit" in next(line for line in gen.splitlines() if "| narrow |" in line)
