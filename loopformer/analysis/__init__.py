"""Measurements on trained models: continuity coefficients of the learned map (paper Sec. 3.2 moduli of
continuity; App. D perturbed-corpus experiment) — `loopformer.analysis.continuity`."""
