"""Export the trained reference pair and install it as rlxrt's shipped assets.

    python -m rlxrt.app.recipe WORK          # target, draft, prompts, recipe
    python -m rlxrt.app.recipe WORK --mtp    # the MTP head (rlxrt train-head on the installed target)

Writes rlxrt/assets/reference/{target,draft} (ONNX, manifest, tokenizer; the
target with its last hidden state as an output, for the MTP head),
rlxrt/assets/reference/mtp (the head, trained by ``rlxrt train-head``: rlxrt/app/recipe.py),
rlxrt/assets/reference/prompts.json (held-out prompts) and recipe.json (the
training summary), and the fp16 torch weights to exporters/reference/weights
(for the Hugging Face peers of ``rlxrt bench``; not part of the wheel).

The graphs run through ``runner(graph_path) -> run(feeds) -> {output name: array}``,
which the application layer passes in (this package creates no ORT session).
"""
from __future__ import annotations

import json
import re
import shutil
import sys
from importlib.resources import files
from pathlib import Path

import numpy as np

from rlxrt.manifest import Manifest

from ..export import GRAPH, export_model
from ..validate import feeds_for
from .corpus import evaluation_files

HERE = Path(__file__).resolve().parent
ASSETS = Path(str(files("rlxrt") / "assets" / "reference"))  # run from a source checkout (editable install)
WEIGHTS = HERE / "weights"
PROMPT_CHARS = 480
FIRST_WORD = re.compile(r"(?:[ \t]*\n)*[ \t]*(?:\w+|\S+)")


def held_out_prompts(n: int = 16) -> list[dict]:
    """Deterministic prompts: in each held-out file, the text up to the middle of its second function.

    A prompt ends after the first word of a line, never on a line break: the
    tokenizer merges a line break with the next line's indentation, so a
    prompt ending in a bare break would tell the model "column 0 follows".
    """
    out = []
    for rel, path in evaluation_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        starts = [i for i in range(len(text)) if text.startswith("\ndef ", i) or text.startswith("\n    def ", i)]
        if len(starts) < 2:
            continue
        start = starts[1] + 1
        body_end = text.find("\n", start + PROMPT_CHARS // 2)
        if body_end < 0:
            continue
        word = FIRST_WORD.match(text, body_end + 1)
        if word is None:
            continue
        cut = max(0, body_end - PROMPT_CHARS)
        cut = text.find("\n", cut) + 1
        out.append({"file": rel, "prompt": text[cut:word.end()]})
        if len(out) == n:
            break
    return out


def _summary(work: Path, role: str) -> dict:
    recs = [json.loads(line) for line in (work / f"{role}.log.jsonl").read_text().splitlines()]
    evals = [r for r in recs if "heldout_loss" in r]
    last = recs[-1]
    return {"steps": last["step"], "tokens": last["tokens"], "train_seconds": last["elapsed_s"],
            "final_train_loss": last["loss"], "heldout_loss": evals[-1]["heldout_loss"] if evals else None}


def build_pair(work_dir: str, runner) -> None:
    """Export WORK/target and WORK/draft into the assets, validated; prompts, held-out losses and the recipe."""
    import torch
    import transformers as tf

    work = Path(work_dir)
    ASSETS.mkdir(parents=True, exist_ok=True)
    for role in ("target", "draft"):
        src = work / role
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy2(work / "tokenizer" / f, src / f)
        res = export_model(src, ASSETS / role, runner=runner, force=True, report=lambda s: print(f"  {role} {s}"),
                           with_hidden_states=role == "target")
        print(f"{role}: validation {res.manifest.validation}")
        # the fp16 weights-only checkpoint, for the torch peers and for resuming the recipe
        model = tf.LlamaForCausalLM.from_pretrained(str(src), dtype=torch.float16)
        (WEIGHTS / role).mkdir(parents=True, exist_ok=True)
        model.save_pretrained(str(WEIGHTS / role))
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy2(work / "tokenizer" / f, WEIGHTS / role / f)
    texts = [p.read_text(encoding="utf-8") for _, p in evaluation_files()]
    losses = {role: heldout_loss(runner(ASSETS / role / GRAPH), ASSETS / role, texts) for role in ("target", "draft")}
    print(f"held-out loss (rlxrt, {losses['target']['tokens']} tokens): target {losses['target']['loss']:.3f}, "
          f"draft {losses['draft']['loss']:.3f}")
    (ASSETS / "prompts.json").write_text(json.dumps(held_out_prompts(), indent=1) + "\n")
    (ASSETS / "recipe.json").write_text(json.dumps(
        {"target": _summary(work, "target"), "draft": _summary(work, "draft"), "heldout_loss_rlxrt": losses,
         "heldout_files": [rel for rel, _ in evaluation_files()],
         "corpus": "Python stdlib *.py (tests, site-packages excluded), held out by sha256(path)[0] < 13",
         "python": sys.version.split()[0]}, indent=1) + "\n")
    print(f"installed into {ASSETS}")


def heldout_loss(run, model_dir: Path, texts: list[str], window: int = 512) -> dict[str, float]:
    """Mean next-token loss (nats) of the exported model in ``model_dir`` on texts, in non-overlapping windows,
    each one call of its graph's ``run(feeds) -> {name: array}`` from an empty cache."""
    from tokenizers import Tokenizer

    manifest = Manifest.load(model_dir)
    tokenizer = Tokenizer.from_file(str(model_dir / manifest.tokenizer))
    window = min(window, manifest.max_positions)
    total, count = 0.0, 0
    for text in texts:
        ids = np.asarray(tokenizer.encode(text).ids, np.int64)
        for start in range(0, len(ids) - 1, window):
            chunk = ids[start:start + window]
            if len(chunk) < 2:
                continue
            out = run(feeds_for(manifest, chunk[None], None, 0))
            logits = out[manifest.outputs["logits"]][0].astype(np.float64)
            logits -= logits.max(-1, keepdims=True)
            logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
            total -= logp[np.arange(len(chunk) - 1), chunk[1:]].sum()
            count += len(chunk) - 1
    return {"loss": float(total / max(1, count)), "tokens": int(count)}
