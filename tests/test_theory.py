"""Executable theory: each construction on a table of parameter cases, checked exactly against independent
references (plain integer/rational formulas of what the statement promises); preconditions; float64 assembly;
moduli estimators on functions with known moduli; the CLI."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction as F

import numpy as np
import pytest

from loopformer.theory import constructions as C
from loopformer.theory.bounds import delta_from_loops, duplicate_measure, loops_for, theorem_bound
from loopformer.theory.exact import Block, FeedForward, evaluate, mat, vec


# ------------------------------------------------------------------------------------------- Prop. A.2–A.4
@pytest.mark.parametrize("t1,t2,eps", [(F(0), F(1), F(1, 10)), (F(-2), F(3, 5), F(1, 7))])
def test_rect(t1, t2, eps):
    for x in [t1 - 5, t1 - eps, t1, (t1 + t2) / 2, t2 - eps, t2, t2 + 3]:
        want = 1 if t1 <= x <= t2 - eps else 0
        assert C.rect(x, t1, t2, eps) == want
    mid = t1 - eps / 2                                       # trifling region: strictly between 0 and 1
    assert 0 < C.rect(mid, t1, t2, eps) < 1


@pytest.mark.parametrize("theta,M", [(0, 3), (4, F(17, 2))])
def test_impulse_and_step(theta, M):
    for x in [-M, F(-1, 3), 0, F(5, 2), M]:
        for t in range(theta - 3, theta + 4):
            assert C.impulse(x, t, theta, M) == (x if t == theta else 0)
    assert C.step(0, F(1, 5)) == 1 and C.step(F(-1, 5), F(1, 5)) == 0 and C.step(3, F(1, 5)) == 1


# ------------------------------------------------------------------------------------------------ Lemma A.5
@pytest.mark.parametrize("m,d,eps", [(2, 1, F(1, 4)), (3, 1, F(1, 30)), (4, 2, F(1, 64)), (7, 1, F(1, 700))])
def test_quantization_exact(m, d, eps):
    net = C.quantization(m, eps, d)
    assert net.loops == m - 1 and net.width == 5 * d and net.ff_width == 7 * d
    assert net.max_weight() <= max(1 / eps, 2 * F(m))
    rng = np.random.default_rng(m)
    for _ in range(6):
        ks = rng.integers(0, m, size=d)
        x = [F(int(k), m) + (F(1, m) - eps) * F(int(rng.integers(0, 101)), 100) for k in ks]
        assert evaluate(net, [x])[0] == [int(k) for k in ks]          # reference: ⌊x·δ^-1⌋
        assert [C.quantize_target(v, m) for v in x] == [int(k) for k in ks]
    # inside a trifling gap (kδ − ε, kδ) the output lies strictly between k − 1 and k
    g = C.trifling_regions(m, eps)[0]
    out = evaluate(C.quantization(m, eps, 1), [[(g[0] + g[1]) / 2]])[0][0]
    assert 0 < out < 1


def test_quantization_as_printed_fails():
    # the printed right edge kδ + 1 makes the sum β(β+1)/2, and ξ_0 with δ^-1 − 1 loops misses the top cell
    net = C.quantization(4, F(1, 100), 1, printed=True)
    outs = [evaluate(net, [[F(2 * k + 1, 8)]])[0][0] for k in range(4)]
    # reference for the printed weights: rectangles that never close sum to Σ_{i ≤ β} i, and the loop
    # count stops one short, so only h_0..h_{δ^-1−2} are added
    assert outs == [sum(range(min(k, 2) + 1)) for k in range(4)] == [0, 1, 3, 3]


# ------------------------------------------------------------------------------------------ Lemma A.6 / A.7
def _ref_seq_id(z, base):
    return sum(v * base ** i for i, v in enumerate(sorted(z)))


@pytest.mark.parametrize("base,N", [(2, 2), (4, 3), (6, 2), (5, 5)])
def test_contextual_mapping_hardmax(base, N):
    net = C.contextual_mapping(base, N, printed=True)          # works as printed
    for z in itertools.permutations(range(base), N):
        out = evaluate(net, [[v] for v in z])
        assert all(o == [_ref_seq_id(z, base)] for o in out)


@pytest.mark.parametrize("m,d,N", [(2, 1, 2), (3, 1, 2), (2, 2, 3)])
def test_contextual_mapping_ext(m, d, N):
    good, bad = C.contextual_mapping_ext(m, d, N), C.contextual_mapping_ext(m, d, N, printed=True)
    wrong = 0
    for z in itertools.permutations(range(m ** d), N):
        want = 2 * _ref_seq_id(z, m ** d) - min(z) % m
        assert all(o == [want] for o in evaluate(good, [[v, v % m] for v in z]))
        wrong += any(o != [want] for o in evaluate(bad, [[v, v % m] for v in z]))
    assert wrong > 0


def test_softmax_temperature_paper_criterion():
    from loopformer.theory.verify import paper_criterion, smallest_temperature, softmax_gaps
    lam = C.softmax_temperature_bound(3, 2)
    assert math.isclose(lam, math.log(4 * 9))
    # the printed default margin: M = smallest integer above (δ^-d − 1)/ε = 4
    assert C.contextual_mapping(3, 2, printed=True).meta["M"] == 5
    lo, hi = softmax_gaps(3, 2, lam, printed=True)
    assert isinstance(lo, F) and lo < 0 < hi < F(1, 2)            # |k − k̃| < ½, yet k̃ > k: Eq. 94 is violated
    assert not paper_criterion(lo, hi)
    assert softmax_gaps(3, 2, 40, printed=True)[0] < 0              # the overshoot stays at every λ
    assert smallest_temperature(3, 2, printed=True, hi=16.0) == math.inf
    lo, hi = softmax_gaps(3, 2, lam, printed=False)                 # M = 2δ^-d/ε: scores ≥ 1 apart
    assert 0 < lo <= hi < 1 and paper_criterion(lo, hi)
    lmin = smallest_temperature(3, 2, printed=False, hi=lam, tol=0.05)
    assert lmin <= lam
    assert not paper_criterion(*softmax_gaps(3, 2, max(lmin - 0.1, 0.01), printed=False))
    # Eq. 108–110: |k − k̃| ≤ N² δ^-Nd e^{−λ} holds with the gap of 1, not with the printed margins
    lam8 = lam + 8
    bound = 4 * 9 * math.exp(-lam8)
    assert max(map(abs, softmax_gaps(3, 2, lam8, printed=False))) <= F(bound)
    assert max(map(abs, softmax_gaps(3, 2, lam8, printed=True))) > F(bound)
    assert max(map(abs, softmax_gaps(3, 2, lam8, printed=True, M="edge"))) > F(bound)


def test_softmax_single_token_reference():
    # N = 1: one loop over one token; softmax of one score is 1, so k̃ = k exactly (an independent reference),
    # and k − k̃ = 0 is outside the open interval (0, 1) of the paper's criterion
    from loopformer.theory.verify import paper_criterion, softmax_gaps
    lo, hi = softmax_gaps(3, 1, 2.0, printed=False)
    assert lo == hi == 0 and not paper_criterion(lo, hi)


def test_verify_rows_compare_exactly():
    from loopformer.theory.verify import Row
    tiny = F(1, 10 ** 400)                                             # float(tiny) == 0.0
    assert not Row("x", "c", "s", 0, tiny, 0, "repaired", "holds").holds
    assert Row("x", "c", "s", 0, -tiny, 0, "repaired", "holds").holds
    assert not Row("x", "c", "s", 0, F(1, 2), F(1, 2), "repaired", "holds", strict=True).holds
    r = Row("x", "c", "s", 0, F(1, 2), 1, "repaired", "holds", strict=True, low=0, error_min=-tiny)
    assert not r.holds and r.passed is False


# ------------------------------------------------------------------------------------------------ Lemma A.9
@pytest.mark.parametrize("bits", [[1], [0, 1], [1, 1, 0, 1, 0, 0, 1], [int(b) for b in bin(0xB5E3A1)[2:]] + [1]])
def test_bit_extraction(bits):
    net = C.bit_extraction(bits)
    assert net.width == 6 and net.ff_width == 9 and net.loops == len(bits)
    for k in range(len(bits) + 1):
        assert evaluate(net, [[k]])[0] == [sum(bits[:k])]
    printed = C.bit_extraction(bits, printed=True)
    assert evaluate(printed, [[len(bits)]])[0] != [sum(bits)]


@pytest.mark.parametrize("bits", [[0], [1, 0], [1, 1, 0], [0, 1, 0, 1, 1, 0], [1, 0, 0, 1, 1, 0, 1, 0, 0],
                                  [1, 1, 0, 1, 0, 0, 1], [0, 0, 0, 0]])
def test_bit_extraction_every_k(bits):
    # repaired: Σ_{l≤k} θ_l at every k = 0..r, also when θ_r = 0
    net, printed = C.bit_extraction(bits), C.bit_extraction(bits, printed=True)
    r = len(bits)
    for k in range(r + 1):
        assert evaluate(net, [[k]])[0] == [sum(bits[:k])]
        # printed output matrix: step_ε(k−l) turns negative after one loop and no θ is ever added
        assert evaluate(printed, [[k]])[0] == [0]
        # coordinate 2 (printed as β_l) runs 0, 0, −θ_1, −θ_1−θ_2, …: it never holds β_l
        seen = []
        evaluate(net, [[k]], trace=lambda t, H, seen=seen: seen.append(H[0][1]))
        assert seen == [0] + [-sum(bits[:l - 1]) for l in range(2, r + 1)]
        assert all(v <= 0 for v in seen)


# ------------------------------------------------------------------------------------------ Lemma 4.1 / 4.2
def _labels(seed, K, d):
    rng = np.random.default_rng(seed)
    return [[F(int(v), 9) for v in row] for row in rng.integers(-30, 30, size=(K, d))]


@pytest.mark.parametrize("seed,K,d", [(0, 2, 1), (1, 9, 1), (2, 12, 3)])
def test_memorization_within_neighbour_difference(seed, K, d):
    y = _labels(seed, K, d)
    net = C.memorization(y)
    eps = [max(abs(y[k][i] - y[k - 1][i]) for k in range(1, K)) for i in range(d)]
    assert net.width == 12 * d and net.ff_width == 18 * d and net.loops == K - 1
    for k in range(K):
        out = evaluate(net, [[k]])[0]
        for i in range(d):
            ref = eps[i] * math.floor(y[k][i] / eps[i]) if eps[i] else y[k][i]   # ε⌊y/ε⌋ (Eq. 374)
            assert out[i] == ref
            assert abs(out[i] - y[k][i]) < eps[i] or eps[i] == 0


def test_memorization_bound_attained():
    eps = F(2, 5)
    walk = [0, 1, 1, 0, -1, 0, 1]
    y = [[(c + 1 - F(1, 2 ** 20)) * eps] for c in walk]
    net = C.memorization(y)
    worst = max(abs(evaluate(net, [[k]])[0][0] - y[k][0]) for k in range(len(y)))
    assert worst == (1 - F(1, 2 ** 20)) * eps                        # sup of Eq. 18 approached, not exceeded


@pytest.mark.parametrize("seed,K,d", [(3, 2, 1), (4, 10, 2), (5, 7, 1)])
def test_exact_memorization(seed, K, d):
    y = _labels(seed, K, d)
    y[0][0] = F(0)                                                    # forces the Eq. 377 shift
    net = C.exact_memorization(y)
    assert net.width == 4 * d and net.ff_width == 6 * d and len(net.eta) == K - 1
    for k in range(K):
        assert evaluate(net, [[k]])[0] == y[k]
    printed = C.exact_memorization(y, printed=True)
    assert any(evaluate(printed, [[k]])[0] != y[k] for k in range(K))


Y42 = [[F(v)] for v in (3, -2, F(1, 2), 4, -1, 2)]


def test_exact_memorization_start_repair_alone_suffices_with_positive_shift():
    # Eq. 377 leaves ε free: shift every label above 0 and the printed bias −1 and M = max y + 1 are correct
    net = C.exact_memorization(Y42, repairs=("start",), shift="positive")
    assert net.meta["shifts"] == (F(3),)                               # 1 − min y
    assert [evaluate(net, [[k]])[0] for k in range(6)] == Y42
    ys = [v[0] + 3 for v in Y42]
    # the start repair changes η_4 of Eq. 378 from y_l/y_{l−1} to (y_l − y_0)/y_{l−1}
    assert [e[3] for e in net.eta] == [(ys[l] - ys[0]) / ys[l - 1] for l in range(1, 6)]
    assert [e[2] for e in net.eta] == [ys[l] / ys[l - 1] - 1 for l in range(1, 6)]
    plain = C.exact_memorization(Y42, repairs=("bias", "M"), shift="positive")
    assert [e[3] for e in plain.eta] == [ys[l] / ys[l - 1] for l in range(1, 6)]


def test_exact_memorization_printed_start_returns_next_label():
    # bias and M repaired, printed L1 = (k, k, y0, 0): the counter is one loop late -> y_{k+1}; at k = K−1
    # nothing is added and L2 returns 0 − ε
    net = C.exact_memorization(Y42, repairs=("bias", "M"), shift="positive")
    outs = [evaluate(net, [[k]])[0] for k in range(6)]
    assert outs == Y42[1:] + [[-net.meta["shifts"][0]]]


def test_exact_memorization_bias_needed_only_for_labels_below_zero():
    # smallest non-zero shift: labels stay negative; the printed bias carries σ(y) − σ(−y−1) ≠ y for y < 0
    bad = C.exact_memorization(Y42, repairs=("start", "M"))
    assert bad.meta["shifts"] == (F(0),)
    assert any(evaluate(bad, [[k]])[0] != Y42[k] for k in range(6))
    good = C.exact_memorization(Y42, repairs=("start", "M", "bias"))
    assert [evaluate(good, [[k]])[0] for k in range(6)] == Y42


def test_exact_memorization_M_needed_only_below_minus_max():
    y = [[F(v)] for v in (1, -5, 2, -3, 1)]                          # −5 < −(max y + 1) = −3
    bad = C.exact_memorization(y, repairs=("start", "bias"))
    assert any(evaluate(bad, [[k]])[0] != y[k] for k in range(5))
    good = C.exact_memorization(y, repairs=("start", "bias", "M"))
    assert [evaluate(good, [[k]])[0] for k in range(5)] == y
    y2 = [[F(v)] for v in (1, -2, 2, -3, 1)]                         # −3 ≥ −(max y + 1): printed M suffices
    ok = C.exact_memorization(y2, repairs=("start", "bias"))
    assert [evaluate(ok, [[k]])[0] for k in range(5)] == y2
    with pytest.raises(ValueError):
        C.exact_memorization(y, repairs=("start", "nope"))
    with pytest.raises(ValueError):
        C.exact_memorization([[F(1)], [F(2)], [F(3)]], shift=-1)    # leaves y_0 = 0


# ------------------------------------------------------------------------------------------- preconditions
@pytest.mark.parametrize("call", [
    lambda: C.quantization(1, F(1, 10)),
    lambda: C.quantization(4, F(1, 4)),
    lambda: C.quantization(4, 0),
    lambda: C.contextual_mapping(4, 2, M=F(6)),                        # M ≤ (δ^-d − 1)/ε = 6
    lambda: C.contextual_mapping(3, 4),                                 # N > δ^-d
    lambda: C.contextual_mapping(4, 2, eps=1),
    lambda: C.bit_extraction([1, 2]),
    lambda: C.bit_extraction([1, 0, 1], eps=F(1, 4)),                   # ε > 2^-r
    lambda: C.memorization([[1]]),
    lambda: C.memorization([[0], [1]], eps=[F(1, 2)]),
    lambda: C.rect(0, 1, 1, F(1, 2)),
    lambda: C.impulse(0, 0, 0, 0),
    lambda: Block(FeedForward(mat([[1]]), vec([0]), mat([[1]]), vec([0])), attention="softmax"),
])
def test_preconditions(call):
    with pytest.raises(ValueError):
        call()


# ------------------------------------------------------------------------------------- composed / bounds
def test_composed_network_matches_step3():
    from loopformer.theory.compose import composed_network
    from loopformer.theory.rate import default_target
    c = composed_network(default_target, 2, 2, 1)
    assert c.net.width == 26 and c.net.ff_width == 74 and c.net.n_heads == 2 and c.net.loops == loops_for(2, 2, 1)
    y, eps = c.labels.y, c.labels.max_neighbour_difference()[0]
    for a, b in [(0, 1), (1, 0)]:
        out = evaluate(c.net, [[F(2 * a + 1, 4)], [F(2 * b + 1, 4)]])
        z = [a, b]
        s = 2 * (2 * max(z) + min(z)) - min(z) % 2
        for n in range(2):
            k = 2 * z[n] * 4 + s
            assert out[n] == [eps * math.floor(y[k][0] / eps)]
            X = np.array([[max(z) / 2, min(z) / 2]])
            want = default_target(X)[0, 0 if z[n] == max(z) else 1]
            assert abs(float(out[n][0]) - want) <= float(eps)


def test_bounds():
    for m, N, d in [(2, 2, 1), (3, 2, 1), (2, 3, 2)]:
        r = loops_for(m, N, d)
        assert delta_from_loops(r, N, d) >= 1 / m                     # Eq. 90–91
    assert theorem_bound(1, 2, 3, N=2, d=2, p=2) == pytest.approx(2 * 3 + 3)
    assert duplicate_measure(4, 2, 1) == pytest.approx(0.25)
    assert duplicate_measure(10, 3, 1) <= 3 * 2 / 2 * 0.1
    with pytest.raises(ValueError):
        delta_from_loops(3, 2, 1)


# ------------------------------------------------------------------------------------------- assembled model
@pytest.mark.parametrize("which", ["A5", "A6", "A9", "42", "A1"])
def test_assembled_float64_matches_exact(which):
    from loopformer.theory.assemble import assemble, run_assembled
    if which == "A5":
        net, Xs = C.quantization(3, F(1, 50), 2), [[[F(k, 3) + F(1, 9), F(2 - k, 3)]] for k in range(3)]
    elif which == "A6":
        net, Xs = C.contextual_mapping(4, 3), [[[a], [b], [c]] for a, b, c in itertools.permutations(range(4), 3)]
    elif which == "A9":
        net, Xs = C.bit_extraction([1, 1, 0, 1, 0, 1]), [[[k]] for k in range(7)]
    elif which == "42":
        y = _labels(9, 8, 2)
        net, Xs = C.exact_memorization(y), [[[k]] for k in range(8)]
    else:
        from loopformer.theory.compose import composed_network
        from loopformer.theory.rate import default_target
        net = composed_network(default_target, 2, 2, 1).net
        Xs = [[[F(1, 4)], [F(3, 4)]], [[F(7, 8)], [F(1, 8)]]]
    model = assemble(net)
    assert model.config.head_dim == 1 and model.config.norm == "none"
    got = run_assembled(model, net, [[[float(v) for v in t] for t in X] for X in Xs])
    want = np.array([[[float(v) for v in o] for o in evaluate(net, X)] for X in Xs])
    np.testing.assert_allclose(got, want, atol=1e-12, rtol=0)


# ------------------------------------------------------------------------------------------------ moduli
def test_moduli_of_linear_map():
    from loopformer.theory.moduli import estimate_modulus
    a, b, N, delta = 0.7, -0.4, 3, 0.1

    def f(X):
        return a * X + b * X.sum(-1, keepdims=True)
    true = {"tok": abs(a + b) * delta, "cont": abs(b) * math.sqrt(N - 1) * delta,
            "seq": max(abs(a), abs(a + N * b)) * delta}
    for kind, w in true.items():
        est = estimate_modulus(f, delta, kind, 1, N, samples=512, steps=25, restarts=4)
        assert est.value <= w * (1 + 1e-9)                          # a lower bound ...
        assert est.value >= 0.98 * w                                # ... that recovers the known constant
        assert est.evaluations >= 1024
        gap = np.abs(f(est.X[None]) - f(est.Xp[None]))[0]
        assert np.linalg.norm(est.X - est.Xp) <= delta * (1 + 1e-9)
        if kind != "seq":
            assert np.linalg.norm(gap[:, est.n]) == pytest.approx(est.value)


def test_moduli_nonsmooth_without_gradients():
    from loopformer.theory.moduli import as_batched, estimate_modulus

    def g(x):                                                        # Lipschitz constant 3 in the own token
        return 3 * np.abs(x - 0.5) + 0 * x.sum(-1, keepdims=True)
    est = estimate_modulus(as_batched(g), 0.2, "tok", 2, 2, samples=400, steps=0)
    assert 0.9 * 3 * 0.2 <= est.value <= 3 * 0.2 + 1e-12
    cont = estimate_modulus(as_batched(g), 0.2, "cont", 2, 2, samples=200, steps=0)
    assert cont.value == pytest.approx(0.0, abs=1e-12)               # no dependence on the context


# ---------------------------------------------------------------------------------------------------- CLI
def test_cli_verify_section(capsys):
    from loopformer.cli import main
    assert main(["theory", "verify", "--section", "Lemma A.9", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "as printed" in out and "repaired" in out and "FAIL" not in out


def test_verify_theorem42_rows_isolate_each_change():
    from loopformer.theory.verify import rows_memorization
    rows = [r for r in rows_memorization() if r.construction.startswith("Theorem 4.2")]
    assert all(r.passed for r in rows)
    by_version = {}
    for r in rows:
        by_version.setdefault(r.version, []).append(r)
    assert all(r.holds for r in by_version["start repair only, ε: all y > 0"])
    assert all(not r.holds for r in by_version["bias + M repairs, printed start"])
    assert by_version["start + M repairs, printed bias, y ≤ 0 kept"]
    assert all(not r.holds for r in by_version["start + M repairs, printed bias, y ≤ 0 kept"])
    assert len(by_version["start + bias repairs, printed M, y < −(max y + 1) kept"]) == 1


def test_cli_user_errors(capsys, tmp_path):
    from loopformer.cli import main
    assert main(["theory", "verify", "--section", "nope"]) == 2
    assert main(["theory", "rate", "--out", str(tmp_path), "--deltas", "1,x"]) == 2
    assert "loopformer: error:" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_rate(tmp_path):
    from loopformer.cli import main
    assert main(["theory", "rate", "--out", str(tmp_path), "--deltas", "2,3", "--samples", "500",
                 "--no-progress"]) == 0
    assert (tmp_path / "rate.png").stat().st_size > 1000
    lines = (tmp_path / "rate.csv").read_text().splitlines()
    assert len(lines) == 3 and lines[0].startswith("delta_inv")


@pytest.mark.slow
def test_cli_verify_all():
    from loopformer.cli import main
    assert main(["theory", "verify", "--no-progress"]) == 0


# ------------------------------------------------------------------------------------------- theory modulus / rate
def _user_target_module(tmp_path, monkeypatch):
    (tmp_path / "user_targets.py").write_text(
        "import numpy as np\n"
        "def triple(X):\n    return 3 * X\n"
        "def flat(X):\n    return np.asarray(X).sum()\n"
        "def nan(X):\n    return X * float('nan')\n"
        "CONST = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def test_cli_modulus_builtin_and_user_targets(tmp_path, monkeypatch, capsys):
    import json

    from loopformer.cli import main
    _user_target_module(tmp_path, monkeypatch)
    out = tmp_path / "m.json"
    assert main(["theory", "modulus", "--target", "sum", "--delta", "0.1", "--N", "3", "--samples", "128",
                 "--steps", "15", "--restarts", "4", "--out", str(out)]) == 0
    assert "| cont | 0.1 |" in capsys.readouterr().out
    m = json.loads(out.read_text())["moduli"]
    # f(X)_n = Σ_j x_j: ω^tok(δ) = δ, ω^cont(δ) = √(N−1)δ, ω(δ) = Nδ — lower bounds that reach them
    for kind, true in (("tok", 0.1), ("cont", math.sqrt(2) * 0.1), ("seq", 0.3)):
        assert true * 0.97 <= m[kind]["value"] <= true * (1 + 1e-9)
        X, Xp = np.array(m[kind]["X"]), np.array(m[kind]["X_prime"])
        assert np.linalg.norm(X - Xp) <= 0.1 * (1 + 1e-9)
    assert main(["theory", "modulus", "--target", "user_targets:triple", "--kind", "tok", "--delta", "0.2",
                 "--samples", "128", "--steps", "0", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["moduli"]["tok"]["value"] == pytest.approx(0.6, rel=1e-9)
    capsys.readouterr()
    for target, words in (("nope_module:f", "cannot import"), ("user_targets:missing", "no attribute"),
                          ("user_targets:CONST", "not callable"), ("user_targets:flat", "same shape"),
                          ("user_targets:nan", "non-finite"), ("nocolon", "package.module:function")):
        assert main(["theory", "modulus", "--target", target, "--delta", "0.1"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("loopformer: error:") and words in err
    for bad in (["--delta", "0"], ["--delta", "0.1", "--p", "0.5"], ["--delta", "0.1", "--lo", "2"],
                ["--delta", "0.1", "--checkpoint", str(tmp_path / "none")],
                ["--delta", "0.1", "--target", "sum", "--checkpoint", str(tmp_path)]):
        assert main(["theory", "modulus", *bad]) == 2
        assert capsys.readouterr().err.startswith("loopformer: error:")
    assert main(["theory", "rate", "--out", str(tmp_path / "r"), "--deltas", "2", "--target",
                 "user_targets:flat"]) == 2
    assert "same shape" in capsys.readouterr().err


def test_cli_modulus_of_a_checkpoint(tmp_path, capsys):
    import json

    import torch

    from loopformer.analysis.continuity import LoopedEmbeddingMap
    from loopformer.cli import main
    from loopformer.model import LoopedTransformer, ModelConfig
    from loopformer.model.io import load, save_checkpoint
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "ck", LoopedTransformer(ModelConfig(vocab_size=20, max_len=8, d_model=8, n_heads=2,
                                                                   loops=2)))
    out = tmp_path / "m.json"
    assert main(["theory", "modulus", "--checkpoint", str(tmp_path / "ck"), "--N", "4", "--delta", "0.05",
                 "--samples", "64", "--steps", "3", "--restarts", "2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["d"] == 8 and data["N"] == 4 and data["lo"] < 0 < data["hi"]
    # the reported value is the gap of the returned pair under the model itself (sequence modulus)
    fmap = LoopedEmbeddingMap(load(tmp_path / "ck").double())
    X, Xp = (torch.tensor(data["moduli"]["seq"][k], dtype=torch.float64).T[None] for k in ("X", "X_prime"))
    with torch.no_grad():
        gap = (fmap.apply(X) - fmap.apply(Xp)).norm().item()
    assert gap == pytest.approx(data["moduli"]["seq"]["value"], rel=1e-9)
    assert main(["theory", "modulus", "--checkpoint", str(tmp_path / "ck"), "--N", "9", "--delta", "0.1"]) == 2
    assert "max_len" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_rate_user_target(tmp_path, monkeypatch):
    from loopformer.cli import main
    _user_target_module(tmp_path, monkeypatch)
    assert main(["theory", "rate", "--out", str(tmp_path / "r"), "--deltas", "2", "--samples", "200",
                 "--target", "user_targets:triple", "--no-progress"]) == 0
    rows = (tmp_path / "r" / "rate.csv").read_text().splitlines()
    head, vals = rows[0].split(","), rows[1].split(",")
    row = dict(zip(head, vals))
    assert int(row["cell_mismatches"]) == 0
    assert float(row["w_tok"]) == pytest.approx(3 * 0.5, rel=1e-9)      # ω^tok(δ√d) of 3X at δ = 1/2
