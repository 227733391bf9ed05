"""How many tokens each sequence of a batched step drafts: a pure function of measured costs and acceptances.

A batched step verifies every active sequence in one call. Its time grows with the call's total rows R (one
row per plain sequence, k + 1 per sequence that drafted k): nearly flat while the weights' reading bounds it,
then about linearly once the arithmetic does. A sequence that drafts k tokens at acceptance a earns in
expectation

    E(k) = 1 + a + a^2 + ... + a^k

tokens (the accepted drafts and the bonus or recovered token), so its j-th drafted token earns a^j at the cost
of one row more of the step, d of drafting, and nothing else. The step's throughput is

    rate = sum_i E_i(k_i) / (t(R) + sum_i k_i d_i),      R = sum_i (1 + k_i)

``plan_ks`` finds the ks with the best rate (Dinkelbach's method: for a rate r, the ks that maximise
earned - r * seconds are the m drafted tokens of most value a^j - r d, for the best m; their rate is the next
r, until it stops growing). Under load (many sequences, the step already past the flat part) a drafted token
costs a whole row of arithmetic and the ks fall to what pays, down to plain steps; a lone sequence drafts as
far as its acceptance pays on a step that is almost free per row. ``StepCost`` is t(R): measured when the batch is made,
refined by every step it runs.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

DECAY = 0.9
"""The weight a point of the step-cost table keeps when a step of its row count is measured again."""
MAX_ITERATIONS = 32
"""Dinkelbach steps at most (the rate grows at every one; a handful reach the best)."""


class StepCost:
    """t(R), seconds of a batched step of R rows: piecewise linear through measured points, extended along
    the last two beyond them."""

    def __init__(self, points: dict[int, float]):
        if not points or any(r < 1 or t <= 0 for r, t in points.items()):
            raise ValueError(f"a step cost needs positive times at row counts >= 1, got {points}")
        self.rows = sorted(points)
        self.seconds = [float(points[r]) for r in self.rows]
        self._monotone()

    def _monotone(self) -> None:
        """A step of more rows never costs less than one of fewer (what says otherwise is timing noise)."""
        for i in range(1, len(self.seconds)):
            self.seconds[i] = max(self.seconds[i], self.seconds[i - 1])

    def __call__(self, rows: int) -> float:
        r, t = self.rows, self.seconds
        if len(r) == 1:
            return t[0] * max(rows, 1) / r[0] if rows > r[0] else t[0]
        i = bisect.bisect_left(r, rows)
        if i < len(r) and r[i] == rows:
            return t[i]
        lo = min(max(i - 1, 0), len(r) - 2)  # the segment rows falls in, or the nearest end one
        slope = (t[lo + 1] - t[lo]) / (r[lo + 1] - r[lo])
        return max(t[0] if rows < r[0] else t[lo] + slope * (rows - r[lo]), 1e-9)

    def observe(self, rows: int, seconds: float) -> None:
        """Refine the point of ``rows`` (the nearest measured row count at or above it) with a step's time."""
        i = min(bisect.bisect_left(self.rows, rows), len(self.rows) - 1)
        if self.rows[i] == rows:
            self.seconds[i] = DECAY * self.seconds[i] + (1 - DECAY) * seconds
        elif rows > self.rows[-1]:
            self.rows.append(rows)
            self.seconds.append(seconds)
        self._monotone()


@dataclass
class Sequence:
    """What ``plan_ks`` knows of one sequence of the step."""

    acceptance: float
    """Estimated chance that a drafted token is accepted, given the ones before it were (0..1)."""
    k_max: int
    """The most it may draft (its request's k, its budget); 0 for a sequence without a speculator."""
    draft_seconds: float = 0.0
    """Seconds of drafting one token."""


def plan_ks(cost: StepCost, sequences: list[Sequence]) -> list[int]:
    """The k of each sequence for the next step: the ks with the best rate (see the module's text); [] for none."""
    n = len(sequences)
    ks, rate = [0] * n, n / cost(n) if n else 0.0
    for _ in range(MAX_ITERATIONS):
        better = _best_at(cost, sequences, rate)
        new_rate = _rate(cost, sequences, better)
        if new_rate <= rate * (1 + 1e-12):
            return ks
        ks, rate = better, new_rate
    return ks


def _best_at(cost: StepCost, sequences: list[Sequence], rate: float) -> list[int]:
    """The ks that maximise earned - rate * seconds: for each count m of drafted tokens the m drafted tokens
    of most value (a sequence's j-th is worth a^j - rate * d, less with every j, so the best m of them are a
    prefix of each sequence's), then the m that is best with the step's cost."""
    n = len(sequences)
    values = sorted(((min(max(s.acceptance, 0.0), 1.0) ** (j + 1) - rate * s.draft_seconds, i)
                     for i, s in enumerate(sequences) for j in range(s.k_max)), key=lambda v: -v[0])
    best_m, best, total = 0, -rate * cost(n), 0.0
    for m, (value, _) in enumerate(values, 1):
        total += value
        if total - rate * cost(n + m) > best:
            best_m, best = m, total - rate * cost(n + m)
    ks = [0] * n
    for _, i in values[:best_m]:
        ks[i] += 1
    return ks


def _rate(cost: StepCost, sequences: list[Sequence], ks: list[int]) -> float:
    earned, seconds = float(len(ks)), cost(len(ks) + sum(ks))
    for s, k in zip(sequences, ks):
        a = min(max(s.acceptance, 0.0), 1.0)
        earned += sum(a ** (j + 1) for j in range(k))
        seconds += k * s.draft_seconds
    return earned / seconds


class Guard:
    """Whether a batch drafts as planned or not at all: the plan's costs are measured, but what a step waits for
    (other sequences' work under one interpreter lock, a speculator catching up) is only estimated, so the
    guard also measures the outcome. It alternates windows of ``window`` steps, keeps the tokens a second of
    the windows that drafted as planned and of those that drafted nothing (running means), drafts in the better
    mode, and tries the other one every ``explore``-th window; a window's rate is its emitted tokens over its
    wall time."""

    def __init__(self, window: int = 24, explore: int = 4):
        self.window, self.explore = window, explore
        self.drafting = True
        self.rates: dict[bool, float | None] = {True: None, False: None}
        self._steps, self._tokens, self._start, self._windows = 0, 0, None, 0

    def step(self, now: float, tokens: int) -> None:
        """A step ended at ``now`` (seconds) and its sequences emitted ``tokens``."""
        if self._start is None:
            self._start = now
            return
        self._steps += 1
        self._tokens += tokens
        if self._steps < self.window:
            return
        rate = self._tokens / max(now - self._start, 1e-9)
        old = self.rates[self.drafting]
        self.rates[self.drafting] = rate if old is None else 0.5 * (old + rate)
        self._windows += 1
        other = not self.drafting
        if self.rates[other] is None or self._windows % self.explore == 0:
            self.drafting = other  # measure the other mode (again)
        else:
            self.drafting = self.rates[True] >= self.rates[False]
        self._steps, self._tokens, self._start = 0, 0, now
