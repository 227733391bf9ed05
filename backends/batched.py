"""The batched variant of a fused graph: several sequences in one call, each in a slot of the KV buffers.

A call feeds the new tokens of N sequences one after another, [1, T] (T the sum of their counts: a prefill
chunk, a pending token and its drafts, or one token of a plain step), with ``sequences`` [N, 3] int32 saying
whose they are (slot, first position, count). The KV buffers are [slots, kv_heads, capacity, head_dim], bound
as both past and present; ``logit_rows`` [R] int64 picks the rows (of the T) whose logits the call returns.

Only rlxrt's CPU kernels run it: every MatMul streams its weights once for all T rows, and
``StreamAttentionBatch`` (stream_batch.h) computes each sequence as a call of its tokens alone computes it.
Every other op of a fused graph works row by row, so a row's logits are bitwise those of the same tokens fed
to the one-sequence graph: batching changes no output.

``batch(model, names)`` rewrites a fused graph already rewritten for rlxrt's kernels (``cpu_kernels.rewrite``):
the attention ops become ``StreamAttentionBatch``, the slice of the last ``num_logits`` rows a gather of
``logit_rows``, and what nothing reads any more is dropped; ``prepare`` first makes a greedy head's switch its
logits branch (the greedy ids read the fed tokens of one sequence).
"""
from __future__ import annotations

from rlxrt.errors import ModelFormatError

from .cpu_kernels import ATTENTION, DOMAIN

BATCH_OP = "StreamAttentionBatch"
SEQUENCES, LOGIT_ROWS = "sequences", "logit_rows"
DROPPED_INPUTS = ("seqlens_k", "total_sequence_length", "num_logits", "greedy")
DROPPED_OUTPUTS = ("next_ids", "greedy_fallbacks")


def refusal(manifest, kernels) -> str | None:
    """Why the graph cannot be batched under the ``kernels`` planned for it (None: it can), with the fix."""
    if manifest is None or manifest.graph_kind != "fused" or manifest.kv_cache is None:
        return "only a fused graph batches (export with --graph fused, a Llama-style model)"
    if manifest.dtype in ("float16", "bfloat16"):
        return f"rlxrt's CPU kernels take float32 and int4/int8 graphs, not {manifest.dtype}"
    if not (kernels.nodes and kernels.rows_exact):
        return (f"a batched step needs rlxrt's CPU kernels for every MatMul and attention (they are {kernels.state}); "
                "set cpu_kernels = rlxrt and run on the CPU provider")
    return None


def prepare(model, names: dict[str, str | None]) -> None:
    """Before rlxrt's rewrite is planned: a greedy head's switch becomes its logits branch, and what only the
    greedy branch read is dropped (``names`` maps the manifest's input roles to the graph's names)."""
    _inline_else(model.graph, names.get("greedy"))
    _prune(model.graph)


def batch(model, names: dict[str, str | None]) -> None:
    """Rewrite ``model`` (prepared, then rewritten for rlxrt's kernels) in place into the batched variant."""
    from onnx import TensorProto, helper

    g = model.graph
    for node in g.node:
        if node.op_type == ATTENTION and node.domain == DOMAIN:
            i = list(node.input)
            node.op_type = BATCH_OP
            del node.input[:]
            node.input.extend(i[:5] + [SEQUENCES] + i[7:9])
    _gather_rows(g, names["num_logits"])
    dropped = {names.get(role) for role in DROPPED_INPUTS} - {None}
    keep = [v for v in g.input if v.name not in dropped]
    del g.input[:]
    g.input.extend(keep)
    g.input.extend([helper.make_tensor_value_info(SEQUENCES, TensorProto.INT32, ["sequences", 3]),
                    helper.make_tensor_value_info(LOGIT_ROWS, TensorProto.INT64, ["rows"])])
    outs = [v for v in g.output if v.name not in DROPPED_OUTPUTS]
    del g.output[:]
    g.output.extend(outs)
    for v in list(g.input) + list(g.output):
        shape = v.type.tensor_type.shape
        if len(shape.dim) == 4 and v.name.startswith(("past_key_values.", "present.")):
            shape.dim[0].Clear()
            shape.dim[0].dim_param = "slots"
    _prune(g)


def _inline_else(g, greedy: str | None) -> None:
    """A greedy head's If on ``greedy`` becomes the nodes of its else branch (all logits)."""
    from onnx import helper

    for at, node in enumerate(g.node):
        if node.op_type == "If" and greedy and list(node.input) == [greedy]:
            branch = next(a.g for a in node.attribute if a.name == "else_branch")
            made = list(branch.node) + [helper.make_node("Identity", [src.name], [dst], name=f"{dst}.inlined")
                                        for src, dst in zip(branch.output, node.output)]
            del g.node[at]
            for offset, n in enumerate(made):
                g.node.insert(at + offset, n)
            return


def _gather_rows(g, num_logits: str) -> None:
    """The Slice of the last ``num_logits`` rows (its start the Neg of that input) becomes a Gather of
    ``logit_rows`` along the rows."""
    from onnx import helper

    negs = {n.output[0] for n in g.node if n.op_type == "Neg" and list(n.input) == [num_logits]}
    for node in g.node:
        if node.op_type == "Slice" and len(node.input) > 1 and node.input[1] in negs:
            node.CopyFrom(helper.make_node("Gather", [node.input[0], LOGIT_ROWS], list(node.output),
                                           name=node.name, axis=1))
            return
    raise ModelFormatError(f"the graph has no slice of its last {num_logits!r} rows: it is not an rlxrt fused graph")


def _prune(g) -> None:
    """Drop nodes and initializers that no graph output depends on."""
    from .cpu_kernels import _walk

    needed = {o.name for o in g.output}
    kept = []
    for node in reversed(list(g.node)):
        if any(o in needed for o in node.output):
            kept.append(node)
            needed.update(node.input)
            for attr in node.attribute:  # a subgraph reads names of the main graph too
                for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                    for inner in _walk(sub):
                        needed.update(inner.input)
    del g.node[:]
    g.node.extend(reversed(kept))
    inits = [t for t in g.initializer if t.name in needed]
    del g.initializer[:]
    g.initializer.extend(inits)


def batched_manifest(m):
    """The manifest as the batched graph meets it: without the inputs and outputs the rewrite drops."""
    import dataclasses

    inputs = {r: (None if r in DROPPED_INPUTS else n) for r, n in m.inputs.items()}
    return dataclasses.replace(m, inputs={**inputs, SEQUENCES: SEQUENCES, LOGIT_ROWS: LOGIT_ROWS},
                               outputs={r: (None if r in DROPPED_OUTPUTS else n) for r, n in m.outputs.items()})
