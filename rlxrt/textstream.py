"""Incremental text with stop strings: token ids in, safe text pieces out (pure Python).

A piece is released only when it can no longer become part of a stop string,
so a stop string that spans several tokens, or ends inside a run of accepted
tokens, is cut exactly: the returned text excludes it, and the token ids end
with the token that completed it.

    >>> pieces = iter(["Hel", "lo", " EN", "D", " more"])
    >>> ts = TextStream(lambda _id: next(pieces), stops=["END"])
    >>> [ts.push(i) for i in range(4)], ts.stop, ts.keep_tokens
    (['Hel', 'lo', ' ', ''], 'END', 4)
"""
from __future__ import annotations

from typing import Callable


class TextStream:
    def __init__(self, decode_step: Callable[[int], str | None], stops: list[str] = ()):
        self.decode_step = decode_step
        self.stops = [s for s in stops if s]
        self.longest = max((len(s) for s in self.stops), default=0)
        self.text = ""
        self.released = 0
        self.tokens = 0
        self.token_ends: list[int] = []
        self.stop: str | None = None
        """The stop string that ended the text, once found."""
        self.keep_tokens: int | None = None
        """Tokens to keep when a stop string was found: up to the one that completed it."""

    def push(self, token_id: int) -> str:
        """Add one token; returns the text that is now safe to show (may be empty)."""
        assert self.stop is None, "push after a stop string was found"
        if not self.stops:  # nothing to hold back: every piece is final at once
            piece = self.decode_step(token_id) or ""
            self.tokens += 1
            self.text += piece
            self.released = len(self.text)
            return piece
        before = len(self.text)
        self.text += self.decode_step(token_id) or ""
        self.tokens += 1
        self.token_ends.append(len(self.text))
        if self.stops and len(self.text) > before:
            start = max(0, before - self.longest + 1)
            hits = [(self.text.find(s, start), s) for s in self.stops]
            hits = [(pos, s) for pos, s in hits if pos >= 0]
            if hits:
                pos, s = min(hits)
                self.stop = s
                end = pos + len(s)
                self.keep_tokens = next(i + 1 for i, e in enumerate(self.token_ends) if e >= end)
                self.text = self.text[:pos]
                out = self.text[self.released:]
                self.released = len(self.text)
                return out
        safe = len(self.text) - self._held_back()
        out = self.text[self.released:safe] if safe > self.released else ""
        self.released = max(self.released, safe)
        return out

    def _held_back(self) -> int:
        """Length of the longest tail of the text that could still grow into a stop string."""
        for n in range(min(self.longest - 1, len(self.text)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0

    def finish(self) -> str:
        """The held-back text, when generation ends without a stop string."""
        out = self.text[self.released:]
        self.released = len(self.text)
        return out
