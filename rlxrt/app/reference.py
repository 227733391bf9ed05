"""The shipped reference pair (trained by exporters/reference), found inside the installed package with
``importlib.resources``, so editable and regular installs alike find it."""
from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from rlxrt.errors import ModelFormatError
from rlxrt.files import read_json

REFERENCE = Path(str(files("rlxrt") / "assets" / "reference"))


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
    return [p["prompt"] for p in read_json(path, "the shipped prompts", ModelFormatError)]


def reference_weights() -> tuple[Path, Path] | None:
    """The Hugging Face weights of the shipped pair (for the transformers peers of ``rlxrt bench``): present
    in a source checkout only, not in the wheel."""
    weights = Path(str(files("rlxrt.exporters.reference") / "weights"))
    return (weights / "target", weights / "draft") if (weights / "target").is_dir() else None
