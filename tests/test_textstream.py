import pytest

from rlxrt.textstream import TextStream


def run(pieces, stops):
    it = iter(pieces)
    ts = TextStream(lambda _t: next(it), stops)
    out = []
    for i in range(len(pieces)):
        out.append(ts.push(i))
        if ts.stop is not None:
            break
    else:
        out.append(ts.finish())
    return "".join(out), ts


@pytest.mark.parametrize("pieces, stops, text, stop, keep", [
    (["ab", "c", "de"], [], "abcde", None, None),
    (["ab", "c", "de"], ["cd"], "ab", "cd", 3),          # spans two tokens
    (["ab", "c", "de"], ["b"], "a", "b", 1),             # inside the first token
    (["ab", None, "cX", "Y"], ["XY"], "abc", "XY", 4),   # a held-back multi-byte step (None) in between
    (["x", "y"], ["yz"], "xy", None, None),              # a prefix of a stop string that never completes
    (["a", "bc", "d"], ["zz", "cd"], "ab", "cd", 3),
    (["aXb", "Y"], ["X", "bY"], "a", "X", 1),            # the earliest match wins
])
def test_stop_strings(pieces, stops, text, stop, keep):
    got, ts = run(pieces, stops)
    assert (got, ts.stop, ts.keep_tokens) == (text, stop, keep)


def test_pieces_are_held_back_only_while_they_could_start_a_stop():
    it = iter(["ab", "E", "x"])
    ts = TextStream(lambda _t: next(it), ["END"])
    assert ts.push(0) == "ab"
    assert ts.push(1) == ""      # "E" could start "END"
    assert ts.push(2) == "Ex"    # not any more
    assert ts.finish() == ""
