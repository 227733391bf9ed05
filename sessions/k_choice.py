"""How many tokens to draft next round, from what the rounds so far cost and earned (``adaptive_k``).

The best k is a property of the machine as much as of the speculator: verifying k + 1 rows costs T(k + 1),
and how fast T grows with the rows differs from one CPU to the next (SmolLM2's T(5)/T(1) is 1.15 on one
2-core VM and 1.54 on another), while the tokens a round earns depend on how often each drafted position
is accepted. Each round this picks the k in 1..k_max with the most expected tokens per second:

    E(k) = 1 + sum_{j<=k} prod_{i<=j} a_i        a_i: acceptance of position i, given 1..i-1 were accepted
    rate(k) = E(k) / (k * d + T(k + 1))           d: the speculator's time per drafted token,
                                                  T(r): a verify of r rows, with its acceptance and commit

All three are running estimates over the rounds this Session has decoded: a_i with a prior worth two rounds
at the estimate of a_{i-1} (a position not tried yet looks like the one before it, so a run of accepted
positions makes the next one worth trying), T(r) the mean of the verify calls of r rows (an r not seen yet
is interpolated between the nearest ones seen, or extrapolated along the last two, or at 5 % of a call per
row from a single one). Older rounds weigh less (counts decay by 1 % a round). The choice only changes how many
tokens are drafted, never how they are accepted: output stays exactly the target's.
"""
from __future__ import annotations

import bisect

PRIOR_FIRST, PRIOR_ROUNDS = 0.5, 2.0  # the first position's prior acceptance, and what a prior weighs
DECAY = 0.99
ROW_SLOPE = 0.05  # the guess for a row more, as a share of the one measured call, before a second is seen


class KChoice:
    def __init__(self, k_start: int, k_max: int):
        self.k_max = k_max
        self.k = k_start
        self._reached = [0.0] * (k_max + 1)  # position i (1-based) was drafted after i - 1 accepted
        self._accepted = [0.0] * (k_max + 1)
        self._verify = [0.0] * (k_max + 2)  # decayed sums of verify seconds and counts by rows
        self._verify_n = [0.0] * (k_max + 2)
        self._draft, self._draft_n = 0.0, 0.0  # decayed sums of propose seconds and drafted tokens

    def observe(self, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float) -> int:
        """Record one round; returns the k for the next one."""
        reached, acc = self._reached, self._accepted
        for i in range(1, self.k_max + 1):
            reached[i] *= DECAY
            acc[i] *= DECAY
        for i in range(1, min(drafted, accepted + 1) + 1):
            reached[i] += 1.0
            if i <= accepted:
                acc[i] += 1.0
        rows = drafted + 1
        if rows < len(self._verify):
            for r in range(1, len(self._verify)):
                self._verify[r] *= DECAY
                self._verify_n[r] *= DECAY
            self._verify[rows] += verify_seconds
            self._verify_n[rows] += 1.0
        if drafted:
            self._draft = self._draft * DECAY + draft_seconds
            self._draft_n = self._draft_n * DECAY + drafted
        self.k = self.best()
        return self.k

    def verify_cost(self, rows: int) -> float | None:
        """Seconds to verify ``rows`` rows: measured, else from the nearest measured rows (None: none yet)."""
        return self._costs()[rows]

    def _costs(self) -> list[float | None]:
        n, total = self._verify_n, self._verify
        seen = [r for r in range(1, len(n)) if n[r] > 0]
        out: list[float | None] = [None] * len(n)
        if not seen:
            return out
        mean = {r: total[r] / n[r] for r in seen}
        first, last = seen[0], seen[-1]
        if len(seen) > 1:
            low_slope = max(0.0, (mean[seen[1]] - mean[first]) / (seen[1] - first))
            high_slope = max(0.0, (mean[last] - mean[seen[-2]]) / (last - seen[-2]))
        else:
            low_slope = high_slope = ROW_SLOPE * mean[first]
        for r in range(1, len(n)):
            if r in mean:
                out[r] = mean[r]
            elif r < first:
                out[r] = max(0.0, mean[first] - low_slope * (first - r))
            elif r > last:
                out[r] = mean[last] + high_slope * (r - last)
            else:
                i = bisect.bisect(seen, r)
                lo, hi = seen[i - 1], seen[i]
                out[r] = mean[lo] + (mean[hi] - mean[lo]) * (r - lo) / (hi - lo)
        return out

    def best(self) -> int:
        costs = self._costs()
        if costs[2] is None:
            return self.k  # nothing measured yet: keep the starting k
        d = self._draft / self._draft_n if self._draft_n > 0 else 0.0
        best_k, best_rate, expected, run, a = self.k, -1.0, 1.0, 1.0, PRIOR_FIRST
        for k in range(1, self.k_max + 1):
            a = (self._accepted[k] + a * PRIOR_ROUNDS) / (self._reached[k] + PRIOR_ROUNDS)
            run *= a
            expected += run
            rate = expected / (k * d + costs[k + 1])
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k
