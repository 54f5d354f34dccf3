"""Evaluation with adaptive depth: the metrics of a halting rule equal the task's metrics of the per-row exits
scored by hand; loops used and wall times are reported; the `eval --halt` / `--halt-sweep` command and its errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_train import TINY

from loopformer.cli import main
from loopformer.eval.halting import best_rule, evaluate_halting, format_halting, halting_sweep
from loopformer.model import LoopedTransformer
from loopformer.model.options import LoopOptions
from loopformer.sources import make_data
from loopformer.train.config import load_run_config


def _model_and_data(*extra):
    cfg = load_run_config(None, [*TINY, "task.answer_only=true", "model.loops=4", *extra])
    torch.manual_seed(1)
    model = LoopedTransformer(cfg.model)
    with torch.no_grad():   # a random but not degenerate model: argmaxes differ per loop
        model.head.proj.weight.mul_(20)
        for p in model.blocks.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model.eval(), make_data(cfg.task)


def test_halting_metrics_are_the_exits_scored_by_hand():
    model, data = _model_and_data()
    res = evaluate_halting(model, data, ["argmax:1", "kl:0.5", "kl:0"], batch_size=7)
    x = torch.as_tensor(np.asarray(data.test["inputs"], dtype=np.int64))
    y = torch.as_tensor(np.asarray(data.test["targets"], dtype=np.int64))
    with torch.no_grad():
        full = model(x, loops=4, return_all=True).all_logits.argmax(-1)               # [R,N,T]
        out = model(x, halt="argmax:1", opts=LoopOptions(halt_positions=y != -100))
    pred = full[out.exit_loops - 1, torch.arange(len(x))].numpy()                    # each row at its exit loop
    r = res["rules"][0]
    assert r["metrics"] == pytest.approx(data.task.metrics(pred, data.test), nan_ok=True)
    assert r["mean_loops"] == pytest.approx(out.exit_loops.float().mean().item())
    assert r["p90_loops"] == pytest.approx(np.percentile(out.exit_loops.numpy(), 90))
    assert res["fixed"]["metrics"] == pytest.approx(data.task.metrics(full[-1].numpy(), data.test), nan_ok=True)
    never = res["rules"][2]                                          # KL < 0 never holds: fixed depth
    assert never["mean_loops"] == 4 and never["metrics"] == res["fixed"]["metrics"]
    assert all(q["wall_s"] > 0 and q["speedup"] > 0 for q in res["rules"])
    assert "| fixed r = 4 |" in format_halting(res) and "| argmax:1 |" in format_halting(res)


def test_sweep_has_the_fixed_curve_and_a_best_rule():
    model, data = _model_and_data()
    res = halting_sweep(model, data, ["argmax", "entropy", "gate"], batch_size=64)   # no gate: skipped
    assert [p["loop"] for p in res["fixed_curve"]] == [1, 2, 3, 4]
    assert {r["criterion"] for r in res["rules"]} == {"argmax", "entropy"}
    best = best_rule(res, max_loss=1.0)                                # anything goes: the fewest loops
    assert best["mean_loops"] == min(r["mean_loops"] for r in res["rules"])


def test_eval_command_with_halting(tmp_path, capsys, monkeypatch):
    from loopformer.model.halting import HaltRule
    from loopformer.train.trainer import train
    cfg = load_run_config(None, [*TINY, "task.answer_only=true", "train.steps=3", f"out_dir={tmp_path / 'r'}"])
    train(cfg)
    out_json, png = tmp_path / "e.json", tmp_path / "s.png"
    parsed, parse = [], HaltRule.parse.__func__
    monkeypatch.setattr(HaltRule, "parse", classmethod(lambda cls, text: parsed.append(text) or parse(cls, text)))
    assert main(["eval", str(tmp_path / "r"), "--halt", "kl:1e-3", "--halt", "argmax:2", "--halt-sweep", "argmax",
                 "--plot", str(png), "--json", str(out_json), "--quiet", "-n", "16"]) == 0
    printed = capsys.readouterr().out
    assert "adaptive depth" in printed and "| kl:0.001 |" in printed and "threshold sweep" in printed
    ev = json.loads(out_json.read_text())
    assert [r["rule"] for r in ev["halting"]["rules"]] == ["kl:0.001", "argmax:2"]
    assert png.stat().st_size > 0
    assert parsed == ["kl:1e-3", "argmax:2"]                        # each rule parsed once (by EvalConfig)


@pytest.mark.parametrize("argv, needle", [
    (["--halt", "kl"], "CRITERION:THRESHOLD"),
    (["--halt", "wobble:1"], "unknown criterion"),
    (["--halt", "kl:x"], "not a number"),
    (["--halt", "gate:0.5"], "exit gate"),
    (["--halt-sweep", "kl,wobble"], "unknown halting criterion"),
    (["--plot", "x.png"], "--halt-sweep"),
])
def test_bad_halting_flags_are_one_line_with_status_2(tmp_path, capsys, argv, needle):
    from loopformer.train.trainer import train
    run = tmp_path / "r"
    train(load_run_config(None, [*TINY, "train.steps=1", f"out_dir={run}"]))
    capsys.readouterr()
    assert main(["eval", str(run), "--quiet", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("loopformer: error: ") and needle in err[0]


def test_runs_record_halting_and_the_report_tables_it(tmp_path):
    from loopformer.experiments.report import write_report
    from loopformer.train.trainer import train
    res = train(load_run_config(None, [*TINY, "task.answer_only=true", "train.steps=2", "eval.halt=[kl:1e-3,argmax:2]",
                                       f"out_dir={tmp_path / 'r'}"]))
    assert [q["rule"] for q in res["halting"]["rules"]] == ["kl:0.001", "argmax:2"]
    assert res["halting"]["fixed"]["metrics"]["accuracy"] == pytest.approx(res["test"]["accuracy"])
    rep = write_report(tmp_path)
    table = (tmp_path / "halting.md").read_text()
    assert "halting.md" in rep["files"] and "| r | kl:0.001 |" in table and "| r | argmax:2 |" in table
    with pytest.raises(Exception, match="eval.halt"):
        load_run_config(None, [*TINY, "eval.halt=[kl]"])


def test_causal_models_halt_per_token_in_evaluation():
    cfg = load_run_config(None, [*TINY, "model.loops=4"])
    assert cfg.model.causal
    torch.manual_seed(1)
    model = LoopedTransformer(cfg.model).eval()
    with torch.no_grad():
        model.head.proj.weight.mul_(20)
    data = make_data(cfg.task)
    res = evaluate_halting(model, data, ["kl:0", "argmax:1"], batch_size=16)
    never, early = res["rules"]
    assert never["metrics"] == pytest.approx(res["fixed"]["metrics"], nan_ok=True) and never["mean_loops"] == 4
    n_supervised = int((np.asarray(data.test["targets"]) != -100).sum())
    x = torch.as_tensor(np.asarray(data.test["inputs"], dtype=np.int64))
    y = torch.as_tensor(np.asarray(data.test["targets"], dtype=np.int64))
    out = model(x, halt="argmax:1", opts=LoopOptions(halt_positions=y != -100))
    assert out.exit_loops.shape == x.shape                           # per token
    assert early["mean_loops"] == pytest.approx(out.exit_loops[y != -100].float().mean().item())
    assert n_supervised > len(x)


def test_a_rule_with_its_own_max_runs_up_to_it():
    model, data = _model_and_data()
    res = evaluate_halting(model, data, ["kl:0,max=6", "kl:0,max=2"], batch_size=64, limit=20)
    assert [q["mean_loops"] for q in res["rules"]] == [6, 2] and res["loops"] == 4
    res = evaluate_halting(model, data, ["kl:0,max=6"], loops=3, batch_size=64, limit=20)
    assert res["rules"][0]["mean_loops"] == 3                         # an explicit loop count bounds every rule


# ------------------------------------------------------------------------------------------------ other data
def _perturbed(model: LoopedTransformer, scale: float = 0.3) -> LoopedTransformer:
    torch.manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return model.eval()


def test_halting_on_in_context_learning_scores_each_prompt_point_by_hand():
    cfg = load_run_config(None, ["task.name=icl", "task.options={function_class: linear, n_dims: 3}", "task.points=6",
                                 "task.n_test=40", "model.d_model=16", "model.n_heads=2", "model.loops=4",
                                 "model.input_injection=true"])
    model, data = _perturbed(LoopedTransformer(cfg.model)), make_data(cfg.task)
    res = evaluate_halting(model, data, ["latent:0.55", "latent:0"], batch_size=16)
    t = data.as_tensors({k: v for k, v in data.test.items()}, torch.device("cpu"))
    counted = t["weight"] > 0                                                         # the prediction positions
    with torch.no_grad():
        out = model(t["inputs"], halt="latent:0.55")                                   # per token: causal
        fixed = model(t["inputs"]).logits
    assert out.exit_loops.shape == counted.shape and len(set(out.exit_loops[counted].tolist())) >= 2
    sq = ((out.logits[..., 0] - t["targets"]) ** 2 * t["weight"]).sum() / t["weight"].sum()
    r, never = res["rules"]
    assert res["metric"] == "mse" and not res["higher_is_better"]
    assert r["metrics"]["mse"] == pytest.approx(sq.item() / data.error_scale, rel=1e-5)
    assert r["mean_loops"] == pytest.approx(out.exit_loops[counted].float().mean().item())
    fixed_sq = ((fixed[..., 0] - t["targets"]) ** 2 * t["weight"]).sum() / t["weight"].sum()
    assert res["fixed"]["metrics"]["mse"] == pytest.approx(fixed_sq.item() / data.error_scale, rel=1e-5)
    assert never["mean_loops"] == 4 and never["metrics"] == pytest.approx(res["fixed"]["metrics"])


def test_halting_on_text_is_per_token_perplexity(tmp_path, capsys):
    rng = np.random.default_rng(0)
    words = ["to", "be", "or", "not", "that", "is", "the", "question"]
    (tmp_path / "t.txt").write_text("".join(" ".join(rng.choice(words, 7)) + "\n" for _ in range(120)))
    assert main(["text", "prepare", str(tmp_path / "t.txt"), "--out", str(tmp_path / "data"), "--vocab-size", "280",
                 "--quiet"]) == 0
    cfg = load_run_config(None, ["task.name=text", f"task.data_dir={tmp_path / 'data'}", "task.block_size=16",
                                 "task.eval_windows=6", "model.d_model=16", "model.n_heads=2", "model.loops=4",
                                 "model.timestep=true"])
    model, data = _perturbed(LoopedTransformer(cfg.model)), make_data(cfg.task)
    res = evaluate_halting(model, data, ["entropy:4.7", "kl:0"], batch_size=4)
    batches = list(data.test_batches(100))
    x = torch.as_tensor(batches[0]["inputs"])
    y = torch.as_tensor(batches[0]["targets"])
    with torch.no_grad():
        out = model(x, halt="entropy:4.7")
    nll = torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), y.reshape(-1))
    r, never = res["rules"]
    assert len(set(out.exit_loops.flatten().tolist())) >= 2                          # tokens stop at different loops
    assert r["metrics"]["ppl"] == pytest.approx(float(nll.exp()), rel=1e-5) and r["metrics"]["tokens"] == y.numel()
    assert r["mean_loops"] == pytest.approx(out.exit_loops.float().mean().item())
    assert never["mean_loops"] == 4 and never["metrics"]["ppl"] == pytest.approx(res["fixed"]["metrics"]["ppl"])
    worse = {**res, "rules": [{**r, "metrics": {"ppl": res["fixed"]["metrics"]["ppl"] + 1}}]}
    assert best_rule(worse, max_loss=0.5) is None                                  # lower is better for perplexity


def test_halt_and_halt_sweep_default_to_the_loops_fixed_depth_runs(tmp_path):
    """One default depth: with supervision steps (N of r loops) `--halt`, `--halt-sweep` and the fixed-depth metrics
    all run N·r loops unless --loops says otherwise."""
    from loopformer.train.trainer import train
    run = tmp_path / "r"
    train(load_run_config(None, [*TINY, "task.answer_only=true", "model.loops=2", "model.supervision_steps=2",
                                 "train.steps=2", f"out_dir={run}"]))
    js = tmp_path / "e.json"
    assert main(["eval", str(run), "--halt", "kl:0", "--halt-sweep", "argmax", "--no-loopwise", "--quiet",
                 "--json", str(js)]) == 0
    res = json.loads(js.read_text())
    assert res["loops"] == res["trained_loops"] == 4
    assert res["halting"]["loops"] == res["halting_sweep"]["loops"] == 4
    assert res["halting"]["rules"][0]["mean_loops"] == 4                              # KL < 0 never holds
    model, data = _model_and_data("model.supervision_steps=2")
    assert evaluate_halting(model, data, ["kl:0"], batch_size=64)["loops"] == 8
