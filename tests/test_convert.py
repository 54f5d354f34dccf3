"""Checkpoints of the published looped-GPT code load into loopformer with identical logits."""

import pytest
import torch

import loopformer
from loopformer.cli import main
from loopformer.errors import UserError
from loopformer.model.convert import from_authors
from loopformer.model.reference import authors_forward, random_authors_state_dict

ARGS = dict(n_loop=4, n_layer=1, n_head=4, n_embd=32, block_size=24, vocab_size=40, dropout=0.0)


def ckpt(model_type, bias=False, seed=0):
    sd = random_authors_state_dict(model_type, 40, 24, 32, seed=seed, bias=bias)
    return {"model": sd, "model_args": {**ARGS, "bias": bias}, "config": {"model_type": model_type},
            "optimizer": {}, "iter_num": 123, "best_val_loss": torch.tensor(3.5)}


@pytest.mark.parametrize("model_type", ["lt", "tmlt"])
@pytest.mark.parametrize("bias", [False, True])
def test_same_logits_at_every_position(model_type, bias):
    c = ckpt(model_type, bias)
    model, info = from_authors(c)
    assert info["model_type"] == model_type and info["iter_num"] == 123
    idx = torch.randint(0, 40, (3, 24))
    ref = authors_forward(c["model"], idx, model_type, ARGS["n_loop"], ARGS["n_head"])
    got = model(idx).logits
    assert ref.abs().max() > 0.1
    assert (got - ref).abs().max().item() <= 1e-5


def test_quirk_matters():
    """Without the compatibility setting the plain looped forward differs (so the test above can fail)."""
    c = ckpt("lt")
    model, _ = from_authors(c)
    plain = loopformer.LoopedTransformer(model.config.replace(compat="none"))
    plain.load_state_dict(model.state_dict())
    idx = torch.randint(0, 40, (2, 10))
    assert (plain(idx).logits - model(idx).logits).abs().max() > 1e-3


def test_cli_round_trip(tmp_path):
    c = ckpt("tmlt")
    torch.save(c, tmp_path / "ckpt.pt")
    assert main(["convert", str(tmp_path / "ckpt.pt"), "--out", str(tmp_path / "conv")]) == 0
    model = loopformer.load(tmp_path / "conv")
    idx = torch.randint(0, 40, (2, 16))
    ref = authors_forward(c["model"], idx, "tmlt", 4, 4)
    assert (model(idx).logits - ref).abs().max().item() <= 1e-5
    hub = loopformer.LoopedTransformer.from_pretrained(str(tmp_path / "conv"))
    torch.testing.assert_close(hub(idx).logits, model(idx).logits)


def test_refusals(tmp_path, capsys):
    c = ckpt("lt")
    c["config"]["model_type"] = "gpt"
    with pytest.raises(UserError, match="unsupported model_type 'gpt'"):
        from_authors(c)
    c = ckpt("tmlt")
    del c["model"]["adaLN_modulation.1.weight"]
    with pytest.raises(UserError, match="adaLN_modulation.1.weight"):
        from_authors(c)
    torch.save(c, tmp_path / "bad.pt")
    assert main(["convert", str(tmp_path / "bad.pt"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "missing weight" in err
    assert not (tmp_path / "o").exists()
    assert main(["convert", str(tmp_path / "none.pt"), "--out", str(tmp_path / "o")]) == 2


def test_checkpoint_folder_is_strict_and_atomic(tmp_path):
    model = loopformer.LoopedTransformer(loopformer.preset("debug"))
    path = loopformer.save_checkpoint(tmp_path / "ck", model, run={"seed": 1})
    loopformer.save_checkpoint(tmp_path / "ck", model, run={"seed": 2})   # overwrite in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert {p.name for p in path.iterdir()} == {"model.safetensors", "config.json"}
    # a config that does not match the weights is refused
    import json
    cfg = json.loads((path / "config.json").read_text())
    cfg["d_model"] = 64
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError):
        loopformer.load(path)
