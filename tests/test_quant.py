"""Weight-only quantization of the shared block (loopformer.eval.quant, torchao): only the block's linear maps are
quantized, the quantized model stays close to full precision, `eval --quant int8` prints the metric after every
loop to 4r beside full precision with both drift verdicts (its full-precision curve the plain `eval`'s), the
quantized export loads back quantized with the same logits; errors are one line and exit status 2."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch

pytest.importorskip("torchao")

from loopformer.cli import main  # noqa: E402
from loopformer.eval.quant import block_maps, quantize_block, quantized_bytes  # noqa: E402
from loopformer.model import LoopedTransformer, ModelConfig  # noqa: E402
from loopformer.train.config import load_run_config  # noqa: E402
from loopformer.train.trainer import train  # noqa: E402

TINY = ["task.name=pointer_chase", "task.options={symbols: 6, hops: 2}", "task.n_train=64", "task.n_test=24",
        "model.d_model=32", "model.n_heads=2", "model.loops=2", "model.input_injection=true"]


def _model() -> LoopedTransformer:
    torch.manual_seed(0)
    return LoopedTransformer(ModelConfig(vocab_size=40, max_len=16, d_model=32, n_heads=2, loops=3, timestep=True,
                                         input_injection=True)).eval()


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_only_the_blocks_linear_maps_are_quantized(kind):
    m = _model()
    q = quantize_block(m, kind)
    maps = set(block_maps(m))
    assert maps == {"blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.fc", "blocks.0.mlp.proj"}
    for name, mod in q.named_modules():
        if isinstance(mod, torch.nn.Linear):
            plain = type(mod.weight) in (torch.Tensor, torch.nn.Parameter)
            assert plain == (name not in maps), name            # the modulation and the head stay as they are
    assert type(m.blocks[0].attn.qkv.weight) is torch.nn.Parameter  # the original is untouched (a copy)
    x = torch.randint(0, 40, (3, 12))
    with torch.no_grad():
        want, got = m(x).logits, q(x).logits
    rel = float((got - want).norm() / want.norm())
    assert rel < (0.02 if kind == "int8" else 0.2), rel
    if kind == "int8":                         # int8 data and a scale per row: under a third of the fp32 bytes
        block = sum(p.numel() * 4 for n, p in m.named_parameters() if n.rsplit(".", 1)[0] in maps)
        saved = quantized_bytes(m) - quantized_bytes(q)
        assert saved > 0.6 * block


@pytest.fixture(scope="module")
def task_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("quant") / "run"
    train(load_run_config(None, [*TINY, "train.steps=2", "train.system.compile=false", "eval.drift=false",
                                 f"out_dir={run}"]))
    return run


def test_eval_quant_prints_the_loop_profile_beside_full_precision(task_run, tmp_path, capsys):
    out = tmp_path / "q.json"
    assert main(["eval", str(task_run), "--quant", "int8", "--quiet", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    res = json.loads(out.read_text())
    r = res["trained_loops"]
    prof = res["drift"]["metric_per_loop"], res["quant"]["drift"]["metric_per_loop"]
    assert len(prof[0]) == len(prof[1]) == 4 * r
    assert "int8 weight-only quantization of the shared block, loop by loop" in text
    assert text.count("\n| ") >= 4 * r and f"| {r} (r) |" in text
    assert f"drift verdict: full precision **{res['drift']['verdict']}**, int8 **{res['quant']['drift']['verdict']}**" \
        in text
    assert main(["eval", str(task_run), "--quiet", "--max-loops", str(4 * r), "--json", str(tmp_path / "f.json")]) == 0
    plain = json.loads((tmp_path / "f.json").read_text())["loopwise"]
    assert [row["accuracy"] for row in plain] == pytest.approx(prof[0])     # the full-precision curve is eval's


def test_errors_are_one_line(task_run, capsys, monkeypatch):
    assert main(["eval", str(task_run), "--quant", "int3", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--quant takes one of int8, int4" in err
    assert main(["eval", str(task_run), "--quant", "int8", "--budgets", "1,2", "--quiet"]) == 2
    assert "--quant compares" in capsys.readouterr().err
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    assert main(["eval", str(task_run), "--quant", "int8", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'loopformer[quant]'" in err


def test_the_quantized_export_loads_back_quantized(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    import loopformer.hf  # noqa: F401
    from loopformer.model.io import save_checkpoint
    from loopformer.text.dataset import TokenCorpus
    rng = np.random.default_rng(0)
    words = "to be or not that is the question whether tis nobler".split()
    (tmp_path / "t.txt").write_text("".join(" ".join(rng.choice(words, 6)) + "\n" for _ in range(100)))
    assert main(["text", "prepare", str(tmp_path / "t.txt"), "--out", str(tmp_path / "data"), "--vocab-size", "280",
                 "--quiet"]) == 0
    corpus = TokenCorpus(tmp_path / "data")
    torch.manual_seed(0)
    model = LoopedTransformer(ModelConfig(vocab_size=corpus.vocab_size, max_len=24, d_model=32, n_heads=2, loops=2,
                                          timestep=True)).eval()
    save_checkpoint(tmp_path / "run" / "checkpoint", model, task={"name": "text", "data_dir": str(tmp_path / "data")})
    assert main(["hf", "export", str(tmp_path / "run"), "--out", str(tmp_path / "full")]) == 0
    assert main(["hf", "export", str(tmp_path / "run"), "--out", str(tmp_path / "int8"), "--quant", "int8"]) == 0
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "int8")
    assert type(back.model.blocks[0].mlp.fc.weight).__name__ == "Int8Tensor"
    assert type(back.model.blocks[0].modulation.weight) is torch.nn.Parameter
    x = torch.randint(0, corpus.vocab_size, (2, 20))
    with torch.no_grad():
        want = quantize_block(model, "int8")(x).logits
        got = back(input_ids=x, use_cache=False).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)        # the same quantized model, loaded back
    size = {k: (tmp_path / k / "model.safetensors").stat().st_size for k in ("full", "int8")}
    assert size["int8"] < size["full"]
    assert main(["hf", "export", str(tmp_path / "run"), "--out", str(tmp_path / "int4"), "--quant", "int4"]) == 2
