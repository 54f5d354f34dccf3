"""Typed configs: YAML + dotted overrides, strict keys, validation errors naming the key."""

import pytest

from loopformer.configio import from_dict, load_config, shipped_config, to_dict
from loopformer.errors import UserError
from loopformer.model import ModelConfig
from loopformer.train.config import load_run_config


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


def test_epochs_without_steps_train_for_those_epochs(tmp_path):
    """A config giving `train.epochs` and no `train.steps` must not fall back to the default step count."""
    from loopformer.train.optim import steps_for

    cfg = load_run_config(shipped_config("lcs60.yaml"))
    assert (cfg.train.steps, cfg.train.epochs) == (0, 50.0)
    assert steps_for(cfg.train.steps, cfg.train.epochs, cfg.task.n_train, cfg.train.batch_size) == \
        -(-50 * cfg.task.n_train // cfg.train.batch_size)
    p = tmp_path / "c.yaml"
    p.write_text("task: {name: edit_distance, n_train: 640}\ntrain: {epochs: 2, batch_size: 64}\n")
    assert load_run_config(p).train.steps == 0
    assert load_run_config(p, ["train.steps=7"]).train.steps == 7                   # steps given: steps win
    p.write_text("task: {name: edit_distance, n_train: 640}\ntrain: {epochs: 2, steps: 5}\n")
    assert load_run_config(p).train.steps == 5
    assert load_run_config(None, ["task.name=edit_distance"]).train.steps == 1000   # neither: the default
