import numpy as np
import pytest

from rlxrt import GenerationError
from rlxrt.sampling import SamplingParams, make_rng, probs, sample


def test_greedy_is_one_hot_at_argmax():
    p = probs(np.array([[0.1, 3.0, -1.0], [5.0, 0.0, 4.9]]), SamplingParams())
    assert p.tolist() == [[0, 1, 0], [1, 0, 0]]


def test_temperature_softmax():
    logits = np.array([[1.0, 2.0, 3.0]])
    p = probs(logits, SamplingParams(temperature=2.0))
    e = np.exp(logits / 2.0)
    np.testing.assert_allclose(p, e / e.sum())


def test_top_k_keeps_k():
    p = probs(np.array([[1.0, 4.0, 3.0, 2.0]]), SamplingParams(temperature=1.0, top_k=2))
    assert (p[0] > 0).tolist() == [False, True, True, False]
    np.testing.assert_allclose(p.sum(), 1.0)


def test_top_p_keeps_smallest_set_reaching_p():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    p = probs(logits, SamplingParams(temperature=1.0, top_p=0.79))
    np.testing.assert_allclose(p[0], [0.5 / 0.8, 0.3 / 0.8, 0, 0])
    p = probs(logits, SamplingParams(temperature=1.0, top_p=0.81))
    assert (p[0] > 0).sum() == 3
    p = probs(logits, SamplingParams(temperature=1.0, top_p=0.1))
    assert p[0].tolist() == [1.0, 0.0, 0.0, 0.0]  # the most likely token always stays


@pytest.mark.parametrize("kwargs, word", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_k": -1}, "top_k"), ({"top_k": 1.5}, "top_k"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
])
def test_bad_params(kwargs, word):
    with pytest.raises(GenerationError, match=word):
        SamplingParams(**kwargs)


def test_seeded_rng_reproduces():
    a, b = make_rng(7), make_rng(7)
    assert [a.random() for _ in range(5)] == [b.random() for _ in range(5)]
    with pytest.raises(GenerationError, match="seed"):
        make_rng(-3)


def test_sample_matches_distribution():
    from scipy.stats import chisquare

    p = np.array([0.1, 0.0, 0.6, 0.3])
    rng = make_rng(0)
    counts = np.bincount([sample(p, rng) for _ in range(20000)], minlength=4)
    assert counts[1] == 0
    assert chisquare(counts[p > 0], 20000 * p[p > 0]).pvalue > 1e-3


@pytest.mark.parametrize("t", [1e-38, 1e-39, 1e-45, 5e-324, 1e-300, 1e-12, 1e-6])
@pytest.mark.parametrize("top_k", [0, 2])
def test_tiny_temperatures_give_valid_distributions(t, top_k):
    """Scaling happens after the max is subtracted and the scale is capped: no overflow, no NaN."""
    logits = np.array([[1.0, 3.0, -2.0, 2.5], [40.0, -40.0, 39.0, 0.0]], np.float32)
    p = probs(logits, SamplingParams(temperature=t, top_k=top_k))
    assert np.isfinite(p).all() and (p >= 0).all()
    np.testing.assert_allclose(p.sum(-1), 1.0)
    assert p.argmax(-1).tolist() == [1, 0] and p.max(-1).tolist() == [1.0, 1.0]


def test_tiny_temperature_splits_exact_ties_evenly():
    p = probs(np.array([[2.0, 5.0, 5.0]], np.float32), SamplingParams(temperature=1e-40))
    np.testing.assert_allclose(p[0], [0.0, 0.5, 0.5])


@pytest.mark.parametrize("t", [1e3, 1e30, 1e300])
def test_huge_temperatures_approach_uniform(t):
    p = probs(np.array([[1.0, 30.0, -5.0]], np.float32), SamplingParams(temperature=t))
    assert np.isfinite(p).all()
    np.testing.assert_allclose(p[0], 1 / 3, rtol=0.05)


def test_nan_logits_are_an_error_not_a_token():
    with pytest.raises(GenerationError, match="non-finite logits"):
        probs(np.array([[1.0, np.nan, 0.0]], np.float32), SamplingParams(temperature=1.0))


def test_numpy_scalars_are_numbers():
    a = SamplingParams(np.float32(0.5), np.int64(3), np.float64(0.9))
    assert (a.temperature, a.top_k, a.top_p) == (0.5, 3, 0.9) and type(a.top_k) is int
    assert make_rng(np.uint32(7)).random() == make_rng(7).random()
    for bad in (True, np.bool_(True), "0.5", None):
        with pytest.raises(GenerationError, match="temperature"):
            SamplingParams(bad)


@pytest.mark.parametrize("t", [1e40, 1e50, 1e300])
def test_huge_temperatures_with_masked_tokens_stay_valid(t):
    """1/T underflows float32 there: the scale is kept normal, so a masked (-inf) entry is never 0 * inf."""
    logits = np.array([[1.0, 30.0, -np.inf, -5.0]], np.float32)
    for top_k in (0, 2):
        p = probs(logits, SamplingParams(temperature=t, top_k=top_k))
        assert np.isfinite(p).all() and p[0, 2] == 0.0
        np.testing.assert_allclose(p.sum(), 1.0)
