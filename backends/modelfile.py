"""Find, check and hash an ONNX model on disk (external data included)."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from rlxrt.errors import ModelFormatError
from rlxrt.files import model_file
from rlxrt.limits import MAX_GRAPH_BYTES
from rlxrt.manifest import MANIFEST_NAME, Manifest

DEFAULT_GRAPH = "model.onnx"


def locate(model: str | os.PathLike) -> tuple[Path, Manifest | None]:
    """Path of the ONNX graph and the manifest, for a .onnx file or a model directory; the graph is a regular
    file inside the directory (``files.model_file``) of at most ``MAX_GRAPH_BYTES``."""
    path = Path(model)
    if not path.exists():
        raise ModelFormatError(
            f"model path does not exist: {str(model)!r}; pass an .onnx file or a directory made by `rlxrt export`"
        )
    manifest = None
    if path.is_dir():
        if os.path.lexists(path / MANIFEST_NAME):
            manifest = Manifest.load(path)
            graph = model_file(path, manifest.graph, "graph")
        elif os.path.lexists(path / DEFAULT_GRAPH):
            graph = model_file(path, DEFAULT_GRAPH, "graph")
        else:
            raise ModelFormatError(
                f"directory {str(model)!r} has neither {MANIFEST_NAME} nor {DEFAULT_GRAPH}; "
                "pass an .onnx file or a directory made by `rlxrt export`"
            )
    else:  # a file the user names: its own directory is the box its external data must stay in
        real = path.resolve()
        graph = model_file(real.parent, real.name, "graph")
    size = graph.stat().st_size
    if size > MAX_GRAPH_BYTES:
        raise ModelFormatError(f"graph {str(graph)!r} has {size} bytes, more than an ONNX file can hold "
                               f"({MAX_GRAPH_BYTES}); keep the weights in external data (re-export the model)")
    return graph, manifest


def external_files(graph: Path):
    """Parse the graph (without its weights) and list the external-data files it needs.

    Returns (onnx ModelProto without external data, [paths]). A file that is
    not ONNX, or is truncated, raises ModelFormatError.
    """
    import onnx
    from google.protobuf.message import DecodeError

    try:  # the binary format whatever the file's name (onnx would read a .json or .txt name as text)
        proto = onnx.load(str(graph), format="protobuf", load_external_data=False)
    except (DecodeError, RuntimeError, ValueError, TypeError) as exc:
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
            p = external_location(graph, tensor)
            if p not in locations:
                locations.append(p)
    return proto, locations


def external_location(graph: Path, tensor) -> Path:
    """The checked file of an external tensor of ``graph``: its location inside the graph's directory
    (``files.model_file``: no absolute path, no ``..``, no symbolic link leading out, a regular file), its
    offset and length within the file, as ONNX Runtime checks them."""
    info = {e.key: e.value for e in tensor.external_data}
    where = f"{str(graph)!r}: tensor {tensor.name!r}"
    if "location" not in info:
        raise ModelFormatError(f"{where} keeps its data externally but names no location; re-export the model")
    path = model_file(graph.parent, info["location"], f"external data of tensor {tensor.name!r}")
    try:
        offset, length = int(info.get("offset", 0)), int(info["length"]) if "length" in info else None
    except ValueError:
        raise ModelFormatError(f"{where}: offset/length {info.get('offset')!r}/{info.get('length')!r} are not "
                               "integers; re-export the model") from None
    size = path.stat().st_size
    if offset < 0 or offset > size or (length is not None and (length < 0 or offset + length > size)):
        raise ModelFormatError(f"{where} reads bytes {offset}..{offset + (length or 0)} of {str(path)!r}, which has "
                               f"{size}; the weights file is truncated or not this graph's: copy it again")
    return path


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
