"""Model cards and the Hub: every exported folder carries README.md in the Hub's card format (YAML front matter, the
loop profile to 4r with FLOPs per token, the drift verdict, the metrics, the training command, the data);
`loopformer push` uploads the export and `loopformer.load("hf:ORG/NAME")` loads it back — tested against a local
stand-in for the Hub (a folder), since these machines cannot reach it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("transformers")

from conftest import text_checkpoint  # noqa: E402

import loopformer  # noqa: E402
import loopformer.hf.hub as hub  # noqa: E402
from loopformer.cli import main  # noqa: E402
from loopformer.hf.card import flops_per_token  # noqa: E402
from loopformer.model import LoopedTransformer  # noqa: E402


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    """A tiny checkpoint in a run folder with the results.json and run.json training writes (their card fields)."""
    tmp = tmp_path_factory.mktemp("hub")
    _, model = text_checkpoint(tmp, {"t.txt": 100})
    run = tmp / "run"
    curve = [60.0, 41.5, 43.0, 47.25, 52.0, 58.0, 65.0, 73.5]
    (run / "results.json").write_text(json.dumps({
        "metric": "ppl", "params": sum(p.numel() for p in model.parameters()),
        "test": {"loss": 3.72, "ppl": 41.5},
        "drift": {"loops": 2, "metric": "ppl", "metric_per_loop": curve, "verdict": "drifting",
                  "at": {"1r": 41.5, "2r": 47.25, "4r": 73.5}, "spectral_radius": {"median": 1.25, "max": 1.5}}}))
    (run / "run.json").write_text(json.dumps({"command": ["/venv/bin/loopformer", "train", "tiny.yaml", "seed=3"],
                                              "total_steps": 10, "seed": 3, "device": "cpu"}))
    return tmp, model, curve


def front_matter(text: str) -> dict:
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def test_the_export_carries_a_model_card_with_the_loop_profile(text_run):
    tmp, model, curve = text_run
    assert main(["hf", "export", str(tmp / "run"), "--out", str(tmp / "hf")]) == 0
    card = (tmp / "hf" / "README.md").read_text()
    meta = front_matter(card)
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert {"loopformer", "custom_code"} <= set(meta["tags"])
    assert meta["loopformer"]["loops"] == 2 and meta["loopformer"]["drift_verdict"] == "drifting"
    assert meta["loopformer"]["flops_per_token_at_r"] == round(flops_per_token(model.config, 2))
    rows = [line for line in card.splitlines() if line.startswith("| ") and line.split("|")[1].strip()[:1].isdigit()]
    profile = rows[:len(curve)]
    assert [float(r.split("|")[2]) for r in profile] == pytest.approx(curve)            # the metric at 1..4r
    assert [int(r.split("|")[3].replace(",", "")) for r in profile] == \
        [round(flops_per_token(model.config, t)) for t in range(1, 9)]                 # FLOPs per token at t
    assert "| 2 (r) |" in card and "**Drift verdict past r: drifting**" in card
    assert "loopformer train tiny.yaml seed=3" in card                                  # the command, argv[0] named
    assert "| ppl | 41.5 |" in card and "Halting savings: not measured" in card
    assert f"corpus {tmp / 'data'}" in card


class LocalHub:
    """A stand-in for the Hub's API: repositories are folders under `root`; an upload replaces the folder."""

    root: Path

    def __init__(self, *args, **kwargs):
        self.created: list[str] = []

    def create_repo(self, repo_id, repo_type="model", private=False, exist_ok=False):
        self.created.append(repo_id)
        (self.root / repo_id).mkdir(parents=True, exist_ok=exist_ok)

    def upload_folder(self, folder_path, repo_id, repo_type="model", commit_message=""):
        dest = self.root / repo_id
        shutil.rmtree(dest)
        shutil.copytree(folder_path, dest)
        return f"local://{repo_id}"


def test_push_and_load_through_a_local_stand_in(text_run, tmp_path, monkeypatch, capsys):
    tmp, model, _ = text_run
    LocalHub.root = tmp_path / "hub"
    monkeypatch.setattr(hub, "HfApi", LocalHub)
    monkeypatch.setattr(hub, "snapshot_download",
                        lambda repo, revision=None, repo_type="model": str(LocalHub.root / repo))
    assert main(["push", str(tmp / "run"), "--repo", "org/tiny-loop"]) == 0
    assert "local://org/tiny-loop" in capsys.readouterr().out
    pushed = LocalHub.root / "org" / "tiny-loop"
    assert {"README.md", "config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in pushed.iterdir()}
    assert 'from_pretrained("org/tiny-loop"' in (pushed / "README.md").read_text()    # the card names the repo
    back = loopformer.load("hf:org/tiny-loop")
    assert isinstance(back, LoopedTransformer) and not back.training
    x = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, model(x).logits, atol=1e-6, rtol=1e-6)


def test_errors_are_one_line(text_run, tmp_path, monkeypatch, capsys):
    tmp, _, _ = text_run
    assert main(["push", str(tmp / "run"), "--repo", "no-slash"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--repo takes ORG/NAME" in err

    class Offline(LocalHub):
        def create_repo(self, *args, **kwargs):
            raise OSError("Name or service not known")

    monkeypatch.setattr(hub, "HfApi", Offline)
    assert main(["push", str(tmp / "run"), "--repo", "org/x"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "push to org/x failed: Name or service not known" in err
    with pytest.raises(ValueError, match="takes device= only"):
        loopformer.load("hf:org/x", ema=True)
