"""Speculator: prompt lookup — propose the tokens that followed the last n-gram's earlier occurrence.

No model and no distribution (the acceptance rule treats the proposal as
one-hot, which is still exact). The longest n-gram (``max_n`` down to
``min_n``) that occurred before wins; among its occurrences the most recent.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from rlxrt.errors import GenerationError
from rlxrt.speculator import AcceptDecision, Context, DraftProposal, VerifyResult


def lookup(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """Up to k tokens that followed the most recent earlier occurrence of the longest matching suffix."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = sliding_window_view(tokens[:-1], n)  # starts 0 .. length-1-n: each has a follower
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            start = hits[-1] + n
            return tokens[start:start + k]
    return tokens[:0]


class PromptLookup:
    name = "prompt-lookup"
    providers: list[str] = []

    def __init__(self, k: int = 4, min_n: int = 1, max_n: int = 3):
        if not (isinstance(min_n, int) and isinstance(max_n, int) and 1 <= min_n <= max_n):
            raise GenerationError(f"prompt lookup needs 1 <= min_n <= max_n, got min_n={min_n!r}, max_n={max_n!r}")
        self.default_k, self.min_n, self.max_n = k, min_n, max_n
        self.run_seconds = 0.0

    def bind(self, target) -> None:
        pass

    def reset(self) -> None:
        pass

    def propose(self, ctx: Context, k: int) -> DraftProposal:
        found = lookup(np.asarray(ctx.tokens, np.int64), k, self.min_n, self.max_n)
        return DraftProposal(found.copy(), None)

    def commit(self, ctx: Context, decision: AcceptDecision, verify: VerifyResult) -> None:
        pass
