"""`rlxrt serve` as a user starts it: a subprocess, its flags, SIGTERM finishing in-flight requests, and the Ray
Serve deployment with 2 replicas answering the official openai client."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from serving import free_port  # noqa: E402

from rlxrt.app.reference import reference_pair, reference_prompts  # noqa: E402
from rlxrt.config import Config  # noqa: E402
from rlxrt.sessions import DraftModel, Session  # noqa: E402

TARGET, DRAFT = reference_pair()
PROMPT = reference_prompts()[0]


def _start(*flags: str, port: int, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rlxrt", "serve", "--port", str(port), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _wait_healthy(proc: subprocess.Popen, port: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}:\n{proc.stdout.read()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"no /health within {seconds} s:\n{proc.stdout.read()}")


def _client(port: int):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("flags,words,code", [  # 2: flags that are missing or exclude each other; 1: a value
    (["--workers", "0"], "--workers", 1), (["--port", "70000"], "--port", 1),
    (["-k", "4", "--speculator", "none"], "-k", 2),
    (["--draft", "x"], "--target", 2), (["--request-timeout", "0"], "--request-timeout", 1),
    (["--target", "t", "--draft", "d", "--head", "h"], "exclude", 2),
    (["--target", "t", "--speculator", "prompt-lookup", "--draft", "d"], "drop --draft", 2),
    (["--min-draft-prob", "1.5"], "--min-draft-prob must be in [0, 1), got 1.5", 1),
    (["--speculator", "prompt-lookup", "--min-draft-prob", "0.3"], "needs a draft model or head", 2),
    (["--target", "t", "--adaptive-k"], "--adaptive-k needs a speculator", 2),
])
def test_serve_usage_errors(flags, words, code, capsys):
    from rlxrt.app.cli import main

    assert main(["serve", *flags]) == code
    assert words in capsys.readouterr().err


@pytest.mark.slow
def test_sigterm_finishes_in_flight_requests():
    port = free_port()
    proc = _start("--workers", "1", "--threads", "1", port=port)
    try:
        _wait_healthy(proc, port, 60)
        c = _client(port)
        stream = c.completions.create(model="rlxrt-reference", prompt=PROMPT, max_tokens=400, temperature=0,
                                      stream=True, extra_body={"ignore_eos": True})
        chunks = [next(iter(stream))]
        proc.send_signal(signal.SIGTERM)
        chunks += list(stream)
        text = "".join(ch.choices[0].text for ch in chunks)
        assert chunks[-1].choices[0].finish_reason == "length"
        cpu = Config(providers=("cpu",), intra_op_threads=1, cache=False)
        want = Session(TARGET, DraftModel(DRAFT, cpu), cpu).generate(PROMPT, max_new_tokens=400, ignore_eos=True)
        assert text == want.text
        assert proc.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has shut down
        with pytest.raises(openai.APIConnectionError):
            c.completions.create(model="rlxrt-reference", prompt="x", max_tokens=2)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_ray_app_builder_for_serve_run():
    """The documented `serve run rlxrt.app.serve.ray_app:build key=value ...` builder: arguments as Ray passes
    them (strings) become the replicas' options; unknown keys are refused."""
    pytest.importorskip("ray")
    from rlxrt.app.serve.ray_app import build

    app = build({"workers": "2", "replicas": "3", "threads": "1", "k": "3", "min_draft_prob": "0.3",
                 "adaptive_k": "true"})
    d = app._bound_deployment
    assert d.num_replicas == 3
    opts = d.init_args[0]
    assert (opts.workers, opts.k, opts.speculator, opts.config.intra_op_threads) == (2, 3, "draft", 1)
    assert opts.min_prob == 0.3 and opts.adaptive_k is True
    assert opts.target.endswith("target") and opts.draft.endswith("draft")
    assert build({"target": str(TARGET)})._bound_deployment.init_args[0].speculator == "none"
    with pytest.raises(ValueError, match="wibble"):
        build({"wibble": "1"})


@pytest.mark.slow
def test_ray_serve_two_replicas():
    pytest.importorskip("ray")
    port = free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_DISABLE_DOCKER_CPU_WARNING": "1"}
    proc = _start("--ray", "--replicas", "2", "--workers", "1", "--threads", "1", port=port, env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        # Ray's proxy answers as soon as one replica is up: wait for rlxrt's line, printed once both run
        deadline = time.monotonic() + 240
        while not any("rlxrt: serving 'rlxrt-reference'" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.2)
        assert any("(2 replica(s) running x 1 worker(s))" in line for line in lines), "".join(lines)[-3000:]
        _wait_healthy(proc, port, 30)
        c = _client(port)
        cpu = Config(providers=("cpu",), intra_op_threads=1, cache=False)
        want = Session(TARGET, DraftModel(DRAFT, cpu), cpu).generate(PROMPT, max_new_tokens=32)
        results = [None] * 6

        def one(i):
            results[i] = _client(port).completions.create(model="rlxrt-reference", prompt=PROMPT, max_tokens=32,
                                                          temperature=0)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [r.choices[0].text for r in results] == [want.text] * 6
        assert results[0].usage.model_extra["speculative"]["speculator"] == "draft-model"
        streamed = "".join(ch.choices[0].text for ch in c.completions.create(
            model="rlxrt-reference", prompt=PROMPT, max_tokens=32, temperature=0, stream=True))
        assert streamed == want.text
        with pytest.raises(openai.BadRequestError):
            c.completions.create(model="rlxrt-reference", prompt=PROMPT, n=2)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.slow
def test_bench_serve_and_soak_commands(tmp_path):
    """The load benchmark and the soak run end to end at a tiny size (their figures are not asserted)."""
    import json

    out = tmp_path / "b"
    run = subprocess.run([sys.executable, "-m", "rlxrt", "bench-serve", "--concurrency", "1,2", "--requests", "2",
                          "--max-tokens", "8", "--repeats", "1", "--adaptive-k", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    report = json.loads((out / "bench-serve.json").read_text())
    servers = {f"{e} {s}" for e in ("pool", "batch") for s in ("plain", "draft k=2", "draft k=2 adaptive")}
    assert set(report["rows"]) == servers and report["config"]["baseline"] == "pool plain"
    assert set(report["rows"]["pool plain"]) == {"1", "2"} and report["config"]["adaptive_k"] is True
    for label in servers:
        assert report["rows"][label]["2"]["tokens_per_second"] > 0
    assert report["rows"]["batch plain"]["2"]["vs_plain"] == 1.0 and (out / "bench-serve.png").stat().st_size
    assert set(report["batches"]) == {label for label in servers if label.startswith("batch")}  # pools have none
    assert report["batches"]["batch draft k=2"]["steps"] > 0
    assert len(report["rows"]["batch draft k=2"]["2"]["vs_plain_runs"]) == 1  # one repeat: one paired ratio
    assert "| batch draft k=2 | 2 |" in run.stdout and "| pool draft k=2 adaptive | 2 |" in run.stdout
    run = subprocess.run([sys.executable, "-m", "rlxrt", "bench-serve", "--soak", "24", "--concurrency", "4",
                          "--max-tokens", "12", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    soak = json.loads((out / "soak.json").read_text())
    assert soak["requests"] == 24 and soak["errors"] == 0 and soak["mismatches"] == 0
    assert soak["replayed_alone"] == 24 - soak["closed_early_by_client"] and soak["workers_idle_after"]


@pytest.mark.slow
def test_bench_serve_measures_an_external_server_beside_its_own(tmp_path):
    """``--external NAME=URL``: a server already running (here another rlxrt server, as llama.cpp's would be) is
    sent the same requests, in the same interleaved order, and reported as its own plain."""
    import json

    port = free_port()
    other = _start("--speculator", "none", "--engine", "pool", "--workers", "1", "--log-level", "error", port=port)
    try:
        _wait_healthy(other, port, 120)
        out = tmp_path / "b"
        run = subprocess.run([sys.executable, "-m", "rlxrt", "bench-serve", "--engines", "batch", "--concurrency", "1,2",
                              "--requests", "2", "--max-tokens", "8", "--repeats", "1", "--out", str(out),
                              "--external", f"other=http://127.0.0.1:{port}/v1"],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
    finally:
        other.send_signal(signal.SIGTERM)
        other.wait(60)
    report = json.loads((out / "bench-serve.json").read_text())
    assert set(report["rows"]) == {"batch plain", "batch draft k=2", "other"}
    assert report["config"]["external"] == [f"other=http://127.0.0.1:{port}/v1"]
    row = report["rows"]["other"]["2"]
    assert row["tokens_per_second"] > 0 and row["vs_plain"] == 1.0 and row["speedup"] > 0
    assert "| other | 2 |" in run.stdout


@pytest.mark.slow
def test_bench_serve_fresh_starts_every_server_for_each_repeat_beside_a_control(tmp_path):
    """``--fresh``: each repeat measures new processes of rlxrt's servers (two processes of one server can differ
    for their whole lives); ``--control``: a second baseline, identical to the first, reported like the others."""
    import json

    out = tmp_path / "b"
    run = subprocess.run([sys.executable, "-m", "rlxrt", "bench-serve", "--engines", "batch", "--speculator", "none",
                          "--concurrency", "1", "--requests", "2", "--max-tokens", "8", "--repeats", "2", "--fresh",
                          "--control", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    report = json.loads((out / "bench-serve.json").read_text())
    assert list(report["rows"]) == ["batch plain", "batch plain (control)", "batch none k=4"]
    assert report["config"]["fresh_servers"] is True and report["config"]["baseline"] == "batch plain"
    pids = report["processes"]
    assert set(pids) == set(report["rows"]) and all(len(set(p)) == 2 for p in pids.values())
    assert len({p for ps in pids.values() for p in ps}) == 6  # no process measured in two repeats or as two servers
    control = report["rows"]["batch plain (control)"]["1"]
    assert len(control["vs_base_runs"]) == 2 and control["tokens_per_second"] > 0
    assert "| batch plain (control) | 1 |" in run.stdout


def test_bench_serve_pairs_each_repeat_with_its_own_plain_run():
    """The machine drifts between repeats: each repeat's speculative run is divided by its engine's plain run of
    the same repeat, and the median of those ratios is reported beside the ratio of the medians."""
    import argparse

    from rlxrt.app.serve.loadgen import _report, format_table

    def run(rate):
        return {"tokens_per_second": rate, "ttft_p50": 0.01, "ttft_p95": 0.02, "latency_p50": 0.1,
                "latency_p95": 0.2, "acceptance_rate": 0.5}

    plain, spec = [100.0, 200.0, 400.0], [110.0, 190.0, 480.0]  # the machine doubles its speed each repeat
    runs = {"batch plain": {2: [run(r) for r in plain]}, "batch draft k=2": {2: [run(r) for r in spec]}}
    args = argparse.Namespace(engines="batch", external=[], workers=2, threads=1, requests=8, max_tokens=16,
                              repeats=3, target=None, adaptive_k=False)
    report = _report(args, [2], runs, "draft", [2])
    row = report["rows"]["batch draft k=2"]["2"]
    assert row["vs_plain"] == 0.95  # 190 / 200: the medians come from different repeats
    assert row["vs_plain_runs"] == [1.1, 0.95, 1.2] and row["vs_plain_paired"] == 1.1
    assert report["rows"]["batch plain"]["2"]["vs_plain_paired"] == 1.0
    assert "| batch draft k=2 | 2 | 190 | 0.95x | 0.95x | 1.10x (0.95-1.20) |" in format_table(report)
    assert row["vs_base_runs"] == [1.1, 0.95, 1.2]  # the baseline here is its engine's plain
    lo, hi = row["vs_base_ci95"]
    assert lo < 1.0 < hi  # three repeats, 0.95 to 1.2: not told apart from plain
    assert f"| {lo:.2f}-{hi:.2f} |" in format_table(report)
    assert report["rows"]["batch plain"]["2"]["vs_base_ci95"] == [1.0, 1.0]


def test_a_ratio_interval_is_students_over_the_logs():
    """Ten repeats 3 % to 7 % faster tell a gain apart from none; two repeats a tenth apart do not; one says
    nothing."""
    from rlxrt.app.serve.loadgen import ratio_interval

    lo, hi = ratio_interval([1.03, 1.07, 1.05, 1.04, 1.06, 1.05, 1.03, 1.07, 1.05, 1.05])
    assert 1.0 < lo < 1.05 < hi < 1.1
    lo, hi = ratio_interval([0.95, 1.05])
    assert lo < 0.7 and hi > 1.4  # t at one degree of freedom is 12.7
    assert ratio_interval([1.2]) == [] and ratio_interval([1.0, 0.0]) == []


def test_bench_serve_pools_the_paired_ratios_from_two_clients_up():
    """One level's interval is wide; the ratios of every level from 2 clients up, taken together, tell a loss of
    a few percent apart from none where no level alone does. One client stays out of the pool."""
    import argparse

    from rlxrt.app.serve.loadgen import _report, format_table

    def run(rate):
        return {"tokens_per_second": rate, "ttft_p50": 0.01, "ttft_p95": 0.02, "latency_p50": 0.1,
                "latency_p95": 0.2, "acceptance_rate": 0.5}

    ratios = {1: [1.5, 1.6, 1.4], 2: [0.92, 1.0, 0.93], 4: [0.97, 0.91, 0.95], 8: [0.98, 0.92, 0.94]}
    runs = {"batch plain": {c: [run(100.0) for _ in r] for c, r in ratios.items()},
            "batch draft k=2": {c: [run(100.0 * x) for x in r] for c, r in ratios.items()}}
    args = argparse.Namespace(engines="batch", external=[], workers=2, threads=1, requests=8, max_tokens=16,
                              repeats=3, target=None, adaptive_k=False)
    report = _report(args, [1, 2, 4, 8], runs, "draft", [2])
    for c in ("2", "4", "8"):  # no level alone excludes 1.0
        lo, hi = report["rows"]["batch draft k=2"][c]["vs_base_ci95"]
        assert lo < 1.0 < hi
    pooled = report["pooled"]["batch draft k=2"]
    assert pooled["clients"] == [2, 4, 8] and pooled["ratios"] == 9
    assert pooled["vs_base"] == 0.946  # the geometric mean of the nine, the one-client runs left out
    lo, hi = pooled["vs_base_ci95"]
    assert 0.9 < lo < hi < 0.98
    assert report["pooled"]["batch plain"]["vs_base_ci95"] == [1.0, 1.0]
    assert f"| batch draft k=2 | 2,4,8 | 9 | 0.946x | {lo:.3f}-{hi:.3f} |" in format_table(report)


@pytest.mark.parametrize("spec", ["llamacpp", "=http://x", "llamacpp=ftp://x", "a=b"])
def test_a_bad_external_server_is_refused_with_the_form(spec):
    from rlxrt.app.serve.loadgen import ExternalServer
    from rlxrt.errors import UsageError

    with pytest.raises(UsageError, match="NAME=URL") as err:
        ExternalServer(spec)
    assert repr(spec) in str(err.value)


def test_tokens_of_a_stream_without_usage_are_counted_from_its_finish():
    """A server that streams no usage (as some do): a request stopped at its length counts every token asked
    for; one that stopped earlier counts a token a chunk."""
    import asyncio
    import json

    import httpx

    from rlxrt.app.serve.loadgen import one_request

    def server(finish):
        def reply(request):
            chunks = [{"choices": [{"text": t, "finish_reason": None}]} for t in ("a", "b", "c")]
            chunks[-1]["choices"][0]["finish_reason"] = finish
            body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
            return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})
        return httpx.MockTransport(reply)

    async def ask(finish):
        async with httpx.AsyncClient(transport=server(finish)) as client:
            return await one_request(client, "http://x", {"prompt": "p", "max_tokens": 5, "stream": True})

    done, stopped = asyncio.run(ask("length")), asyncio.run(ask("stop"))
    assert (done.tokens, done.text, done.finish) == (5, "abc", "length")
    assert (stopped.tokens, stopped.finish) == (3, "stop")


@pytest.mark.parametrize("failures", [1, 2])
def test_a_request_on_a_connection_the_server_closed_is_sent_once_more_and_no_more(failures, monkeypatch):
    """llama.cpp's server closes a kept-alive connection after 5 requests; the load generator sends a request
    that met such a connection again, once: a server that keeps failing still fails the run."""
    import asyncio

    import httpx

    from rlxrt.app.serve.loadgen import run_batch

    calls = []

    def reply(request):
        calls.append(request)
        if len(calls) <= failures:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return httpx.Response(200, json={"choices": [{"text": "ab", "finish_reason": "length"}],
                                         "usage": {"completion_tokens": 2}})

    real = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kw: real(transport=httpx.MockTransport(reply), **kw))
    bodies = [{"prompt": "p", "max_tokens": 2}]
    if failures == 1:
        results, _ = asyncio.run(run_batch("http://x", bodies, 1))
        assert [r.tokens for r in results] == [2]
    else:
        with pytest.raises(httpx.RemoteProtocolError):
            asyncio.run(run_batch("http://x", bodies, 1))
    assert len(calls) == 2


def test_ray_proxy_that_misses_its_readiness_check_is_started_again_then_a_typed_error():
    pytest.importorskip("ray")
    from ray.exceptions import RayActorError

    from rlxrt.app.serve import run
    from rlxrt.errors import RlxrtError

    class Serve:
        def __init__(self, failures):
            self.failures, self.calls = failures, 0

        def start(self, http_options):
            self.calls += 1
            if self.calls <= self.failures:
                raise RayActorError()

    flaky = Serve(run.PROXY_TRIES - 1)
    run._start_proxy(flaky, "127.0.0.1", 1234)
    assert flaky.calls == run.PROXY_TRIES
    with pytest.raises(RlxrtError, match=r"HTTP proxy on 127.0.0.1:1234 in 3 tries.*port is free"):
        run._start_proxy(Serve(run.PROXY_TRIES), "127.0.0.1", 1234)
