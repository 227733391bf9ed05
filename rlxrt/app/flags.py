"""What the CLI's commands share: their config from flags, JSON output, and the shipped defaults behind the
model and prompt flags (one module, so that no command imports another's private names)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rlxrt.errors import InputError, UsageError
from rlxrt.files import read_json, read_text


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def config_of(args: argparse.Namespace, **defaults: Any):
    """The config of a command: its flags > environment > TOML file > ``defaults`` > built-in defaults."""
    from rlxrt.config import load_config

    return load_config(getattr(args, "config", None), providers=getattr(args, "providers", None),
                       strict=True if getattr(args, "strict", False) else None,
                       intra_op_threads=getattr(args, "threads", None), defaults=defaults)


def head_dir(head: str | None, target: str | None):
    """--head, or the shipped MTP head when the target is the shipped one."""
    from pathlib import Path

    from .reference import reference_head, reference_pair

    if head:
        return Path(head)
    shipped = reference_head()
    if shipped is not None and (target is None or Path(target).resolve() == reference_pair()[0].resolve()):
        return shipped
    raise UsageError("--speculator mtp needs --head DIR (an MTP head trained for this target); only the "
                     "shipped reference target comes with one")


def pair_of(args: argparse.Namespace, draft_optional: bool = False, config=None):
    """(target, draft) from --target/--draft, else the shipped reference pair (its float16 graphs where
    ``config`` runs on a GPU); ``draft_optional``: a target alone is fine (draft None)."""
    from pathlib import Path

    from .reference import reference_pair

    if args.target and (args.draft or draft_optional):
        return Path(args.target), Path(args.draft) if args.draft else None
    if args.target or args.draft:
        need = "--target (and --draft if you have one)" if draft_optional else "both --target and --draft"
        raise UsageError(f"pass {need}, or neither (to use the shipped reference pair)")
    return reference_pair(config)


def prompts_of(args: argparse.Namespace, n: int) -> list[str]:
    """The prompts of --prompt-file (a text file: one prompt; a .json file: a list of strings or of
    {"prompt": text}), else the shipped held-out prompts; the first ``n``."""
    from .reference import reference_prompts

    path = getattr(args, "prompt_file", None)
    if not path:
        prompts = reference_prompts()
    elif path.endswith(".json"):
        data = read_json(path, "--prompt-file")
        if not isinstance(data, list):
            raise InputError(f"--prompt-file {path!r} must hold a JSON list of prompts, got {type(data).__name__}")
        prompts = []
        for i, p in enumerate(data):
            text = p.get("prompt") if isinstance(p, dict) else p
            if not isinstance(text, str) or not text:
                raise InputError(f"--prompt-file {path!r}: entry {i} must be a non-empty string or "
                                 f'{{"prompt": text}}, got {p!r}')
            prompts.append(text)
    else:
        prompts = [read_text(path, "--prompt-file")]
    if not prompts or not prompts[0]:
        raise InputError("no prompts: pass --prompt-file (a non-empty text file, or a JSON list of strings)")
    return prompts[:n]
