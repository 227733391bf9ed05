"""A fused decoder graph with its KV cache resident where the graph runs, bound with IOBinding.

Each KV tensor is ONE buffer of the manifest's capacity, allocated once per model on the graph's device
and bound as both the past input and the present output: GroupQueryAttention writes the new positions in
place. A call sends only the new token ids and three small numbers (the last position, the total length,
how many logits rows to return); a rollback is nothing but a shorter ``length`` in the next call. A graph
with a greedy head (exporters/greedy_head.py) returns each row's argmax instead of its logits when asked
(``forward_ids``), which greedy rounds use.

Per-call inputs are host arrays. Where every node runs on the CPU, an OrtValue made from an array aliases it
and a binding keeps the OrtValue, so writing the array in place is what the next call reads: they are bound
once. Under any other provider a host input that a device node consumes is COPIED when it is bound (measured
on CUDA: ../shared/FACTS.md), so writing the array afterwards would change nothing the graph sees; there
every per-call input is bound again at every call, after it is written (``aliases_inputs``).
"""
from __future__ import annotations

import numpy as np

from rlxrt.backends import CompiledGraph
from rlxrt.errors import ModelFormatError
from rlxrt.limits import K_MAX

from .kv import GraphModel, check_room


MIN_ORT = (1, 31)


def _device(graph: CompiledGraph) -> tuple[str, int]:
    """Where the KV buffers live: the CUDA device the session runs on (its device_id), else the host."""
    if graph.providers and graph.providers[0] in ("cuda", "tensorrt"):
        opts = graph.session.get_provider_options().get("CUDAExecutionProvider", {})
        return "cuda", int(opts.get("device_id", 0) or 0)
    return "cpu", 0


def aliases_inputs(graph: CompiledGraph) -> bool:
    """Whether an input bound once from a host array sees the array's later writes: only where every provider
    the session runs on is the CPU (elsewhere IOBinding copies a host input to its device at bind time)."""
    return bool(graph.providers) and all(p == "cpu" for p in graph.providers)


class FusedKVModel(GraphModel):
    def __init__(self, graph: CompiledGraph):
        super().__init__(graph)
        m = self.manifest
        kv = m.kv_cache
        if kv is None or kv.capacity is None:
            raise ModelFormatError(f"{graph.path}: a fused graph needs kv_cache.capacity in its manifest; re-export")
        import onnxruntime as ort

        version = tuple(int(x) for x in ort.__version__.split(".")[:2] if x.isdigit())
        if version < MIN_ORT:
            raise ModelFormatError(
                f"fused graphs need onnxruntime >= {'.'.join(map(str, MIN_ORT))} (its GroupQueryAttention must take "
                f"several new tokens after a past; tested on 1.31-1.32), this is {ort.__version__}; upgrade "
                "onnxruntime, or export with --graph portable")
        device, device_id = _device(graph)
        if device == "cuda" and kv.dtype == "float32":
            raise ModelFormatError(
                f"{graph.path}: an fp32 fused graph runs GroupQueryAttention on the CPU under CUDA (ONNX Runtime's "
                "CUDA kernel is fp16/bf16 only), copying the KV buffers every step; export with --dtype fp16 for GPUs")
        self.capacity = kv.capacity
        self.max_positions = min(m.max_positions, kv.capacity)
        shape = [1, kv.kv_heads, kv.capacity, kv.head_dim]
        self._binding = graph.session.io_binding()
        self._buffers = []  # kept alive: the binding refers to them
        for i in range(kv.layers):
            past_k, past_v, present_k, present_v = kv.names(i)
            for past, present in ((past_k, present_k), (past_v, present_v)):
                buf = ort.OrtValue.ortvalue_from_shape_and_type(shape, np.dtype(kv.dtype), device, device_id)
                self._binding.bind_ortvalue_input(past, buf)
                self._binding.bind_ortvalue_output(present, buf)
                self._buffers.append(buf)
        # the per-call numbers live in arrays written in place (bound once where inputs alias, else at every
        # call); ids and logits of a round land in views of one preallocated buffer each, so a decode step
        # allocates nothing
        self._seqlens, self._total, self._rows = np.zeros(1, np.int32), np.zeros((), np.int32), np.zeros(1, np.int64)
        for role, arr in (("seqlens_k", self._seqlens), ("total_sequence_length", self._total),
                          ("num_logits", self._rows)):
            self._buffers.append(ort.OrtValue.ortvalue_from_numpy(arr))
            self._binding.bind_ortvalue_input(m.inputs[role], self._buffers[-1])
        self._per_call = [(m.inputs[role], value) for role, value in
                          zip(("seqlens_k", "total_sequence_length", "num_logits"), self._buffers[-3:])]
        """The per-call numbers' names and OrtValues (the greedy flag joins them below)."""
        self._alias = aliases_inputs(graph)
        self._ids_name, self._logits = m.inputs["input_ids"], m.outputs["logits"]
        self._ids: dict[int, tuple[np.ndarray, object]] = {}
        self._out: dict[int, tuple[np.ndarray, object]] = {}
        self._hid: dict[int, tuple[np.ndarray, object]] = {}
        self._ids_buf = np.zeros((1, K_MAX + 1), np.int64)
        self._logits_buf = np.zeros((1, K_MAX + 1, self.logits_width), np.float32)
        self._hidden_buf: np.ndarray | None = None
        self._bound: tuple[int, int] | None = None  # (tokens, rows) the binding holds: rebound only on change
        self._ort, self._vocab = ort, self.logits_width
        self._hidden_name: str | None = None
        self._run_binding = graph.session.run_with_iobinding
        self.output_names = [self._logits]
        self.greedy_ids = bool(m.inputs.get("greedy") and m.outputs.get("next_ids"))
        self._fallbacks: np.ndarray | None = None
        if self.greedy_ids:  # the unused output of each mode is bound to an empty array, made once
            self._greedy, self._next_name = np.zeros(1, bool), m.outputs["next_ids"]
            self._next_buf, self._next = np.zeros((1, K_MAX + 1), np.int64), {}
            self._no_logits = ort.OrtValue.ortvalue_from_numpy(np.zeros((1, 0, self.logits_width), np.float32))
            self._no_ids = ort.OrtValue.ortvalue_from_numpy(np.zeros((1, 0), np.int64))
            self._buffers.append(ort.OrtValue.ortvalue_from_numpy(self._greedy))
            self._binding.bind_ortvalue_input(m.inputs["greedy"], self._buffers[-1])
            self._per_call.append((m.inputs["greedy"], self._buffers[-1]))
            if m.outputs.get("greedy_fallbacks"):  # rows the head's bound could not certify, per call
                self._fallbacks = np.zeros((), np.int64)
                self._buffers.append(ort.OrtValue.ortvalue_from_numpy(self._fallbacks))
                self._binding.bind_ortvalue_output(m.outputs["greedy_fallbacks"], self._buffers[-1])
        self.reset()

    def _buffer(self, cache: dict, n: int, shape: tuple, dtype, base: np.ndarray | None = None):
        """A host array and the OrtValue over its memory: made once per length ``n`` up to a round's
        (K_MAX + 1) — a view of ``base`` when given —, afresh for longer calls (prompts)."""
        if n in cache:
            return cache[n]
        arr = base[:, :n] if base is not None and n <= base.shape[1] else np.zeros(shape, dtype)
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
        if size <= 0:
            raise ModelFormatError(f"{self.graph.path}: the hidden_states output of a fused graph must have a fixed "
                                   "width; re-export the target with --with-hidden-states")
        self._hidden_buf = np.zeros((1, K_MAX + 1, size), np.float32)
        self._bound = None
        return size

    def forward_ids(self, tokens, rows: int | None = None) -> np.ndarray:
        """As ``forward``, but returns the argmax of each row's logits [rows] int64 from the graph's greedy
        head (``greedy_ids``) without computing the logits. -1 marks a row whose hidden state is not finite;
        -2 a row after one whose argmax differs from the token fed after it (a rejected draft), not read."""
        return self.forward(tokens, rows, greedy=True)

    def forward(self, tokens, rows: int | None = None, greedy: bool = False) -> np.ndarray:
        """Feed ``tokens`` after the first ``length`` positions; returns the logits of the last ``rows``
        of them (default: all) as [rows, V], or with ``greedy`` their ids (``forward_ids``). The array (and
        ``hidden``) is this model's buffer: valid until its next call."""
        s = len(tokens)
        end = self.length + s
        check_room(end, self.max_positions)
        n = s if rows is None else min(rows, s)
        ids, ids_value = self._buffer(self._ids, s, (1, s), np.int64, self._ids_buf)
        ids[0] = tokens
        if greedy:
            out, out_value = self._buffer(self._next, n, (1, n), np.int64, self._next_buf)
        else:
            out, out_value = self._buffer(self._out, n, (1, n, self._vocab), np.float32, self._logits_buf)
        hidden = None
        if self._hidden_buf is not None:
            hidden, hidden_value = self._buffer(self._hid, s, (1, s, self._hidden_buf.shape[2]), np.float32,
                                                self._hidden_buf)
        self._seqlens[0] = end - 1
        self._total[()] = end
        self._rows[0] = n
        b = self._binding
        if self._bound != (s, n, greedy) or s > K_MAX + 1:  # a round's shapes repeat: bound once, written in place
            b.bind_ortvalue_input(self._ids_name, ids_value)
            if self.greedy_ids:
                self._greedy[0] = greedy
                b.bind_ortvalue_output(self._next_name, out_value if greedy else self._no_ids)
            b.bind_ortvalue_output(self._logits, self._no_logits if greedy else out_value)
            if hidden is not None:
                b.bind_ortvalue_output(self._hidden_name, hidden_value)
            self._bound = (s, n, greedy)
        elif not self._alias:  # the ids were written in place: bind them again (copied now, as written)
            b.bind_ortvalue_input(self._ids_name, ids_value)
        if not self._alias:
            for name, value in self._per_call:
                b.bind_ortvalue_input(name, value)
        self._timed(self._run_binding, b)
        if greedy:
            self.greedy_rows += n
            if self._fallbacks is not None:
                self.greedy_fallbacks += int(self._fallbacks)
        self.length = end
        if hidden is not None:
            self.hidden = hidden[0]
        return out[0]

    def commit(self, length: int) -> None:
        """Keep only the first ``length`` positions: the next call writes over the rest."""
        self.length = min(self.length, length)
