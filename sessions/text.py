"""The tokenizer of an exported model (``tokenizers`` only, no transformers), read once per file and shared by
every Session of the model (``codec_for``)."""
from __future__ import annotations

import os
import threading
from functools import cached_property
from pathlib import Path

from rlxrt.errors import ModelFormatError
from rlxrt.files import decode, read_model_file
from rlxrt.limits import MAX_TOKENIZER_BYTES


class TextCodec:
    def __init__(self, directory: Path, name: str):
        """The tokenizer file ``name`` of the model directory ``directory`` (read within the directory's box,
        ``files.read_model_file``)."""
        from tokenizers import Tokenizer

        path = Path(directory) / name
        text = decode(read_model_file(directory, name, "tokenizer", MAX_TOKENIZER_BYTES), path, "tokenizer",
                      ModelFormatError)
        try:
            self.tokenizer = Tokenizer.from_str(text)
        except Exception as exc:
            raise ModelFormatError(f"cannot read tokenizer {str(path)!r}: {exc}; re-export the model") from None
        self.path = path
        self._vocab: dict[str, int] | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens=False`` for text that already holds them (a rendered
        chat template writes its own BOS)."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def decoder(self):
        """A per-request ``step(token_id) -> str | None`` that never splits a multi-byte character."""
        from tokenizers.decoders import DecodeStream

        stream = DecodeStream(skip_special_tokens=True)
        tok = self.tokenizer
        return lambda token_id: stream.step(tok, int(token_id))

    def vocab(self) -> dict[str, int]:
        """Token string -> id, added tokens included (made once; read it, do not change it)."""
        if self._vocab is None:
            self._vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        return self._vocab

    @cached_property
    def max_token_bytes(self) -> int:
        """Bytes of UTF-8 the longest token stands for, at most: its own string's (a byte-level token writes a
        byte as one character, SentencePiece a space as the 3-byte ``▁``, WordPiece adds ``##``)."""
        return max((len(t.encode("utf-8", "surrogatepass")) for t in self.vocab()), default=1)

    def max_text_bytes(self, positions: int) -> int:
        """A text of more UTF-8 bytes than this cannot fit in ``positions`` tokens (twice the bound that holds
        for a tokenizer whose decode gives its text back, for normalisers that drop characters)."""
        return 2 * positions * self.max_token_bytes


CODECS_KEPT = 8
"""Tokenizer files whose codec ``codec_for`` keeps (the last ones read)."""
_codecs: dict[tuple, TextCodec] = {}
_codecs_lock = threading.Lock()


def codec_for(graph) -> TextCodec | None:
    """The codec of ``graph``'s model, one for every Session of it (docs/design.md, "Threading"): kept by the
    tokenizer file's path, size, modification time and inode (its own, not a link's target's), so a re-exported
    or replaced file is read again, through the directory's box (``files.read_model_file``). A codec holds no
    per-request state, and its tokenizer is only read."""
    m = graph.manifest
    if m is None or not m.tokenizer:
        return None
    directory = Path(graph.path).parent
    path = directory / m.tokenizer
    try:
        st = os.lstat(path)
        key: tuple | None = (str(path.absolute()), st.st_size, st.st_mtime_ns, st.st_ino)
    except OSError:  # TextCodec says what is wrong
        key = None
    with _codecs_lock:
        codec = _codecs.get(key) if key is not None else None
    if codec is None:
        codec = TextCodec(directory, m.tokenizer)
        if key is not None:
            with _codecs_lock:
                _codecs[key] = codec
                while len(_codecs) > CODECS_KEPT:
                    del _codecs[next(iter(_codecs))]
    return codec
