"""Session: a compiled target graph bound to a Speculator, serving requests one after another.

Each round proposes k tokens, verifies them in ONE target pass (k+1 rows),
applies the acceptance rule and commits. Without a speculator the same loop
runs with k = 0: plain decoding, the fair baseline.

Threading: a Session serves one request at a time (see ``turns.py``): calls from
several threads are serialised; a new request from the thread that still holds
an open stream of the same Session cancels that stream. For parallel requests
create one Session each; they can share one compiled graph.
"""
from __future__ import annotations

import logging
import numbers
import os
import time
import weakref
from typing import Iterator, Sequence

import numpy as np

from rlxrt.backends import CompiledGraph, compile
from rlxrt.checks import as_bool, as_int
from rlxrt.config import Config, check_config
from rlxrt.errors import GenerationError, ModelFormatError
from rlxrt.limits import K_MAX, MAX_NEW_TOKENS, MAX_STOP_LENGTH, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from rlxrt.sampling import SamplingParams, make_rng
from rlxrt.speculator import Context, Speculator
from rlxrt.stats import RequestStats
from rlxrt.textstream import TextStream

from .chat import NO_TEMPLATE, ChatTemplate, chat_template_for
from .k_choice import KChoice
from .round import Round, fixed_rows
from .state import decoder_for
from .text import codec_for
from .stream import Generation, Stream, _Result
from .turns import Turns

HALF = ("float16", "bfloat16")
log = logging.getLogger("rlxrt")


class Session:
    """Generate with a target model, optionally sped up by a speculator.

    ``target`` is a model directory made by ``rlxrt export`` (or its
    CompiledGraph: several Sessions may share one); ``speculator`` is e.g.
    ``DraftModel(dir)`` or ``PromptLookup()`` and belongs to this Session alone;
    ``k`` is the number of tokens drafted per round (default: the speculator's);
    ``adaptive_k`` picks each round's k in 1..k_max from what this Session's rounds have cost and earned
    (the k with the most expected tokens per second; see ``sessions/k_choice.py``), starting from ``k``;
    a request's own ``k`` then caps its rounds. A request with a ``seed`` drafts a fixed k (its own, else
    ``k``) even then, so that the same seed gives the same sample alone or beside other requests.
    """

    def __init__(self, target: "str | os.PathLike | CompiledGraph | Batch", speculator: Speculator | None = None,
                 config: Config | None = None, *, k: int | None = None, adaptive_k: bool = False,
                 k_max: int | None = None):
        if speculator is not None and not isinstance(speculator, Speculator):
            raise GenerationError(f"speculator must be an rlxrt Speculator (DraftModel, PromptLookup, MtpHead or a "
                                  f"subclass of rlxrt.speculator.Speculator), got {type(speculator).__name__}")
        if config is not None:
            check_config(config)
        from .batch import Batch

        if isinstance(target, Batch):  # one slot of a batched graph, for this Session's life
            graph, self.target = target.graph, target.slot()
            weakref.finalize(self, target.release, self.target)
            try:
                self._setup(graph, speculator, k, adaptive_k, k_max)
            except BaseException:  # refused: the slot goes back now, not when the refused Session is collected
                target.release(self.target)
                raise
        else:
            graph = target if isinstance(target, CompiledGraph) else compile(target, config)
            self.target = decoder_for(graph)
            self._setup(graph, speculator, k, adaptive_k, k_max)

    def _setup(self, graph: CompiledGraph, speculator: Speculator | None, k: int | None, adaptive_k: bool,
               k_max: int | None) -> None:
        self.manifest = self.target.manifest
        if self.target.vocab_ids is not None:
            raise ModelFormatError(
                f"{graph.path.parent} is a draft-only export: its logits cover {self.target.logits_width} of the "
                f"{self.manifest.vocab_size} tokens (exported with --draft-vocab), so it cannot be the target; bind "
                "it as the draft (DraftModel(dir) / --draft DIR) of a full-vocabulary target, or re-export it "
                "without --draft-vocab")
        if speculator is not None and graph.rows_mixed:
            raise GenerationError(f"{graph.path.parent} cannot be speculated over exactly: {graph.rows_mixed}")
        self.rows = fixed_rows(graph)
        """Rows of every decoding call of the target (``Config.fixed_rows``; 0: as many as it needs)."""
        if speculator is not None and not graph.rows_exact and not self.rows and self.manifest.dtype in HALF:
            log.warning("speculating over %s, a %s graph on kernels that compute a verification's rows apart from "
                        "one-row steps: they agree to %s rounding, so greedy output can part from plain greedy "
                        "output where two tokens tie that closely (docs/exactness.md)", graph.path.parent,
                        self.manifest.dtype, self.manifest.dtype)
        self.codec = codec_for(graph)
        self._graph = graph
        self._chat: ChatTemplate | None = None
        self.k = self._check_rows(self._check_k(k if k is not None else speculator.default_k if speculator else 4))
        self.adaptive_k = as_bool(adaptive_k, "adaptive_k")
        self.k_max = self._check_k(k_max if k_max is not None else max(self.k, min(2 * self.k, K_MAX)), "k_max")
        if k_max is None and self.rows:  # the default ceiling stays within the fixed rows
            self.k_max = min(self.k_max, self.rows - 1)
        self._check_rows(self.k_max, "k_max")
        self.speculator = speculator
        self._k_choice = None if not self.adaptive_k or speculator is None else \
            KChoice(min(self.k, self.k_max), self.k_max, speculator.drafters)
        if speculator is not None:
            speculator.attach(self)
            try:
                speculator.bind(self.target)
            except BaseException:
                speculator.detach(self)
                raise
            if self.target.shared:
                self.target.draft_sources(speculator.source_names or (speculator.name,), speculator.batched_sources)
        self._turns = Turns()
        self._last_seq = 0
        self.stats = RequestStats(speculator=self._spec_name)
        """Totals over all requests served."""
        self.last: Generation | None = None
        """The result of the most recently started request that has ended (an older stream that ends later,
        e.g. a cancelled one, does not replace it; ``Stream.generation`` has each request's own)."""

    @property
    def _spec_name(self) -> str:
        return self.speculator.name if self.speculator is not None else "none"

    @property
    def speculator_name(self) -> str:
        """The speculator's name (``draft``, ``prompt-lookup``, ``mtp``) or ``none`` for plain decoding."""
        return self._spec_name

    def prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """The checked token ids of ``prompt`` (text or ids), as a request would run it."""
        return self._prompt_ids(prompt)

    @staticmethod
    def _check_k(k, name: str = "k (tokens drafted per round)") -> int:
        return as_int(k, name, 1, K_MAX)

    def _check_rows(self, k: int, name: str = "k") -> int:
        """``k`` when it fits the fixed rows of every call (a round feeds k + 1 rows)."""
        if self.rows and k + 1 > self.rows:
            raise GenerationError(f"{name}={k} drafts more than the target's fixed rows leave room for "
                                  f"({self.rows} rows: k <= {self.rows - 1}); set fixed_rows = {k + 1} in the config, "
                                  f"or pass k <= {self.rows - 1}")
        return k

    # -- public API -------------------------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stop: Sequence[str] | None = None,
                 stop_token_ids: Sequence[int] | None = None, *, ignore_eos: bool = False,
                 k: int | None = None) -> Generation:
        """Generate a continuation of ``prompt`` (text or token ids) and return it with its stats."""
        stream = self.stream(prompt, max_new_tokens, temperature, top_k, top_p, seed, stop, stop_token_ids,
                             ignore_eos=ignore_eos, k=k)
        with stream:
            for _ in stream:
                pass
        assert stream.generation is not None
        return stream.generation

    def stream(self, prompt: str | Sequence[int], max_new_tokens: int = 128, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stop: Sequence[str] | None = None,
               stop_token_ids: Sequence[int] | None = None, *, ignore_eos: bool = False,
               k: int | None = None) -> Stream:
        """Like generate, but a ``Stream`` of text pieces as they become final; every argument is checked
        here, before anything runs. The request takes the session on the first ``next()``."""
        params = SamplingParams(temperature, top_k, top_p)
        prompt_ids = self._prompt_ids(prompt)
        max_new = as_int(max_new_tokens, "max_new_tokens", 1, MAX_NEW_TOKENS)
        stops = self._check_stops(stop)
        stop_ids = set() if as_bool(ignore_eos, "ignore_eos") else set(self.manifest.eos_token_ids)
        if stop_token_ids is not None and (isinstance(stop_token_ids, (str, bytes))
                                           or not isinstance(stop_token_ids, (Sequence, np.ndarray))):
            raise GenerationError(f"stop_token_ids must be a list of token ids, got {type(stop_token_ids).__name__} "
                                  f"{stop_token_ids!r}")
        if stop_token_ids is not None and hasattr(stop_token_ids, "__len__") \
                and len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise GenerationError(f"stop_token_ids holds {len(stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} "
                                  "are allowed")
        extra = list(stop_token_ids) if stop_token_ids is not None else []
        if len(extra) > MAX_STOP_TOKEN_IDS:
            raise GenerationError(f"stop_token_ids holds {len(extra)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed")
        stop_ids |= set(self._check_ids(extra, "stop_token_ids"))
        # with adaptive_k a request's own k caps its rounds; otherwise it is their length. A seeded request
        # never adapts: k follows the clock there, and its sample must not (docs/exactness.md, "Seeds")
        adaptive = self._k_choice is not None and seed is None
        if k is not None:
            k = self._check_rows(self._check_k(k)) if self.speculator is not None else self._check_k(k)
        else:  # adaptive: a cap only; a seeded request under adaptive_k: where adaptive_k starts
            k = K_MAX if adaptive else self.k if self._k_choice is None else min(self.k, self.k_max)
        ctx = Context(tokens=list(prompt_ids), params=params, rng=make_rng(seed))
        result = _Result(prompt_ids)
        return Stream(self._run(result, ctx, max_new, k, stops, stop_ids, adaptive, seed is None), result,
                      self._turns)

    def chat(self, messages: Sequence[dict], max_new_tokens: int = 128, **kwargs) -> Generation:
        """Reply to ``messages`` ([{"role": "system" | "user" | "assistant", "content": text}, ...]) rendered
        with the model's chat template; the model's end-of-turn token ends the reply. Takes generate's
        keyword arguments."""
        stream = self.chat_stream(messages, max_new_tokens, **kwargs)
        with stream:
            for _ in stream:
                pass
        assert stream.generation is not None
        return stream.generation

    def chat_stream(self, messages: Sequence[dict], max_new_tokens: int = 128, *,
                    stop_token_ids: Sequence[int] | None = None, **kwargs) -> Stream:
        """Like chat, but a ``Stream`` of text pieces (see ``stream``)."""
        ids = self.chat_prompt(messages)
        ends = list(self._chat_template().end_of_turn_ids)
        if stop_token_ids is not None:
            if isinstance(stop_token_ids, (str, bytes)) or not isinstance(stop_token_ids, Sequence):
                raise GenerationError(f"stop_token_ids must be a list of token ids, got {stop_token_ids!r}")
            ends += list(stop_token_ids)
        return self.stream(ids, max_new_tokens, stop_token_ids=ends, **kwargs)

    def chat_prompt(self, messages: Sequence[dict], *, seconds: float | None = None) -> list[int]:
        """The prompt token ids of ``messages`` under the model's chat template (with the assistant's opener);
        the template renders within ``seconds`` (default ``limits.TEMPLATE_SECONDS``) or the request fails."""
        text = self.chat_text(messages, seconds=seconds)
        assert self.codec is not None  # an export keeps a template only with its tokenizer
        return self.codec.encode(text, add_special_tokens=False)

    def chat_text(self, messages: Sequence[dict], *, seconds: float | None = None) -> str:
        """``messages`` rendered with the model's chat template, the assistant's opener included."""
        return self._chat_template().render(messages, add_generation_prompt=True, max_chars=self._max_prompt_bytes,
                                            seconds=seconds)

    @property
    def _max_prompt_bytes(self) -> int:
        assert self.codec is not None
        return self.codec.max_text_bytes(self.manifest.max_positions)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.manifest.chat)

    def _chat_template(self) -> ChatTemplate:
        if self._chat is None:
            template = chat_template_for(self._graph)
            if template is None:
                raise GenerationError(NO_TEMPLATE)
            self._chat = template
        return self._chat

    # -- internals ------------------------------------------------------------------------------------------
    def _check_stops(self, stop) -> list[str]:
        if isinstance(stop, (bytes, bytearray)):
            raise GenerationError(f"stop must be text or a list of texts, got bytes {bytes(stop)[:40]!r}; decode it")
        if stop is not None and not isinstance(stop, (str, Sequence)):
            raise GenerationError(f"stop must be text or a list of texts, got {type(stop).__name__} {stop!r}")
        if stop is not None and hasattr(stop, "__len__") and not isinstance(stop, str) and len(stop) > MAX_STOP_STRINGS:
            raise GenerationError(f"{len(stop)} stop strings given; at most {MAX_STOP_STRINGS} are allowed")
        stops = [stop] if isinstance(stop, str) else list(stop) if stop is not None else []
        if len(stops) > MAX_STOP_STRINGS:
            raise GenerationError(f"{len(stops)} stop strings given; at most {MAX_STOP_STRINGS} are allowed")
        for s in stops:
            if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_LENGTH:
                raise GenerationError(f"a stop string must be text of 1..{MAX_STOP_LENGTH} characters, got {s!r}")
        if stops and self.codec is None:
            raise GenerationError("stop strings need a tokenizer, and this model was exported without one; "
                                  "use stop_token_ids")
        return stops

    def _check_ids(self, ids, what: str) -> list[int]:
        v = self.manifest.vocab_size
        out = []
        for t in ids:
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Integral) or not 0 <= t < v:
                raise GenerationError(f"{what} holds token id {t!r}, outside the vocabulary (0..{v - 1}); pass "
                                      "integer ids the model's tokenizer produced")
            out.append(int(t))
        return out

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.codec is None:
                raise GenerationError("this model was exported without a tokenizer; pass the prompt as token ids")
            if len(prompt) > self._max_prompt_bytes or len(prompt.encode("utf-8", "surrogatepass")) > \
                    self._max_prompt_bytes:  # checked before tokenising it
                raise GenerationError(f"the prompt has {len(prompt)} characters, more than the "
                                      f"{self.manifest.max_positions} positions of the model can hold; shorten it")
            ids = self.codec.encode(prompt)
        elif isinstance(prompt, np.ndarray):
            if prompt.ndim != 1:
                raise GenerationError(f"a prompt of token ids must be one-dimensional, got shape {prompt.shape}")
            ids = self._check_ids(prompt.tolist() if prompt.dtype.kind in "iu" else list(prompt), "the prompt")
        elif isinstance(prompt, (list, tuple)):
            ids = self._check_ids(prompt, "the prompt")
        else:
            raise GenerationError(f"prompt must be text or a sequence of token ids, got {type(prompt).__name__}")
        if not ids:
            raise GenerationError("the prompt is empty; pass at least one token or character")
        if len(ids) >= self.manifest.max_positions:
            raise GenerationError(f"the prompt has {len(ids)} tokens, but the model's max positions are "
                                  f"{self.manifest.max_positions}; shorten it to at most "
                                  f"{self.manifest.max_positions - 1} tokens")
        return ids

    def _run(self, result: _Result, ctx: Context, max_new: int, k: int, stops: list[str],
             stop_ids: set[int], adaptive: bool, planned: bool = True) -> Iterator[str]:
        """One request, round by round; ``planned``: a batched slot's plan may lower its k (not for a seeded
        request, whose k is part of its seed's contract)."""
        claim = result.claim  # taken by Stream.__next__ before this first step
        target, spec = self.target, self.speculator
        shared = target.shared  # a slot of a Batch: its steps run with other Sessions' rounds
        prompt_len = len(ctx.tokens)
        finish, reason, text, paused = "error", None, None, 0.0
        stats = RequestStats(prompt_tokens=prompt_len, speculator=self._spec_name)
        run0 = 0.0
        t_start = t_decode = time.perf_counter()
        try:
            stats.providers = {"target": list(target.providers)}
            if spec is not None:
                stats.providers["draft"] = list(spec.providers)
            text = TextStream(self.codec.decoder(), stops) if self.codec is not None else None
            run0 = target.run_seconds + (spec.run_seconds if spec else 0.0)
            rounds = Round(ctx, target, spec, self.rows)
            rounds.prefill()
            t_decode = time.perf_counter()
            stats.prefill_seconds = t_decode - t_start
            run0 = target.run_seconds + (spec.run_seconds if spec else 0.0)  # decode only, like decode_seconds
            pad = self.rows - 1 if self.rows else 0  # a fixed-rows call writes that many positions past its tokens
            choice = self._k_choice if spec is not None and adaptive else None
            several = spec is not None and spec.drafters > 1  # a Cascade: a batch plans each source's k
            adaptive_ks = choice.ks if several and choice is not None else None
            k_now = min(choice.k, k) if choice is not None else k
            if spec is not None and spec.drafters > 1 and self._k_choice is not None:
                spec.set_ks(choice.ks if choice is not None else [k] * spec.drafters)
            while True:
                generated = len(ctx.tokens) - prompt_len
                budget = min(max_new - generated, self.manifest.max_positions - len(ctx.tokens) - pad)
                if budget <= 0:
                    finish = "length"
                    break
                t0 = time.perf_counter()
                k_round = min(k_now, budget - 1) if spec is not None else 0
                if shared and planned and spec is not None:
                    k_round = target.k_cap(k_round, adaptive_ks)
                    if several:
                        spec.set_ks(target.caps)
                decision = rounds.run(k_round)
                new = rounds.new
                stats.record_round(rounds.drafted, decision.accepted, decision.bonus)
                stats.draft_seconds += rounds.draft_seconds
                stats.target_seconds += rounds.target_seconds
                if shared:
                    target.observe(rounds.drafted, decision.accepted, spec.drafted_by if spec else 0,
                                   rounds.draft_seconds)
                if choice is not None:
                    k_now = min(k, choice.observe(rounds.drafted, decision.accepted, time.perf_counter() - t0,
                                                  spec.drafted_by))
                    if spec.drafters > 1:
                        spec.set_ks(choice.ks)
                hit = None if stop_ids.isdisjoint(new) else next(i for i, t in enumerate(new) if t in stop_ids)
                if hit is not None:
                    rounds.cut(len(ctx.tokens) - len(new) + hit + 1)
                    new = new[:hit + 1]
                    finish, reason = "stop", new[-1]
                said = False
                if text is not None:
                    for n, t in enumerate(new):
                        piece = text.push(t)
                        if text.stop is not None:
                            rounds.cut(len(ctx.tokens) - len(new) + n + 1 - (text.tokens - text.keep_tokens))
                            finish, reason = "stop", text.stop
                        if piece:
                            said = True
                            p0 = time.perf_counter()
                            yield piece
                            paused += time.perf_counter() - p0
                            if claim.cancelled:  # a newer request of this thread owns the caches now
                                finish = "cancelled"
                                return
                        if text.stop is not None:
                            break
                if finish == "stop":
                    break
                if not said:  # nothing final this round (special tokens, a possible stop string, no tokenizer):
                    p0 = time.perf_counter()  # still one step per round, so a caller can stop between rounds
                    yield ""
                    paused += time.perf_counter() - p0
                    if claim.cancelled:
                        finish = "cancelled"
                        return
            if text is not None and text.stop is None:
                tail = text.finish()
                if tail:
                    yield tail
        except GeneratorExit:  # the caller closed the stream (after its last piece, the finish stands)
            if finish == "error":
                finish = "cancelled"
            raise
        finally:
            end = time.perf_counter()
            if shared:
                target.idle()
            if not claim.cancelled:
                stats.run_seconds = target.run_seconds + (spec.run_seconds if spec else 0.0) - run0
            self._turns.give_back(claim)
            stats.decode_seconds = max(0.0, end - t_decode - paused)
            out = ctx.tokens[prompt_len:]
            stats.emitted = len(out)
            result.generation = Generation(text.text if text is not None else "", out, finish, stats, reason,
                                           ctx.tokens[:prompt_len])
            with self._turns.lock:
                self.stats.add(stats)
                if claim.seq > self._last_seq:
                    self._last_seq = claim.seq
                    self.last = result.generation
