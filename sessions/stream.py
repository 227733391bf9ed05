"""What a request hands back: its ``Generation`` (text, tokens, finish reason, stats) and, while it runs, its
``Stream`` of text pieces; ``_Result`` is what the two share with the request's generator."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from rlxrt.errors import GenerationError
from rlxrt.stats import RequestStats

from .driver import running
from .turns import Claim, Turns


@dataclass
class Generation:
    text: str
    """The generated text (prompt excluded; a matched stop string excluded)."""
    token_ids: list[int]
    """Generated token ids (an EOS token or the token completing a stop string included)."""
    finish_reason: str
    """"stop" (EOS token or stop string), "length" (max_new_tokens or max positions), "cancelled" (the stream
    was closed, or a newer request of the same thread took the session over) or "error" (an exception
    ended it; it was raised to the caller)."""
    stats: RequestStats
    stop_reason: int | str | None = None
    """The EOS token id or the stop string that ended the request."""
    prompt_token_ids: list[int] = field(default_factory=list)


class _Result:
    """What a request's generator shares with its Stream: the claim it runs under and the Generation it
    leaves (no reference back to the Stream: an abandoned stream is freed, and its claim given back, as soon
    as the caller drops it)."""

    __slots__ = ("generation", "claim", "prompt_ids")

    def __init__(self, prompt_ids: list[int]) -> None:
        self.generation: Generation | None = None
        self.claim: Claim | None = None
        self.prompt_ids = prompt_ids


class Stream:
    """The text pieces of one request as they become final; ``generation`` holds the result once it ends.
    A round that makes no text final (special tokens, text that may begin a stop string) yields ``""``, so
    every ``next()`` is at most one round.

    Use it as an iterator, or as a context manager that closes it (ending it as "cancelled" if unfinished)::

        with session.stream("def f(") as s:
            for piece in s:
                print(piece, end="")
        print(s.generation.finish_reason)
    """

    def __init__(self, pieces: Iterator[str], result: _Result, turns: Turns):
        self._pieces, self._result, self._turns = pieces, result, turns
        self._closed = False

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> str:
        if self._closed:
            raise StopIteration
        if self._result.claim is None:  # the request starts: wait for the session (never inside a step)
            self._result.claim = self._turns.take()
        step = self._turns.step
        if not step.acquire(blocking=False):  # held: another thread, or a task, is in a step of this stream
            if running() is not None:  # a task cannot wait: the step's task may be paused on this thread
                raise GenerationError("this stream is being read by another task of the Driver; read a stream "
                                      "from one task at a time")
            step.acquire()
        try:
            return next(self._pieces)
        finally:
            step.release()

    def close(self) -> None:
        """End the request now (its generation says "cancelled") and free the session for the next one."""
        if self._result.claim is None and not self._closed:  # never started: nothing ran, nothing to free
            self._result.generation = Generation("", [], "cancelled", RequestStats(), None,
                                                 list(self._result.prompt_ids))
        self._closed = True
        self._pieces.close()

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def generation(self) -> Generation | None:
        """The request's result: None until the stream ended (exhausted, closed, cancelled or failed)."""
        return self._result.generation
