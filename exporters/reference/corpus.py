"""Corpus: the stdlib ``*.py`` sources (tests and site-packages excluded), split by file; a byte-level BPE.

The split is deterministic: a file is held out when the first byte of the
sha256 of its path relative to the stdlib root is below 13 (~5 %).
"""
from __future__ import annotations

import hashlib
import json
import sys
import sysconfig
from pathlib import Path

import numpy as np

EOS = "<|endoftext|>"
VOCAB_SIZE = 4096
EXCLUDE = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib2to3"}


def stdlib_files() -> list[tuple[str, Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if EXCLUDE & set(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        out.append((rel.as_posix(), p))
    return out


# Generated data, not code: a documentation dump and codec tables. Kept in training (they are stdlib
# sources), left out of the held-out *evaluation* so that it measures code completion.
NOT_CODE_PREFIXES = ("pydoc_data/", "encodings/cp", "encodings/mac_", "encodings/iso8859", "encodings/koi8",
                     "encodings/hp_", "encodings/kz", "encodings/ptcp", "encodings/tis_", "encodings/palmos")


def is_code(rel: str) -> bool:
    return not rel.startswith(NOT_CODE_PREFIXES)


def evaluation_files() -> list[tuple[str, Path]]:
    """Held-out files that are code: what held-out losses, prompts and benchmarks use."""
    return [(rel, p) for rel, p in stdlib_files() if is_held_out(rel) and is_code(rel)]


def is_held_out(rel: str) -> bool:
    return hashlib.sha256(rel.encode()).digest()[0] < 13


def split() -> tuple[list[str], list[str], list[str]]:
    """(train texts, held-out texts, held-out relative paths)."""
    train, held, held_names = [], [], []
    for rel, p in stdlib_files():
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if is_held_out(rel):
            held.append(text)
            held_names.append(rel)
        else:
            train.append(text)
    return train, held, held_names


def train_tokenizer(texts: list[str], out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[EOS], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOS, "eos_token": EOS,
        "unk_token": None, "model_max_length": 1024, "clean_up_tokenization_spaces": False}, indent=1))
    return tok


def encode(tok, texts: list[str]) -> np.ndarray:
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.uint16)


def main(work: str) -> None:
    work_dir = Path(work)
    train, held, held_names = split()
    tok = train_tokenizer(train, work_dir / "tokenizer")
    np.save(work_dir / "train.npy", encode(tok, train))
    np.save(work_dir / "heldout.npy", encode(tok, held))
    (work_dir / "heldout_files.json").write_text(json.dumps(held_names, indent=0))
    print(f"{len(train)} train files, {len(held)} held-out; tokens: "
          f"{len(np.load(work_dir / 'train.npy'))} train, {len(np.load(work_dir / 'heldout.npy'))} held-out")


if __name__ == "__main__":
    main(sys.argv[1])
