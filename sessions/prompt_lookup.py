"""Speculator: prompt lookup — propose the tokens that followed the last n-gram's earlier occurrence.

No model and no distribution (the acceptance rule treats the proposal as
one-hot, which is still exact). The longest n-gram (``max_n`` down to
``min_n``) that occurred before wins; among its occurrences the most recent.
"""
from __future__ import annotations

import numpy as np

from rlxrt.checks import as_int
from rlxrt.errors import GenerationError
from rlxrt.limits import K_MAX
from rlxrt.speculator import Context, DraftProposal, Speculator


def lookup(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """Up to k tokens that followed the most recent earlier occurrence of the longest matching suffix.

    One vectorised pass finds the earlier positions holding the last token;
    only those are extended backwards (most recent first), up to ``max_n``.
    """
    length = len(tokens)
    if length < 2:
        return tokens[:0]
    best_n, best_end = 0, -1
    for end in np.flatnonzero(tokens[:-1] == tokens[-1])[::-1].tolist():  # each has a follower
        n = 1
        while n < max_n and end - n >= 0 and tokens[end - n] == tokens[length - 1 - n]:
            n += 1
        if n > best_n:
            best_n, best_end = n, end
            if n == max_n:
                break
    if best_n < min_n:
        return tokens[:0]
    return tokens[best_end + 1:best_end + 1 + k]


class PromptLookup(Speculator):
    name = "prompt-lookup"

    def __init__(self, k: int = 4, min_n: int = 1, max_n: int = 3):
        self.default_k = as_int(k, "prompt lookup's k", 1, K_MAX)
        self.min_n = as_int(min_n, "prompt lookup's min_n", 1, 64)
        self.max_n = as_int(max_n, "prompt lookup's max_n", 1, 64)
        if self.min_n > self.max_n:
            raise GenerationError(f"prompt lookup needs min_n <= max_n, got min_n={min_n!r}, max_n={max_n!r}")
        self.reset()

    def reset(self) -> None:
        self._ids = np.zeros(256, np.int64)  # the request's tokens so far (they only grow within a request)
        self._n = 0

    def propose(self, ctx: Context, k: int) -> DraftProposal:
        n = len(ctx.tokens)
        if n > len(self._ids):
            self._ids = np.concatenate([self._ids[:self._n], np.zeros(2 * n, np.int64)])
        self._ids[self._n:n] = ctx.tokens[self._n:n]
        self._n = n
        found = lookup(self._ids[:n], k, self.min_n, self.max_n)
        return DraftProposal(found.copy(), None)
