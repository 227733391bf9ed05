"""A real server under hostile requests: a chat template that loops for some messages and a 200 MiB body run
beside normal requests, which still answer in their usual time; the server checks before it reads
(Content-Length, Transfer-Encoding, deep JSON, a non-string ``user``); a client that goes away mid-body is
logged as such; a template that requires a system message serves; a busy port is refused before "serving"."""
from __future__ import annotations

import logging
import socket
import threading
import time
import urllib.request

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from serving import SIMPLE_TEMPLATE, Running, free_port, options, with_chat_template  # noqa: E402

from rlxrt.app.reference import reference_pair  # noqa: E402

TARGET, _ = reference_pair()
LOOP = ("{% if messages[-1]['content'] == 'loop' %}{% for a in range(100000) %}{% for b in range(100000) %}"
        "{% endfor %}{% endfor %}{% endif %}" + SIMPLE_TEMPLATE)
"""A template that loops (about 10^10 iterations) for the message 'loop', and renders the others."""
SYSTEM_FIRST = ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message must come first') }}"
                "{% endif %}" + SIMPLE_TEMPLATE)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = Running(options(with_chat_template(TARGET, tmp_path_factory.mktemp("loop") / "t", LOOP), workers=2))
    yield running
    running.stop()


def _raw(port: int, data: bytes, read: bool = True) -> bytes:
    """Send ``data`` on a fresh connection; the first bytes of the answer (b"" when the server closed first)."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(data)
        if not read:
            return b""
        try:
            return s.recv(4096)
        except ConnectionResetError:
            return b""


def _normal(client) -> float:
    t0 = time.monotonic()
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "def add(a, b):"}],
                                       max_tokens=24, temperature=0)
    assert r.choices[0].message.content
    return time.monotonic() - t0


def _rss_mib() -> float:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS")) / 1024


def test_a_looping_template_and_a_huge_body_do_not_slow_a_normal_request(server):
    client = server.client()
    _normal(client)  # warm
    alone = sorted(_normal(client) for _ in range(3))[1]
    rss = _rss_mib()
    results: dict = {}

    def hostile_chat():
        t0 = time.monotonic()
        try:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "loop"}], max_tokens=4)
        except openai.BadRequestError as exc:
            results["loop"] = (exc.status_code, str(exc), time.monotonic() - t0)

    def huge_body():
        import httpx

        def chunks():
            block = b"x" * (1 << 20)
            for _ in range(200):
                yield block

        t0 = time.monotonic()
        try:
            r = httpx.post(f"{server.url}/v1/completions", content=chunks(), timeout=60)
            results["body"] = (r.status_code, r.text, time.monotonic() - t0)
        except httpx.HTTPError as exc:  # the server answered 413 and closed while the client was still sending
            results["body"] = ("closed", repr(exc), time.monotonic() - t0)

    attackers = [threading.Thread(target=hostile_chat), threading.Thread(target=huge_body)]
    for t in attackers:
        t.start()
    time.sleep(0.3)  # both are under way
    busy = [_normal(client) for _ in range(3)]
    t0 = time.monotonic()
    health = urllib.request.urlopen(f"{server.url}/health", timeout=5).status
    health_seconds = time.monotonic() - t0
    for t in attackers:
        t.join(60)
    assert health == 200 and health_seconds < 0.5, health_seconds
    assert sorted(busy)[1] < 3 * alone + 0.5, (alone, busy)
    status, message, seconds = results["loop"]
    assert status == 400 and "time budget" in message and seconds < 15, results["loop"]
    status, message, seconds = results["body"]
    assert status in (413, "closed") and seconds < 30, results["body"]
    assert _rss_mib() - rss < 100, "the body was read whole"
    assert _normal(client) < 3 * alone + 0.5  # and after


def test_the_server_checks_before_it_reads(server):
    port = server.port
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    answer = _raw(port, (head + f"Content-Length: {200 << 20}\r\n\r\n").encode() + b"{")
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    both = (head + "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n").encode()
    answer = _raw(port, both)
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    deep = b'{"prompt": "x", "max_tokens": 2, "logit_bias": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for body, words in ((deep, "nests deeper"), (b'{"prompt": "x", "user": {"id": 1}}', "user"),
                        (b'{"prompt": "x", "logit_bias": ' + b"[" * 40 + b"]" * 40 + b"}", "nests deeper than 32")):
        req = urllib.request.Request(f"{server.url}/v1/completions", data=body, method="POST",
                                     headers={"content-type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=20)
        text = err.value.read().decode()
        assert err.value.code == 400 and words in text, text
    ok = server.client().completions.create(model="m", prompt="x", max_tokens=2, user="alice")
    assert ok.usage.completion_tokens == 2


def test_a_client_that_leaves_mid_body_is_logged_as_such(server, caplog):
    caplog.set_level(logging.INFO, logger="rlxrt.serve")
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    _raw(server.port, head.encode() + b'{"prompt": "x"', read=False)
    deadline = time.monotonic() + 10
    while "disconnected while sending" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "disconnected while sending its request body" in caplog.text
    assert "internal error" not in caplog.text


def test_a_template_that_requires_a_system_message_serves(tmp_path):
    running = Running(options(with_chat_template(TARGET, tmp_path / "t", SYSTEM_FIRST)))
    try:
        c = running.client()
        r = c.chat.completions.create(model="m", messages=[{"role": "system", "content": "be brief"},
                                                           {"role": "user", "content": "hi"}], max_tokens=3)
        assert r.usage.completion_tokens >= 1
        with pytest.raises(openai.BadRequestError, match="a system message must come first"):
            c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    finally:
        running.stop()


def test_a_busy_port_is_an_error_before_serving(capsys):
    from rlxrt.app.cli import main

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        assert main(["serve", "--port", str(port), "--workers", "1", "--threads", "1"]) == 1
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "--port" in err and "serving" not in err
    assert free_port() > 0
