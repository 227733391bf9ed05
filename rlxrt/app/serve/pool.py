"""A pool of worker threads, each owning one Session, behind a bounded queue.

A request is a ``Job``: the worker runs it round by round and hands its events (``start``, text as it comes,
the final ``Generation`` or an error) to the event loop that waits for them. Between rounds the worker checks
whether the client went away (``cancel``) or the request ran past its deadline, so a disconnected or timed-out
request frees its worker at the next round. Sessions are one per worker (a Session serves one request at a
time); they share the compiled graphs, which ONNX Runtime runs from several threads at once.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from rlxrt.errors import RlxrtError
from rlxrt.sessions.driver import running

log = logging.getLogger("rlxrt.serve")


@dataclass
class Work:
    """What to generate: prompt token ids and Session.stream's keyword arguments."""

    prompt_ids: list[int]
    kwargs: dict[str, Any]


class QueueFull(RlxrtError):
    """Every worker is busy and the queue is full: the client should retry later (HTTP 429)."""


class Closed(RlxrtError):
    """The pool is shutting down and takes no new requests (HTTP 503)."""


@dataclass
class Job:
    work: Work
    loop: asyncio.AbstractEventLoop
    deadline: float
    """time.monotonic() after which the request ends as timed out."""
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    """Set when the client went away: the worker stops at its next round."""
    arrived: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    started: bool = False
    """A worker took it (set on the worker thread under the pool's lock; read by the watcher)."""
    forgotten: bool = False
    """Its client went away, or its deadline passed, while it waited for a worker: it no longer holds a place in
    the queue (``Pool.forget``), and the worker that takes it skips it."""
    timed_out: bool = False
    failed: bool = False
    """An exception ended it (reported to the client)."""
    streaming: bool = True
    """The client reads the text as it comes; a request answered whole is told only its end (no text events)."""
    _text: list[str] = field(default_factory=list)
    _text_lock: threading.Lock = field(default_factory=threading.Lock)

    def emit(self, kind: str, value: Any = None) -> None:
        self._call(self.events.put_nowait, (kind, value))

    def text(self, piece: str) -> None:
        """Hand a piece of text to the event loop. Pieces that come before the loop took the last ones go as one
        "text" event: the tokens a speculative round accepted come at once, and go as one SSE chunk and one
        wake-up of the loop, not one each; under load the loop's lag joins more. Order is kept: every event
        goes through the loop's queue of callbacks, first in first out."""
        if not self.streaming:
            return
        with self._text_lock:
            self._text.append(piece)
            if len(self._text) > 1:  # a hand-over is on its way and takes this piece too
                return
        self._call(self._hand_text)

    def _hand_text(self) -> None:
        with self._text_lock:
            text = "".join(self._text)
            self._text.clear()
        self.events.put_nowait(("text", text))

    def _call(self, fn, *args) -> None:
        """Hand ``fn(*args)`` to the event loop: from a driver's task, just before its next step of requests'
        rounds (``Driver.defer``), so the loop runs it while that step runs outside the interpreter lock."""
        driver = running()
        if driver is not None:
            driver.defer(self._post, fn, args)
        else:
            self._post(fn, args)

    def _post(self, fn, args: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is waiting any more
            self.cancel.set()


class Pool:
    """``workers`` Sessions from ``make_session()``, each serving one request at a time; at most
    ``workers + max_queue`` requests are admitted at once (``submit`` raises QueueFull beyond that).
    ``on_done(job, generation)`` is called when a request ends (metrics). Each Session has a thread of its own,
    or, ``driven``, one thread serves them all, each request a task of its ``rlxrt.sessions.Driver`` (Sessions
    on a Batch: their rounds then hand over without waking a thread)."""

    def __init__(self, make_session: Callable[[], Any], workers: int, max_queue: int,
                 on_done: Callable[[Job, Any], None] | None = None, driven: bool = False):
        self.sessions = [make_session() for _ in range(workers)]
        self.driven = driven
        self.max_queue = max_queue
        self.capacity = workers + max_queue
        self._on_done = on_done
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._admitted = 0
        self._running = 0
        self._closed = False
        self._threads = [threading.Thread(target=self._drive, name="rlxrt-engine", daemon=True)] if driven else \
            [threading.Thread(target=self._serve, args=(s,), name=f"rlxrt-worker-{i}", daemon=True)
             for i, s in enumerate(self.sessions)]
        for t in self._threads:
            t.start()

    @property
    def session(self):
        """A Session of the pool, for what every worker shares (manifest, tokenizer, chat template)."""
        return self.sessions[0]

    @property
    def running(self) -> int:
        return self._running

    @property
    def waiting(self) -> int:
        return self._admitted - self._running

    def submit(self, job: Job) -> None:
        with self._lock:
            self._refuse()
            self._admitted += 1
            self._queue.put(job)  # under the lock: never behind close()'s stop sentinels

    def check(self) -> None:
        """Raise what ``submit`` would raise now (Closed, QueueFull), admitting nothing: a request that would be
        refused is told so before it is parsed or tokenised."""
        with self._lock:
            self._refuse()

    def _refuse(self) -> None:
        """Raise Closed or QueueFull where a request would be refused now (called with the lock held)."""
        if self._closed:
            raise Closed("the server is shutting down; retry on another instance")
        if self._admitted >= self.capacity:
            raise QueueFull(f"all {len(self.sessions)} workers are busy and {self.max_queue} requests are "
                            "queued; retry later")

    def forget(self, job: Job) -> None:
        """A job that no worker took yet and nobody waits for any more (its client went away, or its deadline
        passed): its place in the queue is given back now, not when a worker takes it, so that dead jobs behind
        long requests do not turn live ones away."""
        with self._lock:
            if not job.started and not job.forgotten:
                job.forgotten = True
                self._admitted -= 1

    def close(self, timeout: float | None = None) -> None:
        """Take no new requests, let the admitted ones finish, then stop the workers."""
        with self._lock:
            self._closed = True
            for _ in self._threads:
                self._queue.put(None)
        for t in self._threads:
            t.join(timeout)

    # -- worker threads -------------------------------------------------------------------------------------
    def _serve(self, session) -> None:
        while (job := self._queue.get()) is not None:
            self._serve_one(session, job)

    def _drive(self) -> None:
        """The driven pool's one thread: each request a task of a Driver on a free Session, taken from the queue
        between steps (waited for only when no request is running)."""
        from rlxrt.sessions import Driver

        driver, free, closing = Driver(), list(reversed(self.sessions)), False  # a stack: the last freed is warm
        while True:
            while free and not closing:
                try:
                    job = self._queue.get(block=driver.live == 0)
                except queue.Empty:
                    break
                if job is None:
                    closing = True
                    break
                driver.spawn(self._task, free, free.pop(), job)
            if driver.live:
                driver.cycle()
            elif closing:
                driver.close()
                return

    def _task(self, free: list, session, job: Job) -> None:
        try:
            self._serve_one(session, job)
        finally:
            free.append(session)

    def _serve_one(self, session, job: Job) -> None:
        with self._lock:
            forgotten, job.started = job.forgotten, True
            if not forgotten:
                self._running += 1
        generation = None
        try:
            if not forgotten:
                generation = self._run(session, job)
        except Exception as exc:  # bad arguments, a model error or a bug: the client hears of it; keep serving
            job.failed = True
            job.emit("error", exc)
        finally:
            if not forgotten:
                with self._lock:
                    self._running -= 1
                    self._admitted -= 1
            if self._on_done is not None:
                try:
                    self._on_done(job, generation)
                except Exception:  # metrics must never take a worker down
                    log.exception("recording a request's metrics failed")

    @staticmethod
    def _run(session, job: Job):
        job.started = True
        if job.cancel.is_set():
            return None
        if time.monotonic() > job.deadline:
            job.timed_out = True
            job.emit("timeout")
            return None
        w = job.work
        stream = session.stream(w.prompt_ids, **w.kwargs)
        job.emit("start")
        with stream:
            for piece in stream:
                if job.first_token is None:
                    job.first_token = time.monotonic()
                if piece:
                    job.text(piece)
                if job.cancel.is_set():
                    break
                if time.monotonic() > job.deadline:
                    job.timed_out = True
                    break
        g = stream.generation
        if job.timed_out:
            job.emit("timeout", g)
        else:
            job.emit("done", g)
        return g
