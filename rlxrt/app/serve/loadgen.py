"""``rlxrt bench-serve``: drive rlxrt servers with C concurrent streaming clients and compare plain with
speculative serving side by side (interleaved repeats, medians); ``--soak N``: a long mixed run that checks
nothing is lost (every greedy or seeded answer equals the same request served alone) and that memory stays flat.

Each server runs in its own process (``rlxrt serve``), started here on a free port; the clients are one asyncio
loop in this process (httpx), so the numbers include HTTP, JSON and SSE, as a user of the server sees them.
``--external NAME=URL`` adds an OpenAI-compatible server already running (llama.cpp's ``llama-server``, say),
sent the same requests in the same interleaved order. ``--fresh`` starts rlxrt's servers anew for every repeat, so
that what sets one process apart from another (where its memory landed, what it timed as it started) is sampled
with the repeats instead of measured once. ``--control`` adds a second baseline server, identical to the first,
whose ratio to it shows what the measurement cannot tell apart. The report pools each server's paired ratios
from 2 clients up (``pooled``): on a shared machine one level's interval is several percent wide.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from statistics import mean, median, stdev
from typing import Any

from rlxrt.errors import InputError, RlxrtError, UsageError

from ..speculators import model_of


def add_bench_serve(add, model_flags) -> None:
    p = add("bench-serve", cmd_bench_serve, "load-test rlxrt serve: plain vs speculative serving at several "
                                            "concurrencies (tokens/s, time to first token, latency p50/p95), or "
                                            "a soak run (--soak N)")
    model_flags(p)
    p.add_argument("--engines", default="pool,batch",
                   help="serving engines to compare, each plain and speculative (default pool,batch)")
    p.add_argument("--workers", type=int, default=2, help="workers of each pool server (default 2)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per pool worker (default 1); a batch "
                                                         "server's step takes every core")
    p.add_argument("--concurrency", default="1,2,4,8,16", help="concurrent clients to try (default 1,2,4,8,16); a "
                                                               "batch server decodes as many at once as the most")
    p.add_argument("--requests", type=int, default=16, help="requests per measurement (default 16)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per request (EOS ignored; default 128)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats; medians are reported")
    p.add_argument("--ks", help="draft lengths to compare, one speculative server each (e.g. 2,3,4; default: -k)")
    p.add_argument("--fresh", action="store_true",
                   help="start every rlxrt server anew for each repeat, in alternating order, so that the "
                        "intervals hold what one process of a server differs from another (external servers stay)")
    p.add_argument("--control", action="store_true",
                   help="a second, identical baseline server: what two servers that differ in nothing differ by")
    p.add_argument("--soak", type=int, help="instead: a soak run of N mixed requests on the speculative server")
    p.add_argument("--seed", type=int, default=0, help="soak: the mix's random seed")
    p.add_argument("--external", action="append", default=[], metavar="NAME=URL",
                   help="an OpenAI-compatible server already running (e.g. llama.cpp's llama-server), measured "
                        "beside rlxrt's with the same requests; repeatable")
    p.add_argument("--out", default="bench-serve-out", help="directory for bench-serve.json and bench-serve.png")


# -- servers ----------------------------------------------------------------------------------------------------
class ServerProcess:
    def __init__(self, flags: list[str], label: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url, self.label = f"http://127.0.0.1:{self.port}", label
        import tempfile

        self.log = tempfile.TemporaryFile(mode="w+")  # drained by the OS, read back on failure
        self.proc = subprocess.Popen([sys.executable, "-m", "rlxrt", "serve", "--port", str(self.port), *flags],
                                     stdout=subprocess.DEVNULL, stderr=self.log, text=True)

    def wait_ready(self, seconds: float = 120) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RlxrtError(f"the {self.label} server exited: {self.log.read()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.2)
        raise RlxrtError(f"the {self.label} server did not answer /health within {seconds} s")

    def batch_report(self) -> dict | None:
        """What a batch server's Batch measured and decided (its /health ``batch``); None for a pool server."""
        with urllib.request.urlopen(f"{self.url}/health", timeout=30) as r:
            return json.loads(r.read()).get("batch")

    def rss_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _start(wanted: list[tuple[list[str], str]], reverse: bool = False) -> dict[str, ServerProcess]:
    """rlxrt's servers, one at a time (a batch server times its steps as it starts), in ``wanted``'s order or
    its reverse; returned in ``wanted``'s order. Where one fails, those already started are stopped."""
    started: dict[str, ServerProcess] = {}
    try:
        for flags, label in (wanted[::-1] if reverse else wanted):
            started[label] = ServerProcess(flags, label)
            started[label].wait_ready()
    except BaseException:
        for server in started.values():
            server.stop()
        raise
    return {label: started[label] for _, label in wanted}


def _warm(servers, prompts: list[str], clients: int) -> None:
    """The first runs of each server's graphs, before any is timed."""
    for s in servers:
        asyncio.run(run_batch(s.url, _bodies(prompts, 2 * clients, 16), clients))


class ExternalServer:
    """A server this command did not start (``--external NAME=URL``): measured, never stopped."""

    def __init__(self, spec: str):
        name, sep, url = spec.partition("=")
        url = url.rstrip("/").removesuffix("/v1")
        if not sep or not name.strip() or not url.startswith(("http://", "https://")):
            raise UsageError(f"--external takes NAME=URL with an http(s) URL (e.g. llamacpp=http://127.0.0.1:8080); "
                             f"got {spec!r}")
        self.label, self.url = name.strip(), url

    def wait_ready(self, seconds: float = 120) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for path in ("/v1/models", "/health"):
                try:
                    with urllib.request.urlopen(f"{self.url}{path}", timeout=2):
                        return
                except OSError:
                    pass
            time.sleep(0.5)
        raise RlxrtError(f"the external server {self.label!r} at {self.url} answered neither /v1/models nor "
                         f"/health within {seconds} s; start it first, or fix --external")

    def stop(self) -> None:
        """Not ours to stop."""


# -- clients ----------------------------------------------------------------------------------------------------
@dataclass
class Result:
    text: str
    tokens: int
    ttft: float | None
    latency: float
    finish: str | None
    usage: dict | None
    cancelled: bool = False


async def one_request(client, url: str, body: dict, cancel_after: int | None = None) -> Result:
    """One request; streaming when ``body["stream"]``; ``cancel_after`` chunks: close the stream early."""
    start = time.perf_counter()
    if not body.get("stream"):
        r = await client.post(f"{url}/v1/completions", json=body)
        r.raise_for_status()
        data = r.json()
        return Result(data["choices"][0]["text"], data["usage"]["completion_tokens"], None,
                      time.perf_counter() - start, data["choices"][0]["finish_reason"], data["usage"])
    text, ttft, usage, finish, chunks = [], None, None, None, 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                raise RlxrtError(f"server error: {obj['error']['message']}")
            if obj.get("usage"):
                usage = obj["usage"]
            for choice in obj.get("choices", []):
                if choice.get("text") and ttft is None:
                    ttft = time.perf_counter() - start
                text.append(choice.get("text") or "")
                finish = choice.get("finish_reason") or finish
            chunks += 1
            if cancel_after is not None and chunks >= cancel_after:
                return Result("".join(text), 0, ttft, time.perf_counter() - start, None, None, cancelled=True)
    if usage:
        tokens = usage["completion_tokens"]
    else:  # a server that streams no usage: every token asked for where it stopped at the length, else a chunk each
        tokens = body["max_tokens"] if finish == "length" else sum(1 for t in text if t)
    return Result("".join(text), tokens, ttft, time.perf_counter() - start, finish, usage)


async def run_batch(url: str, bodies: list[dict], concurrency: int) -> tuple[list[Result], float]:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def go(body):
            async with sem:
                try:
                    return await one_request(client, url, body)
                except httpx.RemoteProtocolError:  # a kept-alive connection the server had closed (llama.cpp's
                    return await one_request(client, url, body)  # closes one after 5 requests): once more

        start = time.perf_counter()
        results = await asyncio.gather(*(go(b) for b in bodies))
        return list(results), time.perf_counter() - start


def _pct(values: list[float], q: float) -> float:
    v = sorted(values)
    if not v:
        return float("nan")
    i = min(len(v) - 1, max(0, round(q * (len(v) - 1))))
    return v[i]


def _measure(results: list[Result], wall: float) -> dict[str, float]:
    tokens = sum(r.tokens for r in results)
    spec = [r.usage.get("speculative", {}) for r in results if r.usage]
    drafted = sum(s.get("draft_tokens", 0) for s in spec)
    return {"tokens_per_second": tokens / wall, "ttft_p50": _pct([r.ttft for r in results if r.ttft], 0.5),
            "ttft_p95": _pct([r.ttft for r in results if r.ttft], 0.95),
            "latency_p50": _pct([r.latency for r in results], 0.5),
            "latency_p95": _pct([r.latency for r in results], 0.95),
            "acceptance_rate": sum(s.get("accepted_tokens", 0) for s in spec) / drafted if drafted else 0.0}


# -- the command ------------------------------------------------------------------------------------------------
def _server_flags(args: argparse.Namespace, k: int | None, adaptive: bool | None = None,
                  engine: str = "pool", slots: int = 16) -> tuple[list[str], list[str], str]:
    """(plain flags, speculative flags, speculator name) for draft length ``k`` (the start of an adaptive k
    when ``adaptive``, default ``--adaptive-k``) on ``engine`` (a batch of ``slots`` sequences)."""
    sizes = ["--workers", str(args.workers), "--threads", str(args.threads)] if engine == "pool" else \
        ["--workers", str(slots), "--threads", str(os.cpu_count() or 1)]
    base = ["--engine", engine, *sizes, "--max-queue", "1024", "--model-name", "m", "--log-level", "error"]
    model = ["--target", args.target] if args.target else []
    spec = list(model)
    if args.draft:
        spec += ["--draft", args.draft]
    if args.head:
        spec += ["--head", args.head]
    name = args.speculator or ("draft" if args.draft or not args.target else "mtp" if args.head else "prompt-lookup")
    spec += ["--speculator", name] + (["-k", str(k)] if k else [])
    if args.min_draft_prob:
        spec += ["--min-draft-prob", str(args.min_draft_prob)]
    if args.adaptive_k if adaptive is None else adaptive:
        spec += ["--adaptive-k"]
    return base + model + ["--speculator", "none"], base + spec, name


def _bodies(prompts: list[str], n: int, max_tokens: int) -> list[dict]:
    return [{"prompt": prompts[i % len(prompts)], "max_tokens": max_tokens, "temperature": 0, "stream": True,
             "stream_options": {"include_usage": True}, "ignore_eos": True} for i in range(n)]


def cmd_bench_serve(args: argparse.Namespace) -> int:
    import importlib.util

    from ..flags import prompts_of

    if importlib.util.find_spec("httpx") is None:
        raise UsageError("bench-serve needs httpx: pip install 'rlxrt[serve]'")
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        raise UsageError(f"--concurrency must be comma-separated integers, got {args.concurrency!r}") from None
    for flag, value, low in (("--concurrency", min(levels), 1), ("--requests", args.requests, 1),
                             ("--max-tokens", args.max_tokens, 1), ("--repeats", args.repeats, 1),
                             ("--workers", args.workers, 1), ("--threads", args.threads, 0),
                             ("--soak", args.soak if args.soak is not None else 1, 1)):
        if value < low:
            raise InputError(f"{flag} must be >= {low}, got {value}")
    prompts = prompts_of(argparse.Namespace(prompt_file=None), 64)
    if args.ks and args.k:
        raise UsageError("pass -k or --ks, not both")
    try:
        ks = [int(k) for k in args.ks.split(",")] if args.ks else [args.k]
    except ValueError:
        raise UsageError(f"--ks must be comma-separated integers, got {args.ks!r}") from None
    if any(k is not None and not 1 <= k <= 32 for k in ks):
        raise InputError(f"draft lengths must be in 1..32, got {args.ks or args.k}")
    engines = [e for e in args.engines.split(",") if e]
    if not engines or any(e not in ("pool", "batch") for e in engines):
        raise UsageError(f"--engines takes pool and/or batch, comma-separated; got {args.engines!r}")
    externals = [ExternalServer(spec) for spec in args.external]
    if len({e.label for e in externals}) < len(externals):
        raise UsageError(f"--external names must differ; got {', '.join(e.label for e in externals)}")
    _, spec_flags, name = _server_flags(args, ks[0], engine=engines[-1], slots=max(levels))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.soak:
        from .soak import run_soak

        report = run_soak(ServerProcess(spec_flags, name), prompts, args.soak, max(levels), args.max_tokens, args.seed)
        (out / "soak.json").write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps({k: v for k, v in report.items() if k != "rss_mb"}, indent=2))
        print(f"wrote {out / 'soak.json'}", file=sys.stderr)
        return 0 if report["mismatches"] == 0 and report["errors"] == 0 else 1
    wanted = _wanted(args, engines, ks, name, max(levels))
    for e in externals:
        if e.label in {label for _, label in wanted}:
            raise UsageError(f"--external name {e.label!r} is one of rlxrt's servers; choose another")
    labels = [label for _, label in wanted] + [e.label for e in externals]
    runs: dict[str, dict[int, list[dict]]] = {k: {c: [] for c in levels} for k in labels}
    servers: dict[str, Any] = {}
    try:
        if not args.fresh:
            servers.update(_start(wanted))
        pids = {label: [servers[label].proc.pid] if label in servers else [] for _, label in wanted}
        for e in externals:
            e.wait_ready()
            servers[e.label] = e
        _warm(servers.values(), prompts, max(levels))
        batches = _repeats(args, wanted, labels, servers, runs, levels, prompts, pids)
    finally:
        for s in servers.values():
            s.stop()
    report = _report(args, levels, runs, name, ks)
    report["batches"] = {label: b for label, b in batches.items() if b is not None}
    report["processes"] = pids  # each rlxrt server's process ids: one, or one a repeat with --fresh
    (out / "bench-serve.json").write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(report))
    try:
        _chart(report, out / "bench-serve.png")
    except ImportError:
        print("(no chart: pip install matplotlib)", file=sys.stderr)
    print(f"wrote {out / 'bench-serve.json'}", file=sys.stderr)
    return 0


def _wanted(args, engines: list[str], ks: list, name: str, slots: int) -> list[tuple[list[str], str]]:
    """(flags, label) of every rlxrt server to measure, the baseline first."""
    wanted = []
    for engine in engines:
        flags = lambda k, adaptive=None: _server_flags(args, k, adaptive, engine, slots)  # noqa: E731
        wanted.append((flags(ks[0])[0], f"{engine} plain"))
        if args.control and engine == engines[0]:
            wanted.append((flags(ks[0])[0], f"{engine} plain (control)"))
        for k in ks:  # with --adaptive-k, an adaptive server beside each fixed one
            label = f"{engine} {name} k={k or (2 if name in ('draft', 'mtp') else 4)}"
            wanted.append((flags(k, False)[1], label))
            if args.adaptive_k:
                wanted.append((flags(k, True)[1], f"{label} adaptive"))
    return wanted


def _repeats(args, wanted, labels: list[str], servers: dict, runs: dict, levels: list[int], prompts,
             pids: dict[str, list[int]]) -> dict:
    """Every repeat: each level, each server in turn (the order reversed every other repeat), into ``runs``;
    with ``--fresh`` rlxrt's servers are started for the repeat (their process ids into ``pids``) and stopped
    after it. The batch reports of the last processes."""
    batches: dict[str, Any] = {}
    for rep in range(args.repeats):
        if args.fresh:  # started in turn forward and backward: neither end of the order is always first
            started = _start(wanted, reverse=rep % 2 == 1)
            servers.update(started)
            for label, server in started.items():
                pids[label].append(server.proc.pid)
            _warm(started.values(), prompts, max(levels))
        for c in levels:
            for label in (labels if rep % 2 == 0 else labels[::-1]):
                results, wall = asyncio.run(run_batch(servers[label].url,
                                                      _bodies(prompts, args.requests, args.max_tokens), c))
                runs[label][c].append(_measure(results, wall))
                print(f"  repeat {rep + 1}/{args.repeats} concurrency {c:>2} {label:<18} "
                      f"{runs[label][c][-1]['tokens_per_second']:8.1f} tok/s", file=sys.stderr)
        if args.fresh or rep == args.repeats - 1:
            batches.update({label: servers[label].batch_report() for _, label in wanted})
        if args.fresh:
            for label in started:
                servers.pop(label).stop()
    return batches


def _report(args, levels, runs, name, ks) -> dict[str, Any]:
    rows = {}
    for label, per in runs.items():
        rows[label] = {str(c): {k: round(median(r[k] for r in per[c]), 4) for k in per[c][0]} for c in levels}
    first = next(iter(rows))  # the first engine's plain server: the baseline
    for label in rows:
        plain = f"{label.split()[0]} plain"  # an external server is its own plain
        plain = plain if plain in rows else label
        for c in levels:
            row = rows[label][str(c)]
            row["speedup"] = round(row["tokens_per_second"] / rows[first][str(c)]["tokens_per_second"], 3)
            row["vs_plain"] = round(row["tokens_per_second"] / rows[plain][str(c)]["tokens_per_second"], 3)
            paired = _ratios(runs[label][c], runs[plain][c])
            row["vs_plain_paired"] = round(median(paired), 3)  # each repeat against its own plain run: the
            row["vs_plain_runs"] = [round(x, 3) for x in paired]  # machine's drift between repeats cancels
            base = _ratios(runs[label][c], runs[first][c])
            row["vs_base_runs"] = [round(x, 3) for x in base]
            row["vs_base_ci95"] = [round(x, 3) for x in ratio_interval(base)]
    return {"pooled": _pooled(levels, runs, first), "config": {"engines": args.engines, "external": list(args.external), "baseline": first,
                       "batch_sequences": max(levels),
                       "workers": args.workers, "threads_per_worker": args.threads, "requests": args.requests,
                       "max_tokens": args.max_tokens, "repeats": args.repeats, "cpu_count": os.cpu_count(),
                       "target": Path(args.target).name if args.target else "shipped reference target",
                       "speculator": name,
                       "ks": [k or (2 if model_of(name) else 4) for k in ks], "adaptive_k": args.adaptive_k,
                       "fresh_servers": bool(getattr(args, "fresh", False))},
            "rows": rows, "note": "medians over interleaved repeats; tokens/s is all clients' tokens over wall time; "
                                  "vs_plain_paired: the median over repeats of each repeat's ratio to its engine's plain "
                                  "run of the same repeat (vs_plain_runs); vs_base_runs: each repeat's ratio to the "
                                  "baseline's run of the same repeat, vs_base_ci95 the 95 % interval of their "
                                  "geometric mean (Student's t over the logs; none from one repeat); pooled: every "
                                  "such ratio from 2 clients up, their geometric mean and its 95 % interval"}


def _pooled(levels: list[int], runs: dict, first: str) -> dict[str, Any]:
    """Each server's paired ratios to the baseline at every level from 2 clients up, taken together: one run's
    interval at one level is several percent wide on a shared machine, and the goal is the same at each level.
    Their geometric mean and its 95 % interval (none from fewer than two ratios)."""
    shared = [c for c in levels if c >= 2]
    pooled = {}
    for label, per in runs.items():
        ratios = [x for c in shared for x in _ratios(per[c], runs[first][c])]
        if len(ratios) >= 2 and min(ratios) > 0:
            pooled[label] = {"clients": shared, "ratios": len(ratios),
                             "vs_base": round(math.exp(mean(math.log(x) for x in ratios)), 3),
                             "vs_base_ci95": [round(x, 3) for x in ratio_interval(ratios)]}
    return pooled


def _ratios(runs: list[dict], against: list[dict]) -> list[float]:
    """Each repeat's tokens a second over ``against``'s in the same repeat."""
    return [r["tokens_per_second"] / p["tokens_per_second"] for r, p in zip(runs, against)]


def format_table(report: dict[str, Any]) -> str:
    rows = report["rows"]
    base = report["config"].get("baseline", "plain")
    lines = [f"| server | clients | tok/s | vs {base} | vs its engine's plain | paired (range) | vs {base} paired, 95 % | "
             "TTFT p50 / p95 (ms) | latency p50 / p95 (s) | acceptance |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for label, per in rows.items():
        for c, r in per.items():
            lines.append(f"| {label} | {c} | {r['tokens_per_second']:.0f} | {r.get('speedup', 1.0):.2f}x | "
                         f"{r.get('vs_plain', 1.0):.2f}x | {_paired(r)} | {_interval(r)} | "
                         f"{1000 * r['ttft_p50']:.0f} / {1000 * r['ttft_p95']:.0f} | "
                         f"{r['latency_p50']:.2f} / {r['latency_p95']:.2f} | {r['acceptance_rate']:.2f} |")
    pooled = report.get("pooled") or {}
    if pooled:
        lines += ["", f"| server | clients, pooled | paired ratios | vs {base}, geometric mean | 95 % |",
                  "| --- | --- | --- | --- | --- |"]
        for label, p in pooled.items():
            lo, hi = p["vs_base_ci95"]
            lines.append(f"| {label} | {','.join(map(str, p['clients']))} | {p['ratios']} | {p['vs_base']:.3f}x | "
                         f"{lo:.3f}-{hi:.3f} |")
    return "\n".join(lines)


T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
       11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 18: 2.101, 20: 2.086, 25: 2.060, 30: 2.042,
       40: 2.021, 60: 2.000, 120: 1.980}
"""Student's t, two-sided 95 %, by degrees of freedom (a missing one reads the next one below; past 120, 1.96)."""


def ratio_interval(ratios: list[float]) -> list[float]:
    """The 95 % interval of the geometric mean of paired ``ratios`` (Student's t over their logs); [] from
    fewer than two, or where one is not above 0."""
    if len(ratios) < 2 or min(ratios) <= 0:
        return []
    logs = [math.log(x) for x in ratios]
    df = len(logs) - 1
    t = 1.96 if df > 120 else T95[max(d for d in T95 if d <= df)]
    half = t * stdev(logs) / math.sqrt(len(logs))
    return [math.exp(mean(logs) - half), math.exp(mean(logs) + half)]


def _interval(row: dict[str, Any]) -> str:
    ci = row.get("vs_base_ci95") or []
    return f"{ci[0]:.2f}-{ci[1]:.2f}" if ci else "-"


def _paired(row: dict[str, Any]) -> str:
    runs = row.get("vs_plain_runs") or [1.0]
    return f"{row.get('vs_plain_paired', 1.0):.2f}x ({min(runs):.2f}-{max(runs):.2f})"


def _chart(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4), dpi=110)
    for label, per in report["rows"].items():
        cs = [int(c) for c in per]
        a.plot(cs, [per[c]["tokens_per_second"] for c in per], marker="o", label=label)
        b.plot(cs, [per[c]["latency_p95"] for c in per], marker="o", label=label)
    for ax, title in ((a, "tokens/s (all clients)"), (b, "latency p95 (s)")):
        ax.set_xlabel("concurrent streaming clients")
        ax.set_title(title, fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.legend(fontsize=8)
        ax.set_ylim(bottom=0)
    cfg = report["config"]
    fig.suptitle(f"rlxrt bench-serve: pool {cfg['workers']} workers x {cfg['threads_per_worker']} thread(s), "
                 f"batch {cfg.get('batch_sequences', '-')} sequences; "
                 f"{cfg['requests']} requests x {cfg['max_tokens']} tokens, medians of {cfg['repeats']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def mixed_bodies(prompts: list[str], n: int, max_tokens: int, seed: int) -> list[tuple[dict, int | None]]:
    """The soak's mix: (body, cancel_after) — streaming or not, greedy or seeded sampling, some cancelled."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        stream = rng.random() < 0.5
        body = {"prompt": prompts[rng.randrange(len(prompts))], "max_tokens": rng.randint(8, max_tokens),
                "temperature": 0 if rng.random() < 0.6 else round(rng.uniform(0.5, 1.0), 2), "stream": stream}
        if body["temperature"]:
            body["seed"] = rng.randrange(1 << 30)
            body["top_k"] = rng.choice([0, 20])
        if stream:
            body["stream_options"] = {"include_usage": True}
        out.append((body, rng.randint(1, 3) if stream and rng.random() < 0.2 else None))
    return out
