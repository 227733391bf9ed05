"""An MTP head's drafts for many Sessions in shared steps: each weight of the head read once a step for all.

``HeadBatch(head_dir, slots=16)`` compiles the batched head graph (``backends/head_batch.py``) and holds its
attention layer's KV buffers, [slots, heads, capacity, head size], allocated once; ``MtpHead(head_batch)``
takes a slot (a ``HeadSlot``, a model like ``StateModel`` to the head) for its life. The Session's target must
be a slot of a ``Batch``: that slot leads the head's (``Slot.lead``), so from the target's step to its next
hand-in the head's steps wait for the Sessions that draft, and each chained proposal of every drafting Session
runs in one call: one step for the first proposals (each with its verified rows), one for each next position.

A sequence's rows are bitwise the same beside any others (the batched graph's promise), so a seeded request
drafts the same tokens alone and under load. A slot's gated state after every fed row is kept until a commit
picks the one of the last accepted position (no re-run), and its KV cache rolls back by length.
"""
from __future__ import annotations

import os
import threading
import time

import numpy as np

from rlxrt.backends import CompiledGraph, compile
from rlxrt.backends.head_batch import LAST_ROWS, SEQUENCES
from rlxrt.checks import as_int
from rlxrt.config import Config
from rlxrt.errors import GenerationError, ModelFormatError
from rlxrt.limits import K_MAX

from .kv import GraphModel, draft_vocab_ids
from .steps import Steps

CHUNK = 128
"""The most rows a slot feeds a step: a first proposal after a long prompt goes in pieces of this."""
GATHER_SECONDS = 0.2
"""The longest a step waits for a drafting slot to hand in (one whose thread went away) before it runs without."""


class HeadBatch(Steps):
    """The batched head graph and the slots of its KV buffers (see the module's text)."""

    def __init__(self, head: str | os.PathLike | CompiledGraph, config: Config | None = None, *, slots: int = 8,
                 capacity: int | None = None, chunk: int = CHUNK):
        import onnxruntime as ort

        if isinstance(head, CompiledGraph):
            config = config if config is not None else head.config
            graph = head if head.batched else compile(head.path.parent, config, batched=True)
        else:
            graph = compile(head, config, batched=True)
        m = graph.manifest
        if not m.draft_head or m.draft_head.get("kind") != "mtp":
            raise ModelFormatError(f"{graph.path} is not an MTP head (its manifest has no draft_head of kind 'mtp')")
        self.graph = graph
        self.slots = as_int(slots, "slots", 1, 1024)
        self.chunk = as_int(chunk, "chunk (the most rows a slot feeds a step)", 1, 1 << 16)
        self.capacity = m.max_positions if capacity is None else \
            min(as_int(capacity, "capacity (positions a slot holds)", 1, 1 << 24), m.max_positions)
        """Positions a slot holds: at most the head's max positions (its rotary tables)."""
        self.gather_seconds = GATHER_SECONDS
        self.each = bool(m.draft_head.get("attention_heads"))
        """An attention layer: every fed row comes with its hidden state (else each sequence's last row alone)."""
        kv = m.kv_cache if self.each else None
        self._binding = graph.session.io_binding()
        self._buffers = []
        for past, present in ((kv.names(0)[0], kv.names(0)[2]), (kv.names(0)[1], kv.names(0)[3])) if kv else ():
            buf = ort.OrtValue.ortvalue_from_shape_and_type([self.slots, kv.kv_heads, self.capacity, kv.head_dim],
                                                            np.float32, "cpu", 0)
            self._binding.bind_ortvalue_input(past, buf)
            self._binding.bind_ortvalue_output(present, buf)
            self._buffers.append(buf)
        width = int(m.draft_head["hidden_size"])
        self.state_size = int(m.state.tensors[0].shape[-1])
        rows = self.slots * self.chunk
        self._ids = np.zeros((1, rows), np.int64)
        self._hidden_in = np.zeros((1, rows if self.each else self.slots, width), np.float32)
        self._state = np.zeros((self.slots, self.state_size), np.float32)
        self._seqs = np.zeros((self.slots, 3), np.int32)
        self._last = np.zeros(self.slots, np.int64)
        ids = draft_vocab_ids(graph)
        self._logits = np.zeros((1, self.slots, m.vocab_size if ids is None else len(ids)), np.float32)
        self._own = np.zeros((1, self.slots, width), np.float32)
        self._states = np.zeros((rows, self.state_size), np.float32)
        self._names = (m.inputs["input_ids"], m.inputs["hidden_states"], m.state.tensors[0].input, m.outputs["logits"],
                       m.outputs["hidden_states"], m.state.tensors[0].output)
        self._values: dict[tuple[str, int], object] = {}  # an OrtValue per (array, length): made once
        self._bound: tuple[int, int] | None = None
        self._ort = ort
        self._cond = threading.Condition()
        self._free = list(range(self.slots))
        self._all: list[HeadSlot] = []
        self._running = False
        self.driver = None
        self.steps = 0
        self.calls = 0
        self.run_seconds = 0.0

    def _new_slot(self, index: int) -> "HeadSlot":
        return HeadSlot(self, index)

    def _give_back(self, slot: "HeadSlot") -> None:
        slot.active = False

    def _step(self) -> None:
        """Run one step over every slot that handed in rows (called with the lock held; released while ONNX
        Runtime runs)."""
        taking = [s for s in self._all if s.pending is not None]
        t, parts = 0, []
        for n, s in enumerate(taking):
            count = min(self.chunk, len(s.pending) - s.fed)
            self._ids[0, t:t + count] = s.pending[s.fed:s.fed + count]
            if self.each:
                self._hidden_in[0, t:t + count] = s.rows[s.fed:s.fed + count]
            else:  # read at the last row alone: what earlier pieces read is dropped
                self._hidden_in[0, n] = s.rows[0]
            self._state[n] = s.state()
            self._seqs[n] = (s.index, s.length, count)
            self._last[n] = t + count - 1
            parts.append((s, t, count))
            t += count
        _, error = self._run_unlocked(len(parts), t, len(taking))
        for n, (s, start, count) in enumerate(parts):
            if error is not None:
                self._fail(s, error, "the head's batched step")
                continue
            s.keep(self._states[start:start + count])
            s.fed += count
            if s.fed == len(s.pending):
                if s.chain_left and s.chain_next(self._logits[0, n], self._own[0, n:n + 1]):
                    continue  # its next drafted token goes in the next step
                s.deliver(self._logits[0, n:n + 1], self._own[0, n:n + 1])
                s.pending = None
        self._cond.notify_all()

    def _run(self, rows: int, sequences: int) -> None:
        ids, hidden, state, logits, own, states = self._names
        b = self._binding  # the arrays are written in place: bound again where a length changed
        if self._bound is None or self._bound[0] != rows:
            b.bind_ortvalue_input(ids, self._value("ids", self._ids[:, :rows], rows))
            if self.each:
                b.bind_ortvalue_input(hidden, self._value("hidden", self._hidden_in[:, :rows], rows))
            b.bind_ortvalue_output(states, self._value("states", self._states[:rows], rows))
        if self._bound is None or self._bound[1] != sequences:
            b.bind_ortvalue_input(state, self._value("state", self._state[:sequences], sequences))
            if not self.each:
                b.bind_ortvalue_input(hidden, self._value("hidden", self._hidden_in[:, :sequences], sequences))
            b.bind_ortvalue_input(SEQUENCES, self._value("seqs", self._seqs[:sequences], sequences))
            b.bind_ortvalue_input(LAST_ROWS, self._value("last", self._last[:sequences], sequences))
            b.bind_ortvalue_output(logits, self._value("logits", self._logits[:, :sequences], sequences))
            b.bind_ortvalue_output(own, self._value("own", self._own[:, :sequences], sequences))
        self._bound = (rows, sequences)
        t0 = time.perf_counter()
        try:
            self.graph.session.run_with_iobinding(b)
        except self.graph.errors as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:400]
            raise GenerationError(f"onnxruntime failed running the batched head {self.graph.path}: {first}") from exc
        self.run_seconds += time.perf_counter() - t0


class HeadSlot(GraphModel):
    """One sequence of a HeadBatch: to an ``MtpHead`` what a ``StateModel`` is, its calls run in the batch's
    steps. Its logits and hidden state are its own copies, valid until its next call."""

    shared = True

    def __init__(self, batch: HeadBatch, index: int):
        super().__init__(batch.graph)
        self.batch, self.index = batch, index
        self.hidden_each = batch.each
        self.max_positions = batch.capacity
        self.pending: np.ndarray | None = None
        self.rows: np.ndarray | None = None
        """The hidden states of the pending tokens' positions, one row each."""
        self.fed = self.want = 0
        self.since = 0.0
        self.error: Exception | None = None
        self.active = False
        self.led = False
        self.released = False
        self._kept = np.zeros((64, batch.state_size), np.float32)
        """The state after ``_base`` tokens, then after each token fed since, row by row (grown by doubling)."""
        self._base = 0
        self._logits = np.zeros((1, self.logits_width), np.float32)
        self._own = np.zeros((1, batch._own.shape[2]), np.float32)
        self.chain_left = 0
        """Drafted tokens its chain has still to run (``chain``)."""
        self._chain = np.zeros(K_MAX, np.int64)
        self._chained = 0
        self._next = np.zeros(1, np.int64)
        self._next_rows = np.zeros_like(self._own)
        self.reset()

    def reset(self) -> None:
        self.length, self._base, self.hidden = 0, 0, None
        self._kept[0] = 0.0

    def state(self, length: int | None = None) -> np.ndarray:
        """The state after the first ``length`` tokens (default: all fed), if still kept."""
        length = self.length if length is None else length
        if not self._base <= length <= self.length:
            raise GenerationError(f"the head's state after {length} tokens is no longer kept (kept: {self._base} to "
                                  f"{self.length}); a recurrent model commits forward only")
        return self._kept[length - self._base]

    def keep(self, states: np.ndarray) -> None:
        """The states after each of the rows a step fed (under the batch's lock)."""
        at = self.length - self._base + 1
        if at + len(states) > len(self._kept):
            grown = np.zeros((max(2 * len(self._kept), at + len(states)), self._kept.shape[1]), np.float32)
            grown[:at] = self._kept[:at]
            self._kept = grown
        self._kept[at:at + len(states)] = states
        self.length += len(states)

    def deliver(self, logits: np.ndarray, own: np.ndarray) -> None:
        self._logits[:] = logits
        self._own[:] = own
        self.hidden = self._own

    def arm(self) -> None:
        """Its target stepped: its Session may draft next, and the head's steps wait for it."""
        with self.batch._cond:
            self.active = True

    def idle(self) -> None:
        """Its Session's drafting is done this round: the head's steps no longer wait for it."""
        with self.batch._cond:
            self.active = False
            self.batch._cond.notify_all()

    def forward(self, tokens, hidden: np.ndarray | None = None, rows: int | None = None) -> np.ndarray:
        """Feed ``tokens`` after the first ``length``, with ``hidden`` [s, H] the hidden state of each (a head
        without attention: [1, H], the last one's); the last position's logits [1, V] (its hidden state in
        ``hidden``)."""
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        need = len(ids) if self.hidden_each else 1
        if hidden is None or len(hidden) != need or not len(ids):
            raise GenerationError(f"the head's call of {len(ids)} tokens reads {need} hidden state row(s), got "
                                  f"{None if hidden is None else len(hidden)}")
        if self.length + len(ids) > self.max_positions:
            raise GenerationError(f"sequence of {self.length + len(ids)} tokens exceeds the head's batch capacity "
                                  f"({self.max_positions})")
        self.rows = hidden
        t0 = time.perf_counter()
        self.batch.submit(self, ids, 1)
        self.run_seconds += time.perf_counter() - t0
        return self._logits

    def chain(self, tokens, hidden: np.ndarray, k: int) -> np.ndarray:
        """Greedy drafts without leaving the batch's steps: feed ``tokens`` (with ``hidden``, as ``forward``),
        then k - 1 times the argmax of the last call with the head's own hidden state, each in the step after;
        the k argmax ids (valid until its next call). The steps run on without waking this slot's thread or
        task between them, so they wait for no sequence's Python."""
        k = as_int(k, "k (tokens a chain drafts)", 1, K_MAX)
        if self.length + len(tokens) + k - 1 > self.max_positions:
            raise GenerationError(f"a chain of {k} after {self.length + len(tokens)} tokens exceeds the head's "
                                  f"batch capacity ({self.max_positions})")
        self._chained, self.chain_left = 0, k
        try:
            self.forward(tokens, hidden)
        finally:
            self.chain_left = 0
        return self._chain[:self._chained]

    def chain_next(self, logits: np.ndarray, own: np.ndarray) -> bool:
        """A chain's step is over (under the batch's lock): keep the argmax of ``logits``, its row (read in the
        step's buffer, not copied); True where the chain goes on, that token and the head's own hidden state
        ``own`` [1, H] then pending."""
        x = int(logits.argmax())
        if self.vocab_ids is not None:
            x = int(self.vocab_ids[x])
        self._chain[self._chained] = x
        self._chained += 1
        self.chain_left -= 1
        if not self.chain_left:
            if self.led:  # its round's drafting is done: the others' chains need not wait for it
                self.active = False
            return False
        self._next[0] = x
        self._next_rows[:] = own
        self.pending, self.rows, self.fed = self._next, self._next_rows, 0
        self.since = time.perf_counter()
        return True

    def commit(self, length: int) -> None:
        """Keep the state after the first ``length`` tokens; the KV cache moves its length back with it."""
        length = min(self.length, length)
        self._kept[0] = self.state(length)  # one row onto another (or itself): nothing to copy first
        self._base = self.length = length
