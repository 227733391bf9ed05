"""A compiled decoder graph with its KV cache: feeds by name, rollback by length.

The cache is the list of ``present`` arrays the last run returned. Rolling
back is moving ``length``: the next run is fed the views ``t[:, :, :length]``
(no copy of the cache beyond what ORT itself makes of a non-contiguous input).
"""
from __future__ import annotations

import time

import numpy as np

from rlxrt.backends import CompiledGraph
from rlxrt.errors import GenerationError, ModelFormatError


def draft_vocab_ids(graph: CompiledGraph) -> np.ndarray | None:
    """[N] int64 token ids of a draft-only export's logit columns (ascending, inside the vocabulary), or None;
    ModelFormatError when the manifest's file is missing or does not hold them."""
    m = graph.manifest
    if not m.draft_vocab:
        return None
    from rlxrt.files import parse_json, read_model_file
    from rlxrt.limits import MAX_ID_LIST_BYTES

    path = graph.path.parent / m.draft_vocab["ids"]
    n = int(m.draft_vocab["size"])
    raw = read_model_file(graph.path.parent, m.draft_vocab["ids"], "draft_vocab.ids", MAX_ID_LIST_BYTES)
    ids = parse_json(raw, f"draft_vocab.ids {str(path)!r}", ModelFormatError)
    arr = np.asarray(ids, np.int64) if isinstance(ids, list) and all(isinstance(i, int) for i in ids) else None
    if arr is None or arr.shape != (n,) or arr[0] < 0 or arr[-1] >= m.vocab_size or bool(np.any(np.diff(arr) <= 0)):
        raise ModelFormatError(f"{path}: draft_vocab.ids must list {n} distinct token ids in ascending order, each "
                               f"below vocab_size {m.vocab_size}; re-export the draft with --draft-vocab")
    return arr


def check_room(end: int, max_positions: int) -> None:
    """GenerationError when a call would end past the KV capacity."""
    if end > max_positions:
        raise GenerationError(f"sequence of {end} tokens exceeds the model's KV capacity ({max_positions}); "
                              "shorten the request, or re-export with a larger --max-context")


class GraphModel:
    """What the KV and the recurrent-state models share: the graph, its manifest, timed runs (each states the
    ``decoder.Decoder`` protocol)."""

    greedy_ids = False
    """True when the graph has a greedy head: ``forward_ids`` returns each row's argmax without the logits."""
    shared = False
    """True for a slot of a Batch (``batch.Slot``): its calls run in steps with other sequences', and it plans
    its k with them (``k_cap``, ``observe``, ``idle``)."""
    greedy_rows = 0
    """Rows this model's greedy head has answered (``forward_ids``), since it was made."""
    greedy_fallbacks = 0
    """Of those, rows its bound could not certify, which took the full Gemm (graphs that report it)."""
    hidden: np.ndarray | None = None
    """[s, H] last hidden states of the last forward, when fetched (see ``KVModel.fetch_hidden``); a fused
    graph's is its buffer, like its logits: valid until the next forward (copy it to keep it)."""

    def __init__(self, graph: CompiledGraph):
        m = graph.manifest
        if m is None:
            raise ModelFormatError(
                f"{graph.path} has no rlxrt.json next to it; sessions run model directories made by "
                "`rlxrt export`, not bare .onnx files"
            )
        self.graph, self.manifest = graph, m
        self._session_run = graph.session.run
        self.ids_name = m.inputs["input_ids"]
        self.vocab_size = m.vocab_size
        self.vocab_ids = draft_vocab_ids(graph)
        """The token of each logit column of a draft-only export (``rlxrt export --draft-vocab N``), else None."""
        self.logits_width = m.vocab_size if self.vocab_ids is None else len(self.vocab_ids)
        self.max_positions = m.max_positions
        self.run_seconds = 0.0
        """Seconds spent inside ORT's session.run."""

    @property
    def providers(self) -> list[str]:
        return self.graph.providers

    def forward_ids(self, tokens, rows: int | None = None) -> np.ndarray:
        raise NotImplementedError(f"{self.graph.path} has no greedy head (greedy_ids is False): call forward")

    def fetch_hidden(self) -> int:
        """Return the last hidden states with every forward (in ``hidden``); returns the hidden size."""
        name = self.manifest.outputs.get("hidden_states")
        if not name or name not in self.graph.output_names:
            raise GenerationError(
                f"{self.graph.path} has no hidden_states output, and a draft head reads the target's last hidden "
                "state; re-export the target with `rlxrt export SRC OUT --with-hidden-states`")
        if name not in self.output_names:  # a recurrent model fetches a declared one always
            self.output_names.append(name)
        shape = next(t.shape for t in self.graph.outputs if t.name == name)
        return int(shape[-1]) if shape and isinstance(shape[-1], int) else -1

    def _run(self, names: list[str], feeds: dict) -> list:
        return self._timed(self._session_run, names, feeds)

    def _timed(self, run, *args):
        """``run(*args)`` timed into ``run_seconds``; only ONNX Runtime's own failures become GenerationError,
        a bug in rlxrt propagates as is."""
        t0 = time.perf_counter()
        try:
            out = run(*args)
        except self.graph.errors as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:400]
            raise GenerationError(f"onnxruntime failed running {self.graph.path}: {first}; the session stays "
                                  "usable — check the model export and the providers") from exc
        self.run_seconds += time.perf_counter() - t0
        return out


class KVCache:
    """The KV half of a graph: past inputs fed as views of the last ``present`` outputs.

    A rollback is moving the length the next call starts from; the cache itself is never copied by us.
    """

    def __init__(self, graph: CompiledGraph):
        m = graph.manifest
        kv = m.kv_cache
        names = [kv.names(i) for i in range(kv.layers)]
        self.past_names = [n for layer in names for n in layer[:2]]
        self.present_names = [n for layer in names for n in layer[2:]]
        missing = [n for n in self.past_names if n not in graph.input_names]
        missing += [n for n in self.present_names if n not in graph.output_names]
        if missing:
            raise ModelFormatError(f"{graph.path}: the manifest names KV tensors {missing} the graph does not have")
        self.mask_name = m.inputs.get("attention_mask")
        self.pos_name = m.inputs.get("position_ids")
        self._ones = np.ones((1, m.max_positions), np.int64)
        self._positions = np.arange(m.max_positions, dtype=np.int64)[None]
        self._empty = np.zeros((1, kv.kv_heads, 0, kv.head_dim), np.dtype(kv.dtype))
        self.reset()

    def reset(self) -> None:
        self.cache = [self._empty] * len(self.past_names)

    def feed(self, feeds: dict, start: int, end: int) -> None:
        """Add the mask, positions and past views for a call that feeds positions start..end-1."""
        if self.mask_name:
            feeds[self.mask_name] = self._ones[:, :end]
        if self.pos_name:
            feeds[self.pos_name] = self._positions[:, start:end]
        for name, t in zip(self.past_names, self.cache):
            feeds[name] = t if t.shape[2] == start else t[:, :, :start]


class KVModel(GraphModel):
    def __init__(self, graph: CompiledGraph):
        super().__init__(graph)
        m = self.manifest
        if m.kv_cache is None:
            raise ModelFormatError(f"{graph.path}: the manifest declares no KV cache; re-export the model")
        if m.inputs["input_ids"] not in graph.input_names:
            raise ModelFormatError(f"{graph.path}: the manifest names input {m.inputs['input_ids']!r} the graph "
                                   "does not have")
        self.kv = KVCache(graph)
        self.output_names = [m.outputs["logits"]] + self.kv.present_names
        self._caches = len(self.kv.present_names)
        self.reset()

    def reset(self) -> None:
        self.length = 0
        self.hidden = None
        self.kv.reset()

    def forward(self, tokens, rows: int | None = None) -> np.ndarray:
        """Feed ``tokens`` after the first ``length`` cached ones; returns their logits [s, V] (the last
        ``rows`` of them when given: this graph computes them all anyway)."""
        ids = np.asarray(tokens, dtype=np.int64).reshape(1, -1)
        s, start = ids.shape[1], self.length
        end = start + s
        if end > self.max_positions:
            raise GenerationError(f"sequence of {end} tokens exceeds the model's max positions "
                                  f"({self.max_positions})")
        feeds = {self.ids_name: ids}
        self.kv.feed(feeds, start, end)
        out = self._run(self.output_names, feeds)
        self.kv.cache = out[1:1 + self._caches]
        if len(out) > 1 + self._caches:
            self.hidden = out[-1][0]
        self.length = end
        return out[0][0] if rows is None else out[0][0][-rows:]

    def commit(self, length: int) -> None:
        """Keep only the first ``length`` cached positions (a rollback is moving this number)."""
        self.length = min(self.length, length)
