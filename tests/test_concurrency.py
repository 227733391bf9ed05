"""The threading contract on the shipped pair (real graphs, real ORT sessions): one Session serves one
request at a time; threads are serialised, a newer request of the same thread cancels its open stream,
an older request never overwrites ``session.last``; Sessions sharing one compiled graph run in parallel."""
import threading

import pytest

from rlxrt import Config, GenerationError, compile
from rlxrt.app.reference import reference_pair, reference_prompts
from rlxrt.sessions import DraftModel, PromptLookup, Session

CFG = Config(intra_op_threads=1, cache=False)
N = 24


@pytest.fixture(scope="module")
def graphs():
    target, draft = reference_pair()
    return compile(target, CFG), compile(draft, CFG)


@pytest.fixture(scope="module")
def prompts():
    return [p[-300:] for p in reference_prompts()[:4]]


@pytest.fixture(scope="module")
def reference(graphs, prompts):
    """What each prompt gives alone, greedy and sampled (seeded)."""
    s = Session(graphs[0], None, CFG)
    return {(i, t): s.generate(p, max_new_tokens=N, temperature=t, seed=i, ignore_eos=True).token_ids
            for i, p in enumerate(prompts) for t in (0.0, 0.8)}


def make(graphs, kind):
    spec = {"plain": None, "lookup": PromptLookup(), "draft": DraftModel(graphs[1], CFG)}[kind]
    return Session(graphs[0], spec, CFG, k=3)


def run_threads(work, n):
    errors = []

    def guarded(i):
        try:
            work(i)
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors


@pytest.mark.parametrize("kind", ["plain", "lookup", "draft"])
def test_threads_on_one_session_are_serialised(graphs, prompts, reference, kind):
    alone = make(graphs, kind)  # sampled runs draw differently per speculator: the reference is per kind
    want = {(p, t): alone.generate(prompts[p], max_new_tokens=N, temperature=t, seed=p, ignore_eos=True).token_ids
            for p in range(len(prompts)) for t in (0.0, 0.8)}
    assert all(want[(p, 0.0)] == reference[(p, 0.0)] for p in range(len(prompts)))
    session = make(graphs, kind)
    wrong = []

    def work(i):
        for r in range(3):
            p, t = (i + r) % len(prompts), (0.0, 0.8)[(i + r) % 2]
            g = session.generate(prompts[p], max_new_tokens=N, temperature=t, seed=p, ignore_eos=True)
            if g.token_ids != want[(p, t)] or g.finish_reason != "length":
                wrong.append((i, r, p, t))

    run_threads(work, 4)
    assert not wrong
    assert session.stats.emitted == 4 * 3 * N


def test_threads_on_one_session_with_streams(graphs, prompts, reference):
    """A stream held open across yields by one thread makes the other threads wait, never mix."""
    session = make(graphs, "draft")
    wrong = []

    def work(i):
        p = i % len(prompts)
        with session.stream(prompts[p], max_new_tokens=N, ignore_eos=True) as s:
            text = "".join(s)
        g = s.generation
        if g.token_ids != reference[(p, 0.0)] or g.text != text or g.finish_reason != "length":
            wrong.append(i)

    run_threads(work, 4)
    assert not wrong


def test_sessions_sharing_one_compiled_graph_run_in_parallel(graphs, prompts, reference):
    wrong = []

    def work(i):
        s = make(graphs, ("plain", "lookup", "draft")[i % 3])
        for r in range(2):
            p = (i + r) % len(prompts)
            if s.generate(prompts[p], max_new_tokens=N, ignore_eos=True).token_ids != reference[(p, 0.0)]:
                wrong.append((i, r))

    run_threads(work, 4)
    assert not wrong


@pytest.mark.parametrize("kind", ["plain", "lookup", "draft"])
def test_a_new_request_cancels_the_open_stream_of_the_same_thread(graphs, prompts, reference, kind):
    session = make(graphs, kind)
    first = session.stream(prompts[0], max_new_tokens=N, ignore_eos=True)
    got = next(first)
    second = session.generate(prompts[1], max_new_tokens=N, ignore_eos=True)
    assert second.token_ids == reference[(1, 0.0)]
    rest = list(first)  # resumed: it ends at once, without touching the caches
    assert rest == []
    g = first.generation
    assert g.finish_reason == "cancelled"
    assert reference[(0, 0.0)][:len(g.token_ids)] == g.token_ids and g.text.startswith(got)
    assert session.last is second  # the older stream ended later, but does not replace the newer result
    assert session.generate(prompts[0], max_new_tokens=N, ignore_eos=True).token_ids == reference[(0, 0.0)]


def test_two_interleaved_streams(graphs, prompts, reference):
    session = make(graphs, "lookup")
    a = session.stream(prompts[0], max_new_tokens=N, ignore_eos=True)
    b = session.stream(prompts[1], max_new_tokens=N, ignore_eos=True)  # nothing runs until next()
    next(a)
    next(b)  # b takes the session: a is cancelled
    assert next(a, None) is None and a.generation.finish_reason == "cancelled"
    list(b)
    assert b.generation.token_ids == reference[(1, 0.0)]
    assert session.last is b.generation


def test_closing_a_stream_frees_the_session(graphs, prompts, reference):
    session = make(graphs, "draft")
    s = session.stream(prompts[2], max_new_tokens=N, ignore_eos=True)
    next(s)
    s.close()
    assert s.generation.finish_reason == "cancelled" and session.last is s.generation
    done = []
    t = threading.Thread(target=lambda: done.append(session.generate(prompts[3], max_new_tokens=N,
                                                                     ignore_eos=True)))
    t.start()
    t.join(60)
    assert done and done[0].token_ids == reference[(3, 0.0)]


def test_an_abandoned_stream_never_overwrites_a_later_result(graphs, prompts, reference):
    session = make(graphs, "plain")
    old = session.stream(prompts[0], max_new_tokens=N, ignore_eos=True)
    next(old)
    new = session.generate(prompts[1], max_new_tokens=N, ignore_eos=True)
    del old  # garbage-collected: closed, finishing as cancelled
    assert session.last is new


def test_a_speculator_serves_one_session(graphs):
    spec = DraftModel(graphs[1], CFG)
    first = Session(graphs[0], spec, CFG)
    with pytest.raises(GenerationError, match="one speculator per Session"):
        Session(graphs[0], spec, CFG)
    lookup = PromptLookup()
    owner = Session(graphs[0], lookup, CFG)
    with pytest.raises(GenerationError, match="already serves another Session"):
        Session(graphs[0], lookup, CFG)
    assert first.generate([1, 2, 3], max_new_tokens=4).finish_reason in ("length", "stop")
    del owner  # once its Session is gone, a speculator may serve a new one
    assert Session(graphs[0], lookup, CFG).speculator is lookup


def test_a_stream_resumed_on_another_thread_is_never_mixed_with_a_new_request(graphs, prompts, reference):
    """The stream was started here and is consumed by a worker; a new request from here cancels it, but only
    once the worker's step in flight has ended: the new output is exact, the old one a correct prefix."""
    for trial in range(5):
        session = make(graphs, "draft")
        s = session.stream(prompts[0], max_new_tokens=N, ignore_eos=True)
        next(s)
        worker = threading.Thread(target=lambda: list(s))
        worker.start()
        g = session.generate(prompts[1], max_new_tokens=N, ignore_eos=True)
        worker.join(60)
        assert g.token_ids == reference[(1, 0.0)], trial
        old = s.generation
        assert old.finish_reason in ("cancelled", "length")
        assert old.token_ids == reference[(0, 0.0)][:len(old.token_ids)], trial


def test_closing_an_unstarted_stream(graphs, prompts, reference):
    session = make(graphs, "plain")
    s = session.stream(prompts[0], max_new_tokens=N)
    s.close()
    assert s.generation.finish_reason == "cancelled" and s.generation.token_ids == []
    assert list(s) == []
    assert session.generate(prompts[0], max_new_tokens=N, ignore_eos=True).token_ids == reference[(0, 0.0)]


def test_closing_after_a_stop_string_keeps_the_finish(graphs, prompts):
    session = make(graphs, "lookup")
    text = session.generate(prompts[0], max_new_tokens=N, ignore_eos=True).text
    stop = text[3:6]
    with session.stream(prompts[0], max_new_tokens=N, stop=[stop], ignore_eos=True) as s:
        got = "".join(s)
    assert s.generation.finish_reason == "stop" and s.generation.stop_reason == stop and stop not in got
