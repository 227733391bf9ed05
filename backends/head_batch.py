"""The batched variant of an MTP head's graph: the drafts of several sequences in one call.

A call feeds the new rows of N sequences one after another, [1, T], with ``sequences`` [N, 3] int32 as the
target's batched graph takes it (slot, first position, count); ``state`` becomes [N, R], each sequence's gated
state before its rows, and ``last_rows`` [N] int64 the row of each sequence whose logits and hidden state the
call returns ([1, N, ...]; ``states`` stays the state after every row, [T, R]). The attention layer's keys and
values live in buffers [slots, heads, capacity, head size], bound as both past and present (capacity at most
the head's max positions, the rows of its rotary tables).

The rewrite keeps every row-wise op and replaces the two that mix rows: the closed-form scan becomes
``StreamScan`` (stream_scan.h: the recurrence row after row, from each sequence's own start state) and the
attention over a concatenated cache ``StreamAttentionBatch`` with rotary tables that turn nothing (cos 1,
sin 0: the head has no position encoding). With rlxrt's kernels for every MatMul and norm, a sequence's rows
are then bitwise the same whatever the other sequences of the call, so a seeded request drafts the same
tokens alone and beside others. They are not bitwise those of the one-sequence head graph (its scan sums in
closed form), which is another build of the same head: the acceptance rule reads the distribution a draft was
sampled from, so either is exact.

A head without an attention layer reads one hidden state a sequence, ``hidden_states`` [1, N, H] (its last
row's, as the one-sequence graph reads one), and has no KV buffers; the last-row slices of its input
embedding and state become Gathers of ``last_rows``. A head that reads the target's residual streams beside
its last hidden state does not batch (``refusal``).
"""
from __future__ import annotations

import numpy as np

from rlxrt.errors import ModelFormatError

from .cpu_kernels import DOMAIN

SEQUENCES, LAST_ROWS = "sequences", "last_rows"
SCAN_OP, ATTENTION_OP = "StreamScan", "StreamAttentionBatch"
SCAN = ("log_a_t", "cum", "cum_t", "cum_u", "diff", "decay", "decay_causal", "b_t", "b_u", "terms", "summed_s",
        "decay0", "s0", "from_s0", "states_t", "states_all")
"""What the closed-form scan's nodes make (``exporters/head_graph._scan``): StreamScan makes ``states_all``."""
ATTENTION = ("present_key.0", "present_value.0", "x_last", "q_4d", "q_t", "scores", "weights", "attended",
             "attended_t", "attended_row", "z_last", "k_new_4d", "k_new_t", "v_new_4d", "v_new_t")
"""What the attention over a concatenated cache makes (``exporters/head_graph._attention``) but its
projections: StreamAttentionBatch, then a Gather of each sequence's last row, make what they fed."""
ATTENDED = ("q", "k_new", "v_new", "a", "z_all", "attn_out")
"""What the attention's replacement reads, or reads it."""
FLAT = ("e_last", "state_last")
"""A head without attention: the slices of the last row that a Gather of each sequence's last row replaces."""


def refusal(manifest) -> str | None:
    """Why this head's graph cannot be batched (None: it can), with the fix."""
    head = manifest.draft_head if manifest is not None else None
    if not head or head.get("kind") != "mtp":
        return "only an MTP head's graph batches this way"
    if head.get("hidden_layers"):
        return "the head reads the target's residual streams beside its last hidden state"
    if head.get("attention_heads") and (manifest.kv_cache is None or manifest.kv_cache.layers != 1):
        return "the head's manifest declares no one-layer cache for its attention"
    return None


def shape(manifest) -> tuple[int, int, int]:
    """(heads, head size, positions) of the head's attention, (0, 0, 0) for none: what ``batch_head`` takes."""
    kv = manifest.kv_cache if manifest.draft_head.get("attention_heads") else None
    return (kv.kv_heads, kv.head_dim, manifest.max_positions) if kv is not None else (0, 0, 0)


def batch_head(model, heads: int, head_dim: int, positions: int) -> None:
    """Rewrite the head graph ``model`` (as ``exporters/head_graph.py`` writes it) in place into its batched
    variant, before rlxrt's kernels are planned on it (``heads`` 0: a head without attention)."""
    from onnx import TensorProto, helper

    g = model.graph
    produced = {o for n in g.node for o in n.output}
    replaced = SCAN + (ATTENTION if heads else FLAT)
    missing = [n for n in replaced + ("log_a", "b", "e") + (ATTENDED if heads else ()) if n not in produced]
    if missing:
        raise ModelFormatError(f"the head graph makes no {missing}: it is not one rlxrt wrote")
    kept = [n for n in g.node if not set(replaced) & set(n.output)]
    made = [helper.make_node(SCAN_OP, ["log_a", "b", "state", SEQUENCES], ["states_all"], name="scan", domain=DOMAIN)]
    if heads:
        made += _attention(g, kept, heads, head_dim, positions)
    else:  # the last row of each sequence's input embedding and state
        made += [helper.make_node("Gather", ["e", LAST_ROWS], ["e_last"], name="e_last", axis=1),
                 helper.make_node("Gather", ["states_all", LAST_ROWS], ["state_last"], name="state_last", axis=1)]
    del g.node[:]
    g.node.extend(_ordered(kept + made, {i.name for i in g.input} | {t.name for t in g.initializer}
                           | {SEQUENCES, LAST_ROWS}))
    state = next(v for v in g.input if v.name == "state")
    width = state.type.tensor_type.shape.dim[-1].dim_value
    state.CopyFrom(helper.make_tensor_value_info("state", TensorProto.FLOAT, ["sequences", width]))
    for v in list(g.input) + list(g.output):
        dims = v.type.tensor_type.shape.dim
        if v.name.startswith(("past_", "present_")):
            v.CopyFrom(helper.make_tensor_value_info(v.name, TensorProto.FLOAT, ["slots", heads, "capacity", head_dim]))
        elif v.name in ("logits", "hidden_out") or v.name == "hidden_states" and not heads:
            dims[1].Clear()
            dims[1].dim_param = "sequences"
    g.input.extend([helper.make_tensor_value_info(SEQUENCES, TensorProto.INT32, ["sequences", 3]),
                    helper.make_tensor_value_info(LAST_ROWS, TensorProto.INT64, ["sequences"])])
    from .batched import _prune

    _prune(g)
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))


def _attention(g, kept: list, heads: int, head_dim: int, positions: int) -> list:
    """Every row's query (the kernel attends each row over its sequence's slot), then the last row of each
    sequence: the nodes that replace ``ATTENTION``."""
    from onnx import helper, numpy_helper

    for node in kept:
        if node.output[0] == "q":
            node.input[0] = "a"
        elif node.output[0] == "attn_out":
            node.input[0] = "attended_row"
    half = np.zeros((positions, head_dim // 2), np.float32)
    g.initializer.extend([numpy_helper.from_array(half + 1, "turn_cos"), numpy_helper.from_array(half, "turn_sin")])
    return [
        helper.make_node(ATTENTION_OP, ["q", "k_new", "v_new", "past_key.0", "past_value.0", SEQUENCES, "turn_cos",
                                        "turn_sin"], ["attended_all", "present_key.0", "present_value.0"],
                         name="attention", domain=DOMAIN, num_heads=heads, kv_num_heads=heads,
                         scale=float(1 / np.sqrt(head_dim)), local_window_size=-1),
        helper.make_node("Gather", ["attended_all", LAST_ROWS], ["attended_row"], name="attended_row", axis=1),
        helper.make_node("Gather", ["z_all", LAST_ROWS], ["z_last"], name="z_last", axis=1),
    ]


def _ordered(nodes: list, available: set[str]) -> list:
    """``nodes`` in an order where each runs after what it reads (ONNX wants its nodes sorted)."""
    out, left, have = [], list(nodes), set(available)
    while left:
        ready = [n for n in left if all(i in have or not i for i in n.input)]
        if not ready:
            raise ModelFormatError("the batched head graph has a cycle or reads a name nothing makes")
        for n in ready:
            out.append(n)
            have.update(n.output)
        left = [n for n in left if all(id(n) != id(r) for r in ready)]
    return out


def batched_manifest(m):
    """The manifest as the batched head graph meets it: with the inputs the rewrite adds."""
    import dataclasses

    return dataclasses.replace(m, inputs={**m.inputs, SEQUENCES: SEQUENCES, LAST_ROWS: LAST_ROWS})
