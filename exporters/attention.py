"""The attention family: decoder-only transformers (llama, qwen2, mistral, gpt2, …) through optimum-onnx.

optimum writes one graph with a KV cache (``past_key_values.{i}.key/.value`` in,
``present.{i}.key/.value`` out); rlxrt optionally adds the last hidden state as
an output and converts the weights to fp16 or int8.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from rlxrt.errors import ExportError
from rlxrt.manifest import KVCacheLayout, Manifest

from .hidden import HIDDEN, add_hidden_output
from .validate import hidden_diff, reference_logits, validate
from .variants import DYNAMIC_INT8, to_fp16, to_int8

TASK = "text-generation-with-past"
PAST = ("past_key_values.{i}.key", "past_key_values.{i}.value", "present.{i}.key", "present.{i}.value")


def supported_model_types() -> list[str]:
    """The model types optimum-onnx exports with a KV cache."""
    import optimum.exporters.onnx.model_configs  # noqa: F401  (registers the architectures)
    from optimum.exporters.tasks import TasksManager

    return sorted(m for m, by in TasksManager._SUPPORTED_MODEL_TYPE.items()
                  if TASK in by.get("onnx", {}))


class Attention:
    """optimum's graph in fp32, fp16 or int8."""

    task = TASK

    def export(self, steps, torch, model, graph: Path, variant: str, with_hidden: bool) -> None:
        raw = graph.parent.with_name("raw")  # optimum's own output, next to the graph's folder
        steps.run("export", _optimum_export, model, raw / graph.name)
        if with_hidden:
            add_hidden_output(raw / graph.name, int(model.config.hidden_size))
        if variant == "float16":
            steps.run("fp16", to_fp16, raw / graph.name, graph)
        elif variant == "int8":
            steps.run("quantise", to_int8, raw / graph.name, graph)
        else:
            for f in raw.iterdir():
                if f.name.startswith(graph.name):
                    shutil.move(str(f), graph.parent / f.name)

    def layout(self, model, graph: Path, variant: str, with_hidden: bool) -> dict:
        cache_dtype = "float16" if variant == "float16" else "float32"
        inputs, outputs, kv = _kv_layout(graph, model.config.num_hidden_layers, cache_dtype)
        return {"dtype": variant, "inputs": inputs, "outputs": outputs, "kv_cache": kv, "state": None,
                "max_positions": int(getattr(model.config, "max_position_embeddings", 0) or 0),
                "quantization": dict(DYNAMIC_INT8) if variant == "int8" else None}

    def validate(self, torch, model, manifest: Manifest, run, tolerance: float, columns=None) -> dict:
        """``columns``: a draft-only graph's N tokens, the columns of PyTorch's logits its own are compared with."""
        prompt_len = 8
        ids, ref = reference_logits(torch, model, manifest.vocab_size, prompt_len=prompt_len, step_len=4)
        if columns is not None:
            ref = ref[..., columns]
        return validate(run, manifest, ids, ref, prompt_len, tolerance,
                        lambda *outs: hidden_diff(torch, model, ids, *outs, layers=manifest.hidden_layers))


def _optimum_export(model, graph: Path) -> None:
    import logging
    import warnings

    from optimum.exporters import onnx as optimum_onnx

    for name in ("optimum", "transformers", "torch.onnx"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimum_onnx.onnx_export_from_model(model, str(graph.parent), task=TASK, do_validation=False)
    if not graph.is_file():
        raise ExportError(f"optimum wrote no {graph.name} (files: {sorted(p.name for p in graph.parent.iterdir())})")


def _kv_layout(graph: Path, layers: int, dtype: str) -> tuple[dict, dict, KVCacheLayout]:
    import onnx

    proto = onnx.load(str(graph), load_external_data=False)
    ins = {i.name: i for i in proto.graph.input}
    outs = [o.name for o in proto.graph.output]
    for i in range(layers):
        for name in PAST[:2]:
            if name.format(i=i) not in ins:
                raise ExportError(f"exported graph lacks input {name.format(i=i)!r}; "
                                  f"its inputs are {sorted(ins)}")
        for name in PAST[2:]:
            if name.format(i=i) not in outs:
                raise ExportError(f"exported graph lacks output {name.format(i=i)!r}")
    dims = ins["past_key_values.0.key"].type.tensor_type.shape.dim
    kv_heads, head_dim = dims[1].dim_value, dims[3].dim_value
    if not kv_heads or not head_dim:
        raise ExportError("exported graph has no static kv-heads/head-dim in its past inputs")
    inputs = {role: (role if role in ins else None) for role in ("input_ids", "attention_mask", "position_ids")}
    outputs = {"logits": "logits" if "logits" in outs else None,
               "hidden_states": HIDDEN if HIDDEN in outs else None}
    return inputs, outputs, KVCacheLayout(layers, kv_heads, head_dim, dtype, *PAST)
