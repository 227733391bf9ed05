"""Parsing ``rlxrt.json`` field by field: the type and range of every field, so a bad model directory
fails at load with the field's name and the fix, not later as ONNX Runtime's text. (The names and widths
it gives are then checked against the graph itself by ``rlxrt.backends`` at compile time.)"""
from __future__ import annotations

import numbers
from typing import Any

from .errors import ModelFormatError

DTYPES = ("float32", "float16", "bfloat16", "int8", "int4")
CACHE_DTYPES = ("float32", "float16", "bfloat16")
GRAPH_KINDS = ("portable", "fused")
FIX = "re-export the model with `rlxrt export`, or correct the field"


class _Fields:
    def __init__(self, data: Any, where: str, path: str = ""):
        if not isinstance(data, dict):
            what = f"field {path!r}" if path else "the manifest"
            raise ModelFormatError(f"{where}: {what} must be a JSON object, got {type(data).__name__} "
                                   f"{str(data)[:60]!r}; {FIX}")
        self.data, self.where, self.path = data, where, path

    def _name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def fail(self, key: str, what: str, value: Any) -> ModelFormatError:
        return ModelFormatError(f"{self.where}: field {self._name(key)!r} must be {what}, got {value!r}; {FIX}")

    def get(self, key: str, required: bool = True) -> Any:
        if key not in self.data:
            if required:
                raise ModelFormatError(f"{self.where}: field {self._name(key)!r} is missing; {FIX}")
            return None
        return self.data[key]

    def text(self, key: str, required: bool = True, file_name: bool = False) -> str | None:
        v = self.get(key, required)
        if v is None and not required:
            return None
        if not isinstance(v, str) or not v:
            raise self.fail(key, "a non-empty string", v)
        if file_name and (v in (".", "..") or "/" in v or "\\" in v):
            raise self.fail(key, "a file name inside the model directory (no path)", v)
        return v

    def integer(self, key: str, low: int | None = None, high: int | None = None, required: bool = True,
                value: Any = None) -> int | None:
        v = self.get(key, required) if value is None else value
        if v is None and not required:
            return None
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or (low is not None and v < low) \
                or (high is not None and v > high):
            span = f" in {low}..{high}" if high is not None else f" >= {low}" if low is not None else ""
            raise self.fail(key, f"an integer{span}", v)
        return int(v)

    def choice(self, key: str, allowed: tuple[str, ...]) -> str:
        v = self.get(key)
        if v not in allowed:
            raise self.fail(key, f"one of {', '.join(allowed)}", v)
        return v

    def table(self, key: str, required: bool = True) -> dict | None:
        v = self.get(key, required)
        if v is None and not required:
            return None
        if not isinstance(v, dict):
            raise self.fail(key, "a JSON object", v)
        return v

    def sub(self, key: str, known: tuple[str, ...] | None = None) -> "_Fields":
        """The object at ``key``; with ``known``, a key it does not list is an error (a typo, or a field of a
        newer rlxrt)."""
        f = _Fields(self.get(key), self.where, self._name(key))
        f.only(known)
        return f

    def only(self, known: tuple[str, ...] | None) -> None:
        unknown = sorted(set(self.data) - set(known)) if known is not None else []
        if unknown:
            raise ModelFormatError(f"{self.where}: unknown field(s) {', '.join(repr(self._name(k)) for k in unknown)} "
                                   f"(known here: {', '.join(known)}); {FIX}")

    def strings(self, keys: tuple[str, ...]) -> None:
        """Each of ``keys``, where present, is a string or null."""
        for key in keys:
            v = self.data.get(key)
            if v is not None and not isinstance(v, str):
                raise self.fail(key, "a string or null", v)

    def names(self, key: str, required_roles: tuple[str, ...]) -> dict[str, str | None]:
        v = self.table(key)
        for role, name in v.items():
            if name is not None and (not isinstance(name, str) or not name):
                raise self.fail(f"{key}.{role}", "a graph tensor name or null", name)
        for role in required_roles:
            if not v.get(role):
                raise ModelFormatError(f"{self.where}: field {self._name(key + '.' + role)!r} is required "
                                       f"(the graph's {role} tensor); {FIX}")
        return dict(v)


def _source(f: _Fields) -> dict:
    if f.get("source", required=False) is None:
        return {}
    f.sub("source").strings(("path_or_id", "weights_sha256", "task", "gguf_sha256"))
    return f.data["source"]


def parse(cls, data: Any, where: str):
    """A Manifest instance of ``cls`` from the decoded JSON ``data``."""
    from .manifest import SCHEMA, KVCacheLayout, StateLayout, StateTensor

    f = _Fields(data, where)
    schema = data.get("schema")
    if not isinstance(schema, str) or not schema.startswith("rlxrt.manifest/"):
        raise ModelFormatError(f"{where}: missing or foreign 'schema' {schema!r}; expected {SCHEMA!r}")
    if schema.split("/")[-1] != SCHEMA.split("/")[-1]:
        raise ModelFormatError(f"{where}: schema {schema!r} is not supported by this rlxrt (reads {SCHEMA!r}); "
                               "re-export the model with this version of rlxrt")
    known = {"architecture", "model_type", "vocab_size", "max_positions", "graph", "dtype", "inputs", "outputs",
             "kv_cache", "bos_token_id", "eos_token_ids", "pad_token_id", "tokenizer", "source", "versions",
             "validation", "state", "draft_head", "graph_kind", "quantization", "chat", "draft_vocab", "hidden_layers",
             "schema"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ModelFormatError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))} for schema {SCHEMA} "
                               f"(known: {', '.join(sorted(known))}); {FIX}")
    vocab = f.integer("vocab_size", 1)
    token = dict(low=0, high=vocab - 1)
    eos = f.get("eos_token_ids", required=False) or []
    if not isinstance(eos, list):
        raise f.fail("eos_token_ids", "a list of token ids", eos)
    kv = None
    if f.get("kv_cache", required=False) is not None:
        k = f.sub("kv_cache", ("layers", "kv_heads", "head_dim", "dtype", "past_key", "past_value", "present_key",
                               "present_value", "capacity", "seq_axis"))
        legacy_axis = k.data.get("seq_axis", 2)  # written by rlxrt before 0.2; the layout is fixed at axis 2
        if legacy_axis != 2:
            raise k.fail("seq_axis", "2 (caches are [batch, kv_heads, seq, head_dim])", legacy_axis)
        patterns = {}
        for name in ("past_key", "past_value", "present_key", "present_value"):
            patterns[name] = k.text(name)
            if "{i}" not in patterns[name]:
                raise k.fail(name, "a name pattern with {i} for the layer", patterns[name])
        kv = KVCacheLayout(layers=k.integer("layers", 1), kv_heads=k.integer("kv_heads", 1),
                           head_dim=k.integer("head_dim", 1), dtype=k.choice("dtype", CACHE_DTYPES),
                           capacity=k.integer("capacity", 1, required=False), **patterns)
    state = None
    if f.get("state", required=False) is not None:
        st = f.sub("state", ("tensors", "max_tokens_per_call"))
        tensors = st.get("tensors")
        if not isinstance(tensors, list) or not tensors:
            raise st.fail("tensors", "a non-empty list", tensors)
        parsed = []
        for i, t in enumerate(tensors):
            tf = _Fields(t, where, f"state.tensors[{i}]")
            tf.only(("input", "output", "shape", "dtype"))
            shape = tf.get("shape")
            if not isinstance(shape, list) or not shape:
                raise tf.fail("shape", "a non-empty list of sizes", shape)
            dims = tuple(tf.integer(f"shape[{j}]", 1, value=d) for j, d in enumerate(shape))
            parsed.append(StateTensor(tf.text("input"), tf.text("output"), dims, tf.choice("dtype", CACHE_DTYPES)))
        state = StateLayout(tuple(parsed), st.integer("max_tokens_per_call", 1))
    head = f.table("draft_head", required=False)
    if head is not None:
        hf = f.sub("draft_head", ("kind", "hidden_size", "target", "draft_vocab", "draft_vocab_ids", "hidden_layers",
                                  "attention_heads"))
        hf.text("kind")
        hf.integer("hidden_size", 1)
        _layers(hf, "hidden_layers", None)
        hf.integer("draft_vocab", 1, vocab, required=False)
        hf.text("draft_vocab_ids", required=False, file_name=True)
        if hf.integer("attention_heads", 1, required=False) is not None and kv is None:
            raise ModelFormatError(f"{where}: a draft head with 'draft_head.attention_heads' needs field 'kv_cache' "
                                   f"(its attention layer's cache); {FIX}")
        if hf.get("target", required=False) is not None:
            hf.sub("target", ("path_or_id", "weights_sha256")).strings(("path_or_id", "weights_sha256"))
    chat = _chat(f, token) if f.get("chat", required=False) is not None else None
    draft_vocab = f.table("draft_vocab", required=False)
    if draft_vocab is not None:
        dv = f.sub("draft_vocab", ("size", "ids", "corpus_tokens", "corpus_coverage"))
        dv.integer("size", 1, vocab - 1)
        dv.text("ids", file_name=True)
    inputs = f.names("inputs", ("input_ids",))
    if head is not None and not inputs.get("hidden_states"):
        raise ModelFormatError(f"{where}: a draft head needs field 'inputs.hidden_states'; {FIX}")
    if kv is None and state is None:
        raise ModelFormatError(f"{where}: the manifest declares neither a KV cache ('kv_cache') nor recurrent "
                               f"state ('state'); {FIX}")
    outputs = f.names("outputs", ("logits",))
    hidden_layers = _layers(f, "hidden_layers", kv.layers if kv is not None else None)
    if hidden_layers and not outputs.get("hidden_states"):
        raise ModelFormatError(f"{where}: field 'hidden_layers' describes the 'hidden_states' output, and "
                               f"'outputs.hidden_states' is absent; {FIX}")
    kind = f.choice("graph_kind", GRAPH_KINDS) if "graph_kind" in data else "portable"
    if kind == "fused" and (kv is None or kv.capacity is None):
        raise ModelFormatError(f"{where}: a fused graph needs field 'kv_cache.capacity' (its KV buffer length); {FIX}")
    if kind == "fused":
        for role in ("seqlens_k", "total_sequence_length", "num_logits"):
            if not inputs.get(role):
                raise ModelFormatError(f"{where}: a fused graph needs field 'inputs.{role}'; {FIX}")
        if f.integer("max_positions", 1) > kv.capacity:
            raise ModelFormatError(f"{where}: field 'max_positions' ({data['max_positions']}) exceeds "
                                   f"'kv_cache.capacity' ({kv.capacity}); {FIX}")
    return cls(
        architecture=f.text("architecture"), model_type=f.text("model_type"), vocab_size=vocab,
        max_positions=f.integer("max_positions", 1), graph=f.text("graph", file_name=True),
        dtype=f.choice("dtype", DTYPES), inputs=inputs, outputs=outputs, kv_cache=kv,
        bos_token_id=f.integer("bos_token_id", required=False, **token),
        eos_token_ids=tuple(f.integer(f"eos_token_ids[{i}]", value=t, **token) for i, t in enumerate(eos)),
        pad_token_id=f.integer("pad_token_id", 0, required=False),
        tokenizer=f.text("tokenizer", required=False, file_name=True),
        source=_source(f), versions=f.table("versions", required=False) or {},
        validation=f.table("validation", required=False) or {}, state=state, draft_head=head, graph_kind=kind,
        quantization=f.table("quantization", required=False), chat=chat, draft_vocab=draft_vocab,
        hidden_layers=hidden_layers, schema=schema)


def _layers(f: "_Fields", key: str, layers: int | None) -> tuple[int, ...]:
    """A list of layer counts, distinct and ascending, each below ``layers`` when known; () when absent."""
    v = f.get(key, required=False) or []
    if not isinstance(v, list) or not all(isinstance(j, int) and not isinstance(j, bool) for j in v) \
            or v != sorted(set(v)) or any(j < 1 or (layers is not None and j >= layers) for j in v):
        span = f"1..{layers - 1}" if layers is not None else ">= 1"
        raise f.fail(key, f"a list of distinct layer counts in ascending order, each in {span}", v)
    return tuple(v)


def _chat(f: "_Fields", token: dict) -> dict:
    c = f.sub("chat", ("template", "bos_token", "eos_token", "end_of_turn_ids"))
    ends = c.get("end_of_turn_ids", required=False) or []
    if not isinstance(ends, list):
        raise c.fail("end_of_turn_ids", "a list of token ids", ends)
    return {"template": c.text("template", file_name=True),
            "bos_token": c.text("bos_token", required=False), "eos_token": c.text("eos_token", required=False),
            "end_of_turn_ids": [c.integer(f"end_of_turn_ids[{i}]", value=t, **token) for i, t in enumerate(ends)]}
