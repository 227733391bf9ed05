"""``rlxrt inspect``: what a model file or directory holds, read with onnx alone."""
from __future__ import annotations

import os
from typing import Any

from rlxrt.errors import ModelFormatError
from rlxrt.manifest import MANIFEST_NAME, Manifest


def _shape(t) -> list:
    dims = t.type.tensor_type.shape.dim
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in dims]


def inspect_model(model: str | os.PathLike) -> dict[str, Any]:
    import onnx
    from onnx import helper

    from rlxrt.backends.modelfile import external_files, locate

    graph_path, manifest = locate(model)
    proto, ext = external_files(graph_path)
    inits = {i.name for i in proto.graph.initializer}

    def io(values) -> list[dict[str, Any]]:
        return [{"name": v.name, "dtype": helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).name,
                 "shape": _shape(v)} for v in values if v.name not in inits]

    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
    size = graph_path.stat().st_size + sum(p.stat().st_size for p in ext)
    if manifest is None and (graph_path.parent / MANIFEST_NAME).is_file():
        try:
            manifest = Manifest.load(graph_path.parent)
        except ModelFormatError:
            manifest = None
    return {
        "graph": str(graph_path), "opset": opset, "ir_version": proto.ir_version,
        "producer": f"{proto.producer_name} {proto.producer_version}".strip(),
        "size_bytes": size, "external_data": [str(p) for p in ext], "nodes": len(proto.graph.node),
        "inputs": io(proto.graph.input), "outputs": io(proto.graph.output),
        "manifest": manifest.to_dict() if manifest else None,
        "onnx": onnx.__version__,
    }
