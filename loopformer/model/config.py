"""Model configuration: one dataclass describes the whole family (standard, looped, timestep-modulated).

    standard Transformer   n_layers = L, loops = 1
    Looped Transformer     n_layers = k (usually 1), loops = r            (paper Sec. 2.2: L2 ∘ TF^r ∘ L1)
    TMLT                   ... and timestep = True                        (paper Sec. 4.2, Eq. 12-15)

Presets carry the paper's sizes (App. C.1.3 reasoning, C.2 ICL, C.3 language modelling).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from loopformer.errors import UserError
from loopformer.model.extensions import check as check_extensions
from loopformer.model.lengths import check as check_loop_rule
from loopformer.model.stability import check as check_stabilisers

_ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu")
_HEADS = ("lm", "sequence", "regression")
_PAST_R = ("continue", "clamp", "hold", "own")
_TIMES = ("index", "normalized")
# upper bounds of the size fields (far above any model that fits a machine today; checked before allocating)
LIMITS = {"vocab_size": 1 << 24, "input_dim": 1 << 20, "max_len": 1 << 24, "d_model": 1 << 17, "n_heads": 1 << 12,
          "head_dim": 1 << 14, "ffn_dim": 1 << 20, "n_layers": 4096, "loops": 4096, "supervision_steps": 4096,
          "timestep_freq_dim": 1 << 16, "n_out": 1 << 24}


@dataclass
class ModelConfig:
    # L1: read-in. Exactly one of vocab_size (token ids) / input_dim (real vectors, e.g. in-context learning).
    vocab_size: int = 0
    input_dim: int = 0
    max_len: int = 1024               # learned positions available
    pos: str = "learned"              # "learned" (a trained vector per position < max_len) | "none" | "rope" (rotary:
                                      # q·k depends on relative positions only; no length limit)
    rope_base: float = 10000.0        # RoPE's base: angles p·base^(−2i/head_dim)
    pos_factors: list[list[int]] | None = None  # set by the task (task.position_factors): per factor, each
                                      # position's index in it (Sudoku: row, column, box); L1 adds one learned
                                      # table per factor to the position's embedding
    # TF: the looped block
    d_model: int = 256
    n_heads: int = 4
    head_dim: int | None = None    # default d_model // n_heads
    ffn_dim: int | None = None     # default 4 * d_model
    n_layers: int = 1                 # k layers per block (the standard Transformer: L layers, loops = 1)
    loops: int = 1                    # r: how often the block is applied (override per call with loops=)
    loop_rule: str = "fixed"          # loops as a function of a row's size n (length generalisation;
                                      # loopformer.model.lengths): "fixed" (r) | "linear:a,b" ⌈a·n + b⌉ |
                                      # "log:c,b" ⌈c·⌈log2 n⌉ + b⌉; r must cover the largest training size
    activation: str = "gelu"          # "gelu" (exact erf) | "gelu_tanh" | "relu" | "silu"
    norm: str = "rms"                 # pre-norm: "rms" | "none"
    norm_gain: bool = True            # learnable gain in the block's RMSNorms
    norm_eps: float | None = None  # None: machine epsilon of the dtype (torch.nn.RMSNorm's default)
    bias: bool = False
    dropout: float = 0.0
    causal: bool = True
    attn_scale: float | None = None  # softmax scale; None = 1/sqrt(head_dim); large values approach hardmax
    attn_window: int = 0              # w > 0: a sliding attention window — a query at position i sees the keys at
                                      # i-w+1..i (and, bidirectional, ..i+w-1), counted in slots; 0: every key. With
                                      # rotary positions every relative offset a windowed block meets at any length is
                                      # one it met in training (docs/length-generalisation.md)
    timestep: bool = False            # TMLT: α(t), γ(t) from the loop index (Eq. 12-15)
    timestep_freq_dim: int = 256      # width of the sinusoidal loop-index features PE(t)
    timestep_max_period: float = 10000.0
    timestep_embed: str = "sinusoid"  # PE(t) of Eq. 12: "sinusoid" (the paper's) | "learned" (a trained vector per
                                      # loop t < loops; later loops reuse the last one)
    timestep_scale: float = 1.0       # the sinusoid reads PE(scale · t) (>1 spreads few loops over more phase)
    timestep_gate_init: float = 1.0   # initial residual gates γ1, γ2 (b5's gate half). 1 (default): the untrained TMLT
                                      # block is the untrained looped block; 0: adaLN-Zero, the paper's and the
                                      # authors' choice (the untrained block is the identity). See docs/tmlt-study.md
    timestep_time: str = "index"      # what the timestep encoding reads: "index" (the paper's loop index t) |
                                      # "normalized" (a budget-aware model: the time τ = t / R of a run of R loops,
                                      # read as PE(r·τ) — at R = r exactly the paper's PE(t) — plus a second embedder
                                      # of the step size Δt = 1 / R, read as PE(r·Δt), summed into TE; LoopFormer's
                                      # parametrisation). See docs/elastic-depth.md
    timestep_past: str = "continue"   # the loop index past the trained loops (t >= loops): "continue" the sinusoid
                                      # PE(t) | "clamp" to the last trained t = loops - 1 (a learned table always
                                      # clamps) | "hold": every loop past r reads one index of its own, t = loops
                                      # (the hold index: trained by loop counts drawn past r, `train.loops.hold`;
                                      # sinusoid only). Changes no weights: choose it at load / evaluation time |
                                      # "own": every loop past r reads a modulation of its own, a parameter
                                      # (`Layer.past_modulation` [4,D] per layer; with input injection also the
                                      # injection's scale β [D], h + β ⊙ e) that nothing before r reads — trained
                                      # alone (`train.optim.freeze`), loops 1..r stay exactly as they were. Started from
                                      # weights without them (train.init_from): the hold index's modulation (t = r)
                                      # and β = 1. Weights of their own: set it before training
    input_injection: bool = False     # add the read-in embedding before every loop after the first
    # the start state and state noise (loopformer.model.stability)
    start_state: str = "input"        # h_0: "input" (the read-in e) | "zeros" (0, e injected before the first loop
                                      # too; needs input_injection)
    state_noise: float = 0.0          # training only: h_t += σ·RMS(h_t)·ε after every loop (0: off)
    extensions: dict[str, Any] = field(default_factory=dict)  # experiments on the loop by name, with their options
                                      # (loopformer.model.extensions), e.g. {noise_start: {sigma: 1.0}}; the lab's:
                                      # noise_start, sandwich_norm
    # deep supervision (loopformer.model.recursion): `supervision_steps` steps of `loops` loops each, every step
    # starting from the previous one's (detached) hidden state with its own loss; inference runs them as one pass
    # of supervision_steps × loops loops
    supervision_steps: int = 1        # N: steps per sample (1: plain training, the loss after `loops` loops)
    step_timestep: str = "continue"   # TMLT's loop index across steps: "continue" counting (step s, loop t reads
                                      # s·loops + t) | "restart" at every step (reads t: one block, N times)
    exit_gate: bool = False           # a learned exit gate: one stop logit per position after every loop
                                      # (loopformer.model.halting.ExitGate); off: no extra weights
    # L2: read-out
    head: str = "lm"                  # "lm" (per-token logits) | "sequence" (pooled classes) | "regression"
    n_out: int | None = None       # default: vocab_size for "lm", 1 for "regression"
    pool: str = "mean"                # sequence head: "mean" | "last" | "first"
    final_norm: bool = True
    tie_embeddings: bool = False      # lm head shares the token embedding
    # memory options for deep loops
    grad_loops: int | None = None  # backpropagate through the last grad_loops loops only (truncated BPTT)
    checkpoint: bool = False          # activation checkpointing per loop
    # compatibility with published checkpoints (see loopformer.model.convert)
    compat: str = "none"              # "none" | "authors": their LT quirk (v from un-normalised x, no MLP pre-norm)
    init_std: float = 0.02

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)

        need((self.vocab_size > 0) != (self.input_dim > 0),
             f"exactly one of vocab_size / input_dim must be > 0 (got {self.vocab_size}, {self.input_dim})")
        for name, hi in LIMITS.items():    # sizes no machine holds: refused before anything is allocated
            v = getattr(self, name)
            need(v is None or v <= hi, f"{name}={v} exceeds {hi:,} (the largest this library accepts)")
        need(self.supervision_steps * self.loops <= LIMITS["loops"],
             f"supervision_steps × loops = {self.supervision_steps * self.loops} exceeds {LIMITS['loops']:,}")
        need(self.d_model > 0 and self.n_heads > 0, "d_model and n_heads must be positive")
        need(0 <= self.attn_window <= LIMITS["max_len"],
             f"attn_window must be 0 (every key) or 1..{LIMITS['max_len']:,} positions (got {self.attn_window})")
        if self.head_dim is None:
            need(self.d_model % self.n_heads == 0,
                 f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; set head_dim")
        else:
            need(self.head_dim > 0, "head_dim must be positive")
        need(self.ffn_dim is None or self.ffn_dim > 0, "ffn_dim must be positive")
        need(self.n_layers >= 1, f"n_layers must be >= 1 (got {self.n_layers})")
        need(self.loops >= 1, f"loops must be >= 1 (got {self.loops})")
        need(self.max_len >= 1, "max_len must be >= 1")
        need(self.pos in ("learned", "none", "rope"), f"pos must be 'learned', 'none' or 'rope' (got {self.pos!r})")
        if self.pos == "rope":
            need(self.hd % 2 == 0, f"pos='rope' rotates pairs of a head's dimensions: head_dim={self.hd} must be even")
            need(math.isfinite(self.rope_base) and self.rope_base > 1, "rope_base must be > 1")
        for f in self.pos_factors or []:
            need(len(f) >= self.max_len and min(f) >= 0,
                 f"pos_factors: every factor needs a non-negative index for each of the max_len={self.max_len} "
                 f"positions (got {len(f)} entries)")
        check_stabilisers(self)
        check_extensions(self)
        check_loop_rule(self)
        need(self.activation in _ACTIVATIONS, f"activation must be one of {_ACTIVATIONS} (got {self.activation!r})")
        need(self.norm in ("rms", "none"), f"norm must be 'rms' or 'none' (got {self.norm!r})")
        need(0.0 <= self.dropout < 1.0, f"dropout must be in [0, 1) (got {self.dropout})")
        need(self.head in _HEADS, f"head must be one of {_HEADS} (got {self.head!r})")
        need(self.pool in ("mean", "last", "first"), f"pool must be mean/last/first (got {self.pool!r})")
        need(self.n_out is None or self.n_out > 0, "n_out must be positive")
        need(self.head == "regression" or self.n_out is not None or self.vocab_size > 0,
             f"head={self.head!r} with vector input needs n_out")
        need(self.timestep_freq_dim >= 2 and self.timestep_freq_dim % 2 == 0, "timestep_freq_dim must be even")
        need(self.timestep_embed in ("sinusoid", "learned"),
             f"timestep_embed must be 'sinusoid' or 'learned' (got {self.timestep_embed!r})")
        need(math.isfinite(self.timestep_scale) and self.timestep_scale > 0, "timestep_scale must be > 0")
        need(self.timestep_past in _PAST_R, f"timestep_past must be one of {_PAST_R} (got {self.timestep_past!r})")
        need(self.timestep_past != "hold" or self.timestep_embed == "sinusoid",
             "timestep_past='hold' reads the index r, which a learned table (r vectors) lacks: use "
             "timestep_embed='sinusoid'")
        need(self.timestep_past != "own" or (self.timestep and self.timestep_time == "index"),
             "timestep_past='own' is a modulation of the loops past r: it needs timestep=true and "
             "timestep_time='index'")
        need(self.timestep_time in _TIMES, f"timestep_time must be one of {_TIMES} (got {self.timestep_time!r})")
        if self.timestep_time == "normalized":
            need(self.timestep, "timestep_time='normalized' conditions the timestep encoding: set timestep=true")
            need(self.timestep_embed == "sinusoid", "timestep_time='normalized' reads the sinusoid at fractional "
                                                    "times: timestep_embed must be 'sinusoid'")
            need(self.supervision_steps == 1, "timestep_time='normalized' needs supervision_steps = 1")
        need(self.supervision_steps >= 1, f"supervision_steps must be >= 1 (got {self.supervision_steps})")
        need(self.step_timestep in ("continue", "restart"),
             f"step_timestep must be 'continue' or 'restart' (got {self.step_timestep!r})")
        need(self.grad_loops is None or self.grad_loops >= 1, "grad_loops must be >= 1 (or null for all loops)")
        need(self.compat in ("none", "authors"), f"compat must be 'none' or 'authors' (got {self.compat!r})")
        if self.tie_embeddings:
            need(self.vocab_size > 0 and self.head == "lm" and self.out_dim == self.vocab_size,
                 "tie_embeddings needs token input and an lm head over the vocabulary")
        need(not (self.exit_gate and self.head == "sequence"),
             "exit_gate needs a per-position read-out (head lm or regression), not head='sequence'")
        need(self.init_std > 0, "init_std must be positive")
        need(self.norm_eps is None or (math.isfinite(self.norm_eps) and self.norm_eps > 0),
             f"norm_eps must be a positive number or null (got {self.norm_eps})")
        need(math.isfinite(self.timestep_gate_init), "timestep_gate_init must be a finite number")

    # derived sizes
    @property
    def indexed_positions(self) -> bool:
        """Whether the read-in embeds position indices (learned positions or position factors): sequences are then
        limited to max_len and positions count from the first real token."""
        return self.pos == "learned" or bool(self.pos_factors)

    @property
    def hd(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def ffn(self) -> int:
        return self.ffn_dim if self.ffn_dim is not None else 4 * self.d_model

    @property
    def out_dim(self) -> int:
        if self.n_out is not None:
            return self.n_out
        return self.vocab_size if self.head in ("lm", "sequence") else 1

    @property
    def total_loops(self) -> int:
        """Loops of a full inference pass: supervision_steps × loops."""
        return self.supervision_steps * self.loops

    @property
    def variant(self) -> str:
        """'standard', 'looped' or 'tmlt' — the name used in result tables."""
        if self.timestep:
            return "tmlt"
        return "looped" if self.loops > 1 else "standard"

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


# fields that left the core (docs/architecture.md, "What left the core"): their defaults, which old configs and
# checkpoints hold and which are dropped on reading; set otherwise they are refused, or turned into their extension
REMOVED = {"loop_scale": "none", "layerscale_init": 0.1, "sandwich_norm": False, "grad_window": None,
           "forget_gate": False, "forget_gate_bias": 4.0, "start_noise": 1.0,
           "solver": "unroll", "solver_tol": 1e-3, "solver_max_iter": 0, "solver_backward": "bptt"}
BEFORE_SPLIT = "before-core-split"   # the code's tag before they left: runs that used them run from there
BEFORE_FIXED_POINT = "before-fixed-point-exit"   # ... for the fixed-point mode's fields (solver*: it trained one task
                                                  # of four, studies/transfer)
LEFT_AT = {key: BEFORE_FIXED_POINT if key.startswith("solver") else BEFORE_SPLIT for key in REMOVED}


def _same(value: Any, default: Any) -> bool:
    """Whether a removed field's value is its default (a float default also as text: YAML reads `1e-3` as text)."""
    if isinstance(default, float) and isinstance(value, (str, int)) and not isinstance(value, bool):
        try:
            return float(value) == default
        except ValueError:
            return False
    return value == default


def migrate(data: dict) -> dict:
    """A model section (a YAML's `model:`, a checkpoint's config.json) written before some fields left the core,
    in today's form: a removed field at its default dropped; `sandwich_norm: true` and `start_state: noise` (with
    its `start_noise`) turned into their lab extensions; any other removed field set → a ValueError naming it."""
    if not isinstance(data, dict) or not (set(data) & set(REMOVED) or data.get("start_state") == "noise"):
        return data
    data = dict(data)
    ext = dict(data.get("extensions") or {})
    if data.pop("sandwich_norm", False) is True:
        ext["sandwich_norm"] = {}
    sigma = data.pop("start_noise", 1.0)
    if data.get("start_state") == "noise":
        data["start_state"] = "input"
        ext["noise_start"] = {"sigma": sigma}
    for key, default in REMOVED.items():
        if key in data and not _same(data.pop(key), default):
            raise ValueError(f"model.{key} has left loopformer (its study found it did not help); runs that used it "
                             f"run from the tag {LEFT_AT[key]}")
    if ext:
        data["extensions"] = ext
    return data


_GPT2_VOCAB = 50304  # 50257 padded to a multiple of 64, as in the authors' code

PRESETS: dict[str, ModelConfig] = {
    # a few thousand parameters: unit tests and smoke runs
    "debug": ModelConfig(vocab_size=32, max_len=64, d_model=32, n_heads=2, loops=3, n_layers=1),
    # App. C.1.3: reasoning tasks (vocab / max_len / causal set by the task)
    "reasoning": ModelConfig(vocab_size=64, max_len=256, d_model=256, n_heads=4, n_layers=1, loops=8,
                             input_injection=True),
    "reasoning-tmlt": ModelConfig(vocab_size=64, max_len=256, d_model=256, n_heads=4, n_layers=1, loops=8,
                                  input_injection=True, timestep=True),
    # App. C.2: in-context learning, GPT-2 style, d = 256, 8 heads, 20-dim inputs, scalar read-out
    "icl": ModelConfig(input_dim=21, max_len=256, d_model=256, n_heads=8, n_layers=1, loops=12,
                       input_injection=True, head="regression"),
    # App. C.3: WikiText-103; the looped model and the 6-layer baseline have about the same parameter count
    "lm-looped": ModelConfig(vocab_size=_GPT2_VOCAB, max_len=1024, d_model=768, n_heads=12, n_layers=1, loops=24,
                             tie_embeddings=True),
    "lm-tmlt": ModelConfig(vocab_size=_GPT2_VOCAB, max_len=1024, d_model=768, n_heads=12, n_layers=1, loops=24,
                           tie_embeddings=True, timestep=True),
    "lm-baseline": ModelConfig(vocab_size=_GPT2_VOCAB, max_len=1024, d_model=512, n_heads=8, n_layers=6, loops=1,
                               tie_embeddings=True),
}


def preset(name: str, **overrides) -> ModelConfig:
    """A named preset, optionally with fields replaced: `preset("reasoning", loops=16)`."""
    if name not in PRESETS:
        raise UserError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return PRESETS[name].replace(**overrides)
