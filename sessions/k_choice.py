"""How many tokens to draft next round, from what the rounds so far cost and earned (``adaptive_k``).

The best k is a property of the machine as much as of the speculator: a round that drafts k tokens costs the
drafting plus a verification of k + 1 rows, and how fast that grows with k differs from one CPU to the next
(docs/python-api.md has figures), while the tokens a round earns depend on
how often each drafted position is accepted. After each round this picks the k in 1..k_max with the most
expected tokens per second:

    E(k) = 1 + sum_{j<=k} prod_{i<=j} a_i      a_i: acceptance of position i, given 1..i-1 were accepted
    rate(k) = E(k) / C(k)                       C(k): the time of a round that drafted k tokens, all of it
                                                (drafting, verifying, accepting and committing)

Both are running estimates over the rounds this Session has decoded, in which older rounds weigh less (their
counts decay by 1 % a round). a_i has a prior worth two rounds at the estimate of a_{i-1}: a position not
tried yet looks like the one before it, so a run of accepted positions makes the next one worth trying.
C(k) is the mean of the rounds that drafted k tokens; a k not seen yet is interpolated between the nearest
ones seen, or extrapolated along the last two (rounds that draft fewer than asked — a request's last
tokens, a lookup without a match — give the second point), or at 5 % of a round per token from a single one;
an extrapolated token never costs less than 1 % of a round (a timing blip that makes the longer of two rounds
look cheaper must not make every k look free, which sent a source that drafts nothing right to k_max). A round
counts at most ``CLIP`` times what its k was expected to cost: a k's mean moves only when that k is drafted, so
one slow round (a preempted thread, a pause) counted whole could make a k look dear for good and keep a source
at a k far below its best; a k that really costs more is still learnt, in a few rounds. Last, a round that
drafts a token fewer is taken to cost at least 1 % of a round less (as an extrapolated one does): a k is
re-measured only when it is chosen, so one slow round at a k below the one kept (measured again and again)
could otherwise make the smaller k look dearer for good, and keep a source that drafts nothing right at k=2.
With several draft sources (a Cascade) each source has its own estimates and its own k. The choice only
changes how many tokens are drafted, never how they are accepted: output stays exactly the target's.
"""
from __future__ import annotations

import bisect

PRIOR_FIRST, PRIOR_ROUNDS = 0.5, 2.0  # the first position's prior acceptance, and what a prior weighs
DECAY = 0.99
SLOPE = 0.05  # the guess for a token more, as a share of the one round length measured, before a second
MIN_SLOPE = 0.01  # the least an extrapolated token more costs, as a share of the round it extends
CLIP = 1.25  # the most a round counts, as a share of what its k was expected to cost


class KChoice:
    """The k of the next round; with several draft sources (a Cascade), one k per source."""

    def __init__(self, k_start: int, k_max: int, sources: int = 1):
        self.k_max = k_max
        self.ks = [k_start] * sources
        """The k of each source; ``k`` (the largest) is what a round may draft."""
        self._reached = [[0.0] * (k_max + 1) for _ in range(sources)]  # position i drafted, 1..i-1 accepted
        self._accepted = [[0.0] * (k_max + 1) for _ in range(sources)]
        self._seconds = [[0.0] * (k_max + 1) for _ in range(sources)]  # decayed sums by drafted tokens
        self._rounds = [[0.0] * (k_max + 1) for _ in range(sources)]
        self._expected: list[list[float | None]] = [[None] * (k_max + 1) for _ in range(sources)]
        """Of each source, each k's cost as the last choice saw it (the decay leaves the means as they are)."""

    @property
    def k(self) -> int:
        return max(self.ks)

    def observe(self, drafted: int, accepted: int, seconds: float, source: int = 0) -> int:
        """Record one round (``source``: which one drafted it); returns the k for the next one."""
        reached, acc = self._reached[source], self._accepted[source]
        total, rounds = self._seconds[source], self._rounds[source]
        for i in range(self.k_max + 1):
            reached[i] *= DECAY
            acc[i] *= DECAY
            total[i] *= DECAY
            rounds[i] *= DECAY
        for i in range(1, min(drafted, accepted + 1) + 1):
            reached[i] += 1.0
            if i <= accepted:
                acc[i] += 1.0
        if drafted <= self.k_max:
            expected = self._expected[source][drafted]
            total[drafted] += seconds if expected is None else min(seconds, CLIP * expected)
            rounds[drafted] += 1.0
        self.ks[source] = self._best(source)
        return self.k

    def round_cost(self, k: int, source: int = 0) -> float | None:
        """Seconds of a round that drafts ``k`` tokens: measured, else from the nearest measured (None: none)."""
        return self._costs(source)[k]

    def _costs(self, source: int) -> list[float | None]:
        total, rounds = self._seconds[source], self._rounds[source]
        seen = [k for k in range(len(rounds)) if rounds[k] > 0]
        out: list[float | None] = [None] * len(rounds)
        if not seen:
            return out
        mean = {k: total[k] / rounds[k] for k in seen}
        first, last = seen[0], seen[-1]
        if len(seen) > 1:
            low = max(MIN_SLOPE * mean[first], (mean[seen[1]] - mean[first]) / (seen[1] - first))
            high = max(MIN_SLOPE * mean[last], (mean[last] - mean[seen[-2]]) / (last - seen[-2]))
        else:
            low = high = SLOPE * mean[first]
        for k in range(len(rounds)):
            if k in mean:
                out[k] = mean[k]
            elif k < first:
                out[k] = max(0.0, mean[first] - low * (first - k))
            elif k > last:
                out[k] = mean[last] + high * (k - last)
            else:
                i = bisect.bisect(seen, k)
                lo, hi = seen[i - 1], seen[i]
                out[k] = mean[lo] + (mean[hi] - mean[lo]) * (k - lo) / (hi - lo)
        for k in range(len(out) - 2, 0, -1):  # a token fewer saves at least MIN_SLOPE of a round
            out[k] = min(out[k], out[k + 1] * (1.0 - MIN_SLOPE))
        return out

    def _best(self, source: int) -> int:
        costs = self._expected[source] = self._costs(source)
        reached, acc = self._reached[source], self._accepted[source]
        best_k, best_rate, expected, run, a = self.ks[source], -1.0, 1.0, 1.0, PRIOR_FIRST
        for k in range(1, self.k_max + 1):
            a = (acc[k] + a * PRIOR_ROUNDS) / (reached[k] + PRIOR_ROUNDS)
            run *= a
            expected += run
            cost = costs[k]
            if cost is None:
                return self.ks[source]  # nothing measured yet: keep the starting k
            rate = expected / cost if cost > 0 else float("inf")
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k
