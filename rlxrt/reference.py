"""The shipped reference pair (trained by exporters/reference), located inside the installed package."""
from __future__ import annotations

import json
from pathlib import Path

from .errors import ModelFormatError

REFERENCE = Path(__file__).resolve().parent / "assets" / "reference"


def reference_pair() -> tuple[Path, Path]:
    target, draft = REFERENCE / "target", REFERENCE / "draft"
    if not (target / "rlxrt.json").is_file() or not (draft / "rlxrt.json").is_file():
        raise ModelFormatError(
            f"the shipped reference pair is missing from {REFERENCE}; reinstall rlxrt, or pass "
            "--target/--draft model directories"
        )
    return target, draft


def reference_head() -> Path | None:
    """The MTP head trained for the shipped target (None if this install lacks it)."""
    head = REFERENCE / "mtp"
    return head if (head / "rlxrt.json").is_file() else None


def reference_prompts() -> list[str]:
    path = REFERENCE / "prompts.json"
    if not path.is_file():
        return []
    return [p["prompt"] for p in json.loads(path.read_text())]
