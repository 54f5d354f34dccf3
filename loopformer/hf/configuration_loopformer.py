"""`LoopformerConfig`: the transformers configuration of a loopformer language model (model_type "loopformer").

Its config.json holds every field of loopformer's `ModelConfig` at top level, as a loopformer checkpoint's
config.json does (`loopformer.model.io`), plus what the transformers class adds:

    inference_loops   the loop count a call runs when it names none (None: `loops`, the r the model was trained
                      with; `forward(loops=...)` and `generate(..., loops=...)` choose per call)
    halt              a halting rule such as "kl:1e-3" (adaptive depth per token, `loopformer.model.halting`) that
                      every call applies when it names none (None: fixed depth)
    use_cache         whether calls outside training keep a key/value cache when they do not say
    timestep_past     (a `ModelConfig` field) the loop index past r: continue | clamp | hold | own

Aliases for tools that read the usual names: hidden_size = d_model, num_attention_heads = n_heads,
num_hidden_layers = n_layers (the layers of the shared block, run `loops` times), max_position_embeddings = max_len.

This file imports nothing of loopformer: an exported folder carries a copy of it (with `modeling_loopformer.py`) so
that `AutoConfig.from_pretrained(DIR, trust_remote_code=True)` reads it where loopformer is not installed.
"""

from __future__ import annotations

import copy

from transformers import PretrainedConfig

# loopformer's ModelConfig fields and their defaults (tests/test_hf.py checks them against ModelConfig)
MODEL_FIELDS = {
    "vocab_size": 0,
    "input_dim": 0,
    "max_len": 1024,
    "pos": "learned",
    "rope_base": 10000.0,
    "pos_factors": None,
    "d_model": 256,
    "n_heads": 4,
    "head_dim": None,
    "ffn_dim": None,
    "n_layers": 1,
    "loops": 1,
    "loop_rule": "fixed",
    "activation": "gelu",
    "norm": "rms",
    "norm_gain": True,
    "norm_eps": None,
    "bias": False,
    "dropout": 0.0,
    "causal": True,
    "attn_scale": None,
    "attn_window": 0,
    "timestep": False,
    "timestep_freq_dim": 256,
    "timestep_max_period": 10000.0,
    "timestep_embed": "sinusoid",
    "timestep_scale": 1.0,
    "timestep_gate_init": 1.0,
    "timestep_time": "index",
    "timestep_past": "continue",
    "input_injection": False,
    "start_state": "input",
    "state_noise": 0.0,
    "extensions": {},
    "supervision_steps": 1,
    "step_timestep": "continue",
    "exit_gate": False,
    "head": "lm",
    "n_out": None,
    "pool": "mean",
    "final_norm": True,
    "tie_embeddings": False,
    "grad_loops": None,
    "checkpoint": False,
    "compat": "none",
    "init_std": 0.02,
}


class LoopformerConfig(PretrainedConfig):
    model_type = "loopformer"
    attribute_map = {"hidden_size": "d_model", "num_attention_heads": "n_heads", "num_hidden_layers": "n_layers",
                     "max_position_embeddings": "max_len"}

    def __init__(self, inference_loops: int | None = None, halt: str | None = None, use_cache: bool = True,
                 **kwargs):
        for name, default in MODEL_FIELDS.items():
            setattr(self, name, kwargs.pop(name, copy.deepcopy(default)))
        self.inference_loops = inference_loops
        self.halt = halt
        self.use_cache = use_cache
        kwargs.pop("tie_word_embeddings", None)       # follows tie_embeddings
        super().__init__(**kwargs)
        self.tie_word_embeddings = bool(self.tie_embeddings)

    def model_fields(self) -> dict:
        """The loopformer `ModelConfig` fields of this config, by name."""
        return {name: copy.deepcopy(getattr(self, name)) for name in MODEL_FIELDS}

    def causal_lm_problem(self) -> str | None:
        """Why a model of this config is not a causal language model (None: it is one)."""
        if self.head != "lm" or not self.causal or self.input_dim or not self.vocab_size:
            return (f"a transformers causal language model needs a loopformer model with head='lm', causal=true and "
                    f"token input (this one: head={self.head!r}, causal={self.causal}, "
                    f"{'vector input' if self.input_dim else f'vocab_size={self.vocab_size}'})")
        return None


__all__ = ["LoopformerConfig", "MODEL_FIELDS"]
