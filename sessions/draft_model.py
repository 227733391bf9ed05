"""Speculator: a smaller exported model drafts k tokens with its own KV cache.

The draft may run on another provider than the target (its own config). Its
cache follows the committed tokens: after a round it keeps only the prefix
that the committed sequence confirms, and the next ``propose`` feeds the
tokens it has not seen (the prompt at the first one; then the pending token,
and after a full acceptance the last drafted one too) in one call. It reads
nothing before the first round (``prefill`` is the base class's), as an MTP
head does, so a request that never drafts (under load a batch may draft
nothing) never pays for the draft's reading of its prompt.

Given a ``Batch`` of the draft model, it drafts on a slot of it: the drafts of every Session of the target's
Batch then run in the same steps, each weight read once for all of them (``Slot.lead``).

A draft that has more than ``catch_up`` tokens to read (its first proposal after a long prompt, or after rounds
that drafted nothing: under load a batch drafts in some steps only) starts again on the last ``catch_up`` of
them: what it proposes next depends on recent text, and it is the target that decides what is kept
(docs/performance.md, "Stop 64", measures what it costs in acceptance). ``catch_up=None`` reads everything.
"""
from __future__ import annotations

import os
import weakref

import numpy as np

from rlxrt.backends import CompiledGraph, compile
from rlxrt.checks import as_int
from rlxrt.config import Config
from rlxrt.errors import GenerationError
from rlxrt.speculator import AcceptDecision, Context, DraftProposal, VerifyResult

from .decoder import Decoder
from .drafting import ModelSpeculator, check_same_vocabulary
from .state import decoder_for


CATCH_UP = 64
"""The most tokens a draft reads to catch up on the text (see the module's text)."""


class DraftModel(ModelSpeculator):
    name = "draft-model"
    default_k = 4  # best at temperature 0 on the shipped pair (exporters/reference/results/bench.json)

    def __init__(self, draft: "str | os.PathLike | CompiledGraph | Batch", config: Config | None = None, *,
                 min_prob: float = 0.0, catch_up: int | None = CATCH_UP):
        from .batch import Batch

        self.catch_up = None if catch_up is None else as_int(catch_up, "catch_up (the most tokens a draft reads to "
                                                             "catch up; None: all)", 1, 1 << 20)
        self.offset = 0
        """The position in the text of the draft's first one (above 0 once it started again on the last tokens)."""
        self.read_ahead = False
        """Whether it read tokens since its last commit (a proposal): only then may its cache hold some the round
        did not commit."""

        if isinstance(draft, Batch):  # a slot of the draft's batch, for this speculator's life
            self.model = draft.slot()
            weakref.finalize(self, draft.release, self.model)
        else:
            self.model = decoder_for(draft if isinstance(draft, CompiledGraph) else compile(draft, config))
        self.set_min_prob(min_prob)

    def bind(self, target: Decoder) -> None:
        check_same_vocabulary(target, self.model)
        if self.model.shared:
            if not target.shared:
                raise GenerationError("a draft on a slot of a Batch drafts for a target that is a slot of another "
                                      "Batch (its steps pace the draft's); give a lone Session the draft's "
                                      "directory or compiled graph instead")
            target.lead(self.model)

    @property
    def batched_sources(self) -> tuple[bool, ...]:
        return (self.model.shared,)

    def reset(self) -> None:
        self.model.reset()
        self.offset, self.read_ahead = 0, False

    def _unread(self, ctx: Context) -> list[int]:
        """The tokens the draft reads next: all it has not read, or the last ``catch_up`` of the text where it
        has more than that to read (it then starts again on them)."""
        m = self.model
        start = self.offset + m.length
        if self.catch_up is not None and len(ctx.tokens) - start > self.catch_up:
            m.reset()
            self.offset = start = len(ctx.tokens) - self.catch_up
        return ctx.unread(start)

    def propose(self, ctx: Context, k: int) -> DraftProposal:
        m = self.model
        k = min(k, ctx.room(m.max_positions + self.offset))
        if k <= 0:
            return DraftProposal(np.zeros(0, np.int64))
        self.read_ahead = True
        unread = self._unread(ctx)
        if m.shared and ctx.params.greedy and not self.min_prob:  # the whole chain in the batch's steps
            return DraftProposal(m.chain(unread, k))
        if m.greedy_ids and ctx.params.greedy and not self.min_prob:  # argmax ids from the draft's greedy head
            return self.chain_ids(m.forward_ids(unread, rows=1)[-1], k, lambda x: m.forward_ids((x,))[0])
        return self.chain(m.forward(unread, rows=1)[-1], k, ctx, lambda x: m.forward((x,))[0])

    def commit(self, ctx: Context, decision: AcceptDecision, verify: VerifyResult) -> None:
        if self.read_ahead:  # else its cache holds no more than the committed tokens: nothing to cut
            self.read_ahead = False
            self.model.commit(ctx.read - self.offset)
