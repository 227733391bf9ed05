"""Expose the last hidden state (the input of the LM head) as an extra graph output.

Heads that draft from the target's hidden states (MTP, EAGLE-style) need it.
The tensor is already computed for the logits, so fetching it costs a copy
and nothing else; a session that does not ask for it never sees it.
"""
from __future__ import annotations

from pathlib import Path

from rlxrt.errors import ExportError

HIDDEN = "hidden_states"


def _lm_head_input(graph, logits: str) -> tuple[str, str]:
    """(hidden tensor, weight tensor) of the MatMul/Gemm that produces ``logits`` (through an optional bias Add)."""
    producers = {out: n for n in graph.node for out in n.output}
    node = producers.get(logits)
    while node is not None and node.op_type in ("Add", "Identity", "Cast"):
        node = next((producers[i] for i in node.input if i in producers
                     and producers[i].op_type in ("MatMul", "Gemm", "Add", "Identity", "Cast")), None)
    if node is None or node.op_type not in ("MatMul", "Gemm"):
        raise ExportError(f"cannot find the LM head (a MatMul producing {logits!r}) in the exported graph; "
                          "export without --with-hidden-states")
    return node.input[0], node.input[1]


def add_hidden_output(path: Path, hidden_size: int, logits: str = "logits") -> str:
    """Add output ``hidden_states`` [batch, sequence, hidden_size] to the graph at ``path`` (in place)."""
    import onnx
    from onnx import TensorProto, helper

    proto = onnx.load(str(path), load_external_data=False)
    g = proto.graph
    if any(o.name == HIDDEN for o in g.output):
        return HIDDEN
    hidden, _ = _lm_head_input(g, logits)
    g.node.append(helper.make_node("Identity", [hidden], [HIDDEN], name="rlxrt_hidden_states"))
    g.output.append(helper.make_tensor_value_info(HIDDEN, TensorProto.FLOAT,
                                                  ["batch_size", "sequence_length", hidden_size]))
    onnx.save(proto, str(path))
    return HIDDEN
