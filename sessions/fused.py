"""A fused decoder graph with its KV cache resident where the graph runs, bound with IOBinding.

Each KV tensor is ONE buffer of the manifest's capacity, allocated once per model on the graph's device
and bound as both the past input and the present output: GroupQueryAttention writes the new positions in
place. A call sends only the new token ids and three small numbers (the last position, the total length,
how many logits rows to return); a rollback is nothing but a shorter ``length`` in the next call.
"""
from __future__ import annotations

import numpy as np

from rlxrt.backends import CompiledGraph
from rlxrt.errors import GenerationError, ModelFormatError
from rlxrt.limits import K_MAX

from .kv import GraphModel


class FusedKVModel(GraphModel):
    def __init__(self, graph: CompiledGraph):
        super().__init__(graph)
        m = self.manifest
        kv = m.kv_cache
        if kv is None or kv.capacity is None:
            raise ModelFormatError(f"{graph.path}: a fused graph needs kv_cache.capacity in its manifest; re-export")
        import onnxruntime as ort

        self.capacity = kv.capacity
        self.max_positions = min(m.max_positions, kv.capacity)
        device = "cuda" if graph.providers[0] == "cuda" else "cpu"
        shape = [1, kv.kv_heads, kv.capacity, kv.head_dim]
        self._binding = graph.session.io_binding()
        self._buffers = []  # kept alive: the binding refers to them
        for i in range(kv.layers):
            past_k, past_v, present_k, present_v = kv.names(i)
            for past, present in ((past_k, present_k), (past_v, present_v)):
                buf = ort.OrtValue.ortvalue_from_shape_and_type(shape, np.dtype(kv.dtype), device, 0)
                self._binding.bind_ortvalue_input(past, buf)
                self._binding.bind_ortvalue_output(present, buf)
                self._buffers.append(buf)
        # the per-call numbers live in arrays bound once and written in place; the ids and logits buffers
        # are made once per call length, so a decode step allocates nothing
        self._seqlens, self._total, self._rows = np.zeros(1, np.int32), np.zeros((), np.int32), np.zeros(1, np.int64)
        for role, arr in (("seqlens_k", self._seqlens), ("total_sequence_length", self._total),
                          ("num_logits", self._rows)):
            self._buffers.append(ort.OrtValue.ortvalue_from_numpy(arr))
            self._binding.bind_ortvalue_input(m.inputs[role], self._buffers[-1])
        self._ids_name, self._logits = m.inputs["input_ids"], m.outputs["logits"]
        self._ids: dict[int, tuple[np.ndarray, object]] = {}
        self._out: dict[int, tuple[np.ndarray, object]] = {}
        self._ort, self._vocab = ort, m.vocab_size
        self._hidden_name: str | None = None
        self._run_binding = graph.session.run_with_iobinding
        self.output_names = [self._logits]
        self.reset()

    def _buffer(self, cache: dict, n: int, shape: tuple, dtype) -> tuple[np.ndarray, object]:
        """A host array and the OrtValue over its memory: made once per length ``n`` up to a round's
        (K_MAX + 1), afresh for longer calls (prompts), so the cache stays small."""
        if n in cache:
            return cache[n]
        arr = np.zeros(shape, dtype)
        made = (arr, self._ort.OrtValue.ortvalue_from_numpy(arr))
        if n <= K_MAX + 1:
            cache[n] = made
        return made

    def reset(self) -> None:
        self.length = 0
        self.hidden = None

    def fetch_hidden(self) -> int:
        size = super().fetch_hidden()
        self._hidden_name = self.manifest.outputs["hidden_states"]
        return size

    def forward(self, tokens, rows: int | None = None) -> np.ndarray:
        """Feed ``tokens`` after the first ``length`` positions; returns the logits of the last ``rows``
        of them (default: all) as [rows, V]. The array is this model's buffer: valid until its next call."""
        s = len(tokens)
        end = self.length + s
        if end > self.max_positions:
            raise GenerationError(f"sequence of {end} tokens exceeds the model's KV capacity ({self.max_positions}); "
                                  "shorten the request, or re-export with a larger --max-context")
        n = s if rows is None else min(rows, s)
        ids, ids_value = self._buffer(self._ids, s, (1, s), np.int64)
        ids[0] = tokens
        logits, logits_value = self._buffer(self._out, n, (1, n, self._vocab), np.float32)
        self._seqlens[0] = end - 1
        self._total[()] = end
        self._rows[0] = n
        b = self._binding
        b.bind_ortvalue_input(self._ids_name, ids_value)
        b.bind_ortvalue_output(self._logits, logits_value)
        if self._hidden_name:
            b.bind_output(self._hidden_name)
        self._timed(self._run_binding, b)
        self.length = end
        if self._hidden_name:
            self.hidden = b.get_outputs()[-1].numpy()[0]
        return logits[0]

    def commit(self, length: int) -> None:
        """Keep only the first ``length`` positions: the next call writes over the rest."""
        self.length = min(self.length, length)
