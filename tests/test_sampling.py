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
