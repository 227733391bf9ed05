"""How a batch drafts: plain steps, as planned, or every sequence its own k, decided by measuring all three
interleaved.

The plan (``k_policy.plan_ks``) prices what it can measure: the step's rows and the gaps the drafts add. Not
everything a step waits for is priced (a speculator catching up after a pause, the cores the drafts take from
the step, a speculative round's own Python), and a price can be wrong: a draft model's chain costs a fixed part
a round and a part a chain step, shared by every sequence drafting beside it, which a price per token charges to
few tokens where few sequences draft, so that the plan drafts less than pays. So the ``Guard`` measures the
outcome, tokens a second, of three modes: ``PLAIN`` steps, drafting as ``PLANNED``, and ``ALL`` (every sequence
drafts what its Session would draft alone).

It measures the modes interleaved, a few steps of each in turn, because this machine's speed drifts at every
time scale a guard could use: on the 2-core VM (the shipped pair, 2 sequences, plain steps throughout), one
window of 16-256 steps against the mean of the windows either side of it differed by 10-13 % (standard
deviation), while two halves of 128 steps taken alternately, 2 or 4 steps each, differed by 1.9-2.6 %
(docs/performance.md, "Stop 59"). A guard that compared windows one after the other could not tell modes 5 %
apart, and chose between them by chance.

A measurement goes round the modes, ``block`` steps each, until ``measure`` steps count. The first ``lead``
steps of each block do not count: they pay for the mode before them. A speculator catches up then on what it
did not read (a head reads every row since its last proposal), and in a server the tokens the last steps
emitted are sent and read while they run, the event loop's and the clients' work on the same cores, which a
mode emitting more tokens a step leaves to whichever mode follows it (how much that moved a measurement of
2-step blocks all counted was not measured apart from the VM's noise: docs/performance.md, "Stop 59").
It ends early once ``measure_min`` steps count and plain steps serve more than ``early`` more, or less, than
the best drafting mode. The modes are ranked plain, planned, all: a mode is chosen over the ones before it
only where it served more than ``margin`` more than the best of them (a tie goes to fewer drafts: what
drafting costs outside the steps, the drafts' prompts, is not measured).

The chosen mode is then kept for ``keep`` steps, and measured again: a measurement that changes the choice
starts ``keep`` over at the least (one measurement can be wrong), one that confirms it doubles ``keep`` (up to
``keep_max``). A measurement spends most of its steps in modes not chosen, so a confirmed choice is also kept
at least as long as holds what they lose within ``budget`` of the rate, up to ``keep_far``: where drafting
serves 40 % less, the next measurement comes thousands of steps on. A drafting mode that served ``drop`` less
than the chosen one sits out the next ``sit_out`` measurements (every sequence drafting its k, under a load
where that loses by far, would cost every measurement a third of its steps); plain steps are always measured.
"""
from __future__ import annotations

PLAIN, PLANNED, ALL = "plain", "planned", "all"
MODES = (PLAIN, PLANNED, ALL)
"""The ranking: a mode is chosen over those before it only by a margin."""
TRY_BUDGET = 0.01
"""The share of the rate a settled guard's measurements may cost (``Guard``)."""


class Guard:
    """Plain steps, drafting as planned, or every sequence its own k, by the tokens a second each serves when
    measured interleaved (see the module's text). ``step`` takes each step's record; ``mode`` is the mode the
    next rounds plan in."""

    def __init__(self, modes: tuple[str, ...] = MODES, measure: int = 96, block: int = 4, lead: int = 2,
                 margin: float = 0.02, keep: int = 576, keep_max: int = 4608, keep_far: int = 9216,
                 budget: float = TRY_BUDGET, measure_min: int = 48, early: float = 0.25, drop: float = 0.1,
                 sit_out: int = 3):
        if not budget > 0:
            raise ValueError(f"a guard's budget for its measurements is a share of the rate above 0, got {budget!r}")
        if not modes or any(m not in MODES for m in modes) or len(set(modes)) != len(modes):
            raise ValueError(f"a guard's modes are some of {MODES} in that order, got {modes!r}")
        if not 0 <= lead < block or measure < len(modes) * (block - lead) or not 0 < measure_min <= measure:
            raise ValueError(f"a guard counts at least a block of each mode, past its lead: measure={measure}, "
                             f"block={block}, lead={lead}, measure_min={measure_min}, {len(modes)} modes")
        self.modes = tuple(m for m in MODES if m in modes)
        self.measure, self.block, self.margin, self.budget = measure, block, margin, budget
        self.lead, self.measure_min, self.early, self.drop, self.sit_out = lead, measure_min, early, drop, sit_out
        self.keep_min, self.keep_max = keep, max(keep, keep_max)
        self.keep_far = max(self.keep_max, keep_far)
        self.keep = keep
        """Steps the chosen mode is kept before the next measurement."""
        self.mode = self.modes[-1]
        """The mode the next rounds plan in."""
        self.measuring = True
        """A measurement is running: the mode goes round every ``block`` steps."""
        self.rates: dict[str, float | None] = {m: None for m in self.modes}
        """Each mode's tokens a second in the last measurement."""
        self.measurements = 0
        self.recorded = 0
        """Step records taken."""
        self._choice: str | None = None  # the last measurement's choice
        self._out = {m: 0 for m in self.modes}  # measurements each mode sits out
        self._start()

    @property
    def drafting(self) -> bool:
        """Whether the next rounds may draft."""
        return self.mode != PLAIN

    def step(self, mode: str, seconds: float, tokens: int) -> None:
        """One step's record: the mode its rounds drafted in, its seconds, the tokens its rounds emitted."""
        self.recorded += 1
        if not self.measuring:
            if mode == self.mode:
                self._kept += 1
                if self._kept >= self.keep:
                    self._start()
            return
        if mode not in self._sums:  # a record from before the guard's modes were set (not a mode it measures)
            return
        self._seen += 1
        self.mode = self._measured[-1 - (self._seen // self.block) % len(self._measured)]
        self._run = self._run + 1 if mode == self._last else 1
        self._last = mode
        if self._run > self.lead:  # past the steps that pay for the mode before it
            total = self._sums[mode]
            total[0] += seconds
            total[1] += tokens
            self._counts[mode] += 1
        counted = sum(self._counts.values())
        if counted >= self.measure or counted >= self.measure_min and self._apart():
            self._decide()

    def _start(self) -> None:
        self._measured = tuple(m for m in self.modes if not self._out[m] or m == self._choice)
        for m in self.modes:
            self._out[m] = max(self._out[m] - 1, 0)
        if len(self._measured) < 2 and self._choice is not None:  # nothing to measure it against: kept on
            self.measuring, self._kept = False, 0
            return
        self.measuring, self.mode, self._seen = True, self._measured[-1], 0
        self._last, self._run = None, 0  # the mode of the last record, and its records in a row
        self._sums = {m: [0.0, 0] for m in self._measured}  # seconds, tokens
        self._counts = {m: 0 for m in self._measured}

    def _rate(self, mode: str) -> float | None:
        seconds, tokens = self._sums[mode]
        return tokens / seconds if self._counts[mode] and seconds > 0 else None

    def _apart(self) -> bool:
        """Whether every mode is measured (a share of the steps each, at least) and plain steps serve more than
        ``early`` more or less than the best drafting mode: the choice is then plain, or drafting, whatever more
        steps would measure (which drafting mode is left to a whole measurement)."""
        measured = self._measured
        if min(self._counts.values()) < self.measure_min // (2 * len(measured)) or measured[0] != PLAIN:
            return False
        rates = [self._rate(m) for m in measured]
        if None in rates or len(rates) < 2:
            return False
        plain, drafts = rates[0], max(rates[1:])
        return drafts > plain * (1 + self.early) or plain > drafts * (1 + self.early)

    def _decide(self) -> None:
        rates = {m: self._rate(m) for m in self._measured}
        self.rates.update(rates)
        self.measurements += 1
        if None in rates.values():  # a mode had no counted step: measured again
            self._start()
            return
        chosen = self._measured[0]
        for m in self._measured[1:]:
            if rates[m] > rates[chosen] * (1 + self.margin):
                chosen = m
        best = max(rates.values())
        loss = sum(1.0 - r / best for r in rates.values()) / len(rates)  # what the measurement lost
        for m, r in rates.items():  # a drafting mode far behind sits the next few out (plain steps never do)
            if m not in (chosen, PLAIN) and r < rates[chosen] * (1 - self.drop):
                self._out[m] = self.sit_out
        if chosen == self._choice:  # confirmed: measured less often, and at most at the budget's cost
            self.keep = max(min(2 * self.keep, self.keep_max),
                            min(int(self.measure * (loss / self.budget - 1)), self.keep_far))
        else:  # a new choice is measured again soon: one measurement can be wrong
            self.keep = self.keep_min
        self._choice, self.mode, self.measuring, self._kept = chosen, chosen, False, 0
