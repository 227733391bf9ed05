"""How many tokens each sequence of a batched step drafts: a pure function of measured costs and acceptances.

A batched step verifies every active sequence in one call. Its time grows with the call's total rows R (one
row per plain sequence, k + 1 per sequence that drafted k): nearly flat while the weights' reading bounds it,
then about linearly once the arithmetic does. A sequence that drafts k tokens at acceptance a earns in
expectation

    E(k) = 1 + a + a^2 + ... + a^k

tokens (the accepted drafts and the bonus or recovered token), so its j-th drafted token earns a^j at the cost
of one row more of the step, d of drafting, and nothing else (with an acceptance a_i per position, as a
batch's slots estimate it: a_1 a_2 ... a_j). The step's throughput is

    rate = sum_i E_i(k_i) / (t(R) + sum_i k_i d_i),      R = sum_i (1 + k_i)

``plan_ks`` finds the ks with the best rate (Dinkelbach's method: for a rate r, the ks that maximise
earned - r * seconds are the m drafted tokens of most value a^j - r d, for the best m; their rate is the next
r, until it stops growing). Under load (many sequences, the step already past the flat part) a drafted token
costs a whole row of arithmetic and the ks fall to what pays, down to plain steps; a lone sequence drafts as
far as its acceptance pays on a step that is almost free per row. ``StepCost`` is t(R): its shape measured
when the batch is made, at the sequences' context, refined by every step it runs.

A sequence with several draft sources (a Cascade: prompt lookup, then a head) is one ``Sequence`` per source,
each with its own acceptance, its own cost d and the chance c that it is the one to draft the next round (lookup
only drafts where it finds a match). Its j-th token then earns c a^j for c rows and c d seconds: the plan ranks
tokens by what they earn a row (a^j - r d), weighs rows by chance, and returns a k for each source. So a source
whose drafts are accepted less, or cost more to make, stops drafting first as the load grows, while a cheap and
accurate one goes on.
"""
from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from dataclasses import dataclass

DECAY = 0.9
"""The weight the step cost's scale keeps at each step measured."""
MAX_ITERATIONS = 32
"""Dinkelbach steps at most (the rate grows at every one; a handful reach the best)."""
PLAUSIBLE = 0.1
"""How far measured step times may stray from a shape a step can have (``StepCost.plausible``)."""


class StepCost:
    """t(R, c), seconds of a batched step of R rows whose sequences hold c tokens each on average: a shape
    measured once on one sequence with no context (piecewise linear through measured points, extended along the
    last two beyond them) and what each row adds a token of context it attends to (``per_row_context``, measured
    once too), corrected by what every step measures: a ``scale`` below 1 where steps run faster than the model
    (start-up measured on a machine busy with something else: another server starting, which slows every row
    alike), and an ``offset`` where they run slower (what the shape leaves out: each sequence's own share of a
    step, the interpreter's threads between and around steps, which a row more does not add to): a scale alone
    read what slows a live step as a dearer row, and the plan drafted less than pays (docs/design.md, "Why the
    context and the scale").

    Each row attends to its sequence's context, so a drafted row costs the shape's slope and its context: on
    the shipped target at 256 tokens of context, that adds about 75 % to the slope; on SmolLM2, 1.8 us a row
    and token (docs/performance.md, "The cost model the k plan uses")."""

    def __init__(self, points: dict[int, float], per_row_context: float = 0.0):
        if not points or any(r < 1 or t <= 0 for r, t in points.items()):
            raise ValueError(f"a step cost needs positive times at row counts >= 1, got {points}")
        self.rows = sorted(points)
        self.seconds = [float(points[r]) for r in self.rows]
        r, t = self.rows, self.seconds
        for i in range(1, len(t)):  # more rows never cost less than fewer, nor more a row (else: noise)
            t[i] = min(max(t[i], t[i - 1]), t[i - 1] * r[i] / r[i - 1])
        self.per_row_context = max(float(per_row_context), 0.0)
        self.scale = 1.0
        """Measured steps' seconds over the model's where below 1 (a running mean; steps slower count as 1)."""
        self.offset = 0.0
        """Seconds measured steps took beyond the model's (a running mean; steps faster count as 0)."""

    @staticmethod
    def plausible(points: dict[int, float], tolerance: float = PLAUSIBLE) -> bool:
        """Whether measured ``points`` (rows -> seconds) are a shape a step can have, within ``tolerance``: more
        rows cost no less than fewer, and no more a row (a step of R rows is never dearer than R steps of one).
        A calibration that ran beside other work (another server starting) measures some sizes slowed and others
        not, which breaks one or the other."""
        rows = sorted(points)
        for lo, hi in zip(rows, rows[1:]):
            if points[hi] < points[lo] * (1 - tolerance) or points[hi] > points[lo] * hi / lo * (1 + tolerance):
                return False
        return True

    def shape(self, rows: float) -> float:
        r, t = self.rows, self.seconds
        if len(r) == 1:
            return t[0] * max(rows, 1) / r[0] if rows > r[0] else t[0]
        i = bisect.bisect_left(r, rows)
        if i < len(r) and r[i] == rows:
            return t[i]
        lo = min(max(i - 1, 0), len(r) - 2)  # the segment rows falls in, or the nearest end one
        slope = (t[lo + 1] - t[lo]) / (r[lo + 1] - r[lo])
        return max(t[0] if rows < r[0] else t[lo] + slope * (rows - r[lo]), 1e-9)

    def __call__(self, rows: float, context: float = 0.0) -> float:
        return self.scale * (self.shape(rows) + self.per_row_context * rows * context) + self.offset

    def observe(self, rows: int, seconds: float, context: float = 0.0) -> None:
        """Refine the scale and the offset with a step of ``rows`` at ``context`` tokens a sequence that took
        ``seconds``."""
        model = self.shape(rows) + self.per_row_context * rows * context
        self.scale = DECAY * self.scale + (1 - DECAY) * min(seconds / model, 1.0)
        self.offset = DECAY * self.offset + (1 - DECAY) * max(seconds - model, 0.0)


@dataclass
class Sequence:
    """What ``plan_ks`` knows of one sequence of the step."""

    acceptance: float | tuple[float, ...]
    """Estimated chance that a drafted token is accepted, given the ones before it were (0..1): one value for
    every position, or one per position (``Acceptance.values``; the last one holds beyond them)."""
    k_max: int
    """The most it may draft (its request's k, its budget); 0 for a sequence without a speculator."""
    draft_seconds: float = 0.0
    """Seconds of drafting one token."""
    chance: float = 1.0
    """The chance that this source drafts the sequence's next round (1 for a sequence's only source)."""


MIN_CHANCE = 0.02
"""The least chance a source is planned with: one that has not drafted for a while still gets the k its tokens
would earn, so it is asked, and its chance measured, again."""


def plan_ks(cost: StepCost, sequences: list[Sequence], overhead: float = 0.0, slots: int | None = None,
            context: float = 0.0) -> list[int]:
    """The k of each sequence for the next step: the ks with the best rate (see the module's text); [] for none.
    ``overhead``: seconds every step costs besides t(R), whatever is drafted (the sequences' work between steps).
    ``slots``: the sequences the step runs, where ``sequences`` holds several sources of one (default: one
    each). ``context``: the tokens each sequence holds, on average. The step's cost is read once per row count
    it can reach (the batch plans every few steps, under its lock)."""
    n = len(sequences) if slots is None else slots
    if not sequences:
        return []
    table = [cost(n + m, context) + overhead for m in range(sum(s.k_max for s in sequences) + 1)]
    powers = [_powers(s) for s in sequences]
    chances = [min(max(s.chance, MIN_CHANCE), 1.0) for s in sequences]
    plan = _Plan(table, sequences, powers, chances, n)
    ks, rate = [0] * len(sequences), n / table[0]
    for _ in range(MAX_ITERATIONS):
        better = plan.best_at(rate)
        new_rate = plan.rate(better)
        if new_rate <= rate * (1 + 1e-12):
            return ks
        ks, rate = better, new_rate
    return ks


def _powers(s: Sequence) -> list[float]:
    """What each of the sequence's drafted tokens earns: the chance it and every one before it are accepted."""
    each = (s.acceptance,) if isinstance(s.acceptance, (int, float)) else tuple(s.acceptance) or (0.0,)
    out, run = [], 1.0
    for j in range(s.k_max):
        run *= min(max(each[min(j, len(each) - 1)], 0.0), 1.0)
        out.append(run)
    return out


class Acceptance:
    """One draft source's acceptance by drafted position, as a batch's slot estimates it from its rounds: a_i,
    the chance that the i-th drafted token is accepted given that the ones before it were. The positions differ
    (SmolLM2-135M: its head 0.56, 0.63, 0.76, 0.60 at positions 1-4, prompt lookup 0.71, 0.78, 0.88, 0.87), so
    one value, which rounds drafting one token measure at the first position alone, prices the later tokens at
    a^j, too low, and the plan stops them early. Counts decay by ``decay`` a round of this source and by
    ``drift`` a round of another or none, so an estimate follows the text and a source whose drafts stopped
    paying drifts back to the prior and is tried again; a position has a prior worth ``weight`` rounds at the
    estimate of the position before it (the first: ``prior``), so a position not reached yet looks like it. With a
    ``base`` (the batch's estimate of the source over every slot's rounds), a position's prior is the base's
    estimate of that position instead: a new request starts from what the source does in the batch, and an
    estimate that drifts goes back to that, not to a constant that may be too low for the plan to ever draft
    (and so to ever measure) again."""

    def __init__(self, prior: float = 0.5, decay: float = 0.9, drift: float = 0.06, weight: float = 1.0,
                 base: "Acceptance | None" = None):
        self.prior, self.decay, self.drift_share, self.weight, self.base = prior, decay, drift, weight, base
        self._reached: list[float] = []  # position i + 1 drafted with every one before it accepted
        self._accepted: list[float] = []

    def observe(self, drafted: int, accepted: int) -> None:
        """A round that drafted ``drafted`` tokens from this source, of which the first ``accepted`` were kept."""
        self._fade(self.decay)
        reached = min(drafted, accepted + 1)  # a rejection ends the round: later positions say nothing
        while len(self._reached) < reached:
            self._reached.append(0.0)
            self._accepted.append(0.0)
        for i in range(reached):
            self._reached[i] += 1.0
            if i < accepted:
                self._accepted[i] += 1.0

    def drift(self, rounds: int = 1) -> None:
        """Rounds this source did not draft (a batch's slot counts its rounds that drafted nothing and tells
        them when the plan reads the estimate: ``Slot._settle``)."""
        self._fade((1.0 - self.drift_share) ** rounds)

    def _fade(self, factor: float) -> None:
        for i in range(len(self._reached)):
            self._reached[i] *= factor
            self._accepted[i] *= factor

    def clear(self) -> None:
        """Forget every round (a new request: its text is not the last one's); the prior, or the base, is left."""
        self._reached.clear()
        self._accepted.clear()

    def values(self, positions: int) -> tuple[float, ...]:
        """a_1 .. a_positions."""
        base = self.base.values(positions) if self.base is not None else None
        out, a = [], self.prior
        for i in range(positions):
            if base is not None:
                a = base[i]
            if i < len(self._reached):
                a = (self._accepted[i] + a * self.weight) / (self._reached[i] + self.weight)
            out.append(a)
        return tuple(out)

    @property
    def first(self) -> float:
        """a_1: the chance the first drafted token is accepted."""
        return self.values(1)[0]


class _Plan:
    """One plan's fixed inputs (the step's seconds by drafted rows, each source's powers of its acceptance and
    chance), read at every Dinkelbach step."""

    def __init__(self, table: list[float], sequences: list[Sequence], powers: list[list[float]],
                 chances: list[float], slots: int):
        self.table, self.sequences, self.powers, self.chances, self.slots = table, sequences, powers, chances, slots

    def seconds(self, rows: float) -> float:
        """The step's seconds with ``rows`` drafted rows (a fraction where rows are weighed by chance)."""
        table, i = self.table, min(int(rows), len(self.table) - 1)
        if i + 1 >= len(table):
            return table[i]
        return table[i] + (rows - i) * (table[i + 1] - table[i])

    def best_at(self, rate: float) -> list[int]:
        """The ks that maximise earned - rate * seconds: drafted tokens in the order of what they earn a row (a
        source's j-th earns a^j - rate * d, less with every j, so what is taken of each source is a prefix of
        its tokens), then the prefix of that order that is best with the step's cost."""
        seqs, chances = self.sequences, self.chances
        values = sorted(((p - rate * s.draft_seconds, i) for i, (s, ps) in enumerate(zip(seqs, self.powers))
                         for p in ps), reverse=True)
        best_m, best, total, rows = 0, -rate * self.table[0], 0.0, 0.0
        for m, (value, i) in enumerate(values, 1):
            total += chances[i] * value
            rows += chances[i]
            score = total - rate * self.seconds(rows)
            if score > best:
                best_m, best = m, score
        ks = [0] * len(seqs)
        for _, i in values[:best_m]:
            ks[i] += 1
        return ks

    def rate(self, ks: list[int]) -> float:
        earned, rows, drafting = float(self.slots), 0.0, 0.0
        for s, ps, c, k in zip(self.sequences, self.powers, self.chances, ks):
            earned += c * sum(ps[:k])
            rows += c * k
            drafting += c * k * s.draft_seconds
        return earned / (self.seconds(rows) + drafting)


class DraftCost:
    """What the steps wait for between them, as the batch sees it: the seconds from one step's end to the next
    one's start with nothing drafted (``overhead``: the sequences' own work, under one interpreter lock) and
    the seconds each drafted token of a source adds to that (``per_token``). The sequences draft side by side on
    their own threads, so a sequence's own drafting time is not what the step waits for; this is. Where
    several sources drafted before one step (lookup for some sequences, a head for others), what the gap grew
    by is shared among them in proportion to the seconds each took to draft in the sequences' own threads. Medians
    of the last ``window`` gaps of each kind, so a gap stretched by something else (a client joining) does not
    count. After ``stale`` gaps in a row without a source's drafts, its cost is forgotten: the plan drafts from it
    again and measures anew (a cost measured once, under other load, would otherwise stop it for good). That
    try costs what drafting at a cost of nothing does, and a draft model or a head reads every token it skipped,
    so a source that drafted in fewer than ``window`` gaps between two forgettings waits twice as long before
    the next, up to ``stale_max`` gaps; one that drafts in ``window`` gaps starts over at ``stale``."""

    def __init__(self, window: int = 16, stale: int = 64, stale_max: int = 1024):
        self.plain: deque[float] = deque(maxlen=window)
        self.drafting: dict[str, deque[float]] = {}
        self.window, self.stale, self.stale_max = window, stale, max(stale, stale_max)
        self._without: dict[str, int] = {}  # gaps in a row without each source's drafts
        self._with: dict[str, int] = {}  # gaps with each source's drafts since its cost was last forgotten
        self._interval: dict[str, int] = {}  # each source's gaps in a row without its drafts before forgetting
        self.forgotten: set[str] = set()
        """Sources whose cost was measured, then forgotten (and not measured again since)."""

    def observe(self, gap: float, parts: dict[str, tuple[int, float]] | None = None) -> None:
        """A gap before a step; ``parts``: each source that drafted for it -> (its tokens, its drafting's
        seconds in the sequences' own threads); none for a gap with nothing drafted."""
        parts = {name: p for name, p in (parts or {}).items() if p[0] > 0}
        for name in parts:
            self._with[name] = self._with.get(name, 0) + 1
            if self._with[name] >= self.window:  # it pays again: forgotten as soon as at first
                self._interval.pop(name, None)
        for name in list(self.drafting):
            self._without[name] = 0 if name in parts else self._without.get(name, 0) + 1
            if self._without[name] >= self.interval(name):
                del self.drafting[name], self._without[name]
                self.forgotten.add(name)
                if self._with.pop(name, 0) < self.window:
                    self._interval[name] = min(2 * self.interval(name), self.stale_max)
        if not parts:
            self.plain.append(gap)
            return
        grown = max(gap - self.overhead, 0.0)
        own = sum(seconds for _, seconds in parts.values())
        tokens = sum(t for t, _ in parts.values())
        for name, (t, seconds) in parts.items():
            share = seconds / own if own > 0 else t / tokens
            seen = self.drafting.get(name)
            if seen is None:
                seen = self.drafting[name] = deque(maxlen=self.window)
            seen.append(grown * share / t)
            self.forgotten.discard(name)

    def seed(self, other: "DraftCost") -> None:
        """Start from what ``other`` (another load's) has measured: a new load's plan starts from a neighbour's
        costs, not from drafting as if nothing cost anything."""
        self.plain.extend(other.plain)
        for name, seen in other.drafting.items():
            self.drafting[name] = deque(seen, maxlen=self.window)

    @property
    def overhead(self) -> float:
        return statistics.median(self.plain) if self.plain else 0.0

    def interval(self, source: str) -> int:
        """Gaps in a row without ``source``'s drafts before its cost is forgotten."""
        return self._interval.get(source, self.stale)

    def per_token(self, source: str) -> float:
        """0 until a gap with ``source``'s drafts is measured: drafting is then planned as a lone sequence plans it."""
        seen = self.drafting.get(source)
        return statistics.median(seen) if seen else 0.0


TRIM_FROM = 4
"""A guard's window of at least this many steps leaves out its step of the lowest rate (``Guard``)."""
TRY_BUDGET = 0.005
"""The share of a settled guard's rate its tries of the worse mode may cost (``Guard``; replayed on a server's own
step times, 0.005 served as much as 0.01 or more, with up to 0.7 % more where one mode is far ahead:
``scripts/guard_replay.py``, docs/performance.md, "Stop 63")."""
MARGIN = 0.06
"""How much more a guard's drafting windows must serve than its plain ones to count as better (``Guard``): the
goal is never to serve less than plain steps, so a near tie goes to them (docs/performance.md, "Stop 65")."""


class Guard:
    """Whether a batch drafts as planned or not at all: the plan's costs are measured, but not everything a step waits
    for is (a speculator catching up after a pause, the cores the drafts take from the step, a speculative
    round's own Python), so the guard also measures the outcome. It runs windows of ``window`` steps in one mode
    and drafts in the better one, drafting counting as better only where it serves ``margin`` more (a tie goes to
    plain steps: what drafting costs outside the steps counted, the drafts' prompts and catching up, is not
    measured). After ``explore`` windows in the better mode it tries the other for one window, then runs one more
    in the better mode, and compares the try with the mean of the windows just before and after it: the machine's
    speed drifts, so a try measured now is compared with the kept mode measured around it, never with a rate
    measured long before. A window's rate leaves out its step of the lowest rate (``TRIM_FROM``): a few steps
    take far longer than the rest in either mode (a request arriving, the machine), and the choice would follow
    them. A try that confirms the choice doubles ``explore``, up to ``explore_max`` (a try costs what the worse
    mode loses, so a settled choice is tried less and less often); one that finds the other mode better is made
    again at once, and two in a row switch to it and start over at ``explore`` (one window against two is a
    coin's toss where the modes are a few percent apart; docs/performance.md, "Stop 53"). A step counts with the
    mode its sequences drafted in, its whole time (the gap before it and its run) and the tokens its rounds
    emitted; the batch leaves out steps that hold a prompt's chunk, whose time says nothing of drafting. The
    first ``settle`` steps after a switch do not count either: a speculator catches up then on what it did not
    read while the other mode ran (a head reads every row since its last proposal), a cost of switching, not of
    the mode. A try that confirms the choice by a wide margin also spaces the next one so that tries cost at
    most ``budget`` of the rate (a try window in a mode that serves a fraction f less, once every E + 2 windows,
    costs about f / (E + 2)), up to ``explore_far`` windows: where drafting serves 20 % less, tries come every
    ~38 windows, not every 16; where the modes are a few percent apart, doubling alone spaces them, and a try
    that confirms by a small margin brings the spacing back to what doubling gives."""

    def __init__(self, window: int = 16, explore: int = 4, settle: int = 1, explore_max: int = 16,
                 margin: float = MARGIN, explore_far: int = 64, budget: float = TRY_BUDGET):
        if not budget > 0:
            raise ValueError(f"a guard's budget for its tries is a share of the rate above 0, got {budget!r}")
        self.window, self.settle, self.margin, self.budget = window, settle, margin, budget
        self.explore_min, self.explore_max = explore, max(explore, explore_max)
        self.explore_far = max(self.explore_max, explore_far)
        self.explore = explore
        """Windows in the better mode before the other is tried again (doubles while tries confirm it, or more
        where a try lost much)."""
        self._settling = 0
        self.drafting = True
        self.rates: dict[bool, float | None] = {True: None, False: None}
        """Each mode's tokens a second in its last window."""
        self._steps: dict[bool, list[tuple[float, int]]] = {True: [], False: []}  # each mode's window so far
        self._kept = 0  # windows in the better mode since the other was last tried
        self._phase = "first"  # the first two windows (one of each mode); "try": the window running tries the
        # other mode; "close": the one after a try; "keep": the better mode's
        self._before: float | None = None  # the kept mode's rate in the window before the try
        self._doubt = False  # the last try found the other mode better: it is tried again before a switch

    def step(self, drafting: bool, seconds: float, tokens: int) -> None:
        """One step's record: the mode its rounds drafted in, its seconds, the tokens its rounds emitted."""
        if drafting == self.drafting and self._settling > 0:
            self._settling -= 1
            return
        steps = self._steps[drafting]
        steps.append((seconds, tokens))
        if drafting != self.drafting or len(steps) < self.window:
            return
        if len(steps) >= TRIM_FROM:  # the window's step of the lowest rate is left out
            steps.remove(min(steps, key=lambda step: step[1] / max(step[0], 1e-9)))
        self.rates[drafting] = sum(t for _, t in steps) / max(sum(sec for sec, _ in steps), 1e-9)
        self._steps[drafting] = []
        self._window_ended(drafting)

    def _window_ended(self, drafting: bool) -> None:
        rate, other = self.rates[drafting], self.rates[not drafting]
        if other is None:  # the other mode is measured once before any choice: the window after this one
            self._switch(not drafting, "first")
        elif self._phase == "try":  # back to the kept mode for the window that closes the bracket
            self._switch(not drafting, "close")
        elif self._phase in ("close", "first"):  # a bracket closed, or the first window of each mode
            around = rate if self._before is None else 0.5 * (self._before + rate)
            drafts, plain = (around, other) if drafting else (other, around)
            best = drafts > plain * (1 + self.margin)
            if best == drafting:
                if self._phase == "close" and not self._doubt:
                    loss = 1.0 - min(drafts, plain) / max(drafts, plain, 1e-9)  # what a try of the other mode lost
                    self.explore = max(min(2 * self.explore, self.explore_max),
                                       min(math.ceil(loss / self.budget) - 2, self.explore_far))
                self._doubt = False
                self._kept, self._phase, self._before = 1, "keep", rate
            elif self._phase == "close" and not self._doubt:  # tried again at once: a switch takes two in a row
                self._doubt, self._before = True, rate
                self._switch(not drafting, "try")
            else:
                self._doubt = False
                self.explore = self.explore_min
                self._switch(best, "keep")
        else:
            self._kept += 1
            self._before = rate
            if self._kept >= self.explore:
                self._switch(not drafting, "try")

    def _switch(self, drafting: bool, phase: str) -> None:
        if drafting != self.drafting:
            self._settling = self.settle
        if phase in ("keep", "first"):
            self._kept, self._before = 0, None
        self.drafting, self._phase = drafting, phase
