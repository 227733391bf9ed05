"""A compiled recurrent graph (SSM / RNN) with its state: commit picks a per-position state.

A recurrent state cannot be rolled back by length like a KV cache. The graph
returns the state after EACH token it was fed (manifest ``state``), and this
model keeps those states for every position since the last commit; a commit
to length n selects the state after token n-1 and forgets the rest, so a
rejected draft costs no re-run. Inputs longer than the graph's
``max_tokens_per_call`` are fed in chunks. A draft head (a ``hidden_states``
input) reads the hidden state of the last fed position and returns the
logits and hidden state of that position only; a graph with a
``hidden_states`` output leaves its rows in ``hidden``. A hybrid graph
(attention layers with a KV cache besides the recurrent ones) uses both
mechanisms at once: in one commit the KV cache rolls back by length and the
state by selection.
"""
from __future__ import annotations

import numpy as np

from rlxrt.backends import CompiledGraph
from rlxrt.errors import GenerationError, ModelFormatError

from .kv import GraphModel, KVCache, KVModel


class StateModel(GraphModel):
    def __init__(self, graph: CompiledGraph):
        super().__init__(graph)
        m = self.manifest
        if m.state is None:
            raise ModelFormatError(f"{graph.path}: the manifest declares no recurrent state")
        tensors = m.state.tensors
        missing = [t.input for t in tensors if t.input not in graph.input_names]
        missing += [t.output for t in tensors if t.output not in graph.output_names]
        if missing:
            raise ModelFormatError(f"{graph.path}: the manifest names state tensors {missing} the graph lacks")
        self.state_inputs = [t.input for t in tensors]
        self.hidden_in = m.inputs.get("hidden_states")
        self.hidden_each = bool(m.draft_head and m.draft_head.get("attention_heads"))
        """A head with an attention layer reads the hidden state of every fed position, not the last one's."""
        hidden_out = m.outputs.get("hidden_states")
        self.output_names = [m.outputs["logits"]] + ([hidden_out] if hidden_out else []) \
            + [t.output for t in tensors]
        self._first_state = 2 if hidden_out else 1
        self.kv = KVCache(graph) if m.kv_cache is not None else None  # a hybrid: attention layers too
        self._states_end = len(self.output_names)
        if self.kv is not None:
            self.output_names += self.kv.present_names
        self._zero = [np.zeros(t.shape, np.dtype(t.dtype)) for t in tensors]
        self.chunk = m.state.max_tokens_per_call
        self.reset()

    def reset(self) -> None:
        self.length = 0
        self.hidden = None
        self._states: dict[int, list[np.ndarray]] = {0: self._zero}
        if self.kv is not None:
            self.kv.reset()

    def state(self, length: int | None = None) -> list[np.ndarray]:
        """The state after the first ``length`` tokens (default: all fed), if still kept."""
        length = self.length if length is None else length
        if length not in self._states:
            raise GenerationError(f"the state after {length} tokens is no longer kept (kept: "
                                  f"{sorted(self._states)}); a recurrent model commits forward only")
        return self._states[length]

    def forward(self, tokens, hidden: np.ndarray | None = None, rows: int | None = None) -> np.ndarray:
        """Feed ``tokens`` after the first ``length``; returns their logits [s, V] (the last ``rows`` of them
        when given). A head is given ``hidden`` [1, H], the last position's hidden state (one with an attention
        layer: [s, H], every fed position's), and returns the last position's logits [1, V]."""
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        start = self.length
        if start + len(ids) > self.max_positions:
            raise GenerationError(f"sequence of {start + len(ids)} tokens exceeds the model's max positions "
                                  f"({self.max_positions})")
        if self.hidden_in is not None and (hidden is None or len(hidden) != (len(ids) if self.hidden_each else 1)):
            raise GenerationError(
                f"{self.graph.path}: a draft head reads the hidden state of "
                f"{f'each fed position, {len(ids)} rows' if self.hidden_each else 'the last fed position, one row'}; "
                f"got {None if hidden is None else len(hidden)}")
        state = self.state(start)
        parts, hid = [], []
        for c in range(0, len(ids), self.chunk):
            part = ids[c:c + self.chunk]
            feeds = {self.ids_name: part[None]}
            if self.hidden_each:
                feeds[self.hidden_in] = np.asarray(hidden[c:c + self.chunk], np.float32)[None]
            elif self.hidden_in is not None:  # earlier chunks only build the state; their outputs are dropped
                last = c + self.chunk >= len(ids)
                feeds[self.hidden_in] = np.asarray(hidden if last else np.zeros_like(hidden), np.float32)[None]
            feeds.update(zip(self.state_inputs, state))
            base = start + c
            if self.kv is not None:
                self.kv.feed(feeds, base, base + len(part))
            out = self._run(self.output_names, feeds)
            if self.kv is not None:
                self.kv.cache = out[self._states_end:]
            parts.append(out[0][0])
            if self._first_state == 2:
                hid.append(out[1][0])
            states = out[self._first_state:self._states_end]
            for j in range(len(part)):
                self._states[base + j + 1] = [per_position[j] for per_position in states]
            state = self._states[base + len(part)]
        self.length = start + len(ids)
        if hid:
            self.hidden = hid[-1] if self.hidden_in is not None or len(hid) == 1 else np.concatenate(hid)
        if self.hidden_in is not None:
            return parts[-1]
        logits = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return logits if rows is None else logits[-rows:]

    def commit(self, length: int) -> None:
        """Keep the state after the first ``length`` tokens; states of later positions are dropped
        (a hybrid's KV cache moves its length back with it)."""
        length = min(self.length, length)
        keep = self.state(length)
        self._states = {length: keep}
        self.length = length


def decoder_for(graph: CompiledGraph):
    """The model wrapper a graph's manifest asks for: a KV cache, or recurrent state (with or without one)."""
    m = graph.manifest
    if m is not None and m.inputs.get("hidden_states"):
        raise ModelFormatError(f"{graph.path} is a draft head (it reads the target's hidden states), not a "
                               "language model; bind it as a speculator: MtpHead(dir) / --speculator mtp")
    if m is not None and m.state is not None:
        return StateModel(graph)
    if m is not None and m.graph_kind == "fused":
        from .fused import FusedKVModel

        return FusedKVModel(graph)
    return KVModel(graph)
