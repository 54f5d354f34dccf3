"""loopformer's language models as a transformers class: `LoopformerForCausalLM` runs `LoopedTransformer` itself
(every option of the model family: TMLT, input injection, the loop index past r, halting rules, the fixed-point
mode, the lab's extensions) behind transformers' `PreTrainedModel` and `GenerationMixin`, so `generate`,
`save_pretrained` / `from_pretrained`, `AutoModelForCausalLM` and the Trainer work with it.

    forward(input_ids, attention_mask, cache | past_key_values, labels, loops=, halt=, use_cache, return_dict)
        -> CausalLMOutputWithPast: logits are LoopedTransformer's; the loss with labels is transformers' causal LM
           loss (labels shifted inside, -100 ignored)
    loops   the loop count of the call (default config.inference_loops, else the trained r = config.loops)
    halt    a halting rule, e.g. "kl:1e-3": every token loops until the rule says it is done (default config.halt)

The key/value cache (`LoopformerCache`) is loopformer's `KVCache` — one slot per (loop, layer), since every loop
of the shared block writes keys and values of its own — behind transformers' `Cache` interface; `layers[t·k + i]`
views the slot of layer i at loop t. It is made for one loop count (a call with another is refused) and grows
(doubling) as tokens arrive. Beam search reorders and repeats its rows.
"""

from __future__ import annotations

import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.modeling_outputs import CausalLMOutputWithPast

from loopformer.configio import from_dict, to_dict
from loopformer.errors import UserError
from loopformer.hf.configuration_loopformer import LoopformerConfig
from loopformer.hf.modeling_loopformer import CACHE_FIELD
from loopformer.model.cache import KVCache
from loopformer.model.config import ModelConfig, migrate
from loopformer.model.halting import HaltRule
from loopformer.model.looped import LoopedTransformer

GROW_AT_LEAST = 64     # positions a new or grown cache has room for beyond what it holds


def hf_config(cfg: ModelConfig, **extra) -> LoopformerConfig:
    """The transformers config of a loopformer `ModelConfig` (`extra`: inference_loops, halt, token ids, ...); a
    model that is not a causal language model is refused."""
    config = LoopformerConfig(**to_dict(cfg), **extra)
    problem = config.causal_lm_problem()
    if problem:
        raise UserError(problem)
    return config


def model_config(config: LoopformerConfig) -> ModelConfig:
    """loopformer's `ModelConfig` of a transformers config (fields that left the core migrated or refused)."""
    try:
        return from_dict(ModelConfig, migrate(config.model_fields()))
    except ValueError as exc:
        raise UserError(str(exc)) from None


class LoopSlot(CacheLayerMixin):
    """The slot of one (loop, layer) of a `LoopformerCache`: its keys and values so far, [B,H,S,Dh] views."""

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, owner: LoopformerCache, slot: int):     # no state of its own: the owner's buffer
        self.owner, self.slot = owner, slot
        self.is_initialized = True

    @property
    def keys(self) -> torch.Tensor:
        return self.owner.kv.k[self.slot, :, :, :self.owner.kv.length]

    @property
    def values(self) -> torch.Tensor:
        return self.owner.kv.v[self.slot, :, :, :self.owner.kv.length]

    @property
    def device(self) -> torch.device:
        return self.owner.kv.kv.device

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing: the owner allocates every slot at once."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write keys and values [B,H,T,Dh] after the filled part (the model advances the length once per call,
        after all its slots are written); return all of this slot's so far."""
        self.owner.reserve(key_states.shape[2])
        return self.owner.kv.update(self.slot, key_states, value_states)

    def get_seq_length(self) -> int:
        return self.owner.kv.length

    def get_max_length(self) -> int:
        return -1                   # grows

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.kv.length + query_length, 0

    def reset(self) -> None:
        self.owner.reset()

    def crop(self, tokens_to_remove: int) -> None:
        self.owner.crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.owner.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.owner.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.owner.batch_select_indices(indices)


class LoopformerCache(Cache):
    """loopformer's per-(loop, layer) `KVCache` as a transformers `Cache` (module docstring). `kv` is the
    `KVCache` the model reads and writes; operations on the whole cache (reorder, repeat, select, crop, reset) act
    on its one buffer once, not per slot."""

    def __init__(self, model: LoopedTransformer, batch_size: int, loops: int | None = None, room: int = 0):
        self.model = model
        self.kv: KVCache = model.new_cache(batch_size, max_len=max(room, 1) + GROW_AT_LEAST, loops=loops)
        super().__init__(layers=[LoopSlot(self, s) for s in range(self.kv.slots)])

    @property
    def loops(self) -> int:
        return self.kv.loops

    def reserve(self, new: int) -> None:
        """Room for `new` more positions: a full buffer is replaced by one of twice the size (or more), holding
        what was written."""
        kv = self.kv
        if kv.length + new <= kv.max_len:
            return
        bigger = self.model.new_cache(kv.kv.shape[2], max_len=max(2 * kv.max_len, kv.length + new + GROW_AT_LEAST),
                                      loops=kv.loops)
        bigger.kv[..., :kv.length, :] = kv.kv[..., :kv.length, :]
        bigger.length = kv.length
        self.kv = bigger

    def set_rows(self, buffer: torch.Tensor) -> None:
        """Replace the cache's buffer [2,R·k,B',H,L,Dh] by one of other rows (beam search)."""
        kv = self.kv
        kv.kv = buffer
        kv.k, kv.v = buffer[0], buffer[1]
        kv.rows = torch.arange(buffer.shape[2], device=buffer.device)
        kv.later = None

    # what transformers calls on a cache
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv.length

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.kv.length + query_length, 0

    @property
    def batch_size(self) -> int:
        return self.kv.kv.shape[2]

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return True

    def reset(self) -> None:
        self.kv.kv.zero_()
        self.kv.length = 0

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last `tokens_to_remove` positions (a negative count: keep that many fewer than now)."""
        self.kv.length = max(0, self.kv.length - abs(int(tokens_to_remove)))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.set_rows(self.kv.kv.index_select(2, beam_idx.to(self.kv.kv.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.set_rows(self.kv.kv.repeat_interleave(repeats, dim=2))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.set_rows(self.kv.kv.index_select(2, indices.to(self.kv.kv.device)))


class LoopformerForCausalLM(PreTrainedModel, GenerationMixin):
    """A loopformer causal language model (`LoopedTransformer`, as `.model`) as a transformers model."""

    config_class = LoopformerConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _no_split_modules = ["Layer"]
    _tied_weights_keys = {"model.head.proj.weight": "model.embed.tok.weight"}

    def __init__(self, config: LoopformerConfig):
        super().__init__(config)
        problem = config.causal_lm_problem()
        if problem:
            raise UserError(problem)
        self.model = LoopedTransformer(model_config(config))
        self.post_init()

    @classmethod
    def from_loopformer(cls, model: LoopedTransformer, **extra) -> LoopformerForCausalLM:
        """This class around a loopformer model, sharing its weights (`extra`: config fields, e.g. inference_loops,
        halt, eos_token_id)."""
        with torch.device("meta"):
            out = cls(hf_config(model.config, **extra))
        out.model = model
        return out.to(next(model.parameters()).device)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """transformers' `from_pretrained`, strict as loopformer's own loading: a weights file that lacks weights of
        the model or holds others is refused (one line)."""
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        missing, unexpected = sorted(info.get("missing_keys") or []), sorted(info.get("unexpected_keys") or [])
        if missing or unexpected:
            raise UserError(f"{args[0] if args else 'the checkpoint'} does not match its config: missing "
                            f"{missing[:3]}, unexpected {unexpected[:3]}")
        return (model, info) if want_info else model

    def _init_weights(self, module):
        """Nothing: `LoopedTransformer` initialises its own weights (GPT-2's scheme, adaLN-Zero), so a model made
        here with a seed is the loopformer model of that seed."""

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False        # `forward` makes a `LoopformerCache`: a slot per (loop, layer), not per layer

    def get_input_embeddings(self):
        return self.model.embed.tok

    def set_input_embeddings(self, value):
        self.model.embed.tok = value

    def get_output_embeddings(self):
        return self.model.head.proj

    def new_cache(self, batch_size: int, loops: int | None = None, halt: str | HaltRule | None = None,
                  room: int = 0) -> LoopformerCache:
        """An empty cache for calls with `loops` loops (default: the config's) or under the halting rule `halt`
        (its max loops), with room for `room` positions before it grows."""
        loops, rule = self.call_depth(loops, halt)
        return LoopformerCache(self.model, batch_size, loops or (rule.max_loops if rule else None), room)

    def call_depth(self, loops: int | None, halt: str | HaltRule | None) -> tuple[int | None, HaltRule | None]:
        """A call's loop count (None: the model's r) and halting rule, from its arguments or the config."""
        loops = loops if loops is not None else self.config.inference_loops
        halt = halt if halt is not None else self.config.halt
        return (None if loops is None else int(loops)), (HaltRule.parse(halt) if isinstance(halt, str) else halt)

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache: Cache | None = None,
                labels: torch.LongTensor | None = None, use_cache: bool | None = None,
                return_dict: bool | None = None, loops: int | None = None, halt: str | HaltRule | None = None,
                past_key_values: Cache | None = None, **kwargs):
        if input_ids is None:
            raise UserError("a loopformer model reads token ids (input_ids), not inputs_embeds")
        for flag in ("output_hidden_states", "output_attentions"):
            if kwargs.pop(flag, None):
                raise UserError(f"{flag} is not available for loopformer models")
        cache = cache if cache is not None else past_key_values
        use_cache = use_cache if use_cache is not None else (self.config.use_cache and not self.training)
        R, rule = self.call_depth(loops, halt)
        if use_cache and cache is None:
            cache = self.new_cache(input_ids.shape[0], R, rule, room=input_ids.shape[1])
        if use_cache and not isinstance(cache, LoopformerCache):
            raise UserError(f"a loopformer model keeps its keys and values in a LoopformerCache (model.new_cache), "
                            f"not a {type(cache).__name__}")
        if use_cache:
            cache.reserve(input_ids.shape[1])
        call = {} if R is None else {"loops": R}
        out = self.model(input_ids, attn_mask=None if attention_mask is None else attention_mask.bool(),
                         positions=position_ids, cache=cache.kv if use_cache else None, halt=rule, **call)
        logits = out.logits
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=logits.shape[-1], **kwargs)
        result = CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache if use_cache else None})
        return result if return_dict is not False else result.to_tuple()


__all__ = ["LoopformerForCausalLM", "LoopformerCache", "LoopSlot", "hf_config", "model_config"]
