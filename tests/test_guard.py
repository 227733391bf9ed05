"""The batch's guard (sessions/guard.py): plain steps, drafting as planned, or every sequence its own k, by the
three measured interleaved."""
from __future__ import annotations

import math

import numpy as np
import pytest

from rlxrt.sessions.guard import ALL, PLAIN, PLANNED, Guard


class Machine:
    """Steps of a machine whose speed drifts at every time scale (log speed an AR(1) process: ``phi`` a step,
    ``noise`` its innovation), where each mode serves ``gains[mode]`` times plain steps' tokens a second. A
    step's record reaches the guard two steps late, as the batch's does (its tokens are reported after the next
    step starts)."""

    def __init__(self, seed: int, gains: dict[str, float], phi: float = 0.98, noise: float = 0.03):
        self.rng, self.gains, self.phi, self.noise = np.random.default_rng(seed), gains, phi, noise
        self.log_speed = 0.0
        self.modes: list[str] = []

    def run(self, guard: Guard, steps: int) -> list[str]:
        """The mode of each step run (of the rounds planned while the guard said so)."""
        start = len(self.modes)
        for _ in range(steps):
            self.log_speed = self.phi * self.log_speed + self.noise * self.rng.standard_normal()
            self.modes.append(guard.mode)
            if len(self.modes) > 2:
                mode = self.modes[-3]
                guard.step(mode, 1.0, int(round(1000 * math.exp(self.log_speed) * self.gains[mode])))
        return self.modes[start:]


def measure_once(guard: Guard, rates: dict[str, float], limit: int = 10_000) -> list[str]:
    """Steps at fixed ``rates`` (tokens in a second) until the running measurement decides: the modes run."""
    seen = []
    while guard.measuring and len(seen) < limit:
        seen.append(guard.mode)
        guard.step(guard.mode, 1.0, rates[guard.mode])
    assert not guard.measuring, "the measurement never decided"
    return seen


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("best", [PLAIN, PLANNED, ALL])
def test_the_guard_keeps_the_mode_that_serves_most_on_a_drifting_machine(seed, best):
    """The machine's speed drifts by ~15 % (standard deviation) with a correlation that lasts tens of steps, and
    the best mode serves 7 % more than the next: measured interleaved two steps at a time, the best mode runs
    in nearly every step, the measurements included."""
    gains = {PLAIN: 1.0, PLANNED: 1.0, ALL: 1.0}
    gains[best] = 1.07
    if best == PLAIN:
        gains[ALL] = 0.8  # drafting every k loses by far under load
    guard = Guard()
    modes = Machine(seed, gains).run(guard, 20_000)
    share = sum(m == best for m in modes[2000:]) / len(modes[2000:])
    assert share >= 0.9, share


def test_a_measurement_goes_round_the_modes_and_leaves_out_each_blocks_lead():
    """block=4, lead=2: all x4, planned x4, plain x4, ... from the start of a measurement; the first two steps of
    each block do not count (they pay for the mode before them: a speculator catching up, a server's clients
    reading the tokens the steps before emitted)."""
    guard = Guard(measure=6, block=4, lead=2, measure_min=6)
    seen = []
    while guard.measuring and len(seen) < 100:
        mode = guard.mode
        lead = len(seen) % 4 < 2
        seen.append(mode)
        guard.step(mode, 1.0, 100 if lead else {ALL: 30, PLANNED: 20, PLAIN: 10}[mode])
    assert seen == [ALL] * 4 + [PLANNED] * 4 + [PLAIN] * 4  # 6 counted, 6 left out
    assert guard.rates == {PLAIN: 10.0, PLANNED: 20.0, ALL: 30.0}
    assert guard.mode == ALL and guard.drafting


def test_records_reaching_the_guard_late_still_leave_out_each_runs_lead():
    """The batch hands the guard a step's record two steps late, so a mode's run of records starts two steps
    after the guard's schedule switched: what counts is the run of records, not the schedule."""
    guard = Guard(measure=6, block=4, lead=2, measure_min=6)
    modes = []
    while guard.measuring and len(modes) < 100:
        modes.append(guard.mode)
        if len(modes) > 2:
            mode = modes[-3]
            run = 1
            while run < len(modes) - 2 and modes[-3 - run] == mode:
                run += 1
            guard.step(mode, 1.0, 100 if run <= 2 else {ALL: 30, PLANNED: 20, PLAIN: 10}[mode])
    assert guard.rates == {PLAIN: 10.0, PLANNED: 20.0, ALL: 30.0}


def test_a_mode_is_chosen_over_those_before_it_only_by_the_margin():
    """The ranking plain, planned, all: within the margin a tie goes to fewer drafts (what drafting costs outside
    the steps, the drafts' prompts, is not measured)."""
    for rates, chosen in (({PLAIN: 100, PLANNED: 101, ALL: 101}, PLAIN),
                          ({PLAIN: 100, PLANNED: 110, ALL: 111}, PLANNED),
                          ({PLAIN: 100, PLANNED: 110, ALL: 120}, ALL),
                          ({PLAIN: 100, PLANNED: 90, ALL: 103}, ALL)):
        guard = Guard(measure=12, block=2, lead=0, measure_min=12, margin=0.02)
        measure_once(guard, rates)
        assert guard.mode == chosen, (rates, guard.mode)
        assert guard.drafting == (chosen != PLAIN)


def test_a_confirmed_choice_is_measured_less_and_less_often_and_a_change_is_followed():
    """Each measurement that confirms the choice doubles the steps kept before the next, up to keep_max; where
    another mode pays more, the next measurement finds it, switches, and starts over at the least."""
    guard = Guard(measure=12, block=2, lead=0, measure_min=12, keep=16, keep_max=64, budget=1.0)
    keeps = []
    rates = {PLAIN: 10, PLANNED: 12, ALL: 11}

    def run(steps):
        for _ in range(steps):
            was = guard.measurements
            guard.step(guard.mode, 1.0, rates[guard.mode])
            if guard.measurements > was:
                keeps.append((guard.mode, guard.keep))

    run(600)
    assert keeps[:4] == [(PLANNED, 16), (PLANNED, 32), (PLANNED, 64), (PLANNED, 64)], keeps
    keeps.clear()
    rates[PLAIN] = 14  # the load grew: plain steps pay now
    run(200)
    assert keeps[0] == (PLAIN, 16) and keeps[1] == (PLAIN, 32), keeps


def test_measurements_where_drafting_loses_by_far_are_spaced_by_what_they_cost():
    """Drafting serves 40 % less (a small pair under load): a measurement spends two thirds of its steps drafting,
    so the next comes measure * (loss / budget - 1) steps on, loss the modes' mean shortfall (0.8 / 3), and the
    steps drafting cost about the budget of the rate."""
    guard = Guard(measure=36, block=2, lead=0, measure_min=36, keep=64, keep_max=64, budget=0.01, early=1.0)
    modes = []
    for _ in range(40_000):
        modes.append(guard.mode)
        guard.step(guard.mode, 1.0, 10 if guard.mode == PLAIN else 6)
    assert guard.mode == PLAIN and abs(guard.keep - 36 * (0.8 / 3 / 0.01 - 1)) <= 1, guard.keep
    loss = sum(m != PLAIN for m in modes) * 0.4 / len(modes)  # what the steps drafting cost, as a share
    assert loss <= 0.012, loss


def test_a_measurement_ends_early_where_the_modes_are_far_apart():
    guard = Guard(measure=144, block=2, lead=0, measure_min=24, early=0.25)
    seen = measure_once(guard, {PLAIN: 10, PLANNED: 6, ALL: 5})
    assert len(seen) == 24 and guard.mode == PLAIN


def test_a_drafting_mode_far_behind_sits_out_the_next_measurements():
    """Every sequence drafting its k serves a third less than drafting as planned: the next three measurements
    go round plain steps and the plan alone (drafting far behind costs each measurement a third of its steps),
    the fourth measures it again. Plain steps are measured every time."""
    guard = Guard(measure=12, block=2, lead=0, measure_min=12, keep=4, budget=1.0, drop=0.1, sit_out=3)
    rounds = []
    for _ in range(5):
        rounds.append(set(measure_once(guard, {PLAIN: 10, PLANNED: 12, ALL: 8})))
        assert guard.mode == PLANNED
        for _ in range(guard.keep):
            guard.step(PLANNED, 1.0, 12)
    assert rounds == [{PLAIN, PLANNED, ALL}, {PLAIN, PLANNED}, {PLAIN, PLANNED}, {PLAIN, PLANNED},
                      {PLAIN, PLANNED, ALL}], rounds


def test_where_both_drafting_modes_lose_by_far_plain_steps_are_kept_without_measuring_them_alone():
    """Both drafting modes sit out: the measurements they sit out are not run (plain steps against nothing),
    the chosen mode is kept on, and the one after measures every mode again."""
    guard = Guard(measure=12, block=2, lead=0, measure_min=12, keep=4, budget=1.0, drop=0.1, sit_out=2)
    measure_once(guard, {PLAIN: 10, PLANNED: 6, ALL: 6})
    assert guard.mode == PLAIN and guard.keep == 4
    for _ in range(3 * 4):  # three keeps: the first two end in a measurement sat out
        assert not guard.measuring
        guard.step(PLAIN, 1.0, 10)
    assert guard.measuring and guard.mode == ALL


def test_a_record_of_another_mode_while_one_is_kept_is_left_out():
    """The batch hands the guard a step's record two steps late: records of a mode just left, after a choice,
    neither count for the kept mode nor bring the next measurement nearer."""
    guard = Guard(measure=12, block=2, lead=0, measure_min=12, keep=4, budget=1.0)
    measure_once(guard, {PLAIN: 10, PLANNED: 20, ALL: 10})
    assert guard.mode == PLANNED
    for _ in range(10):
        guard.step(ALL, 1.0, 10)
    assert not guard.measuring
    for _ in range(4):
        guard.step(PLANNED, 1.0, 20)
    assert guard.measuring


def test_a_guard_of_one_mode_keeps_it():
    """A batch whose guard may only plan (or only step plain) measures nothing against it."""
    for mode in (PLAIN, PLANNED, ALL):
        guard = Guard(modes=(mode,), measure=4, measure_min=4)
        for _ in range(50):
            assert guard.mode == mode
            guard.step(mode, 1.0, 10)


@pytest.mark.parametrize("kwargs", [dict(budget=0.0), dict(block=0), dict(measure=4, block=2),
                                    dict(measure_min=0), dict(measure=8, measure_min=9), dict(modes=()),
                                    dict(modes=("draft",)), dict(modes=(PLAIN, PLAIN))])
def test_a_guard_refuses_settings_it_cannot_measure_with(kwargs):
    with pytest.raises(ValueError, match="guard"):
        Guard(**kwargs)
