"""loopformer: looped transformers with timestep encoding (Xu & Sato, ICML 2025).

    L2 ∘ TF^r ∘ L1 — a read-in, one shared block applied r times (optionally modulated by the loop index t),
    a read-out. See `loopformer.model` for the model family.
"""

from loopformer.model import LoopedTransformer, ModelConfig, preset
from loopformer.model.io import load, save_checkpoint
from loopformer.version import __version__

__all__ = ["LoopedTransformer", "ModelConfig", "preset", "load", "save_checkpoint", "__version__"]
