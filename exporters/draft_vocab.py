"""A draft-only export's vocabulary (``rlxrt export --draft-vocab N --vocab-corpus PATH...``).

A small draft spends most of its step on its LM head (the shipped draft: 4096 × 128 of its 0.74M weights),
and its step is bound by reading those weights. Keeping only the N tokens a corpus uses most (as FR-Spec
does) shrinks that read V/N times; the draft then proposes only those tokens, its distribution is zero
elsewhere, and the acceptance rule keeps the target's output exact whatever the draft proposes. The end of
generation tokens are always kept, so the draft can propose the end of a reply.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from rlxrt.errors import ExportError

FILE = "draft_vocab.json"


def frequent_ids(tokenizer: Path, texts: list[str], n: int, vocab_size: int, keep: tuple[int, ...] = ()
                 ) -> tuple[np.ndarray, dict]:
    """The ``n`` token ids ``texts`` use most (ascending; ties to the lower id; ``keep`` always in) and the
    manifest's ``draft_vocab`` record."""
    if not 0 < n < vocab_size:
        raise ExportError(f"--draft-vocab {n} must be between 1 and {vocab_size - 1} (the vocabulary has "
                          f"{vocab_size} tokens); leave it out to keep the whole vocabulary")
    keep = tuple(sorted({int(k) for k in keep if 0 <= int(k) < vocab_size}))
    if n <= len(keep):
        raise ExportError(f"--draft-vocab {n} leaves no room beside the {len(keep)} end-of-generation token(s) "
                          f"{list(keep)} it always keeps; pass a larger N")
    if not tokenizer.is_file():
        raise ExportError("--draft-vocab counts the corpus's tokens with the model's tokenizer.json, and this "
                          "source has none; export a model that ships one")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    counts = np.zeros(vocab_size, np.int64)
    for start in range(0, len(texts), 256):
        for enc in tok.encode_batch(texts[start:start + 256], add_special_tokens=False):
            ids = np.asarray(enc.ids, np.int64)
            counts += np.bincount(ids[ids < vocab_size], minlength=vocab_size)
    total = int(counts.sum())
    if total == 0:
        raise ExportError("--vocab-corpus holds no tokens; pass text like what the model will write")
    order = np.argsort(-counts, kind="stable")
    rest = order[~np.isin(order, keep)][:n - len(keep)]
    ids = np.sort(np.concatenate([np.asarray(keep, np.int64), rest]))
    record = {"size": n, "ids": FILE, "corpus_tokens": total,
              "corpus_coverage": round(float(counts[ids].sum()) / total, 4)}
    return ids, record
