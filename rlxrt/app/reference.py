"""The shipped reference pair (trained by exporters/reference), found inside the installed package with
``importlib.resources``, so editable and regular installs alike find it."""
from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from rlxrt.errors import ModelFormatError
from rlxrt.files import read_json

REFERENCE = Path(str(files("rlxrt") / "assets" / "reference"))


GPU_PROVIDERS = ("cuda", "tensorrt")
"""Providers whose fused graphs run in float16 (ONNX Runtime's CUDA GroupQueryAttention is fp16/bf16 only)."""


def reference_pair(config=None) -> tuple[Path, Path]:
    """The shipped target and draft; for a ``config`` whose first provider is a GPU, their float16 graphs, built
    from the shipped float32 ones on first use into the config's cache directory (seconds; the same weights,
    so the shipped head binds to them too)."""
    target, draft = REFERENCE / "target", REFERENCE / "draft"
    if not (target / "rlxrt.json").is_file() or not (draft / "rlxrt.json").is_file():
        raise ModelFormatError(
            f"the shipped reference pair is missing from {REFERENCE}; reinstall rlxrt, or pass "
            "--target/--draft model directories"
        )
    if config is None or not config.providers or config.providers[0] not in GPU_PROVIDERS:
        return target, draft
    return _float16(target, config), _float16(draft, config)


def _float16(model: Path, config) -> Path:
    import sys

    from rlxrt import __version__
    from rlxrt.exporters.fused_weights import rebuild

    out = Path(config.cache_dir) / f"reference-float16-{__version__}" / model.name
    if not (out / "rlxrt.json").is_file():
        print(f"rlxrt: building the shipped {model.name}'s float16 graph for {config.providers[0]} in {out} (once)",
              file=sys.stderr, flush=True)
        rebuild(model, out, "float16")
    return out


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
