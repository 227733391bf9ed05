"""A job's events as the event loop receives them (pure: a loop that runs only when told, no server)."""
import asyncio
import math

from rlxrt.app.serve.pool import Job, Work


def _drain(loop, job):
    loop.run_until_complete(asyncio.sleep(0))  # runs the callbacks handed over so far
    return [job.events.get_nowait() for _ in range(job.events.qsize())]


def test_pieces_before_the_loop_takes_them_go_as_one_event_in_order():
    loop = asyncio.new_event_loop()
    try:
        job = Job(Work([1], {}), loop, deadline=math.inf)
        job.emit("start")
        for piece in ("de", "f ", "add"):  # a round's accepted tokens, handed over at once
            job.text(piece)
        assert _drain(loop, job) == [("start", None), ("text", "def add")]
        job.text("(")
        assert _drain(loop, job) == [("text", "(")]  # the loop kept up: a piece alone
        job.text("a")
        job.text(", b")
        job.emit("done", "generation")  # after the text it ends, as queued
        assert _drain(loop, job) == [("text", "a, b"), ("done", "generation")]
    finally:
        loop.close()


def test_a_request_answered_whole_gets_no_text_events():
    loop = asyncio.new_event_loop()
    try:
        job = Job(Work([1], {}), loop, deadline=math.inf, streaming=False)
        job.emit("start")
        job.text("def")
        job.emit("done", "generation")
        assert _drain(loop, job) == [("start", None), ("done", "generation")]
    finally:
        loop.close()


def test_a_closed_loop_cancels_the_job():
    loop = asyncio.new_event_loop()
    loop.close()
    job = Job(Work([1], {}), loop, deadline=math.inf)
    job.text("x")
    assert job.cancel.is_set()
