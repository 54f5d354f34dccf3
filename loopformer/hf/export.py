"""`loopformer hf export RUN --out DIR`: a run's (or checkpoint's) language model as a transformers folder.

    DIR/config.json               `LoopformerConfig` (model_type "loopformer", every ModelConfig field, auto_map)
    DIR/model.safetensors         the weights, named as `LoopedTransformer`'s under `model.`
    DIR/generation_config.json    end-of-text as eos and pad token
    DIR/tokenizer.json, tokenizer_config.json
                                  the run's tokenizer as a transformers fast tokenizer (`loopformer.hf.tokenizer`)
    DIR/README.md                 the model card (the Hub's format): the loop profile, the drift verdict, FLOPs per
                                  token, metrics, the training command, the data, the config (`loopformer.hf.card`)
    DIR/configuration_loopformer.py, modeling_loopformer.py
                                  the self-contained modelling code for `trust_remote_code=True` (where loopformer
                                  is not installed); left out, with the reason, for a model it does not run

With `quant="int8"` (`--quant int8`) the shared block's linear maps are stored int8 weight-only through
transformers' torchao quantizer (`TorchAoConfig` in config.json's quantization_config; everything else as it is),
and `from_pretrained(DIR)` loads them quantized (`loopformer.eval.quant`; the extra `quant`).

`AutoModelForCausalLM.from_pretrained(DIR)` loads the folder after `import loopformer.hf`,
`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` without loopformer, and
`AutoTokenizer.from_pretrained(DIR)` its tokenizer. The folder is written next to DIR and renamed into place; DIR
must be new, empty or an earlier export (its config.json records `loopformer_export`): nothing else is replaced.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from loopformer.errors import UserError
from loopformer.eval.quant import block_maps, check_kind
from loopformer.eval.quant import config as quant_config
from loopformer.fileio import check_owned_folder, new_folder
from loopformer.hf import configuration_loopformer, modeling_loopformer
from loopformer.hf.card import model_card
from loopformer.hf.model import LoopformerForCausalLM, hf_config
from loopformer.hf.tokenizer import fast_tokenizer
from loopformer.model.halting import HaltRule
from loopformer.model.io import CONFIG, RUN_CHECKPOINT, load, read_config, resolve_checkpoint
from loopformer.model.memory import check_loops
from loopformer.text.commands import checkpoint_data_dir
from loopformer.text.dataset import TokenCorpus
from loopformer.version import __version__

CODE = (configuration_loopformer, modeling_loopformer)       # the remote code an export carries
WRITTEN = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
           "special_tokens_map.json", "chat_template.jinja", "README.md", *(Path(m.__file__).name for m in CODE))
MARKER = "loopformer_export"       # the key of config.json that marks a folder this command wrote
AUTO_MAP = {"AutoConfig": "configuration_loopformer.LoopformerConfig",
            "AutoModelForCausalLM": "modeling_loopformer.LoopformerForCausalLM"}


@dataclass
class Export:
    folder: Path
    remote_code: str | None       # why the folder carries no remote code (None: it does)


def check_out(out: str | Path) -> None:
    """A UserError unless `out` is missing, empty or a folder this command wrote."""
    hint = "choose a new folder for the export"
    check_owned_folder(out, WRITTEN, CONFIG, "hf export", hint=hint)
    cfg = Path(out) / CONFIG
    if cfg.is_file():
        try:
            ours = MARKER in json.loads(cfg.read_text())
        except (ValueError, OSError, TypeError):
            ours = False
        if not ours:
            raise UserError(f"{out} holds a config.json that hf export did not write; {hint}")


def export(run: str | Path, out: str | Path, data: str | Path | None = None, ema: bool = False,
           loops: int | None = None, halt: str | None = None, memory_check: bool = True,
           quant: str | None = None, name: str | None = None) -> Export:
    """Write the transformers folder `out` of the language model in `run` (a run folder or a checkpoint folder);
    see the module docstring. `data`: the prepared corpus whose tokenizer to save (default: the one the run was
    trained on); `ema`: the averaged weights; `loops`, `halt`: the loop count and halting rule calls use when they
    name none (config.inference_loops, config.halt); `quant`: "int8" stores the shared block int8 weight-only;
    `name`: the model's name in its card (default: the folder's name; `push`: the repository's)."""
    ckpt = resolve_checkpoint(run)
    cfg, recorded = read_config(ckpt)
    config = hf_config(cfg, inference_loops=loops, halt=halt)       # refuses a model that is no causal LM
    check_loops(loops, cfg.loops)
    if halt is not None:
        HaltRule.parse(halt)
    if quant is not None:
        if quant != "int8":
            raise UserError(f"hf export --quant takes int8 (got {quant!r}); int4 is measured by eval --quant int4 "
                            f"but torchao stores it unpacked on CPU (no smaller file)")
        check_kind(quant)
    check_out(out)
    corpus = data if data is not None else checkpoint_data_dir(str(ckpt))
    if corpus is None:
        raise UserError(f"cannot tell which tokenizer {ckpt} uses; pass --data DIR (its prepared corpus)")
    tokenizer = TokenCorpus(corpus).tokenizer()
    if tokenizer.vocab_size > cfg.vocab_size:
        raise UserError(f"the tokenizer of {corpus} has {tokenizer.vocab_size} tokens, more than the model's "
                        f"vocabulary of {cfg.vocab_size}: not the corpus this model was trained on")
    fast = fast_tokenizer(tokenizer, cfg.max_len if cfg.indexed_positions else None)
    model = load(ckpt, ema=ema, memory_check=memory_check)
    extra = {"inference_loops": loops, "halt": halt, "eos_token_id": tokenizer.eot_id,
             "pad_token_id": tokenizer.eot_id,
             MARKER: {"loopformer_version": __version__, "ema": ema,
                      "run": ckpt.parent.name if ckpt.name == RUN_CHECKPOINT else ckpt.name}}
    hf = LoopformerForCausalLM.from_loopformer(model, **extra)
    remote = modeling_loopformer.unsupported(config)
    if remote is None:
        hf.config.auto_map = dict(AUTO_MAP)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()           # one line of output, as every loopformer command
    try:
        with new_folder(out) as tmp:
            hf.save_pretrained(tmp)
            if quant is not None:
                quantized(tmp, quant)
            fast.save_pretrained(tmp)
            (tmp / "README.md").write_text(model_card(ckpt, cfg, recorded, name=name or Path(out).name,
                                                      remote_code=remote is None, quant=quant, inference_loops=loops,
                                                      halt=halt))
            if remote is None:
                for mod in CODE:
                    shutil.copyfile(mod.__file__, tmp / Path(mod.__file__).name)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return Export(Path(out), remote)


def quantized(folder: Path, kind: str) -> None:
    """Rewrite the model saved in `folder` with the shared block's linear maps quantized (`kind`) through
    transformers' torchao quantizer, which records itself in config.json so `from_pretrained` loads it quantized."""
    from transformers import TorchAoConfig
    model = LoopformerForCausalLM.from_pretrained(folder)
    keep = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
            and n not in set(block_maps(model, prefix="model."))]
    q = LoopformerForCausalLM.from_pretrained(folder, quantization_config=TorchAoConfig(
        quant_config(kind), modules_to_not_convert=keep))
    if getattr(model.config, "auto_map", None):
        q.config.auto_map = model.config.auto_map
    (folder / "model.safetensors").unlink()
    q.save_pretrained(folder)


__all__ = ["export", "check_out", "Export", "AUTO_MAP", "WRITTEN"]
