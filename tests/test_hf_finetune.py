"""`loopformer hf finetune`: LoRA adapters (peft) on the shared block through the transformers class, saved with
the run and merged into a loopformer checkpoint — the merged model's logits equal the base with the saved adapters
loaded by peft, only the adapters train, the frozen weights stay; `--full` trains every weight; errors are one line
and exit status 2."""

from __future__ import annotations

import importlib.util
import json
import re

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from conftest import one_line_error, text_checkpoint  # noqa: E402

from loopformer.cli import main  # noqa: E402
from loopformer.hf.finetune import TARGETS, load_adapter  # noqa: E402
from loopformer.hf.model import LoopformerForCausalLM  # noqa: E402
from loopformer.model import LoopedTransformer, ModelConfig  # noqa: E402
from loopformer.model.io import load, save_checkpoint  # noqa: E402
from loopformer.text.perplexity import perplexity  # noqa: E402


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("finetune")
    corpus, _ = text_checkpoint(tmp, {"plays.txt": 200})
    return tmp, corpus


def test_lora_trains_the_adapters_and_merges_them(text_run, capsys):
    tmp, corpus = text_run
    out = tmp / "lora"
    assert main(["hf", "finetune", str(tmp / "run"), "--out", str(out), "--steps", "6", "--batch-size", "4",
                 "--rank", "4", "--lr", "1e-2"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith(f"wrote {out}: lora, ")
    res = json.loads((out / "finetune.json").read_text())
    base = load(tmp / "run")
    targets = [m for n, m in base.named_modules() if isinstance(m, torch.nn.Linear) and re.fullmatch(TARGETS, n)]
    assert len(targets) == 4                      # qkv, attn.proj, mlp.fc, mlp.proj (not the timestep modulation)
    assert res["trainable_parameters"] == sum(4 * (m.in_features + m.out_features) for m in targets)
    assert res["model_parameters"] == sum(p.numel() for p in base.parameters())
    merged = load(out)                                                # the run folder's merged checkpoint
    x = torch.as_tensor(np.asarray(corpus.tokens("test"))[:40].astype(np.int64)).view(2, 20)
    with_adapter = load_adapter(LoopformerForCausalLM.from_loopformer(load(tmp / "run")), out / "adapter").eval()
    with torch.no_grad():
        want = with_adapter(input_ids=x).logits
        got = merged(x).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    b, m = base.state_dict(), merged.state_dict()
    adapted = {f"blocks.0.{t}.weight" for t in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")}
    for name in b:                   # the block's linear maps moved; the embedding, head, norms, modulation did not
        assert (not torch.equal(b[name], m[name])) == (name in adapted), name
    after = perplexity(merged, np.asarray(corpus.tokens("test")), block_size=24, progress=False).ppl
    assert after == pytest.approx(res["perplexity_after"], rel=1e-6)
    # the merged run exports for transformers like any run
    assert main(["hf", "export", str(out), "--out", str(tmp / "lora-hf")]) == 0


def test_full_finetuning_trains_every_weight(text_run, capsys):
    tmp, _ = text_run
    out = tmp / "full"
    assert main(["hf", "finetune", str(tmp / "run"), "--out", str(out), "--full", "--steps", "4",
                 "--batch-size", "4"]) == 0
    res = json.loads((out / "finetune.json").read_text())
    assert res["method"] == "full" and res["trainable_parameters"] == res["model_parameters"]
    assert not (out / "adapter").exists() and (out / "checkpoint" / "model.safetensors").is_file()



def test_errors_are_one_line(text_run, tmp_path, capsys, monkeypatch):
    tmp, _ = text_run
    run = str(tmp / "run")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    assert main(["hf", "finetune", run, "--out", str(tmp_path / "mine"), "--steps", "1"]) == 2
    one_line_error(capsys, "notes.txt")
    assert main(["hf", "finetune", run, "--out", str(tmp_path / "a"), "--steps", "0"]) == 2
    one_line_error(capsys, "at least 1")
    assert main(["hf", "finetune", run, "--out", str(tmp_path / "a"), "--lr", "nan"]) == 2
    one_line_error(capsys, "--lr must be a positive number")
    save_checkpoint(tmp_path / "cls", LoopedTransformer(ModelConfig(vocab_size=11, max_len=8, d_model=16, n_heads=2,
                                                                    causal=False)))
    assert main(["hf", "finetune", str(tmp_path / "cls"), "--out", str(tmp_path / "c")]) == 2
    one_line_error(capsys, "causal")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    assert main(["hf", "finetune", run, "--out", str(tmp_path / "b")]) == 2
    one_line_error(capsys, "pip install 'loopformer[hf,lora]'")
