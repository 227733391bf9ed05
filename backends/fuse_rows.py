"""The row-wise ops between a fused graph's MatMuls on rlxrt's kernels (``stream_rows.h``).

On a batched step of a few rows ONNX Runtime's RMS norms and the Sigmoid, Mul, Mul of each SwiGLU cost more
than their arithmetic: each node wakes the intra-op threads (docs/kernels.md has the figures). ``fuse``
replaces, in the main graph of a model whose MatMuls ``cpu_kernels.rewrite`` has already replaced:

- ``SimplifiedLayerNormalization(x, gamma)`` over the last axis by ``StreamNorm``;
- ``SkipSimplifiedLayerNormalization(x, skip, gamma)`` without a bias, whose mean and inverse deviation nothing
  reads, by ``StreamSkipNorm`` (outputs y and the sum x + skip);
- ``Mul(Mul(g, Sigmoid(g)), u)`` by ``StreamSwiGLU(g, u)``, where g and u are outputs of rlxrt's MatMuls over
  the same input and of the same width (so of one shape), and nothing else reads the intermediate values.

Each computes a row the same whatever the other rows of the call, as the nodes they replace do.
"""
from __future__ import annotations

from .cpu_kernels import DOMAIN, OPS, _attrs, _walk

NORM, SKIP_NORM, SWIGLU = "StreamNorm", "StreamSkipNorm", "StreamSwiGLU"


def _readers(graph) -> dict[str, int]:
    """How many nodes (of this graph and its subgraphs) and graph outputs read each value."""
    counts: dict[str, int] = {}
    for node in _walk(graph):
        for name in node.input:
            counts[name] = counts.get(name, 0) + 1
    for out in graph.output:
        counts[out.name] = counts.get(out.name, 0) + 1
    return counts


def _epsilon(node) -> float:
    return float(_attrs(node).get("epsilon", 1e-5))


def _norm(node, readers: dict, vectors: set) -> list | None:
    """[op, inputs, outputs, epsilon] for a norm node the kernels can take (its gamma one of ``vectors``, the
    graph's 1-D initializers), else None."""
    unread = all(not name or not readers.get(name) for name in node.output[1:3])
    if node.op_type == "SimplifiedLayerNormalization" and node.domain in ("", "ai.onnx") and len(node.input) == 2:
        attrs = _attrs(node)
        if attrs.get("axis", -1) == -1 and attrs.get("stash_type", 1) == 1 and unread and node.input[1] in vectors:
            return [NORM, list(node.input), [node.output[0]], _epsilon(node)]
    if node.op_type == "SkipSimplifiedLayerNormalization" and node.domain == "com.microsoft" \
            and len([n for n in node.input if n]) == 3 and all(node.input[:3]) and unread and node.input[2] in vectors:
        total = node.output[3] if len(node.output) > 3 and node.output[3] else f"{node.output[0]}.unread_sum"
        return [SKIP_NORM, list(node.input[:3]), [node.output[0], total], _epsilon(node)]
    return None


def rewritten_width(node) -> tuple[str, int] | None:
    """(input, output width) of one of rlxrt's MatMuls (``cpu_kernels.rewrite`` made it), else None."""
    if node.domain == DOMAIN and node.op_type in OPS.values():
        return node.input[0], int(_attrs(node)["n"])
    return None


def _swiglu(mul, producers: dict, nodes: list, readers: dict, width) -> tuple | None:
    """(g, u, the positions of the Sigmoid and the first Mul) when ``mul`` ends g * sigmoid(g) * u as the kernels
    take it; ``producers`` maps a value to the position in ``nodes`` of the node that makes it, ``width`` gives
    (input, output width) of a node that is (or will be) one of rlxrt's MatMuls, else None."""

    def made_by(name, op):
        at = producers.get(name)
        ok = at is not None and nodes[at].op_type == op and nodes[at].domain in ("", "ai.onnx") and readers.get(name) == 1
        return at if ok else None

    if mul.op_type != "Mul" or mul.domain not in ("", "ai.onnx") or len(mul.input) != 2:
        return None
    for silu_name, u in (mul.input, mul.input[::-1]):
        silu = made_by(silu_name, "Mul")
        if silu is None or len(nodes[silu].input) != 2:
            continue
        for g, sig_name in (nodes[silu].input, nodes[silu].input[::-1]):
            sig = made_by(sig_name, "Sigmoid")
            if sig is None or list(nodes[sig].input) != [g]:
                continue
            a, b = nodes[producers[g]] if g in producers else None, nodes[producers[u]] if u in producers else None
            if a is not None and b is not None and width(a) is not None and width(a) == width(b):
                return g, u, sig, silu
    return None


def _found(graph) -> tuple[list, dict, dict, set]:
    nodes = list(graph.node)
    producers = {out: i for i, node in enumerate(nodes) for out in node.output if out}
    return nodes, producers, _readers(graph), {t.name for t in graph.initializer if len(t.dims) == 1}


def plan(graph, width) -> tuple[int, int]:
    """(norms, SwiGLUs) ``fuse`` would replace in ``graph`` once its MatMuls are rlxrt's (``width`` as above)."""
    nodes, producers, readers, vectors = _found(graph)
    norms = sum(_norm(n, readers, vectors) is not None for n in nodes)
    return norms, sum(_swiglu(n, producers, nodes, readers, width) is not None for n in nodes)


def fuse(graph, width=rewritten_width) -> tuple[int, int]:
    """Replace what ``plan`` counts in ``graph`` (its MatMuls rewritten), in place; returns the same counts."""
    from onnx import helper

    nodes, producers, readers, vectors = _found(graph)
    made: dict[int, object] = {}
    dropped: set[int] = set()
    norms = swiglus = 0
    for i, node in enumerate(nodes):
        found = _norm(node, readers, vectors)
        if found is not None:
            op, ins, outs, eps = found
            made[i] = helper.make_node(op, ins, outs, name=node.name or None, domain=DOMAIN, epsilon=eps)
            norms += 1
            continue
        glu = _swiglu(node, producers, nodes, readers, width)
        if glu is not None:
            g, u, sig, silu = glu
            dropped.update((sig, silu))
            made[i] = helper.make_node(SWIGLU, [g, u], [node.output[0]], name=node.name or None, domain=DOMAIN)
            swiglus += 1
    kept = [made.get(i, node) for i, node in enumerate(nodes) if i not in dropped]
    del graph.node[:]
    graph.node.extend(kept)
    return norms, swiglus
