"""Executable theory of looped transformers (paper Sec. 3–4, App. A–B).

    exact         exact (rational / mpmath) weights and evaluator for L2 ∘ TF^r ∘ L1
    constructions Prop. A.2–A.4, Lemma A.5, A.6, Cor. A.7, Lemma A.9, Lemma 4.1, Theorem 4.2 — as printed or repaired
    compose       Theorem A.1: the three steps in one block of width 17d+9 (two heads of size 1, FF width 49d+25)
    bounds        the rate of Theorem 3.6 (δ as a function of r, the bound, duplicate/trifling measures)
    moduli        estimators of the moduli of continuity (Def. 3.3–3.5) for any callable
    verify / rate the `loopformer theory verify` table and the `loopformer theory rate` plot
    assemble      the constructions loaded into `loopformer.model.LoopedTransformer` in float64
"""

from loopformer.theory.bounds import delta_from_loops, duplicate_measure, loops_for, theorem_bound
from loopformer.theory.compose import composed_network, contextual_labels
from loopformer.theory.constructions import (
                                             bit_extraction,
                                             contextual_mapping,
                                             contextual_mapping_ext,
                                             exact_memorization,
                                             impulse,
                                             memorization,
                                             quantization,
                                             rect,
                                             softmax_temperature_bound,
                                             step,
)
from loopformer.theory.exact import Affine, Block, FeedForward, Head, LoopedNet, evaluate
from loopformer.theory.moduli import ModulusEstimate, estimate_moduli, estimate_modulus

__all__ = [
    "Affine", "Block", "FeedForward", "Head", "LoopedNet", "evaluate",
    "rect", "step", "impulse", "quantization", "contextual_mapping", "contextual_mapping_ext", "bit_extraction",
    "memorization", "exact_memorization", "softmax_temperature_bound", "composed_network", "contextual_labels",
    "delta_from_loops", "loops_for", "theorem_bound", "duplicate_measure",
    "ModulusEstimate", "estimate_modulus", "estimate_moduli",
]
