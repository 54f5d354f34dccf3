"""The lab: experiments that run through the loop's extension point (`loopformer.model.extensions`) and that the
core never imports. Each is named in a config (`model.extensions: {noise_start: {sigma: 1.0}}`) and found through
the entry points pyproject.toml lists; its study's page says what it measured.

    loop_scales     free per-loop scales η(t) of the block's update, Theorem 4.2's model (`loopformer.lab.loop_scales`):
                    the dials study's third arm
    noise_start     EqR's random start state (`loopformer.lab.noise_start`)
    sandwich_norm   Huginn's norms on both sides of each residual branch (`loopformer.lab.sandwich`)
    state_norm      the carried state normalised after every loop (`loopformer.lab.state_norm`): a candidate of the
                    deep recipe
"""
