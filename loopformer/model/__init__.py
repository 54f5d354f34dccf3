"""The model family: `ModelConfig`, presets, `LoopedTransformer` (standard / looped / TMLT), checkpoint I/O."""

from loopformer.model.cache import KVCache
from loopformer.model.config import PRESETS, ModelConfig, preset
from loopformer.model.looped import LoopedTransformer, LoopOutput
from loopformer.model.options import LoopOptions

__all__ = ["ModelConfig", "PRESETS", "preset", "LoopedTransformer", "LoopOutput", "LoopOptions", "KVCache"]
