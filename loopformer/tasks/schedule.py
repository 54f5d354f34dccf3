"""A fixed program: one hidden circuit of K layers, the same for every sample (a depth-demanding task).

The circuit is drawn once from `circuit_seed` (an option of the task, so it is recorded with the data and the
run): for every layer t = 1..K a permutation π_t of the n positions that is one cycle through all of them (each
position's partner)
and a table g_t on the alphabet {0..q-1}. Layer t maps the state x to

    x'_i = g_t(x_i, x_{π_t(i)})        for every position i at once,

and the answer is the state after K layers, at every position. g_t is a Latin square,
g_t(a, b) = ρ_t((σ_t(a) + τ_t(b)) mod q) with random permutations σ_t, τ_t, ρ_t: a bijection in each argument,
so no layer loses the information of either input and the states stay uniformly distributed at every position.
The mixing across positions keeps the K layers from collapsing into one position-wise lookup (a chain of fixed maps
on one symbol would compose into one map): after layer t a position depends on up to min(n, 2^t) inputs (t + 1 of
them along the cycle when one layer repeats), so the answer needs K sequential steps. Each π_t is one cycle
through all n positions: a permutation with short cycles would confine every position to its cycle's few inputs.
A standard K-layer transformer can emulate one circuit layer per layer; a looped model must carry the step in its
hidden state; a timestep-modulated one is told it (paper Sec. 4.2).

`period` P draws only P layers and repeats them in turn (P = 1: one layer applied K times). The mixing across
positions still needs K sequential steps; a looped block can then learn the one layer without knowing t, which
makes the knob K a depth test for looped models too, while P = K (all distinct) tests whether a model can act as
different layers at different loops.

A deep random circuit is hard to learn from its output alone, so every sample also carries the state after every
layer (`step_targets` [N, K, n]); `task.loop_targets=true` supervises loop t with layer j(t)'s state
(`loopformer.tasks.common.loop_steps`).

Layout (bidirectional, T = n):  inputs x_1 … x_n (the input state), targets the state after layer K.
Splits are disjoint by a hash of the input row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from loopformer.tasks.base import TokenTask, Vocab
from loopformer.tasks.common import check_range, dataclass_options, draw_in_split, exact_match, make_rng, token_accuracy


@dataclass(frozen=True)
class Circuit:
    """K layers on n positions over q symbols: partners [K, n] (π_t) and tables [K, q, q] (g_t)."""

    partners: np.ndarray = field(repr=False)
    tables: np.ndarray = field(repr=False)

    @property
    def layers(self) -> int:
        return len(self.partners)

    def run(self, x: np.ndarray) -> np.ndarray:
        """[N, K, n] the state after every layer of the inputs x [N, n] (values 0..q-1)."""
        out = np.empty((x.shape[0], self.layers, x.shape[1]), dtype=np.int64)
        for t in range(self.layers):
            x = self.tables[t][x, x[:, self.partners[t]]]
            out[:, t] = x
        return out

    def run_reference(self, x: list[int]) -> list[list[int]]:
        """The same for one input, one position and one layer at a time (the tests' reference)."""
        states = []
        for t in range(self.layers):
            x = [int(self.tables[t][x[i]][x[int(self.partners[t][i])]]) for i in range(len(x))]
            states.append(x)
        return states


def draw_circuit(seed: int, layers: int, width: int, alphabet: int, period: int = 0) -> Circuit:
    """The circuit of `seed`: per layer a cyclic permutation of the positions (one cycle through all, so that
    repeated layers too spread every input over every position) and a Latin square; with
    `period` P > 0 only P layers are drawn and layer t repeats drawn layer (t - 1) mod P."""
    rng = np.random.default_rng([int(seed), 0xC1C])
    partners = np.empty((layers, width), dtype=np.int64)
    tables = np.empty((layers, alphabet, alphabet), dtype=np.int64)
    for t in range(layers):
        order = rng.permutation(width)                   # π_t: one cycle through all positions, in this order
        partners[t, order] = np.roll(order, -1)
        sigma, tau, rho = rng.permutation(alphabet), rng.permutation(alphabet), rng.permutation(alphabet)
        tables[t] = rho[(sigma[:, None] + tau[None, :]) % alphabet]
    if period:
        partners, tables = partners[np.arange(layers) % period], tables[np.arange(layers) % period]
    partners.flags.writeable = tables.flags.writeable = False
    return Circuit(partners, tables)


@dataclass
class ScheduleTask(TokenTask):
    """The output of a fixed hidden circuit of `layers` layers on `width` positions."""

    layers: int = 8           # K: circuit layers (the knob)
    width: int = 12           # n: positions
    alphabet: int = 4         # q: symbols
    circuit_seed: int = 0     # which circuit (one per seed; the same for every sample and split)
    period: int = 0           # distinct layers: layer t is drawn layer (t - 1) mod period (0: all K distinct; 1: one
                              # layer applied K times, which a looped block can learn without knowing t)

    name = "schedule"
    causal = False

    def __post_init__(self) -> None:
        check_range("layers", self.layers, 1, 256)
        check_range("width", self.width, 2, 1024)
        check_range("alphabet", self.alphabet, 2, 64)
        check_range("circuit_seed", self.circuit_seed, 0, 2 ** 63 - 1)
        check_range("period", self.period, 0, self.layers)
        self.vocab = Vocab(["<pad>"] + [f"v{i}" for i in range(self.alphabet)])
        self.seq_len = self.width
        self.steps = self.layers
        self.circuit = draw_circuit(self.circuit_seed, self.layers, self.width, self.alphabet, self.period)

    def options(self) -> dict:
        return dataclass_options(self)

    def _draw(self, rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
        x = rng.integers(0, self.alphabet, size=(n, self.width))
        states = self.circuit.run(x) + 1                                                  # [n,K,T] token ids
        return {"inputs": (x + 1).astype(np.int32), "targets": states[:, -1].astype(np.int32),
                "step_targets": states.astype(np.int32)}

    def generate(self, n: int, seed: int, split: str = "train") -> dict[str, np.ndarray]:
        return draw_in_split(self._draw, n, make_rng(seed, split), split)

    def metrics(self, pred: np.ndarray, batch: dict[str, np.ndarray]) -> dict[str, float]:
        """accuracy: the whole output state right; token_accuracy: positions right."""
        targets = np.asarray(batch["targets"])
        return {"accuracy": float(exact_match(pred, targets).mean()) if len(pred) else float("nan"),
                "token_accuracy": token_accuracy(pred, targets)}

    def decode_row(self, batch: dict[str, np.ndarray], i: int) -> str:
        x = " ".join(str(int(v) - 1) for v in batch["inputs"][i])
        y = " ".join(str(int(v) - 1) for v in batch["targets"][i])
        return f"{x}  -> ({self.layers} layers) ->  {y}"
