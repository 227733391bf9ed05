"""The sampled-losslessness check shared by the stateful tests: the first two emitted tokens of many
seeded requests against the target's exact distributions, by chi-square."""
from __future__ import annotations

import numpy as np
from scipy.stats import chisquare

from rlxrt.sampling import SamplingParams, probs, sample
from rlxrt.speculator import AcceptDecision


def two_token_marginals(ref, prompt: list[int], params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """The target's distribution of the first emitted token, and the marginal of the second (by enumerating
    the first); ``ref`` is a fresh KVModel or StateModel of the target."""
    p1 = probs(ref.forward(prompt)[-1], params)[0]
    p2 = np.zeros_like(p1)
    for x in np.flatnonzero(p1 > 1e-7):
        ref.commit(len(prompt))
        p2 += p1[x] * probs(ref.forward([int(x)])[0], params)[0]
    return p1, p2 / p2.sum()


def assert_first_two_tokens_follow(session, prompt: list[int], p1, p2, draws: int) -> None:
    """Sample ``draws`` two-token requests (temperature 1, seeds 0..draws-1); chi-square p > 1e-3 for both
    positions, tokens expected fewer than 5 times pooled into one cell."""
    first, second = np.zeros_like(p1), np.zeros_like(p2)
    for i in range(draws):
        t = session.generate(prompt, max_new_tokens=2, temperature=1.0, seed=i, ignore_eos=True).token_ids
        first[t[0]] += 1
        second[t[1]] += 1
    for counts, p in ((first, p1), (second, p2)):
        expected = p * draws
        big = expected >= 5
        obs, exp = counts[big], expected[big]
        if (~big).any():
            obs, exp = np.append(obs, counts[~big].sum()), np.append(exp, expected[~big].sum())
        assert chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 1e-3


def accept_ignoring_q(p, q, draft, rng) -> AcceptDecision:
    """A wrong acceptance rule for negative controls: it accepts a drafted token when p > 0.5 q, and otherwise
    samples from p instead of the residual, so the output no longer has the target's distribution."""
    for i in range(len(draft)):
        if p[i, draft[i]] / q[i, draft[i]] <= 0.5:
            return AcceptDecision(i, np.array([*draft[:i], sample(p[i], rng)]), False)
    return AcceptDecision(len(draft), np.array([*draft, sample(p[len(draft)], rng)]), True)
