"""The claims registry: each claim of the paper (and each the library adds) as data — what it says, where the paper
says it and with which numbers, the miniature experiment that tests it on shipped configs, the metric, and the rule
that turns the runs into a verdict. The registry is `loopformer/configs/claims.yaml`; `loopformer reproduce` runs it
(`loopformer.experiments.reproduce`).

An experiment is a shipped config, overrides common to its runs, and *arms* (named override sets: "looped r=8",
"TMLT r=8"), each trained once per model seed (`seed=S`; the data seed is the config's, so every arm of a seed
sees the same data and, for paired arms, the same initial shared weights). Claims whose experiments share a `group`
share their runs (the group fixes the config and the common overrides). A theory claim runs `theory verify`.

Verdict rules (`verdict`):
    paired     arm a against arm b, seed by seed: d_s = a_s − b_s (b_s − a_s for a metric where lower is
               better); the claim is "d > margin".
    at_least   arm a's metric ≥ value,
    at_most    ... ≤ value.
    iso_depth  at matched depth k·L, arm a (k layers looped L times) against arm b (k·L unique layers) and arm c
               (k layers once): per seed φ_s = (a_s − c_s) / (b_s − c_s), the share of the gain of unique depth
               that looping recovers; the claim is "φ > value". Read as an exponent, φ is the recurrence-equivalence
               exponent of iso-depth scaling: with the metric linear in log depth between k and k·L, the looped
               model matches k·L^φ unique layers. A seed where b and c tie has no φ (left out, and said).
Of n seeds, k meet the claim's condition. The verdict is a one-sided sign test at the level ALPHA = 1/8 (the level
at which 3 of 3 seeds is significant): reproduced when P(X ≥ k) ≤ 1/8 for X ~ Binomial(n, 1/2), not reproduced
when P(X ≤ k) ≤ 1/8, inconclusive otherwise. For 3 seeds that is "every seed" / "no seed"; with 7, 6 of 7 (or 1
of 7) concludes. With fewer than 3 seeds no count is significant: every seed / no seed decides, and the report says
the verdict is a screen (one seed under `--quick`: one observation). Beside the verdict, the sign test's interval
for the median (`median_interval`): [d_(j), d_(n+1−j)] of the sorted values with the largest j whose coverage
1 − 2·P(X ≤ j − 1) is at least 75 %.

Sequential seeds (`loopformer reproduce --max-seeds`): a claim still inconclusive after its experiment's seeds
gets one more seed at a time, up to the cap, and is judged on all of them; the report says where it stopped and
why.

An analysis step (`analysis`): a claim may name a measurement run on each of its arms' finished runs — a
`loopformer` command of ANALYSES (e.g. `analyze continuity {run} --data ... --out {out}`), run once per run into
RUN/analysis/<name>/ — and judge its JSON output: the claim's metric is then `analysis.<path>` into that file
(`*` takes the only entry of a mapping, e.g. `analysis.models.*.relative_coefficient`), with the metric's direction
given by the claim (`higher_is_better`).

Beside the verdict, where the compared arms' FLOPs per answer (`loopformer.model.flops`) differ by more than 5 %,
one phrase says so (`compute_note`).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from loopformer.configio import load_config, shipped_config
from loopformer.errors import UserError

RULES = ("paired", "at_least", "at_most", "iso_depth")
ALPHA = 1 / 8             # the sign test's level: 3 of 3 seeds (p = 1/8) is significant
INTERVAL_COVERAGE = 0.75  # the sign-test interval for the median covers at least this
KINDS = ("train", "theory")
# the measurements an analysis step may run: the command's first words → the JSON file it writes into --out
ANALYSES = {("analyze", "continuity"): "continuity.json", ("analyze", "dynamics"): "dynamics.json"}
PREPARE_COMMANDS = (("text", "prepare"), ("data", "gen"))   # what an experiment's `prepare` step may run
MAX_SEEDS = 100          # the most model seeds per arm (an experiment's `seeds`, `reproduce --seeds`)


def check_name(kind: str, name: str) -> None:
    """A claim id, group or arm name names folders under the report's `--out`: one path component (no separators,
    no leading dot, at most 100 characters), else a ValueError naming it."""
    if not name or len(name) > 100 or name.startswith(".") or any(c in name for c in "/\\\0"):
        raise ValueError(f"{kind} {name!r}: a name must be one folder name (no '/', no leading '.', at most 100 "
                         "characters)")


def out_values(command: list[str], where: str) -> list[str]:
    """The values a registry command gives `--out` (each as its own word after `--out`); a ValueError for any other
    way of naming the flag (`--out=DIR`, an abbreviation such as `--ou DIR`), which the command's parser would take
    as the folder to write, overriding the checked one."""
    outs = []
    for i, a in enumerate(command):
        flag = a.split("=", 1)[0]
        if len(flag) >= 3 and "--out".startswith(flag):
            if a != "--out":
                raise ValueError(f"{where} may name its folder only as `--out DIR` (got {a!r})")
            outs.append(command[i + 1] if i + 1 < len(command) else "")
    return outs


def check_prepare(group: str, prepare: list[str]) -> None:
    """An experiment's `prepare` step writes only under the report's data folder: `text prepare` or `data gen` with
    `--out {data}/...` (no '..'), never `--force` (which would replace a folder it did not make)."""
    if not prepare:
        return
    where = f"group {group!r}: prepare"
    if tuple(prepare[:2]) not in PREPARE_COMMANDS:
        raise ValueError(f"{where} may run {' or '.join(' '.join(c) for c in PREPARE_COMMANDS)} only "
                         f"(got {' '.join(prepare[:2])!r})")
    if "--force" in prepare:
        raise ValueError(f"{where} may not pass --force")
    outs = out_values(prepare, where)
    if len(outs) != 1 or not (outs[0] == "{data}" or outs[0].startswith("{data}/")) or ".." in outs[0].split("/"):
        raise ValueError(f"{where} must write with one --out under {{data}} (the report's data folder)")
VERDICTS = ("reproduced", "not reproduced", "inconclusive", "not run")


@dataclass
class Arm:
    name: str = ""
    overrides: list[str] = field(default_factory=list)


@dataclass
class Experiment:
    group: str = ""                   # runs folder; claims with the same group share runs
    config: str = ""                  # a shipped config (under loopformer/configs), e.g. cpu/demo.yaml
    overrides: list[str] = field(default_factory=list)       # common to every arm
    arms: list[Arm] = field(default_factory=list)
    seeds: int = 3                    # model seeds 0..seeds-1 (--seeds overrides)
    quick: list[str] = field(default_factory=list)           # extra overrides under --quick
    prepare: list[str] = field(default_factory=list)         # a `loopformer` command run once before training
                                      # (e.g. data preparation); {data} is replaced by the output's data folder


@dataclass
class Rule:
    kind: str = "paired"              # paired | at_least | at_most
    a: str = ""                       # the arm the claim is about
    b: str = ""                       # paired: the arm it is compared with; iso_depth: k·L unique layers
    c: str = ""                       # iso_depth: k layers once
    margin: float = 0.0               # paired: a − b must exceed this (metric units; sign-corrected for ↓ metrics)
    value: float = 0.0                # at_least / at_most / iso_depth: the threshold

    def arms(self) -> tuple[str, ...]:
        """The arms the rule compares."""
        return {"paired": (self.a, self.b), "iso_depth": (self.a, self.b, self.c)}.get(self.kind, (self.a,))


@dataclass
class Analysis:
    """A measurement on each finished run of a claim's arms (see the module docstring)."""
    name: str = ""                    # RUN/analysis/<name>/ (default: the command's second word)
    command: list[str] = field(default_factory=list)   # ANALYSES command with {run}, {out} (and {data})

    def output(self) -> str:
        """The JSON file the command writes into its --out folder."""
        return ANALYSES[tuple(self.command[:2])]

    def check(self, claim: str) -> None:
        where = f"claim {claim}: analysis"
        if tuple(self.command[:2]) not in ANALYSES:
            known = ", ".join(" ".join(k) for k in ANALYSES)
            raise ValueError(f"{where} {' '.join(self.command[:2])!r} is not an analysis (choose from {known})")
        if "{run}" not in self.command:
            raise ValueError(f"{where} must name the run as {{run}}")
        if out_values(self.command, where) != ["{out}"]:
            raise ValueError(f"{where} must write with --out {{out}} (the run's analysis folder)")
        if not self.name:
            self.name = self.command[1]
        check_name("analysis", self.name)


@dataclass
class Claim:
    id: str = ""
    statement: str = ""
    source: str = "paper"             # paper | library
    figure: str = ""                  # where the paper (or the docs) state it: "Table 2", "Theorem 4.2", ...
    paper: str = ""                   # the paper's numbers, as text
    kind: str = "train"               # train | theory
    metric: str = "test.accuracy"     # a path into a run's results.json (numbers index lists), or a derived metric
    scale: float = 100.0              # shown as metric × scale (100: percent)
    unit: str = "%"
    quick: bool = True                # part of --quick
    cpu: Experiment = field(default_factory=Experiment)
    gpu: Experiment | None = None  # --scale paper: the paper-scale configs
    rule: Rule = field(default_factory=Rule)
    docs: str = ""                    # the page that discusses it
    analysis: Analysis | None = None  # a measurement on each run, judged instead of results.json
    higher_is_better: bool | None = None   # the metric's direction (None: the runs' results.json says)

    def __post_init__(self) -> None:
        check_name("claim id", self.id)
        if self.kind not in KINDS:
            raise ValueError(f"claim {self.id}: kind must be one of {KINDS}")
        if self.rule.kind not in RULES:
            raise ValueError(f"claim {self.id}: rule.kind must be one of {RULES}")
        if self.analysis is not None:
            if self.kind != "train":
                raise ValueError(f"claim {self.id}: an analysis step needs training runs (kind: train)")
            self.analysis.check(self.id)
            if not self.metric.startswith("analysis."):
                raise ValueError(f"claim {self.id}: with an analysis step the metric is analysis.<path into "
                                 f"{self.analysis.output()}>")
        elif self.metric.startswith("analysis."):
            raise ValueError(f"claim {self.id}: metric {self.metric!r} reads an analysis, but the claim has none")
        if self.kind == "train":
            for exp in (self.cpu, self.gpu):
                if exp is None:
                    continue
                names = [a.name for a in exp.arms]
                for name in names:
                    check_name("arm", name)
                if len(set(names)) != len(names):
                    raise ValueError(f"claim {self.id}: two arms share a name")
                for need in self.rule.arms():
                    if need not in names:
                        raise ValueError(f"claim {self.id}: rule names arm {need!r}, not one of {names}")
                if not exp.group or not exp.config or not 1 <= exp.seeds <= MAX_SEEDS:
                    raise ValueError(f"claim {self.id}: an experiment needs a group, a config and seeds in "
                                     f"1..{MAX_SEEDS} (got seeds: {exp.seeds})")
                check_name("group", exp.group)
                check_prepare(exp.group, exp.prepare)


@dataclass
class Registry:
    claims: list[Claim] = field(default_factory=list)

    def __post_init__(self) -> None:
        ids = [c.id for c in self.claims]
        if len(set(ids)) != len(ids) or not all(ids):
            raise ValueError("every claim needs an id of its own")
        seen: dict[str, tuple] = {}
        for c in self.claims:
            for exp in (c.cpu, c.gpu):
                if exp is None or c.kind != "train":
                    continue
                key = (exp.config, tuple(exp.overrides), tuple(exp.quick), tuple(exp.prepare))
                if seen.setdefault(exp.group, key) != key:
                    raise ValueError(f"group {exp.group!r}: claims that share a group must share its config and "
                                     f"common overrides ({c.id})")


def load_registry(path: str | None = None) -> Registry:
    """The shipped registry (`configs/claims.yaml`), or the YAML file at `path`."""
    return load_config(Registry, path or shipped_config("claims.yaml"))


def family(known: list[str], name: str) -> list[str]:
    """The claim ids `name` selects: itself if it is one, else the family of ids it starts with a dash
    ("iso-depth" → iso-depth-lcs, iso-depth-ed); none if neither."""
    return [name] if name in known else [k for k in known if k.startswith(name + "-")]


def select(registry: Registry, ids: list[str] | None = None, quick: bool = False) -> list[Claim]:
    """The claims named by `ids` (all; under --quick those marked quick), in registry order. A name is a claim id
    or a family of them (`family`); one that is neither is a one-line error."""
    known = [c.id for c in registry.claims]
    if ids:
        bad = [i for i in ids if not family(known, i)]
        if bad:
            raise UserError(f"unknown claim(s) {', '.join(bad)}; choose from {', '.join(known)} "
                            "(or a family: the start of ids before a dash, e.g. iso-depth)")
        chosen = {k for i in ids for k in family(known, i)}
        return [c for c in registry.claims if c.id in chosen]
    return [c for c in registry.claims if c.quick or not quick]


# ------------------------------------------------------------------ metrics
def metric_value(results: dict[str, Any], path: str) -> float:
    """The number at `path` in a results.json ("test.accuracy", "halting.rules.0.loops_saved", "budgets.budgets.3.
    metrics.accuracy"), or a derived metric:
        halting_saved_at_par    the fraction of loops the first halting rule saves when its metric is within 0.5
                                points (0.005) of fixed depth, else 0."""
    if path == "halting_saved_at_par":
        h = results["halting"]
        m, rule = h["metric"], h["rules"][0]
        gap = rule["metrics"][m] - h["fixed"]["metrics"][m]
        gap = gap if h.get("higher_is_better", True) else -gap
        return float(rule["loops_saved"]) if gap >= -0.005 else 0.0
    node: Any = results
    for part in path.split("."):
        if part == "*" and isinstance(node, dict) and len(node) == 1:    # the only entry of a mapping
            node = next(iter(node.values()))
            continue
        try:
            node = node[int(part)] if isinstance(node, list) else node[part]
        except (KeyError, IndexError, ValueError, TypeError):
            raise UserError(f"metric {path!r}: results hold no {part!r} there") from None
    try:
        return float(node)
    except (TypeError, ValueError):
        raise UserError(f"metric {path!r}: {node!r} is not a number") from None


# ------------------------------------------------------------------ verdicts
@dataclass
class Verdict:
    verdict: str                      # one of VERDICTS
    diffs: list[float]                # paired: per-seed differences (sign-corrected); else per-seed values
    median: float
    low: float
    high: float
    reason: str
    interval: tuple[float, float, float] | None = None   # (low, high, coverage): the median's sign-test interval


def binom_tail(n: int, k: int) -> float:
    """P(X ≥ k) for X ~ Binomial(n, 1/2)."""
    return sum(math.comb(n, i) for i in range(max(k, 0), n + 1)) / 2 ** n


def median_interval(values: list[float]) -> tuple[float, float, float] | None:
    """The sign test's distribution-free interval for the median: (d_(j), d_(n+1−j), coverage) with the largest j
    whose coverage 1 − 2·P(X ≤ j − 1), X ~ Binomial(n, 1/2), is at least INTERVAL_COVERAGE; None below 3 values
    (no j reaches it)."""
    v, n = sorted(values), len(values)
    best = None
    for j in range(1, n // 2 + 1):
        coverage = 1 - 2 * (1 - binom_tail(n, j))         # P(X ≤ j − 1) = 1 − P(X ≥ j)
        if coverage >= INTERVAL_COVERAGE - 1e-12:
            best = (v[j - 1], v[n - j], coverage)
    return best


def median_range(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def diff_label(rule: Rule, higher_is_better: bool, metric: str = "") -> str:
    """What a paired rule's differences measure: a − b, or b − a where lower is better (the sign that makes a
    positive difference the claim's direction)."""
    if rule.kind == "iso_depth":
        return f"φ = ({rule.a} − {rule.c}) / ({rule.b} − {rule.c})"
    if higher_is_better:
        return f"{rule.a} − {rule.b}"
    return f"{rule.b} − {rule.a} ({metric + ': ' if metric else ''}lower is better)"


def iso_depth_shares(a: list[float], b: list[float], c: list[float]) -> list[float | None]:
    """φ_s = (a_s − c_s) / (b_s − c_s) per seed (None where b_s and c_s tie: unique depth gained nothing); the same
    for a lower-is-better metric (both differences change sign)."""
    return [None if abs(y - z) < 1e-12 else (x - z) / (y - z) for x, y, z in zip(a, b, c)]


def verdict(rule: Rule, a: list[float], b: list[float] | None = None, higher_is_better: bool = True,
            c: list[float] | None = None) -> Verdict:
    """Apply `rule` to arm a's per-seed values (and arm b's — and c's for iso_depth —, paired by seed) — see the
    module docstring."""
    if not a or (rule.kind in ("paired", "iso_depth") and (b is None or len(b) != len(a))) or \
            (rule.kind == "iso_depth" and (c is None or len(c) != len(a))):
        return Verdict("not run", [], float("nan"), float("nan"), float("nan"), "no finished runs")
    tied = 0
    if rule.kind == "iso_depth":
        shares = iso_depth_shares(a, b, c)
        tied = sum(x is None for x in shares)
        vals = [x for x in shares if x is not None]
        if not vals:
            return Verdict("not run", [], float("nan"), float("nan"), float("nan"),
                           f"no φ: {rule.b} and {rule.c} tie in every seed")
        target, above = rule.value, True
        what, cond = diff_label(rule, higher_is_better), f"> {rule.value:g}"
    elif rule.kind == "paired":
        sign = 1.0 if higher_is_better else -1.0
        vals = [sign * (x - y) for x, y in zip(a, b)]
        target, above = rule.margin, True
        what = diff_label(rule, higher_is_better)
        cond = f"> {rule.margin:g}"
    else:
        vals, target, above = list(a), rule.value, rule.kind == "at_least"
        what, cond = rule.a, (">= " if above else "<= ") + f"{rule.value:g}"
    strict = rule.kind in ("paired", "iso_depth")
    ok = [(v > target) if strict else (v >= target if above else v <= target) for v in vals]
    med, lo, hi = median_range(vals)
    n, k = len(vals), sum(ok)
    reason = f"{what} {cond} in {k} of {n} seed{'s' if n > 1 else ''}" + \
        (f" ({tied} seed{'s' if tied > 1 else ''} without φ: {rule.b} and {rule.c} tie)" if tied else "")
    if n < 3:                            # no count is significant: every seed / no seed decides (a screen)
        v = "reproduced" if k == n else "not reproduced" if k == 0 else "inconclusive"
        if n == 2:
            reason += " (fewer than 3 seeds: a screen, not a test)"
    else:
        p_hi, p_lo = binom_tail(n, k), binom_tail(n, n - k)
        v = "reproduced" if p_hi <= ALPHA else "not reproduced" if p_lo <= ALPHA else "inconclusive"
        reason += f" (sign test: p = {min(p_hi, p_lo):.3g}; concludes at p ≤ 1/8)"
    return Verdict(v, vals, med, lo, hi, reason, median_interval(vals))


# ------------------------------------------------------------------ compute beside the verdict
COMPUTE_TOLERANCE = 0.05   # arms whose FLOPs per answer differ by more than this fraction get a note


def compute_ratio(flops: dict[str, int | None]) -> tuple[str, str, float] | None:
    """(the costlier arm, the cheaper arm, their ratio of FLOPs per answer) over the arms a claim compares, in
    order `flops` {arm: FLOPs per answer}; None when there are fewer than two arms or one's compute is unknown."""
    if len(flops) < 2 or any(f is None or f <= 0 for f in flops.values()):
        return None
    big = max(flops, key=lambda a: flops[a])
    small = min(flops, key=lambda a: flops[a])
    return big, small, flops[big] / flops[small]


def compute_note(flops: dict[str, int | None], tolerance: float = COMPUTE_TOLERANCE) -> str | None:
    """One short phrase for the verdict when the compared arms differ in compute by more than `tolerance`
    ("arms differ in compute: looped many 4.0× the FLOPs of looped few"); None when they do not, or it is unknown."""
    r = compute_ratio(flops)
    if r is None or r[2] <= 1 + tolerance:
        return None
    return f"arms differ in compute: {r[0]} {r[2]:.1f}× the FLOPs of {r[1]}"


__all__ = ["ANALYSES", "Analysis", "Arm", "Experiment", "Rule", "Claim", "Registry", "Verdict", "load_registry",
           "select", "metric_value", "verdict", "iso_depth_shares", "median_range", "median_interval", "binom_tail",
           "ALPHA", "compute_ratio", "compute_note", "COMPUTE_TOLERANCE", "RULES", "VERDICTS", "MAX_SEEDS",
           "out_values"]
