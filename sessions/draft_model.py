"""Speculator: a smaller exported model drafts k tokens with its own KV cache.

The draft may run on another provider than the target (its own config). Its
cache follows the committed tokens: after a round it keeps only the prefix
that the committed sequence confirms, and the next ``propose`` feeds the
tokens it has not seen (the pending token, and after a full acceptance the
last drafted one too) in one call.
"""
from __future__ import annotations

import os

import numpy as np

from rlxrt.backends import CompiledGraph, compile
from rlxrt.config import Config
from rlxrt.errors import GenerationError
from rlxrt.sampling import probs, sample
from rlxrt.speculator import AcceptDecision, Context, DraftProposal, VerifyResult

from .kv import KVModel
from .state import StateModel, decoder_for
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


class ModelSpeculator:
    """A speculator that runs a graph of its own (``model``): its providers and its time in ORT."""

    model: KVModel | StateModel

    @property
    def providers(self) -> list[str]:
        return self.model.providers

    @property
    def run_seconds(self) -> float:
        return self.model.run_seconds


class DraftModel(ModelSpeculator):
    name = "draft-model"
    default_k = 4  # best at temperature 0 on the shipped pair (exporters/reference/results/bench.json)

    def __init__(self, draft: str | os.PathLike | CompiledGraph, config: Config | None = None):
        graph = draft if isinstance(draft, CompiledGraph) else compile(draft, config)
        self.model = decoder_for(graph)

    def bind(self, target: KVModel | StateModel) -> None:
        check_same_vocabulary(target, self.model)

    def reset(self) -> None:
        self.model.reset()

    def prefill(self, ctx: Context) -> None:
        """Read the prompt (all but its last token, like the target) before the first round."""
        if len(ctx.tokens) < self.model.max_positions:  # else propose drafts nothing anyway
            self.model.forward(ctx.tokens[self.model.length:-1])

    def propose(self, ctx: Context, k: int) -> DraftProposal:
        m = self.model
        k = min(k, m.max_positions - len(ctx.tokens))
        if k <= 0:
            return DraftProposal(np.zeros(0, np.int64))
        return draft_chain(m.forward(ctx.tokens[m.length:])[-1], k, ctx, lambda x: m.forward((x,))[0])

    def commit(self, ctx: Context, decision: AcceptDecision, verify: VerifyResult) -> None:
        self.model.commit(len(ctx.tokens) - 1)
