"""The acceptance rule of speculative sampling (Leviathan et al. 2023, Algorithm 1).

For each drafted position i, accept ``x_i`` with probability
``min(1, p_i(x_i) / q_i(x_i))``. At the first rejection emit a *recovered*
token from ``norm(max(0, p_i - q_i))`` and stop. If all k are accepted, emit
a *bonus* token from ``p_k``. The emitted sequence is distributed exactly as
the target's, whatever the draft. A draft without probabilities (prompt
lookup) is treated as one-hot at its token, which is still lossless.

Worked example (k = 2, vocabulary {a, b, c})::

    q_0 = [.6 .3 .1], x_0 = a;  p_0 = [.3 .5 .2]  -> accept a with prob .3/.6 = .5
    suppose accepted; q_1 = [.1 .8 .1], x_1 = b;  p_1 = [.2 .4 .4]
                                                 -> accept b with prob .4/.8 = .5
    suppose rejected: recovered ~ norm(max(0, p_1 - q_1)) = norm([.1 0 .3]) = [.25 0 .75]
    emitted: [a, recovered]; accepted = 1, bonus = False

At temperature 0 both distributions are one-hot and the rule becomes
"accept while the draft token is the target's argmax, then emit the argmax".
"""
from __future__ import annotations

import numpy as np

from .sampling import sample
from .speculator import AcceptDecision


def speculative_accept(p: np.ndarray, q: np.ndarray | None, draft: np.ndarray,
                       rng: np.random.Generator) -> AcceptDecision:
    """Apply the rule to target rows ``p`` [k+1, V], draft rows ``q`` [k, V] (or None) and tokens [k]."""
    k = len(draft)
    assert p.shape[0] == k + 1, (p.shape, k)
    for i in range(k):
        x = int(draft[i])
        q_x = 1.0 if q is None else float(q[i, x])
        p_x = float(p[i, x])
        if q_x > 0 and rng.random() < min(1.0, p_x / q_x):
            continue
        if q is None:
            residual = p[i].copy()
            residual[x] = 0.0  # max(0, p - onehot(x))
        else:
            residual = np.maximum(p[i] - q[i], 0.0)
        if residual.sum() <= 0.0:  # p == q up to rounding: any draw from p is exact
            residual = p[i]
        tokens = np.empty(i + 1, np.int64)
        tokens[:i] = draft[:i]
        tokens[i] = sample(residual, rng)
        return AcceptDecision(accepted=i, tokens=tokens, bonus=False)
    tokens = np.empty(k + 1, np.int64)
    tokens[:k] = draft
    tokens[k] = sample(p[k], rng)
    return AcceptDecision(accepted=k, tokens=tokens, bonus=True)


def greedy_accept(target_argmax: np.ndarray, draft: np.ndarray) -> AcceptDecision:
    """Temperature 0: accept while ``draft[i] == target_argmax[i]``; then emit the target's argmax."""
    k = len(draft)
    if k == 0:  # plain decoding
        return AcceptDecision(accepted=0, tokens=target_argmax[:1].astype(np.int64), bonus=True)
    mismatch = np.flatnonzero(np.asarray(draft) != target_argmax[:k])
    j = int(mismatch[0]) if mismatch.size else k
    tokens = np.empty(j + 1, np.int64)
    tokens[:j] = draft[:j]
    tokens[j] = target_argmax[j]
    return AcceptDecision(accepted=j, tokens=tokens, bonus=j == k)
