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
from .files import decode, parse_json, read_model_file
from .limits import MAX_MANIFEST_BYTES

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
    """Output name pattern of the present values. Every cache tensor is [batch, kv_heads, seq, head_dim]."""
    capacity: int | None = None
    """Fused graphs: the length of the one buffer per tensor that is bound as both past and present (the
    longest sequence a session can run); None for portable graphs, whose past grows with every call."""

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
    """Weights variant: float32, float16, int8 (dynamic quantisation) or int4 (fused graphs, see quantization)."""
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
    quantization: dict[str, Any] | None = None
    """How the weights were quantised (method, bits, block size, accuracy level), or None. Exactness is then
    relative to the quantised graph: speculative output equals its plain output."""
    graph_kind: str = "portable"
    """``portable`` (optimum's graph: past in, a longer present out, all logits rows) or ``fused`` (rlxrt's
    own graph: GroupQueryAttention over a shared KV buffer, logits for the last ``num_logits`` rows)."""
    draft_head: dict[str, Any] | None = None
    """For a draft head (not a language model): ``kind`` (``mtp``), ``hidden_size`` (the width of the target's
    ``hidden_states`` it reads), the ``target`` it was trained on (``path_or_id``, ``weights_sha256``) and the
    target's ``hidden_layers`` it reads (absent: none); None for a model."""
    draft_vocab: dict[str, Any] | None = None
    """A draft-only export whose logits cover N tokens of the vocabulary (``rlxrt export --draft-vocab N``):
    ``size`` (N), ``ids`` (file name of the JSON list of those token ids, ascending: logit column j is token
    ``ids[j]``), ``corpus_tokens`` and ``corpus_coverage`` (the share of the counted corpus they cover). It
    drafts for a target of the whole vocabulary and is refused as a target. None for a full-vocabulary model."""
    chat: dict[str, Any] | None = None
    """The chat template of an instruct model, or None: ``template`` (file name of the Jinja template),
    ``bos_token`` and ``eos_token`` (the strings a template may use) and ``end_of_turn_ids`` (tokens that end
    a reply: the model's EOS ids and the tokenizer's ``eos_token``, e.g. ``<|im_end|>``)."""
    hidden_layers: tuple[int, ...] = ()
    """With a ``hidden_states`` output: the layers whose residual stream follows the LM head's input in it
    (transformers' ``hidden_states[j]``, j layers in), each as wide as the hidden size; () for the LM head's
    input alone (``rlxrt export --hidden-layers``, read by an MTP head trained on them)."""
    schema: str = SCHEMA

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["eos_token_ids"] = list(self.eos_token_ids)
        out["hidden_layers"] = list(self.hidden_layers)
        return out

    def write(self, directory: str | os.PathLike) -> Path:
        path = Path(directory) / MANIFEST_NAME
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "manifest") -> "Manifest":
        """Build and check a manifest; every wrong type, range or missing field is a ModelFormatError naming
        the field (see ``manifest_check.py``)."""
        from .manifest_check import parse

        return parse(cls, data, where)

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "Manifest":
        path = Path(directory) / MANIFEST_NAME
        if not os.path.lexists(path):
            raise ModelFormatError(
                f"{str(directory)!r} has no {MANIFEST_NAME}; export the model with `rlxrt export SRC OUT`")
        raw = read_model_file(directory, MANIFEST_NAME, "manifest", MAX_MANIFEST_BYTES)
        data = parse_json(decode(raw, path, "manifest", ModelFormatError), f"manifest {str(path)!r}", ModelFormatError)
        return cls.from_dict(data, where=str(path))


def is_model_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / MANIFEST_NAME).is_file()
