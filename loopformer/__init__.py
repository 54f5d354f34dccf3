"""loopformer: looped transformers with timestep encoding (Xu & Sato, ICML 2025).

    L2 ∘ TF^r ∘ L1 — a read-in, one shared block applied r times (optionally modulated by the loop index t),
    a read-out. See `loopformer.model` for the model family.
"""

__version__ = "0.1.0"

from loopformer.model import LoopedTransformer, ModelConfig, preset  # noqa: E402
from loopformer.model.io import load, save_checkpoint  # noqa: E402

__all__ = ["LoopedTransformer", "ModelConfig", "preset", "load", "save_checkpoint", "__version__"]
