"""Speculator: an MTP head drafts from the target's last hidden state, chaining its own.

Head position p reads the target's hidden state h_p and token x_{p+1} and
proposes x_{p+2}; the next chained step reads the head's own predicted hidden
state and the token it just proposed. The head's recurrent state depends on
the tokens only, so the per-position states of a round are exact for every
accepted token: ``commit`` keeps the state at the last accepted position and
drops the rest (no re-run). The target's true hidden states of the positions
the head has not consumed yet (the pending token's, and after a full
acceptance the last draft's too) are kept and fed at the next ``propose``,
with the tokens, in one call.
"""
from __future__ import annotations

import os

import numpy as np

from rlxrt.backends import CompiledGraph, compile
from rlxrt.config import Config
from rlxrt.errors import GenerationError, ModelFormatError
from rlxrt.sampling import probs, sample
from rlxrt.speculator import AcceptDecision, Context, DraftProposal, VerifyResult

from .draft_model import check_same_vocabulary
from .kv import KVModel
from .state import StateModel


class MtpHead:
    name = "mtp-head"
    default_k = 3

    def __init__(self, head: str | os.PathLike | CompiledGraph, config: Config | None = None):
        graph = head if isinstance(head, CompiledGraph) else compile(head, config)
        m = graph.manifest
        if m is None or not m.draft_head or m.draft_head.get("kind") != "mtp":
            raise ModelFormatError(f"{graph.path} is not an MTP head (its manifest has no draft_head of kind "
                                   "'mtp'); pass a model directory to DraftModel instead")
        self.model = StateModel(graph)
        self.hidden_size = int(m.draft_head["hidden_size"])
        self.target: KVModel | None = None
        self.reset()

    @property
    def providers(self) -> list[str]:
        return self.model.providers

    @property
    def run_seconds(self) -> float:
        return self.model.run_seconds

    def bind(self, target) -> None:
        if not isinstance(target, KVModel):
            raise GenerationError("an MTP head drafts for a transformer target (KV cache); this target is "
                                  "recurrent: use a draft model or prompt lookup")
        check_same_vocabulary(target, self.model)
        size = target.fetch_hidden()
        if size not in (-1, self.hidden_size):
            raise GenerationError(f"the MTP head reads hidden states of size {self.hidden_size}, the target's are "
                                  f"{size}; use the head trained for this target")
        self.target = target

    def reset(self) -> None:
        self.model.reset()
        self.rows = np.zeros((0, self.hidden_size), np.float32)
        """The target's hidden states of head positions ``row_start`` .. (committed tokens - 2), not yet fed."""
        self.row_start = 0

    def prefill(self, ctx: Context) -> None:
        """Consume the prompt's tokens (all but the pending one) with the target's prefill hidden states."""
        h = self.target.hidden  # rows of prompt positions 0 .. n-2
        n = len(ctx.tokens)
        if n > 2:
            self.model.forward(ctx.tokens[1:n - 1], h[:n - 2])
        self.rows, self.row_start = h[n - 2:n - 1], self.model.length

    def propose(self, ctx: Context, k: int) -> DraftProposal:
        m = self.model
        k = min(k, m.max_positions - len(ctx.tokens))
        if k <= 0 or not len(self.rows):  # a one-token prompt: no hidden state before the first round
            return DraftProposal(np.zeros(0, np.int64))
        logits = m.forward(ctx.tokens[m.length + 1:], self.rows)[-1]
        hidden = m.hidden[-1:]
        tokens = np.empty(k, np.int64)
        greedy = ctx.params.greedy
        rows = None if greedy else np.empty((k, m.vocab_size))
        for i in range(k):
            if greedy:
                x = int(logits.argmax())
            else:
                rows[i] = probs(logits, ctx.params)[0]
                x = sample(rows[i], ctx.rng)
            tokens[i] = x
            if i + 1 < k:
                logits = m.forward((x,), hidden)[0]
                hidden = m.hidden
        return DraftProposal(tokens, rows)

    def commit(self, ctx: Context, decision: AcceptDecision, verify: VerifyResult) -> None:
        n_new = len(ctx.tokens)
        first = n_new - len(decision.tokens) - 1  # head position of verify row 0 (the old pending token's)
        start = self.row_start
        keep = min(n_new - 2, self.model.length)
        self.model.commit(keep)
        if verify.hidden is None:
            raise GenerationError("the target returned no hidden states; bind the head before generating")
        old = self.rows[max(0, keep - start):max(0, first - start)]
        new = verify.hidden[max(0, keep - first):n_new - 1 - first]
        self.rows = np.concatenate([old, new]) if len(old) else new
        self.row_start = keep
