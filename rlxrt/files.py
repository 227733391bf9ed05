"""Reading the files a user names (prompts, prompt lists, config files): every OS or decoding failure
becomes an ``RlxrtError`` that names the file and the fix, never a traceback."""
from __future__ import annotations

import json
import os
from typing import Any

from .errors import RlxrtError, UsageError


def read_text(path: str | os.PathLike, what: str, error: type[RlxrtError] = UsageError) -> str:
    """The UTF-8 text of ``path``; ``what`` names it in errors (e.g. ``"--prompt-file"``)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        raise error(f"{what} {str(path)!r} does not exist; pass an existing file") from None
    except IsADirectoryError:
        raise error(f"{what} {str(path)!r} is a directory; pass a file") from None
    except PermissionError:
        raise error(f"{what} {str(path)!r} is not readable (permission denied); fix its permissions") from None
    except OSError as exc:
        raise error(f"cannot read {what} {str(path)!r}: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{what} {str(path)!r} is not UTF-8 text (byte {exc.start}: {data[exc.start:exc.start + 1]!r}); "
                    "save it as UTF-8") from None


def read_json(path: str | os.PathLike, what: str, error: type[RlxrtError] = UsageError) -> Any:
    text = read_text(path, what, error)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{what} {str(path)!r} is not valid JSON ({exc}); fix the file") from None
