"""The manifest against the graph it describes: every name it gives exists, and every width it states
equals the graph's where the graph fixes it. Run at compile time, so a bad model directory fails at load
naming the field, never at ``generate()`` as ONNX Runtime's text."""
from __future__ import annotations

from typing import Sequence

from rlxrt.errors import ModelFormatError
from rlxrt.manifest import Manifest

ORT_TYPES = {"float32": "tensor(float)", "float16": "tensor(float16)", "float64": "tensor(double)",
             "bfloat16": "tensor(bfloat16)", "int64": "tensor(int64)", "int32": "tensor(int32)"}


def check_contract(m: Manifest, inputs: Sequence, outputs: Sequence, where: str) -> None:
    """``inputs``/``outputs`` are the session's TensorSpecs (name, shape, dtype); raises ModelFormatError."""
    ins, outs = {t.name: t for t in inputs}, {t.name: t for t in outputs}
    fix = "re-export the model, or correct the field"

    def need(table: dict, name: str, field: str):
        if name not in table:
            kind = "input" if table is ins else "output"
            raise ModelFormatError(f"{where}: {field} names graph {kind} {name!r}, which the graph does not have "
                                   f"(its {kind}s: {', '.join(sorted(table))[:300]}); {fix}")
        return table[name]

    def dims(spec, field: str, expected: dict[int, int]) -> None:
        for axis, size in expected.items():
            if -len(spec.shape) <= axis < len(spec.shape) and isinstance(spec.shape[axis], int) \
                    and spec.shape[axis] != size:
                raise ModelFormatError(f"{where}: {field} is {size}, but graph tensor {spec.name!r} has "
                                       f"{spec.shape[axis]} on axis {axis} (shape {list(spec.shape)}); {fix}")

    def dtype(spec, field: str, name: str) -> None:
        want = ORT_TYPES.get(name)
        if want is not None and spec.dtype != want:
            raise ModelFormatError(f"{where}: {field} is {name!r}, but graph tensor {spec.name!r} is {spec.dtype}; "
                                   f"{fix}")

    for role, name in m.inputs.items():
        if name:
            need(ins, name, f"inputs.{role}")
    for role, name in m.outputs.items():
        if name:
            need(outs, name, f"outputs.{role}")
    if m.draft_vocab:  # a draft-only export: logits over its N tokens
        dims(outs[m.outputs["logits"]], "draft_vocab.size", {-1: int(m.draft_vocab["size"])})
    else:
        dims(outs[m.outputs["logits"]], "vocab_size", {-1: m.vocab_size})
    hidden_in = m.inputs.get("hidden_states")
    if hidden_in and m.draft_head:
        dims(ins[hidden_in], "draft_head.hidden_size", {-1: int(m.draft_head["hidden_size"])})
    kv = m.kv_cache
    if kv is not None:
        for i in range(kv.layers):
            for j, name in enumerate(kv.names(i)):
                field = ("kv_cache.past_key", "kv_cache.past_value", "kv_cache.present_key",
                         "kv_cache.present_value")[j] + f" (layer {i})"
                spec = need(ins if j < 2 else outs, name, field)
                dims(spec, "kv_cache.kv_heads", {1: kv.kv_heads})
                dims(spec, "kv_cache.head_dim", {3: kv.head_dim})
                dtype(spec, "kv_cache.dtype", kv.dtype)
        extra = [n for n in ins if n.startswith(kv.past_key.split("{i}")[0]) and n not in
                 {x for i in range(kv.layers) for x in kv.names(i)[:2]}]
        if extra:
            raise ModelFormatError(f"{where}: kv_cache.layers is {kv.layers}, but the graph has more cache inputs "
                                   f"({', '.join(extra[:4])}); {fix}")
    known = {n for n in m.inputs.values() if n}
    if kv is not None:
        known |= {n for i in range(kv.layers) for n in kv.names(i)[:2]}
    if m.state is not None:
        known |= {t.input for t in m.state.tensors}
    unknown = [n for n in ins if n not in known]
    if unknown:
        raise ModelFormatError(f"{where}: the graph has inputs {', '.join(map(repr, unknown[:4]))} the manifest does "
                               f"not declare (inputs: {m.inputs}); nothing would feed them; {fix}")
    if m.state is not None:
        for t in m.state.tensors:
            spec = need(ins, t.input, "state.tensors[].input")
            dims(spec, f"state tensor {t.input!r} shape", dict(enumerate(t.shape)))
            dtype(spec, f"state tensor {t.input!r} dtype", t.dtype)
            need(outs, t.output, "state.tensors[].output")
