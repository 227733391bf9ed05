"""Reading the files a user names (prompts, prompt lists, config files) and the files a model directory
names (manifest, graph, weights, tokenizer, template, id lists): every OS or decoding failure becomes an
``RlxrtError`` that names the file and the fix, never a traceback, and nothing is read without a bound.

A model directory is a closed box: a file it names must resolve, after symbolic links, to a regular file
inside the directory (``model_file``), so that no manifest, graph or template can make rlxrt read a file
elsewhere on the machine, block on a FIFO or read a device without end.
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from .errors import InputError, ModelFormatError, RlxrtError
from .limits import MAX_USER_FILE_BYTES


def read_bytes(path: str | os.PathLike, what: str, error: type[RlxrtError] = InputError,
               limit: int = MAX_USER_FILE_BYTES) -> bytes:
    """The bytes of ``path``, at most ``limit`` of them (more is an error); ``what`` names it in errors (e.g.
    ``"--prompt-file"``). A pipe is read too (``/dev/stdin``), never past the limit."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise error(f"{what} {str(path)!r} does not exist; pass an existing file") from None
    except IsADirectoryError:
        raise error(f"{what} {str(path)!r} is a directory; pass a file") from None
    except PermissionError:
        raise error(f"{what} {str(path)!r} is not readable (permission denied); fix its permissions") from None
    except OSError as exc:
        raise error(f"cannot read {what} {str(path)!r}: {exc.strerror or exc}") from None
    try:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise error(f"{what} {str(path)!r} is a directory; pass a file")
        return _read_fd(fd, path, what, error, limit)
    finally:
        os.close(fd)


def _read_fd(fd: int, path, what: str, error: type[RlxrtError], limit: int) -> bytes:
    size = os.fstat(fd).st_size
    if size > limit:
        raise error(f"{what} {str(path)!r} has {size} bytes, more than the {limit} allowed; pass a smaller file")
    chunks, total = [], 0
    try:
        while chunk := os.read(fd, min(1 << 20, limit + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise error(f"{what} {str(path)!r} holds more than the {limit} bytes allowed; pass a smaller file")
    except OSError as exc:
        raise error(f"cannot read {what} {str(path)!r}: {exc.strerror or exc}") from None
    return b"".join(chunks)


def decode(data: bytes, path, what: str, error: type[RlxrtError]) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{what} {str(path)!r} is not UTF-8 text (byte {exc.start}: {data[exc.start:exc.start + 1]!r}); "
                    "save it as UTF-8") from None


def read_text(path: str | os.PathLike, what: str, error: type[RlxrtError] = InputError,
              limit: int = MAX_USER_FILE_BYTES) -> str:
    """The UTF-8 text of ``path`` (at most ``limit`` bytes); ``what`` names it in errors."""
    return decode(read_bytes(path, what, error, limit), path, what, error)


def parse_json(text: str | bytes, what: str, error: type[RlxrtError] = InputError) -> Any:
    """``text`` parsed as JSON; malformed or absurdly deep JSON is ``error`` naming ``what``."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{what} is not valid JSON ({exc}); fix the file") from None
    except RecursionError:
        raise error(f"{what} nests its JSON arrays or objects too deeply to read; fix the file") from None


def read_json(path: str | os.PathLike, what: str, error: type[RlxrtError] = InputError,
              limit: int = MAX_USER_FILE_BYTES) -> Any:
    return parse_json(read_text(path, what, error, limit), f"{what} {str(path)!r}", error)


def model_file(directory: str | os.PathLike, name: str, what: str) -> Path:
    """The file ``name`` (as a model directory's manifest or graph gives it) inside ``directory``, checked: a
    relative path that resolves, after symbolic links, to a regular file inside the directory; otherwise a
    ModelFormatError names the file and why."""
    root = Path(directory).resolve()
    where = f"{what} {name!r} of model directory {str(directory)!r}"
    if not isinstance(name, str) or not name or "\0" in name or os.path.isabs(name) \
            or Path(name).drive or ".." in Path(name).parts:
        raise ModelFormatError(f"{where} is not a relative path inside the directory; a model directory may only "
                               "name its own files: re-export the model")
    try:
        path = (root / name).resolve(strict=True)
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ModelFormatError(f"{where} is missing; re-export the model or copy the file back") from None
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symbolic link loop
        raise ModelFormatError(f"cannot read {where}: {getattr(exc, 'strerror', None) or exc}") from None
    if path != root and root not in path.parents:
        raise ModelFormatError(f"{where} resolves to {str(path)!r}, outside the directory (a symbolic link); a "
                               "model directory may only name its own files: copy the file into it")
    if not stat.S_ISREG(mode):
        raise ModelFormatError(f"{where} is not a regular file (a directory, FIFO, socket or device); put the "
                               "real file there")
    return path


def read_model_file(directory: str | os.PathLike, name: str, what: str, limit: int) -> bytes:
    """The bytes of the model directory's file ``name`` (``model_file``), at most ``limit`` of them. The file
    is opened without blocking and checked again once open, so a FIFO swapped in meanwhile is refused too."""
    path = model_file(directory, name, what)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise ModelFormatError(f"cannot read {what} {str(path)!r}: {exc.strerror or exc}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ModelFormatError(f"{what} {str(path)!r} is not a regular file; put the real file there")
        return _read_fd(fd, path, what, ModelFormatError, limit)
    finally:
        os.close(fd)
