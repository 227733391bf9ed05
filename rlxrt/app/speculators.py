"""The speculators the CLI, the server and bench build by name."""
from __future__ import annotations

KINDS = ("draft", "mtp", "prompt-lookup", "lookup+draft", "lookup+mtp", "none")
"""``lookup+X``: prompt lookup where the text repeats itself, else X (``rlxrt.sessions.Cascade``)."""
LOOKUP_MIN_N = 3
"""A cascade's lookup drafts on a match of at least 3 tokens, else the model behind it drafts: on SmolLM2's
chat bench, lookup+mtp made 1.35x with 3 against 1.31x with 2 (the head alone 1.28x, lookup alone 1.11x)."""


def model_of(kind: str) -> str | None:
    """The model a kind runs: ``draft``, ``mtp`` or None (prompt lookup, plain decoding)."""
    base = kind.removeprefix("lookup+")
    return base if base in ("draft", "mtp") else None


def build(kind: str, helper, config, min_prob: float = 0.0):
    """The speculator of ``kind`` (None for ``none``); ``helper`` is the draft model or head (a directory or
    a compiled graph) when the kind runs one; ``min_prob``: its chain ends where its likeliest token is below
    it (``ModelSpeculator``)."""
    from rlxrt.sessions import Cascade, DraftModel, MtpHead, PromptLookup

    model = model_of(kind)
    drafter = DraftModel(helper, config, min_prob=min_prob) if model == "draft" else \
        MtpHead(helper, config, min_prob=min_prob) if model == "mtp" else None
    if kind.startswith("lookup+"):
        return Cascade(PromptLookup(min_n=LOOKUP_MIN_N), drafter)
    return PromptLookup() if kind == "prompt-lookup" else drafter
