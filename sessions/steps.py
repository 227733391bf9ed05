"""What a batch does for the slots whose calls it runs in shared steps, whatever its graph: a slot hands in its
call and waits; the one whose hand-in completes a step (a Session's thread, or the driver once every task waits)
runs it for all of them (``Batch``: a target's or a draft model's fused graph; ``HeadBatch``: an MTP head's).

A subclass holds ``graph``, ``slots``, ``_cond`` (the lock), ``_all`` (its slots), ``_free`` (the indices not
taken), ``driver``, ``_running``, ``gather_seconds``, ``_ort`` and ``_values``; it makes a slot in ``_new_slot``,
takes one back in ``_give_back`` and runs a step in ``_step`` (called with the lock held). Its slots carry ``pending`` (the call's tokens, None
once a step has run them all), ``fed``, ``want``, ``since``, ``error``, ``active``, ``led`` and ``released``.
"""
from __future__ import annotations

import time

import numpy as np

from rlxrt.config import Config
from rlxrt.errors import GenerationError

from .driver import running


class Steps:
    def _new_slot(self, index: int):
        raise NotImplementedError

    def _give_back(self, slot) -> None:
        raise NotImplementedError

    def _step(self) -> None:
        raise NotImplementedError

    @property
    def config(self) -> Config:
        return self.graph.config

    def slot(self):
        """A free slot, for one Session's life (``release`` gives it back); GenerationError when none is free."""
        with self._cond:
            if not self._free:
                raise GenerationError(f"all {self.slots} slots of the {type(self).__name__} are taken; make it with "
                                      "more slots (one per Session), or release one")
            s = self._new_slot(self._free.pop(0))
            self._all.append(s)
            return s

    def release(self, slot) -> None:
        with self._cond:
            if slot in self._all:
                self._give_back(slot)
                slot.released = True
                self._all.remove(slot)
                self._free.append(slot.index)
                self._cond.notify_all()

    def _run_unlocked(self, calls: int, *args):
        """``self._run(*args)`` (a step's ONNX Runtime call, ``calls`` slots' calls) with the lock released:
        (what it returned, None), or (None, what it raised); a step that ran is counted."""
        self._running = True
        self._cond.release()
        try:
            out = self._run(*args)
        except Exception as exc:  # every slot of the step hears of it, in its own thread
            return None, exc
        finally:
            self._cond.acquire()
            self._running = False
        self.steps += 1
        self.calls += calls
        return out, None

    @staticmethod
    def _fail(slot, error: Exception, what: str) -> None:
        """The step failed: ``slot``'s call (and its chain) ends with ``error`` (as a GenerationError naming
        ``what``)."""
        slot.pending, slot.chain_left = None, 0
        slot.error = error if isinstance(error, GenerationError) else GenerationError(f"{what} failed: {error}")

    def _value(self, name: str, array: np.ndarray, n: int):
        """An OrtValue over ``array`` (a view of a buffer made once, ``n`` long): made once per (name, n)."""
        key = (name, n)
        if key not in self._values:
            self._values[key] = self._ort.OrtValue.ortvalue_from_numpy(array)
        return self._values[key]

    def submit(self, slot, tokens: np.ndarray, rows: int) -> None:
        """Hand in ``tokens`` of ``slot`` (its last ``rows`` rows wanted) and wait until a step has run them all;
        the rows are then in the slot's buffers."""
        if slot.released:
            raise GenerationError(f"this slot was given back to its {type(self).__name__} (release), and a step no "
                                  "longer runs it; take a new one (slot(), or a new Session on the batch)")
        driver = running()
        if driver is None and self.driver is not None:
            raise GenerationError(f"this {type(self).__name__} is served by a Driver's thread; run every Session on "
                                  "it as a task of that driver (rlxrt.sessions.Driver)")
        with self._cond:
            slot.pending, slot.fed, slot.want, slot.error = tokens, 0, rows, None
            slot.since = time.perf_counter()  # a hand-in wakes nobody: the one that completes a step runs it
            while driver is None and slot.pending is not None:
                if self._running:  # the step's end wakes every waiter
                    self._cond.wait()
                elif self._ready():
                    self._step()
                else:  # until a step's end, an idle slot, or the gathering time is up
                    self._cond.wait(max(self._gather_left(), 0.001))
        if driver is not None:  # the driver runs the step once every task waits for one
            driver.wait(self, slot)
        if slot.error is not None:
            raise slot.error

    def _gather_left(self) -> float:
        waiting = [s.since for s in self._all if s.pending is not None]
        return self.gather_seconds - (time.perf_counter() - min(waiting)) if waiting else self.gather_seconds

    def _ready(self) -> bool:
        """Whether a step may start: every slot in a request has handed in, or one has waited long enough."""
        waiting = [s for s in self._all if s.pending is not None]
        if not waiting:
            return False
        if self.all_in():
            return True
        return time.perf_counter() - min(s.since for s in waiting) > self.gather_seconds

    def drafts_only(self) -> bool:
        """Whether every slot that handed in tokens drafts for another batch's slot (a draft's chain step: short,
        and not a step of requests' rounds)."""
        return all(s.led for s in self._all if s.pending is not None)

    def all_in(self) -> bool:
        """Whether every slot in a request has handed in its tokens: a step now waits for nobody."""
        return all(s.pending is not None for s in self._all if s.active)
