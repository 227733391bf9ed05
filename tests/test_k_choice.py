"""The adaptive k rule on made-up rounds: it follows what drafting and verifying cost and earn."""
from rlxrt.sessions.k_choice import KChoice

MS = 1e-3


def feed(choice, rounds, accept, draft_ms, verify_ms):
    """Rounds drafting the current k; ``accept(k)`` how many are accepted, ``verify_ms(rows)`` a verify."""
    for _ in range(rounds):
        k = choice.k
        choice.observe(k, accept(k), k * draft_ms * MS, verify_ms(k + 1) * MS)
    return choice.k


def test_all_accepted_free_drafts_and_flat_verify_go_to_k_max():
    assert feed(KChoice(2, 8), 100, lambda k: k, 0.0, lambda r: 10.0) == 8


def test_nothing_accepted_goes_to_one():
    assert feed(KChoice(4, 8), 100, lambda k: 0, 0.1, lambda r: 10.0) == 1


def test_rows_that_cost_more_keep_k_small():
    """Half of each position accepted: cheap rows make k=4 pay, rows at 40 % of a step each do not."""
    half = [1, 0]

    def accept(k):  # alternate: all k accepted, then none
        half.reverse()
        return k if half[0] else 0

    flat = feed(KChoice(2, 8), 200, accept, 0.0, lambda r: 10.0 * (1 + 0.01 * (r - 1)))
    steep = feed(KChoice(2, 8), 200, accept, 0.0, lambda r: 10.0 * (1 + 0.4 * (r - 1)))
    assert flat > steep and steep == 1


def test_an_unmeasured_row_count_is_extrapolated_and_interpolated():
    c = KChoice(2, 8)
    assert c.verify_cost(3) is None
    c.observe(2, 2, 0.0, 10 * MS)  # 3 rows
    assert abs(c.verify_cost(5) - 10 * MS * (1 + 0.05 * 2)) < 1e-12  # one call seen: 5 % a row
    c.observe(6, 6, 0.0, 14 * MS)  # 7 rows
    assert abs(c.verify_cost(5) - 12 * MS) < 1e-12  # between two
    assert abs(c.verify_cost(9) - 16 * MS) < 1e-12  # along the last two: 1 ms a row
