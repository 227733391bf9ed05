"""Session: a compiled target graph bound to a Speculator, serving requests one after another.

Each round proposes k tokens, verifies them in ONE target pass (k+1 rows),
applies the acceptance rule and commits. Without a speculator the same loop
runs with k = 0: plain decoding, the fair baseline.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from rlxrt.acceptance import greedy_accept, speculative_accept
from rlxrt.backends import CompiledGraph, compile
from rlxrt.config import Config
from rlxrt.errors import GenerationError, RlxrtError
from rlxrt.sampling import SamplingParams, make_rng, probs
from rlxrt.speculator import Context, DraftProposal, VerifyResult
from rlxrt.stats import RequestStats
from rlxrt.textstream import TextStream

from .state import decoder_for
from .text import codec_for

K_MAX = 32
_NOTHING = DraftProposal(np.zeros(0, np.int64))


@dataclass
class Generation:
    text: str
    """The generated text (prompt excluded; a matched stop string excluded)."""
    token_ids: list[int]
    """Generated token ids (an EOS token or the token completing a stop string included)."""
    finish_reason: str
    """"stop" (EOS token or stop string), "length" (max_new_tokens or max positions) or "cancelled"."""
    stats: RequestStats
    stop_reason: int | str | None = None
    """The EOS token id or the stop string that ended the request."""
    prompt_token_ids: list[int] = field(default_factory=list)


class Session:
    """Generate with a target model, optionally sped up by a speculator.

    ``target`` is a model directory made by ``rlxrt export`` (or its
    CompiledGraph); ``speculator`` is e.g. ``DraftModel(dir)`` or
    ``PromptLookup()``; ``k`` is the number of tokens drafted per round
    (default: the speculator's); ``adaptive_k`` grows k by 2 after a fully
    accepted round and shrinks it by 1 after a rejection, within 1..k_max.
    """

    def __init__(self, target: str | os.PathLike | CompiledGraph, speculator=None, config: Config | None = None,
                 *, k: int | None = None, adaptive_k: bool = False, k_max: int | None = None):
        graph = target if isinstance(target, CompiledGraph) else compile(target, config)
        self.target = decoder_for(graph)
        self.manifest = self.target.manifest
        self.codec = codec_for(graph)
        self.speculator = speculator
        if speculator is not None:
            speculator.bind(self.target)
        self.k = self._check_k(k if k is not None else getattr(speculator, "default_k", 4))
        self.adaptive_k = bool(adaptive_k)
        self.k_max = self._check_k(k_max if k_max is not None else max(self.k, min(2 * self.k, K_MAX)))
        self.stats = RequestStats(speculator=self._spec_name)
        """Totals over all requests served."""
        self.last: Generation | None = None
        """The last request's result (also set when a stream was abandoned)."""

    @property
    def _spec_name(self) -> str:
        return getattr(self.speculator, "name", "none") if self.speculator is not None else "none"

    @staticmethod
    def _check_k(k) -> int:
        if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or not 1 <= k <= K_MAX:
            raise GenerationError(f"k (tokens drafted per round) must be an integer in 1..{K_MAX}, got {k!r}")
        return int(k)

    # -- public API -------------------------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stop: Sequence[str] | None = None,
                 stop_token_ids: Sequence[int] | None = None, *, ignore_eos: bool = False,
                 k: int | None = None) -> Generation:
        """Generate a continuation of ``prompt`` (text or token ids) and return it with its stats."""
        for _ in self.stream(prompt, max_new_tokens, temperature, top_k, top_p, seed, stop, stop_token_ids,
                             ignore_eos=ignore_eos, k=k):
            pass
        assert self.last is not None
        return self.last

    def stream(self, prompt: str | Sequence[int], max_new_tokens: int = 128, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stop: Sequence[str] | None = None,
               stop_token_ids: Sequence[int] | None = None, *, ignore_eos: bool = False,
               k: int | None = None) -> Iterator[str]:
        """Like generate, but yields text pieces as they become final; ``session.last`` holds the result."""
        params = SamplingParams(temperature, top_k, top_p)
        prompt_ids = self._prompt_ids(prompt)
        if not isinstance(max_new_tokens, (int, np.integer)) or isinstance(max_new_tokens, bool) \
                or max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        stops = list(stop or [])
        if isinstance(stop, str):
            stops = [stop]
        if stops and self.codec is None:
            raise GenerationError("stop strings need a tokenizer, and this model was exported without one; "
                                  "use stop_token_ids")
        stop_ids = set() if ignore_eos else set(self.manifest.eos_token_ids)
        stop_ids |= set(self._check_ids(stop_token_ids or [], "stop_token_ids"))
        k = self._check_k(k) if k is not None else self.k
        ctx = Context(tokens=list(prompt_ids), params=params, rng=make_rng(seed))
        return self._run(ctx, int(max_new_tokens), k, stops, stop_ids)

    # -- internals ------------------------------------------------------------------------------------------
    def _check_ids(self, ids, what: str) -> list[int]:
        out = []
        for t in ids:
            if not isinstance(t, (int, np.integer)) or isinstance(t, bool) or not 0 <= t < self.manifest.vocab_size:
                raise GenerationError(f"{what} holds token id {t!r}, outside the vocabulary "
                                      f"(0..{self.manifest.vocab_size - 1})")
            out.append(int(t))
        return out

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.codec is None:
                raise GenerationError("this model was exported without a tokenizer; pass the prompt as token ids")
            ids = self.codec.encode(prompt)
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            ids = self._check_ids(list(np.asarray(prompt).reshape(-1).tolist()) if isinstance(prompt, np.ndarray)
                                  else prompt, "the prompt")
        else:
            raise GenerationError(f"prompt must be text or a sequence of token ids, got {type(prompt).__name__}")
        if not ids:
            raise GenerationError("the prompt is empty; pass at least one token or character")
        if len(ids) >= self.manifest.max_positions:
            raise GenerationError(f"the prompt has {len(ids)} tokens, but the model's max positions are "
                                  f"{self.manifest.max_positions}; shorten it to at most "
                                  f"{self.manifest.max_positions - 1} tokens")
        return ids

    def _run(self, ctx: Context, max_new: int, k: int, stops: list[str], stop_ids: set[int]) -> Iterator[str]:
        target, spec = self.target, self.speculator
        stats = RequestStats(prompt_tokens=len(ctx.tokens), speculator=self._spec_name,
                             providers={"target": list(target.providers)})
        if spec is not None:
            stats.providers["draft"] = list(getattr(spec, "providers", []))
        text = TextStream(self.codec.decoder(), stops) if self.codec is not None else None
        prompt_len = len(ctx.tokens)
        finish, reason = "cancelled", None
        run0 = target.run_seconds + getattr(spec, "run_seconds", 0.0)
        paused = 0.0
        t_start = t_decode = time.perf_counter()
        try:
            target.reset()
            if spec is not None:
                spec.reset()
            if prompt_len > 1:
                target.forward(ctx.tokens[:-1])
                if spec is not None and hasattr(spec, "prefill"):
                    spec.prefill(ctx)
            t_decode = time.perf_counter()
            stats.prefill_seconds = t_decode - t_start
            run0 = target.run_seconds + getattr(spec, "run_seconds", 0.0)  # decode only, like decode_seconds
            greedy = ctx.params.greedy
            k_now = k
            while True:
                generated = len(ctx.tokens) - prompt_len
                budget = min(max_new - generated, self.manifest.max_positions - len(ctx.tokens))
                if budget <= 0:
                    finish = "length"
                    break
                k_eff = min(k_now, budget - 1) if spec is not None else 0
                t0 = time.perf_counter()
                proposal = spec.propose(ctx, k_eff) if k_eff > 0 else _NOTHING
                t1 = time.perf_counter()
                drafted = proposal.tokens
                feed = np.empty(len(drafted) + 1, np.int64)
                feed[0] = ctx.tokens[-1]
                feed[1:] = drafted
                logits = target.forward(feed)
                t2 = time.perf_counter()
                if greedy:
                    verify = VerifyResult(logits, hidden=target.hidden)
                    decision = greedy_accept(logits.argmax(-1), drafted)
                else:
                    verify = VerifyResult(logits, probs(logits, ctx.params), target.hidden)
                    q = proposal.probs
                    decision = speculative_accept(verify.probs, q, drafted, ctx.rng)
                new = decision.tokens.tolist()
                ctx.tokens.extend(new)
                target.commit(len(ctx.tokens) - 1)
                if spec is not None:
                    spec.commit(ctx, decision, verify)
                stats.record_round(len(drafted), decision.accepted, decision.bonus)
                stats.draft_seconds += t1 - t0
                stats.target_seconds += t2 - t1
                if self.adaptive_k and spec is not None and len(drafted) == k_now:
                    k_now = min(self.k_max, k_now + 2) if decision.bonus else max(1, k_now - 1)
                hit = next((i for i, t in enumerate(new) if t in stop_ids), None)
                if hit is not None:
                    del ctx.tokens[len(ctx.tokens) - len(new) + hit + 1:]
                    new = new[:hit + 1]
                    finish, reason = "stop", new[-1]
                if text is not None:
                    for n, t in enumerate(new):
                        piece = text.push(t)
                        if text.stop is not None:
                            cut = len(ctx.tokens) - len(new) + n + 1 - (text.tokens - text.keep_tokens)
                            del ctx.tokens[cut:]
                            finish, reason = "stop", text.stop
                        if piece:
                            p0 = time.perf_counter()
                            yield piece
                            paused += time.perf_counter() - p0
                        if text.stop is not None:
                            break
                if finish == "stop":
                    break
            if text is not None and text.stop is None:
                tail = text.finish()
                if tail:
                    yield tail
        except RlxrtError:
            raise
        except Exception as exc:  # an ORT failure mid-request: typed, and the session stays usable
            raise GenerationError(f"generation failed: {type(exc).__name__}: {exc}") from exc
        finally:
            end = time.perf_counter()
            stats.decode_seconds = max(0.0, end - t_decode - paused)
            stats.run_seconds = target.run_seconds + getattr(spec, "run_seconds", 0.0) - run0
            out = ctx.tokens[prompt_len:]
            stats.emitted = len(out)
            gen_text = text.text if text is not None else ""
            self.last = Generation(gen_text, out, finish, stats, reason, ctx.tokens[:prompt_len])
            self.stats.add(stats)
