"""rlxrt's own CPU kernels for MatMuls and attention: each weight packed once and streamed once per call for
all rows, and every row computed the same whatever the other rows of the call.

A decoder step on CPU is bound by reading its weights. ONNX Runtime's MatMul (MLAS) reads them more slowly
the more rows it multiplies them with (docs/kernels.md has the figures); and its MatMuls and GroupQueryAttention take other paths for several rows, so a
verification's rows differ from one-row steps by ~1e-6 (by up to 0.5 with int8 activations). The library
(``stream_matmul.c`` with the headers it includes; built at install)
holds ``StreamMatMul`` (float32 panels [ceil(N/32), K, 32]), ``StreamMatMulQ4`` (int4 blocks, float32
arithmetic), ``StreamMatMulQx8`` (4- or 8-bit blocks with int8 activations), ``StreamAttention`` and the
row-wise ops ``fuse_rows`` puts between them.

``compile()`` rewrites the graph before ONNX Runtime optimises it: every MatMul and bias-free Gemm over a
float32 matrix initializer, every MatMulNBits it can take and every GroupQueryAttention of rlxrt's fused form
becomes rlxrt's op over the weights packed (the originals dropped when nothing else reads them). The choice is
``Config.cpu_kernels``: ``auto`` rewrites where the variant that runs was measured faster than ONNX Runtime's
(``WINS_ON``, ``INT8_WINS_ON``), ``rlxrt`` always, ``ort`` never. The state is recorded as a sentence, as huge
pages are (``on: N MatMuls, …`` or ``off: why``), and ``Plan.rows_exact`` says whether every row of a call is
computed alike.
"""
from __future__ import annotations

import importlib.machinery
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import numpy as np

from rlxrt.errors import ProviderError

DOMAIN = "ai.rlxrt"
OPS = {"float": "StreamMatMul", "float_t": "StreamMatMul", "int4": "StreamMatMulQ4", "int4x8": "StreamMatMulQx8",
       "int8x8": "StreamMatMulQx8"}
"""The op each kind of weight becomes."""
ATTENTION = "StreamAttention"
"""What GroupQueryAttention becomes (stream_attention.h): a query row computed the same whatever the others."""
PANEL = 32
"""Columns per packed panel (two 16-float vectors)."""
KERNEL_VERSION = "5"
"""Goes into the compile cache key with the plan: a graph rewritten for other packed layouts is never served."""
LIBRARY_STEM = "_stream_matmul"


@lru_cache(maxsize=1)
def library() -> Path | None:
    """The kernel library built at install time next to this file, or None (no C compiler at install)."""
    here = Path(__file__).resolve().parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = here / f"{LIBRARY_STEM}{suffix}"
        if candidate.is_file():
            return candidate
    return None


def _ask(function: str) -> str | None:
    import ctypes

    path = library()
    if path is None:
        return None
    fn = getattr(ctypes.CDLL(os.fspath(path)), function)
    fn.restype = ctypes.c_char_p
    return fn().decode()


@lru_cache(maxsize=1)
def isa() -> str | None:
    """The vector width the float kernels run at in this process (avx512, avx2, generic); None without the
    library."""
    return _ask("rlxrt_stream_matmul_isa")


@lru_cache(maxsize=1)
def int8_isa() -> str | None:
    """How the int8-activation kernel runs in this process (avx512vnni, generic); None without the library."""
    return _ask("rlxrt_stream_matmul_int8_isa")


WINS_ON = ("avx512",)
"""Where ``auto`` uses the kernel: the variants measured faster than ONNX Runtime's MatMul on whole decoder
steps (docs/kernels.md). The avx2 and generic variants are exact and tested, but were only measured on a CPU
where ONNX Runtime itself runs AVX-512, where they were slower, so ``auto`` leaves them off."""
INT8_WINS_ON = ("avx512vnni",)
"""The same for the int8-activation kernel (MatMulNBits at accuracy level 4)."""


def pack(w: np.ndarray) -> np.ndarray:
    """``w`` [K, N] as column panels [ceil(N/32), K, 32], the last padded with zeros."""
    k, n = w.shape
    panels = -(-n // PANEL)
    padded = np.zeros((k, panels * PANEL), np.float32)
    padded[:, :n] = w
    return np.ascontiguousarray(padded.reshape(k, panels, PANEL).transpose(1, 0, 2))


@dataclass
class Plan:
    """What the rewrite will do to one graph."""

    nodes: list[int]
    """Positions, in ``_walk`` order, of the nodes to replace (MatMul-like nodes and attention)."""
    weight_bytes: int
    """Bytes of their weights (a weight read by several of them counted once)."""
    state: str
    """``on: ...`` or ``off: why``."""
    rows_exact: bool = False
    """Every MatMul-like node and every attention of the graph runs rlxrt's kernels, so that (the other ops of a
    fused graph being row by row) a row's output is bitwise the same alone or in a verification."""
    batched: dict | None = None
    """The manifest's input names when the rewrite also makes the batched variant (``batched.batch``)."""
    batched_head: tuple[int, int, int] | None = None
    """An MTP head's (heads, head size, positions) when the rewrite also makes its batched variant
    (``head_batch.batch_head``, before the planned nodes are replaced)."""


class Source(NamedTuple):
    """The weight a node multiplies by, as the kernel will read it."""

    kind: str
    """``float`` (x @ W), ``float_t`` (x @ W^T, a Gemm with transB), ``int4`` (MatMulNBits' codes and scales,
    float32 arithmetic) or ``int4x8`` / ``int8x8`` (4- or 8-bit codes with int8 activations, accuracy level 4)."""
    names: tuple[str, ...]
    """The initializers: (W,) or (codes, scales)."""
    n: int
    """Output columns."""


def _walk(graph):
    """Every node of ``graph`` and of its subgraphs (If branches, loop bodies), depth first."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                yield from _walk(sub)


def _initializers(model) -> dict:
    return {t.name: t for t in model.graph.initializer}


def _attrs(node) -> dict:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _source(node, inits: dict) -> Source | None:
    """What ``node`` multiplies by when the kernel can take it, else None: x @ W or Gemm(x, W) without bias,
    alpha 1 or x transposed, over a float32 matrix initializer of the main graph; or MatMulNBits over int4
    blocks of 32 without zero points: 4-bit at accuracy level 0 (float32 arithmetic on the dequantised weight),
    4- or 8-bit at level 4 (int8 activations); a K that is not a multiple of 32 is read zero-padded to whole
    blocks (stream_matmul.c)."""
    from onnx import TensorProto

    def matrix(name, dtype=TensorProto.FLOAT, rank=2):
        t = inits.get(name)
        return t if t is not None and t.data_type == dtype and len(t.dims) == rank else None

    if len(node.input) < 2:
        return None
    attrs = _attrs(node)
    if node.domain in ("", "ai.onnx") and matrix(node.input[1]) is not None:
        w = matrix(node.input[1])
        if node.op_type == "MatMul":
            return Source("float", (w.name,), int(w.dims[1]))
        if node.op_type == "Gemm" and not (len(node.input) > 2 and node.input[2]) and not attrs.get("transA") \
                and attrs.get("alpha", 1.0) == 1.0:
            transposed = bool(attrs.get("transB"))
            return Source("float_t" if transposed else "float", (w.name,), int(w.dims[0 if transposed else 1]))
        return None
    if node.domain != "com.microsoft" or node.op_type != "MatMulNBits" or len(node.input) < 3 or any(node.input[3:]):
        return None
    k, n, bits, level = int(attrs.get("K", 0)), int(attrs.get("N", 0)), attrs.get("bits", 4), attrs.get("accuracy_level", 0)
    kind = {(4, 0): "int4", (4, 4): "int4x8", (8, 4): "int8x8"}.get((bits, level))
    blocks = -(-k // 32)  # a K that is not a multiple of 32 ends in a block padded with weight-0 codes
    if kind is None or attrs.get("block_size") != 32 or k <= 0:
        return None
    codes, scales = matrix(node.input[1], TensorProto.UINT8, 3), inits.get(node.input[2])
    if codes is None or list(codes.dims) != [n, blocks, 4 * bits] or scales is None \
            or scales.data_type != TensorProto.FLOAT or int(np.prod(scales.dims)) != n * blocks:
        return None
    return Source(kind, (codes.name, scales.name), n)


def pack_int4(codes: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """MatMulNBits' int4 blocks (codes [N, K/32, 16], two a byte along K, low nibble first; scales [N * K/32])
    as StreamMatMulQ4's panels: codes [P, K, 16] (byte j: column j low, column j + 16 high) and scales
    [P, K/32, 32]; padding columns get code 8 and scale 0 (weight 0)."""
    n, blocks, _ = codes.shape
    panels = -(-n // PANEL)
    flat = np.full((panels * PANEL, blocks * 32), 8, np.uint8)
    flat[:n] = unpack_codes(codes, 4)
    per_panel = flat.reshape(panels, PANEL, blocks * 32).transpose(0, 2, 1)  # [P, K, 32]
    packed = np.ascontiguousarray(per_panel[..., :16] | (per_panel[..., 16:] << 4))
    s = np.zeros((panels * PANEL, blocks), np.float32)
    s[:n] = scales.reshape(n, blocks)
    return packed, np.ascontiguousarray(s.reshape(panels, PANEL, blocks).transpose(0, 2, 1))


def _attention(node, inits: dict) -> dict | None:
    """StreamAttention's attributes for a GroupQueryAttention node it can take, else None: the form rlxrt's
    fused float32 graphs write (rotary inside, rotate-half, no softcap, no extra inputs, float32 cos/sin
    caches, a head size that is a multiple of 16 up to 256)."""
    from onnx import TensorProto

    if node.op_type != "GroupQueryAttention" or node.domain != "com.microsoft" or len(node.input) < 9 \
            or any(node.input[9:]):
        return None
    attrs = _attrs(node)
    cos = inits.get(node.input[7])
    if (attrs.get("do_rotary"), attrs.get("rotary_interleaved", 0), attrs.get("softcap", 0.0),
            attrs.get("smooth_softmax", 0)) != (1, 0, 0.0, 0) or cos is None or cos.data_type != TensorProto.FLOAT \
            or len(cos.dims) != 2:
        return None
    d = 2 * int(cos.dims[1])
    if d % 16 or d > 256:
        return None
    return {"num_heads": int(attrs["num_heads"]), "kv_num_heads": int(attrs["kv_num_heads"]),
            "scale": float(attrs.get("scale") or 1.0 / d ** 0.5), "local_window_size": int(attrs.get("local_window_size", -1))}


def keys_in_order(keys: np.ndarray) -> np.ndarray:
    """A key buffer [..., capacity, head_dim] as StreamAttention keeps it (blocks of 16 positions, each
    dimension by dimension: stream_attention.h) as the keys in position order, the layout ONNX Runtime's
    GroupQueryAttention keeps; ``keys_in_blocks`` is the other way."""
    return _reblock(keys, to_order=True)


def keys_in_blocks(keys: np.ndarray) -> np.ndarray:
    """Keys in position order [..., capacity, head_dim] as StreamAttention keeps them."""
    return _reblock(keys, to_order=False)


def _reblock(keys: np.ndarray, to_order: bool) -> np.ndarray:
    *lead, cap, d = keys.shape
    flat_in, out = keys.reshape(*lead, cap * d), np.empty_like(keys)
    flat_out = out.reshape(*lead, cap * d)
    for j0 in range(0, cap, 16):
        w = min(16, cap - j0)
        if to_order:
            out[..., j0:j0 + w, :] = np.swapaxes(flat_in[..., j0 * d:(j0 + w) * d].reshape(*lead, d, w), -1, -2)
        else:
            flat_out[..., j0 * d:(j0 + w) * d] = np.swapaxes(keys[..., j0:j0 + w, :], -1, -2).reshape(*lead, w * d)
    return out


def unpack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """MatMulNBits' codes [N, K/32, 4 * bits] as one code a byte, [N, K]."""
    n = codes.shape[0]
    if bits == 8:
        return codes.reshape(n, -1)
    out = np.empty((n, codes.shape[1], 32), np.uint8)
    out[..., 0::2], out[..., 1::2] = codes & 15, codes >> 4
    return out.reshape(n, -1)


def pack_qx8(codes: np.ndarray, scales: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """MatMulNBits' 4- or 8-bit blocks as StreamMatMulQx8's panels (stream_int8.h): codes [P, K/4, 2, 64]
    (8-bit) or [P, K/4, 2, 32] (4-bit, code t low and t + 32 high in byte t) where code t of a group of 16
    columns is row 4 * quad + t % 4 of column t // 4; scales [P, K/32, 32]. Padding columns get the zero
    code and scale 0."""
    n, blocks = codes.shape[0], codes.shape[1]
    k, panels = blocks * 32, -(-n // PANEL)
    flat = np.full((panels * PANEL, k), 1 << (bits - 1), np.uint8)
    flat[:n] = unpack_codes(codes, bits)
    t = flat.reshape(panels, 2, 16, k // 4, 4).transpose(0, 3, 1, 2, 4).reshape(panels, k // 4, 2, 64)
    packed = t if bits == 8 else t[..., :32] | (t[..., 32:] << 4)
    s = np.zeros((panels * PANEL, blocks), np.float32)
    s[:n] = scales.reshape(n, blocks)
    return np.ascontiguousarray(packed), np.ascontiguousarray(s.reshape(panels, PANEL, blocks).transpose(0, 2, 1))


def plan(model, mode: str, provider: str) -> Plan:
    """Which MatMuls, Gemms and MatMulNBits ``mode`` (auto, rlxrt, ort) rewrites in ``model`` (an onnx
    ModelProto, weights loaded or not) for a session whose first provider is ``provider``."""
    from onnx import TensorProto

    from . import fuse_rows, shifts

    if mode == "ort":
        return Plan([], 0, "off: cpu_kernels = ort in config")
    if provider != "cpu":
        return Plan([], 0, f"off: the session runs on {provider}")
    inits = _initializers(model)
    walked = list(_walk(model.graph))
    found = {i: w for i, w in ((i, _source(n, inits)) for i, n in enumerate(walked)) if w is not None}
    attention = [i for i, n in enumerate(walked) if _attention(n, inits) is not None]
    if not found and not attention:
        return Plan([], 0, "off: no float32 MatMul over a weight in the graph")
    if library() is None:
        why = ("off: the kernel library was not built at install (no C compiler?); reinstall rlxrt with gcc or "
               "clang present")
        if mode == "rlxrt":
            raise ProviderError(f"cpu_kernels = rlxrt, but {why[5:]}, or set cpu_kernels = auto")
        return Plan([], 0, why)
    if mode == "auto":  # only where the variant that would run was measured to win
        wins = {False: isa() in WINS_ON, True: int8_isa() in INT8_WINS_ON}
        found = {i: w for i, w in found.items() if wins[w.kind.endswith("x8")]}
        attention = attention if wins[False] else []
    int4_outputs = {walked[i].output[0] for i, w in found.items() if w.kind in ("int4", "int4x8") and walked[i].output}
    shifted = shifts.find(model.graph, lambda node: bool(node.output) and node.output[0] in int4_outputs)
    folded = {mm for mm, _ in shifted.values()}  # the shift MatMuls: folded into their kernel, not rewritten
    found = {i: w for i, w in found.items() if not (walked[i].output and walked[i].output[0] in folded)}
    read = {name for w in found.values() for name in w.names}
    size = sum(int(np.prod(inits[name].dims)) * (1 if inits[name].data_type == TensorProto.UINT8 else 4)
               for name in read)
    if not found and not attention:
        return Plan([], size, f"off: the kernel runs {isa()} here, where ONNX Runtime's MatMul was not measured "
                              "slower (cpu_kernels = rlxrt forces it)")
    kinds = [w.kind for w in found.values()]
    q4, x8 = kinds.count("int4"), kinds.count("int4x8") + kinds.count("int8x8")
    parts = [f"{q4} int4"] * bool(q4) + [f"{x8} with int8 activations"] * bool(x8) + \
        [f"{len(shifted)} with a Q4_1 shift"] * bool(shifted)
    isas = isa() + (f", {int8_isa()}" if x8 else "")
    matmuls = [i for i, n in enumerate(walked) if n.op_type in ("MatMul", "Gemm", "MatMulNBits", "MatMulInteger",
                                                                  "FusedMatMul", "GroupQueryAttention", "Attention")]
    exact = all(i in found or i in attention or walked[i].output[0] in folded for i in matmuls)
    kinds_said = f" ({', '.join(parts)})" if parts else ""
    att_said = f", {len(attention)} attention" if attention else ""
    widths = {shifted.get(walked[i].output[0], (None, walked[i].output[0]))[1]: (walked[i].input[0], w.n)
              for i, w in found.items() if walked[i].output}  # a folded node makes its Add's output
    norms, swiglus = fuse_rows.plan(model.graph, lambda node: widths.get(node.output[0]) if node.output else None)
    rows_said = f", {norms} norms and {swiglus} SwiGLUs" if norms or swiglus else ""
    return Plan(sorted([*found, *attention]), size, f"on: {len(found)} MatMuls{kinds_said}{att_said}{rows_said}, "
                                                    f"{size / 2**20:.0f} MiB of weights, {isas}", exact)


def rewrite(model, chosen: Plan) -> None:
    """Replace the planned nodes of ``model`` (the graph ``plan`` read, weights loaded) in place; the packed
    weights are initializers of the main graph, which subgraphs see; then the row-wise ops between them
    (``fuse_rows``)."""
    from onnx import helper, numpy_helper

    from . import fuse_rows, shifts

    inits = _initializers(model)
    everything = list(_walk(model.graph))
    readers: dict[str, int] = {}
    for node in everything:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    packed: dict[Source, list[str]] = {}
    for node in (everything[i] for i in chosen.nodes):
        attention = _attention(node, inits)
        if attention is not None:
            node.CopyFrom(helper.make_node(ATTENTION, list(node.input[:9]), list(node.output), name=node.name or None,
                                           domain=DOMAIN, **attention))
            continue
        source = _source(node, inits)
        assert source is not None, f"node {node.name!r} ({node.op_type}) is not what the plan read"
        if source not in packed:
            arrays = [numpy_helper.to_array(inits[name]) for name in source.names]
            if source.kind == "int4":
                made = dict(zip(("codes", "scales"), pack_int4(*arrays)))
            elif source.kind.endswith("x8"):
                made = dict(zip(("codes_x8", "scales_x8"), pack_qx8(*arrays, 4 if source.kind == "int4x8" else 8)))
            else:
                made = {"panels" + ("_t" if source.kind == "float_t" else ""):
                        pack(arrays[0].T if source.kind == "float_t" else arrays[0])}
            packed[source] = [f"{source.names[0]}.{suffix}" for suffix in made]
            model.graph.initializer.extend(numpy_helper.from_array(a, name)
                                           for a, name in zip(made.values(), packed[source]))
        bits = {"bits": 4 if source.kind == "int4x8" else 8} if source.kind.endswith("x8") else {}
        node.CopyFrom(helper.make_node(OPS[source.kind], [node.input[0], *packed[source]], list(node.output),
                                       name=node.name or None, domain=DOMAIN, n=source.n, **bits))
        for name in source.names:
            readers[name] -= 1
    replaced = {name for source in packed for name in source.names}
    keep = [t for t in model.graph.initializer if t.name not in replaced or readers.get(t.name, 0) > 0]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)
    if chosen.nodes:
        shifts.fold(model.graph)
        fuse_rows.fuse(model.graph)
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))


def register(opts) -> None:
    """Let a session with these options load graphs holding rlxrt's ops (a no-op without the library)."""
    path = library()
    if path is not None:
        opts.register_custom_ops_library(os.fspath(path))


def _read_external(model, graph: Path) -> None:
    """Bring every external tensor of ``model`` (the graph file ``graph``) into it, each location checked as
    ONNX Runtime checks it (``modelfile.external_location``: inside the model directory, within the file).
    onnx's own loader would refuse a data file that is a symbolic link inside the directory, which a user's
    model directory may well hold."""
    from onnx import TensorProto

    from .modelfile import external_location

    for tensor in model.graph.initializer:
        if tensor.data_location != TensorProto.EXTERNAL:
            continue
        path = external_location(graph, tensor)
        info = {e.key: e.value for e in tensor.external_data}
        with open(path, "rb") as fh:
            fh.seek(int(info.get("offset", 0)))
            tensor.raw_data = fh.read(int(info["length"])) if "length" in info else fh.read()
        del tensor.external_data[:]
        tensor.data_location = TensorProto.DEFAULT


def rewritten(graph: Path, chosen: Plan, work: Path) -> Path:
    """``graph`` with the planned MatMuls replaced, written to ``work``/source.onnx (+ .data)."""
    import onnx

    model = onnx.load(os.fspath(graph), format="protobuf", load_external_data=False)
    _read_external(model, graph)
    if chosen.batched_head is not None:
        from .head_batch import batch_head

        batch_head(model, *chosen.batched_head)
    if chosen.batched is not None:
        from .batched import batch, prepare

        prepare(model, chosen.batched)
    rewrite(model, chosen)
    if chosen.batched is not None:
        batch(model, chosen.batched)
    out = work / "source.onnx"
    onnx.save_model(model, os.fspath(out), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=out.name + ".data", size_threshold=1024)
    return out
