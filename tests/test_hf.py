"""The transformers classes (`loopformer.hf`): logits equal to `LoopedTransformer`'s at three loop counts, with and
without the per-(loop, layer) cache; greedy `generate` token for token as loopformer's generation; the
self-contained remote-code model against loopformer; save_pretrained / from_pretrained and AutoModelForCausalLM;
`loopformer hf export` on a tiny text checkpoint, its tokenizer and its errors (one line, exit status 2)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import one_line_error, text_checkpoint  # noqa: E402

import loopformer.hf  # noqa: E402  (registers the Auto classes)
from loopformer.cli import main  # noqa: E402
from loopformer.errors import UserError  # noqa: E402
from loopformer.hf import modeling_loopformer as remote  # noqa: E402
from loopformer.hf.configuration_loopformer import MODEL_FIELDS, LoopformerConfig  # noqa: E402
from loopformer.hf.model import LoopformerCache, LoopformerForCausalLM, hf_config  # noqa: E402
from loopformer.hf.tokenizer import bpe_from_ranks, byte_symbols  # noqa: E402
from loopformer.model import LoopedTransformer, ModelConfig  # noqa: E402
from loopformer.model.io import save_checkpoint  # noqa: E402
from loopformer.text.generate import SamplingConfig, generate, generate_text  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(vocab_size=40, max_len=32, d_model=16, n_heads=2, loops=3)
VARIANTS = {   # a plain looped model; TMLT with injection, own loops past r and tied embeddings; a rotary TMLT of
               # two layers with normalised time, a zero start, a window and biases; the authors' looped layer
    "looped": ModelConfig(**TINY),
    "tmlt": ModelConfig(**TINY, timestep=True, input_injection=True, timestep_past="own", tie_embeddings=True),
    "tmlt-rope": ModelConfig(**{**TINY, "n_layers": 2}, pos="rope", timestep=True, timestep_time="normalized",
                             timestep_past="clamp", input_injection=True, start_state="zeros", attn_window=5,
                             bias=True, activation="silu"),
    "authors": ModelConfig(**TINY, compat="authors", input_injection=True),
}


def make(name: str, seed: int = 0) -> LoopedTransformer:
    """A random model of the variant, its modulations drawn away from their start (else TMLT is the looped model)."""
    torch.manual_seed(seed)
    model = LoopedTransformer(VARIANTS[name]).eval()
    with torch.no_grad():
        for blk in model.blocks:
            if blk.modulation is not None:
                torch.nn.init.normal_(blk.modulation.weight, 0, 0.3)
            if blk.past_modulation is not None:
                torch.nn.init.normal_(blk.past_modulation, 0, 0.3)
    return model


def both(model: LoopedTransformer):
    """The transformers class around `model` and the remote-code class with its weights."""
    hf = LoopformerForCausalLM.from_loopformer(model, eos_token_id=0, pad_token_id=0).eval()
    alone = remote.LoopformerForCausalLM(hf.config).eval()
    alone.load_state_dict(hf.state_dict())
    return hf, alone


def prompts(seed: int = 1):
    """Two left-padded prompts of lengths 6 and 3 (pad id 0), as token lists and as ids + mask."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(1, 40, (6,), generator=g).tolist(), torch.randint(1, 40, (3,), generator=g).tolist()]
    ids = torch.tensor([rows[0], [0, 0, 0] + rows[1]])
    mask = torch.tensor([[1] * 6, [0, 0, 0, 1, 1, 1]])
    return rows, ids, mask


def cached(out):
    """The cache of a model output (`cache`; `past_key_values` before transformers 5.24)."""
    return getattr(out, remote.CACHE_FIELD)


def test_config_holds_every_model_field_with_its_default():
    want = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(ModelConfig)}
    assert MODEL_FIELDS == want
    cfg = hf_config(VARIANTS["tmlt"], inference_loops=6)
    assert cfg.model_type == "loopformer" and cfg.hidden_size == 16 and cfg.num_hidden_layers == 1
    assert cfg.tie_word_embeddings and cfg.inference_loops == 6
    back = LoopformerConfig.from_dict(cfg.to_dict())
    assert back.model_fields() == dataclasses.asdict(VARIANTS["tmlt"])


@pytest.mark.parametrize("name", sorted(VARIANTS))
@torch.no_grad()
def test_logits_equal_loopformers_with_and_without_the_cache(name):
    model = make(name)
    hf, alone = both(model)
    _, ids, mask = prompts()
    for R in (1, 3, 7):                          # fewer loops, the trained r, past r
        ref = model(ids, loops=R, attn_mask=mask.bool()).logits
        for m in (hf, alone):
            assert torch.allclose(m(ids, attention_mask=mask, loops=R, use_cache=False).logits, ref, atol=1e-5)
            out = m(ids[:, :4], attention_mask=mask[:, :4], loops=R, use_cache=True)    # the prompt, then
            steps = [out.logits]
            for j in (4, 5):                                                          # one token at a time
                out = m(ids[:, j:j + 1], attention_mask=mask[:, :j + 1], loops=R, cache=cached(out))
                steps.append(out.logits)
            assert torch.allclose(torch.cat(steps, 1), ref, atol=1e-5), (name, R, type(m).__module__)
    plain = model(ids).logits                    # the config's loops without a mask
    assert torch.allclose(hf(ids).logits, plain, atol=1e-5) and torch.allclose(alone(ids).logits, plain, atol=1e-5)


@torch.no_grad()
def test_the_cache_is_loopformers_with_a_slot_per_loop_and_layer():
    hf, _ = both(make("tmlt-rope"))
    _, ids, mask = prompts()
    cache = cached(hf(ids, attention_mask=mask, loops=4, use_cache=True))
    assert isinstance(cache, LoopformerCache) and cache.loops == 4 and len(cache.layers) == 4 * 2
    assert cache.get_seq_length() == 6 and cache.layers[5].keys.shape == (2, 2, 6, 8)
    with pytest.raises(UserError, match="made for 4 loops"):
        hf(ids[:, :1], attention_mask=torch.ones(2, 7), loops=3, cache=cache)
    with pytest.raises(UserError, match="LoopformerCache"):
        hf(ids, use_cache=True, cache=transformers.DynamicCache())
    small = hf.new_cache(2, loops=4)             # grows past its room, keeping what it holds
    first = hf(ids, attention_mask=mask, loops=4, cache=small, use_cache=True).logits
    assert torch.equal(first, hf(ids, attention_mask=mask, loops=4, use_cache=False).logits)
    for _ in range(70):
        hf(ids[:, :1], loops=4, cache=small, use_cache=True)
    assert small.get_seq_length() == 76 and small.kv.max_len >= 76


@pytest.mark.parametrize("name", ["looped", "tmlt"])
@torch.no_grad()
def test_greedy_generate_equals_loopformers_generation(name):
    model = make(name)
    hf, alone = both(model)
    rows, ids, mask = prompts()
    for loops in (None, 5):
        want = generate(model, rows, SamplingConfig(max_new_tokens=6, temperature=0, loops=loops)).tokens
        for m in (hf, alone):
            for use_cache in (True, False):
                got = m.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, loops=loops,
                                 use_cache=use_cache, eos_token_id=None, pad_token_id=0)
                assert got[:, ids.shape[1]:].tolist() == want, (type(m).__module__, loops, use_cache)


@torch.no_grad()
def test_generate_with_a_halting_rule_and_beam_search():
    model = make("tmlt")
    hf, _ = both(model)
    rows, ids, mask = prompts()
    for rule in ("argmax:2,max=6", "kl:1e-3"):     # loopformer: the depth-wise schedule for the batch
        want = generate(model, rows, SamplingConfig(max_new_tokens=5, temperature=0, halt=rule)).tokens
        got = hf.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, halt=rule, eos_token_id=None)
        assert got[:, 6:].tolist() == want, rule
    beams = [hf.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=3, do_sample=False, use_cache=c,
                         eos_token_id=None) for c in (True, False)]   # the cache reordered per beam
    assert torch.equal(beams[0], beams[1])


def test_loss_is_the_shifted_causal_lm_loss():
    hf, alone = both(make("looped"))
    _, ids, _ = prompts()
    labels = ids.clone()
    labels[1, :3] = -100
    for m in (hf, alone):
        out = m(ids, labels=labels)
        want = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        assert torch.allclose(out.loss, want, atol=1e-6)
    out = hf.train()(ids, labels=labels)
    out.loss.backward()
    assert cached(out) is None and hf.model.embed.tok.weight.grad is not None


@torch.no_grad()
def test_save_and_load_round_trip(tmp_path):
    model = make("tmlt")
    hf, _ = both(model)
    hf.config.inference_loops = 5
    hf.save_pretrained(tmp_path / "m")
    _, ids, mask = prompts()
    want = model(ids, loops=5, attn_mask=mask.bool()).logits
    for cls in (LoopformerForCausalLM, transformers.AutoModelForCausalLM, remote.LoopformerForCausalLM):
        back = cls.from_pretrained(tmp_path / "m").eval()
        assert type(back).__name__ == "LoopformerForCausalLM" and back.config.inference_loops == 5
        assert torch.allclose(back(ids, attention_mask=mask).logits, want, atol=1e-5), cls
    assert isinstance(transformers.AutoConfig.from_pretrained(tmp_path / "m"), LoopformerConfig)
    from safetensors.torch import load_file, save_file
    weights = load_file(tmp_path / "m" / "model.safetensors")
    del weights["model.norm_f.weight"]
    save_file(weights, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match="missing.*norm_f"):
        LoopformerForCausalLM.from_pretrained(tmp_path / "m")


def test_a_model_that_is_no_causal_lm_is_refused():
    for bad in (ModelConfig(**TINY, head="sequence"), ModelConfig(**TINY, causal=False),
                ModelConfig(input_dim=5, n_out=1, d_model=16, n_heads=2, head="regression")):
        with pytest.raises(UserError, match="causal language model"):
            hf_config(bad)
        with pytest.raises(UserError, match="causal language model"):
            LoopformerForCausalLM(LoopformerConfig(**dataclasses.asdict(bad)))
        with pytest.raises(ValueError, match="causal language model"):
            remote.LoopformerForCausalLM(LoopformerConfig(**dataclasses.asdict(bad)))


def test_the_gpt2_style_conversion_encodes_as_tiktoken():
    """tiktoken's mergeable ranks -> a transformers byte-level BPE: the same ids (ranks made from a small BPE, as
    GPT-2's are read from tiktoken's cached files, which tests do not download)."""
    tiktoken = pytest.importorskip("tiktoken")
    from loopformer.text.tokenizers import ByteBPETokenizer
    text = "to be or not to be, that is the question: whether 'tis nobler in the mind"
    bpe = ByteBPETokenizer.train([text] * 20, 300)
    vocab = json.loads(bpe.to_json())["model"]["vocab"]
    symbol = {ch: b for b, ch in byte_symbols().items()}
    ranks = {bytes(symbol[c] for c in tok): i - 1 for tok, i in vocab.items() if i > 0}
    pattern = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    eot = len(ranks)
    enc = tiktoken.Encoding("tiny", pat_str=pattern, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": eot})
    fast = bpe_from_ranks(ranks, pattern, {"<|endoftext|>": eot})
    for s in (text, "nobler tis the whether, 'to' 42 mind!", "ünïcode ☃ and  spaces\n\nnewlines"):
        assert fast.encode(s).ids == enc.encode_ordinary(s) and fast.decode(enc.encode_ordinary(s)) == s
    assert len(ranks) > 280 and fast.encode("a<|endoftext|>").ids[-1] == eot


WORDS = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis", "nobler"]


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    """A tiny prepared corpus and a TMLT checkpoint on it inside a run folder."""
    tmp = tmp_path_factory.mktemp("hf")
    corpus, model = text_checkpoint(tmp, {"hamlet.txt": 150}, words=WORDS, per_line=7, modulation_std=0.3)
    return tmp, corpus, model


@torch.no_grad()
def test_export_command_writes_a_folder_transformers_loads(text_run, capsys):
    tmp, corpus, model = text_run
    out = tmp / "exported"
    assert main(["hf", "export", str(tmp / "run"), "--out", str(out), "--loops", "3"]) == 0
    assert "trust_remote_code=True" in capsys.readouterr().out
    assert {"config.json", "model.safetensors", "tokenizer.json", "modeling_loopformer.py",
            "configuration_loopformer.py", "generation_config.json"} <= set(os.listdir(out))
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_loopformer.LoopformerForCausalLM"
    assert config["inference_loops"] == 3 and config["eos_token_id"] == corpus.tokenizer().eot_id
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    lf = corpus.tokenizer()
    for text in ("to be or not", "whether tis nobler ünïcode"):
        assert tok(text).input_ids == lf.encode(text) and tok.decode(lf.encode(text)) == text
    enc = tok(["to be or not to", "the question"], return_tensors="pt", padding=True, padding_side="left")
    got = hf.generate(**enc, max_new_tokens=5, do_sample=False)
    want = generate_text(model, lf, ["to be or not to", "the question"],
                         SamplingConfig(max_new_tokens=5, temperature=0, loops=3))
    assert tok.batch_decode(got[:, enc.input_ids.shape[1]:]) == want
    assert main(["hf", "export", str(tmp / "run"), "--out", str(out)]) == 0       # an earlier export: replaced
    assert json.loads((out / "config.json").read_text())["inference_loops"] is None
    # the remote code imports nothing of loopformer
    for name in ("modeling_loopformer.py", "configuration_loopformer.py"):
        assert "loopformer." not in "".join(line for line in (out / name).read_text().splitlines(True)
                                            if line.startswith(("import", "from")))


def test_the_exported_folder_loads_where_loopformer_is_missing(text_run, tmp_path):
    tmp, corpus, model = text_run
    out = tmp / "remote"
    assert main(["hf", "export", str(tmp / "run"), "--out", str(out)]) == 0
    script = ("import sys; sys.modules['loopformer'] = None\n"      # as where loopformer is not installed
              "import json, torch\n"
              "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
              f"m = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)\n"
              f"t = AutoTokenizer.from_pretrained({str(out)!r}, trust_remote_code=True)\n"
              "ids = t('to be or not', return_tensors='pt').input_ids\n"
              "with torch.no_grad():\n"
              "    print(json.dumps([type(m).__module__, m(ids).logits.tolist(),\n"
              "                      m.generate(ids, max_new_tokens=4, do_sample=False).tolist()]))\n")
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    module, logits, tokens = json.loads(res.stdout.strip().splitlines()[-1])
    assert module.startswith("transformers_modules") and module.endswith("modeling_loopformer")
    ids = torch.tensor([corpus.tokenizer().encode("to be or not")])
    with torch.no_grad():
        assert torch.allclose(torch.tensor(logits), model(ids).logits, atol=1e-5)
    want = generate(model, ids.tolist(), SamplingConfig(max_new_tokens=4, temperature=0), eos_id=None).tokens
    assert tokens[0][ids.shape[1]:] == want[0]


def test_export_errors_are_one_line(text_run, tmp_path, capsys, monkeypatch):
    tmp, _, model = text_run
    assert main(["hf", "export", str(tmp / "nowhere"), "--out", str(tmp_path / "o")]) == 2
    one_line_error(capsys, "nowhere")
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "cls", LoopedTransformer(ModelConfig(**TINY, head="sequence", causal=False)))
    assert main(["hf", "export", str(tmp_path / "cls"), "--out", str(tmp_path / "o")]) == 2
    one_line_error(capsys, "causal language model")
    save_checkpoint(tmp_path / "bare", model)             # no corpus recorded: the tokenizer is unknown
    assert main(["hf", "export", str(tmp_path / "bare"), "--out", str(tmp_path / "o")]) == 2
    one_line_error(capsys, "--data")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    assert main(["hf", "export", str(tmp / "run"), "--out", str(tmp_path / "mine")]) == 2
    one_line_error(capsys, "notes.txt")
    assert main(["hf", "export", str(tmp / "run"), "--out", str(tmp_path / "o"), "--loops", "0"]) == 2
    one_line_error(capsys, "loops")
    assert not (tmp_path / "o").exists()
    monkeypatch.setitem(sys.modules, "transformers", None)          # transformers not installed
    assert main(["hf", "export", str(tmp / "run"), "--out", str(tmp_path / "o")]) == 2
    one_line_error(capsys, "loopformer[hf]")


def test_a_model_the_remote_code_does_not_run_exports_without_it(text_run, tmp_path, capsys):
    tmp, corpus, _ = text_run
    assert main(["hf", "export", str(tmp / "run"), "--out", str(tmp_path / "o"), "--halt", "argmax:2"]) == 0
    assert "no remote code" in capsys.readouterr().out
    assert not (tmp_path / "o" / "modeling_loopformer.py").exists()
    config = json.loads((tmp_path / "o" / "config.json").read_text())
    assert "auto_map" not in config and config["halt"] == "argmax:2"
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "o").config.halt == "argmax:2"


def test_the_docs_page_names_the_supported_versions():
    page = (ROOT / "docs" / "ecosystem.md").read_text()
    low, high = loopformer.hf.SUPPORTED
    assert f"transformers>={low},<{high}" in (ROOT / "pyproject.toml").read_text()
    assert f">= {low}, < {high}" in page and "ecosystem.md" in (ROOT / "mkdocs.yml").read_text()
