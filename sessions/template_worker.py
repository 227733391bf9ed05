"""The chat-template renderer's own process: a model's Jinja template is compiled and rendered here, never in
the process that serves requests, so that a template that loops, exponentiates or builds a huge text costs
a process that ``chat.py`` kills at its deadline (and that runs under a memory limit) instead of a server
whose GIL it would hold.

Run as ``python -I -c <this file's text> MEMORY_BYTES`` (it imports nothing of rlxrt: only the standard
library and jinja2); one JSON request a line on stdin, one JSON reply a line on stdout:

    {"template": SOURCE, "special": {"bos_token": ..., "eos_token": ...}}  ->  {"ok": true}
    {"messages": [...], "add_generation_prompt": true, "max_chars": N}     ->  {"text": ...}
    any failure                                          ->  {"error": MESSAGE, "kind": "syntax" | "refused" | "limit"}

The environment is transformers' ``apply_chat_template`` one (an immutable sandbox, ``trim_blocks`` /
``lstrip_blocks``, ``loopcontrols``, ``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII
text, ``{% generation %}`` blocks rendered as is) with the operators that make numbers or texts grow
(``**``, ``*``, ``+``, ``%``) intercepted: a result past ``MAX_INT_BITS`` or ``MAX_TEXT`` is refused before it
is made (an intercepted operator is also never folded at compile time).
"""
import json
import math
import sys
from datetime import datetime

MAX_INT_BITS = 1 << 16
"""Bits of an integer a template may make with ``**`` or ``*``."""
MAX_TEXT = 1 << 26
"""Items of a text or list a template may make with ``*`` or ``+``."""


class Refused(Exception):
    """The template refused the messages (``raise_exception``) or asked for more than the limits allow."""


class Limit(Exception):
    """The render went past a limit (size of a number or text, the output's length)."""


def _bits(n: int) -> int:
    return abs(n).bit_length()


def _check_binop(operator: str, left, right) -> None:
    ints = isinstance(left, int) and isinstance(right, int)
    if operator == "**" and ints and right > 0 and abs(left) > 1 and right * math.log2(abs(left)) > MAX_INT_BITS:
        raise Limit(f"{left} ** {right} would have more than {MAX_INT_BITS} bits")
    if operator == "*" and ints and _bits(left) + _bits(right) > MAX_INT_BITS:
        raise Limit(f"a product of more than {MAX_INT_BITS} bits")
    if operator == "*" and not ints:
        seq, n = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(n, int) and isinstance(seq, (str, list, tuple)) and len(seq) * max(n, 0) > MAX_TEXT:
            raise Limit(f"repeating {len(seq)} items {n} times makes more than {MAX_TEXT}")
    if operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)) \
            and len(left) + len(right) > MAX_TEXT:
        raise Limit(f"a concatenation of more than {MAX_TEXT} items")


def make_environment():
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["**", "*", "+", "%"])

        def call_binop(self, context, operator, left, right):
            _check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}``: its body rendered as is (transformers tracks its span; a prompt needs none)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message):
        raise Refused(str(message))

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, GenerationBlock])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def render(template, special: dict, request: dict) -> str:
    """The template over the request's messages; the output stops being built past ``max_chars``."""
    limit, size, parts = int(request["max_chars"]), 0, []
    for piece in template.generate(messages=request["messages"], tools=None, documents=None,
                                   add_generation_prompt=bool(request["add_generation_prompt"]), **special):
        size += len(piece)
        if size > limit:
            raise Limit(f"the rendered prompt is longer than {limit} characters")
        parts.append(piece)
    return "".join(parts)


def answer(state: dict, line: bytes) -> dict:
    import jinja2

    try:
        request = json.loads(line)
        if "template" in request:
            state["template"] = make_environment().from_string(request["template"])
            state["special"] = dict(request.get("special") or {})
            return {"ok": True}
        return {"text": render(state["template"], state["special"], request)}
    except jinja2.TemplateSyntaxError as exc:
        return {"error": f"line {exc.lineno}: {exc.message}", "kind": "syntax"}
    except Refused as exc:
        return {"error": str(exc), "kind": "refused"}
    except MemoryError:
        return {"error": "MemoryError: it needed more than the renderer's memory", "kind": "limit"}
    except (Limit, RecursionError, OverflowError) as exc:
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}", "kind": "limit"}
    except Exception as exc:  # a TypeError or SecurityError inside the template's own code
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}", "kind": "refused"}


def main() -> None:
    memory = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    if memory:
        try:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        except (ImportError, ValueError, OSError):  # no such limit here (Windows): the deadline still holds
            pass
    state: dict = {}
    out = sys.stdout.buffer
    for line in sys.stdin.buffer:
        reply = answer(state, line)
        try:
            data = json.dumps(reply).encode("ascii")
        except MemoryError:
            data = b'{"error": "MemoryError: the reply does not fit in memory", "kind": "limit"}'
        out.write(data + b"\n")
        out.flush()


if __name__ == "__main__":
    main()
