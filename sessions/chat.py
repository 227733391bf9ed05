"""Chat templates: an instruct model's messages rendered to its prompt text, as transformers'
``apply_chat_template`` renders them (``template_worker.py`` says how), but in processes of their own under a
time and memory budget (``renderer.py``), so that a hostile or broken template costs a stopped process and a
typed error, never a hung or frozen caller."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from rlxrt.errors import GenerationError, ModelFormatError
from rlxrt.files import decode, read_model_file
from rlxrt.limits import MAX_CHAT_MESSAGES, MAX_TEMPLATE_BYTES, TEMPLATE_SECONDS

from .renderer import Renderer

NO_TEMPLATE = ("this model has no chat template (its export kept none: the source had no chat_template); "
               "send a plain prompt instead (Session.generate, `rlxrt generate` without --chat, /v1/completions)")


class ChatTemplate:
    def __init__(self, directory: Path, record: dict[str, Any], seconds: float = TEMPLATE_SECONDS):
        path = directory / record["template"]
        source = decode(read_model_file(directory, record["template"], "chat template", MAX_TEMPLATE_BYTES), path,
                        "chat template", ModelFormatError)
        special = {"bos_token": record.get("bos_token") or "", "eos_token": record.get("eos_token") or ""}
        self.renderer = Renderer(source, special, str(path), seconds)
        self.end_of_turn_ids = tuple(record.get("end_of_turn_ids", ()))
        """Tokens that end a reply (the model's EOS ids and the end-of-turn token)."""

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True, *, max_chars: int = 1 << 26,
               seconds: float | None = None) -> str:
        """The prompt text of ``messages`` (a list of {"role": ..., "content": ...}), ending with the assistant's
        turn opener when ``add_generation_prompt``; at most ``max_chars`` characters, within ``seconds`` (default
        the template's budget, ``TEMPLATE_SECONDS``)."""
        return self.renderer.render(check_messages(messages), bool(add_generation_prompt), max_chars, seconds)


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
