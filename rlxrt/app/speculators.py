"""The speculators the CLI, the server and bench build by name: one registration each.

A speculator is one file in ``sessions/`` (a ``Speculator`` subclass) and one entry in ``SPECULATORS``: its
name, the model it drafts with (``draft``: the ``--draft`` directory, ``mtp``: the ``--head`` directory, or
none) and how to build it. Every speculator that drafts with a model also gets a ``lookup+NAME`` kind: prompt
lookup where the text repeats itself, else it (``rlxrt.sessions.Cascade``). The flags' choices, the server's
options and bench all read this table.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

LOOKUP_MIN_N = 3
"""A cascade's lookup drafts on a match of at least 3 tokens, else the model behind it drafts: a shorter match
predicts new text worse than a head does (SmolLM2's chat bench, docs/heads.md)."""


@dataclass(frozen=True)
class Kind:
    model: str | None
    """The model it drafts with: ``draft`` (a draft model directory), ``mtp`` (an MTP head directory) or None."""
    make: Callable[[Any, Any, float], Any]
    """``make(helper, config, min_prob)``: the speculator (None for plain decoding); ``helper`` is the model's
    directory or compiled graph (a draft model's also a ``Batch`` of it, for Sessions on a target's Batch),
    ``min_prob`` where a model's chain ends (``ModelSpeculator``)."""


def _draft(helper, config, min_prob):
    from rlxrt.sessions import DraftModel

    return DraftModel(helper, config, min_prob=min_prob)


def _mtp(helper, config, min_prob):
    from rlxrt.sessions import MtpHead

    return MtpHead(helper, config, min_prob=min_prob)


def _lookup(helper, config, min_prob):
    from rlxrt.sessions import PromptLookup

    return PromptLookup()


SPECULATORS: dict[str, Kind] = {
    "draft": Kind("draft", _draft),
    "mtp": Kind("mtp", _mtp),
    "prompt-lookup": Kind(None, _lookup),
    "none": Kind(None, lambda helper, config, min_prob: None),
}


def _cascade(kind: Kind) -> Kind:
    def make(helper, config, min_prob):
        from rlxrt.sessions import Cascade, PromptLookup

        return Cascade(PromptLookup(min_n=LOOKUP_MIN_N), kind.make(helper, config, min_prob))

    return Kind(kind.model, make)


SPECULATORS.update({f"lookup+{name}": _cascade(kind) for name, kind in list(SPECULATORS.items()) if kind.model})
KINDS = tuple(SPECULATORS)
"""Every name, in the order the flags list them."""


def model_of(kind: str) -> str | None:
    """The model a kind drafts with: ``draft``, ``mtp`` or None (prompt lookup, plain decoding)."""
    return SPECULATORS[kind].model if kind in SPECULATORS else None


def build(kind: str, helper, config, min_prob: float = 0.0):
    """The speculator of ``kind`` (None for ``none``); ``helper`` is the draft model or head (a directory or
    a compiled graph) when the kind drafts with one."""
    return SPECULATORS[kind].make(helper, config, min_prob)
