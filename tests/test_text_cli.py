"""The text commands end to end on a tiny corpus and checkpoint; user errors are one line with exit status 2."""

import json

import numpy as np
import pytest
import torch
from conftest import one_line_error

from loopformer import device
from loopformer.cli import main
from loopformer.model import LoopedTransformer, ModelConfig
from loopformer.model.io import save_checkpoint
from loopformer.text.dataset import TokenCorpus
from loopformer.text.perplexity import perplexity

WORDS = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis", "nobler"]


@pytest.fixture()
def setup(tmp_path, capsys):
    rng = np.random.default_rng(0)
    (tmp_path / "hamlet.txt").write_text("".join(" ".join(rng.choice(WORDS, 7)) + "\n" for _ in range(150)))
    assert main(["text", "prepare", str(tmp_path / "hamlet.txt"), "--out", str(tmp_path / "data"),
                 "--vocab-size", "280", "--quiet"]) == 0
    corpus = TokenCorpus(tmp_path / "data")
    torch.manual_seed(0)
    model = LoopedTransformer(ModelConfig(vocab_size=corpus.vocab_size, max_len=24, d_model=16, n_heads=2, loops=2,
                                          timestep=True))
    for blk in model.blocks:
        torch.nn.init.normal_(blk.modulation.weight, 0, 0.3)
    save_checkpoint(tmp_path / "ckpt", model, task={"name": "text", "data_dir": str(tmp_path / "data")})
    save_checkpoint(tmp_path / "bare", model)
    capsys.readouterr()
    return tmp_path, corpus, model


def test_prepare_cli(tmp_path, capsys):
    assert main(["text", "prepare", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "out")]) == 2
    one_line_error(capsys, "missing.txt")
    assert not (tmp_path / "out").exists()
    (tmp_path / "a.txt").write_text("".join(f"line {i} of the text\n" for i in range(60)))
    args = ["text", "prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "out"), "--vocab-size", "270",
            "--quiet"]
    assert main(args) == 0 and "prepared" in capsys.readouterr().out
    assert main(args) == 0 and "up to date" in capsys.readouterr().out
    assert main(args[:-3] + ["--vocab-size", "300", "--quiet"]) == 2
    one_line_error(capsys, "force")
    assert main(args + ["--perturb", "1.5"]) == 2
    one_line_error(capsys, "perturb")
    assert main(["text"]) == 2


def test_perplexity_cli(setup, capsys):
    tmp_path, corpus, model = setup
    out_json = tmp_path / "ppl.json"
    assert main(["perplexity", str(tmp_path / "ckpt"), "--data", str(tmp_path / "data"), "--split", "test",
                 "--stride", "8", "--estimate", "--estimate-iters", "3", "--quiet", "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert "test perplexity" in printed and "authors' protocol" in printed
    res = json.loads(out_json.read_text())
    ref = perplexity(model.eval(), corpus.tokens("test"), 24, 8, progress=False)
    assert res["perplexity"]["ppl"] == pytest.approx(ref.ppl, rel=1e-5)
    assert res["perplexity"]["tokens"] == len(corpus.tokens("test")) - 1
    assert res["estimate"]["method"] == "estimate"
    assert main(["perplexity", str(tmp_path / "ckpt"), "--data", str(tmp_path / "nowhere")]) == 2
    one_line_error(capsys, "not a prepared corpus")
    assert main(["perplexity", str(tmp_path / "nockpt"), "--data", str(tmp_path / "data")]) == 2
    one_line_error(capsys, "nockpt")
    assert main(["perplexity", str(tmp_path / "ckpt"), "--data", str(tmp_path / "data"), "--split", "dev"]) == 2
    one_line_error(capsys, "no 'dev' split")
    assert main(["perplexity", str(tmp_path / "ckpt"), "--data", str(tmp_path / "data"), "--block-size", "99"]) == 2
    one_line_error(capsys, "max_len")


def test_generate_cli(setup, capsys):
    tmp_path, corpus, model = setup
    args = ["generate", str(tmp_path / "ckpt"), "--prompt", "to be", "--prompt", "the question whether",
            "--max-new-tokens", "6", "--top-k", "5", "--seed", "3"]
    assert main(args) == 0                                        # tokenizer found through the checkpoint's task
    first = capsys.readouterr().out
    assert first.count("--- ") == 2 and "\nto be" in first and "\nthe question whether" in first
    assert main(args) == 0 and capsys.readouterr().out == first  # seeded
    assert main(args + ["--no-cache"]) == 0 and capsys.readouterr().out == first
    assert main(["generate", str(tmp_path / "bare"), "--prompt", "to be", "--data", str(tmp_path / "data"),
                 "--temperature", "0", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("to be")
    assert main(["generate", str(tmp_path / "bare"), "--prompt", "to be"]) == 2
    one_line_error(capsys, "--data")
    assert main(["generate", str(tmp_path / "ckpt"), "--prompt", "to be", "--max-new-tokens", "100"]) == 2
    one_line_error(capsys, "context")
    assert main(["generate", str(tmp_path / "ckpt"), "--prompt", "to be", "--top-p", "2"]) == 2
    one_line_error(capsys, "top_p")
    halted = args + ["--halt", "kl:1e-2,max=3"]                     # per-token exits: cache == recompute
    assert main(halted) == 0
    exits = capsys.readouterr().out
    assert main(halted + ["--no-cache"]) == 0 and capsys.readouterr().out == exits
    assert main(["generate", str(tmp_path / "ckpt"), "--prompt", "to be", "--halt", "kl"]) == 2
    one_line_error(capsys, "CRITERION:THRESHOLD")


def test_generate_with_exits_in_both_schedules(setup, capsys, monkeypatch):
    tmp_path, corpus, model = setup
    args = ["generate", str(tmp_path / "ckpt"), "--prompt", "to be", "--prompt", "the question whether",
            "--max-new-tokens", "6", "--temperature", "0", "--halt", "entropy:5"]
    assert main(args) == 0                                        # depth-wise by default
    deep = capsys.readouterr().out
    assert main(args + ["--schedule", "step"]) == 0 and capsys.readouterr().out == deep
    assert deep.count("--- ") == 2
    assert main(args + ["--schedule", "sideways"]) == 2
    monkeypatch.setattr(device.shutil, "which", lambda name: None)              # no C++ compiler: refused
    capsys.readouterr()
    assert main(args + ["--compile"]) == 2
    one_line_error(capsys, "C++ compiler")


def test_generate_from_a_run_folder_and_non_utf8_prompts(setup, capsys):
    tmp_path, corpus, model = setup
    save_checkpoint(tmp_path / "run" / "checkpoint", model, task={"name": "text", "data_dir": str(tmp_path / "data")})
    args = ["--prompt", "to be", "--max-new-tokens", "4", "--temperature", "0"]
    assert main(["generate", str(tmp_path / "ckpt"), *args]) == 0
    want = capsys.readouterr().out
    assert main(["generate", str(tmp_path / "run"), *args]) == 0          # the run folder names its checkpoint
    assert capsys.readouterr().out == want
    bad = b"to \xff be".decode("utf-8", "surrogateescape")                  # how argv delivers undecodable bytes
    assert main(["generate", str(tmp_path / "ckpt"), "--prompt", bad]) == 2
    one_line_error(capsys, "not valid UTF-8")


def test_generate_caps_loops_and_sizes_the_cache_first(setup, capsys):
    tmp_path, corpus, model = setup
    assert main(["generate", str(tmp_path / "ckpt"), "--prompt", "to be", "--max-new-tokens", "4",
                 "--loops", "100000000"]) == 2
    one_line_error(capsys, "loops must be in 1..1024")
    from loopformer.model import memory
    from loopformer.text.generate import SamplingConfig, generate

    budget = sum(memory.estimate(model.config, batch=2, seq_len=4, loops=900, cache_len=4).values())
    with pytest.MonkeyPatch.context() as mp:      # a machine with less free memory than this cache needs
        mp.setattr(memory, "available_bytes", lambda device="cpu": budget - 1)
        with pytest.raises(Exception, match="generation needs about"):
            generate(model, [[1, 2], [3, 4]], SamplingConfig(max_new_tokens=2, loops=900))
        assert generate(model, [[1, 2], [3, 4]], SamplingConfig(max_new_tokens=2, loops=900),
                        memory_check=False).tokens
