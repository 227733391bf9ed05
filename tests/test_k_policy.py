"""The batched k policy (sessions/k_policy.py) as a pure function of step costs and acceptances."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from rlxrt.sessions.k_policy import Acceptance, DraftCost, Guard, Sequence, StepCost, plan_ks


def earned(s: Sequence, k: int) -> float:
    """1 + a_1 + a_1 a_2 + ... over k drafted tokens (one acceptance for every position, or one per position)."""
    each = [s.acceptance] * k if isinstance(s.acceptance, float) else list(s.acceptance)
    return 1 + sum(float(np.prod(each[:j])) for j in range(1, k + 1))


def rate(cost: StepCost, seqs: list[Sequence], ks: list[int]) -> float:
    earned_all = sum(earned(s, k) for s, k in zip(seqs, ks))
    return earned_all / (cost(sum(1 + k for k in ks)) + sum(k * s.draft_seconds for s, k in zip(seqs, ks)))


def test_step_cost_interpolates_extends_and_learns():
    cost = StepCost({1: 2.0, 8: 3.0, 16: 5.0})
    assert cost(1) == 2.0 and cost(16) == 5.0
    assert cost(4) == pytest.approx(2.0 + 3 / 7)
    assert cost(32) == pytest.approx(9.0)  # along the last segment
    assert cost(0) == 2.0
    cost.observe(8, 6.0)  # a step took 3 s more than the model's (what the shape leaves out)
    assert cost.scale == 1.0 and cost.offset == pytest.approx(0.3)
    assert cost(8) == pytest.approx(3.3) and cost(16) == pytest.approx(5.3) and cost(1) == pytest.approx(2.3)
    for _ in range(100):
        cost.observe(8, 6.0)
    assert cost(16) == pytest.approx(8.0, rel=1e-3)  # a row more costs what the shape says, the step 3 s more
    for _ in range(200):
        cost.observe(8, 1.5)  # half the model's time (start-up measured a busy machine, say)
    assert cost.offset == pytest.approx(0.0, abs=1e-6)
    assert cost(16) == pytest.approx(2.5, rel=1e-3)  # every row count read at the measured scale
    with pytest.raises(ValueError):
        StepCost({})


def test_a_shape_no_step_can_have_is_told_and_mended():
    """Times measured beside other work (two servers calibrating at once, as measured on the 2-core VM) slow
    some sizes and not others: two rows five times one, or 32 rows seven times 16. ``plausible`` says so; a
    StepCost made of them anyway costs no size less than a smaller one, nor more a row."""
    alone = {1: 1.0, 2: 1.05, 4: 1.1, 8: 1.26, 16: 1.82, 32: 2.85}
    assert StepCost.plausible(alone)
    assert not StepCost.plausible({**alone, 2: 5.23, 4: 5.23, 8: 5.23})  # two rows dearer than two steps of one
    assert not StepCost.plausible({**alone, 32: 7.33})
    assert not StepCost.plausible({**alone, 8: 0.8})  # eight rows cheaper than four
    assert StepCost.plausible({**alone, 8: 1.05})  # within the tolerance
    cost = StepCost({**alone, 2: 5.23, 32: 7.33})
    assert cost.seconds == pytest.approx([1.0, 2.0, 2.0, 2.0, 2.0, 4.0])
    assert StepCost(alone).seconds == list(alone.values())


def test_what_steps_take_beyond_the_model_does_not_make_a_row_dearer():
    """Steps that take twice the model's time at the rows they run, through what the shape leaves out, keep a
    drafted row at the shape's slope: 0.3 a row pays here, where the same level read as a scale of every row
    (twice the slope) would not."""
    cost = StepCost({1: 1.0, 4: 1.2, 16: 2.4})
    for _ in range(200):
        cost.observe(4, 2.4)
    assert cost(4) == pytest.approx(2.4) and cost(8) - cost(4) == pytest.approx(0.4)
    assert plan_ks(cost, [Sequence(0.3, 2)] * 4) == [1] * 4
    scaled = StepCost({1: 2.0, 4: 2.4, 16: 4.8})  # the same steps, every row twice as dear
    assert plan_ks(scaled, [Sequence(0.3, 2)] * 4) == [0] * 4


def test_step_cost_counts_the_context_each_row_attends_to():
    """A row costs the shape's slope and what it adds a token of the context it attends to, so rows drafted
    at a long context cost more than the shape measured without one."""
    cost = StepCost({1: 1.0, 8: 1.2, 16: 2.0}, per_row_context=0.001)
    assert cost(8, 0) == pytest.approx(1.2)
    assert cost(16, 100) - cost(8, 100) == pytest.approx(0.8 + 8 * 0.1)
    cost.observe(8, 2.0 * 1.5, context=100)  # 1.5 times the model at 8 rows and 100 tokens
    assert cost.offset == pytest.approx(0.1)
    assert cost(16, 100) - cost(8, 100) == pytest.approx(1.6)  # the rows' cost as modelled, context and all
    cost.observe(8, 2.0 * 0.5, context=100)
    assert cost.scale == pytest.approx(0.95)
    assert cost(16, 100) - cost(8, 100) == pytest.approx(0.95 * 1.6)
    assert StepCost({1: 1.0}, per_row_context=-1.0).per_row_context == 0.0  # timing noise never makes rows cheaper


def test_a_lone_sequence_on_a_flat_step_drafts_what_its_acceptance_pays_for():
    flat = StepCost({1: 1.0, 64: 1.3})  # reading the weights bounds it: a row more is almost free
    assert plan_ks(flat, [Sequence(0.9, 8)]) == [8]
    assert plan_ks(flat, [Sequence(0.9, 3)]) == [3]  # never past its k
    assert plan_ks(flat, [Sequence(0.0, 8)]) == [0]  # nothing accepted: plain steps
    assert plan_ks(flat, [Sequence(0.9, 0)]) == [0]  # no speculator


def test_under_load_drafting_falls_to_what_pays():
    cost = StepCost({1: 1.0, 8: 1.2, 64: 8.0})  # flat to 8 rows, then a row costs ~0.12
    one = plan_ks(cost, [Sequence(0.6, 8)])
    many = plan_ks(cost, [Sequence(0.6, 8)] * 16)
    assert sum(one) >= 3 and max(many) < max(one)
    compute_bound = StepCost({1: 1.0, 2: 2.0})  # every row costs a whole step
    assert plan_ks(compute_bound, [Sequence(0.6, 8)] * 4) == [0] * 4
    assert plan_ks(cost, []) == []


def test_long_contexts_draft_less():
    """Each drafted row attends to its sequence's context: at a long one the same acceptance pays for fewer."""
    cost = StepCost({1: 1.0, 8: 1.2, 64: 8.0}, per_row_context=0.0005)
    seqs = [Sequence(0.9, 8)] * 8
    short, long = plan_ks(cost, seqs, context=10), plan_ks(cost, seqs, context=1000)
    assert sum(long) < sum(short) and sum(short) > 0


def test_acceptance_by_position_prices_every_drafted_token():
    """A source whose first drafted token is accepted half the time and whose later ones almost always are when
    it is (lookup, a head: positions 2-4 accept more than position 1 does): one value, the first position's,
    prices the third token at 0.5^3 and stops at one; the estimate by position drafts all three."""
    cost = StepCost({1: 1.0, 2: 1.25, 8: 2.75})  # a row costs a quarter of a step
    estimate = Acceptance(prior=0.5, decay=0.9, drift=0.06, weight=1.0)
    for _ in range(40):  # rejected at once, or kept whole
        estimate.observe(3, 0)
        estimate.observe(3, 3)
    first, second, third = estimate.values(3)
    assert 0.4 < first < 0.6 and second > 0.9 and third > 0.9
    assert plan_ks(cost, [Sequence(first, 3)]) == [1]
    assert plan_ks(cost, [Sequence(estimate.values(3), 3)]) == [3]
    assert plan_ks(cost, [Sequence((first, 0.0), 3)]) == [1]  # past what it knows, the last position holds


def test_an_acceptance_estimate_starts_from_its_prior_and_drifts_back_to_it():
    estimate = Acceptance(prior=0.5, decay=0.9, drift=0.06, weight=1.0)
    assert estimate.values(3) == (0.5, 0.5, 0.5) and estimate.first == 0.5
    for _ in range(30):
        estimate.observe(1, 1)  # only the first position is ever reached
    first, second = estimate.values(2)
    assert first > 0.9 and second == pytest.approx(first)  # a position not reached looks like the one before
    for _ in range(35):  # rounds without this source's drafts: half-way back to the prior
        estimate.drift()
    assert 0.6 < estimate.first < 0.8
    for _ in range(500):
        estimate.drift()
    assert estimate.first == pytest.approx(0.5, abs=0.01)


def test_an_acceptance_with_a_base_starts_from_it_forgets_into_it_and_drifts_back_to_it():
    """A slot's estimate over the batch's (its base): a new request starts from what the source does in the
    batch, position by position; its own rounds move it; a new text forgets them; not drafting drifts back to
    the base, not to a constant."""
    base = Acceptance(prior=0.5, decay=0.98, drift=0.0)
    for _ in range(50):
        base.observe(3, 3)  # the batch's rounds: all three kept
    assert base.values(3)[0] > 0.95
    estimate = Acceptance(prior=0.5, decay=0.9, drift=0.06, weight=1.0, base=base)
    assert estimate.values(3) == base.values(3)
    for _ in range(30):
        estimate.observe(3, 0)  # this text: its first draft is rejected every time
    assert estimate.first < 0.1 and estimate.values(2)[1] == pytest.approx(base.values(2)[1])  # never reached
    for _ in range(500):
        estimate.drift()
    assert estimate.first == pytest.approx(base.first, abs=0.01)
    estimate.observe(3, 0)
    estimate.clear()
    assert estimate.values(3) == base.values(3)


def test_expensive_drafts_draft_less():
    cost = StepCost({1: 1.0, 64: 1.5})
    cheap, dear = plan_ks(cost, [Sequence(0.7, 8, 0.0), Sequence(0.7, 8, 0.5)])
    assert cheap > dear


@pytest.mark.parametrize("seed", range(20))
def test_the_plan_has_the_best_rate_of_every_choice(seed):
    """Against exhaustive search over k <= 4 for three sequences, on random convex step costs."""
    rng = np.random.default_rng(seed)
    base, knee, slope = rng.uniform(0.5, 2), int(rng.integers(1, 12)), rng.uniform(0.01, 1.0)
    cost = StepCost({r: base + slope * max(0, r - knee) for r in (1, knee, knee + 1, 16)})
    seqs = [Sequence(float(rng.uniform(0, 1)), int(rng.integers(0, 5)), float(rng.uniform(0, 0.2)))
            for _ in range(3)]
    if seed % 2:  # an acceptance per position, as a batch's slots estimate it
        seqs = [Sequence(tuple(float(a) for a in rng.uniform(0, 1, 4)), s.k_max, s.draft_seconds) for s in seqs]
    ks = plan_ks(cost, seqs)
    best = max(rate(cost, seqs, list(c)) for c in itertools.product(*(range(s.k_max + 1) for s in seqs)))
    assert all(0 <= k <= s.k_max for k, s in zip(ks, seqs))
    assert rate(cost, seqs, ks) >= best * (1 - 1e-9)


@pytest.mark.parametrize("drafting_pays", [True, False])
def test_the_guard_keeps_the_mode_that_serves_more(drafting_pays):
    """Windows of steps in each mode at a measured rate: the guard drafts in the better mode most of the time,
    and follows when the better mode changes."""
    guard = Guard(window=4, explore=4)
    chosen = []

    def run(steps, pays):
        for _ in range(steps):
            mode = guard.drafting
            rate = 12.0 if mode == pays else 10.0  # tokens a second of the mode it is in
            chosen.append(mode)
            guard.step(mode, 1.0, int(rate))

    run(400, drafting_pays)
    share = sum(c == drafting_pays for c in chosen[40:]) / len(chosen[40:])
    assert share >= 0.7, share
    chosen.clear()
    run(400, not drafting_pays)  # the workload changed: the other mode pays now
    share = sum(c != drafting_pays for c in chosen[80:]) / len(chosen[80:])
    assert share >= 0.7, share


@pytest.mark.parametrize("gain, drafts", [(1.05, False), (1.08, True)])
def test_a_near_tie_goes_to_plain_steps(gain, drafts):
    """Drafting windows that serve 5 % more than plain ones are within the guard's margin (``k_policy.MARGIN``,
    6 %): the guard keeps plain steps, since what drafting costs outside the steps counted is not measured and the
    goal is never to serve less than them; 8 % more is beyond it, and the guard drafts."""
    guard = Guard(window=4, explore=4, settle=0)
    modes = []
    for _ in range(4 * 100):
        modes.append(guard.drafting)
        guard.step(guard.drafting, 1.0, 100 * (gain if guard.drafting else 1.0))
    share = sum(modes[40:]) / len(modes[40:])
    assert (share >= 0.8) if drafts else (share <= 0.2), share


def test_a_settled_choice_is_tried_less_and_less_often_and_a_change_is_still_followed():
    """Each try of the worse mode that confirms the choice doubles the windows before the next (a try costs
    what the worse mode loses), up to explore_max; once the other mode pays more, the first try finds it and
    the guard keeps it. (A budget of the whole rate leaves the spacing to doubling alone.)"""
    guard = Guard(window=4, explore=4, settle=0, explore_max=16, budget=1.0)
    windows = []

    def run(steps, pays):
        for _ in range(steps):
            mode = guard.drafting
            windows.append(mode)
            guard.step(mode, 1.0, 12 if mode == pays else 10)

    run(4 * 200, True)
    tries = [i for i in range(4, len(windows), 4) if not windows[i] and windows[i - 4]]
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert gaps[:3] == [4 * 5, 4 * 9, 4 * 17] and set(gaps[2:]) == {4 * 17}, gaps  # 4, 8, 16, 16, ... kept windows
    assert sum(not w for w in windows[400:]) / len(windows[400:]) <= 1 / 16
    assert guard.explore == 16
    windows.clear()
    run(4 * 60, False)  # the other mode pays now: found by the next try (at most 16 windows on), tried again
    first = windows.index(False)  # at once, then kept
    assert first <= 4 * 17 and windows[first:first + 20:4] == [False, True, False, True, False], windows
    close = first + 12  # the window after the second try, in the mode it leaves
    tries = [i for i in range(close + 4, len(windows), 4) if windows[i]]  # drafting is now the one tried
    assert [b - a for a, b in zip([close] + tries, tries)][:3] == [4 * 5, 4 * 9, 4 * 17], windows


def test_tries_of_a_mode_that_loses_by_far_are_spaced_by_what_they_lose():
    """Plain steps serve 10 tokens a second and drafting 6 (a small pair under load): each try of drafting
    costs 40 % of a window, so after the first that confirms plain steps the next comes 38 windows on (a 1 %
    budget), not 8, and the worse mode's share of the windows stays near 1/40. Where drafting then pays, the
    next try finds it and the guard switches."""
    guard = Guard(window=4, explore=4, settle=0, explore_max=16, explore_far=64, budget=0.01)
    windows = []

    def run(steps, plain_rate, drafting_rate):
        for _ in range(steps):
            mode = guard.drafting
            windows.append(mode)
            guard.step(mode, 1.0, drafting_rate if mode else plain_rate)

    run(4 * 300, 10, 6)
    tries = [i for i in range(4, len(windows), 4) if windows[i] and not windows[i - 4]]
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert windows[4 * 5] and set(gaps) == {4 * 39}, gaps  # the first try after 4 kept windows, then 38 and its close
    assert guard.explore == 38
    assert sum(windows[400:]) / len(windows[400:]) <= 1 / 30
    windows.clear()
    run(4 * 60, 10, 14)  # drafting pays now: the next try (at most 38 windows on) finds it, and again at once
    assert windows.index(True) <= 4 * 40 and guard.drafting


def test_a_guard_refuses_a_budget_that_is_not_a_share_above_zero():
    with pytest.raises(ValueError, match="above 0"):
        Guard(budget=0.0)


def test_a_try_is_judged_against_the_windows_around_it_not_a_rate_measured_long_before():
    """Drafting serves 8 % more than plain steps all along, while the machine slows by half every 60 windows:
    each try of plain steps is compared with drafting measured just before and after it, so the guard keeps
    drafting. (A guard that compared drafting's fresh rate with plain steps' rate measured at the last try, up
    to 16 windows before, found the machine's slowing there and switched.)"""
    guard = Guard(window=4, explore=4, settle=0)
    windows = []
    for step in range(4 * 200):
        speed = 0.5 ** (step / (4 * 60))
        windows.append(guard.drafting)
        guard.step(guard.drafting, 1.0, 100 * speed * (1.08 if guard.drafting else 1.0))
    kept = windows[40::4]
    assert sum(kept) / len(kept) >= 0.85, "".join("d" if w else "." for w in windows[::4])


def test_one_lucky_try_does_not_switch_two_in_a_row_do():
    """Drafting serves 12 tokens a second and plain steps 10, but the first try of plain steps after the start
    measures 20: the guard tries them again at once, finds 10, and keeps drafting. Later plain steps serve 20
    in every window: two tries in a row find them better, and it switches."""
    guard = Guard(window=2, explore=2, settle=0)
    modes = []

    def window(plain_rate):
        mode = guard.drafting
        modes.append(mode)
        for _ in range(2):
            guard.step(mode, 1.0, 12 if mode else plain_rate)

    for _ in range(3):  # the first window of each mode, then drafting kept
        window(10)
    assert modes == [True, False, True]
    window(10)  # kept: the next window tries plain steps
    window(20)  # the lucky try, then the window that closes it, then plain tried again at once
    window(10)
    window(10)
    window(10)
    assert modes[3:] == [True, False, True, False, True] and guard.drafting
    for _ in range(8):
        window(20)
    assert modes[8:14] == [True, False, True, False, True, False] and not guard.drafting  # kept, two tries, plain


def test_a_window_leaves_out_its_slowest_step():
    """A window's rate is that of its steps but the one of the lowest rate (a request arriving, the machine): one
    slow step does not decide a choice, which otherwise follows where such steps fall."""
    guard = Guard(window=4, explore=4, settle=0)
    for seconds in (1.0, 1.0, 10.0, 1.0):
        guard.step(True, seconds, 10)
    assert guard.rates[True] == 10.0
    for seconds, tokens in ((1.0, 8), (1.0, 8), (1.0, 0), (1.0, 8)):  # a step whose tokens came late
        guard.step(False, seconds, tokens)
    assert guard.rates[False] == 8.0


def test_a_step_record_of_the_mode_before_a_switch_counts_for_that_mode():
    """The batch hands the guard a step's record one step late (its tokens are reported after it): a record of
    the mode just left goes to that mode, not to the window now running."""
    guard = Guard(window=2, explore=4, settle=0)
    guard.step(True, 1.0, 20)
    guard.step(True, 1.0, 20)  # a window of drafting at 20 tok/s: the other mode is measured next
    assert guard.drafting is False and guard.rates[True] == 20.0
    guard.step(True, 1.0, 0)  # late record of the drafting mode: not the plain window's
    guard.step(False, 1.0, 10)
    guard.step(False, 1.0, 10)
    assert guard.rates[False] == 10.0 and guard.drafting is True


def test_overhead_between_steps_makes_drafting_pay():
    """Seconds every step waits besides its run are paid whatever is drafted, so a drafted token that costs a
    little row is worth it where the step alone would not be."""
    cost = StepCost({1: 1.0, 16: 2.5})  # 0.1 s a row
    assert plan_ks(cost, [Sequence(0.3, 1)] * 4) == [0] * 4
    assert plan_ks(cost, [Sequence(0.3, 1)] * 4, overhead=2.0) == [1] * 4


def test_draft_cost_is_what_drafting_adds_to_the_gap_between_steps():
    waits = DraftCost(window=5)
    assert waits.per_token("mtp") == 0.0 and waits.overhead == 0.0  # nothing measured: drafting planned as alone
    for gap in (0.010, 0.011, 0.5, 0.009, 0.010):  # one gap stretched by something else: the median holds
        waits.observe(gap)
    for gap, drafted in ((0.030, 10), (0.050, 20), (0.019, 4)):
        waits.observe(gap, {"mtp": (drafted, 0.001)})
    assert waits.overhead == pytest.approx(0.010)
    assert waits.per_token("mtp") == pytest.approx(0.002)
    assert waits.per_token("prompt-lookup") == 0.0


def test_a_gap_with_drafts_of_several_sources_is_shared_by_their_own_drafting_time():
    """Lookup's drafts took 1 % of the sequences' drafting time, the head's 99 %: what the gap grew by is the
    head's, nearly all of it, however many tokens lookup drafted."""
    waits = DraftCost(window=5)
    waits.observe(0.010)
    waits.observe(0.030, {"prompt-lookup": (10, 0.0001), "mtp": (5, 0.0099)})
    assert waits.per_token("mtp") == pytest.approx(0.020 * 0.99 / 5)
    assert waits.per_token("prompt-lookup") == pytest.approx(0.020 * 0.01 / 10)
    waits.observe(0.030, {"prompt-lookup": (10, 0.0), "mtp": (5, 0.0)})  # no time measured: shared by tokens
    assert waits.drafting["mtp"][-1] == pytest.approx(0.020 / 15)


def test_under_load_a_dear_and_less_accepted_source_stops_first():
    """A Cascade's two sources per sequence: lookup (accepted 0.95, drafts a third of the rounds, free) and a head
    (accepted 0.5, the other rounds, a little dear). Alone both draft; with 16 sequences on a step past its flat
    part the head stops and lookup goes on."""
    cost = StepCost({1: 1.0, 8: 1.2, 64: 8.0})

    def sources():
        return [Sequence(0.95, 4, 0.0, 1 / 3), Sequence(0.5, 4, 0.02, 2 / 3)]

    alone = plan_ks(cost, sources(), slots=1)
    assert alone[0] >= 3 and alone[1] >= 1
    many = plan_ks(cost, sources() * 16, slots=16)
    lookup, head = many[0::2], many[1::2]
    assert max(head) == 0 and min(lookup) >= 1


def test_a_source_that_has_not_drafted_for_a_while_is_still_asked():
    """Its chance estimate fell to nothing, but a k of 0 would never measure it again: it is planned as if
    it drafted at a small chance."""
    flat = StepCost({1: 1.0, 64: 1.3})
    assert plan_ks(flat, [Sequence(0.9, 4, 0.0, 0.0), Sequence(0.5, 4, 0.0, 1.0)], slots=1)[0] == 4


@pytest.mark.parametrize("seed", range(20))
def test_the_plan_with_chances_is_near_the_best_rate_of_every_choice(seed):
    """Two sources per sequence with chances: the plan's expected rate against exhaustive search over
    k <= 3 for each of four sources (rows weighed by chance make it a knapsack, so near, not exact)."""
    rng = np.random.default_rng(100 + seed)
    base, knee, slope = rng.uniform(0.5, 2), int(rng.integers(1, 8)), rng.uniform(0.01, 1.0)
    cost = StepCost({r: base + slope * max(0, r - knee) for r in (1, knee, knee + 1, 16)})
    seqs = []
    for _ in range(2):
        first = float(rng.uniform(0, 1))
        seqs += [Sequence(float(rng.uniform(0, 1)), 3, float(rng.uniform(0, 0.2)), first),
                 Sequence(float(rng.uniform(0, 1)), 3, float(rng.uniform(0, 0.2)), 1 - first)]

    def expected(ks):
        earned = 2 + sum(s.chance * sum(s.acceptance ** j for j in range(1, k + 1)) for s, k in zip(seqs, ks))
        rows = sum(s.chance * k for s, k in zip(seqs, ks))
        lo = int(rows)
        t = cost(2 + lo) + (rows - lo) * (cost(3 + lo) - cost(2 + lo))
        return earned / (t + sum(s.chance * k * s.draft_seconds for s, k in zip(seqs, ks)))

    ks = plan_ks(cost, seqs, slots=2)
    best = max(expected(list(c)) for c in itertools.product(range(4), repeat=4))
    assert expected(ks) >= best * 0.95


def test_the_first_step_after_a_switch_does_not_count():
    """A speculator catches up on what it did not read while the other mode ran: the first step after a switch
    pays that once, and is left out of the new mode's window."""
    guard = Guard(window=2, explore=4, settle=1)
    guard.step(True, 1.0, 20)
    guard.step(True, 1.0, 20)
    assert guard.drafting is False
    guard.step(False, 1.0, 10)
    guard.step(False, 1.0, 10)
    assert guard.rates[False] is None  # one of its two steps was the settling one
    guard.step(False, 1.0, 10)
    assert guard.rates[False] == 10.0 and guard.drafting is True
    guard.step(True, 5.0, 20)  # the catch-up step of drafting again: not counted
    guard.step(True, 1.0, 20)
    guard.step(True, 1.0, 20)
    assert guard.rates[True] == 20.0


def test_a_drafting_cost_not_measured_for_long_is_forgotten():
    """The plan drafts from a source again after a long run of gaps without its drafts (plain ones, or another
    source's), and measures its cost anew."""
    waits = DraftCost(window=4, stale=3)
    waits.observe(0.02, {"mtp": (2, 0.001)})
    assert waits.per_token("mtp") == pytest.approx(0.01)
    waits.observe(0.0)
    waits.observe(0.01, {"prompt-lookup": (4, 0.0001)})
    assert waits.per_token("mtp") == pytest.approx(0.01)
    waits.observe(0.0)
    assert waits.per_token("mtp") == 0.0
    assert waits.per_token("prompt-lookup") == pytest.approx(0.0025)


def test_a_source_that_keeps_not_paying_is_tried_less_and_less_often():
    """Each forgetting that is followed by few drafts doubles the wait before the next (a try costs a burst of
    drafting at no cost, and a catch-up); a source that drafts for long again starts over."""
    waits = DraftCost(window=2, stale=3, stale_max=12)

    def forgotten_after(source: str) -> int:
        waits.observe(0.02, {source: (2, 0.001)})  # drafted once (the try), then never again
        gaps = 0
        while waits.per_token(source) > 0.0:
            waits.observe(0.0)
            gaps += 1
        return gaps

    assert [forgotten_after("draft-model") for _ in range(4)] == [3, 6, 12, 12]
    for _ in range(3):  # a source that pays drafts in gap after gap
        waits.observe(0.02, {"draft-model": (2, 0.001)})
    assert forgotten_after("draft-model") == 3
    assert waits.interval("mtp") == 3  # each source its own
