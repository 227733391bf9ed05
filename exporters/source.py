"""Find the model to export: a local directory or a hub id (offline: fail fast)."""
from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path

from rlxrt.errors import ExportError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5")


def _looks_like_path(src: str) -> bool:
    return src.startswith(("/", "./", "../", "~", ".\\")) or os.sep in src and src.count("/") != 1


def _hub_reachable(timeout: float = 3.0) -> bool:
    try:
        with socket.create_connection(("huggingface.co", 443), timeout=timeout):
            return True
    except OSError:
        return False


def resolve_source(src: str | os.PathLike) -> Path:
    """A local directory for ``src``: itself, a cached hub snapshot, or a fresh download."""
    path = Path(src).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ExportError(f"source {str(src)!r} is a file; pass the Hugging Face model directory that holds it")
        if not (path / "config.json").is_file():
            raise ExportError(
                f"source directory {str(src)!r} has no config.json; pass a Hugging Face model directory "
                "(one saved with `save_pretrained`)"
            )
        return path
    src = str(src)
    if _looks_like_path(src):
        raise ExportError(f"source directory {src!r} does not exist; pass a Hugging Face model directory")
    alternative = (f"download it on a machine with access (`huggingface-cli download {src} --local-dir DIR`) "
                   f"and pass the local directory: rlxrt export DIR OUT")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ExportError(f"{src!r} is not a local directory and huggingface_hub is missing; {alternative}") from None
    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"]
    try:
        return Path(snapshot_download(src, local_files_only=True, allow_patterns=patterns))
    except Exception:
        pass
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false") or not _hub_reachable():
        raise ExportError(f"{src!r} is not a local directory and the Hugging Face hub cannot be reached "
                          f"(offline); {alternative}")
    try:
        return Path(snapshot_download(src, allow_patterns=patterns))
    except Exception as exc:
        raise ExportError(f"downloading {src!r} from the hub failed ({exc}); {alternative}") from None


def read_config(path: Path, name: str = "config.json") -> dict:
    try:
        data = json.loads((path / name).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ExportError(f"{str(path / name)!r} is not valid JSON ({exc}); fix or re-save the model") from None
    if not isinstance(data, dict):
        raise ExportError(f"{str(path / name)!r} holds a {type(data).__name__}, not a JSON object")
    return data


def recorded_name(src: str | os.PathLike) -> str:
    """What a manifest records of ``src``: a local directory's own name (``target``, never an absolute path
    of the machine that built the export) or a hub id as given."""
    text = str(src)
    path = Path(text).expanduser()
    if path.exists() or _looks_like_path(text):
        return Path(os.path.abspath(path)).name
    return text


def weights_hash(path: Path) -> str:
    files = sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    if not files:
        raise ExportError(f"no weight files (*.safetensors, *.bin) in {str(path)!r}; save the model with its weights")
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()
