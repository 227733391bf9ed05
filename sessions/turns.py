"""Who may use a Session's caches now: one request at a time, never two mixed.

- A request from another thread waits until the current one ends (its ``generate`` returns, or its
  stream is exhausted, closed or garbage-collected): concurrent callers are serialised.
- A request from the same thread while one of that thread's streams is still open cancels that stream
  (waiting would deadlock: only this thread could finish it). The cancelled stream ends, the next time
  it is resumed, with ``finish_reason == "cancelled"`` and without touching the caches again.
- Every step of a stream (one ``next()``) holds ``step``; a request that cancels a stream first waits for
  a step of it that another thread may be running, so the two never touch the caches at once.
- Under a ``Driver`` each task counts as a thread of its own, but none can wait: a request while another
  task's request holds the caches is refused (its step may be paused inside a batch's step, and waiting
  would stop the one thread that runs both).
"""
from __future__ import annotations

import threading

from rlxrt.errors import GenerationError

from .driver import task_or_thread


class Claim:
    """One request's hold on the caches."""

    __slots__ = ("thread", "seq", "cancelled")

    def __init__(self, thread: object, seq: int):
        self.thread = thread
        """The thread (or a Driver's task) that started the request (a stream may be resumed from others)."""
        self.seq = seq
        """Order in which requests started (later requests have larger numbers)."""
        self.cancelled = False
        """Set when a newer request of the same thread took the caches over."""


class Turns:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._owner: Claim | None = None
        self._seq = 0
        self.step = threading.Lock()
        """Held while a request's code runs (never while it waits in ``take``)."""

    def take(self) -> Claim:
        """Wait for the caches (or take them from this thread's own open stream) and hold them."""
        me, driven = task_or_thread()
        cancelled = None
        with self._cond:
            while self._owner is not None:
                if self._owner.thread == me:
                    cancelled = self._owner
                    cancelled.cancelled = True
                    break
                if driven:
                    raise GenerationError("this Session is serving a request of another task of the Driver; a "
                                          "Session serves one request at a time: give each task a Session of its "
                                          "own")
                self._cond.wait()
            self._seq += 1
            self._owner = Claim(me, self._seq)
            claim = self._owner
        if cancelled is not None:  # a step of it may be running on another thread: let it finish first
            with self.step:
                pass
        return claim

    def give_back(self, claim: Claim) -> None:
        with self._cond:
            if self._owner is claim:
                self._owner = None
                self._cond.notify_all()

    @property
    def lock(self) -> threading.Condition:
        """Held briefly to publish a finished request's results (``session.last``, totals)."""
        return self._cond
