"""`loopformer lm-eval`: lm-evaluation-harness through the transformers class on tasks built from a prepared corpus.
lm_eval's token perplexity equals loopformer's own perplexity over the same documents and windows at three loop
budgets; the next-line items are drawn as documented; errors are one line and exit status 2."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

from conftest import one_line_error, text_checkpoint  # noqa: E402

from loopformer.cli import main  # noqa: E402
from loopformer.hf import lmeval  # noqa: E402
from loopformer.model import LoopedTransformer, ModelConfig  # noqa: E402
from loopformer.model.io import save_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    """A tiny corpus of three documents and a TMLT checkpoint on it inside a run folder."""
    tmp = tmp_path_factory.mktemp("lmeval")
    corpus, _ = text_checkpoint(tmp, {"a.txt": 60, "b.txt": 60, "c.txt": 60}, vocab_size=300,
                                prepare=("--test-fraction", "0.3"), modulation_std=0.3)
    return tmp, corpus


def test_lm_eval_perplexity_equals_loopformers_at_three_budgets(text_run, capsys):
    tmp, corpus = text_run
    out = tmp / "eval"
    assert main(["lm-eval", str(tmp / "run"), "--out", str(out), "--loops", "1,2,4", "--items", "6"]) == 0
    res = json.loads((out / "results.json").read_text())
    meta = res["loopformer_lm_eval"]
    assert meta["documents"] == 3 and meta["documents_same_tokens"] == 3      # the tokenizers agree on every doc
    assert [r["loops"] for r in res["budgets"]] == [1, 2, 4]
    for row in res["budgets"]:
        check = row["check"]
        assert abs(check["rel_diff_docs"]) < 1e-5, row                       # same documents and windows
        assert abs(check["rel_diff_split"]) < 0.2, row                        # one stream: close, not equal
        acc = row["metrics"]["loopformer_next_line"]["acc"]
        assert 0 <= acc <= 1
    flops = [r["flops_per_token"] for r in res["budgets"]]
    assert flops == sorted(flops) and flops[0] > 0
    assert (out / "results.md").read_text().count("\n| ") == 3 + 1
    assert (out / "lm_eval.png").stat().st_size > 0
    assert {p.name for p in (out / "tasks").iterdir()} >= {"loopformer_ppl.yaml", "loopformer_next_line.yaml",
                                                             "ppl.jsonl", "next_line.jsonl", "loopformer_tasks.py"}
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4 and lines[-1].startswith("wrote ")                # one line per budget, then the files
    # a second run into the same folder replaces what the first wrote
    assert main(["lm-eval", str(tmp / "run"), "--out", str(out), "--loops", "2", "--tasks", "ppl"]) == 0
    assert [r["loops"] for r in json.loads((out / "results.json").read_text())["budgets"]] == [2]


def test_documents_and_next_line_items():
    toks = np.array([5, 6, 0, 0, 7, 0, 8, 9])
    assert [d.tolist() for d in lmeval.documents(toks, 0)] == [[5, 6], [7], [8, 9]]
    texts = ["\n".join(f"line number {i} of document {d} here" for i in range(30)) for d in range(2)]
    items = lmeval.next_line_items(texts, 10, seed=3)
    assert items == lmeval.next_line_items(texts, 10, seed=3) and len(items) == 10
    for it in items:
        assert len(it["choices"]) == lmeval.CHOICES == len(set(it["choices"]))
        answer = it["choices"][it["label"]]
        doc = next(t for t in texts if it["context"] + answer in t)          # the true line follows its context
        assert it["context"].endswith("\n") and len(it["context"]) <= lmeval.CONTEXT_CHARS and doc



def test_errors_are_one_line(text_run, tmp_path, capsys, monkeypatch):
    tmp, _ = text_run
    run = str(tmp / "run")
    assert main(["lm-eval", run, "--out", str(tmp_path / "a"), "--tasks", "hellaswag"]) == 2
    one_line_error(capsys, "unknown task 'hellaswag'")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "notes.txt").write_text("mine")
    assert main(["lm-eval", run, "--out", str(tmp_path / "b")]) == 2
    one_line_error(capsys, "notes.txt")
    assert main(["lm-eval", run, "--out", str(tmp_path / "c"), "--split", "dev"]) == 2
    one_line_error(capsys, "no split 'dev'")
    save_checkpoint(tmp_path / "cls", LoopedTransformer(ModelConfig(vocab_size=11, max_len=8, d_model=16, n_heads=2,
                                                                    causal=False)))
    assert main(["lm-eval", str(tmp_path / "cls"), "--out", str(tmp_path / "e")]) == 2
    one_line_error(capsys, "causal")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a))
    assert main(["lm-eval", run, "--out", str(tmp_path / "d")]) == 2
    one_line_error(capsys, "pip install 'loopformer[hf,lmeval]'")


@pytest.mark.slow
def test_lm_eval_command_line_on_an_exported_folder(text_run, tmp_path):
    """The documented path without loopformer's command: `lm_eval --model hf` on the exported folder with its remote
    code, the loop count as a config field, on the task folder `loopformer lm-eval` wrote — the same perplexity."""
    import os
    import subprocess
    import sys
    tmp, _ = text_run
    out = tmp_path / "eval"
    assert main(["lm-eval", str(tmp / "run"), "--out", str(out), "--loops", "2", "--tasks", "ppl"]) == 0
    want = json.loads((out / "results.json").read_text())["budgets"][0]["metrics"]["loopformer_ppl"]
    assert main(["hf", "export", str(tmp / "run"), "--out", str(tmp_path / "hf")]) == 0
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
                           f"pretrained={tmp_path / 'hf'},trust_remote_code=True,inference_loops=2,max_length=24",
                           "--tasks", "loopformer_ppl", "--include_path", str(out / "tasks"), "--device", "cpu",
                           "--batch_size", "4", "--output_path", str(tmp_path / "cli")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(next((tmp_path / "cli").rglob("results_*.json")).read_text())["results"]["loopformer_ppl"]
    assert got["token_perplexity,none"] == pytest.approx(want["token_perplexity"], rel=1e-5)
