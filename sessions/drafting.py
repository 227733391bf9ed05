"""What the model-backed speculators share: the vocabulary check, the draft chain, a graph of their own."""
from __future__ import annotations

import numpy as np

from rlxrt.errors import GenerationError
from rlxrt.sampling import probs, sample
from rlxrt.speculator import Context, DraftProposal, Speculator

from .kv import KVModel
from .state import StateModel
from .text import codec_for


def check_same_vocabulary(target: KVModel | StateModel, draft: KVModel | StateModel) -> None:
    tv, dv = target.vocab_size, draft.vocab_size
    if tv != dv:
        raise GenerationError(
            f"draft and target vocabularies differ: target has {tv} tokens, draft has {dv}; "
            "use a draft trained with the target's tokenizer"
        )
    t_codec, d_codec = codec_for(target.graph), codec_for(draft.graph)
    if t_codec is not None and d_codec is not None and t_codec.vocab() != d_codec.vocab():
        a, b = t_codec.vocab(), d_codec.vocab()
        diff = sorted(set(a.items()) ^ set(b.items()))[:3]
        raise GenerationError(
            f"draft and target tokenizers differ (target {len(a)} tokens, draft {len(b)}; e.g. {diff}); "
            "use a draft trained with the target's tokenizer"
        )


def draft_chain(logits: np.ndarray, k: int, ctx: Context, step) -> DraftProposal:
    """k drafted tokens: the first from ``logits`` [V], each next one from ``step(token)`` (the draft's
    logits after it). Greedy takes the argmax; sampling draws from the transformed row, which the
    acceptance rule then needs."""
    tokens = np.empty(k, np.int64)
    greedy = ctx.params.greedy
    rows = None if greedy else np.empty((k, len(logits)))
    for i in range(k):
        if greedy:
            x = int(logits.argmax())
        else:
            rows[i] = probs(logits, ctx.params)[0]
            x = sample(rows[i], ctx.rng)
        tokens[i] = x
        if i + 1 < k:
            logits = step(x)
    return DraftProposal(tokens, rows)


class ModelSpeculator(Speculator):
    """A speculator that runs a graph of its own (``model``): its providers and its time in ORT."""

    model: KVModel | StateModel

    @property
    def providers(self) -> list[str]:
        return self.model.providers

    @property
    def run_seconds(self) -> float:
        return self.model.run_seconds
