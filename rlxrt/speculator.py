"""The Speculator protocol and the typed records of one speculation round.

One round: the speculator *proposes* k tokens; the target *verifies* them in
one pass (k+1 rows: row i is the target's distribution after
``context + proposed[:i]``, row k the bonus row); the acceptance rule decides;
then everything *commits*: KV caches move their length back to the committed
tokens, recurrent state is set to the state after the last accepted token.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from .sampling import SamplingParams


@dataclass
class Context:
    """The request as the speculator sees it."""

    tokens: list[int]
    """Committed tokens so far: prompt + emitted, in order."""
    params: SamplingParams
    rng: np.random.Generator
    """The request's generator; drafts draw from it so a seed reproduces a run."""


@dataclass
class DraftProposal:
    tokens: np.ndarray
    """[k] int64: the proposed continuation (k may be smaller than asked, even 0)."""
    probs: np.ndarray | None = None
    """[k, V] float64: the draft distribution each token was drawn from; None = one-hot (no distribution)."""
    seconds_in_run: float = 0.0
    """Time spent inside ORT's session.run while proposing."""


@dataclass
class VerifyResult:
    logits: np.ndarray
    """[k+1, V] float32: the target's logits after context + proposed[:i]."""
    probs: np.ndarray | None = None
    """[k+1, V] float64: the transformed distribution (None when greedy: only the argmax is needed)."""
    hidden: np.ndarray | None = None
    """[k+1, H]: the target's last hidden states, for heads that draft from them (None if not exported)."""


@dataclass
class AcceptDecision:
    accepted: int
    """How many drafted tokens were accepted (0..k)."""
    tokens: np.ndarray
    """[accepted + 1] int64: the accepted tokens then the recovered or bonus token."""
    bonus: bool
    """True when all k were accepted and the last token came from the bonus row."""


@runtime_checkable
class Speculator(Protocol):
    """What a draft source implements. Optional capabilities are attributes, never type checks."""

    name: str
    """Short name for stats and the CLI (``draft-model``, ``prompt-lookup``)."""
    default_k: int
    """Tokens to propose per round unless the session says otherwise."""
    providers: list[str]
    """Providers its graphs actually run on (empty for model-free speculators)."""

    def bind(self, target) -> None:
        """Attach to a target model (check vocabulary etc.); raises GenerationError on mismatch."""

    def reset(self) -> None:
        """Forget the previous request (caches, state).

        Optional: ``prefill(ctx)`` reads the prompt before the first round (a
        draft model fills its cache there), so that time counts as prefill,
        not as drafting.
        """

    def propose(self, ctx: Context, k: int) -> DraftProposal:
        """Up to k tokens continuing ``ctx.tokens``."""

    def commit(self, ctx: Context, decision: AcceptDecision, verify: VerifyResult) -> None:
        """Advance persistent state over the accepted tokens only (``ctx.tokens`` is already extended)."""


@dataclass
class EmptyProposal:
    """The proposal of plain decoding: nothing drafted."""

    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    probs: None = None
    seconds_in_run: float = 0.0
