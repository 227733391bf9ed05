"""Speculator: an MTP head drafts from the target's last hidden state, chaining its own.

Head position p reads the target's hidden state h_p and token x_{p+1} and
proposes x_{p+2}; the next chained step reads the head's own predicted hidden
state and the token it just proposed. The head's recurrent state depends on
the tokens only, so the per-position states of a round are exact for every
accepted token: ``commit`` keeps the state at the last accepted position and
drops the rest (no re-run). What the head has not read yet (the pending token,
and after a full acceptance the last draft too) is fed at the next
``propose`` in one call, with the target's hidden state of the position
before the pending token: the verify row that produced it.

Given a ``HeadBatch``, it drafts on a slot of it: the proposals of every Session whose target stepped with the
others run in the same head steps, each weight of the head read once for all (sessions/head_batch.py).
"""
from __future__ import annotations

import logging
import os
import weakref

import numpy as np

from rlxrt.backends import CompiledGraph, compile
from rlxrt.config import Config
from rlxrt.errors import GenerationError, ModelFormatError
from rlxrt.speculator import AcceptDecision, Context, DraftProposal, Prefill, VerifyResult

from .decoder import Decoder
from .drafting import ModelSpeculator, check_same_vocabulary
from .state import StateModel


log = logging.getLogger("rlxrt")


class MtpHead(ModelSpeculator):
    name = "mtp-head"
    default_k = 4

    def __init__(self, head: "str | os.PathLike | CompiledGraph | HeadBatch", config: Config | None = None, *,
                 min_prob: float = 0.0):
        from .head_batch import HeadBatch

        if isinstance(head, HeadBatch):  # a slot of the head's batch, for this speculator's life
            self.model = head.slot()
            weakref.finalize(self, head.release, self.model)
            m = head.graph.manifest
        else:
            graph = head if isinstance(head, CompiledGraph) else compile(head, config)
            m = graph.manifest
            if m is None or not m.draft_head or m.draft_head.get("kind") != "mtp":
                raise ModelFormatError(f"{graph.path} is not an MTP head (its manifest has no draft_head of kind "
                                       "'mtp'); pass a model directory to DraftModel instead")
            self.model = StateModel(graph)
        self.each = self.model.hidden_each
        """An attention layer: its cache must hold what the target computed, so a commit keeps the head's
        positions only up to the last one built from the target's hidden state, and the next ``propose`` feeds
        the accepted ones again with the verify rows (one call)."""
        self.hidden_size = int(m.draft_head["hidden_size"])
        self.width = self.hidden_size
        self.set_min_prob(min_prob)
        self._rows: np.ndarray | None = None
        """With an attention layer: the buffer ``last`` lives in, made once and grown by doubling."""
        self.reset()

    @property
    def batched_sources(self) -> tuple[bool, ...]:
        return (self.model.shared,)

    def bind(self, target: Decoder) -> None:
        if self.model.shared and not target.shared:
            raise GenerationError("a head on a slot of a HeadBatch drafts for a target that is a slot of a Batch "
                                  "(its steps pace the head's); give a lone Session the head's directory or "
                                  "compiled graph instead")
        if not target.manifest.outputs.get("hidden_states"):  # before the weights: this is what any head needs
            raise GenerationError(f"the target {target.graph.path.parent} has no hidden_states output, and an MTP "
                                  "head drafts from the target's hidden states; re-export the target with `rlxrt "
                                  "export SRC OUT --with-hidden-states`")
        trained_on = (self.model.manifest.draft_head.get("target") or {}).get("weights_sha256")
        actual = target.manifest.source.get("weights_sha256")
        if trained_on and not actual:
            log.warning("the MTP head %s was trained for weights %s…, and the target %s records no weights hash: "
                        "it cannot be checked to be that target", self.model.graph.path.parent, trained_on[:12],
                        target.graph.path.parent)
        if trained_on and actual and trained_on != actual:
            raise GenerationError(
                f"this MTP head ({self.model.graph.path.parent}) was trained for a target whose weights hash is "
                f"{trained_on[:12]}…, but the target's weights hash is {actual[:12]}…; a head drafts well only "
                "for its own target: train one for this target, or pass the target it was trained for")
        check_same_vocabulary(target, self.model)
        reads = tuple(self.model.manifest.draft_head.get("hidden_layers") or ())
        outputs = tuple(target.manifest.hidden_layers)
        if reads and reads != outputs:
            raise GenerationError(
                f"this MTP head reads the residual streams of layers {list(reads)} beside the target's last hidden "
                f"state, and the target {target.graph.path.parent} outputs those of {list(outputs)}; re-export the "
                f"target with --hidden-layers {','.join(map(str, reads))}, or use a head trained on what it outputs")
        last = self.hidden_size // (1 + len(reads))  # the width of the LM head's input
        self.width = self.hidden_size if reads else last
        """The columns of the target's hidden_states the head reads: all of them, or the LM head's input alone
        (a head that reads only the last hidden state binds to a target that outputs residual streams too)."""
        size = target.fetch_hidden()
        if size not in (-1, last * (1 + len(outputs))):
            raise GenerationError(f"the MTP head reads hidden states of size {last}, the target's are "
                                  f"{size // (1 + len(outputs))}; use the head trained for this target")
        if self.model.shared:  # its target's steps pace the head's (sessions/head_batch.py)
            target.lead(self.model)

    def reset(self) -> None:
        self.model.reset()
        self.last: np.ndarray | None = None
        """[1, H]: the target's hidden state of the position before the pending token (None: none yet); with an
        attention layer, [s, H]: those of every position the head has still to read."""

    def _hold(self, rows: np.ndarray, after: bool) -> None:
        """Keep ``rows`` as the rows the head has still to read (after those it has when ``after``), in a buffer
        that grows by doubling and lives across requests: a round that proposed nothing adds its rows without
        copying the ones before them again (those of a long prompt, for one)."""
        n = len(self.last) if after and self.last is not None else 0
        total = n + len(rows)
        buf = self._rows
        if buf is None or total > len(buf) or buf.dtype != rows.dtype:
            grown = np.empty((max(total, 2 * len(buf) if buf is not None else 0, 64), rows.shape[1]), rows.dtype)
            if n:
                grown[:n] = self.last
            self._rows = buf = grown
        buf[n:total] = rows
        self.last = buf[:total]  # with an attention layer, always the start of this buffer

    def prefill(self, ctx: Context, record: Prefill) -> None:
        """Read the prompt's tokens but the pending one; keep the target's hidden state before it."""
        h = record.hidden  # rows of the positions the target read: 0 .. read-1
        read = ctx.read
        if h is None or len(h) != read:
            raise GenerationError(f"the MTP head needs the target's hidden states of the {read} prompt positions "
                                  f"before the pending token, got {None if h is None else len(h)} rows; bind the "
                                  "head to a Session whose target was exported with --with-hidden-states")
        if self.each:  # read at the first propose, with the rows of the rounds before it: nothing is paid
            if read > 0:  # for a request that never drafts
                self._hold(h[:read, :self.width], after=False)
            return
        if read > 1 and not self.model.shared:  # only the state is kept; the head reads one position behind
            self.model.forward(ctx.tokens[1:read], h[read - 2:read - 1, :self.width])  # (on a batch: at the
            # first propose, with the pending token, so a request that never drafts pays nothing)
        self.last = h[read - 1:read, :self.width] if read > 0 else None

    def propose(self, ctx: Context, k: int) -> DraftProposal:
        m = self.model
        k = min(k, ctx.room(m.max_positions))
        if k <= 0 or self.last is None:  # a one-token prompt: no hidden state before the first round
            return DraftProposal(np.zeros(0, np.int64))
        try:
            if m.shared and ctx.params.greedy and not self.min_prob:  # the whole chain in the head's batch steps
                return DraftProposal(m.chain(ctx.unread(m.length + 1), self.last, k))
            first = m.forward(ctx.unread(m.length + 1), self.last)[0]  # the head's position i reads token i + 1
            return self.chain(first, k, ctx, lambda x: m.forward((x,), m.hidden)[0])  # chained on its own hidden
        finally:
            if m.shared:  # its drafting is done: the head's next steps need not wait for it
                m.idle()

    def commit(self, ctx: Context, decision: AcceptDecision, verify: VerifyResult) -> None:
        if verify.hidden is None:
            raise GenerationError("the target returned no hidden states; bind the head before generating")
        j = len(decision.tokens) - 1  # the verify row that produced the new pending token
        if not self.each:
            self.model.commit(min(ctx.read - 1, self.model.length))
            self.last = verify.hidden[j:j + 1, :self.width]
            return
        real = ctx.read - len(decision.tokens)  # positions read with the target's hidden states
        rows = verify.hidden[:j + 1, :self.width]          # the target's, of the verified positions
        # copied, never kept as a view: the target's next call rewrites its buffer, and a round that drafts
        # nothing (a batch's plan under load) does not read them before that
        self._hold(rows, after=self.model.length < real)  # after: nothing was proposed, they wait behind those
        if self.model.length >= real:
            self.model.commit(real)
