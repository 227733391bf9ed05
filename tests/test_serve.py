"""`rlxrt serve` through the official openai client: a real uvicorn server on 127.0.0.1, the shipped pair's
real ONNX graphs. Every answer is compared with the same request run directly on a Session."""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from serving import Running, options, with_chat_template  # noqa: E402

from rlxrt.app.reference import reference_pair, reference_prompts  # noqa: E402
from rlxrt.config import Config  # noqa: E402
from rlxrt.sessions import DraftModel, Session  # noqa: E402

TARGET, DRAFT = reference_pair()
PROMPTS = reference_prompts()
CPU = Config(providers=("cpu",), intra_op_threads=1, cache=False)


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    return with_chat_template(TARGET, tmp_path_factory.mktemp("chat") / "target")


@pytest.fixture(scope="module")
def spec(chat_target):
    """A speculative server (the shipped draft, k=4, 2 workers of the pool engine, whose Sessions decode as a
    lone Session does: the stats compare too) on a target with a chat template."""
    server = Running(options(chat_target, "draft", DRAFT, engine="pool"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def direct(chat_target):
    return Session(chat_target, DraftModel(DRAFT, CPU), CPU)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def test_completion_equals_session(spec, direct):
    c = spec.client()
    r = c.completions.create(model="m", prompt=PROMPTS[0], max_tokens=40, temperature=0)
    g = direct.generate(PROMPTS[0], max_new_tokens=40)
    assert r.choices[0].text == g.text and r.choices[0].finish_reason == ("length" if g.finish_reason == "length"
                                                                           else "stop")
    u = r.usage
    assert (u.prompt_tokens, u.completion_tokens) == (len(g.prompt_token_ids), len(g.token_ids))
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    s = u.model_extra["speculative"]
    assert s["speculator"] == "draft-model" and s["draft_tokens"] == g.stats.drafted
    assert s["accepted_tokens"] == g.stats.accepted and s["accepted_per_position"] == g.stats.accepted_per_position
    assert 0 < s["acceptance_rate"] <= 1 and s["drafts"] == g.stats.drafted_per_position[0]
    models = c.models.list()
    assert [m.id for m in models.data] == ["m"]


def test_min_draft_prob_serves_plain_greedy_with_shorter_chains():
    """`serve --head H -k 4 --min-draft-prob 0.5`: the replies equal plain greedy decoding, and some rounds
    drafted fewer than k tokens (the shipped head: about 1.4 tokens a round at P=0.5, 3.6 at P=0, when the length
    clips the last rounds)."""
    from rlxrt.app.flags import head_dir

    server = Running(options(TARGET, "mtp", head_dir(None, None), k=4, min_prob=0.5))
    try:
        c, plain = server.client(), Session(TARGET, None, CPU)
        drafted = rounds = 0
        for p in PROMPTS[:3]:
            r = c.completions.create(model="m", prompt=p, max_tokens=40, temperature=0)
            assert r.choices[0].text == plain.generate(p, max_new_tokens=40).text
            s = r.usage.model_extra["speculative"]
            drafted, rounds = drafted + s["draft_tokens"], rounds + s["drafts"]
        assert rounds <= drafted < 2 * rounds
    finally:
        server.stop()


def test_adaptive_k_serves_plain_greedy():
    """`serve --draft D --adaptive-k`: every worker's Session picks its own k, and the replies, in parallel,
    equal plain greedy decoding."""
    server = Running(options(TARGET, "draft", DRAFT, k=2, adaptive_k=True))
    try:
        assert all(s.adaptive_k and s._k_choice is not None for s in server.server.pool.sessions)
        c, plain = server.client(), Session(TARGET, None, CPU)
        replies: dict = {}
        threads = [threading.Thread(target=lambda p=p: replies.__setitem__(
            p, c.completions.create(model="m", prompt=p, max_tokens=60, temperature=0).choices[0].text))
            for p in PROMPTS[:4]]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert replies == {p: plain.generate(p, max_new_tokens=60).text for p in PROMPTS[:4]}
    finally:
        server.stop()


def test_seeded_sampled_requests_with_adaptive_k_are_the_same_alone_and_concurrent():
    """The seed contract under adaptive k: 32 seeded sampled requests sent at once, beside unseeded ones that
    move every worker's k, equal the same requests sent one at a time, and a fresh Session's answers."""
    server = Running(options(TARGET, "draft", DRAFT, k=2, adaptive_k=True))
    try:
        c = server.client()
        requests = [(PROMPTS[i % len(PROMPTS)], 1000 + i, 0.3 + 0.1 * (i % 8)) for i in range(32)]

        def ask(prompt, seed, t):
            return c.completions.create(model="m", prompt=prompt, max_tokens=40, temperature=t, seed=seed,
                                        extra_body={"ignore_eos": True}).choices[0].text

        alone = [ask(*r) for r in requests]
        out: list = [None] * 32
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, ask(*requests[i]))) for i in range(32)]
        threads += [threading.Thread(target=lambda p=p: c.completions.create(  # unseeded: k adapts meanwhile
            model="m", prompt=p, max_tokens=60, temperature=0.8)) for p in PROMPTS[:8]]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert out == alone
        assert len(set(alone)) > 16  # the seeds matter
        fresh = Session(TARGET, DraftModel(DRAFT, CPU), CPU, k=2, adaptive_k=True)
        assert [fresh.generate(p, max_new_tokens=40, temperature=t, seed=s, ignore_eos=True).text
                for p, s, t in requests[:8]] == alone[:8]
    finally:
        server.stop()


def test_chat_and_streaming(spec, direct):
    c = spec.client()
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    r = c.chat.completions.create(model="m", messages=messages, max_tokens=30, temperature=0)
    g = direct.chat(messages, max_new_tokens=30)
    assert r.choices[0].message.content == g.text and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == len(g.token_ids)
    chunks = list(c.chat.completions.create(model="m", messages=messages, max_tokens=30, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == g.text
    # a round's accepted tokens go as one chunk: fewer text chunks than tokens where drafts were accepted
    pieces = sum(bool(ch.choices and ch.choices[0].delta.content) for ch in chunks)
    assert g.stats.accepted > 0 and pieces < len(g.token_ids)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == len(g.token_ids)
    pieces = [ch.choices[0].text for ch in c.completions.create(model="m", prompt=PROMPTS[1], max_tokens=50,
                                                                temperature=0, stream=True)]
    whole = c.completions.create(model="m", prompt=PROMPTS[1], max_tokens=50, temperature=0).choices[0].text
    assert "".join(pieces) == whole and len(pieces) > 3


def test_stop_strings_and_seeds(spec, direct):
    c = spec.client()
    full = direct.generate(PROMPTS[0], max_new_tokens=60).text
    stop = full.strip()[3:6]
    assert stop
    r = c.completions.create(model="m", prompt=PROMPTS[0], max_tokens=60, temperature=0, stop=[stop, "@@@"])
    want = direct.generate(PROMPTS[0], max_new_tokens=60, stop=[stop, "@@@"])
    assert r.choices[0].text == want.text and stop not in r.choices[0].text and r.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="m", prompt=PROMPTS[0], max_tokens=60, temperature=0, stop=stop, stream=True))
    assert streamed == want.text
    draws = [c.completions.create(model="m", prompt=PROMPTS[2], max_tokens=30, temperature=0.9, seed=s).choices[0].text
             for s in (7, 7, 8, 9)]
    assert draws[0] == draws[1] == direct.generate(PROMPTS[2], max_new_tokens=30, temperature=0.9, seed=7).text
    assert len(set(draws)) > 1  # other seeds give other samples (3 equal 30-token samples would be a bug)
    top_k = c.completions.create(model="m", prompt=PROMPTS[2], max_tokens=20, temperature=0.9, seed=3,
                                 extra_body={"top_k": 5}).choices[0].text
    assert top_k == direct.generate(PROMPTS[2], max_new_tokens=20, temperature=0.9, seed=3, top_k=5).text


BAD = [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": "ten"}, "max_tokens"), ({"temperature": -1}, "temperature"),
    ({"temperature": 3}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"n": 2}, "n"), ({"seed": "x"}, "seed"), ({"seed": -1}, "seed"), ({"top_k": 1.5}, "top_k"),
    ({"stop": [""]}, "stop"), ({"stop": ["a"] * 17}, "stop"),
    ({"stop": 5}, "stop"), ({"stream": "yes"}, "stream"), ({"logprobs": 3}, "logprobs"),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"frequency_penalty": 1}, "frequency_penalty"),
    ({"logit_bias": {"5": 10}}, "logit_bias"), ({"echo": True}, "echo"), ({"best_of": 2}, "best_of"),
    ({"top_k": -1}, "top_k"), ({"wibble": 1}, "wibble"), ({"prompt": ""}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [5, 99999]}, "prompt"), ({"prompt": "x " * 3000}, "prompt"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "no"}}, "stream_options"),
]


@pytest.mark.parametrize("fields,param", BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_fields_are_400s(spec, fields, param):
    c = spec.client()
    body = {"prompt": "def f(", "max_tokens": 4, **fields}
    prompt = body.pop("prompt")
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model="m", prompt=prompt, extra_body=body)
    e = err.value
    assert e.status_code == 400 and e.body["param"] == param and param in e.body["message"]
    assert "Traceback" not in e.message


def test_chat_errors_and_health(spec):
    c = spec.client()
    for messages, param in [([], "messages"), ([{"role": "user"}], "messages[0].content"),
                            ([{"content": "x"}], "messages[0]")]:
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(model="m", messages=messages)
        assert err.value.body["param"] == param
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="gm-4", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi", "tool_calls": []}])
    assert err.value.body["param"] == "messages[0]" and "tool_calls" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                  max_completion_tokens=6)
    assert err.value.body["param"] == "max_completion_tokens"
    named = [{"role": "user", "content": "def add(a, b):", "name": "ann"}]
    assert c.chat.completions.create(model="m", messages=named, max_tokens=4, temperature=0).choices[0].message
    with pytest.raises(openai.APIStatusError) as err:
        c.completions.create(model="m", prompt="x" * (9 << 20), max_tokens=2)
    assert err.value.status_code == 413
    plain = Running(options(TARGET))  # the shipped target has no chat template
    try:
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            plain.client().chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        req = urllib.request.Request(f"{plain.url}/v1/completions", data=b"{not json", method="POST",
                                     headers={"content-type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        assert err.value.code == 400 and b"not JSON" in err.value.read()
        # lone surrogates are valid JSON escapes but not text (the openai client cannot even send them)
        for body, param in ((b'{"prompt": "def f(\\ud800", "max_tokens": 2}', "prompt"),
                            (b'{"prompt": "x", "stop": ["\\udfff"]}', "stop"),
                            (b'{"prompt": "x", "\\udfff": 1}', "body")):
            req = urllib.request.Request(f"{plain.url}/v1/completions", data=body, method="POST",
                                         headers={"content-type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(req, timeout=10)
            answer = json.loads(err.value.read())
            assert err.value.code == 400 and answer["error"]["param"] == param, answer
    finally:
        plain.stop()
    assert '"status":"ok"' in _get(f"{spec.url}/health")


def _long_stream(client, tokens=900):
    return client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=tokens, temperature=0, stream=True,
                                     extra_body={"ignore_eos": True})


def _hold_next_request(pool) -> threading.Event:
    """Make the next request ``pool`` runs wait after its first piece of text until the returned event is set
    (its job is then ``event.jobs[0]``): a test that needs it running while it checks the queue, or while its
    client gives up, does not then race the shipped target's decoding, which on a fast machine finishes 1,000
    tokens in half a second."""
    hold, run, taken = threading.Event(), pool._run, []
    hold.jobs = taken

    def held(session, job):
        if not taken:
            taken.append(job)
            text = job.text

            def slow(piece):
                text(piece)
                hold.wait(30)

            job.text = slow
        return run(session, job)

    pool._run = held
    return hold


def _wait(predicate, seconds=20.0):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def test_queue_full_is_429_and_disconnect_frees_the_worker():
    server = Running(options(TARGET, workers=1, max_queue=1))
    hold = None
    try:
        c = server.client()
        busy = _long_stream(c)
        next(iter(busy))  # the worker runs it
        queued = threading.Thread(target=lambda: c.completions.create(model="m", prompt="x", max_tokens=2))
        queued.start()
        _wait(lambda: server.server.pool.waiting == 1)
        with pytest.raises(openai.RateLimitError) as err:
            c.completions.create(model="m", prompt="x", max_tokens=2)
        assert err.value.response.headers["retry-after"] == "1"
        busy.close()  # the client goes away mid-stream
        queued.join(30)
        assert not queued.is_alive()  # the worker was freed for the queued request
        _wait(lambda: server.server.pool.running == 0 and server.server.pool.waiting == 0)
        metrics = _get(f"{server.url}/metrics")
        assert 'rlxrt:request_success_total{finished_reason="cancelled",model_name="m"} 1.0' in metrics
        assert 'rlxrt:request_rejected_total{model_name="m"} 1.0' in metrics
        assert c.completions.create(model="m", prompt="x", max_tokens=2).choices[0].text is not None
        # a non-streaming client that gives up (its own timeout) is cancelled too
        hold = _hold_next_request(server.server.pool)  # it runs on until its client has gone
        with pytest.raises(openai.APITimeoutError):
            server.client(timeout=0.4).completions.create(model="m", prompt=PROMPTS[0], max_tokens=1000,
                                                          temperature=0, extra_body={"ignore_eos": True})
        _wait(lambda: hold.jobs and hold.jobs[0].cancel.is_set())
        hold.set()
        _wait(lambda: server.server.pool.running == 0)
        assert 'finished_reason="cancelled",model_name="m"} 2.0' in _get(f"{server.url}/metrics")
    finally:
        if hold is not None:
            hold.set()
        server.stop()


@pytest.mark.parametrize("engine", ["pool", "batch"])
def test_a_queued_request_whose_client_left_gives_its_place_back_at_once(engine):
    """A client that gives up while its request waits for a worker frees the request's place in the queue
    then, not when a worker reaches the dead request: else dead requests behind a long one turn live ones
    away (429) though nothing waits."""
    config = Config(providers=("cpu",), intra_op_threads=1, cache=False,
                    **({"cpu_kernels": "rlxrt"} if engine == "batch" else {}))
    server = Running(options(TARGET, workers=1, max_queue=1, engine=engine, config=config))
    pool = server.server.pool
    hold = _hold_next_request(pool)
    try:
        c = server.client()
        busy = _long_stream(c, 1500)
        next(iter(busy))  # the worker runs it, and holds it after its first text until ``hold`` is set
        with pytest.raises(openai.APITimeoutError):  # queued behind it, then its client gives up
            server.client(timeout=0.5).completions.create(model="m", prompt="x", max_tokens=2)
        _wait(lambda: pool.waiting == 0)
        assert pool.running == 1  # the long request still runs
        out: list = []
        queued = threading.Thread(target=lambda: out.append(
            c.completions.create(model="m", prompt=PROMPTS[1], max_tokens=6, temperature=0).choices[0].text))
        queued.start()  # admitted: the dead request holds no place
        _wait(lambda: pool.waiting == 1)
        hold.set()
        busy.close()
        queued.join(60)
        direct = Session(TARGET, None, CPU).generate(PROMPTS[1], max_new_tokens=6)
        assert out == [direct.text]
        _wait(lambda: pool.running == 0 and pool.waiting == 0)  # the dead request was skipped, counted once
        assert c.completions.create(model="m", prompt="x", max_tokens=2).usage.completion_tokens == 2
    finally:
        hold.set()
        server.stop()


def test_a_full_server_turns_a_request_away_before_parsing_it_and_parses_off_the_event_loop():
    """Where the queue is full a request is answered 429 before its body is parsed or its prompt tokenised (a
    flood of large bodies costs a full server little; the body is still read, so the client hears the 429), and
    an admitted request's body is parsed on a preparing thread, not on the event loop that streams every other
    answer."""
    server = Running(options(TARGET, workers=1, max_queue=0))
    s = server.server
    parsed: list[str] = []
    prepare = s.prepare

    def counted(raw, chat, deadline):
        parsed.append(threading.current_thread().name)
        return prepare(raw, chat, deadline)

    s.prepare = counted
    hold = _hold_next_request(s.pool)
    try:
        c = server.client()
        busy = _long_stream(c, 1500)
        next(iter(busy))  # the one worker runs it, held until the refusal is seen; the queue holds none
        assert parsed and parsed[0].startswith("rlxrt-tokenise")
        big = {"model": "m", "prompt": "word " * 1_000_000, "max_tokens": 2}  # ~5 MB
        req = urllib.request.Request(f"{server.url}/v1/completions", json.dumps(big).encode(),
                                     {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == 429 and err.value.headers["Retry-After"] == "1"
        assert len(parsed) == 1  # refused before its body was parsed or tokenised
        hold.set()
        busy.close()
        _wait(lambda: s.pool.running == 0)
        assert c.completions.create(model="m", prompt="x", max_tokens=2).usage.completion_tokens == 2
        assert 'rlxrt:request_rejected_total{model_name="m"} 1.0' in _get(f"{server.url}/metrics")
    finally:
        hold.set()
        server.stop()


def test_request_timeout_is_504():
    server = Running(options(TARGET, workers=1, request_timeout=0.3))
    try:
        c = server.client()
        with pytest.raises(openai.APIStatusError) as err:
            c.completions.create(model="m", prompt=PROMPTS[0], max_tokens=1000, temperature=0,
                                 extra_body={"ignore_eos": True})
        assert err.value.status_code == 504
        with pytest.raises(openai.APIError, match="request-timeout"):
            list(_long_stream(c, 1000))
        assert c.completions.create(model="m", prompt="x", max_tokens=2).usage.completion_tokens == 2
    finally:
        server.stop()


def test_32_concurrent_greedy_requests_equal_sequential(spec):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(32)]
    lengths = [10 + 3 * (i % 7) for i in range(32)]
    c = spec.client()
    sequential = [c.completions.create(model="m", prompt=p, max_tokens=n, temperature=0).choices[0].text
                  for p, n in zip(prompts, lengths)]
    out: list = [None] * 32

    def one(i):
        cc = spec.client()
        if i % 2:
            out[i] = "".join(ch.choices[0].text for ch in cc.completions.create(
                model="m", prompt=prompts[i], max_tokens=lengths[i], temperature=0, stream=True))
        else:
            out[i] = cc.completions.create(model="m", prompt=prompts[i], max_tokens=lengths[i],
                                           temperature=0).choices[0].text

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert out == sequential


def test_metrics_match_responses(chat_target):
    from prometheus_client.parser import text_string_to_metric_families

    server = Running(options(chat_target, "draft", DRAFT))
    try:
        c = server.client()
        usages = [c.completions.create(model="m", prompt=p, max_tokens=24, temperature=t, seed=1).usage
                  for p in PROMPTS[:3] for t in (0, 0.8)]
        usages.append(list(c.completions.create(model="m", prompt=PROMPTS[3], max_tokens=24, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))[-1].usage)
        families = {f.name: f for f in text_string_to_metric_families(_get(f"{server.url}/metrics"))}

        def total(name, **labels):
            return sum(s.value for s in families[name].samples
                       if s.name.endswith("_total") and all(s.labels.get(k) == v for k, v in labels.items()))

        spec_u = [u.model_extra["speculative"] for u in usages]
        assert total("rlxrt:spec_decode_num_drafts") == sum(s["drafts"] for s in spec_u)
        assert total("rlxrt:spec_decode_num_draft_tokens") == sum(s["draft_tokens"] for s in spec_u)
        assert total("rlxrt:spec_decode_num_accepted_tokens") == sum(s["accepted_tokens"] for s in spec_u) > 0
        for pos in range(4):
            assert total("rlxrt:spec_decode_num_accepted_tokens_per_pos", position=str(pos)) == \
                sum(s["accepted_per_position"][pos] for s in spec_u if len(s["accepted_per_position"]) > pos)
        assert total("rlxrt:generation_tokens") == sum(u.completion_tokens for u in usages)
        assert total("rlxrt:prompt_tokens") == sum(u.prompt_tokens for u in usages)
        assert total("rlxrt:request_success") == len(usages)
        latency = families["rlxrt:e2e_request_latency_seconds"]
        assert [s.value for s in latency.samples if s.name.endswith("_count")] == [len(usages)]
        ttft = families["rlxrt:time_to_first_token_seconds"]
        assert [s.value for s in ttft.samples if s.name.endswith("_count")] == [len(usages)]
    finally:
        server.stop()
