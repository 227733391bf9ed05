"""The Speculator base class and the typed records of one speculation round.

One round: the speculator *proposes* k tokens; the target *verifies* them in
one pass (k+1 rows: row i is the target's distribution after
``context + proposed[:i]``, row k the bonus row); the acceptance rule decides;
then everything *commits*: KV caches move their length back to the committed
tokens, recurrent state is set to the state after the last accepted token.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .errors import GenerationError
from .sampling import SamplingParams


@dataclass
class Context:
    """The request as the speculator sees it."""

    tokens: list[int]
    """Committed tokens so far: prompt + emitted, in order."""
    params: SamplingParams
    rng: np.random.Generator
    """The request's generator; drafts draw from it so a seed reproduces a run."""

    @property
    def read(self) -> int:
        """Positions the target has read: every committed token but the last, the *pending* token, which the
        next verification feeds first. (The pending-token rule: ``sessions/round.py`` alone applies it.)"""
        return len(self.tokens) - 1

    def unread(self, length: int) -> list[int]:
        """The committed tokens a model holding ``length`` positions has not read yet (the pending one too)."""
        return self.tokens[length:]

    def room(self, max_positions: int) -> int:
        """Tokens a model of ``max_positions`` positions can still take after the committed ones."""
        return max_positions - len(self.tokens)


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
    logits: np.ndarray | None
    """[k+1, V] float32: the target's logits after context + proposed[:i]. Valid during this round only: a
    fused target hands out its own buffer, overwritten by its next call (copy what you keep). None in a
    greedy round over a graph with a greedy head, which returns only the argmax (``greedy_ids``)."""
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


@dataclass
class Prefill:
    """What the target computed while reading the prompt, handed to ``Speculator.prefill``."""

    hidden: np.ndarray | None = None
    """[n-1, H]: the target's last hidden states at prompt positions 0..n-2 (None unless the speculator
    asked for them in ``bind`` through ``target.fetch_hidden()``)."""


_ATTACH = threading.Lock()


class Speculator:
    """The base of every draft source: ``propose`` is required, the other hooks default to doing nothing.

    Subclasses declare ``name`` and ``default_k``; a speculator that runs a graph of its own overrides
    ``providers`` and ``run_seconds``. One speculator object serves one Session (it keeps per-request
    state); ``attach`` refuses a second one, so two sessions never share draft state.
    """

    name: str = "speculator"
    """Short name for stats and the CLI (``draft-model``, ``prompt-lookup``)."""
    default_k: int = 4
    """Tokens to propose per round unless the session says otherwise."""
    drafters: int = 1
    """How many draft sources it picks among, round by round (a Cascade: one per source); ``adaptive_k``
    keeps a k for each."""
    drafted_by: int = 0
    """Which of them drafted the last proposal (0 for a single source)."""
    source_names: tuple[str, ...] = ()
    """The name of each draft source, in ``drafted_by``'s order (empty: its own ``name``, the one source)."""

    @property
    def batched_sources(self) -> tuple[bool, ...]:
        """Of each draft source, in ``drafted_by``'s order: whether its drafts run in a Batch's steps (a draft
        model on a Batch's slot, whose steps wait for every Session that may draft)."""
        return (False,) * self.drafters
    _owner = None

    @property
    def providers(self) -> list[str]:
        """Providers its graphs actually run on (empty for model-free speculators)."""
        return []

    @property
    def run_seconds(self) -> float:
        """Seconds spent inside ONNX Runtime by its own graphs."""
        return 0.0

    def attach(self, owner: object) -> None:
        """Called once by the Session that will drive this speculator; a second live owner is an error."""
        with _ATTACH:
            current = self._owner() if self._owner is not None else None
            if current is not None and current is not owner:
                raise GenerationError(
                    f"this {type(self).__name__} already serves another Session, and a speculator keeps "
                    "per-request state; create one speculator per Session (they can share a compiled graph: "
                    "pass the same rlxrt.compile(...) result to each)")
            self._owner = weakref.ref(owner)

    def detach(self, owner: object) -> None:
        """Undo ``attach`` (the Session could not bind it)."""
        with _ATTACH:
            if self._owner is not None and self._owner() is owner:
                self._owner = None

    def set_ks(self, ks: Sequence[int]) -> None:
        """The k of each draft source for the next rounds, from ``adaptive_k``: only a speculator with several
        sources needs it (the round's k, the largest of them, already caps a single one)."""

    def bind(self, target) -> None:
        """Check the target (vocabulary, hidden size …); raise GenerationError on a mismatch."""

    def reset(self) -> None:
        """Forget the previous request (caches, state)."""

    def prefill(self, ctx: Context, record: Prefill) -> None:
        """Read the prompt before the first round (its time counts as prefill, not as drafting)."""

    def propose(self, ctx: Context, k: int) -> DraftProposal:
        """Up to k tokens continuing ``ctx.tokens``."""
        raise NotImplementedError(f"{type(self).__name__} must implement propose(ctx, k)")

    def commit(self, ctx: Context, decision: AcceptDecision, verify: VerifyResult) -> None:
        """Advance persistent state over the accepted tokens only (``ctx.tokens`` is already extended)."""
