"""loopformer's language models in the Hugging Face stack: `import loopformer.hf` registers `LoopformerConfig`
(model_type "loopformer") with `AutoConfig` and `LoopformerForCausalLM` with `AutoModelForCausalLM`, so

    import loopformer.hf
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("exported/")     # `loopformer hf export RUN --out exported/`
    tok = AutoTokenizer.from_pretrained("exported/")
    model.generate(**tok("To be", return_tensors="pt"), max_new_tokens=20, loops=12)

    configuration_loopformer   `LoopformerConfig` (self-contained: exported folders carry a copy)
    modeling_loopformer        the model in plain PyTorch for `trust_remote_code=True` (self-contained likewise)
    model                      `LoopformerForCausalLM` around `LoopedTransformer`, `LoopformerCache` (the
                               per-(loop, layer) key/value cache as a transformers `Cache`)
    tokenizer                  a transformers fast tokenizer from loopformer's tokenizers
    export                     the folder `loopformer hf export` writes
    card                       its model card (README.md): the loop profile, drift verdict, FLOPs per token
    hub                        `loopformer push` and `loopformer.load("hf:ORG/NAME")` (huggingface_hub)
    lmeval                     `loopformer lm-eval`: lm-evaluation-harness at loop budgets (extra `lmeval`)
    finetune                   `loopformer hf finetune`: LoRA adapters on the shared block (extra `lora`)

Needs the extra `hf` (`pip install 'loopformer[hf]'`): transformers within `SUPPORTED`.
"""

import logging
from importlib.metadata import version

from packaging.version import Version

SUPPORTED = ("5.20", "6")          # transformers >= 5.20, < 6 (pyproject.toml's extra `hf`)

_found = version("transformers")
if not Version(SUPPORTED[0]) <= Version(_found) < Version(SUPPORTED[1]):
    raise ImportError(f"loopformer.hf needs transformers >= {SUPPORTED[0]}, < {SUPPORTED[1]} (found {_found}): "
                      f"pip install 'loopformer[hf]'")

# transformers imports torchao where it is installed (the extra `quant`); its import warns about kernels built for
# GPUs and other Python versions, and registers enums torch warns about: quiet for the one-line commands
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from loopformer.hf.configuration_loopformer import LoopformerConfig  # noqa: E402
from loopformer.hf.model import LoopformerCache, LoopformerForCausalLM, hf_config, model_config  # noqa: E402

AutoConfig.register("loopformer", LoopformerConfig, exist_ok=True)
AutoModelForCausalLM.register(LoopformerConfig, LoopformerForCausalLM, exist_ok=True)

__all__ = ["LoopformerConfig", "LoopformerForCausalLM", "LoopformerCache", "hf_config", "model_config", "SUPPORTED"]
