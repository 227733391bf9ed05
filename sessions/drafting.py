"""What the model-backed speculators share: the vocabulary check, the draft chain, a graph of their own."""
from __future__ import annotations

import numpy as np

from rlxrt.checks import as_float
from rlxrt.errors import GenerationError
from rlxrt.sampling import probs, sample
from rlxrt.speculator import Context, DraftProposal, Speculator

from .decoder import Decoder
from .text import codec_for


def check_same_vocabulary(target: Decoder, draft: Decoder) -> None:
    tv, dv = target.vocab_size, draft.vocab_size
    if tv != dv:
        raise GenerationError(
            f"draft and target vocabularies differ: target has {tv} tokens, draft has {dv}; "
            "use a draft trained with the target's tokenizer"
        )
    t_codec, d_codec = codec_for(target.graph), codec_for(draft.graph)
    if t_codec is not None and d_codec is not None and t_codec is not d_codec and t_codec.vocab() != d_codec.vocab():
        a, b = t_codec.vocab(), d_codec.vocab()
        diff = sorted(set(a.items()) ^ set(b.items()))[:3]
        raise GenerationError(
            f"draft and target tokenizers differ (target {len(a)} tokens, draft {len(b)}; e.g. {diff}); "
            "use a draft trained with the target's tokenizer"
        )


def draft_chain(logits: np.ndarray, k: int, ctx: Context, step, min_prob: float = 0.0,
                scratch: np.ndarray | None = None, vocab_ids: np.ndarray | None = None,
                vocab_size: int = 0, rows: np.ndarray | None = None) -> DraftProposal:
    """Up to k drafted tokens: the first from ``logits`` [V], each next one from ``step(token)`` (the draft's
    logits after it). Greedy takes the argmax; sampling draws from the transformed row, which the
    acceptance rule then needs. With ``min_prob`` the chain ends before any position after the first where
    the draft's likeliest token has a probability below ``min_prob``. That is decided from the draft's row
    before a token is drawn from it: deciding on the drawn token instead would draw the kept ones from q
    restricted to its likely tokens while the acceptance rule divides by q itself, which biases sampled
    output (the pure-tier chi-square test caught exactly that). ``scratch`` [V] float32 is where greedy
    computes the probability. ``vocab_ids`` [N]: the logits are a draft-only export's N columns, column j
    token ``vocab_ids[j]`` of ``vocab_size``; q is then zero outside them, which the acceptance rule takes as
    it comes. ``rows`` [>= k, V]: where a sampled chain writes q (the caller's, reused every round: only the
    columns of ``vocab_ids`` are ever written, so the others stay zero); a new array when not given."""
    tokens = np.empty(k, np.int64)
    greedy = ctx.params.greedy
    if greedy:
        rows = None
    elif rows is None or len(rows) < k:
        rows = np.empty((k, len(logits))) if vocab_ids is None else np.zeros((k, vocab_size))
    for i in range(k):
        if greedy:
            x = int(logits.argmax())
            if i and min_prob:
                buf = np.subtract(logits, logits[x], out=scratch)
                if 1.0 / np.exp(buf, out=buf).sum() < min_prob:
                    return DraftProposal(tokens[:i], None)
        else:
            q = probs(logits, ctx.params)[0]
            if i and q.max() < min_prob:  # decided before drawing: a drafted token is still drawn from q
                return DraftProposal(tokens[:i], rows[:i])
            x = sample(q, ctx.rng)
            if vocab_ids is None:
                rows[i] = q
            else:
                rows[i, vocab_ids] = q
        if vocab_ids is not None:
            x = int(vocab_ids[x])
        tokens[i] = x
        if i + 1 < k:
            logits = step(x)
    return DraftProposal(tokens, None if rows is None else rows[:k])


class ModelSpeculator(Speculator):
    """A speculator that runs a graph of its own (``model``): its providers and its time in ORT.

    ``min_prob`` (0 <= p < 1, default 0): a round's chain ends before a position after the first where the
    draft's likeliest token is below p, so that unlikely tokens cost no draft step nor verification row."""

    model: Decoder
    min_prob: float = 0.0
    scratch: np.ndarray | None = None
    rows: np.ndarray | None = None
    """[k, V] float64: the sampled chain's q rows, made at the first sampled round (again for a larger k) and
    reused (the acceptance rule reads them within the round)."""

    def set_min_prob(self, min_prob: float) -> None:
        self.min_prob = as_float(min_prob, "min_prob (a draft's chain ends below it)", 0.0, 0.999)
        self.scratch = np.empty(self.model.logits_width, np.float32) if self.min_prob else None

    def chain(self, logits: np.ndarray, k: int, ctx: Context, step) -> DraftProposal:
        if not ctx.params.greedy and (self.rows is None or len(self.rows) < k):
            self.rows = np.zeros((k, self.model.vocab_size))
        return draft_chain(logits, k, ctx, step, self.min_prob, self.scratch, self.model.vocab_ids,
                           self.model.vocab_size, self.rows)

    @staticmethod
    def chain_ids(first: int, k: int, step) -> DraftProposal:
        """Up to k greedy drafts from argmax ids: ``first``, then ``step(token)`` (the draft's next id). The
        chain ends before a -1 (a hidden state that is not finite): a draft's tokens never touch exactness."""
        tokens = np.empty(k, np.int64)
        x = int(first)
        for i in range(k):
            if x < 0:
                return DraftProposal(tokens[:i])
            tokens[i] = x
            if i + 1 < k:
                x = int(step(x))
        return DraftProposal(tokens)

    @property
    def providers(self) -> list[str]:
        return self.model.providers

    @property
    def run_seconds(self) -> float:
        return self.model.run_seconds
