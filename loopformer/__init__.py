"""loopformer: looped transformers with timestep encoding (Xu & Sato, ICML 2025).

    L2 ∘ TF^r ∘ L1 — a read-in, one shared block applied r times (optionally modulated by the loop index t),
    a read-out. See `loopformer.model` for the model family.
"""

import functools

from loopformer.model import LoopedTransformer, ModelConfig, preset
from loopformer.model.io import load as _load_checkpoint
from loopformer.model.io import save_checkpoint
from loopformer.version import __version__


@functools.wraps(_load_checkpoint)
def load(path, *args, **kwargs) -> LoopedTransformer:
    if isinstance(path, str) and path.startswith("hf:"):       # a Hub repository: loopformer.hf.hub (extra `hf`)
        from loopformer.errors import UserError
        if args or set(kwargs) - {"device"}:
            raise UserError("loopformer.load('hf:ORG/NAME') takes device= only")
        try:
            from loopformer.hf.hub import load_hub
        except ImportError as exc:
            raise UserError(f"loading {path} needs transformers: pip install 'loopformer[hf]' ({exc})") from None
        return load_hub(path[3:], **kwargs)
    return _load_checkpoint(path, *args, **kwargs)


load.__doc__ = (_load_checkpoint.__doc__ or "") + """
    `path` "hf:ORG/NAME[@REVISION]": the model of a Hub repository that `loopformer push` (or `hf export` and an
    upload) wrote, downloaded and cached by huggingface_hub (`loopformer.hf.hub.load_hub`; the extra `hf`).
"""

__all__ = ["LoopedTransformer", "ModelConfig", "preset", "load", "save_checkpoint", "__version__"]
