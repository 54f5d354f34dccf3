"""train.init_from: a run that starts from another run's weights (fine-tuning) — the weights it starts with are
exactly the source's, its optimiser and schedule are fresh, bad sources are refused before anything is written."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from test_train import TINY

from loopformer.cli import main
from loopformer.train.config import load_run_config
from loopformer.train.trainer import Trainer, train

BASE = [*TINY, "train.steps=3", "log.dynamics=false", "eval.drift=false"]


def _weights(run) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoint" / "model.safetensors"))


def test_a_run_starts_from_the_source_weights_with_a_fresh_schedule(tmp_path, monkeypatch):
    src = tmp_path / "src"
    train(load_run_config(None, [*BASE, f"out_dir={src}"]))
    first = {}
    orig = Trainer.step

    def spy(self, step):
        if not first:
            first.update({k: v.clone() for k, v in self.model.state_dict().items()})
            first["_lr_step"] = torch.tensor(step)
        return orig(self, step)

    monkeypatch.setattr(Trainer, "step", spy)
    # other loop settings than the source (the hold of a fine-tuning run): only the shapes must match
    cfg = load_run_config(None, [*BASE, f"train.init_from={src}", "train.loops.hold=2", f"out_dir={tmp_path / 'ft'}"])
    train(cfg)
    want = _weights(src)
    assert int(first.pop("_lr_step")) == 0                                # the schedule starts at step 0
    assert all(torch.equal(first[k], want[k]) for k in want)              # exactly the source's weights
    assert any(not torch.equal(v, want[k]) for k, v in _weights(tmp_path / "ft").items())   # and it trained
    info = json.loads((tmp_path / "ft" / "run.json").read_text())
    assert info["init_from"] == str((src / "checkpoint").resolve())


@pytest.mark.parametrize("bad,needle", [
    ("missing", "checkpoint not found"),
    ("wide", "does not match its config"),
])
def test_init_from_refusals_write_nothing(tmp_path, capsys, bad, needle):
    src = tmp_path / "src"
    if bad == "wide":
        train(load_run_config(None, [*BASE, f"out_dir={src}", "model.d_model=32"]))
    (tmp_path / "c.yaml").write_text("name: ft\n")
    out = tmp_path / "ft"
    assert main(["train", str(tmp_path / "c.yaml"), "--quiet", *BASE, f"train.init_from={src}",
                 f"out_dir={out}"]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1
    assert not out.exists() or not any(p.name in ("checkpoint", "config.yaml", "run.json") for p in out.iterdir())
