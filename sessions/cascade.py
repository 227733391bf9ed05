"""Speculator: several draft sources in order; each round the first that proposes anything drafts.

The usual pair is prompt lookup first (free, and right for a long run when the text repeats itself, e.g.
code being edited) with a model behind it (an MTP head or a draft model) for new text:
``Cascade(PromptLookup(min_n=3), MtpHead(dir))``. Requiring a match of ``min_n`` tokens keeps lookup from
answering on a chance one-token match, where the model drafts better.

Exactness holds round by round: the acceptance rule sees the distribution of the source that drafted
(one-hot for lookup). Every source reads the prompt and commits every round, drafted or not, so a model
behind lookup keeps following the text (its next ``propose`` feeds what it has not read in one call).
"""
from __future__ import annotations

from typing import Sequence

from rlxrt.checks import as_int
from rlxrt.errors import GenerationError
from rlxrt.limits import K_MAX
from rlxrt.speculator import AcceptDecision, Context, DraftProposal, Prefill, Speculator, VerifyResult


class Cascade(Speculator):
    def __init__(self, *sources: Speculator, ks: Sequence[int] | None = None):
        """``ks``: the most tokens each source drafts in a round (default: the session's k for all), e.g.
        ``ks=(8, 2)``: long runs where lookup matches, short ones from a head; the session's k caps both."""
        if len(sources) < 2 or not all(isinstance(s, Speculator) for s in sources):
            raise GenerationError("Cascade needs two or more speculators, e.g. Cascade(PromptLookup(min_n=3), "
                                  f"MtpHead(dir)); got {[type(s).__name__ for s in sources]}")
        if ks is not None and (isinstance(ks, (str, bytes)) or not isinstance(ks, Sequence)
                               or len(ks) != len(sources)):
            raise GenerationError(f"Cascade's ks must give one k per source ({len(sources)}), got {ks!r}")
        self.sources = sources
        self.ks = [K_MAX] * len(sources) if ks is None else [as_int(k, "a Cascade source's k", 1, K_MAX) for k in ks]
        self.name = "+".join(s.name for s in sources)
        self.default_k = max(s.default_k for s in sources) if ks is None else max(self.ks)
        self.proposed_by = [0] * len(sources)
        """Rounds each source drafted, over the speculator's life."""
        self.drafters = len(sources)
        self.source_names = tuple(s.name for s in sources)
        self._adaptive: list[int] | None = None  # per-source k from the session's adaptive_k

    @property
    def batched_sources(self) -> tuple[bool, ...]:
        return tuple(b for s in self.sources for b in s.batched_sources)

    @property
    def providers(self) -> list[str]:
        return next((s.providers for s in self.sources if s.providers), [])

    @property
    def run_seconds(self) -> float:
        return sum(s.run_seconds for s in self.sources)

    def attach(self, owner: object) -> None:
        super().attach(owner)
        done = []
        try:
            for s in self.sources:
                s.attach(owner)
                done.append(s)
        except BaseException:
            for s in done:
                s.detach(owner)
            super().detach(owner)
            raise

    def detach(self, owner: object) -> None:
        for s in self.sources:
            s.detach(owner)
        super().detach(owner)

    def bind(self, target) -> None:
        for s in self.sources:
            s.bind(target)

    def reset(self) -> None:
        """Forget the previous request, and the ks it set (each request sets its own, or drafts k from each)."""
        self._adaptive = None
        for s in self.sources:
            s.reset()

    def prefill(self, ctx: Context, record: Prefill) -> None:
        for s in self.sources:
            s.prefill(ctx, record)

    def set_ks(self, ks: Sequence[int]) -> None:
        if self._adaptive is None:
            self._adaptive = list(ks)
        else:  # every round on a Batch: the list is made once a request
            self._adaptive[:] = ks

    def propose(self, ctx: Context, k: int) -> DraftProposal:
        adaptive = self._adaptive
        for i, s in enumerate(self.sources):
            self.drafted_by = i
            proposal = s.propose(ctx, min(k, self.ks[i], adaptive[i] if adaptive else K_MAX))
            if len(proposal.tokens):
                self.proposed_by[i] += 1
                return proposal
        return proposal

    def commit(self, ctx: Context, decision: AcceptDecision, verify: VerifyResult) -> None:
        for s in self.sources:
            s.commit(ctx, decision, verify)
