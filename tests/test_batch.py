"""Continuous batching (sessions/batch.py, backends/batched.py): the batched fused graph computes every slot's
rows bitwise as the one-sequence graph computes them, with rollbacks of different lengths per slot and prompts
fed in chunks; Sessions on one Batch, joining and leaving while others decode, each give what they give alone
(greedy and seeded sampled, every speculator); batched sampled rounds keep the target's distribution; what
cannot be batched is refused with the fix."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from lossless import assert_first_two_tokens_follow, two_token_marginals
from rlxrt.backends import compile, cpu_kernels
from rlxrt.config import Config
from rlxrt.errors import GenerationError, ProviderError
from rlxrt.sampling import SamplingParams
from rlxrt.sessions import Cascade, DraftModel, MtpHead, PromptLookup, Session
from rlxrt.sessions.batch import Batch
from rlxrt.speculator import DraftProposal, Speculator
from rlxrt.sessions.fused import FusedKVModel
from rlxrt.app.flags import head_dir
from rlxrt.app.reference import reference_pair

TARGET, DRAFT = (str(p) for p in reference_pair())
HEAD = str(head_dir(None, None))

CFG = Config(intra_op_threads=1, cache=False, cpu_kernels="rlxrt")
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef add(a, b):\n    return"


def _script(rng, prompt_len: int, vocab: int):
    """A prompt and four calls after it, each kept to a random length (a rollback of its own)."""
    prompt = rng.integers(3, vocab, prompt_len)
    calls, length = [], prompt_len
    for k in (1, 4, 6, 3):
        fed = rng.integers(3, vocab, k)
        length += int(rng.integers(1, k + 1))
        calls.append((fed, length))
    return prompt, calls


def _play(model, prompt, calls) -> list[np.ndarray]:
    model.reset()
    out = [model.forward(prompt, rows=1).copy()]
    for fed, keep in calls:
        out.append(model.forward(fed).copy())
        model.commit(keep)
    return out


def _on_threads(count: int, run, hung: str, seconds: float = 50) -> list[Exception]:
    """``run(i)`` for each i < count on a thread of its own, all at once; what they raised. A thread still running
    after ``seconds`` fails the test with ``hung``."""
    errors: list[Exception] = []

    def one(i):
        try:
            run(i)
        except Exception as exc:  # returned to the test
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds)
    assert not any(t.is_alive() for t in threads), hung
    return errors


def _batched_equals_lone(target, slots: int, chunk: int, lengths) -> None:
    lone = FusedKVModel(compile(target, CFG))
    batch = Batch(target, CFG, slots=slots, chunk=chunk, calibrate=False, gather_seconds=30.0)  # steps wait for all
    rng = np.random.default_rng(7)
    scripts = [_script(rng, n, lone.vocab_size) for n in lengths]
    expected = [_play(lone, *s) for s in scripts]
    got: dict[int, list] = {}

    ready = threading.Barrier(len(scripts))

    def run(i):
        slot = batch.slot()
        slot.reset()  # in a request: steps wait for it
        ready.wait()
        got[i] = _play(slot, *scripts[i])
        batch.release(slot)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(scripts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, want in enumerate(expected):
        assert len(got[i]) == len(want)
        for a, b in zip(got[i], want):
            assert a.shape == b.shape and np.array_equal(a, b), f"sequence {i} differs from its lone run"
    assert batch.steps < sum(len(s[1]) + 1 + len(s[0]) // chunk for s in scripts)  # calls really shared steps


def test_batched_graph_equals_lone_runs_on_the_shipped_target():
    _batched_equals_lone(TARGET, slots=4, chunk=8, lengths=(5, 30, 17, 1))


@pytest.mark.parametrize("family, kwargs", [("llama", {}), ("qwen3", {}), ("mistral", {"greedy_head": True}),
                                            ("llama", {"quantize": "int4"}), ("llama", {"quantize": "int8"})])
def test_batched_graph_equals_lone_runs_on_every_fused_kind(exported, family, kwargs):
    _batched_equals_lone(exported(family, graph="fused", **kwargs), slots=3, chunk=4, lengths=(9, 2, 13))


def test_sessions_joining_and_leaving_equal_their_lone_runs():
    """Eight Sessions of every speculator on one Batch, started at staggered times so that requests join and
    leave while others decode, two requests each; greedy and seeded sampled output equal the lone run's."""
    batch = Batch(TARGET, CFG, slots=8, chunk=16)
    makers = [lambda: None, PromptLookup, lambda: DraftModel(DRAFT, CFG), lambda: MtpHead(HEAD, CFG)]
    requests = [(CODE + " " * i, dict(max_new_tokens=24 + 8 * (i % 3), ignore_eos=True,
                                     **({"temperature": 0.8, "seed": i} if i % 2 else {}))) for i in range(8)]
    lone = {}
    for i, (prompt, kw) in enumerate(requests):
        lone[i] = Session(TARGET, makers[i % 4](), CFG).generate(prompt, **kw).token_ids
    got, errors = {}, []
    start = [threading.Event() for _ in requests]

    def run(i):
        try:
            session = Session(batch, makers[i % 4](), CFG)
            start[i].wait()
            for _ in range(2):  # the slot serves a second request after the first
                got[i] = session.generate(requests[i][0], **requests[i][1]).token_ids
            if i + 1 < len(start):
                start[i + 1].set()
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    start[0].set()
    for i in range(1, len(start), 2):  # odd requests join early, beside the running ones
        start[i].set()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert {i: got[i] for i in lone} == lone


@pytest.mark.parametrize("catch_up", [None, 5])
def test_drafts_on_a_draft_batch_step_together_and_equal_their_lone_runs(catch_up):
    """Sessions whose draft model drafts on a slot of the draft's own Batch: their drafts run in shared steps
    (more calls than steps), and every output equals the lone run's, greedy and seeded, with a draft alone and
    behind prompt lookup (a round that drafts from the lookup, or not at all, leaves the draft's steps at once:
    a step that waited for it would wait out the minute both batches gather for); also where a draft more than
    5 tokens behind starts again on the last 5 (after the prompt, and after the lookup's rounds)."""
    batch = Batch(TARGET, CFG, slots=6, chunk=16, gather_seconds=60)
    drafts = Batch(DRAFT, CFG, slots=6, chunk=16, gather_seconds=60, calibrate=False)
    makers = [lambda d: DraftModel(d, CFG, catch_up=catch_up),
              lambda d: Cascade(PromptLookup(min_n=3), DraftModel(d, CFG, catch_up=catch_up))]
    requests = [(CODE + " " * i, dict(max_new_tokens=20 + 6 * (i % 3), ignore_eos=True,
                                     **({"temperature": 0.8, "seed": i} if i % 3 == 2 else {}))) for i in range(6)]
    lone = {i: Session(TARGET, makers[i % 2](DRAFT), CFG, k=3).generate(p, **kw).token_ids
            for i, (p, kw) in enumerate(requests)}
    got = {}

    def run(i):
        session = Session(batch, makers[i % 2](drafts), CFG, k=3)
        for _ in range(2):
            got[i] = session.generate(requests[i][0], **requests[i][1]).token_ids

    errors = _on_threads(len(requests), run, "a step waited for a slot that was not drafting")
    assert not errors, errors
    assert got == lone
    assert drafts.calls > drafts.steps > 0


class _Flipping:
    """A guard that switches between plain steps and drafting every ``every`` steps it is told of."""

    def __init__(self, every: int):
        self.every, self.told, self.drafting, self.plain_steps = every, 0, True, 0

    def step(self, drafting: bool, seconds: float, tokens: int) -> None:
        self.told += 1
        self.plain_steps += not drafting
        if self.told % self.every == 0:
            self.drafting = not self.drafting


def test_rounds_that_switch_between_plain_steps_and_drafts_equal_their_lone_runs():
    """Where the guard switches modes every few steps, a draft model's Session drafts in some rounds and not in
    others (a plain round takes neither the lock nor the draft's commit: nothing it read is left to cut), and
    catches up when it drafts again: every output, greedy and seeded, equals the lone run's."""
    batch = Batch(TARGET, CFG, slots=4, chunk=16, gather_seconds=60)
    drafts = Batch(DRAFT, CFG, slots=4, chunk=16, gather_seconds=60, calibrate=False)
    flipping = _Flipping(3)
    batch.guard = lambda sequences: flipping
    requests = [(CODE + " " * i, dict(max_new_tokens=40, ignore_eos=True,
                                     **({"temperature": 0.8, "seed": i} if i == 3 else {}))) for i in range(4)]
    lone = {i: Session(TARGET, DraftModel(DRAFT, CFG), CFG, k=3).generate(p, **kw).token_ids
            for i, (p, kw) in enumerate(requests)}
    got = {}

    def run(i):
        got[i] = Session(batch, DraftModel(drafts, CFG), CFG, k=3).generate(requests[i][0], **requests[i][1]).token_ids

    errors = _on_threads(len(requests), run, "a request did not end")
    assert not errors, errors
    assert got == lone
    assert flipping.plain_steps > 3 and drafts.calls > drafts.steps > 0  # both modes ran

def test_a_chain_runs_its_drafts_in_consecutive_steps_and_equals_the_token_by_token_chain():
    """``Slot.chain``: each slot's greedy chain (k of its own) runs in the batch's steps without its thread
    handing in between them, as many steps as the longest chain; its tokens are the argmax chain fed one token a
    call, its length counts every token fed, and a draft's slot stops pacing the steps at its chain's end."""
    lone = FusedKVModel(compile(DRAFT, CFG))
    drafts = Batch(DRAFT, CFG, slots=3, calibrate=False, gather_seconds=30.0)
    target = Batch(TARGET, CFG, slots=1, calibrate=False)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, lone.vocab_size, n) for n in (9, 17, 5)]
    ks = (1, 3, 4)
    expected = []
    for prompt, k in zip(prompts, ks):
        lone.reset()
        x, chain = int(lone.forward(prompt, rows=1)[-1].argmax()), []
        for _ in range(k):
            chain.append(x)
            x = int(lone.forward(np.array([x]))[-1].argmax())
        expected.append(chain)
    slots = [drafts.slot() for _ in ks]
    lead = target.slot()
    for s in slots:
        lead.lead(s)
        s.reset()
        s.arm()
    got: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, slots[i].chain(prompts[i], ks[i]).tolist()))
               for i in range(len(ks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert [got[i] for i in range(len(ks))] == expected
    assert drafts.steps == max(ks) and drafts.calls == sum(ks)
    assert [s.length for s in slots] == [len(p) + k - 1 for p, k in zip(prompts, ks)]
    assert not any(s.active for s in slots)
    with pytest.raises(GenerationError, match="k .tokens a chain drafts."):
        slots[0].chain(prompts[0], 0)


def test_a_draft_reads_its_prompt_only_when_it_first_drafts():
    """A request that never drafts (here: one token, so no round has room for a draft) costs the draft's batch
    no step; the next request's first proposal reads its whole prompt, and its output is the lone run's."""
    batch = Batch(TARGET, CFG, slots=2, calibrate=False)
    drafts = Batch(DRAFT, CFG, slots=2, calibrate=False)
    session = Session(batch, DraftModel(drafts, CFG), CFG, k=2)
    assert len(session.generate(CODE, max_new_tokens=1).token_ids) == 1
    assert drafts.steps == 0
    got = session.generate(CODE, max_new_tokens=12, ignore_eos=True)
    assert drafts.steps > 0 and got.stats.drafted > 0
    assert got.token_ids == Session(TARGET, DraftModel(DRAFT, CFG), CFG, k=2).generate(
        CODE, max_new_tokens=12, ignore_eos=True).token_ids


def test_a_draft_on_a_batch_needs_a_batched_target():
    drafts = Batch(DRAFT, CFG, slots=1, calibrate=False)
    with pytest.raises(GenerationError, match="another Batch"):
        Session(TARGET, DraftModel(drafts, CFG), CFG)


@pytest.mark.parametrize("catch_up", [64, 1])
def test_batched_sampling_follows_the_target(exported, catch_up):
    """Sampled speculative rounds in batched steps, beside other sequences: the first two tokens' chi-square;
    also with a draft that reads only the last token of the text (``catch_up=1``), so its proposals come from
    another distribution than a draft that read the prompt: the target's stays."""
    target = exported("llama", graph="fused")
    batch = Batch(target, CFG, slots=2)
    params = SamplingParams(1.0, 0, 1.0)
    prompt = [5, 9, 14, 5, 9]
    p1, p2 = two_token_marginals(FusedKVModel(compile(target, CFG)), prompt, params)
    busy = threading.Event()

    def neighbour():  # a plain sequence that keeps decoding in the other slot
        s = Session(batch, None, CFG)
        while not busy.is_set():
            s.generate([3, 4, 5], max_new_tokens=8, ignore_eos=True)

    t = threading.Thread(target=neighbour)
    t.start()
    try:
        spec = DraftModel(exported("llama", seed=1, graph="fused"), CFG, catch_up=catch_up)
        session = Session(batch, spec, CFG, k=3)
        assert_first_two_tokens_follow(session, prompt, p1, p2, draws=600)
        assert spec.offset == (len(prompt) - 1 if catch_up == 1 else 0)  # it started again on the last token
    finally:
        busy.set()
        t.join()


def test_a_failed_step_fails_its_requests_and_the_batch_serves_on(monkeypatch):
    batch = Batch(TARGET, CFG, slots=2, calibrate=False)
    session = Session(batch, None, CFG)
    before = session.generate(CODE, max_new_tokens=8).token_ids
    real = batch.graph.session.run_with_iobinding

    def fails(binding):
        raise batch.graph.errors[0]("an injected failure")

    monkeypatch.setattr(batch.graph.session, "run_with_iobinding", fails)
    with pytest.raises(GenerationError, match="injected"):
        session.generate(CODE, max_new_tokens=8)
    monkeypatch.setattr(batch.graph.session, "run_with_iobinding", real)
    assert session.generate(CODE, max_new_tokens=8).token_ids == before


def test_a_step_failing_within_a_chain_fails_the_request_and_the_chain_serves_on(monkeypatch):
    """A draft's step that fails after its chain's first step: the round's request fails with the error, no
    chain is left running, and the next request drafts and equals its lone run."""
    batch = Batch(TARGET, CFG, slots=2, calibrate=False)
    drafts = Batch(DRAFT, CFG, slots=2, calibrate=False)
    session = Session(batch, DraftModel(drafts, CFG), CFG, k=4)
    real = drafts.graph.session.run_with_iobinding
    calls = []

    def fails_second(binding):
        calls.append(1)
        if len(calls) == 2:  # the chain's second step
            raise drafts.graph.errors[0]("an injected failure")
        return real(binding)

    monkeypatch.setattr(drafts.graph.session, "run_with_iobinding", fails_second)
    with pytest.raises(GenerationError, match="injected"):
        session.generate(CODE, max_new_tokens=12, ignore_eos=True)
    assert len(calls) == 2
    monkeypatch.setattr(drafts.graph.session, "run_with_iobinding", real)
    got = session.generate(CODE, max_new_tokens=12, ignore_eos=True)
    assert got.stats.drafted > 0 and session.speculator.model.chain_left == 0
    assert got.token_ids == Session(TARGET, DraftModel(DRAFT, CFG), CFG, k=4).generate(
        CODE, max_new_tokens=12, ignore_eos=True).token_ids


def test_a_slot_that_never_hands_in_does_not_stall_the_others():
    batch = Batch(TARGET, CFG, slots=2, gather_seconds=0.05, calibrate=False)
    held = Session(batch, None, CFG).stream(CODE, max_new_tokens=64)
    next(held)  # in a request, never read again
    try:
        assert len(Session(batch, None, CFG).generate(CODE, max_new_tokens=16).token_ids) == 16
    finally:
        held.close()


def test_a_prompt_alone_goes_in_full_steps_and_beside_a_decoding_sequence_in_chunks():
    batch = Batch(TARGET, CFG, slots=4, chunk=4, calibrate=False)
    lone = Session(TARGET, None, CFG)
    prompt = lone.prompt_ids(CODE * 3)
    assert len(prompt) > batch.width
    session = Session(batch, None, CFG)
    before = batch.steps
    got = session.generate(prompt, max_new_tokens=1)
    full = 4 * batch.width  # all a step holds
    fed = len(prompt) - 1  # the Session feeds the last prompt token with its first round
    assert batch.steps - before == -(-fed // full) + 1 < -(-fed // 4) + 1
    assert got.token_ids == lone.generate(prompt, max_new_tokens=1).token_ids
    decoding, fresh = batch.slot(), batch.slot()
    try:
        decoding.reset()
        fresh.reset()
        assert batch._chunk([fresh]) == full // 1 and batch._chunk([decoding, fresh]) == full // 2
        decoding.fresh = False  # past its prompt: its next token waits for every step
        assert batch._chunk([fresh]) == batch._chunk([decoding, fresh]) == 4
    finally:
        batch.release(decoding)
        batch.release(fresh)


def test_each_draft_source_of_a_slot_is_planned_from_its_own_acceptance_and_chance():
    """A Cascade's slot keeps an acceptance and a chance of answering for each source, from its rounds'
    reports; under load the plan keeps the accurate source drafting and stops the one that is not."""
    from rlxrt.sessions.k_policy import StepCost

    batch = Batch(TARGET, CFG, slots=2, calibrate=False)
    batch.cost = StepCost({1: 1.0, 2: 1.1, 8: 2.0, 64: 10.0})  # a row costs ~0.14 of a step past two
    a, b = batch.slot(), batch.slot()
    try:
        for s in (a, b):
            s.draft_sources(("prompt-lookup", "mtp-head"))
            s.reset()
            assert s.chances() == [0.5, 0.25]  # the prior: lookup answers half the rounds, the head the rest
        waits = batch.draft_cost(2)  # both sources' costs measured at this load: every slot is planned for each
        waits.observe(0.001)
        waits.observe(0.0012, {"prompt-lookup": (2, 0.0001), "mtp-head": (2, 0.0001)})
        for _ in range(60):  # lookup drafts 3 and all are kept; the head drafts 3 and the first is rejected
            for s in (a, b):
                s.k_cap(3)
                s.observe(3, 3, 0)
                s.k_cap(3)
                s.observe(3, 0, 1)
        assert a.acceptance[0].first > 0.9 and a.acceptance[1].first < 0.2
        assert 0.4 < a.chances()[0] < 0.6 and 0.4 < a.chances()[1] < 0.6  # each drafted half the rounds
        with batch._cond:
            batch._replan()  # as after every step
        a.k_cap(3)
        lookup, head = a.caps
        assert lookup >= 2 and head == 0, a.caps
        for _ in range(60):  # lookup stops finding matches: asked, it answers nothing; the head drafts if asked
            a.k_cap(3)
            a.observe(a.caps[1], 0, 1)
            with batch._cond:
                batch._replan()
        assert a.chances()[0] < 0.01 and a.chances()[1] > 0.99
        assert a.caps[0] >= 1  # still asked: its planned chance never falls to nothing
        a.draft_sources(("draft-model",))  # other sources: planned anew, not read from the old plan
        assert a.k_cap(3) <= 3 and len(a.caps) == 1  # the same k wanted as the old plan assumed
    finally:
        batch.release(a)
        batch.release(b)


def test_a_request_starts_from_what_its_source_does_in_the_batch():
    """Each slot's acceptance and chance of answering start, at each request, from the batch's estimates over
    every slot's rounds: a new request of a loaded batch whose source drafts well is planned to draft, where a
    constant prior of one half would stop it before any round could tell."""
    from rlxrt.sessions.k_policy import StepCost

    batch = Batch(TARGET, CFG, slots=4, calibrate=False)
    batch.cost = StepCost({1: 1.0, 4: 1.3, 64: 20.0})  # past four rows, a row costs ~0.31 of a four-row step
    slots = [batch.slot() for _ in range(4)]
    try:
        for s in slots:
            s.draft_sources(("prompt-lookup",))
            s.reset()
            s.k_wanted = 2
        assert slots[0].acceptance[0].values(2) == (0.5, 0.5) and slots[0].answers == [0.5]
        waits = batch.draft_cost(4)  # lookup's cost measured at this load (nearly nothing): no slot tries it
        waits.observe(0.001)
        waits.observe(0.001, {"prompt-lookup": (2, 0.00001)})
        with batch._cond:
            batch._replan()
        assert [batch._plan[s][0][0] for s in slots] == [0, 0, 0, 0]  # a half does not pay for a row here
        for _ in range(40):  # the first slot's rounds: it answers, and both drafts are kept
            slots[0].k_cap(2)
            slots[0].observe(2, 2, 0)
        assert batch.pool("prompt-lookup").values(2)[1] > 0.95 and batch.answer_rates["prompt-lookup"] > 0.5
        for s in slots[1:]:
            s.reset()  # their next requests
            assert s.acceptance[0].values(2) == batch.pool("prompt-lookup").values(2)
            assert s.answers == [batch.answer_rates["prompt-lookup"]]
        with batch._cond:
            batch._replan()
        assert all(batch._plan[s][0][0] > 0 for s in slots[1:])
    finally:
        for s in slots:
            batch.release(s)


def test_calibration_times_context_that_was_written():
    """Memory never written can read as one page of zeros, at no cost: the calibration writes the context its
    step attends to before timing it."""
    from rlxrt.sessions import batch as batching

    batch = Batch(TARGET, CFG, slots=2, calibrate=False)
    for buf in batch._buffers:  # a value no step writes
        buf.update_inplace(np.full(buf.shape(), 7.0, np.float32))
    batch._calibrate()
    written = batching.CONTEXT_TOKENS + batching.CONTEXT_ROWS
    for i, buf in enumerate(batch._buffers):  # keys, values, keys, ...: keys in blocks (cpu_kernels.keys_in_order)
        kv = buf.numpy()[0] if i % 2 else cpu_kernels.keys_in_order(buf.numpy()[0])  # [kv_heads, capacity, head_dim]
        assert (kv[:, :written] != 7.0).all() and (kv[:, written:] == 7.0).all()


def test_calibration_measures_again_while_its_times_are_no_shape_a_step_can_have(monkeypatch):
    """Each size's least time counts (other work only adds time); a first round whose least times break the
    shape (two rows timed while another server started) is measured again, and the cost keeps the least."""
    from rlxrt.sessions import batch as batching

    batch = Batch(TARGET, CFG, slots=2, calibrate=False)
    calls, seen = {"n": 0}, {}
    timed = (batching.CALIBRATION_REPEATS + 1) * 2 * (len(batching.CALIBRATION_ROWS) + 1)

    def run(tokens, sequences, rows):
        calls["n"] += 1
        seen[tokens] = seen.get(tokens, 0) + 1
        slowed = calls["n"] <= timed and tokens == 2  # every pass of the first rounds: two rows slowed
        noise = 2e-4 if tokens == 1 and seen[tokens] != 3 else 0.0  # one row: fast in one timed pass only
        return 1e-3 * (1 + 0.05 * tokens) * (5 if slowed else 1) + noise

    monkeypatch.setattr(batch, "_run", run)
    cost = batch._calibrate()
    sizes = [r for r in batching.CALIBRATION_ROWS if r <= min(batch.width, batch.capacity)]
    assert cost.rows == sizes
    assert cost.seconds[sizes.index(2)] == pytest.approx(1.1e-3, rel=1e-2)  # measured again: its own time
    assert cost.seconds[0] == pytest.approx(1.05e-3, rel=1e-3)  # the least, not the median (1.25e-3)
    assert calls["n"] > timed  # there were more passes


def test_a_draft_catching_up_takes_all_the_room_a_step_has_left():
    """A draft's slot reads its prompt at its first proposal; its target's batch waits for every draft step,
    so that catch-up goes in one step beside the others' drafts, not in ``chunk``-token pieces."""
    drafts = Batch(DRAFT, CFG, slots=4, chunk=4, calibrate=False)
    slots = [drafts.slot() for _ in range(3)]
    try:
        for s in slots:
            s.led = True
            s.reset()
        catching_up, drafting, other = slots
        catching_up.pending, catching_up.fed = np.zeros(60, np.int64), 0
        drafting.pending, drafting.fed, drafting.fresh = np.zeros(3, np.int64), 0, False
        other.pending, other.fed, other.fresh = np.zeros(1, np.int64), 0, False
        room = len(drafts._positions) - 4
        assert room >= 60 and drafts._chunk(slots) == room
        assert drafts._chunk([catching_up, drafting]) == room + 1
        for s in slots:  # a target's batch (no slot led) keeps its chunks beside decoding sequences
            s.led = False
        assert drafts._chunk(slots) == 4
    finally:
        for s in slots:
            s.pending = None
            drafts.release(s)


def test_slots_are_bounded_and_given_back():
    batch = Batch(TARGET, CFG, slots=1, calibrate=False)
    first = Session(batch, None, CFG)
    with pytest.raises(GenerationError, match="slots"):
        Session(batch, None, CFG)
    del first
    import gc

    gc.collect()
    Session(batch, None, CFG)  # the slot came back with the Session


def test_a_refused_session_gives_its_slot_back_at_once_and_a_given_back_slot_takes_no_calls():
    """A Session whose arguments are refused frees its slot then, not when the refused object is collected (a
    kept exception keeps it alive); a slot given back is refused at once, not left waiting for a step that no
    longer runs it; a step's gathering time is checked."""
    batch = Batch(TARGET, CFG, slots=1, calibrate=False)
    with pytest.raises(GenerationError, match="k") as kept:
        Session(batch, PromptLookup(), CFG, k=99)
    assert batch._free == [0] and kept.value is not None  # free while the error is still held
    slot = batch.slot()
    batch.release(slot)
    with pytest.raises(GenerationError, match="given back"):
        slot.forward([5, 6])
    s = Session(batch, None, CFG)  # the batch serves on
    assert len(s.generate([5, 6, 7], max_new_tokens=3, ignore_eos=True).token_ids) == 3
    for bad in (float("nan"), -1.0, "0.2x", None):
        with pytest.raises(GenerationError, match="gather_seconds"):
            Batch(TARGET, CFG, slots=1, calibrate=False, gather_seconds=bad)


def test_what_cannot_batch_is_refused_with_the_fix(exported):
    with pytest.raises(ProviderError, match="cpu_kernels = rlxrt"):
        Batch(TARGET, Config(cache=False, cpu_kernels="ort"))
    with pytest.raises(ProviderError, match="fused graph"):
        Batch(exported("llama", graph="portable"), CFG)
    with pytest.raises(ProviderError, match="float16"):
        Batch(exported("llama", graph="fused", dtype="fp16"), CFG)


def test_a_forgotten_source_is_tried_by_one_slot_and_only_drafting_slots_hold_up_the_drafts():
    """Once a source's cost is forgotten only the slot that accepts its drafts most drafts from it until it is
    measured again (not every slot, as if drafting cost nothing); a draft model's batch waits only for the
    slots planned to draft; a new load starts from the nearest load's costs."""
    from rlxrt.sessions.k_policy import StepCost

    batch = Batch(TARGET, CFG, slots=4, calibrate=False)
    batch.cost = StepCost({1: 1.0, 64: 1.1})  # rows almost free: only the drafts' cost decides
    slots = [batch.slot() for _ in range(4)]
    try:
        for n, s in enumerate(slots):
            s.draft_sources(("draft-model",), (True,))
            s.reset()
            for _ in range(n + 1):  # the later a slot, the more of its drafts were accepted
                s.acceptance[0].observe(1, 1)
            s.answers[0] = 1.0  # a draft model answers whenever asked
            s.k_wanted = 3
        waits = batch.draft_cost(4)
        assert waits is batch.draft_cost(3) and waits is not batch.draft_cost(2)  # one per load, as the guards
        with batch._cond:
            batch._replan()
        assert [batch._plan[s][0][0] for s in slots] == [0, 0, 0, 3]  # never measured here: one slot tries it
        waits.observe(0.1)
        waits.observe(0.13, {"draft-model": (3, 0.01)})  # measured: 0.01 s a drafted token
        with batch._cond:
            batch._replan()
        assert all(batch._plan[s][0][0] > 0 for s in slots)  # rows almost free: every slot drafts
        assert batch.draft_cost(8).per_token("draft-model") == pytest.approx(0.01)  # a new load starts from it
        for _ in range(waits.stale):
            waits.observe(0.1)
        assert waits.forgotten == {"draft-model"}
        with batch._cond:
            batch._replan()
        assert [batch._plan[s][0][0] for s in slots] == [0, 0, 0, 3]  # the best-accepting slot tries it
        assert [batch._leads_draft(s) for s in slots] == [False, False, False, True]
        batch.cost = StepCost({1: 1.0, 64: 64.0})  # a row costs a whole step: nothing pays, but a try is a try
        with batch._cond:
            batch._replan()
        assert [batch._plan[s][0][0] for s in slots] == [0, 0, 0, 3]
        batch.cost = StepCost({1: 1.0, 64: 1.1})
        waits.observe(0.13, {"draft-model": (3, 0.01)})
        with batch._cond:
            batch._replan()
        assert all(batch._plan[s][0][0] > 0 for s in slots) and all(batch._leads_draft(s) for s in slots)
    finally:
        for s in slots:
            batch.release(s)


def test_a_source_catching_up_leaves_its_gap_unmeasured():
    """A head reads at its first proposal all it has not read (the prompt, or the rounds since it last drafted):
    the gap before such a step says what catching up costs, not what a drafted token does, and is not measured
    as the source's cost; its next drafts, a round later, are."""
    from rlxrt.sessions.batch import CATCH_UP_ROUNDS, _Gap

    batch = Batch(TARGET, CFG, slots=2, calibrate=False)
    slots = [batch.slot(), batch.slot()]
    waits = batch.draft_cost(2)
    waits.observe(0.001)  # the gap with nothing drafted

    def step(source: int, gap: float = 0.005):
        """A clean step whose rounds drafted 2 tokens a slot from ``source``, reported, then the next step."""
        with batch._cond:
            batch._gap = record = _Gap(waits, gap, 2 * len(slots))
            for s in slots:
                s._gap = record
        for s in slots:
            s.observe(2, 1, source, 0.001)
        with batch._cond:
            batch._account(False, batch.guard(2), waits, True, 0, 0.0, 0.0, False)
        return record

    def measured(name: str) -> int:
        return len(waits.drafting.get(name, ()))

    try:
        for s in slots:
            s.draft_sources(("prompt-lookup", "mtp-head"))
            s.reset()
        assert step(1, gap=0.05).caught_up and measured("mtp-head") == 0  # the first since the prompt
        assert not step(1).caught_up and measured("mtp-head") == 1
        assert waits.per_token("mtp-head") == pytest.approx(0.001)  # (0.005 - 0.001) / 4 tokens
        assert step(0).caught_up and measured("prompt-lookup") == 0  # every source's first drafts of a request
        for _ in range(CATCH_UP_ROUNDS):
            assert not step(0).caught_up
        assert measured("prompt-lookup") == CATCH_UP_ROUNDS
        assert step(1, gap=0.05).caught_up and measured("mtp-head") == 1  # back after 9 rounds of lookup
        for s in slots:
            s.reset()  # a new request: its first drafts read its prompt
        assert step(0).caught_up
    finally:
        for s in slots:
            batch.release(s)


def test_steps_where_no_sequence_can_draft_tell_the_guards_and_draft_costs_nothing():
    """Sessions without a speculator sharing a batch with speculative ones (or before them): their steps say
    nothing of what drafting gains or costs, so the guards and the gaps the plan prices learn only from steps
    that hold a sequence that could draft."""
    batch = Batch(TARGET, CFG, slots=2, calibrate=False)

    def together(make):
        threads = [threading.Thread(target=lambda: Session(batch, make(), CFG).generate(
            CODE, max_new_tokens=60, ignore_eos=True)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)

    together(lambda: None)
    assert batch.steps > 60
    assert all(g.rates == {True: None, False: None} for g in batch.guards.values())
    assert all(not c.plain and not c.drafting for c in batch.draft_costs.values())
    together(lambda: PromptLookup(min_n=2))
    assert any(r is not None for g in batch.guards.values() for r in g.rates.values())
    assert any(c.plain or c.drafting for c in batch.draft_costs.values())


def test_the_active_count_follows_every_slot_change():
    """Rounds read the count of slots in a request without walking every slot: it is counted again after a slot
    joins a request, ends one, is armed as a draft or hands in tokens, and a lone sequence drafts as alone."""
    batch = Batch(TARGET, CFG, slots=3, calibrate=False)
    a, b = batch.slot(), batch.slot()
    try:
        with batch._cond:
            assert batch._active_count() == 0
        a.reset()
        b.reset()
        with batch._cond:
            assert batch._active_count() == 2
        b.idle()
        a.k_wanted = 3
        with batch._cond:
            assert batch._active_count() == 1 and batch.k_for(a) == 3  # alone: its Session's k
        b.arm()
        with batch._cond:
            assert batch._active_count() == 2
        b.active = False
        b.forward(np.array([1, 2], np.int64))  # a hand-in makes it active again
        with batch._cond:
            assert batch._active_count() == 2
    finally:
        batch.release(a)
        batch.release(b)
    with batch._cond:
        assert batch._active_count() == 0


def test_a_round_that_drafts_nothing_takes_no_lock_and_its_drift_is_applied_when_read():
    """Where the last step's load has its guard in plain steps, a slot's k (0) and its report of a round that
    drafted nothing need no lock (another thread holds it here); the acceptance drifts over those rounds when the
    plan next reads it, and the tokens they emitted are counted, also after the slot is given back."""
    batch = Batch(TARGET, CFG, slots=2, calibrate=False, gather_seconds=30.0)
    a, b = batch.slot(), batch.slot()
    try:
        for s in (a, b):
            s.draft_sources(("draft-model",))
        a.reset()
        assert a.k_cap(2) == 2  # alone: its Session's k
        a.observe(2, 2, 0)  # both kept: the batch's a_1 = (1 + 0.5) / (1 + 1), the prior worth one round
        b.reset()
        pool = batch.pool("draft-model").first
        assert pool == pytest.approx(0.75)
        assert a.acceptance[0].first == pytest.approx((1 + pool) / 2)  # the slot's prior is the batch's
        batch.guard(2).drafting = False
        threads = [threading.Thread(target=s.forward, args=(np.array([5], np.int64),)) for s in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not batch.drafts_next  # the step's load drafts nothing
        done = []

        def rounds():
            for _ in range(10):
                done.append(a.k_cap(2))
                a.observe(0, 0, 0)

        with batch._cond:  # held: a round that needed it would wait here
            t = threading.Thread(target=rounds)
            t.start()
            t.join(10)
            assert done == [0] * 10 and not t.is_alive()
            assert a.acceptance[0]._reached == [1.0, 1.0]  # counted by the slot, not yet told to its acceptance
            batch._replan()
        kept = 0.94 ** 10
        assert a.acceptance[0].first == pytest.approx((kept + pool) / (kept + 1))  # drifting back to the batch's
        assert batch.emitted == 3 + 10
        b.idle()  # a slot changed: the next round asks the plan again
        assert batch.drafts_next
    finally:
        batch.release(a)
        batch.release(b)
    assert batch.emitted == 13


def test_a_planned_round_reads_its_k_without_the_lock_until_it_wants_another():
    """Where the last step left a plan for its load, a slot that wants the k it was planned with reads its part
    of the plan without the lock (another thread holds it here); one that wants another k waits for the lock,
    since the batch plans again for it."""
    from rlxrt.sessions.k_policy import StepCost

    batch = Batch(TARGET, CFG, slots=2, calibrate=False, gather_seconds=30.0)
    batch.cost = StepCost({1: 1.0, 2: 1.01, 64: 1.6})  # rows all but free: the plan drafts
    a, b = batch.slot(), batch.slot()
    try:
        for s in (a, b):
            s.draft_sources(("draft-model",))
            s.reset()
        waits = batch.draft_cost(2)  # the draft's cost measured at this load: no slot is trying it
        waits.observe(0.001)
        waits.observe(0.0011, {"draft-model": (2, 0.0001)})
        assert a.k_cap(2) == 2 and b.k_cap(2) == 2  # planned under the lock
        threads = [threading.Thread(target=s.forward, args=(np.array([5], np.int64),)) for s in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert batch.planned_next and a.planned == ([2], 2)
        got = []
        with batch._cond:
            same = threading.Thread(target=lambda: got.append(a.k_cap(2)))
            same.start()
            same.join(10)
            assert got == [2] and not same.is_alive()
            other = threading.Thread(target=lambda: got.append(a.k_cap(3)))
            other.start()
            other.join(0.5)
            assert other.is_alive() and got == [2]  # waits for the lock: planned again
        other.join(10)
        assert got[1] >= 1 and a.planned[1] == 3
        b.idle()
        assert not batch.planned_next  # a slot changed: the next round asks the batch
    finally:
        batch.release(a)
        batch.release(b)


class _Known(Speculator):
    """Drafts a known continuation; ``wrong``: every draft a miss that costs 10 ms a token."""

    name = "known"

    def __init__(self, prompt_len: int, continuation: list[int], wrong: bool = False):
        self.start, self.ids, self.wrong = prompt_len, continuation, wrong

    def propose(self, ctx, k):
        done = len(ctx.tokens) - self.start
        ids = np.array(self.ids[done:done + k], np.int64)
        if self.wrong:
            time.sleep(10e-3 * len(ids))
            ids = (ids + 1) % 64
        return DraftProposal(ids)


def test_a_lone_sequence_drafts_only_where_its_guard_finds_drafting_serves_more():
    """Alone on a Batch, a Session's own k choice drafts at least one token every round; the lone sequence's
    guard measures both modes and keeps the better: it stops drafting where every draft is a miss that costs
    10 ms a token, and drafts on where every draft is right and free. Each output equals the plain run's."""
    plain = Session(TARGET, None, CFG)
    ids = plain.prompt_ids(CODE)
    expected = plain.generate(ids, max_new_tokens=160, ignore_eos=True).token_ids
    for wrong in (True, False):
        batch = Batch(TARGET, CFG, slots=1, calibrate=False)
        session = Session(batch, _Known(len(ids), expected, wrong), CFG, k=3)
        g = session.generate(ids, max_new_tokens=160, ignore_eos=True)
        assert g.token_ids == expected
        guard = batch.guards[0]
        assert None not in guard.rates.values() and guard.drafting is not wrong
        assert set(batch.guards) == {0} and batch.report()["guards"] == {"1": "plain" if wrong else "drafting"}
        if wrong:  # its first window of each mode, and at most one try of drafting: a small share of the rounds
            assert g.stats.drafted_per_position[0] <= 3 * guard.window + 3 < g.stats.rounds / 2


def test_a_draft_far_behind_the_text_reads_only_its_last_tokens():
    """A draft with more than ``catch_up`` tokens unread starts again on the last ``catch_up`` of the text: after
    a long prompt, and after rounds that drafted nothing; a shorter gap is read whole. What it keeps follows the
    committed text from there (the commit is a length past its start), and greedy output stays the plain run's."""
    from rlxrt.speculator import Context

    plain = Session(TARGET, None, CFG)
    ids = plain.prompt_ids(CODE)
    assert len(ids) > 8
    expected = plain.generate(ids, max_new_tokens=40, ignore_eos=True).token_ids
    spec = DraftModel(DRAFT, CFG, catch_up=8)
    session = Session(TARGET, spec, CFG, k=3)
    assert session.generate(ids, max_new_tokens=40, ignore_eos=True).token_ids == expected
    assert spec.offset == len(ids) - 8  # its first proposal read the prompt's last 8 tokens; then it kept up

    ctx = Context(list(ids), SamplingParams(), np.random.default_rng(0))
    spec.reset()
    proposal = spec.propose(ctx, 2)
    assert spec.offset == len(ids) - 8 and spec.model.length == 8 + 2 - 1
    ctx.tokens.extend(proposal.tokens[:1].tolist() + [7])  # the first drafted token kept, then the target's
    spec.commit(ctx, None, None)
    assert spec.model.length == 8 + 1  # the pending token is not read: it is fed next
    ctx.tokens.extend([9, 10, 11])  # three rounds that drafted nothing: a gap of 5 read whole
    spec.propose(ctx, 1)
    assert spec.offset == len(ids) - 8 and spec.model.length == len(ctx.tokens) - spec.offset
    spec.commit(ctx, None, None)
    ctx.tokens.extend(range(20, 40))  # twenty more: it starts again
    spec.propose(ctx, 2)
    assert spec.offset == len(ctx.tokens) - 8 and spec.model.length == 8 + 1
    with pytest.raises(GenerationError, match="catch_up"):
        DraftModel(DRAFT, CFG, catch_up=0)
