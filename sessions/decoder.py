"""The protocol every decoder states outright: the KV model of portable graphs (``kv.KVModel``), the fused
model with its bound buffers (``fused.FusedKVModel``) and the recurrent or hybrid model (``state.StateModel``).

A decoder holds one sequence's cache or state. ``forward`` feeds tokens after the ``length`` positions it
holds; ``commit(n)`` keeps the first n (a KV cache moves a length, a recurrent model selects the state after
position n-1 from the per-position states its last call returned); ``reset`` forgets the sequence.
Capabilities are declared attributes, never type checks: ``greedy_ids`` says ``forward_ids`` is there.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np


class Decoder(Protocol):
    length: int
    """Positions the decoder holds (read, and not rolled back)."""
    max_positions: int
    vocab_size: int
    logits_width: int
    """Columns of its logits: the vocabulary, or a draft-only export's N tokens (``vocab_ids``)."""
    vocab_ids: np.ndarray | None
    hidden: np.ndarray | None
    """[s, H] hidden states of the last forward once ``fetch_hidden`` asked for them, else None."""
    greedy_ids: bool
    """True when ``forward_ids`` returns each row's argmax without computing the logits (a greedy head)."""
    shared: bool
    """True for a slot of a Batch (``batch.Slot``): its calls run in steps with other sequences', it caps a
    round's k (``k_cap``), hears each round's result (``observe``) and the request's end (``idle``)."""
    run_seconds: float
    """Seconds spent inside ONNX Runtime."""

    @property
    def providers(self) -> list[str]: ...

    def reset(self) -> None: ...

    def forward(self, tokens, *, rows: int | None = None) -> np.ndarray:
        """Logits [rows, V] of the last ``rows`` fed positions (default: all of them)."""

    def forward_ids(self, tokens, *, rows: int | None = None) -> np.ndarray:
        """Argmax ids [rows] of the last ``rows`` fed positions (only where ``greedy_ids``)."""

    def commit(self, length: int) -> None: ...

    def fetch_hidden(self) -> int:
        """Return the hidden states with every forward from now on; returns their width (-1: not fixed)."""
