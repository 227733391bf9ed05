"""Whether a graph computes each row of a (k+1)-row verification as a one-row step computes it.

Speculative output equals plain output only if the target scores a drafted position in a verification as it
would in a step of its own. Float kernels meet that up to rounding (ONNX Runtime's MatMul and attention take
other paths for several rows: ~1e-6 apart in float32), and bit for bit where rlxrt's CPU kernels run every
MatMul and attention (``cpu_kernels.Plan.rows_exact``). Two kinds of node break it outright:

- dynamic activation quantisation (``DynamicQuantizeLinear`` and the ops ONNX Runtime fuses it into): one
  scale over all rows of a call, so a row's value depends on the rows beside it;
- ``MatMulNBits`` at accuracy level 4 (int8 activations) on ONNX Runtime's kernels, whose multi-row path
  differs from its one-row path by up to 0.5 in the logits (measured).

``mixed_rows`` names them and the fix that works for the graph at hand; a Session refuses to speculate over
such a target.
"""
from __future__ import annotations

from . import cpu_kernels

DYNAMIC = ("DynamicQuantizeLinear", "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "DynamicQuantizeLSTM",
           "QAttention")
"""Ops that quantise activations with one scale computed over the whole input of a call."""


def _int8_activations(node) -> bool:
    return node.op_type == "MatMulNBits" and cpu_kernels._attrs(node).get("accuracy_level", 0) == 4


def mixed_rows(model, kernels: cpu_kernels.Plan, provider: str) -> str | None:
    """Why a verification's rows are not computed like one-row steps in ``model`` (an onnx ModelProto, weights
    loaded or not) as ``kernels`` will rewrite it for ``provider``, with the fix; None when they are (up to
    float rounding)."""
    walked = list(cpu_kernels._walk(model.graph))
    dynamic = sorted({n.op_type for n in walked if n.op_type in DYNAMIC})
    if dynamic:
        return (f"the graph quantises its activations dynamically ({', '.join(dynamic)}: one scale over all rows "
                "of a call), so a verification's rows differ from one-row steps and speculative output would not "
                "equal plain output; no kernel set changes that. Decode it without a speculator, or export the "
                "target without dynamic int8: in float32, or (llama, mistral, qwen2, qwen3) as the fused graph "
                "with --quantize int8 or int4, whose rows rlxrt's CPU kernels compute alike")
    level4 = [i for i, n in enumerate(walked) if _int8_activations(n)]
    left = [i for i in level4 if i not in set(kernels.nodes)]
    if not left:
        return None
    why = (f"{len(left)} of its {len(level4)} MatMulNBits with int8 activations (accuracy level 4) run on ONNX "
           "Runtime's kernels, whose (k+1)-row verification differs from one-row steps, so speculative output "
           "would not equal plain output")
    return f"{why}; {_fix(model, provider, level4)}"


def _fix(model, provider: str, level4: list[int]) -> str:
    """What makes such a graph speculate exactly here: rlxrt's kernels when they take every such node, else
    another export."""
    other = ("export the target with --quantize int4 (float32 compute, --int4-compute fp32) or in float32, or "
             "decode it without a speculator")
    if provider != "cpu":
        return f"rlxrt's row-exact kernels run on the CPU only, and this session runs on {provider}: {other}"
    if cpu_kernels.library() is None:
        return f"rlxrt's kernel library was not built at install (reinstall rlxrt with a C compiler present), or {other}"
    forced = set(cpu_kernels.plan(model, "rlxrt", provider).nodes)
    if all(i in forced for i in level4):
        return ("compile it with cpu_kernels = rlxrt (its kernels compute a row the same alone or in a "
                f"verification), or {other}")
    return f"rlxrt's kernels cannot take all of them (a block size other than 32, zero points): {other}"
