"""Session behaviour on tiny onnx.helper graphs with known distributions (no torch)."""
import numpy as np
import pytest
from scipy.stats import chisquare

from bigram import make_bigram_model, rolled_table
from rlxrt import Config, GenerationError, ModelFormatError
from rlxrt.sessions import DraftModel, PromptLookup, Session
from rlxrt.sampling import SamplingParams, make_rng
from rlxrt.sessions.prompt_lookup import lookup

V = 5
P = rolled_table([8, 4, 2, 1, 0.5], V)       # target
Q = rolled_table([0.5, 1, 2, 4, 8], V)       # draft with the opposite skew
CFG = Config(intra_op_threads=1, cache=False)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("bigram")
    return make_bigram_model(root / "target", P), make_bigram_model(root / "draft", Q)


def joint_pvalue(session, draws, k=None):
    joint = np.zeros((V, V))
    for seed in range(draws):
        g = session.generate([0], max_new_tokens=2, temperature=1.0, seed=seed, k=k)
        a, b = g.token_ids
        joint[a, b] += 1
    expected = draws * P[0][:, None] * P
    return chisquare(joint.ravel(), expected.ravel()).pvalue


@pytest.mark.parametrize("spec", ["draft", "lookup"])
def test_sampled_sequences_follow_the_target(pair, spec):
    target, draft = pair
    speculator = DraftModel(draft, CFG) if spec == "draft" else PromptLookup(min_n=1, max_n=1)
    s = Session(target, speculator, CFG, k=2)
    assert joint_pvalue(s, 20_000) > 1e-3
    if spec == "draft":
        assert 0 < s.stats.acceptance_rate < 1  # both the accepted and the recovered paths were used


def test_a_chain_ended_below_min_prob_keeps_sampling_exact(tmp_path):
    """A draft whose rows after odd tokens are flat (likeliest 0.24) and after even ones skewed (0.52): with
    ``min_prob=0.4`` its chain ends after a drafted odd token and goes on after an even one. The first
    three tokens still follow the target's joint distribution. (Ending on the drawn token's own
    probability instead fails this test: kept tokens would then come from q restricted, not from q.)"""
    flat = np.array([0.24, 0.19, 0.19, 0.19, 0.19])
    q = np.array([Q[i] if i % 2 == 0 else np.roll(flat, i) for i in range(V)])
    target = make_bigram_model(tmp_path / "target", P)
    s = Session(target, DraftModel(make_bigram_model(tmp_path / "draft", q), CFG, min_prob=0.4), CFG, k=3)
    draws, joint = 20_000, np.zeros((V, V, V))
    for seed in range(draws):
        a, b, c = s.generate([0], max_new_tokens=3, temperature=1.0, seed=seed).token_ids
        joint[a, b, c] += 1
    expected = (draws * P[0][:, None, None] * P[:, :, None] * P[None, :, :]).ravel()
    big = expected >= 5
    obs, exp = np.append(joint.ravel()[big], joint.ravel()[~big].sum()), np.append(expected[big], expected[~big].sum())
    assert chisquare(obs, exp).pvalue > 1e-3
    d = s.stats.drafted_per_position
    assert 0 < d[1] < 0.8 * d[0]  # the chain ended early in some rounds, not in all


@pytest.mark.parametrize("min_prob, per_round", [(0.6, 1), (0.5, 3)])
def test_greedy_with_min_prob_drafts_fewer_tokens_and_stays_exact(pair, min_prob, per_round):
    target, draft = pair  # Q gives its likeliest token 0.52: below 0.6 every chain ends after one token
    plain = Session(target, None, CFG).generate([2], max_new_tokens=30).token_ids
    g = Session(target, DraftModel(draft, CFG, min_prob=min_prob), CFG, k=3).generate([2], max_new_tokens=30)
    assert g.token_ids == plain
    always = Session(target, DraftModel(draft, CFG), CFG, k=3).generate([2], max_new_tokens=30).stats
    d = g.stats.drafted_per_position
    assert d == (always.drafted_per_position if per_round == 3 else [always.drafted_per_position[0]])


@pytest.mark.parametrize("min_prob", [1.0, -0.1, float("nan"), "0.3", True])
def test_bad_min_prob_is_a_typed_error(pair, min_prob):
    with pytest.raises(GenerationError, match="min_prob"):
        DraftModel(pair[1], CFG, min_prob=min_prob)


def test_sampled_plain_follows_the_target(pair):
    assert joint_pvalue(Session(pair[0], None, CFG), 10_000) > 1e-3


def test_same_seed_same_output(pair):
    s = Session(pair[0], DraftModel(pair[1], CFG), CFG, k=3)
    a = s.generate([1, 2], max_new_tokens=20, temperature=0.9, seed=5).token_ids
    b = s.generate([1, 2], max_new_tokens=20, temperature=0.9, seed=5).token_ids
    c = s.generate([1, 2], max_new_tokens=20, temperature=0.9, seed=6).token_ids
    assert a == b and len(a) == 20 and a != c


def test_stats_identities(pair):
    s = Session(pair[0], DraftModel(pair[1], CFG), CFG, k=4)
    g = s.generate([0, 1], max_new_tokens=40, temperature=1.0, seed=0)
    st = g.stats
    assert st.emitted == len(g.token_ids) == 40
    assert st.drafted == sum(st.drafted_per_position) and st.accepted == sum(st.accepted_per_position)
    assert st.emitted == st.accepted + st.rounds  # no stop condition cut a round short here
    assert len(st.drafted_per_position) == 4 and st.drafted_per_position[0] <= st.rounds
    assert all(a <= d for a, d in zip(st.accepted_per_position, st.drafted_per_position))
    assert all(x >= y for x, y in zip(st.accepted_per_position, st.accepted_per_position[1:]))
    assert st.decode_seconds >= st.draft_seconds + st.target_seconds - 1e-9
    assert 0 <= st.python_overhead_share <= 1 and st.tokens_per_second > 0
    assert st.providers == {"target": ["cpu"], "draft": ["cpu"]}
    total_before = s.stats.emitted
    s.generate([0], max_new_tokens=5)
    assert s.stats.emitted == total_before + 5  # session totals accumulate


def test_plain_rounds_emit_one_token(pair):
    g = Session(pair[0], None, CFG).generate([0], max_new_tokens=7)
    assert g.stats.rounds == 7 and g.stats.drafted == 0 and g.stats.tokens_per_round == 1.0


def test_eos_and_stop_token_ids(tmp_path):
    table = rolled_table([0, 1, 0, 0, 0], V)  # deterministic: next = prev + 1 (mod V)
    m = make_bigram_model(tmp_path / "m", table, eos=[4])
    s = Session(m, PromptLookup(), CFG)
    g = s.generate([0], max_new_tokens=10)
    assert g.token_ids == [1, 2, 3, 4] and g.finish_reason == "stop" and g.stop_reason == 4
    g = s.generate([0], max_new_tokens=10, stop_token_ids=[2])
    assert g.token_ids == [1, 2] and g.stop_reason == 2
    g = s.generate([0], max_new_tokens=10, ignore_eos=True)
    assert g.token_ids == [1, 2, 3, 4, 0, 1, 2, 3, 4, 0] and g.finish_reason == "length"
    # prompt lookup drafts the repeated cycle: a whole accepted run is cut at EOS
    g = s.generate([0, 1, 2, 3, 4, 0, 1], max_new_tokens=10)
    assert g.token_ids == [2, 3, 4] and g.stats.accepted > 0


def test_max_positions_stops_with_length(tmp_path):
    m = make_bigram_model(tmp_path / "m", P, max_positions=12)
    s = Session(m, DraftModel(m, CFG), CFG, k=8)
    g = s.generate([0] * 8, max_new_tokens=50, temperature=1.0, seed=1)
    assert len(g.token_ids) == 4 and g.finish_reason == "length"
    with pytest.raises(GenerationError, match="12 tokens.*max positions are 12"):
        s.generate([0] * 12, max_new_tokens=1)


@pytest.mark.parametrize("kwargs, words", [
    ({"k": 0}, "k .* 1..32"), ({"k": 33}, "k .* 1..32"),
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.1}, "top_p"),
    ({"prompt": []}, "empty"), ({"prompt": [0, 9]}, "token id 9.*0..4"), ({"prompt": "text"}, "tokenizer"),
    ({"max_new_tokens": 0}, "max_new_tokens"), ({"stop": ["x"]}, "stop strings need a tokenizer"),
    ({"stop_token_ids": [77]}, "stop_token_ids.*77"), ({"seed": -1}, "seed"), ({"prompt": 3}, "prompt must be"),
])
def test_bad_requests_leave_the_session_usable(pair, kwargs, words):
    s = Session(pair[0], DraftModel(pair[1], CFG), CFG, k=2)
    before = s.generate([0, 1], max_new_tokens=6, temperature=1.0, seed=3).token_ids
    args = {"prompt": [0, 1], "max_new_tokens": 6, **kwargs}
    with pytest.raises(GenerationError, match=words):
        s.generate(**args)
    assert s.generate([0, 1], max_new_tokens=6, temperature=1.0, seed=3).token_ids == before


@pytest.mark.parametrize("k", [0, 33, -1, 2.5])
def test_bad_session_k(pair, k):
    with pytest.raises(GenerationError, match="1..32"):
        Session(pair[0], PromptLookup(), CFG, k=k)


def test_vocab_mismatch_names_both_sizes(pair, tmp_path):
    other = make_bigram_model(tmp_path / "v7", rolled_table([1, 2, 3, 4, 5, 6, 7], 7))
    with pytest.raises(GenerationError, match="target has 5 tokens, draft has 7"):
        Session(pair[0], DraftModel(other, CFG), CFG)


def test_bare_onnx_file_is_refused(pair):
    with pytest.raises(ModelFormatError, match="rlxrt.json"):
        Session(pair[0] / "model.onnx", None, CFG)


def test_failed_run_mid_request_is_typed_and_recoverable(pair):
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail

    s = Session(pair[0], None, CFG)
    want = s.generate([0], max_new_tokens=3).token_ids
    real = s.target._session_run
    s.target._session_run = lambda *a: (_ for _ in ()).throw(Fail("device lost"))
    with pytest.raises(GenerationError, match="device lost"):
        s.generate([0], max_new_tokens=3)
    assert s.last.finish_reason == "error"
    s.target._session_run = real
    assert s.generate([0], max_new_tokens=3).token_ids == want


def test_a_bug_is_not_disguised_as_a_generation_error(pair):
    """Only ONNX Runtime's failures become GenerationError; anything else propagates as what it is."""
    s = Session(pair[0], None, CFG)
    want = s.generate([0], max_new_tokens=3).token_ids
    real = s.target._session_run
    s.target._session_run = lambda *a: (_ for _ in ()).throw(KeyError("oops"))
    with pytest.raises(KeyError):
        s.generate([0], max_new_tokens=3)
    s.target._session_run = real
    assert s.generate([0], max_new_tokens=3).token_ids == want


@pytest.mark.parametrize("tokens, k, want", [
    ([1, 2, 3, 9, 1, 2], 3, [3, 9, 1]),        # longest suffix [1, 2] seen before
    ([1, 2, 3, 1, 2, 4, 1, 2], 2, [4, 1]),     # most recent occurrence wins
    ([5, 6, 7], 3, []),                        # nothing repeats
    ([4, 4, 4, 4], 3, [4]),                    # n-gram [4,4,4] at 0 is followed by one token
])
def test_lookup(tokens, k, want):
    assert lookup(np.array(tokens), k, 1, 3).tolist() == want


def _lookup_brute_force(tokens, k, min_n, max_n):
    """The definition, spelled out: longest n first, then the most recent earlier occurrence."""
    tokens = list(tokens)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for start in range(len(tokens) - 1 - n, -1, -1):
            if tokens[start:start + n] == tokens[len(tokens) - n:]:
                return tokens[start + n:start + n + k]
    return []


def test_lookup_matches_its_definition_on_random_sequences():
    rng = np.random.default_rng(0)
    for _ in range(3000):
        tokens = rng.integers(0, int(rng.integers(1, 6)), int(rng.integers(0, 30)))
        k, min_n = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        max_n = int(rng.integers(min_n, 5))
        assert lookup(tokens, k, min_n, max_n).tolist() == _lookup_brute_force(tokens, k, min_n, max_n)


def test_prompt_lookup_follows_a_growing_context_across_requests():
    from rlxrt.speculator import Context

    pl = PromptLookup(k=3)
    ctx = Context(tokens=[1, 2, 3, 9, 1, 2], params=SamplingParams(), rng=make_rng(0))
    assert pl.propose(ctx, 3).tokens.tolist() == [3, 9, 1]
    ctx.tokens += [3] + list(range(10, 400)) + [1, 2]  # grows past the buffer
    assert pl.propose(ctx, 3).tokens.tolist() == [3, 10, 11]
    pl.reset()
    ctx = Context(tokens=[7, 8, 7], params=SamplingParams(), rng=make_rng(0))
    assert pl.propose(ctx, 2).tokens.tolist() == [8, 7]


@pytest.mark.parametrize("t", [1e-38, 1e-45, 1e-300])
def test_tiny_temperature_generates_the_greedy_output(pair, t):
    greedy = Session(pair[0], None, CFG).generate([0], max_new_tokens=12).token_ids
    for spec in (None, DraftModel(pair[1], CFG), PromptLookup()):
        g = Session(pair[0], spec, CFG, k=2).generate([0], max_new_tokens=12, temperature=t, seed=5)
        assert g.token_ids == greedy


class _Greedy(PromptLookup):
    """A speculator that proposes ``extra`` more tokens than it was asked for."""

    def __init__(self, extra: int):
        super().__init__()
        self.extra = extra

    def propose(self, ctx, k):
        from rlxrt.speculator import DraftProposal

        return DraftProposal(np.zeros(k + self.extra, np.int64))


@pytest.mark.parametrize("max_new", [2, 5, 30])
def test_a_speculator_that_proposes_more_than_k_is_refused_and_never_overruns(pair, max_new):
    """A custom speculator that ignores k would make a request emit more than max_new_tokens: the round is
    refused with a typed error naming the speculator, nothing beyond the budget is emitted, and the session
    serves the next request. (With one token left a round asks for no draft at all.)"""
    target, _ = pair
    s = Session(target, _Greedy(extra=1), CFG, k=3)
    assert len(s.generate([0], max_new_tokens=1).token_ids) == 1
    with s.stream([0], max_new_tokens=max_new) as stream:
        with pytest.raises(GenerationError, match="_Greedy proposed .* at most .*must return at most k"):
            for _ in stream:
                pass
    assert len(stream.generation.token_ids) <= max_new and stream.generation.finish_reason == "error"
    s.speculator.extra = 0
    assert len(s.generate([0], max_new_tokens=max_new).token_ids) == max_new
