"""Typed configs: YAML + dotted overrides, strict keys, validation errors naming the key."""

import pytest

from loopformer.configio import from_dict, load_config, to_dict
from loopformer.errors import UserError
from loopformer.model import ModelConfig


def test_overrides_and_yaml(tmp_path):
    f = tmp_path / "m.yaml"
    f.write_text("vocab_size: 10\nd_model: 64\nn_heads: 4\nloops: 3\n")
    cfg = load_config(ModelConfig, f, ["loops=8", "timestep=true"])
    assert (cfg.vocab_size, cfg.d_model, cfg.loops, cfg.timestep) == (10, 64, 8, True)
    assert from_dict(ModelConfig, to_dict(cfg)) == cfg


@pytest.mark.parametrize("override,needle", [
    ("lops=3", "lops"),                 # unknown key
    ("loops=many", "loops"),            # wrong type
    ("loops=0", "loops"),               # invalid value
    ("activation=tanh", "activation"),
    ("d_model=30", "divisible"),
    ("loops", "key=value"),
])
def test_bad_values_are_one_line_errors(override, needle):
    with pytest.raises(UserError) as info:
        load_config(ModelConfig, overrides=["vocab_size=10", override])
    msg = str(info.value)
    assert needle in msg and "\n" not in msg


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_config(ModelConfig, tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("vocab_size: [1, 2\n")
    with pytest.raises(UserError, match="cannot parse"):
        load_config(ModelConfig, bad)


def test_direct_construction_validates():
    with pytest.raises(ValueError, match="exactly one of vocab_size"):
        ModelConfig()
    with pytest.raises(ValueError, match="tie_embeddings"):
        ModelConfig(input_dim=3, n_out=2, tie_embeddings=True)
