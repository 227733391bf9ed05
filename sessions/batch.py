"""Continuous batching: many Sessions' targets are slots of ONE batched fused graph, and every step runs the
calls of all of them in one ONNX Runtime call that reads each weight once.

``Batch(target_dir, slots=8)`` compiles the batched variant of a fused graph (``backends/batched.py``) and holds
its KV buffers, [slots, kv_heads, capacity, head_dim] per tensor, allocated once. ``Session(batch, speculator)``
takes a free slot (a ``Slot``, a decoder like any other) for its life. A Session runs its requests as it
always does, round by round on its own thread; its slot's ``forward`` hands the round's tokens to the batch
and waits. A step starts once every slot in a request has handed in its tokens (or the first has waited
``gather_seconds``): the thread that completes it runs the step for all of them, copies each slot's rows to
the slot's own buffers and wakes the others. Requests join and leave between steps; a prompt enters ``chunk``
tokens a step, so a long one does not stall the others.

A slot's rows are computed bitwise as the one-sequence graph computes them (rlxrt's kernels compute a row the
same among any others), so batching changes no output: greedy output equals the request served alone, and a
seeded request follows the seed contract (docs/exactness.md). What batching does change is what a drafted token
costs: every few steps the batch plans every slot's k for its next rounds from the measured step cost and the
slot's acceptance (``k_policy.plan_ks``); a Session drafts at most that (a seeded request keeps its k). A drafted
token costs the step its row and what the step waits for while the slots draft: the gaps between steps, measured
(``k_policy.DraftCost``). A Session whose speculator has several sources (lookup, then a head) is planned a k
for each, from each source's own acceptance, cost and chance of drafting the round. What the plan cannot see is
measured by its outcome: ``k_policy.Guard`` keeps drafting on only while steps that draft serve more tokens a
second than steps that do not, at every load; alone too, since a Session's own k choice drafts at least one
token a round.
"""
from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from rlxrt.backends import CompiledGraph, compile
from rlxrt.config import Config, load_config
from rlxrt.checks import as_float, as_int
from rlxrt.errors import GenerationError
from rlxrt.limits import K_MAX

from .driver import Driver
from .k_policy import Acceptance, DraftCost, Guard, Sequence, StepCost, plan_ks
from .kv import GraphModel, check_room, draft_vocab_ids
from .steps import Steps

CHUNK = 32
"""Prompt tokens a slot feeds a step by default."""
GATHER_SECONDS = 0.2
"""The longest a step waits for a slot in a request to hand in its tokens (one that never does: a stream that
is not read) before it runs without it."""
PRIOR_ACCEPTANCE = 0.5
PRIOR_ANSWER = 0.5
"""The chance a source asked to draft proposes something, before any round has told (lookup: that it finds a
match)."""
ACCEPTANCE_DECAY = 0.9
"""What a slot's estimates of a source (its acceptance, its chance to answer) keep of the past at each round."""
ACCEPTANCE_POSITIONS = 4
"""The drafted positions ``Batch.report`` shows a source's acceptance at."""
POOL_DECAY = 0.98
"""What the batch's estimates of a source over every slot's rounds keep of the past at each round of any slot:
a slot's estimates start from them at each request, and drift back to them (``Batch.pool``)."""
REPLAN_STEPS = 8
"""Steps a plan serves before it is made again (sooner where a slot joins or wants another k): a plan of 8
sequences takes 0.1-0.2 ms, run by the thread whose hand-in completed the step while the others wait."""
CALIBRATION_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
CALIBRATION_REPEATS = 5
CALIBRATION_MORE = 3
"""Rounds of CALIBRATION_REPEATS passes more, at most, while the times measured are not a shape a step can have."""
CONTEXT_ROWS = 8
CONTEXT_TOKENS = 256
"""The rows and context of the calibration step that measures what a row adds a token of context it attends to."""
CATCH_UP_ROUNDS = 8
"""A source that drafts after this many rounds of its slot without its drafts catches up first (``_Gap``)."""
ACCEPTANCE_DRIFT = 0.06
"""What a slot's acceptance counts of a source lose in a round it did not draft: its estimate moves back to the
prior (half-way in about 35 such rounds), so a sequence whose drafts stopped paying is tried again."""


def steps_config(config: Config | None) -> Config:
    """A batch's config: its steps run one at a time on every core, so its threads spin within a run unless
    ``allow_spinning`` says otherwise (docs/configuration.md, "Spinning")."""
    config = config if config is not None else load_config()
    return config if config.allow_spinning is not None else config.with_overrides(allow_spinning=True)


class Batch(Steps):
    """One batched graph and the slots of its KV buffers (see the module's text)."""

    def __init__(self, target: str | os.PathLike | CompiledGraph, config: Config | None = None, *, slots: int = 8,
                 chunk: int = CHUNK, gather_seconds: float = GATHER_SECONDS, calibrate: bool = True):
        import onnxruntime as ort

        graph = target if isinstance(target, CompiledGraph) and target.batched else \
            compile(target.path.parent if isinstance(target, CompiledGraph) else target,
                    steps_config(target.config if isinstance(target, CompiledGraph) and config is None else config),
                    batched=True)
        self.graph, m = graph, graph.manifest
        self.slots = as_int(slots, "slots", 1, 1024)
        self.chunk = as_int(chunk, "chunk", 1, 1 << 16)
        self.gather_seconds = as_float(gather_seconds, "gather_seconds (the longest a step waits for a slot to hand "
                                       "in its tokens)", 0.0, 60.0)
        kv = m.kv_cache
        self.capacity = kv.capacity
        self.width = max(self.chunk, K_MAX + 1)
        """The most tokens one slot feeds a step."""
        rows_max = self.slots * self.width
        self._binding = graph.session.io_binding()
        self._buffers = []
        shape = [self.slots, kv.kv_heads, kv.capacity, kv.head_dim]
        for i in range(kv.layers):
            past_k, past_v, present_k, present_v = kv.names(i)
            for past, present in ((past_k, present_k), (past_v, present_v)):
                buf = ort.OrtValue.ortvalue_from_shape_and_type(shape, np.dtype(kv.dtype), "cpu", 0)
                self._binding.bind_ortvalue_input(past, buf)
                self._binding.bind_ortvalue_output(present, buf)
                self._buffers.append(buf)
        ids = draft_vocab_ids(graph)
        self.vocab = m.vocab_size if ids is None else len(ids)  # a draft-only export's logits are its own columns
        self._ids_name, self._logits_name = m.inputs["input_ids"], m.outputs["logits"]
        self._hidden_name = m.outputs.get("hidden_states")
        self._ids = np.zeros((1, rows_max), np.int64)
        self._seqs = np.zeros((self.slots, 3), np.int32)
        self._rows = np.zeros(self.slots * (K_MAX + 1), np.int64)
        self._logits = np.zeros((1, self.slots * (K_MAX + 1), self.vocab), np.float32)
        self._hidden: np.ndarray | None = None
        self._values: dict[tuple[str, int], object] = {}  # an OrtValue per (array, length): made once
        self._bound: tuple | None = None  # the lengths the binding holds: bound again only when they change
        self._positions = np.arange(rows_max, dtype=np.int64)
        self._ort = ort
        self._cond = threading.Condition()
        self._free = list(range(self.slots))
        self._all: list[Slot] = []
        self._active = 0
        self._recount = False  # a slot's ``active`` changed since ``_active`` was counted
        self._running = False
        self.driver: Driver | None = None
        """The Driver whose thread runs this batch's steps, from its first task's hand-in on (None: the Sessions'
        own threads do)."""
        self.steps = 0
        self.calls = 0
        """Slots' calls the steps have run (more than ``steps`` where steps held several sequences)."""
        self.run_seconds = 0.0
        self.guards: dict[int, Guard] = {}
        """Drafting as planned, or not at all, by the tokens a second each mode has measured (k_policy.Guard): one
        guard per load (``guard``), since what pays at 2 sequences a step need not at 16, and a rate measured at
        one load says nothing of the other mode at another."""
        self.draft_costs: dict[int, DraftCost] = {}
        """What the steps wait for between them, and what a drafted token of each source adds to it: one per load
        (``draft_cost``), like the guards, since both grow with the sequences whose rounds a step waits for."""
        self._emitted_gone = 0  # tokens the slots given back had emitted
        self._emitted_seen = 0
        self.drafts_next = True
        """Whether a Session may draft next round: False where the last step's load has its guard in plain
        steps (made True again by any change of the slots in a request). A slot reads it without the lock, so
        a round that drafts nothing takes the lock only to hand in its token (``Slot.k_cap``)."""
        self.planned_next = False
        """Whether the last step left a plan for its load that the slots read without the lock (``Slot.planned``;
        made False by any change of the slots in a request)."""
        self._ended: float | None = None  # when the last step ended
        self._record: tuple[Guard, bool, float] | None = None  # the last clean step's guard, mode and seconds
        self._gap: _Gap | None = None  # the last clean step's gap, its drafted tokens and their sources
        self.cost = StepCost({1: 1.0})
        if self._hidden_name and self._hidden_name in graph.output_names:
            self.fetch_hidden()  # bound to a buffer made once, whether a slot reads it or not
        if calibrate:
            self.cost = self._calibrate()
        self._plan: dict[Slot, tuple[list[int], int]] = {}
        """slot -> (the k of each of its sources, the k it wanted when planned)"""
        self.pooled: dict[str, Acceptance] = {}
        """Each draft source's acceptance by position over every slot's rounds (``pool``)."""
        self.answer_rates: dict[str, float] = {}
        """Each draft source's chance to propose something when asked, over every slot's rounds."""
        self._planned = 0  # the step after which the plan was made

    # -- slots ----------------------------------------------------------------------------------------------
    def _new_slot(self, index: int) -> "Slot":
        return Slot(self, index)

    def _give_back(self, slot: "Slot") -> None:
        slot.idle()
        self._emitted_gone += slot.emitted

    def fetch_hidden(self) -> int:
        """Return the hidden states of every row from now on (a head drafts from them); their width."""
        if not self._hidden_name or self._hidden_name not in self.graph.output_names:
            raise GenerationError(f"{self.graph.path.parent} has no hidden_states output; re-export the target with "
                                  "--with-hidden-states")
        spec = next(t for t in self.graph.outputs if t.name == self._hidden_name)
        width = spec.shape[-1]
        if self._hidden is None:
            self._hidden = np.zeros((1, self._ids.shape[1], int(width)), np.float32)
        return int(width)

    # -- one step -------------------------------------------------------------------------------------------
    def _step(self) -> None:
        """Run one step over every slot that handed in tokens (called with the lock held; released while
        ONNX Runtime runs)."""
        taking = [s for s in self._all if s.pending is not None]
        own = not self.drafts_only()  # requests' rounds, not only drafts for another batch's (no plan)
        start = time.perf_counter()
        gap = start - self._ended if self._ended is not None else None
        if own:  # what the step tells the plan and the guard (a draft's batch has neither)
            rounds, sources, drafted, caught_up = True, False, 0, False  # one pass: every step runs it
            for s in taking:
                extra = len(s.pending) - 1
                rounds = rounds and not s.fresh  # every slot past its prompt: the step holds rounds alone
                sources = sources or bool(s.sources)
                caught_up = caught_up or (extra > 0 and not s.drafted_last)  # first drafts in a while
                drafted += extra
                s.drafted_last = not s.fresh and extra > 0
            clean = rounds and sources  # none can draft: nothing to tell
            drafted = drafted if clean else 0
            load = self._active_count()
            guard, waits = self.guard(load), self.draft_cost(load)
            drafting = guard.drafting  # the mode the slots planned this step's rounds in
        t, r, parts = 0, 0, []
        longest = max(len(s.pending) - s.fed for s in taking)
        chunk = self.chunk if longest <= self.chunk else self._chunk(taking)  # a chunk's size matters to prompts
        for n, s in enumerate(taking):
            left = len(s.pending) - s.fed  # a prompt goes in chunks; the last holds every row wanted
            count = left if left <= max(chunk, s.want) else min(chunk, left - s.want)
            last = s.fed + count == len(s.pending)
            want = min(s.want, count) if last else 0
            self._ids[0, t:t + count] = s.pending[s.fed:s.fed + count]
            self._seqs[n] = (s.index, s.length, count)
            self._rows[r:r + want] = self._positions[t + count - want:t + count]
            parts.append((s, t, count, r, want, last))
            t, r = t + count, r + want
        seconds, error = self._run_unlocked(len(parts), t, len(taking), r)
        if error is None and own:
            if rounds:  # the plan is for rounds, not for prompts' chunks
                self.cost.observe(t, seconds, sum(s.length for s in taking) / len(taking))
            self._account(clean and gap is not None, guard, waits, drafting, drafted, gap or 0.0, seconds,
                          caught_up)
            if self._gap is not None:  # the drafting slots tell their sources in their rounds' reports
                for s in taking:
                    s._gap = self._gap if len(s.pending) > 1 else None
        active = self._active_count()
        arm = not own or self.guard(active).drafting  # else no Session drafts next round
        self.drafts_next, self.planned_next = arm, False
        if error is None and own and len(parts) > 1:  # a lone sequence is not planned (k_for)
            if not arm:  # nobody drafts next round: planned again when the guard drafts (k_for)
                self._plan = {}
            elif self.steps - self._planned >= REPLAN_STEPS or not self._plan:
                self._replan()
            self.planned_next = arm and active > 1 and bool(self._plan) and not self._recount
        for s, start, count, r0, want, last in parts:
            if error is not None:
                self._fail(s, error, "the batched step")
                continue
            if self._hidden is not None:
                s.keep_hidden(self._hidden[0, start:start + count], s.fed, len(s.pending))
            s.length += count
            s.fed += count
            if last:
                if not s.chain_left:
                    s.deliver(self._logits[0, r0:r0 + want])
                elif s.chain_next(self._logits[0, r0 + want - 1]):  # its next drafted token goes in the next step
                    continue
                if s.leads and arm and self._leads_draft(s):  # the drafts' steps wait for it
                    for draft in s.leads:
                        draft.arm()
                s.pending, s.fresh = None, False
        self._ended = time.perf_counter()
        self._cond.notify_all()

    def _chunk(self, taking: list["Slot"]) -> int:
        """The most prompt tokens a slot feeds this step: ``chunk`` where some sequence is past its prompt (its
        next token waits for the step), else an equal share of all the step can hold, so that prompts alone in
        the batch go in fewer, fuller steps (each step reads every weight once). A draft's batch (its slots led
        by a target's) gives a slot catching up on what it has not read (a prompt, at its first proposal) all
        the room the others' drafts leave: its target's batch waits for every draft step, so a catch-up in
        chunks would hold up every sequence for as many steps as it has chunks."""
        if any(s.led for s in taking):
            short = [len(s.pending) - s.fed for s in taking if len(s.pending) - s.fed <= K_MAX + 1]
            return max(self.chunk, (len(self._positions) - sum(short)) // max(len(taking) - len(short), 1))
        if any(not s.fresh for s in self._all if s.active or s.pending is not None):
            return self.chunk
        return max(self.chunk, len(self._positions) // len(taking))

    def _account(self, clean: bool, guard: Guard, waits: DraftCost, drafting: bool, drafted: int, gap: float,
                 seconds: float, caught_up: bool) -> None:
        """What a step tells of drafting (``clean``: its slots were all past their prompts, and a step before it
        ended, so the gap before it was theirs): the gap's cost (``DraftCost``; not where a slot drafted for the
        first time since its prompt or a pause, nor where a source of a slot did (``_Gap.caught_up``), as its
        speculator then read all it had not read yet) and, to the
        guard, the step before it with the tokens its rounds emitted (reported between the two steps)."""
        if self._record is not None:
            last, *record = self._record
            last.step(*record, self.emitted - self._emitted_seen)
        self._emitted_seen = self.emitted
        self._record = (guard, drafting, gap + seconds) if clean else None
        record = self._gap
        if record is not None and not record.caught_up:  # its sources told what they drafted in their reports
            if sum(t for t, _ in record.parts.values()) == record.tokens:
                record.waits.observe(record.gap, record.parts)
        self._gap = None
        if clean and not caught_up:
            if drafted:
                self._gap = _Gap(waits, gap, drafted)
            else:
                waits.observe(gap)

    def _run(self, tokens: int, sequences: int, rows: int) -> float:
        b, bound = self._binding, self._bound  # the arrays are written in place: bound again where a length changed
        hidden = self._hidden is not None
        if bound is None or bound[0] != tokens or bound[3] != hidden:
            b.bind_ortvalue_input(self._ids_name, self._value("ids", self._ids[:, :tokens], tokens))
            if hidden:
                b.bind_ortvalue_output(self._hidden_name, self._value("hidden", self._hidden[:, :tokens], tokens))
        if bound is None or bound[1] != sequences:
            b.bind_ortvalue_input("sequences", self._value("seqs", self._seqs[:sequences], sequences))
        if bound is None or bound[2] != rows:
            b.bind_ortvalue_input("logit_rows", self._value("rows", self._rows[:rows], rows))
            b.bind_ortvalue_output(self._logits_name, self._value("logits", self._logits[:, :rows], rows))
        self._bound = (tokens, sequences, rows, hidden)
        t0 = time.perf_counter()
        try:
            self.graph.session.run_with_iobinding(b)
        except self.graph.errors as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:400]
            raise GenerationError(f"onnxruntime failed running the batched {self.graph.path}: {first}") from exc
        seconds = time.perf_counter() - t0
        self.run_seconds += seconds
        return seconds

    def _calibrate(self) -> StepCost:
        """The step cost: seconds of a step of R rows for R in CALIBRATION_ROWS (up to what a step can hold),
        and of CONTEXT_ROWS rows at CONTEXT_TOKENS tokens of context (what a row adds a token of context); after
        a warm-up, the least of CALIBRATION_REPEATS passes over all of them in turn, measured on slot 0 before
        any request (what it writes is overwritten by the first prefill). Other work on the machine only adds
        time, so the least is the step's own; where the least times are still not a shape a step can have (a
        server calibrating beside another one: ``StepCost.plausible``), up to CALIBRATION_MORE rounds of passes
        more. The context it attends to is written first: KV memory never written may not be mapped yet and
        read as the system's one page of zeros, at no memory traffic, and so cost less than context does
        (docs/performance.md, stop 51)."""
        sizes = [(r, 0) for r in CALIBRATION_ROWS if r <= min(self.width, self.capacity)]
        rows = min(CONTEXT_ROWS, self.width)
        context = min(CONTEXT_TOKENS, self.capacity - rows)
        if context > 0 and (rows, 0) in sizes:
            sizes.append((rows, context))
            self._ids[0, :self.width] = 0
            for at in range(0, context + rows, self.width):
                n = min(self.width, context + rows - at)
                self._seqs[0] = (0, at, n)
                self._rows[0] = n - 1
                self._run(n, 1, 1)
        least = {size: math.inf for size in sizes}
        for more in range(CALIBRATION_MORE + 1):
            for repeat in range(CALIBRATION_REPEATS + (more == 0)):
                for r, past in sizes:
                    self._ids[0, :r] = 0
                    self._seqs[0] = (0, past, r)
                    self._rows[0] = r - 1
                    seconds = self._run(r, 1, 1)
                    if more or repeat:  # the first pass warms up
                        least[(r, past)] = min(least[(r, past)], seconds)
            if StepCost.plausible({r: t for (r, past), t in least.items() if not past}):
                break
        per_row_context = (least[(rows, context)] - least[(rows, 0)]) / (rows * context) \
            if (rows, context) in least else 0.0
        return StepCost({r: t for (r, past), t in least.items() if not past}, per_row_context)

    def _leads_draft(self, slot: "Slot") -> bool:
        """Whether ``slot``'s Session may draft from a draft model on a Batch next round (its planned k for one
        is above 0, or it is not planned): only then do that Batch's steps wait for its drafts."""
        ks = self._plan.get(slot)
        return ks is None or any(k > 0 for k, batched in zip(ks[0], slot.batched) if batched)

    def _replan(self) -> None:
        """Every drafting slot's k of each source for its next round (``k_policy.plan_ks``), from the step cost,
        each source's acceptance, chance and measured cost. A source whose cost this load has not measured (never,
        or not since it was forgotten) is tried by one slot, the one that accepts its drafts most, until it is
        measured: that slot drafts its k from it whatever the plan says, and the others none. A try costs one
        sequence's drafts, not every sequence drafting as if it cost nothing; and it is drafted even where the
        estimates say it does not pay, since an estimate no round can correct (a batch under load, where a
        source's last rounds went badly) would otherwise stop it for good."""
        active = [s for s in self._all if s.active]
        for s in active:
            s._settle()
        waits = self.draft_cost(len(active))
        trying: dict[str, tuple[Slot, float]] = {}  # a source not measured at this load -> the slot that tries it
        for s in active:
            for name, acceptance in zip(s.sources, s.acceptance):
                first = acceptance.first if name not in waits.drafting and s.k_wanted else -1.0
                if first > trying.get(name, (s, -1.0))[1]:
                    trying[name] = (s, first)
        sequences = [Sequence(a.values(s.k_wanted), s.k_wanted if name not in trying or trying[name][0] is s else 0,
                              waits.per_token(name), chance)
                     for s in active for name, a, chance in zip(s.sources, s.acceptance, s.chances())]
        self._planned = self.steps
        plan = plan_ks(self.cost, sequences, waits.overhead, slots=len(active),
                       context=sum(s.length for s in active) / max(len(active), 1))
        self._plan, at = {}, 0
        for s in active:
            ks = plan[at:at + len(s.sources)]
            for i, name in enumerate(s.sources):
                if name in trying and trying[name][0] is s:
                    ks[i] = s.k_wanted
            s.planned = self._plan[s] = (ks, s.k_wanted)
            at += len(s.sources)

    def report(self) -> dict:
        """What the batch has measured and decided so far, for an operator (the server's ``/health``): its steps,
        the sequences a step held on average, the calibrated cost (ms of a step by its rows), how much faster
        (scale) or slower (offset) its steps run than that, and per load (sequences a step): the gap between
        steps with nothing drafted, what a drafted token of each source adds to it, and whether its guard
        drafts (where a Session on the batch has a speculator); and of each source, over every slot's rounds:
        the chance it proposes something when asked, and its acceptance by drafted position."""
        with self._cond:
            guards = {load_label(load): "drafting" if g.drafting else "plain"
                      for load, g in sorted(self.guards.items())} if any(s.sources for s in self._all) else {}
            costs = sorted(self.draft_costs.items())
            return {"slots": self.slots, "active": self._active_count(), "steps": self.steps,
                    "sequences_per_step": round(self.calls / self.steps, 2) if self.steps else 0.0,
                    "step_ms": {str(r): round(t * 1e3, 3) for r, t in zip(self.cost.rows, self.cost.seconds)},
                    "step_scale": round(self.cost.scale, 3),
                    "step_offset_ms": round(self.cost.offset * 1e3, 3),
                    "gap_ms": {load_label(load): round(c.overhead * 1e3, 3) for load, c in costs if c.plain},
                    "draft_token_ms": {load_label(load): {n: round(c.per_token(n) * 1e3, 3) for n in c.drafting}
                                       for load, c in costs if c.drafting},
                    "guards": guards,
                    "answers": {n: round(self.answer_rates.get(n, PRIOR_ANSWER), 3) for n in sorted(self.pooled)},
                    "acceptance": {n: [round(a, 3) for a in pool.values(ACCEPTANCE_POSITIONS)]
                                   for n, pool in sorted(self.pooled.items())}}

    @property
    def emitted(self) -> int:
        """Tokens the slots' rounds have emitted (counted as they report them)."""
        return self._emitted_gone + sum(s.emitted for s in self._all)

    def _changed(self) -> None:
        """A slot's ``active`` changed: counted again when next asked, and its load's guard and plan read again."""
        self._recount = True
        self.drafts_next, self.planned_next = True, False

    def _active_count(self) -> int:
        """The slots in a request, counted again only after one changed (every round asks, under the lock)."""
        if self._recount:
            self._recount = False  # before the count: a change while counting is counted again next time
            self._active = sum(s.active for s in self._all)
        return self._active

    def guard(self, sequences: int) -> Guard:
        """The guard of a step of this many sequences: one for a lone sequence, then one per power of two (2, 3-4,
        5-8, 9-16, ...)."""
        load = _load(sequences)
        if load not in self.guards:
            self.guards[load] = Guard()
        return self.guards[load]

    def draft_cost(self, sequences: int) -> DraftCost:
        """What the steps of this many sequences wait for between them: one per load, as the guards; a new one
        starts from the nearest load's."""
        load = _load(sequences)
        if load not in self.draft_costs:
            cost = DraftCost()
            if self.draft_costs:
                cost.seed(self.draft_costs[min(self.draft_costs, key=lambda known: abs(known - load))])
            self.draft_costs[load] = cost
        return self.draft_costs[load]

    def pool(self, source: str) -> Acceptance:
        """The batch's acceptance of ``source`` over every slot's rounds: the prior of each slot's own estimate,
        so a request starts from what the source does here, and a slot whose source has not drafted for a while
        goes back to that, not to a constant under which a loaded batch may never draft, nor measure, again."""
        if source not in self.pooled:
            self.pooled[source] = Acceptance(PRIOR_ACCEPTANCE, POOL_DECAY, 0.0)
        return self.pooled[source]

    def k_for(self, slot: "Slot") -> list[int] | int:
        """The planned k of each of ``slot``'s sources (planned again when it wants another k than the plan
        assumed), or one k for all of them: none drafts where the load's guard says so, and a lone sequence
        otherwise drafts what its Session would draft alone."""
        active = self._active_count()
        if not self.guard(active).drafting:
            return 0
        if active <= 1:
            return slot.k_wanted
        n = len(slot.sources)
        ks, wanted = self._plan.get(slot, ((), -1))
        if wanted != slot.k_wanted or len(ks) != n:
            self._replan()
            ks, wanted = self._plan.get(slot, ((), -1))
        return ks if len(ks) == n else slot.k_wanted


@dataclass
class _Gap:
    """The gap before a clean step with drafts, told to ``waits`` once every drafting slot has reported which
    of its sources drafted how many tokens in how many seconds (``parts``)."""

    waits: DraftCost
    gap: float
    tokens: int
    parts: dict[str, tuple[int, float]] = field(default_factory=dict)
    caught_up: bool = False
    """A source drafted for the first time since its request's prompt, or in ``CATCH_UP_ROUNDS`` rounds of its
    slot: it read everything it had not (a head reads every row since its last proposal; after the prompt, the
    prompt), so the gap says what catching up costs, not what its tokens do."""


def _load(sequences: int) -> int:
    """The load of a step of this many sequences: 0 for one (a lone sequence), 1 for two, 2 for 3-4, 3 for
    5-8, ..."""
    return (sequences - 1).bit_length() if sequences > 1 else 0


def load_label(load: int) -> str:
    """The sequences a step holds under ``Batch.guards[load]``: "1", "2", "3-4", "5-8", "9-16", ..."""
    low, high = (2 ** (load - 1) + 1, 2 ** load) if load > 1 else (load + 1, load + 1)
    return str(low) if low == high else f"{low}-{high}"


class Slot(GraphModel):
    """One sequence of a Batch: a decoder like the others (``decoder.Decoder``), whose calls run in the
    batch's steps. Its logits and hidden states are its own copies, valid until its next call."""

    shared = True

    def __init__(self, batch: Batch, index: int):
        super().__init__(batch.graph)
        self.batch, self.index = batch, index
        self.max_positions = min(self.manifest.max_positions, batch.capacity)
        self.pending: np.ndarray | None = None
        self.fed = self.want = 0
        self.since = 0.0
        self.error: Exception | None = None
        self.active = False
        self.released = False
        """Given back to the batch (``Batch.release``): it takes no more calls."""
        self.fresh = False
        """A request's prompt is not all in yet: its steps tell nothing of drafting."""
        self.leads: list[Slot] = []
        """Slots of a draft model's Batch that this slot's Session drafts with: between this slot's step and its
        next hand-in the Session drafts, so the draft's steps wait for them then (``lead``)."""
        self.led = False
        """A draft's slot: active (its batch's steps wait for it) from its target's step to its target's next
        hand-in, not from its own reset."""
        self.sources: tuple[str, ...] = ()
        """The draft sources of its Session's speculator (``draft_sources``); none for plain decoding."""
        self.batched: tuple[bool, ...] = ()
        """Of each source: whether its drafts run in a Batch's steps (a draft model on a Batch's slot)."""
        self.acceptance: list[Acceptance] = []
        """Of each source: the estimated chance a drafted token is accepted, given the ones before it were, by
        position."""
        self.answers: list[float] = []
        """Of each source: the estimated chance it proposes something when asked (lookup: finds a match)."""
        self.caps: list[int] = []
        """The k of each source this round (``k_cap``)."""
        self._capped = False  # some cap is above 0
        self._asked = False  # the round was planned: caps says which sources were asked
        self._gap: _Gap | None = None  # the gap before the step that ran this slot's drafts, told in ``observe``
        self.drafted_last = False
        """Whether its last call held drafted tokens."""
        self._rounds = 0  # the rounds it has reported
        self._idle = 0  # of those, the rounds that drafted nothing (counted by its own thread, without the lock)
        self._drifted = 0  # of those, the rounds its acceptances have drifted by (under the lock: ``_settle``)
        self.emitted = 0
        """Tokens its rounds have emitted (counted by its own thread; the batch sums them)."""
        self._drafted_at: list[int | None] = []  # of each source, the round it last drafted (None: not since reset)
        self.k_wanted = 0
        """The k the Session would draft next round, before the batch's plan caps it."""
        self.planned: tuple[list[int], int] | None = None
        """Its part of the batch's last plan: the k of each source, and the k it wanted when planned."""
        self._logits = np.zeros((K_MAX + 1, self.logits_width), np.float32)
        self._hidden_buf: np.ndarray | None = None
        self._out: np.ndarray = self._logits[:0]
        self.length = 0
        self.chain_left = 0
        """Drafted tokens its chain has still to run (``chain``)."""
        self._chain = np.zeros(K_MAX, np.int64)
        self._chained = 0
        self._next = np.zeros(1, np.int64)

    def fetch_hidden(self) -> int:
        width = self.batch.fetch_hidden()
        self._hidden_buf = np.zeros((self.batch.width, width), np.float32)
        return width

    def reset(self) -> None:
        with self.batch._cond:
            self.length, self.hidden, self.fresh, self.planned = 0, None, True, None
            self.active = not self.led
            self.batch._changed()
            self._drafted_at = [None] * len(self.sources)
            for estimate in self.acceptance:  # a new text: its estimates start from the batch's
                estimate.clear()
            self.answers = [self.batch.answer_rates.get(name, PRIOR_ANSWER) for name in self.sources]

    def idle(self) -> None:
        """The request ended (or, for a draft's slot, its round's drafting did): steps no longer wait for it."""
        with self.batch._cond:
            self.active = False
            self.batch._changed()
            self.batch._cond.notify_all()
        for draft in self.leads:
            draft.idle()

    def lead(self, draft: "Slot") -> None:
        """Let this slot's steps pace ``draft``, a slot of the draft model's Batch its Session drafts with: the
        drafts of every Session that stepped together then run in the same draft steps."""
        if draft.batch is self.batch:
            raise GenerationError("a draft's slot must be of another Batch than its target's")
        draft.led = True
        self.leads.append(draft)

    def arm(self) -> None:
        """Its target stepped: its Session drafts next, and the draft's steps wait for it (``idle`` ends it)."""
        with self.batch._cond:
            self.active = True
            self.batch._changed()

    def keep_hidden(self, rows: np.ndarray, at: int, total: int) -> None:
        """Rows ``at``.. of the hidden states of this slot's call of ``total`` tokens (a prompt comes in chunks);
        called by a step under the batch's lock."""
        if self._hidden_buf is None:
            return
        if total > len(self._hidden_buf):  # a longer prompt than any before: grown once
            self._hidden_buf = np.zeros((total, self._hidden_buf.shape[1]), np.float32)
        self._hidden_buf[at:at + len(rows)] = rows
        self.hidden = self._hidden_buf[:total]

    def deliver(self, logits: np.ndarray) -> None:
        """The rows of this slot's call, copied out of the step's buffer (under the batch's lock)."""
        n = len(logits)
        self._logits[:n] = logits
        self._out = self._logits[:n]

    def forward(self, tokens, rows: int | None = None) -> np.ndarray:
        s = len(tokens)
        end = self.length + s
        check_room(end, self.max_positions)
        n = s if rows is None else min(rows, s)
        if n > K_MAX + 1:
            raise GenerationError(f"a batched slot returns at most {K_MAX + 1} rows of logits a call, {n} were asked")
        for draft in self.leads:  # the round's drafting is done (armed only by this slot's step, which is over)
            if draft.active:
                draft.idle()
        if not self.active:
            self.active = True
            self.batch._changed()
        t0 = time.perf_counter()
        self.batch.submit(self, np.asarray(tokens, np.int64), n)
        self.run_seconds += time.perf_counter() - t0
        return self._out

    def chain(self, tokens, k: int) -> np.ndarray:
        """Greedy drafts without leaving the batch's steps: feed ``tokens``, then k - 1 times the argmax of the
        last row fed, each in the step after; the k argmax ids (valid until its next call). The steps run on
        without waking this slot's thread between them, so they wait for no sequence's Python; a draft's slot
        stops pacing its batch's steps at its chain's end."""
        k = as_int(k, "k (tokens a chain drafts)", 1, K_MAX)
        check_room(self.length + len(tokens) + k - 1, self.max_positions)
        self._chained, self.chain_left = 0, k
        try:
            self.forward(tokens, rows=1)
        finally:
            self.chain_left = 0
        return self._chain[:self._chained]

    def chain_next(self, logits: np.ndarray) -> bool:
        """A chain's step is over (called under the batch's lock): keep the argmax of ``logits``, its last row
        (read in the step's buffer, not copied); True where the chain goes on, its next token then pending."""
        x = int(logits.argmax())
        if self.vocab_ids is not None:
            x = int(self.vocab_ids[x])
        self._chain[self._chained] = x
        self._chained += 1
        self.chain_left -= 1
        if self.chain_left:
            self._next[0] = x
            self.pending, self.fed, self.want, self.fresh = self._next, 0, 1, False
            self.since = time.perf_counter()
            return True
        if self.led:  # its round's drafting is done: the others' chains need not wait for it
            self.active = False
            self.batch._changed()
        return False

    def commit(self, length: int) -> None:
        self.length = min(self.length, length)

    def draft_sources(self, names: tuple[str, ...], batched: tuple[bool, ...] | None = None) -> None:
        """Its Session drafts from these sources (in the order its speculator tries them; ``batched``: of each,
        whether its drafts run in a draft model's Batch, whose steps wait for it only where it may draft); the
        batch plans a k, and keeps an acceptance and a chance of answering, for each."""
        with self.batch._cond:
            self.sources = tuple(names)
            self.batched = tuple(batched) if batched is not None else (False,) * len(names)
            self.acceptance = [Acceptance(PRIOR_ACCEPTANCE, ACCEPTANCE_DECAY, ACCEPTANCE_DRIFT,
                                          base=self.batch.pool(name)) for name in names]
            self.answers = [self.batch.answer_rates.get(name, PRIOR_ANSWER) for name in names]
            self.caps, self._capped = [0] * len(names), False
            self._drafted_at = [None] * len(names)

    def chances(self) -> list[float]:
        """Of each source, the chance it is the one to draft the next round: it answers, and none before it did."""
        out, none_before = [], 1.0
        for answer in self.answers:
            out.append(none_before * answer)
            none_before *= 1.0 - answer
        return out

    def k_cap(self, wanted: int, ks=None) -> int:
        """The k this slot drafts next round when its Session would draft ``wanted`` (``ks``: at most that
        from each source, its adaptive ks): the batch's plan, whose k for each source is left in ``caps``.
        Without taking the lock where the last step's load drafts nothing (0: ``Batch.drafts_next``), or left a
        plan that holds for the k it wants (``Batch.planned_next``)."""
        self.k_wanted = wanted
        batch, planned = self.batch, self.planned
        self._asked = True
        if not batch.drafts_next:  # the round is a plain one: as cheap as a plain Session's (docs/performance.md)
            if self._capped:
                self.caps[:] = [0] * len(self.caps)
                self._capped = False
            return 0
        if batch.planned_next and planned is not None and planned[1] == wanted and len(planned[0]) == len(self.caps):
            plan = planned[0]
        else:
            with batch._cond:
                plan = batch.k_for(self)
        for i in range(len(self.caps)):
            k = plan if isinstance(plan, int) else plan[i]
            self.caps[i] = min(k, wanted if ks is None else min(wanted, ks[i]))
        self._capped = any(self.caps)
        return max(self.caps, default=0)

    def observe(self, drafted: int, accepted: int, source: int = 0, seconds: float = 0.0) -> None:
        """A round's result (``source``: which one drafted it, in ``seconds`` of this slot's thread): the
        acceptance and chances the batch plans with, what the step before it waited for, the tokens it emitted."""
        self.emitted += accepted + 1
        if drafted == 0 and not (self._asked and self._capped):  # nothing to tell but its count: no lock
            self._asked = False
            self._rounds += 1
            self._idle += 1
            return
        with self.batch._cond:
            if drafted > 0:
                last = self._drafted_at[source]
                if self._gap is not None:
                    tokens, spent = self._gap.parts.get(self.sources[source], (0, 0.0))
                    self._gap.parts[self.sources[source]] = (tokens + drafted, spent + seconds)
                    if last is None or self._rounds - last > CATCH_UP_ROUNDS:
                        self._gap.caught_up = True
                self._drafted_at[source] = self._rounds
            self._rounds += 1
            self._gap = None
            self._answered(drafted, source)
            if drafted == 0:
                self._idle += 1
            self._settle()
            if drafted > 0:  # the other sources drift back, so one whose drafts stopped paying is tried again
                for i, estimate in enumerate(self.acceptance):
                    if i == source:
                        estimate.observe(drafted, accepted)
                        estimate.base.observe(drafted, accepted)
                    else:
                        estimate.drift()

    def _settle(self) -> None:
        """Let every source's acceptance drift over the rounds that drafted nothing, counted without the lock
        (called under it, before they are read)."""
        rounds = self._idle - self._drifted
        if rounds:
            for estimate in self.acceptance:
                estimate.drift(rounds)
            self._drifted += rounds

    def _answered(self, drafted: int, source: int) -> None:
        """Which sources were asked this round and whether they answered: each before the one that drafted
        did not; where nothing was drafted, none asked did (known only of a planned round)."""
        asked = self._asked
        self._asked = False
        last = source if drafted > 0 else len(self.answers) if asked else 0
        rates = self.batch.answer_rates
        for i in range(last):
            if not asked or self.caps[i] > 0:
                self.answers[i] = ACCEPTANCE_DECAY * self.answers[i]
                name = self.sources[i]
                rates[name] = POOL_DECAY * rates.get(name, PRIOR_ANSWER)
        if drafted > 0:
            self.answers[source] = ACCEPTANCE_DECAY * self.answers[source] + (1 - ACCEPTANCE_DECAY)
            name = self.sources[source]
            rates[name] = POOL_DECAY * rates.get(name, PRIOR_ANSWER) + (1 - POOL_DECAY)
