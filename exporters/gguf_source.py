"""GGUF sources: ``rlxrt export model.gguf OUT`` (or a directory holding one .gguf and no config.json).

The GGUF is dequantised through transformers' GGUF loader into a Hugging Face directory inside the export's
work directory, which is then exported as usual. Two things the loader gets wrong are set from the GGUF's own
metadata: whether the tokenizer adds a BOS token (``tokenizer.ggml.add_bos_token``; the converter always
adds one) and the EOS token's string (the converter writes the BOS token's). The manifest records the GGUF
file's name and its sha256.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from rlxrt.errors import ExportError, MissingDependencyError


def gguf_file(src: str | os.PathLike) -> Path | None:
    """The GGUF file ``src`` names (the file itself, or the only .gguf in a directory without config.json),
    else None."""
    path = Path(src).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        found = sorted(path.glob("*.gguf"))
        if len(found) > 1:
            raise ExportError(f"{str(src)!r} holds {len(found)} GGUF files ({', '.join(f.name for f in found[:4])}); "
                              "pass the one to export: rlxrt export DIR/NAME.gguf OUT")
        return found[0] if found else None
    return None


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def metadata(path: Path) -> dict:
    """The GGUF's tokenizer facts rlxrt needs: tokens by id, bos/eos ids, add_bos_token (None if absent)."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise MissingDependencyError("exporting a GGUF needs the gguf package: pip install 'rlxrt[export]'") from None
    try:
        reader = GGUFReader(str(path))
    except Exception as exc:
        raise ExportError(f"{str(path)!r} is not a readable GGUF file ({type(exc).__name__}: {exc})") from None

    def scalar(name):
        field = reader.get_field(name)
        return None if field is None else field.contents()

    check_shapes(reader, scalar, path)
    return {"architecture": scalar("general.architecture"),
            "add_bos_token": scalar("tokenizer.ggml.add_bos_token"),
            "bos_token_id": scalar("tokenizer.ggml.bos_token_id"),
            "eos_token_id": scalar("tokenizer.ggml.eos_token_id"), "tokens": scalar("tokenizer.ggml.tokens"),
            "eot_token_id": scalar("tokenizer.ggml.eot_token_id")}


def check_shapes(reader, scalar, path: Path) -> None:
    """The model the metadata describes is the one the file holds, checked before transformers builds a model
    from the metadata (a 468 KB file claiming 64 blocks of 8192 would otherwise allocate gigabytes): every
    block the metadata counts has tensors, and the embedding's width and rows and the MLP's width are the
    metadata's. (Each tensor's bytes lying inside the file was checked when the reader opened it.)"""
    arch = scalar("general.architecture")
    tensors = {t.name: t for t in reader.tensors}
    lie = f"{path.name!r} is damaged or its metadata does not describe its tensors"

    def claim(key):
        value = scalar(f"{arch}.{key}") if arch else None
        return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value

    blocks = claim("block_count")
    held = {int(n.split(".")[1]) for n in tensors if n.startswith("blk.") and n.split(".")[1].isdigit()}
    if isinstance(blocks, int) and (blocks > len(held) or any(i not in held for i in range(blocks))):
        raise ExportError(f"{lie}: {arch}.block_count says {blocks!r} blocks, the file holds tensors of "
                          f"{len(held)}")
    embedding, up = tensors.get("token_embd.weight"), tensors.get("blk.0.ffn_up.weight")
    tokens = scalar("tokenizer.ggml.tokens")
    checks = [("embedding_length", claim("embedding_length"), embedding, 0),
              ("feed_forward_length", claim("feed_forward_length"), up, 1),
              ("vocab_size", claim("vocab_size"), embedding, 1),
              ("tokenizer.ggml.tokens", len(tokens) if tokens is not None else None, embedding, 1)]
    for key, said, tensor, axis in checks:
        if isinstance(said, int) and tensor is not None and said != int(tensor.shape[axis]):
            raise ExportError(f"{lie}: {key} says {said!r}, {tensor.name} has {int(tensor.shape[axis])}")


def dequantise(path: Path, out: Path, torch, transformers) -> dict:
    """Write the Hugging Face directory of the GGUF ``path`` into ``out`` (fp32 safetensors, tokenizer with the
    GGUF's BOS behaviour and special tokens); returns the ``source`` fields to record."""
    meta = metadata(path)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                  dtype=torch.float32)
        tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:
        raise ExportError(f"transformers cannot load the GGUF {path.name!r} ({type(exc).__name__}: {exc}); "
                          f"its architecture is {meta['architecture']!r}") from None
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    del model
    _fix_tokenizer(out, meta)
    _end_tokens(out, meta)
    return {"path_or_id": path.name, "gguf_sha256": sha256(path)}


def _end_tokens(out: Path, meta: dict) -> None:
    """generation_config.json's eos_token_id: the GGUF's EOS and its end-of-turn token (``eot_token_id``,
    e.g. Gemma's <end_of_turn>), both of which end a generation in llama.cpp."""
    ids = [i for i in (meta["eos_token_id"], meta["eot_token_id"]) if i is not None]
    if not ids:
        return
    path = out / "generation_config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    config["eos_token_id"] = list(dict.fromkeys(int(i) for i in ids))
    path.write_text(json.dumps(config, indent=2), encoding="utf-8")


def _fix_tokenizer(out: Path, meta: dict) -> None:
    from tokenizers import Tokenizer, processors

    tokens, bos_id, eos_id = meta["tokens"], meta["bos_token_id"], meta["eos_token_id"]
    bos = tokens[bos_id] if tokens is not None and bos_id is not None else None
    eos = tokens[eos_id] if tokens is not None and eos_id is not None else None
    add_bos = bool(meta["add_bos_token"]) if meta["add_bos_token"] is not None else bos is not None
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    if add_bos and bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, bos_id)])
    else:
        tok.post_processor = None
    tok.save(str(out / "tokenizer.json"))
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    config.update({"add_bos_token": add_bos, **({"bos_token": bos} if bos else {}),
                   **({"eos_token": eos} if eos else {})})
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
    special = out / "special_tokens_map.json"
    if special.is_file():
        data = json.loads(special.read_text(encoding="utf-8"))
        data.update({**({"bos_token": bos} if bos else {}), **({"eos_token": eos} if eos else {})})
        special.write_text(json.dumps(data, indent=2, ensure_ascii=False), encoding="utf-8")
