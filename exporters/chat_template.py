"""Keep an instruct model's chat template: ``chat_template.jinja`` in the model directory and the manifest's
``chat`` record (the template file, the special-token strings a template uses, the tokens that end a reply)."""
from __future__ import annotations

from pathlib import Path

from rlxrt.errors import ExportError
from rlxrt.files import read_json, read_text

TEMPLATE = "chat_template.jinja"


def find_template(src: Path) -> str | None:
    """The template of a Hugging Face model directory: ``chat_template.jinja`` (transformers >= 4.47 writes it
    there), else ``chat_template`` in ``tokenizer_config.json`` (a string, or a list of named templates of which
    ``default`` is used)."""
    if (src / TEMPLATE).is_file():
        return read_text(src / TEMPLATE, TEMPLATE, ExportError)
    config = _tokenizer_config(src)
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template.strip() else None


def save_chat(src: Path, dst: Path, eos_token_ids: tuple[int, ...]) -> dict | None:
    """Write the template next to the exported graph and return the manifest's ``chat`` record (None when
    the model has no template or the export has no tokenizer)."""
    template = find_template(src)
    if template is None or not (dst / "tokenizer.json").is_file():
        return None
    from tokenizers import Tokenizer

    config = _tokenizer_config(src)
    bos, eos = _token(config.get("bos_token")), _token(config.get("eos_token"))
    ends = list(eos_token_ids)
    eos_id = Tokenizer.from_file(str(dst / "tokenizer.json")).token_to_id(eos) if eos else None
    if eos_id is not None and eos_id not in ends:
        ends.append(int(eos_id))
    (dst / TEMPLATE).write_text(template, encoding="utf-8")
    return {"template": TEMPLATE, "bos_token": bos, "eos_token": eos, "end_of_turn_ids": ends}


def _tokenizer_config(src: Path) -> dict:
    path = src / "tokenizer_config.json"
    data = read_json(path, "tokenizer_config.json", ExportError) if path.is_file() else {}
    return data if isinstance(data, dict) else {}


def _token(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict with ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None
