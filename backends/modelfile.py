"""Find, check and hash an ONNX model on disk (external data included)."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from rlxrt.errors import ModelFormatError
from rlxrt.manifest import MANIFEST_NAME, Manifest

DEFAULT_GRAPH = "model.onnx"


def locate(model: str | os.PathLike) -> tuple[Path, Manifest | None]:
    """Path of the ONNX graph and the manifest, for a .onnx file or a model directory."""
    path = Path(model)
    if not path.exists():
        raise ModelFormatError(
            f"model path does not exist: {str(model)!r}; pass an .onnx file or a directory made by `rlxrt export`"
        )
    if path.is_dir():
        if (path / MANIFEST_NAME).is_file():
            manifest = Manifest.load(path)
            graph = path / manifest.graph
            if not graph.is_file():
                raise ModelFormatError(
                    f"{str(path / MANIFEST_NAME)!r} names graph {manifest.graph!r}, which is missing; re-export the model"
                )
            return graph, manifest
        if (path / DEFAULT_GRAPH).is_file():
            return path / DEFAULT_GRAPH, None
        raise ModelFormatError(
            f"directory {str(model)!r} has neither {MANIFEST_NAME} nor {DEFAULT_GRAPH}; "
            "pass an .onnx file or a directory made by `rlxrt export`"
        )
    return path, None


def external_files(graph: Path):
    """Parse the graph (without its weights) and list the external-data files it needs.

    Returns (onnx ModelProto without external data, [paths]). A file that is
    not ONNX, or is truncated, raises ModelFormatError.
    """
    import onnx
    from google.protobuf.message import DecodeError

    try:
        proto = onnx.load(str(graph), load_external_data=False)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise ModelFormatError(
            f"{str(graph)!r} is not a readable ONNX model ({type(exc).__name__}: {exc}); "
            "the file may be truncated or not ONNX — re-export it or copy it again"
        ) from None
    except OSError as exc:
        raise ModelFormatError(f"cannot read {str(graph)!r}: {exc}") from None
    if not proto.graph.node or not proto.graph.output:
        raise ModelFormatError(
            f"{str(graph)!r} parsed as protobuf but holds no ONNX graph (no nodes or outputs); "
            "the file may be truncated or not ONNX"
        )
    locations: list[Path] = []
    for tensor in proto.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            for entry in tensor.external_data:
                if entry.key == "location":
                    p = graph.parent / entry.value
                    if p not in locations:
                        locations.append(p)
    for p in locations:
        if not p.is_file():
            raise ModelFormatError(
                f"{str(graph)!r} keeps weights in {str(p)!r}, which is missing; copy it next to the graph"
            )
    return proto, locations


def content_hash(files: list[Path], memo_dir: Path | None = None) -> str:
    """blake2b over the files' bytes; memoised in ``memo_dir`` by (path, size, mtime, ctime, inode).

    The ctime is in the key because a rewrite in place that restores size and mtime (``os.utime``) still
    moves it, and no user call can set it back: a changed file is hashed again, never served stale."""
    stat_key = None
    if memo_dir is not None:
        stats = []
        for f in files:
            st = f.stat()
            stats.append([str(f.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino])
        stat_key = hashlib.blake2b(json.dumps(stats).encode(), digest_size=16).hexdigest()
        memo = memo_dir / stat_key
        try:
            return memo.read_text().strip()
        except OSError:
            pass
    h = hashlib.blake2b(digest_size=20)
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
    digest = h.hexdigest()
    if memo_dir is not None and stat_key is not None:
        try:
            memo_dir.mkdir(parents=True, exist_ok=True)
            tmp = memo_dir / f".{stat_key}.{os.getpid()}"
            tmp.write_text(digest)
            os.replace(tmp, memo_dir / stat_key)
        except OSError:
            pass
    return digest
