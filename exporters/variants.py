"""Weight variants of an exported graph: fp16 (for GPUs) and dynamic int8 (a cheap CPU draft)."""
from __future__ import annotations

from pathlib import Path

from rlxrt.errors import ExportError


def _save(model, path: Path) -> None:
    import onnx

    big = model.ByteSize() > 1_800_000_000
    onnx.save(model, str(path), save_as_external_data=big, all_tensors_to_one_file=True,
              location=path.name + ".data" if big else None)


def to_fp16(src: Path, dst: Path) -> None:
    """Weights, activations and the KV cache in float16; input ids and masks stay int64."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = onnx.load(str(src))
    try:
        model16 = convert_float_to_float16(model, keep_io_types=False, disable_shape_infer=True)
    except Exception as exc:
        raise ExportError(f"converting {src} to float16 failed: {exc}") from None
    _save(model16, dst)


def to_int8(src: Path, dst: Path) -> None:
    """Dynamic int8 quantisation of the MatMul/Gemm weights (onnxruntime's quantiser)."""
    import logging

    from onnxruntime.quantization import QuantType, quantize_dynamic

    logging.getLogger("root").setLevel(logging.ERROR)  # its "run pre-processing" hint is noise here
    try:
        quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8,
                         use_external_data_format=src.stat().st_size > 1_800_000_000)
    except Exception as exc:
        raise ExportError(f"int8 quantisation of {src} failed: {exc}") from None


def store_weights_fp16(path: Path, min_elements: int = 1024) -> None:
    """Store the large float32 weights of the graph at ``path`` as float16, each behind a Cast to float32.

    Half the file; ORT folds the casts when it loads the graph, so compute stays float32. Lossless only
    for weights already rounded to float16 (``write_head`` rounds the head's before exporting it).
    """
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.load(str(path))
    g = model.graph
    casts, keep = [], []
    for init in g.initializer:
        if init.data_type == TensorProto.FLOAT and int(np.prod(init.dims)) >= min_elements:
            half = numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float16), init.name + "_fp16")
            keep.append(half)
            casts.append(helper.make_node("Cast", [half.name], [init.name], to=TensorProto.FLOAT,
                                          name=init.name + "_to_fp32"))
        else:
            keep.append(init)
    del g.initializer[:]
    g.initializer.extend(keep)
    nodes = casts + list(g.node)
    del g.node[:]
    g.node.extend(nodes)
    _save(model, path)
