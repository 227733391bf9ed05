"""The tokenizer of an exported model (``tokenizers`` only, no transformers)."""
from __future__ import annotations

from pathlib import Path

from rlxrt.errors import ModelFormatError


class TextCodec:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        try:
            self.tokenizer = Tokenizer.from_file(str(path))
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


def codec_for(graph) -> TextCodec | None:
    m = graph.manifest
    if m is None or not m.tokenizer:
        return None
    return TextCodec(Path(graph.path).parent / m.tokenizer)
