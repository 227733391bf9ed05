"""One thread decoding many Sessions on Batches (sessions/driver.py): tasks that join and leave while others
decode give what they give alone, with every speculator (a draft model on its own Batch too); a Batch is a
driver's or its threads', never both; a task that fails ends alone; and the server's pool serves its requests
as one driver's tasks."""
from __future__ import annotations

import asyncio
import math
import threading

import pytest

from rlxrt.app.reference import reference_pair
from rlxrt.app.flags import head_dir
from rlxrt.app.serve.pool import Job, Pool, Work
from rlxrt.config import Config
from rlxrt.errors import GenerationError
from rlxrt.sessions import Batch, Cascade, DraftModel, Driver, MtpHead, PromptLookup, Session

TARGET, DRAFT = (str(p) for p in reference_pair())
HEAD = str(head_dir(None, None))
CFG = Config(intra_op_threads=1, cache=False, cpu_kernels="rlxrt")
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef add(a, b):\n    return"


def test_driven_sessions_joining_and_leaving_equal_their_lone_runs():
    """Eight Sessions of every speculator (a draft model on a Batch of its own among them) as tasks of one
    driver: four start together, and each of those starts another after its first request, so requests join
    and leave while others decode; greedy and seeded sampled output equal the lone run's, and the steps held
    several sequences."""
    batch = Batch(TARGET, CFG, slots=8, chunk=16)
    drafts = Batch(DRAFT, CFG, slots=8, chunk=16, calibrate=False)
    makers = [lambda d: None, lambda d: DraftModel(d, CFG), lambda d: MtpHead(HEAD, CFG),
              lambda d: Cascade(PromptLookup(min_n=3), DraftModel(d, CFG)), lambda d: PromptLookup()]
    requests = [(CODE + " " * i, dict(max_new_tokens=20 + 8 * (i % 3), ignore_eos=True,
                                     **({"temperature": 0.8, "seed": i} if i % 2 else {}))) for i in range(8)]
    lone = {i: Session(TARGET, makers[i % 5](DRAFT), CFG, k=3).generate(p, **kw).token_ids
            for i, (p, kw) in enumerate(requests)}
    driver, got = Driver(), {}

    def task(i):
        session = Session(batch, makers[i % 5](drafts), CFG, k=3)
        for n in range(2):  # the slot serves a second request after the first
            got[i] = session.generate(requests[i][0], **requests[i][1]).token_ids
            if n == 0 and i < 4:
                driver.spawn(task, i + 4)  # joins beside the running ones

    try:
        for i in range(4):
            driver.spawn(task, i)
        driver.run()
        served = batch.driver, drafts.driver
    finally:
        driver.close()
    assert got == lone
    assert batch.calls > batch.steps > 0 and drafts.calls > drafts.steps > 0
    assert served == (driver, driver) and batch.driver is drafts.driver is None  # given back by close


def test_deferred_calls_are_made_in_order_before_the_next_step_of_rounds_never_before_a_drafts_step(monkeypatch, caplog):
    """What tasks defer (a server's text for its event loop) is called in the order deferred, each before the
    next step of the target's batch and never just before a step of the draft's, and all of it by the end; a
    deferred call that raises is logged and the others are made; one deferred by a deferred call is made too."""
    batch = Batch(TARGET, CFG, slots=2, calibrate=False)
    drafts = Batch(DRAFT, CFG, slots=2, calibrate=False)
    log, run = [], Batch._run

    def logged(self, tokens, sequences, rows):
        log.append("target" if self is batch else "draft")
        return run(self, tokens, sequences, rows)

    def fails():
        raise RuntimeError("a deferred call failed")

    monkeypatch.setattr(Batch, "_run", logged)
    driver = Driver()

    def task(i):
        session = Session(batch, DraftModel(drafts, CFG), CFG, k=3)
        for n, _ in enumerate(session.stream(CODE + " " * i, max_new_tokens=24, ignore_eos=True)):
            driver.defer(log.append, (i, n))
            if n == 2:
                driver.defer(fails)
            if n == 3:  # a deferred call that defers another: that one is made at a later flush
                driver.defer(driver.defer, log.append, ("later", i))

    try:
        for i in range(2):
            driver.spawn(task, i)
        driver.run()
    finally:
        driver.close()
    assert all(("later", i) in log for i in range(2))
    log[:] = [e for e in log if not (isinstance(e, tuple) and e[0] == "later")]
    for i in range(2):  # each task's calls, all of them, in the order deferred
        mine = [e for e in log if isinstance(e, tuple) and e[0] == i]
        assert len(mine) > 3 and mine == [(i, n) for n in range(len(mine))]
    assert "draft" in log
    after = [next((e for e in log[j:] if isinstance(e, str)), "end") for j, e in enumerate(log) if isinstance(e, tuple)]
    assert "a call the driver deferred failed" in caplog.text
    assert set(after) <= {"target", "end"} and "target" in after


def test_a_thread_cannot_hand_in_to_a_driven_batch_until_the_driver_is_closed():
    batch = Batch(TARGET, CFG, slots=2, calibrate=False)
    driver, got = Driver(), []
    try:
        driver.spawn(lambda: got.append(Session(batch, None, CFG).generate(CODE, max_new_tokens=8).token_ids))
        driver.run()
        errors = []
        thread = threading.Thread(target=lambda: _catch(errors, lambda: Session(batch, None, CFG).generate(CODE)))
        thread.start()
        thread.join(30)
        assert len(errors) == 1 and isinstance(errors[0], GenerationError) and "task of that driver" in str(errors[0])
        driver.spawn(lambda: got.append(Session(batch, None, CFG).generate(CODE, max_new_tokens=8).token_ids))
        driver.run()
    finally:
        driver.close()
    got.append(Session(batch, None, CFG).generate(CODE, max_new_tokens=8).token_ids)  # closed: threads' again
    assert got[0] == got[1] == got[2] == Session(TARGET, None, CFG).generate(CODE, max_new_tokens=8).token_ids


def _catch(errors, fn):
    try:
        fn()
    except Exception as exc:  # the test reads it
        errors.append(exc)


def test_a_task_that_fails_ends_alone(caplog):
    """A task that raises (after a request, and one whose request is refused before it runs) is logged and
    ended; the others decode on and equal their lone runs."""
    batch = Batch(TARGET, CFG, slots=4, calibrate=False)  # a Session holds its slot for its life
    driver, got = Driver(), {}

    def fine(i):
        got[i] = Session(batch, None, CFG).generate(CODE + " " * i, max_new_tokens=12, ignore_eos=True).token_ids

    def fails_after():
        Session(batch, None, CFG).generate(CODE, max_new_tokens=4)
        raise ValueError("a task's own failure")

    def refused():
        Session(batch, None, CFG).generate(CODE, max_new_tokens=0)

    try:
        driver.spawn(fine, 0)
        driver.spawn(fails_after)
        driver.spawn(refused)
        driver.spawn(fine, 1)
        driver.run()
    finally:
        driver.close()
    assert "a task's own failure" in caplog.text and "max_new_tokens" in caplog.text
    assert got == {i: Session(TARGET, None, CFG).generate(CODE + " " * i, max_new_tokens=12,
                                                          ignore_eos=True).token_ids for i in (0, 1)}


def test_a_driver_belongs_to_the_thread_that_made_it():
    driver = Driver()
    try:
        with pytest.raises(GenerationError, match="already has a Driver"):
            Driver()
        errors = []
        thread = threading.Thread(target=lambda: _catch(errors, lambda: driver.spawn(print)))
        thread.start()
        thread.join(10)
        assert len(errors) == 1 and "thread that made it" in str(errors[0])
        gate = []
        driver.spawn(lambda: gate.append(1))
        with pytest.raises(GenerationError, match="have not ended"):
            driver.close()
        driver.run()
        assert gate == [1]
    finally:
        driver.close()
    Driver().close()  # the thread may make another once it is closed


def test_a_driven_pool_serves_its_requests_as_one_threads_tasks():
    """The server's pool on a Batch (``driven``): six requests on two Sessions, four waiting in the queue,
    each ends with its lone run's tokens, on one thread; closing lets the admitted ones finish."""
    batch = Batch(TARGET, CFG, slots=2, calibrate=False)
    pool = Pool(lambda: Session(batch, PromptLookup(), CFG, k=3), workers=2, max_queue=4, driven=True)
    loop = asyncio.new_event_loop()
    prompts = [CODE + " " * i for i in range(6)]
    jobs = [Job(Work(pool.session.prompt_ids(p), {"max_new_tokens": 16, "ignore_eos": True}), loop,
                deadline=math.inf) for p in prompts]
    try:
        for job in jobs:
            pool.submit(job)
        pool.close(timeout=120)
        assert [t.name for t in pool._threads] == ["rlxrt-engine"] and not pool._threads[0].is_alive()
        loop.run_until_complete(asyncio.sleep(0))
        ends = [[e for e in _events(job) if e[0] in ("done", "error")] for job in jobs]
    finally:
        loop.close()
    lone = Session(TARGET, PromptLookup(), CFG, k=3)
    for p, end in zip(prompts, ends):
        assert len(end) == 1 and end[0][0] == "done"
        assert end[0][1].token_ids == lone.generate(p, max_new_tokens=16, ignore_eos=True).token_ids
    assert batch.calls > batch.steps


def _events(job):
    return [job.events.get_nowait() for _ in range(job.events.qsize())]


def test_a_fault_in_a_steps_bookkeeping_fails_its_requests_and_the_driver_serves_on(monkeypatch):
    """Not ONNX Runtime's failure (``Batch._step`` tells its slots of that) but one of the step's own Python:
    the requests it held fail with it, and the next request on the same Sessions equals its lone run."""
    batch = Batch(TARGET, CFG, slots=2, calibrate=False)
    sessions = [Session(batch, None, CFG) for _ in range(2)]
    real, calls, driver, errors, got = batch._account, [], Driver(), [], []

    def faulty(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("an injected fault")
        return real(*args)

    monkeypatch.setattr(batch, "_account", faulty)
    try:
        for s in sessions:
            driver.spawn(_catch, errors, lambda s=s: s.generate(CODE, max_new_tokens=8, ignore_eos=True))
        driver.run()
        assert len(errors) == 2 and all("injected fault" in str(e) for e in errors)
        driver.spawn(lambda: got.append(sessions[0].generate(CODE, max_new_tokens=8, ignore_eos=True).token_ids))
        driver.run()
    finally:
        driver.close()
    assert got == [Session(TARGET, None, CFG).generate(CODE, max_new_tokens=8, ignore_eos=True).token_ids]


def test_two_tasks_on_one_session_the_second_is_refused_and_the_first_goes_on():
    """A thread would wait for the Session; a task cannot (its wait would stop the thread that runs the other),
    so its request is refused with the fix; one task's second request cancels its first, as a thread's does."""
    batch = Batch(TARGET, CFG, slots=2, calibrate=False)
    session, driver, got, errors = Session(batch, None, CFG), Driver(), {}, []

    def first():
        got["first"] = session.generate(CODE, max_new_tokens=16, ignore_eos=True).token_ids

    def second():
        _catch(errors, lambda: session.generate(CODE, max_new_tokens=4))

    def own_two():
        held = Session(batch, None, CFG)
        stream = held.stream(CODE, max_new_tokens=16)
        next(stream)
        got["again"] = held.generate(CODE, max_new_tokens=8, ignore_eos=True).token_ids
        got["cancelled"] = [piece for piece in stream] == [] and stream.generation.finish_reason == "cancelled"

    try:
        driver.spawn(first)
        driver.spawn(second)
        driver.spawn(own_two)
        driver.run()
    finally:
        driver.close()
    assert len(errors) == 1 and "a Session of its own" in str(errors[0])
    lone = Session(TARGET, None, CFG)
    assert got["first"] == lone.generate(CODE, max_new_tokens=16, ignore_eos=True).token_ids
    assert got["again"] == lone.generate(CODE, max_new_tokens=8, ignore_eos=True).token_ids and got["cancelled"]


def test_a_stream_read_by_two_tasks_at_once_is_refused_to_the_second():
    """A stream's step paused in a batch's step holds the Session: a second task reading the same stream is
    refused (a thread would wait; a task's wait would stop the thread its step runs on), and the first reads
    on to the lone run's end."""
    batch = Batch(TARGET, CFG, slots=2, calibrate=False)
    session, driver, errors, pieces = Session(batch, None, CFG), Driver(), [], []
    stream = session.stream(CODE, max_new_tokens=12, ignore_eos=True)
    try:
        driver.spawn(lambda: pieces.extend(stream))
        driver.spawn(_catch, errors, lambda: next(stream))
        driver.run()
    finally:
        driver.close()
    assert len(errors) == 1 and "another task" in str(errors[0])
    lone = Session(TARGET, None, CFG).generate(CODE, max_new_tokens=12, ignore_eos=True)
    assert stream.generation.token_ids == lone.token_ids and "".join(pieces) == lone.text
