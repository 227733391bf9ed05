"""Chat templates: an instruct model's messages rendered to its prompt text, as transformers'
``apply_chat_template`` renders them (Jinja in an immutable sandbox, ``trim_blocks``/``lstrip_blocks``, the
``loopcontrols`` extension, ``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII text, and
``{% generation %}…{% endgeneration %}`` blocks, which mark the assistant's text for training masks and
render their body unchanged)."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

from rlxrt.errors import GenerationError, ModelFormatError
from rlxrt.files import read_text
from rlxrt.limits import MAX_CHAT_MESSAGES

NO_TEMPLATE = ("this model has no chat template (its export kept none: the source had no chat_template); "
               "send a plain prompt instead (Session.generate, `rlxrt generate` without --chat, /v1/completions)")


class ChatTemplate:
    def __init__(self, directory: Path, record: dict[str, Any]):
        source = read_text(directory / record["template"], "the chat template", ModelFormatError)
        try:
            import jinja2
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:  # pragma: no cover - jinja2 is a dependency
            raise ModelFormatError("chat templates need jinja2: pip install jinja2") from None
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols, _generation_block(jinja2)])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ModelFormatError(f"the chat template {str(directory / record['template'])!r} does not parse: "
                                   f"{exc}; re-export the model or fix the template") from None
        self.special = {"bos_token": record.get("bos_token") or "", "eos_token": record.get("eos_token") or ""}
        self.end_of_turn_ids = tuple(record.get("end_of_turn_ids", ()))
        """Tokens that end a reply (the model's EOS ids and the end-of-turn token)."""

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text of ``messages`` (a list of {"role": ..., "content": ...}), ending with the assistant's
        turn opener when ``add_generation_prompt``."""
        checked = check_messages(messages)
        try:
            return self.template.render(messages=checked, tools=None, documents=None,
                                        add_generation_prompt=bool(add_generation_prompt), **self.special)
        except GenerationError:
            raise
        except Exception as exc:  # jinja2.TemplateError, or a TypeError inside the template's own code
            raise GenerationError(f"the model's chat template refused these messages: {type(exc).__name__}: "
                                  f"{exc}") from None


def check_messages(messages) -> list[dict[str, str]]:
    """Messages as a list of {"role": str, "content": str}; a GenerationError names the first bad one."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise GenerationError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got "
                              f"{type(messages).__name__}")
    if not messages:
        raise GenerationError("messages is empty; pass at least one {'role': 'user', 'content': ...}")
    if len(messages) > MAX_CHAT_MESSAGES:
        raise GenerationError(f"{len(messages)} messages given; at most {MAX_CHAT_MESSAGES} are allowed")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise GenerationError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise GenerationError(f"messages[{i}]['role'] must be a non-empty string (system, user, assistant), "
                                  f"got {role!r}")
        if not isinstance(content, str):
            raise GenerationError(f"messages[{i}]['content'] must be text, got {type(content).__name__}")
        out.append({**m, "role": role, "content": content})
    return out


def chat_template_for(graph) -> ChatTemplate | None:
    m = graph.manifest
    if m is None or not m.chat:
        return None
    return ChatTemplate(Path(graph.path).parent, m.chat)


def _generation_block(jinja2):
    """The ``{% generation %}`` tag: its body rendered as is (transformers tracks its span; a prompt needs none)."""

    class GenerationBlock(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    return GenerationBlock


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str):
    raise GenerationError(f"the model's chat template refused these messages: {message}")
