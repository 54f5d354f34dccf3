"""The loop's extension point (loopformer.model.extensions) and the lab's extensions (loopformer.lab) against hand
computations; configs written before fields left the core (loopformer.model.config.migrate)."""

import json

import pytest
import torch

from loopformer.errors import UserError
from loopformer.model import LoopedTransformer, ModelConfig
from loopformer.model.config import migrate
from loopformer.model.extensions import LoopExtension, available, register
from loopformer.model.io import load, save_checkpoint
from loopformer.model.layers import rms_norm
from loopformer.model.stability import rms


def _cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=11, d_model=16, n_heads=2, loops=4, max_len=16, input_injection=True, causal=False)
    return ModelConfig(**{**base, **kw})


@register("test_shrink")
class Shrink(LoopExtension):
    """A state hook with a parameter: the state after each loop scaled by a learned c (starts at `c0`)."""

    def __init__(self, cfg, c0: float = 0.5):
        super().__init__(cfg)
        self.c0 = c0
        self.c = torch.nn.Parameter(torch.tensor(float(c0)))

    @classmethod
    def check(cls, cfg, c0: float = 0.5) -> None:
        if not 0 < c0 <= 1:
            raise ValueError(f"extensions.test_shrink.c0 must lie in (0, 1] (got {c0})")

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.c.fill_(self.c0)

    def after_loop(self, h, out, t):
        return self.c * out


def _loops_by_hand(m, x, loops, c=1.0, h0=None):
    """h_0 = e (or h0 with e injected), h_t = c · TF(h_{t-1} (+ e))."""
    e = m.embed(x)
    h = e if h0 is None else h0 + e
    for t in range(loops):
        if t > 0:
            h = h + e
        h = c * m.blocks[0](h)
    return h


def test_the_lab_is_found_by_name_and_unknown_names_are_refused():
    assert {"noise_start", "sandwich_norm", "test_shrink"} <= set(available())
    with pytest.raises(ValueError, match="no extension named 'nope'.*noise_start"):
        _cfg(extensions={"nope": {}})
    with pytest.raises(ValueError, match="extensions.noise_start: .*unexpected keyword argument 'sigmaa'"):
        _cfg(extensions={"noise_start": {"sigmaa": 0.5}})
    with pytest.raises(ValueError, match="noise_start needs input_injection"):
        _cfg(extensions={"noise_start": {}}, input_injection=False)
    with pytest.raises(ValueError, match="test_shrink.c0 must lie"):
        _cfg(extensions={"test_shrink": {"c0": 2.0}})
    with pytest.raises(ValueError, match="options as key: value pairs"):
        _cfg(extensions={"test_shrink": 0.5})


def test_a_state_hook_runs_on_every_path_and_trains():
    torch.manual_seed(0)
    m = LoopedTransformer(_cfg(extensions={"test_shrink": {"c0": 0.5}})).eval()
    x = torch.randint(0, 11, (2, 6))
    torch.testing.assert_close(m(x).hidden, _loops_by_hand(m, x, 4, c=0.5))
    # the exits run the same step: a rule that never stops gives the fixed-depth state
    out = m(x, halt="kl:0")
    torch.testing.assert_close(out.hidden, m(x).hidden)
    # with the same weights and no extension, the plain loop
    plain = LoopedTransformer(_cfg()).eval()
    plain.load_state_dict({k: v for k, v in m.state_dict().items() if not k.startswith("extensions.")})
    torch.testing.assert_close(plain(x).hidden, _loops_by_hand(m, x, 4))
    # its parameter is trained like any other
    m.train()
    m(x).logits.square().mean().backward()
    assert m.extensions[0].c.grad is not None and m.extensions[0].c.grad != 0


def test_an_extended_model_round_trips_a_checkpoint(tmp_path):
    torch.manual_seed(0)
    m = LoopedTransformer(_cfg(extensions={"test_shrink": {"c0": 0.25}})).eval()
    with torch.no_grad():
        m.extensions[0].c.fill_(0.75)
    save_checkpoint(tmp_path / "ckpt", m)
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["extensions"] == {"test_shrink": {"c0": 0.25}}
    back = load(tmp_path / "ckpt")
    x = torch.randint(0, 11, (2, 6))
    assert back.extensions[0].c.item() == 0.75
    torch.testing.assert_close(back(x).logits, m(x).logits)


def test_depthwise_generation_refuses_a_state_hook():
    m = LoopedTransformer(_cfg(causal=True, extensions={"test_shrink": {}})).eval()
    cache = m.new_cache(2, max_len=8)
    h = torch.zeros(2, 1, 16)
    with pytest.raises(UserError, match="step schedule"):
        m.loop_rows(h, h, torch.ones(2, 1, 1, dtype=torch.bool), torch.zeros(2, dtype=torch.long), cache,
                    torch.zeros(2, dtype=torch.long), torch.ones(2, 1, dtype=torch.bool))


def test_noise_start_against_hand_computation():
    torch.manual_seed(0)
    m = LoopedTransformer(_cfg(extensions={"noise_start": {"sigma": 0.5}}, state_noise=0.1, loops=3))
    x = torch.randint(0, 11, (2, 6))
    m.train()
    torch.manual_seed(7)
    got = m(x).hidden
    torch.manual_seed(7)
    e = m.embed(x)
    h = torch.randn_like(e) * (0.5 * rms(e)) + e                   # the start, then e injected before loop 0
    noise = [torch.randn_like(e) * 0.1 for _ in range(3)]          # drawn in the loop's order after the start
    for t in range(3):
        h = m.blocks[0](h + e if t > 0 else h)
        h = h + noise[t] * rms(h)
    torch.testing.assert_close(got, h)
    # evaluation: the start at its mean, 0, which with injection is the plain loop from e
    m.eval()
    torch.testing.assert_close(m(x).hidden, _loops_by_hand(m, x, 3))


def test_sandwich_norm_against_hand_computation_and_bounds_updates():
    torch.manual_seed(0)
    m = LoopedTransformer(_cfg(extensions={"sandwich_norm": {}})).eval()
    blk = m.blocks[0]
    with torch.no_grad():
        blk.post_attn.norm.weight.uniform_(0.5, 1.5)
        blk.post_mlp.norm.weight.uniform_(0.5, 1.5)
        blk.attn.proj.weight.mul_(100)          # outputs of size ~1: the norm's eps is negligible below
    x = torch.randn(2, 5, 16)
    post_a = lambda z: rms_norm(z, blk.post_attn.norm.weight, blk.post_attn.norm.eps)   # noqa: E731
    post_f = lambda z: rms_norm(z, blk.post_mlp.norm.weight, blk.post_mlp.norm.eps)     # noqa: E731
    x1 = x + post_a(blk.attn(blk.norm1(x)))
    torch.testing.assert_close(blk(x), x1 + post_f(blk.mlp(blk.norm2(x1))))
    # the attention update after the norm has the RMS of the gains, whatever the input's scale
    for scale in (1e-3, 1.0, 1e3):
        upd = post_a(blk.attn(blk.norm1(x * scale)))                  # [2,5,16]
        attn = blk.attn(blk.norm1(x * scale))
        ref = (blk.post_attn.norm.weight * attn / rms(attn, 0)).pow(2).mean(-1).sqrt()   # RMS(g ⊙ a/RMS(a))
        torch.testing.assert_close(upd.pow(2).mean(-1).sqrt(), ref, rtol=1e-3, atol=1e-5)
        assert float(ref.max()) <= float(blk.post_attn.norm.weight.abs().max()) + 1e-5   # bounded by the gains


def test_old_configs_are_migrated_or_refused():
    old = {"vocab_size": 11, "d_model": 16, "n_heads": 2, "loop_scale": "none", "layerscale_init": 0.1,
           "sandwich_norm": False, "grad_window": None, "forget_gate": False, "forget_gate_bias": 4.0,
           "start_noise": 1.0, "start_state": "input", "input_injection": True}
    assert migrate(old) == {"vocab_size": 11, "d_model": 16, "n_heads": 2, "start_state": "input",
                            "input_injection": True}
    m = migrate({**old, "sandwich_norm": True, "start_state": "noise", "start_noise": 0.5})
    assert m["extensions"] == {"sandwich_norm": {}, "noise_start": {"sigma": 0.5}} and m["start_state"] == "input"
    ModelConfig(**m)                                                    # a valid config
    for key, value in [("forget_gate", True), ("grad_window", 2), ("loop_scale", "rsqrt")]:
        with pytest.raises(ValueError, match=f"model.{key} has left loopformer.*before-core-split"):
            migrate({**old, key: value})


def test_an_old_checkpoint_loads_and_a_removed_switch_is_one_line(tmp_path):
    torch.manual_seed(0)
    m = LoopedTransformer(_cfg()).eval()
    save_checkpoint(tmp_path / "ckpt", m)
    path = tmp_path / "ckpt" / "config.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "forget_gate": False, "loop_scale": "none", "grad_window": None}))
    x = torch.randint(0, 11, (2, 6))
    torch.testing.assert_close(load(tmp_path / "ckpt")(x).logits, m(x).logits)
    path.write_text(json.dumps({**data, "forget_gate": True}))
    with pytest.raises(UserError, match="forget_gate has left loopformer"):
        load(tmp_path / "ckpt")


def test_the_fixed_point_fields_load_at_their_defaults_and_are_refused_set(tmp_path):
    """The fixed-point mode left the core: a checkpoint written with its fields at their defaults loads and
    computes as before; one that sets them, and an override that does, is one line naming the tag."""
    from loopformer.train.config import load_run_config
    torch.manual_seed(0)
    m = LoopedTransformer(_cfg()).eval()
    save_checkpoint(tmp_path / "ckpt", m)
    path = tmp_path / "ckpt" / "config.json"
    data = json.loads(path.read_text())
    assert "solver" not in data
    fields = {"solver": "unroll", "solver_tol": 0.001, "solver_max_iter": 0, "solver_backward": "bptt"}
    path.write_text(json.dumps({**data, **fields}))
    x = torch.randint(0, 11, (2, 6))
    torch.testing.assert_close(load(tmp_path / "ckpt")(x).logits, m(x).logits)
    for key, value in [("solver", "anderson"), ("solver_backward", "phantom:5:0.5"), ("solver_max_iter", 32)]:
        path.write_text(json.dumps({**data, **fields, key: value}))
        with pytest.raises(UserError, match=f"{key} has left loopformer.*before-fixed-point-exit"):
            load(tmp_path / "ckpt")
    tiny = ["task.name=lcs", "model.d_model=16", "model.n_heads=2", f"out_dir={tmp_path / 'run'}"]
    assert load_run_config(None, [*tiny, "model.solver=unroll", "model.solver_tol=1e-3"]) == \
        load_run_config(None, tiny)
    with pytest.raises(UserError, match="model.solver has left loopformer.*before-fixed-point-exit"):
        load_run_config(None, [*tiny, "model.solver=anderson"])


def test_state_norm_against_hand_computation_and_bounds_the_state():
    torch.manual_seed(0)
    m = LoopedTransformer(_cfg(extensions={"state_norm": {"gain": 0.5}}, loops=6)).eval()
    assert torch.equal(m.extensions[0].weight, torch.full((16,), 0.5))
    with torch.no_grad():
        for p in m.blocks.parameters():
            p.mul_(20)                                              # a block that blows an unbounded state up
    x = torch.randint(0, 11, (2, 6))
    e = m.embed(x)
    h = e
    for t in range(6):
        z = m.blocks[0](h + e if t > 0 else h)
        h = 0.5 * z / z.pow(2).mean(-1, keepdim=True).add(torch.finfo(z.dtype).eps).sqrt()
    out = m(x, return_all=True)
    torch.testing.assert_close(out.hidden, h, atol=1e-4, rtol=1e-4)          # large activations: float32 noise
    torch.testing.assert_close(out.all_hidden.pow(2).mean(-1).sqrt(), torch.full((6, 2, 6), 0.5), atol=1e-4,
                               rtol=1e-4)                           # every loop's state has RMS = the gain's
    with pytest.raises(ValueError, match="state_norm.gain must lie"):
        _cfg(extensions={"state_norm": {"gain": 0}})


def test_run_configs_of_the_earlier_release_migrate_their_model_fields(tmp_path):
    from loopformer.train.config import load_run_config
    base = ["task.name=pointer_chase", "task.options={symbols: 6, hops: 2}", "model.d_model=16", "model.n_heads=2",
            "model.input_injection=true", "train.steps=2"]
    cfg = load_run_config(None, [*base, "model.sandwich_norm=true", "model.start_state=noise",
                                 "model.start_noise=0.3", "model.forget_gate=false"])
    assert cfg.model.extensions == {"sandwich_norm": {}, "noise_start": {"sigma": 0.3}}
    old = tmp_path / "old.yaml"                                     # a YAML (or a run's stored config) of before
    old.write_text("model:\n  loop_scale: none\n  layerscale_init: 0.1\n  grad_window: null\n  sandwich_norm: true\n")
    assert load_run_config(old, base).model.extensions == {"sandwich_norm": {}}
    for bad in ("model.forget_gate=true", "model.grad_window=2", "model.loop_scale=rsqrt"):
        with pytest.raises(UserError, match=f"{bad.split('=')[0]} has left loopformer"):
            load_run_config(None, [*base, bad])
