"""The Hugging Face Hub: `loopformer push RUN --repo ORG/NAME` and `loopformer.load("hf:ORG/NAME")`.

    push(run, repo)      export the run (`loopformer.hf.export`: weights, tokenizer, remote code, the model card
                         README.md) into a temporary folder and upload it as one commit to the model repository
                         `repo` (created if missing) with huggingface_hub's `HfApi`; the token is huggingface_hub's
                         own (`hf auth login` or HF_TOKEN)
    load_hub(spec)       "ORG/NAME[@REVISION]" downloaded (`snapshot_download`, cached) and loaded as the
                         `LoopedTransformer` inside `LoopformerForCausalLM`

Needs the extra `hf` (transformers brings huggingface_hub).
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import torch
from huggingface_hub import HfApi, snapshot_download

from loopformer.errors import UserError
from loopformer.hf.export import export
from loopformer.hf.model import LoopformerForCausalLM

REPO = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")


def check_repo(repo: str) -> str:
    if not REPO.fullmatch(repo or "") or ".." in repo or repo.endswith((".", "-")):
        raise UserError(f"--repo takes ORG/NAME, a Hub model repository (got {repo!r})")
    return repo


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:300]


def push(run: str | Path, repo: str, *, private: bool = False, ema: bool = False, loops: int | None = None,
         halt: str | None = None, quant: str | None = None, api: HfApi | None = None) -> str:
    """Export `run` and upload it to the model repository `repo`; returns the commit's URL (module docstring)."""
    check_repo(repo)
    api = api or HfApi()
    with tempfile.TemporaryDirectory(prefix="loopformer-push-") as tmp:
        folder = Path(tmp) / repo.split("/")[1]
        export(run, folder, ema=ema, loops=loops, halt=halt, quant=quant, name=repo)
        try:
            api.create_repo(repo, repo_type="model", private=private, exist_ok=True)
            info = api.upload_folder(folder_path=str(folder), repo_id=repo, repo_type="model",
                                     commit_message=f"loopformer push: {Path(str(run)).name}")
        except (OSError, ValueError, RuntimeError) as exc:       # HTTP errors, no token, no network
            raise UserError(f"push to {repo} failed: {_one_line(exc)} (log in with `hf auth login` or set "
                            f"HF_TOKEN)") from None
    return str(getattr(info, "commit_url", None) or info)


def load_hub(spec: str, device: str | torch.device = "cpu"):
    """The `LoopedTransformer` of the Hub repository "ORG/NAME[@REVISION]", in eval mode on `device`."""
    repo, _, revision = spec.partition("@")
    check_repo(repo)
    try:
        folder = snapshot_download(repo, revision=revision or None, repo_type="model")
    except (OSError, ValueError, RuntimeError) as exc:
        raise UserError(f"cannot download hf:{spec}: {_one_line(exc)}") from None
    if not (Path(folder) / "config.json").is_file():
        raise UserError(f"hf:{spec} holds no config.json: not a model `loopformer push` or `hf export` wrote")
    hf = LoopformerForCausalLM.from_pretrained(folder)
    return hf.model.to(device).eval()


__all__ = ["push", "load_hub", "check_repo"]
