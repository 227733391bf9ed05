"""The teacher pass of ``rlxrt train-head``: the target's own graph run over windows of the corpus, and a cache
of what it computed, so that ``--resume`` and a rerun with other training flags skip the target's pass.

The cache is one file, ``HEAD/.train/teacher.npz``, keyed by the target's manifest, the token streams and the
draft vocabulary: a run with the same key reuses all of it. It holds the hidden states as float16, about 2
bytes per hidden unit per token, plus the rows kept for the output-layer fit (743 MB for 500k training tokens
of SmolLM2, 576 wide, with its held-out windows). A run whose key differs (more text, another draft
vocabulary) still reuses every window whose tokens the cache holds, when it was made by the same target (its
``target`` digest): each window is run alone from an empty cache, so its outputs depend on its tokens only.
Only the new windows go through the target, and the cache is replaced by the new run's.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

WINDOW = 256
CACHE = "teacher.npz"


def teacher(model, stream: np.ndarray, windows: int, keep_logits_rows: int, vocab_ids: np.ndarray | None,
            known: dict | None = None):
    """Run the target over ``windows`` windows of WINDOW + 1 tokens of ``stream``: TeacherData, and (hidden,
    logits over the draft vocabulary) of the first ``keep_logits_rows`` positions for ``output_rows``.
    ``known`` (``known_windows``) gives the outputs of windows an earlier run computed: those are taken from
    it, except the ones whose logits the fit still needs."""
    from rlxrt.exporters.head_train import TeacherData

    T = WINDOW
    tokens = np.stack([stream[i * T:i * T + T + 1] for i in range(windows)]).astype(np.int64)
    hidden, lse, fit_h, fit_l = [], [], [], []
    known, fitted = known or {}, 0
    for w in tokens:
        done = known.get(w[:T].tobytes())
        if done is not None and fitted >= keep_logits_rows:
            hidden.append(done[0])
            lse.append(done[1])
            continue
        model.reset()
        logits = model.forward(w[:T]).astype(np.float64)
        top = logits.max(-1, keepdims=True)
        lse.append((top[:, 0] + np.log(np.exp(logits - top).sum(-1))).astype(np.float32))
        h = np.asarray(model.hidden, np.float32).reshape(T, -1)
        hidden.append(h.astype(np.float16))
        if fitted < keep_logits_rows:
            fitted += len(h)
            fit_h.append(h)
            fit_l.append(logits if vocab_ids is None else logits[:, vocab_ids])
    model.reset()
    fit = (np.concatenate(fit_h), np.concatenate(fit_l)) if fit_h else (None, None)
    return (TeacherData(tokens, np.stack(hidden), np.stack(lse)), *fit)


def cache_key(manifest_file: Path, stream: np.ndarray, held_stream: np.ndarray, vocab_ids: np.ndarray | None,
              keep_logits_rows: int) -> str:
    """What the teacher's outputs depend on: the target (its manifest), the tokens and the draft vocabulary."""
    h = hashlib.sha256()
    for part in (manifest_file.read_bytes(), stream.astype(np.int64).tobytes(), b"|",
                 held_stream.astype(np.int64).tobytes(), b"|",
                 b"full" if vocab_ids is None else vocab_ids.astype(np.int64).tobytes(),
                 f"|{WINDOW}|{keep_logits_rows}".encode()):
        h.update(part)
    return h.hexdigest()


def target_digest(manifest_file: Path) -> str:
    """Which target made a cache: the sha256 of its manifest (weights hash, graph, validation)."""
    return hashlib.sha256(manifest_file.read_bytes()).hexdigest()


def known_windows(directory: Path, target: str) -> dict:
    """{window tokens: (hidden float16 [WINDOW, H], lse [WINDOW])} of the cache in ``directory`` when the same
    ``target`` made it (empty otherwise, and for a cache written before it recorded its target)."""
    path = directory / CACHE
    if not path.is_file():
        return {}
    try:
        with np.load(path) as f:
            if "target" not in f.files or str(f["target"]) != target:
                return {}
            known = {}
            for prefix in ("", "held_"):
                tokens, hidden, lse = f[prefix + "tokens"], f[prefix + "hidden"], f[prefix + "lse"]
                for i in range(len(tokens)):
                    known[tokens[i, :WINDOW].tobytes()] = (hidden[i], lse[i])
            return known
    except (OSError, ValueError, KeyError):  # an unreadable cache is computed again
        return {}


def load(directory: Path, key: str):
    """(data, held, fit_h, fit_l) from the cache when its key is ``key``; None otherwise."""
    from rlxrt.exporters.head_train import TeacherData

    path = directory / CACHE
    if not path.is_file():
        return None
    try:
        with np.load(path) as f:
            if str(f["key"]) != key:
                return None
            return (TeacherData(f["tokens"], f["hidden"], f["lse"]),
                    TeacherData(f["held_tokens"], f["held_hidden"], f["held_lse"]), f["fit_h"], f["fit_l"])
    except (OSError, ValueError, KeyError):  # an unreadable cache is computed again
        return None


def save(directory: Path, key: str, target: str, data, held, fit_h: np.ndarray, fit_l: np.ndarray) -> None:
    """Write the cache (to a temporary name first: a stopped run never leaves a half-written one)."""
    tmp = directory / (CACHE + ".tmp.npz")
    np.savez(tmp, key=np.array(key), target=np.array(target), tokens=data.tokens, hidden=data.hidden,
             lse=data.lse,
             held_tokens=held.tokens, held_hidden=held.hidden, held_lse=held.lse, fit_h=fit_h, fit_l=fit_l)
    os.replace(tmp, directory / CACHE)
