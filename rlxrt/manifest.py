"""``rlxrt.json``: the one contract between exporters and sessions.

A model directory written by ``rlxrt export`` holds the graph, the tokenizer
and this manifest. Sessions read only the manifest; they never infer anything
from file or tensor names. The schema is versioned (``schema``); a reader
refuses a major version it does not know.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import ModelFormatError

MANIFEST_NAME = "rlxrt.json"
SCHEMA = "rlxrt.manifest/1"


@dataclass(frozen=True)
class KVCacheLayout:
    """Where the KV cache lives in the graph's inputs and outputs."""

    layers: int
    """Number of attention layers that carry a KV cache."""
    kv_heads: int
    """Key/value heads per layer (not repeated for grouped-query attention)."""
    head_dim: int
    """Size of one head."""
    dtype: str
    """numpy dtype name of the cache tensors (float32, float16)."""
    past_key: str
    """Input name pattern of the past keys, with ``{i}`` for the layer (``past_key_values.{i}.key``)."""
    past_value: str
    """Input name pattern of the past values."""
    present_key: str
    """Output name pattern of the present keys (``present.{i}.key``)."""
    present_value: str
    """Output name pattern of the present values."""
    seq_axis: int = 2
    """Axis of the sequence length in a cache tensor [batch, kv_heads, seq, head_dim]."""

    def names(self, i: int) -> tuple[str, str, str, str]:
        return (self.past_key.format(i=i), self.past_value.format(i=i),
                self.present_key.format(i=i), self.present_value.format(i=i))


@dataclass(frozen=True)
class StateTensor:
    """One recurrent state tensor: fed before a call, returned after each fed position."""

    input: str
    """Graph input: the state before the first token of the call, shape ``shape``."""
    output: str
    """Graph output: the state after each token of the call, shape [s, *shape]."""
    shape: tuple[int, ...]
    """Shape of one state (e.g. [layers, 1, channels, state size])."""
    dtype: str
    """numpy dtype name."""


@dataclass(frozen=True)
class StateLayout:
    """Recurrent state (SSM / RNN) carried between calls instead of, or besides, a KV cache."""

    tensors: tuple[StateTensor, ...]
    max_tokens_per_call: int
    """Longest input of one call (the graph's cost grows with its square); longer inputs go in chunks."""


@dataclass(frozen=True)
class Manifest:
    """Everything a session needs to run an exported graph."""

    architecture: str
    """Hugging Face architecture class (``LlamaForCausalLM``)."""
    model_type: str
    """Hugging Face ``model_type`` (``llama``)."""
    vocab_size: int
    """Width of the logits (rows of the embedding)."""
    max_positions: int
    """Longest sequence (prompt + generated) the model supports."""
    graph: str
    """File name of the ONNX graph inside the directory."""
    dtype: str
    """Weights variant: float32, float16 or int8 (dynamic quantisation)."""
    inputs: dict[str, str | None]
    """Role -> graph input name: input_ids, attention_mask, position_ids (None when the graph has no such input)."""
    outputs: dict[str, str | None]
    """Role -> graph output name: logits, hidden_states (None when absent)."""
    kv_cache: KVCacheLayout | None
    """The KV cache layout, or None for a graph without one."""
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    """Tokens that end a generation."""
    pad_token_id: int | None = None
    tokenizer: str | None = None
    """File name of the tokenizer (``tokenizer.json``) or None when the export has none (token-id use only)."""
    source: dict[str, Any] = field(default_factory=dict)
    """Where the model came from: ``path_or_id`` and ``weights_sha256``."""
    versions: dict[str, str] = field(default_factory=dict)
    """Versions of the tools that made the export."""
    validation: dict[str, Any] = field(default_factory=dict)
    """Result of validating ORT against PyTorch (max abs diff, argmax agreement, tolerance)."""
    state: StateLayout | None = None
    """Recurrent state tensors, or None for a pure attention model."""
    draft_head: dict[str, Any] | None = None
    """For a draft head (not a language model): ``kind`` (``mtp``), ``hidden_size`` and the ``target``
    it was trained on (``path_or_id``, ``weights_sha256``); None for a model."""
    schema: str = SCHEMA

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["eos_token_ids"] = list(self.eos_token_ids)
        return out

    def write(self, directory: str | os.PathLike) -> Path:
        path = Path(directory) / MANIFEST_NAME
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "manifest") -> "Manifest":
        schema = data.get("schema")
        if not isinstance(schema, str) or not schema.startswith("rlxrt.manifest/"):
            raise ModelFormatError(f"{where}: missing or foreign 'schema' {schema!r}; expected {SCHEMA!r}")
        if schema.split("/")[-1] != SCHEMA.split("/")[-1]:
            raise ModelFormatError(
                f"{where}: schema {schema!r} is not supported by this rlxrt (reads {SCHEMA!r}); "
                "re-export the model with this version of rlxrt"
            )
        data = dict(data)
        kv = data.get("kv_cache")
        try:
            data["kv_cache"] = KVCacheLayout(**kv) if kv is not None else None
            st = data.get("state")
            if st is not None:
                tensors = tuple(StateTensor(t["input"], t["output"], tuple(int(d) for d in t["shape"]), t["dtype"])
                                for t in st["tensors"])
                data["state"] = StateLayout(tensors, int(st["max_tokens_per_call"]))
            data["eos_token_ids"] = tuple(int(t) for t in data.get("eos_token_ids") or ())
            manifest = cls(**data)
        except (TypeError, KeyError) as exc:
            raise ModelFormatError(f"{where}: malformed manifest ({exc}); re-export the model") from None
        manifest.check(where)
        return manifest

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "Manifest":
        path = Path(directory) / MANIFEST_NAME
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelFormatError(
                f"{str(directory)!r} has no {MANIFEST_NAME}; export the model with `rlxrt export SRC OUT`"
            ) from None
        except json.JSONDecodeError as exc:
            raise ModelFormatError(f"{str(path)!r} is not valid JSON ({exc}); re-export the model") from None
        return cls.from_dict(data, where=str(path))

    def check(self, where: str = "manifest") -> None:
        """Internal consistency; raises ModelFormatError naming the bad field."""
        if self.vocab_size <= 0:
            raise ModelFormatError(f"{where}: vocab_size must be positive, got {self.vocab_size}")
        if self.max_positions <= 0:
            raise ModelFormatError(f"{where}: max_positions must be positive, got {self.max_positions}")
        if not self.inputs.get("input_ids"):
            raise ModelFormatError(f"{where}: inputs.input_ids is required")
        if not self.outputs.get("logits"):
            raise ModelFormatError(f"{where}: outputs.logits is required")
        if self.kv_cache is None and self.state is None:
            raise ModelFormatError(f"{where}: the manifest declares neither a KV cache nor recurrent state")
        for t in self.eos_token_ids:
            if not 0 <= t < self.vocab_size:
                raise ModelFormatError(f"{where}: eos token id {t} is outside the vocabulary (size {self.vocab_size})")


def is_model_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / MANIFEST_NAME).is_file()
