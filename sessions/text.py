"""The tokenizer of an exported model (``tokenizers`` only, no transformers)."""
from __future__ import annotations

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
        return self.tokenizer.get_vocab(with_added_tokens=True)

    @cached_property
    def max_token_bytes(self) -> int:
        """Bytes of UTF-8 the longest token stands for, at most: its own string's (a byte-level token writes a
        byte as one character, SentencePiece a space as the 3-byte ``▁``, WordPiece adds ``##``)."""
        return max((len(t.encode("utf-8", "surrogatepass")) for t in self.vocab()), default=1)

    def max_text_bytes(self, positions: int) -> int:
        """A text of more UTF-8 bytes than this cannot fit in ``positions`` tokens (twice the bound that holds
        for a tokenizer whose decode gives its text back, for normalisers that drop characters)."""
        return 2 * positions * self.max_token_bytes


def codec_for(graph) -> TextCodec | None:
    m = graph.manifest
    if m is None or not m.tokenizer:
        return None
    return TextCodec(Path(graph.path).parent, m.tokenizer)
