"""The FastAPI application: OpenAI's completions and chat completions (plain JSON or server-sent events ending
in ``[DONE]``), models, health and Prometheus metrics, over a ``Pool`` of Sessions."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import Request

from rlxrt.errors import GenerationError, RlxrtError, UsageError

from . import protocol as api
from .metrics import Metrics
from .pool import Closed, Job, Pool, QueueFull, Work

log = logging.getLogger("rlxrt.serve")
POLL = 0.25
"""Seconds between checks that a waiting client is still connected."""
MAX_BODY = 8 << 20
"""Largest request body (bytes): refused from its Content-Length before anything is read, or as soon as a
chunked body passes it."""
PREPARE_THREADS = 16
"""Threads of each of the two executors that prepare requests (chat templates; tokenising)."""
PROBE = ([{"role": "user", "content": "hi"}], [{"role": "system", "content": "hi"}, {"role": "user", "content": "hi"}])
"""The chats a server renders at start: the template loads and serves at least one of them."""


class Server:
    """What the routes share: the pool, the served model's name, the metrics, the request timeout."""

    def __init__(self, pool: Pool, model: str, metrics: Metrics, request_timeout: float, retry_after: int = 1,
                 engine: str = "pool", engine_reason: str | None = None, drafts: str | None = None, batch=None):
        self.pool, self.model, self.metrics, self.engine = pool, model, metrics, engine
        self.batch = batch
        """The Batch every Session decodes on under the batch engine (its ``report`` is in /health), else None."""
        self.engine_reason = engine_reason
        """Why the pool serves rather than the batch (None under the batch)."""
        self.drafts = drafts
        """How a draft model or head runs: ``batch`` (every Session's drafts in one step), ``each`` (each
        Session's on its own), None without one."""
        self.request_timeout, self.retry_after = request_timeout, retry_after
        s = pool.session
        self.session = s
        self.max_positions = s.manifest.max_positions
        if s.codec is None:
            raise UsageError(f"{s.manifest.source.get('path_or_id', 'the target')!r} was exported without a "
                             "tokenizer; the server answers with text, so it needs one: re-export with the tokenizer")
        # rendering waits on the template's own processes, tokenising runs here: neither starves the other
        self.renderers = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="rlxrt-render")
        self.tokenisers = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="rlxrt-tokenise")
        if s.has_chat_template:
            self._probe_template()

    def _probe_template(self) -> None:
        """Load the template (a template that does not parse stops the start) and render a one-message chat,
        or one with a system message for templates that require it; a template that refuses both, or runs
        past its budget, is reported and the server starts anyway (completions need no template)."""
        errors = []
        for messages in PROBE:
            try:
                self.session.chat_prompt(messages)
                return
            except GenerationError as exc:
                errors.append(str(exc))
        log.warning("the model's chat template renders neither a user message nor a system and a user message "
                    "(%s); chat requests will get its errors", errors[-1])

    def close(self) -> None:
        self.renderers.shutdown(wait=False, cancel_futures=True)
        self.tokenisers.shutdown(wait=False, cancel_futures=True)

    def work(self, req: api.Request, deadline: float) -> Work:
        """The prompt ids and generation arguments of a checked request (400 for what only the model can
        refuse: no tokenizer, no chat template, a prompt too long, token ids out of range); the chat template
        renders before ``deadline`` (time.monotonic()) or the request fails."""
        s = self.session
        try:  # the Session's own checks: the template exists, ids in range, the prompt fits the context
            seconds = deadline - time.monotonic()
            if seconds <= 0:
                raise TimeoutError
            ids = s.prompt_ids(s.chat_prompt(req.messages, seconds=seconds) if req.chat else req.prompt)
        except GenerationError as exc:
            raise api.ApiError(400, str(exc), "messages" if req.chat else "prompt") from None
        extra = list(s.manifest.chat["end_of_turn_ids"]) if req.chat and not req.ignore_eos else []
        max_new = req.max_tokens if req.max_tokens is not None else self.max_positions - len(ids)
        kwargs = dict(max_new_tokens=max_new, temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
                      seed=req.seed, stop=req.stop or None, stop_token_ids=extra or None, ignore_eos=req.ignore_eos)
        return Work(ids, kwargs)

    def prepare(self, raw: bytes, chat: bool, deadline: float) -> tuple[api.Request, Work]:
        """The body parsed and checked, then its Work (``work``); run off the event loop, where a large body's
        parse would stall every stream."""
        req = api.parse(api.parse_body(raw), chat, self.model)
        return req, self.work(req, deadline)

    def check_room(self) -> None:
        """429 (503 while shutting down) now, where the pool would refuse a request: before its body is parsed
        or its prompt tokenised, so that a flood of requests a full server turns away costs it little."""
        self._admit(self.pool.check)

    def submit(self, work: Work, deadline: float, streaming: bool = True) -> Job:
        job = Job(work, asyncio.get_running_loop(), deadline=deadline, streaming=streaming)
        self._admit(self.pool.submit, job)
        return job

    def _admit(self, call, *args) -> None:
        try:
            call(*args)
        except QueueFull as exc:
            self.metrics.rejected_one()
            raise api.ApiError(429, str(exc), None, "rate_limit_exceeded",
                               {"Retry-After": str(self.retry_after)}) from None
        except Closed as exc:
            raise api.ApiError(503, str(exc), None, "service_unavailable") from None


async def _watch(job: Job, request, pool) -> None:
    """Cancel the job when its client goes away, or when it is past its deadline while still waiting for a
    worker (the worker stops at its next round, or skips it; a job still waiting gives its place in the queue
    back at once); one task per request."""
    while not job.cancel.is_set():
        await asyncio.sleep(POLL)
        if await request.is_disconnected():
            job.cancel.set()
            pool.forget(job)
            job.events.put_nowait(("disconnected", None))
        elif time.monotonic() > job.deadline + 2 * POLL and not job.started:
            job.cancel.set()
            pool.forget(job)
            job.events.put_nowait(("timeout", None))


def _failure(kind: str, value: Any, started: bool = False) -> api.ApiError:
    """The error answer of a job's last event; a GenerationError is the client's fault only before the
    request started (its arguments), after that it is the model's (e.g. NaN logits): a 500."""
    if kind == "timeout":
        return api.ApiError(504, "the request ran past the server's --request-timeout; ask for fewer tokens",
                            None, "timeout")
    if isinstance(value, GenerationError) and not started:
        return api.ApiError(400, str(value))
    if isinstance(value, RlxrtError):
        return api.ApiError(500, f"{type(value).__name__}: {value}", None, "server_error")
    log.error("request failed", exc_info=value)
    return api.ApiError(500, f"internal error ({type(value).__name__}); see the server log", None, "server_error")


async def read_body(request) -> bytes | None:
    """The request's body, checked before it is read: a Content-Length over ``MAX_BODY`` or beside a
    Transfer-Encoding is refused at once, a chunked body as soon as it passes ``MAX_BODY``; None when the
    client went away while sending it."""
    from starlette.requests import ClientDisconnect

    length = request.headers.get("content-length")
    if length is not None and "transfer-encoding" in request.headers:
        raise api.ApiError(400, "the request has both Content-Length and Transfer-Encoding; send one of them")
    if length is not None:
        if not length.isdigit():
            raise api.ApiError(400, f"Content-Length {length[:40]!r} is not a number of bytes")
        if int(length) > MAX_BODY:
            raise api.ApiError(413, f"the request body has {length} bytes; at most {MAX_BODY} are accepted")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY:
                raise api.ApiError(413, f"the request body passed {MAX_BODY} bytes, the most accepted")
            chunks.append(chunk)
    except ClientDisconnect:
        log.info("a client disconnected while sending its request body")
        return None
    return b"".join(chunks)


def build_app(server: Server):
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(server.pool.close)  # in-flight requests have finished (uvicorn waited for them)
        server.close()

    app = FastAPI(title="rlxrt", lifespan=lifespan)

    def error(exc: api.ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(api.ApiError)
    async def on_api_error(request, exc: api.ApiError):
        return error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request, exc):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(api.error_body(str(exc.detail), kind, None, exc.status_code), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request, exc):
        where = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}" for e in exc.errors())
        return JSONResponse(api.error_body(f"invalid request: {where}", "invalid_request_error"), status_code=400)

    @app.exception_handler(Exception)
    async def on_bug(request, exc):
        log.error("internal error", exc_info=exc)
        return JSONResponse(api.error_body(f"internal error ({type(exc).__name__}); see the server log",
                                           "server_error", None, 500), status_code=500)

    @app.get("/health")
    async def health():
        p = server.pool
        out = {"status": "ok", "model": server.model, "engine": server.engine, "drafts": server.drafts,
               "workers": len(p.sessions), "running": p.running, "waiting": p.waiting}
        if server.batch is not None:
            out["batch"] = server.batch.report()
        return out

    @app.get("/v1/models")
    async def models():
        m = server.session.manifest
        return {"object": "list", "data": [{"id": server.model, "object": "model", "created": 0, "owned_by": "rlxrt",
                                            "max_model_len": m.max_positions,
                                            "speculator": server.session.speculator_name}]}

    @app.get("/metrics")
    async def metrics():
        data, content_type = server.metrics.exposition()
        return Response(data, media_type=content_type)

    async def generate(request: Request, chat: bool):
        deadline = time.monotonic() + server.request_timeout  # templates, tokenising and the queue count too
        raw = await read_body(request)  # whole even where it is refused: unread, a client still sending hears a reset
        if raw is None:
            return Response(status_code=499)
        server.check_room()
        loop = asyncio.get_running_loop()
        try:  # off the event loop
            req, work = await loop.run_in_executor(server.renderers if chat else server.tokenisers, server.prepare,
                                                   raw, chat, deadline)
        except TimeoutError:
            raise _failure("timeout", None) from None
        job = server.submit(work, deadline, req.stream)
        watcher = asyncio.create_task(_watch(job, request, server.pool))
        streaming = False
        try:
            kind, value = await job.events.get()  # "start" once the worker took it and the arguments held
            if kind == "disconnected":
                return Response(status_code=499)
            if kind != "start":
                raise _failure(kind, value)
            if req.stream:
                streaming = True  # the stream's generator ends the watcher
                return StreamingResponse(_sse(server, req, api.new_id(chat), job, watcher),
                                         media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            while True:
                kind, value = await job.events.get()
                if kind == "done":
                    return api.response(req, api.new_id(chat), server.model, value)
                if kind == "disconnected":
                    return Response(status_code=499)
                if kind != "text":
                    raise _failure(kind, value, started=True)
        finally:
            if not streaming:
                job.cancel.set()  # a no-op once the job ended
                watcher.cancel()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    return app


async def _sse(server: Server, req: api.Request, rid: str, job: Job, watcher: asyncio.Task) -> AsyncIterator[str]:
    created = int(time.time())

    def event(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    # a text chunk is the same JSON each time but for its text: format it once, insert each piece's JSON string
    head, tail = event(api.chunk(req, rid, server.model, created, text="\0")).split('"\\u0000"')
    try:
        if req.chat:
            yield event(api.chunk(req, rid, server.model, created, role=True))
        while True:
            kind, value = await job.events.get()
            if kind == "text":
                yield head + json.dumps(value, ensure_ascii=False) + tail
            elif kind == "done":
                yield event(api.chunk(req, rid, server.model, created, reason=api.finish_reason(value)))
                if req.include_usage:
                    yield event(api.usage_chunk(req, rid, server.model, created, value))
                break
            elif kind == "disconnected":
                return
            else:
                yield event(_failure(kind, value, started=True).body())
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancel.set()  # a no-op when the job ended; otherwise the client went away mid-stream
        watcher.cancel()
