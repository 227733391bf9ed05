"""One thread decodes many Sessions on Batches: each request is a task (a greenlet) of a ``Driver``, and where a
task's round hands its tokens to a Batch the task pauses and the driver runs the next one; once every task waits
for a step, the driver runs the step and resumes the tasks it served, in turn.

Under threads (one per Session) a step wakes every Session's thread, and they run their rounds one after the
other under the interpreter lock: each hand-over is a wake-up of a sleeping thread, which costs several times
the round's own Python on a small model (docs/performance.md, "Stop 57"). A driver's tasks switch without the
operating system. What a task runs is the same code (``Batch.submit`` pauses it where a thread would wait), so
the same steps run and every output is the same.

What a task hands to another thread (a server's text for its event loop) it can ``defer``: the driver makes
those calls just before its next step that verifies requests' rounds (not a draft's step), or once no step
waits. The other thread then does its Python while this one runs the step outside the interpreter lock; woken
at once, it ran between the step and the drafts' steps, and the first draft step of each round waited for it to
give the lock back (docs/performance.md, "Stop 66").

A Batch is either a driver's or its threads' until the driver is closed: a task that hands in to a Batch another
driver serves, or a thread that hands in to a driven one, is refused. A task may block only in a Batch's steps:
anything else it waits for stalls every task of its driver (a ``HeadBatch`` is stepped as a Batch is). A task's
own ONNX Runtime calls (a head's, where it cannot batch) run on the driver's thread, one task's after another's:
on helper threads at once they were no faster (docs/performance.md, "Stop 57").
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from typing import TYPE_CHECKING, Callable

from rlxrt.errors import GenerationError

if TYPE_CHECKING:
    from .batch import Batch, Slot

log = logging.getLogger("rlxrt")
_local = threading.local()


def running() -> "Driver | None":
    """The driver whose task runs on this thread now (None: none does)."""
    driver = getattr(_local, "driver", None)
    return driver if driver is not None and driver._in_task() else None


def task_or_thread() -> tuple[object, bool]:
    """Who is calling: (the running task of a driver, True), or (this thread's id, False)."""
    driver = running()
    return (driver._greenlet.getcurrent(), True) if driver is not None else (threading.get_ident(), False)


class Driver:
    """Tasks on the thread that made it (see the module's text): ``spawn`` them, then ``cycle`` (or ``run``)."""

    def __init__(self):
        import greenlet

        if getattr(_local, "driver", None) is not None:
            raise GenerationError("this thread already has a Driver; one thread runs one driver's tasks")
        self._greenlet = greenlet
        self._hub = greenlet.getcurrent()
        self._thread = threading.get_ident()
        self._runnable: deque = deque()
        self._waiting: list[tuple["Batch", "Slot", object]] = []
        self._batches: list["Batch"] = []  # the batches it serves (``Batch.driver``), until it is closed
        self._deferred: list[tuple[Callable, tuple]] = []
        self._spare: list[tuple[Callable, tuple]] = []  # the list the next flush's calls are deferred to
        self.live = 0
        """Tasks started and not ended."""
        self.steps = 0
        _local.driver = self

    def _in_task(self) -> bool:
        return self._greenlet.getcurrent() is not self._hub

    def _check_thread(self) -> None:
        if threading.get_ident() != self._thread:
            raise GenerationError("a Driver's tasks are started and run on the thread that made it")

    def spawn(self, fn: Callable, *args) -> None:
        """Start ``fn(*args)`` as a task: it runs at the next ``cycle``. What it raises is logged, and ends it
        alone."""
        self._check_thread()

        def task():
            try:
                fn(*args)
            except Exception:
                log.exception("a task of the driver failed")
            finally:
                self.live -= 1

        self.live += 1
        self._runnable.append(self._greenlet.greenlet(task, parent=self._hub))

    def defer(self, fn: Callable, *args) -> None:
        """Call ``fn(*args)`` on this thread just before the next step that verifies requests' rounds, or once no
        step waits (see the module's text); calls are made in the order deferred, and what one raises is logged."""
        self._deferred.append((fn, args))

    def _flush(self) -> None:
        deferred = self._deferred
        if not deferred:
            return
        self._deferred = self._spare  # what the calls defer goes to the next flush
        for fn, args in deferred:
            try:
                fn(*args)
            except Exception:
                log.exception("a call the driver deferred failed")
        deferred.clear()
        self._spare = deferred

    def wait(self, batch: "Batch", slot: "Slot") -> None:
        """Pause the running task until a step has run ``slot``'s pending tokens (``Batch.submit``)."""
        if batch.driver is None:
            batch.driver = self
            self._batches.append(batch)
        elif batch.driver is not self:
            raise GenerationError("this Batch is served by another Driver's thread; run every Session on it as a "
                                  "task of that driver")
        self._waiting.append((batch, slot, self._greenlet.getcurrent()))
        self._hub.switch()

    def cycle(self) -> None:
        """Run every task that can run until each ends or waits for a step, then run one step and make the tasks
        it served runnable."""
        self._check_thread()
        while self._runnable:
            self._runnable.popleft().switch()
        if not self._waiting:
            self._flush()
            return
        batch = self._next_batch()
        if not batch.drafts_only():
            self._flush()
        try:
            with batch._cond:
                batch._step()
        except Exception as exc:  # a fault of the step's own bookkeeping: its tasks hear of it, the others go on
            log.exception("a batched step failed")
            for b, slot, _ in self._waiting:
                if b is batch and slot.pending is not None:
                    slot.pending, slot.error = None, GenerationError(f"the batched step failed: {exc}")
        self.steps += 1
        waiting = []
        for entry in self._waiting:
            if entry[1].pending is None:  # its tokens are all in: the task goes on with its logits
                self._runnable.append(entry[2])
            else:  # a prompt's next chunk, or a chain's next draft
                waiting.append(entry)
        self._waiting = waiting

    def run(self) -> None:
        """Cycle until every task has ended."""
        while self.live:
            self.cycle()

    def close(self) -> None:
        """Give back the batches it served (another driver, or threads, may serve them now) and let this thread
        make another driver; every task must have ended."""
        if self.live:
            raise GenerationError(f"{self.live} task(s) of the driver have not ended")
        self._flush()
        for batch in self._batches:
            batch.driver = None
        self._batches = []
        if getattr(_local, "driver", None) is self:
            _local.driver = None

    def _next_batch(self) -> "Batch":
        """The batch to step: one whose every slot in a request has handed in (its step waits for nobody), else
        the one that has waited longest (a slot in a request whose task waits for another batch's step: a
        Session between its target's step and its next round, drafting on a draft model's Batch)."""
        batches: list = []
        for batch, _, _ in self._waiting:
            if batch not in batches:
                batches.append(batch)
        for batch in batches:
            if batch.all_in():
                return batch
        return min(batches, key=lambda b: min(s.since for s in b._all if s.pending is not None))
