"""A GGUF Q4_1 weight's shift folded into its ``StreamMatMulQx8`` or ``StreamMatMulQ4`` (stream_int8.h,
stream_matmul.c).

A Q4_1 block is ``scale * code + minimum``; the fused exporter writes it as ``MatMulNBits`` over the codes
(against zero 8) plus the rows' block sums times ``shift = minimum + 8 scale``:

    y = Add(MatMulNBits(x, codes, scales), MatMul(ReduceSum(Reshape(x, [.., K/32, 32]), -1), shift [K/32, N]))

Four more nodes a weight (two of them shared by the weights that read the same x), which on a batched step cost
more than the arithmetic they do. Where ``cpu_kernels`` takes the 4-bit MatMulNBits, ``find`` names the pattern
for the plan (whose shift MatMul then stays out of the float MatMuls), and ``fold`` gives the kernel the shift,
packed as the scales are, as its fourth input, and the Add, the MatMul and (once nothing else reads them) the
ReduceSum and the Reshape go. With int8 activations each block adds ``shift[b, n] * xs[r, b]``, xs the sum of
the row's 32 floats; in float32 arithmetic the panel's outputs add ``sum over b of xs[r, b] * shift[b, n]``.
"""
from __future__ import annotations

from .cpu_kernels import DOMAIN, _attrs, pack
from .fuse_rows import _readers


def _producers(graph) -> dict:
    return {out: node for node in graph.node for out in node.output if out}


def _block_sums_of(name: str, producers: dict, inits: dict) -> str | None:
    """x when ``name`` is ReduceSum(Reshape(x, [.., B, 32]), last axis) without keepdims, else None."""
    from onnx import numpy_helper

    red = producers.get(name)
    if red is None or red.op_type != "ReduceSum" or len(red.input) != 2 or _attrs(red).get("keepdims", 1) != 0:
        return None
    axes = inits.get(red.input[1])
    shaped = producers.get(red.input[0])
    if axes is None or list(numpy_helper.to_array(axes).reshape(-1)) != [-1] or shaped is None \
            or shaped.op_type != "Reshape" or len(shaped.input) != 2 or shaped.input[1] not in inits:
        return None
    shape = numpy_helper.to_array(inits[shaped.input[1]]).reshape(-1)
    return shaped.input[0] if len(shape) >= 2 and shape[-1] == 32 else None


def _match(add, producers: dict, readers: dict, inits: dict, is_q4) -> tuple | None:
    """(the MatMulNBits-like node, the shift MatMul, the shift's initializer) when ``add`` ends the pattern."""
    if add.op_type != "Add" or add.domain not in ("", "ai.onnx") or len(add.input) != 2:
        return None
    for y1, y2 in (add.input, add.input[::-1]):
        q, mm = producers.get(y1), producers.get(y2)
        if q is None or mm is None or not is_q4(q) or readers.get(y1) != 1 or readers.get(y2) != 1 \
                or mm.op_type != "MatMul" or mm.domain not in ("", "ai.onnx") or len(mm.input) != 2:
            continue
        shift = inits.get(mm.input[1])
        attrs = _attrs(q)  # MatMulNBits (K, N), or the kernel that replaced it (n; its K is in its packing)
        k, n = int(attrs.get("K", -1)), int(attrs.get("N", attrs.get("n", -1)))
        if shift is None or shift.data_type != 1 or len(shift.dims) != 2 or int(shift.dims[1]) != n \
                or (k >= 0 and (k % 32 or int(shift.dims[0]) != k // 32)):
            continue
        if _block_sums_of(mm.input[0], producers, inits) == q.input[0]:
            return q, mm, shift
    return None


def find(graph, is_q4) -> dict[str, tuple[str, str]]:
    """For each main-graph pattern whose quantised MatMul ``is_q4`` says the kernel takes: that node's output
    -> (its shift MatMul's output, the Add's output, which the folded node will make)."""
    producers, readers = _producers(graph), _readers(graph)
    inits = {t.name: t for t in graph.initializer}
    found = {}
    for node in graph.node:
        m = _match(node, producers, readers, inits, is_q4)
        if m is not None:
            found[m[0].output[0]] = (m[1].output[0], node.output[0])
    return found


def fold(graph) -> int:
    """Fold every pattern over a 4-bit ``StreamMatMulQx8`` or a ``StreamMatMulQ4`` in ``graph`` (weights loaded);
    how many."""
    from onnx import numpy_helper

    from .cpu_kernels import _walk

    producers, readers = _producers(graph), _readers(graph)
    inits = {t.name: t for t in graph.initializer}

    def is_q4(node):
        return node.domain == DOMAIN and len(node.input) == 3 and (
            node.op_type == "StreamMatMulQ4" or (node.op_type == "StreamMatMulQx8" and _attrs(node).get("bits") == 4))

    removed: list = []  # the nodes that go
    for add in list(graph.node):
        m = _match(add, producers, readers, inits, is_q4)
        if m is None:
            continue
        q, mm, shift = m
        name = f"{shift.name}.panels"
        graph.initializer.append(numpy_helper.from_array(pack(numpy_helper.to_array(shift)), name))  # as scales
        q.input.append(name)
        q.output[0], add.output[0] = add.output[0], f"{add.output[0]}#folded"
        removed += [add, mm]
        for value in mm.input:
            readers[value] -= 1
    gone = {n.output[0] for n in removed}
    while True:  # the block sums and reshapes that fed only what went
        fed = {value for n in removed for value in n.input}
        dead = [n for n in graph.node if n.op_type in ("ReduceSum", "Reshape") and n.output[0] not in gone
                and n.output[0] in fed and all(not readers.get(o) for o in n.output)]
        if not dead:
            break
        for n in dead:
            removed.append(n)
            gone.add(n.output[0])
            for value in n.input:
                readers[value] -= 1
    candidates = {value for n in removed for value in n.input if value in inits}
    keep = [n for n in graph.node if n.output[0] not in gone]
    del graph.node[:]
    graph.node.extend(keep)
    used = {value for n in _walk(graph) for value in n.input} | {o.name for o in graph.output}
    for t in [t for t in graph.initializer if t.name in candidates and t.name not in used]:
        graph.initializer.remove(t)
    return sum(n.op_type == "Add" for n in removed)
