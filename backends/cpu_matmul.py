"""rlxrt's own fp32 MatMul for CPU sessions: each weight packed once, streamed once per call for all rows.

A decoder step on CPU is bound by reading its weights. ONNX Runtime's MatMul (MLAS) reads them more slowly
the more rows it multiplies them with: a (k+1)-row verification costs up to 1.5x a one-row step where the
weights come from memory. ``StreamMatMul`` (``stream_matmul.c``, built at install) keeps each weight as
column panels of 32, [ceil(N/32), K, 32], which it reads front to back once per call whatever the number of
rows, and computes every row the same way whatever the others are: a row's output is bitwise the same
alone or in a verification, so a speculative step and a plain step agree to the bit.

``compile()`` rewrites the graph before ONNX Runtime optimises it: every MatMul of the main graph whose
second input is a float32 matrix initializer becomes ``StreamMatMul`` over that weight packed (the original
is dropped when nothing else reads it). The choice is ``Config.cpu_matmul``: ``auto`` rewrites where the
kernel runs a variant measured faster than ONNX Runtime's (``WINS_ON``), ``rlxrt`` always, ``ort`` never. The
state is recorded as a sentence, as huge pages are: ``on: N MatMuls, …`` or ``off: why``.
"""
from __future__ import annotations

import importlib.machinery
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from rlxrt.errors import ProviderError

DOMAIN, OP = "ai.rlxrt", "StreamMatMul"
PANEL = 32
"""Columns per packed panel (two 16-float vectors)."""
KERNEL_VERSION = "1"
"""Goes into the compile cache key: a graph rewritten for another kernel is never served."""
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


@lru_cache(maxsize=1)
def isa() -> str | None:
    """The vector width the kernel runs at in this process (avx512, avx2, generic), None without the library."""
    import ctypes

    path = library()
    if path is None:
        return None
    fn = ctypes.CDLL(os.fspath(path)).rlxrt_stream_matmul_isa
    fn.restype = ctypes.c_char_p
    return fn().decode()


WINS_ON = ("avx512",)
"""Where ``auto`` uses the kernel: the variants measured faster than ONNX Runtime's MatMul on whole decoder
steps (README, "rlxrt's MatMul kernel"). The avx2 and generic variants are exact and tested, but were only
measured on a CPU where ONNX Runtime itself runs AVX-512 (0.85x and 0.64x of it), so ``auto`` leaves them off."""


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
    """Positions, in ``_walk`` order, of the MatMuls and Gemms to replace."""
    weight_bytes: int
    """Bytes of their weights (a weight read by several of them counted once)."""
    state: str
    """``on: ...`` or ``off: why``."""


def _float_matrices(model) -> dict:
    from onnx import TensorProto

    return {t.name: t for t in model.graph.initializer
            if t.data_type == TensorProto.FLOAT and len(t.dims) == 2}


def _walk(graph):
    """Every node of ``graph`` and of its subgraphs (If branches, loop bodies), depth first."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                yield from _walk(sub)


def _weight(node, weights: dict) -> tuple[str, bool] | None:
    """(the weight's name, whether the op reads it transposed) when ``node`` is x @ W or Gemm(x, W) with no
    bias, alpha 1 and x as it is, over a float32 matrix initializer of the main graph; else None."""
    if node.domain not in ("", "ai.onnx") or len(node.input) < 2 or node.input[1] not in weights:
        return None
    if node.op_type == "MatMul":
        return node.input[1], False
    if node.op_type != "Gemm" or (len(node.input) > 2 and node.input[2]):
        return None
    attrs = {a.name: a for a in node.attribute}
    if attrs.get("transA") and attrs["transA"].i or ("alpha" in attrs and attrs["alpha"].f != 1.0):
        return None
    return node.input[1], bool(attrs.get("transB") and attrs["transB"].i)


def plan(model, mode: str, provider: str) -> Plan:
    """Which MatMuls and Gemms ``mode`` (auto, rlxrt, ort) rewrites in ``model`` (an onnx ModelProto, weights
    loaded or not) for a session whose first provider is ``provider``."""
    if mode == "ort":
        return Plan([], 0, "off: cpu_matmul = ort in config")
    if provider != "cpu":
        return Plan([], 0, f"off: the session runs on {provider}")
    weights = _float_matrices(model)
    found = [(i, _weight(n, weights)) for i, n in enumerate(_walk(model.graph))]
    nodes = [i for i, w in found if w is not None]
    size = sum(int(np.prod(weights[name].dims)) * 4 for name in {w[0] for _, w in found if w is not None})
    if not nodes:
        return Plan([], 0, "off: no float32 MatMul over a weight in the graph")
    if library() is None:
        why = ("off: the kernel library was not built at install (no C compiler?); reinstall rlxrt with gcc or "
               "clang present")
        if mode == "rlxrt":
            raise ProviderError(f"cpu_matmul = rlxrt, but {why[5:]}, or set cpu_matmul = auto")
        return Plan([], 0, why)
    if mode == "auto" and isa() not in WINS_ON:
        return Plan([], size, f"off: the kernel runs {isa()} here, where ONNX Runtime's MatMul was not measured "
                              "slower (cpu_matmul = rlxrt forces it)")
    return Plan(nodes, size, f"on: {len(nodes)} MatMuls, {size / 2**20:.0f} MiB of weights, {isa()}")


def rewrite(model, chosen: Plan) -> None:
    """Replace the planned nodes of ``model`` (the graph ``plan`` read, weights loaded) in place; the packed
    weights are initializers of the main graph, which subgraphs see."""
    from onnx import helper, numpy_helper

    weights = _float_matrices(model)
    everything = list(_walk(model.graph))
    readers: dict[str, int] = {}
    for node in everything:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    packed: dict[tuple[str, bool], str] = {}
    for node in (everything[i] for i in chosen.nodes):
        found = _weight(node, weights)
        assert found is not None, f"node {node.name!r} ({node.op_type}) is not what the plan read"
        source, transposed = found
        if found not in packed:
            w = numpy_helper.to_array(weights[source])
            packed[found] = f"{source}.panels" + (".t" if transposed else "")
            model.graph.initializer.append(numpy_helper.from_array(pack(w.T if transposed else w), packed[found]))
        n = int(weights[source].dims[0 if transposed else 1])
        replacement = helper.make_node(OP, [node.input[0], packed[found]], list(node.output),
                                       name=node.name or None, domain=DOMAIN, n=n)
        node.CopyFrom(replacement)
        readers[source] -= 1
    replaced = {source for source, _ in packed}
    keep = [t for t in model.graph.initializer if t.name not in replaced or readers.get(t.name, 0) > 0]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))


def register(opts) -> None:
    """Let a session with these options load graphs holding StreamMatMul (a no-op without the library)."""
    path = library()
    if path is not None:
        opts.register_custom_ops_library(os.fspath(path))


def _read_external(model, base: Path) -> None:
    """Bring every external tensor of ``model`` into it (onnx's own loader refuses a data file that is a
    symbolic link, which a user's model directory may well hold)."""
    from onnx import TensorProto

    for tensor in model.graph.initializer:
        if tensor.data_location != TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in tensor.external_data}
        with open(base / info["location"], "rb") as fh:
            fh.seek(int(info.get("offset", 0)))
            tensor.raw_data = fh.read(int(info["length"])) if "length" in info else fh.read()
        del tensor.external_data[:]
        tensor.data_location = TensorProto.DEFAULT


def rewritten(graph: Path, chosen: Plan, work: Path) -> Path:
    """``graph`` with the planned MatMuls replaced, written to ``work``/source.onnx (+ .data)."""
    import onnx

    model = onnx.load(os.fspath(graph), load_external_data=False)
    _read_external(model, graph.parent)
    rewrite(model, chosen)
    out = work / "source.onnx"
    onnx.save_model(model, os.fspath(out), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=out.name + ".data", size_threshold=1024)
    return out
