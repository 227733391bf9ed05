"""One speculative round, a room of its own: the speculator proposes, a verifier runs ONE target pass and
decides, and ``Round`` — the one owner of the committed sequence — applies the decision and commits target and
speculator. The request's life around it (budget, stop strings, cancellation, streaming, stats) is
``Session._run``'s.

The pending-token rule: the target has read every committed token but the last, the *pending* token, which
the next call feeds first (``Context.read``). A round feeds ``[pending, *drafted]`` (k + 1 rows: row i is the
target's distribution after the context and ``drafted[:i]``), and after it the target keeps ``Context.read``
positions, whatever it was fed: a rollback is that length.

A verifier is chosen once per request (``verifier_for``) and returns the decision: ``greedy_ids`` (a graph
with a greedy head returns each row's argmax, no logits), ``greedy_logits`` (argmax of the logits), ``sampled``
(the acceptance rule over the transformed distributions). With fixed rows (``Config.fixed_rows``) every call
feeds the same number of rows, padded after the drafts, and a verifier reads only the rows up to the last draft:
plain steps and verifications then run the same kernels (docs/exactness.md, "Fixed rows"). A tree verifier would be one more, over a
tree-shaped proposal; a batched step runs the same round over several sequences (docs/design.md).
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from rlxrt.acceptance import greedy_accept, speculative_accept
from rlxrt.errors import GenerationError
from rlxrt.limits import K_MAX
from rlxrt.sampling import probs
from rlxrt.speculator import AcceptDecision, Context, DraftProposal, Prefill, Speculator, VerifyResult

from .decoder import Decoder

NOTHING = DraftProposal(np.zeros(0, np.int64))
NAN = "the model produced NaN logits; check the export (e.g. fp16 overflow) or use the fp32 variant"
_ROWS = np.arange(K_MAX + 1)

Verifier = Callable[[Decoder, np.ndarray, DraftProposal, Context], "tuple[AcceptDecision, VerifyResult]"]
"""``verify(target, feed, proposal, ctx)``: one target pass over ``feed`` ([pending, *drafted]) and the
decision on ``proposal.tokens``."""


def greedy_ids(target: Decoder, feed: np.ndarray, proposal: DraftProposal, ctx: Context):
    """Greedy over a graph with a greedy head: the argmax ids, no logits."""
    top = target.forward_ids(feed)[:len(proposal.tokens) + 1]  # padding rows, if any, are not read
    if top.min() < 0 and (top == -1).any():  # -1: not finite; -2: after a rejection, not read
        raise GenerationError(NAN)
    return greedy_accept(top, proposal.tokens), VerifyResult(None, hidden=target.hidden)


def greedy_logits(target: Decoder, feed: np.ndarray, proposal: DraftProposal, ctx: Context):
    logits = target.forward(feed)[:len(proposal.tokens) + 1]
    return greedy_accept(_argmax(logits), proposal.tokens), VerifyResult(logits, hidden=target.hidden)


def sampled(target: Decoder, feed: np.ndarray, proposal: DraftProposal, ctx: Context):
    logits = target.forward(feed)[:len(proposal.tokens) + 1]
    verify = VerifyResult(logits, probs(logits, ctx.params), target.hidden)
    return speculative_accept(verify.probs, proposal.probs, proposal.tokens, ctx.rng), verify


def verifier_for(ctx: Context, target: Decoder) -> Verifier:
    """The verifier of a request: chosen once, from its sampling parameters and what the target offers."""
    if not ctx.params.greedy:
        return sampled
    return greedy_ids if target.greedy_ids else greedy_logits


class Round:
    """The committed sequence of one request (``ctx.tokens``) and the rounds that extend it: the only place
    that feeds the target, applies a decision and commits target and speculator."""

    drafted = 0
    """Tokens the last round's speculator proposed."""
    new: list[int] = []
    """The tokens the last round committed (its decision's, as a list)."""
    draft_seconds = 0.0
    target_seconds = 0.0
    """The last round's time in ``propose``, and in the target's pass with the decision."""

    def __init__(self, ctx: Context, target: Decoder, speculator: Speculator | None, rows: int = 0):
        """``rows``: the fixed rows of every call (0: each call feeds the pending token and the drafts)."""
        self.ctx, self.target, self.spec, self.rows = ctx, target, speculator, rows
        self.verify = verifier_for(ctx, target)
        self._feed = np.empty(K_MAX + 1, np.int64)  # the pending token and the drafts of a round

    def prefill(self) -> None:
        """Start the request: both forget the previous one, the target reads the prompt but its pending
        token (its logits are not needed), the speculator reads what it wants of it."""
        target, spec, ctx = self.target, self.spec, self.ctx
        target.reset()
        if spec is not None:
            spec.reset()
        if ctx.read > 0:
            (target.forward_ids if target.greedy_ids else target.forward)(ctx.tokens[:ctx.read], rows=1)
            if spec is not None:
                spec.prefill(ctx, Prefill(hidden=target.hidden))

    def run(self, k: int) -> AcceptDecision:
        """One round drafting at most ``k`` tokens (0: a plain step); the committed sequence grows by the
        decision's tokens, which it returns (the round's figures stay in ``drafted`` and the seconds)."""
        spec, ctx = self.spec, self.ctx
        t0 = time.perf_counter()
        proposal = spec.propose(ctx, k) if k > 0 and spec is not None else NOTHING
        t1 = time.perf_counter()
        drafted = proposal.tokens
        if len(drafted) > k:  # more would overrun max_new_tokens and the context
            raise GenerationError(_overrun(spec, k, len(drafted)))
        feed = self._feed[:max(len(drafted) + 1, self.rows)]
        feed[0] = ctx.tokens[-1]
        feed[1:len(drafted) + 1] = drafted
        if self.rows:
            feed[len(drafted) + 1:] = feed[0]  # padding: written past the committed length, never read
        decision, verify = self.verify(self.target, feed, proposal, ctx)
        t2 = time.perf_counter()
        self.new = decision.tokens.tolist()
        ctx.tokens.extend(self.new)
        self.target.commit(ctx.read)
        if spec is not None:
            spec.commit(ctx, decision, verify)
        self.drafted, self.draft_seconds, self.target_seconds = len(drafted), t1 - t0, t2 - t1
        return decision

    def cut(self, length: int) -> None:
        """End the sequence at ``length`` tokens (a stop token or string was reached; no round follows)."""
        del self.ctx.tokens[length:]


AUTO_ROWS = 9
"""``fixed_rows = auto`` off the CPU: room for k up to 8 (adaptive k's default ceiling at k = 4)."""


def fixed_rows(graph) -> int:
    """The rows every decoding call of ``graph`` feeds (0: as many as it needs): ``Config.fixed_rows``, where
    ``auto`` (None) means ``AUTO_ROWS`` for a target that runs on anything but the CPU."""
    rows = graph.config.fixed_rows
    if rows is None:
        return AUTO_ROWS if graph.providers and graph.providers[0] != "cpu" else 0
    return rows


def _overrun(spec: Speculator, k: int, got: int) -> str:
    return (f"the speculator {type(spec).__name__} proposed {got} tokens when asked for at most {k}; "
            "Speculator.propose(ctx, k) must return at most k tokens (fix the speculator)")


def _argmax(logits: np.ndarray) -> np.ndarray:
    """Row argmax [n]; a NaN row (a broken model) is an error, never a silent token. NumPy's argmax lands
    on a row's first NaN, so only the n picked values need a look."""
    top = logits.argmax(-1)
    if len(top) == 1:
        picked = logits[0, top[0]]
        bad = picked != picked  # NaN
    else:
        bad = np.isnan(logits[_ROWS[:len(top)], top]).any()
    if bad:
        raise GenerationError(NAN)
    return top
