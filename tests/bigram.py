"""Tiny decoder graphs built with onnx.helper whose next-token distribution is a known bigram table.

They carry a real (1-layer, 1-head, dim-1) KV cache, so the Session's cache
handling runs as for an exported model, and a manifest like `rlxrt export`'s.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from rlxrt.manifest import KVCacheLayout, Manifest


def make_bigram_model(out: Path, table: np.ndarray, max_positions: int = 64, eos=()) -> Path:
    """``table[prev]`` is the next-token distribution after token ``prev``; logits = log(table)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    v = table.shape[0]
    logp = np.log(np.maximum(table, 1e-30)).astype(np.float32)
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    inputs = [
        helper.make_tensor_value_info("input_ids", i64, [1, "s"]),
        helper.make_tensor_value_info("attention_mask", i64, [1, "t"]),
        helper.make_tensor_value_info("position_ids", i64, [1, "s"]),
        helper.make_tensor_value_info("past_key_values.0.key", f, [1, 1, "p", 1]),
        helper.make_tensor_value_info("past_key_values.0.value", f, [1, 1, "p", 1]),
    ]
    outputs = [
        helper.make_tensor_value_info("logits", f, [1, "s", v]),
        helper.make_tensor_value_info("present.0.key", f, [1, 1, "t", 1]),
        helper.make_tensor_value_info("present.0.value", f, [1, 1, "t", 1]),
    ]
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["logits"], axis=0),
        helper.make_node("Cast", ["input_ids"], ["ids_f"], to=f),
        helper.make_node("Reshape", ["ids_f", "kv_shape"], ["new_kv"]),
        helper.make_node("Concat", ["past_key_values.0.key", "new_kv"], ["present.0.key"], axis=2),
        helper.make_node("Concat", ["past_key_values.0.value", "new_kv"], ["present.0.value"], axis=2),
    ]
    inits = [numpy_helper.from_array(logp, "table"),
             numpy_helper.from_array(np.array([1, 1, -1, 1], np.int64), "kv_shape")]
    graph = helper.make_graph(nodes, "bigram", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    out.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(out / "model.onnx"))
    Manifest(
        architecture="Bigram", model_type="bigram", vocab_size=v, max_positions=max_positions,
        graph="model.onnx", dtype="float32",
        inputs={"input_ids": "input_ids", "attention_mask": "attention_mask", "position_ids": "position_ids"},
        outputs={"logits": "logits", "hidden_states": None},
        kv_cache=KVCacheLayout(1, 1, 1, "float32", "past_key_values.{i}.key", "past_key_values.{i}.value",
                               "present.{i}.key", "present.{i}.value"),
        eos_token_ids=tuple(eos),
    ).write(out)
    return out


def rolled_table(base, v: int) -> np.ndarray:
    base = np.asarray(base, float)
    base = base / base.sum()
    return np.stack([np.roll(base, s) for s in range(v)])
