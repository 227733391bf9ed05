"""A float32 fused graph read back into its Hugging Face weights, and built again in another dtype.

The shipped pair exists as float32 fused graphs; a GPU needs them in float16 (ONNX Runtime's CUDA
GroupQueryAttention is fp16/bf16 only). Their weights are the graphs' own initializers, named by
``fused.Builder``: this inverts those names (QKV split back into q, k and v; every MatMul weight transposed
back to a Linear's [out, in]) for the graphs it writes for Llama-style models without biases, q/k norms,
quantisation or a draft vocabulary, and anything else is refused. Built again with the same ``config.json`` in
float32 the graph is the same graph (``tests/test_fused_weights.py``); in float16 it is the same weights,
rounded once. The manifest keeps the source's weights hash, so a head trained for the float32 graph binds to it.
"""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np

from rlxrt.errors import ExportError
from rlxrt.manifest import Manifest

from .deps import versions
from .export import GRAPH
from .fused import build_graph, fused_layout

LAYER = re.compile(r"l(\d+)\.(in_norm|qkv|o|post_norm|gate|up|down)\.weight")


def weights_of(graph: Path, config: dict) -> dict[str, np.ndarray]:
    """The Hugging Face weights of the fused float32 graph ``graph`` built from ``config``."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(graph))
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    heads, kv = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    d = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    out = {"model.embed_tokens.weight": inits.pop("embed.weight"), "model.norm.weight": inits.pop("final_norm.weight")}
    names = {"in_norm": "input_layernorm", "post_norm": "post_attention_layernorm"}
    for name in [n for n in inits if LAYER.fullmatch(n)]:
        i, part = LAYER.fullmatch(name).groups()
        w, p = inits.pop(name), f"model.layers.{i}."
        if part in names:
            out[f"{p}{names[part]}.weight"] = w
        elif part == "qkv":
            q, k, v = np.split(w.T, [heads * d, (heads + kv) * d])
            out.update({f"{p}self_attn.q_proj.weight": q, f"{p}self_attn.k_proj.weight": k,
                        f"{p}self_attn.v_proj.weight": v})
        else:
            out[f"{p}{'self_attn.o_proj' if part == 'o' else 'mlp.' + part + '_proj'}.weight"] = np.ascontiguousarray(w.T)
    if "lm_head.weight" in inits:  # an untied output layer: [H, V] in a MatMul
        out["lm_head.weight"] = np.ascontiguousarray(inits.pop("lm_head.weight").T)
    if "lm_head.rows" in inits:  # the same, as the greedy head's table [V, H]
        out["lm_head.weight"] = inits.pop("lm_head.rows")
    derived = ("cos_cache", "sin_cache", "greedy.")  # computed from the config and the weights when built
    left = sorted(n for n in inits if not n.startswith(derived) and inits[n].dtype != np.int64)
    if left or any(a.dtype != np.float32 for a in out.values()):
        raise ExportError(f"{graph} is not a float32 fused graph this reads back (unknown weights: {left[:4]}); "
                          "export it again from its source instead")
    return out


def rebuild(src: Path, out: Path, dtype: str) -> Manifest:
    """The model directory ``src`` (a float32 fused export holding its ``config.json``) built again in ``dtype``
    into ``out``: the same weights, manifest and files, its hidden states as before."""
    old = Manifest.load(src)
    if old.graph_kind != "fused" or old.dtype != "float32" or old.quantization or old.draft_vocab:
        raise ExportError(f"{src} is not a float32 fused export without quantisation (it is {old.graph_kind}, "
                          f"{old.dtype}); export it again from its source with --dtype {dtype}")
    config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    weights = weights_of(src / old.graph, config)
    work = out.with_name(f".{out.name}.partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    with_hidden = bool(old.outputs.get("hidden_states"))
    spec = build_graph(config, weights, work / GRAPH, capacity=old.kv_cache.capacity, with_hidden=with_hidden,
                       dtype=dtype, greedy_head=bool(old.inputs.get("greedy")) and dtype == "float32")
    for f in src.iterdir():
        if not f.name.startswith(("model.onnx", "rlxrt.json")):
            shutil.copy2(f, work / f.name)
    manifest = replace(old, graph=GRAPH, **fused_layout(spec, with_hidden), versions=versions(),
                       source={**old.source, "built_from": f"the float32 fused graph's own weights, as {dtype}"},
                       validation={"skipped": True, "reason": f"the {dtype} graph of the float32 one's weights"})
    manifest.write(work)
    shutil.rmtree(out, ignore_errors=True)
    work.rename(out)
    return manifest
