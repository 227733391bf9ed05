"""OpenAI's request fields checked one by one, and its response shapes.

Every bad field is an ``ApiError`` (HTTP 400, OpenAI's error JSON naming the field); a field that would change
the output and that rlxrt does not implement is refused, never silently ignored. Defaults follow OpenAI's:
``temperature`` 1, ``top_p`` 1, ``max_tokens`` 16 for completions and up to the context for chat.
"""
from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from rlxrt.limits import MAX_NEW_TOKENS, MAX_STOP_LENGTH, MAX_STOP_STRINGS

COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream", "stream_options",
          "user", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "ignore_eos"}
COMPLETION = COMMON | {"prompt", "echo", "suffix", "best_of"}
CHAT = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "response_format",
                 "parallel_tool_calls"}
MAX_DEPTH = 32
"""Levels of nesting a request body may have (OpenAI's bodies have five or six)."""
# fields accepted only at the value that leaves the output unchanged
NEUTRAL = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logit_bias": ({},), "logprobs": (False, 0),
           "echo": (False,), "suffix": ("",), "best_of": (1,), "top_logprobs": (0,), "tools": ([],),
           "tool_choice": ("none",), "response_format": ({"type": "text"},), "parallel_tool_calls": (False, True)}


class ApiError(Exception):
    """An error answered with OpenAI's error JSON."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.param, self.status)


def error_body(message: str, kind: str, param: str | None = None, status: int = 400) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param)


@dataclass
class Request:
    """One checked request."""

    chat: bool
    prompt: str | list[int] | None
    """Completions: the prompt text or token ids."""
    messages: list[dict] | None
    """Chat: the messages (checked again by the chat template)."""
    max_tokens: int | None
    """None: up to the model's context (chat's default)."""
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    ignore_eos: bool


def parse_body(raw: bytes) -> Any:
    """The request body's JSON (400 when it is not JSON or nests absurdly deep)."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError(400, "the request body is not JSON") from None
    except RecursionError:
        raise ApiError(400, f"the request body nests deeper than {MAX_DEPTH} levels") from None


def parse(body: Any, chat: bool, model: str) -> Request:
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    _check_text(body)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("user", f"must be a string (an end-user id), got {str(user)[:80]!r}")
    allowed = CHAT if chat else COMPLETION
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad(unknown[0], f"unrecognized request argument (this endpoint takes {', '.join(sorted(allowed))})")
    for name, neutral in NEUTRAL.items():
        if name in body and body[name] is not None and not any(_same(body[name], v) for v in neutral):
            raise bad(name, f"{body[name]!r} is not supported by rlxrt; leave it out")
    asked = body.get("model")
    if asked is not None and asked != model:
        raise ApiError(404, f"model {asked!r} does not exist; this server serves {model!r} (GET /v1/models)",
                       "model", "model_not_found")
    n = _integer(body, "n", 1, 1, 1_000_000)
    if n != 1:
        raise bad("n", f"rlxrt returns one choice per request; got n={n}, send n=1 (or several requests)")
    prompt, messages = (None, _messages(body)) if chat else (_prompt(body), None)
    limit = _integer(body, "max_completion_tokens", None, 1, MAX_NEW_TOKENS) if chat else None
    max_tokens = _integer(body, "max_tokens", limit if chat else 16, 1, MAX_NEW_TOKENS)
    if limit is not None and body.get("max_tokens") is not None and max_tokens != limit:
        raise bad("max_completion_tokens", f"{limit} disagrees with max_tokens {max_tokens}; send one of them")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}
                                or not isinstance(options.get("include_usage", False), bool)):
        raise bad("stream_options", f"must be {{'include_usage': true | false}}, got {options!r}")
    stream = _flag(body, "stream")
    if options is not None and not stream:
        raise bad("stream_options", "is only allowed with stream: true")
    return Request(chat=chat, prompt=prompt, messages=messages, max_tokens=max_tokens,
                   temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                   top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
                   top_k=_integer(body, "top_k", 0, 0, 1 << 31),
                   seed=_integer(body, "seed", None, 0, (1 << 63) - 1),
                   stop=_stop(body), stream=stream, include_usage=bool((options or {}).get("include_usage")),
                   ignore_eos=_flag(body, "ignore_eos"))


def _check_text(body: dict) -> None:
    """Every string of the body must be text UTF-8 can carry (JSON allows lone surrogates, which no
    tokenizer can encode), and the body nests at most ``MAX_DEPTH`` levels; walked without recursion."""
    todo = [(body, "body", 1)]
    while todo:
        value, where, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise ApiError(400, f"the request body nests deeper than {MAX_DEPTH} levels (at {where!r})")
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise bad(where, "holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text; send valid "
                                 "Unicode") from None
        elif isinstance(value, dict):
            for k, v in value.items():
                todo.append((k, where, depth))
                todo.append((v, k if where == "body" and isinstance(k, str) else where, depth + 1))
        elif isinstance(value, list):
            todo.extend((v, where, depth + 1) for v in value)


def _same(a, b) -> bool:
    return type(a) is type(b) and a == b or (isinstance(a, (int, float)) and not isinstance(a, bool)
                                             and isinstance(b, (int, float)) and a == b)


def _integer(body: dict, name: str, default, low: int, high: int):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise bad(name, f"must be an integer in {low}..{high}, got {v!r}")
    return v


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and \
        (low < v if low_open else low <= v) and v <= high
    if not ok:
        span = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise bad(name, f"must be a number in {span}, got {v!r}")
    return float(v)


def _flag(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(name, f"must be true or false, got {v!r}")
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    stops = [] if v is None else [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS or \
            not all(isinstance(s, str) and 1 <= len(s) <= MAX_STOP_LENGTH for s in stops):
        raise bad("stop", f"must be a string or a list of at most {MAX_STOP_STRINGS} strings of 1..{MAX_STOP_LENGTH} "
                          f"characters, got {str(v)[:80]!r}")
    return stops


def _prompt(body: dict) -> str | list[int]:
    if "prompt" not in body:
        raise bad("prompt", "is required")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        if not p:
            raise bad("prompt", "is empty; send at least one character")
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return p
    raise bad("prompt", "must be one text or one list of token ids (rlxrt serves one prompt per request; send a "
                        f"batch as separate requests), got {str(p)[:80]!r}")


def _messages(body: dict) -> list[dict]:
    m = body.get("messages")
    if not isinstance(m, list) or not m:
        raise bad("messages", f"must be a non-empty list of {{'role', 'content'}} objects, got {str(m)[:80]!r}")
    out = []
    for i, msg in enumerate(m):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise bad(f"messages[{i}]", f"must be an object with a string 'role', got {str(msg)[:80]!r}")
        content = msg.get("content")
        if isinstance(content, list):  # content parts: only text parts are supported
            if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                       for c in content):
                raise bad(f"messages[{i}].content", "only text content parts are supported")
            content = "".join(c["text"] for c in content)
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content", f"must be text, got {str(content)[:80]!r}")
        extra = set(msg) - {"role", "content", "name"}
        if extra:
            raise bad(f"messages[{i}]", f"field(s) {', '.join(sorted(extra))} are not supported (role, content, name)")
        if "name" in msg and not isinstance(msg["name"], str):
            raise bad(f"messages[{i}].name", f"must be text, got {msg['name']!r}")
        out.append({"role": msg["role"], "content": content, **({"name": msg["name"]} if "name" in msg else {})})
    return out


# -- responses ------------------------------------------------------------------------------------------------
def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def finish_reason(generation) -> str:
    return "length" if generation.finish_reason == "length" else "stop"


def usage(generation) -> dict[str, Any]:
    s = generation.stats
    prompt, completion = len(generation.prompt_token_ids), len(generation.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "speculative": {"speculator": s.speculator, "rounds": s.rounds, "drafts": _drafts(s),
                            "draft_tokens": s.drafted, "accepted_tokens": s.accepted,
                            "acceptance_rate": round(s.acceptance_rate, 4),
                            "accepted_per_position": list(s.accepted_per_position),
                            "drafted_per_position": list(s.drafted_per_position),
                            "tokens_per_round": round(s.tokens_per_round, 4)}}


def _drafts(stats) -> int:
    """Rounds that drafted at least one token (vLLM's num_drafts)."""
    return stats.drafted_per_position[0] if stats.drafted_per_position else 0


def response(req: Request, rid: str, model: str, generation) -> dict[str, Any]:
    common = {"id": rid, "created": int(time.time()), "model": model, "usage": usage(generation)}
    reason = finish_reason(generation)
    if req.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": generation.text}, "logprobs": None,
                  "finish_reason": reason}
        return {**common, "object": "chat.completion", "choices": [choice]}
    choice = {"index": 0, "text": generation.text, "logprobs": None, "finish_reason": reason}
    return {**common, "object": "text_completion", "choices": [choice]}


def chunk(req: Request, rid: str, model: str, created: int, text: str | None = None, reason: str | None = None,
          role: bool = False) -> dict[str, Any]:
    if req.chat:
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}
    choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def usage_chunk(req: Request, rid: str, model: str, created: int, generation) -> dict[str, Any]:
    obj = "chat.completion.chunk" if req.chat else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage(generation)}
